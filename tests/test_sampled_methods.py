"""Sampled speculative decoding keeps the target's output distribution with every drafting method that had no
distribution test of its own: ngram, suffix, eagle, eagle3, mtp, medusa, layer_skip and quantized_self, as
chains and, for the methods that draft them, as static trees (a full tree and a choice list).

Each case decodes the same prompt for N seeded requests with the method and, with other seeds, without
speculation, and compares every output token but the first (token 0 comes from the prefill, the others from
speculative steps) and every pair of consecutive ones with a two-sample chi-square test (`significance`).
max_tokens is 4, so the first step verifies a draft 2 deep and may emit a bonus token after it, or 6 for the
methods that draft trees under a chain's budget of k nodes (n-gram branches, suffix trees), so that their
first tree has 4 nodes.

The target. A random tiny model spreads its top-k over tokens that random draft heads almost never propose
(an EAGLE head drafting for one had 6 of 6000 draft tokens accepted): a test on it checks little more than
that rejected drafts cost nothing. Giving it a context-free preference for a few tokens fixes that, but not
the other weakness: its next-token distribution hardly depends on the context, so a verification that read
the target's p after the wrong node still passed every case. So the target here is given a preference for
four tokens, LIKELY, and within them for a successor (40 -> 41 -> 42 -> 43 -> 40), carried by five hidden
dimensions that no layer writes to (their rows of o_proj and down_proj are zero), so they reach the final
norm as the embedding put them there: PRIOR_DIM, PRIOR_LEVEL in every embedding, which the LM head reads for
LIKELY (PRIOR_LOGIT), and SUCCESSOR_DIMS[i], SUCCESSOR_LEVEL in the embedding of LIKELY[i] only, which the LM
head reads for its successor (SUCCESSOR_LOGIT). After a LIKELY token the target's top-8 puts about 0.86 on
LIKELY and 0.4-0.5 on the successor; all other weights stay random. Each head carries the same dimensions to
the target's LM head (EAGLE-3: to a copy of its rows), shifted to the token it predicts, so heads with
otherwise random weights draft the target's likely tokens: 18-87% of a chain's draft tokens are accepted,
10-27% of a tree's nodes. The prompt cycles through LIKELY so that n-gram and suffix matching draft from the
first step on. A verification that reads p after the wrong node now fails every case (chi-square 120-440 on
13-23 dof for tokens 1 and 2).
"""
from __future__ import annotations

import pytest
import torch
from conftest import every_step, save_tiny_model
from safetensors.torch import load_file, save_file
from test_eagle import random_head as eagle_head
from test_eagle3 import random_head as eagle3_head
from test_medusa import random_heads as medusa_heads
from test_speculative import MIN_P_VALUE, significance

from specdec import LLM, SamplingParams

N = 1500  # requests per run
LIKELY = [40, 41, 42, 43]
PROMPT = LIKELY * 2
PRIOR_DIM, PRIOR_LEVEL, PRIOR_LOGIT = 0, 0.5, 2.5
SUCCESSOR_DIMS, SUCCESSOR_LEVEL, SUCCESSOR_LOGIT = [1, 2, 3, 4], 0.5, 1.2
CARRIED = [PRIOR_DIM, *SUCCESSOR_DIMS]
PLAIN_SEEDS = 10**6  # plain requests take seeds PLAIN_SEEDS + i, speculative ones i: independent samples

TOP_K = dict(temperature=1.0, top_k=8)
TOP_P = dict(temperature=0.7, top_p=0.9)
# Penalties and a bias change the target's distribution at every position by the tokens before it on its own path:
# the repetition penalty lowers LIKELY (all in the prompt), the frequency and presence penalties what the output
# repeats, so token 2's distribution depends on token 1 (a verification that ignored a draft's path fails).
PENALIZED = dict(temperature=1.0, top_k=8, presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3,
                 logit_bias={LIKELY[1]: 1.0})
CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]  # a static tree as a choice list, 2 deep (Medusa has 2 heads)


def successor(i: int, steps: int = 1) -> int:
    """The index in LIKELY (and SUCCESSOR_DIMS) `steps` successors after index i."""
    return (i + steps) % len(LIKELY)


def prior_target(path, seed: int = 0, layers: int = 4):
    """A tiny random Llama (4 layers: layer_skip drafts with 2; matrix widths multiples of 32: quantized_self's
    q4_0 blocks) with the preferences described in the module docstring (another seed: a draft model with other
    random weights and the same preferences)."""
    save_tiny_model(path, "llama", seed=seed, num_hidden_layers=layers, intermediate_size=128)
    weights = load_file(path / "model.safetensors")
    embed, lm_head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed[:, CARRIED] = 0
    embed[:, PRIOR_DIM] = PRIOR_LEVEL
    lm_head[:, CARRIED] = 0
    lm_head[LIKELY, PRIOR_DIM] = PRIOR_LOGIT
    for i, token in enumerate(LIKELY):
        embed[token, SUCCESSOR_DIMS[i]] = SUCCESSOR_LEVEL
        lm_head[LIKELY[successor(i)], SUCCESSOR_DIMS[i]] = SUCCESSOR_LOGIT
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[CARRIED] = 0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def carry(matrix: torch.Tensor, scale: float, steps: int = 0) -> None:
    """Make rows CARRIED of a head's [out, in] matrix copy the carried dimensions of its input (the first H
    columns), each successor dimension moved `steps` successors on (what the head predicts lies that many
    tokens after the one whose dimensions it reads)."""
    matrix[CARRIED] = 0
    matrix[PRIOR_DIM, PRIOR_DIM] = scale
    for i, dim in enumerate(SUCCESSOR_DIMS):
        matrix[SUCCESSOR_DIMS[successor(i, steps)], dim] = scale


def keep_carried(layers) -> None:
    """A head's own decoder layers leave the carried dimensions of its residual stream alone, as the target's."""
    for layer in layers:
        layer.o_proj.weight.data[CARRIED] = 0
        layer.down_proj.weight.data[CARRIED] = 0


def save_heads(target, root) -> dict[str, str]:
    """Random eagle, mtp, eagle3 and medusa heads for `target` that carry the preferences to the LM head."""
    dirs = {}
    for seed, layout in enumerate(("eagle", "mtp")):
        head = eagle_head(target, layout, layers=1, seed=seed)
        carry(head.fc.weight.data, 1.0)  # the embedding of the token after the feature's: predicts its successor
        head.enorm.weight.data[CARRIED] = 1.0
        head.norm.weight.data[CARRIED] = 2.0
        keep_carried(head.layers)
        dirs[layout] = root / layout
        head.save(dirs[layout])
    head = eagle3_head(target.config, draft_vocab=100)
    vocab = torch.tensor(sorted(LIKELY + list(range(100, 196))))  # the draft vocabulary: LIKELY and 96 others
    head.d2t.copy_(vocab - torch.arange(100))
    head.lm_head.data.copy_(target.lm_head[vocab].float())  # as Eagle3Head.create starts a head
    carry(head.fc.weight.data, 10.0, steps=1)  # reads the low-layer feature of the token before: one step on
    head.norm.weight.data[CARRIED] = 2.0
    keep_carried([head.midlayer])
    dirs["eagle3"] = root / "eagle3"
    head.save(dirs["eagle3"])
    medusa = medusa_heads(target.lm_head, K=2)
    for k, blocks in enumerate(medusa.medusa_head):  # head k reads token n - 2 and predicts token n + k
        for block in blocks[:medusa.num_layers]:  # x + SiLU(Wx + b): adds the dimensions k + 1 successors on
            carry(block.linear.weight.data, 2.0, steps=k + 1)
            block.linear.weight.data[PRIOR_DIM] = 0
            block.linear.bias.data[CARRIED] = 0
    dirs["medusa"] = root / "medusa"
    medusa.save(dirs["medusa"])
    return {method: str(path) for method, path in dirs.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled_methods")
    plain = LLM(str(prior_target(root / "target")), max_num_seqs=256, speculative_config="off")
    return plain, save_heads(plain.engine.model, root)


@pytest.fixture(scope="module")
def plain_tokens(models):
    """Tokens 1-5 of N plain requests per sampling setting, computed once for all cases (a case with fewer
    tokens compares a prefix: without speculation, the first tokens do not depend on max_tokens)."""
    plain, _ = models
    cache = {}

    def tokens(sampling: dict) -> torch.Tensor:
        key = repr(sorted(sampling.items()))
        if key not in cache:
            outs = plain.generate([{"prompt_token_ids": PROMPT}] * N, params(sampling, 6, PLAIN_SEEDS))
            cache[key] = torch.tensor([o.token_ids[1:] for o in outs])
        return cache[key]

    return tokens


def params(sampling: dict, max_tokens: int, first_seed: int = 0) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=first_seed + i, **sampling)
            for i in range(N)]


CASES = [  # (method, its keys, sampling, max_tokens)
    ("ngram", {"prompt_lookup_min": 1, "ngram_draft_length": "fixed"}, TOP_K, 4),  # k tokens after any match
    ("ngram", {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "ngram_draft_length": "fixed",
               "ngram_branches": 2}, TOP_K, 6),
    ("suffix", {"num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 4.0,
                "suffix_decoding_min_token_prob": 0.0}, TOP_K, 6),
    ("eagle", {}, TOP_K, 4),
    ("eagle", {"tree": "D2-BF2"}, TOP_K, 4),
    ("eagle3", {}, TOP_K, 4),
    ("eagle3", {"num_speculative_tokens": 3, "min_prob": 0.3}, TOP_K, 4),  # a chain cut by the head's probability
    ("eagle3", {"tree": CHOICES}, TOP_K, 4),
    ("eagle3", {"tree": {"topk": 2, "num_steps": 3, "num_draft_tokens": 5}}, TOP_K, 4),  # EAGLE-2 dynamic tree
    ("mtp", {}, TOP_K, 4),
    ("mtp", {"tree": "D2-BF2"}, TOP_K, 4),
    ("medusa", {}, TOP_K, 4),
    ("medusa", {"tree": CHOICES}, TOP_K, 4),
    ("layer_skip", {}, TOP_K, 4),  # a chain sampled from the draft's own q
    ("layer_skip", {"tree": "D2-BF2"}, TOP_K, 4),
    ("quantized_self", {}, TOP_K, 4),
    ("quantized_self", {"tree": CHOICES}, TOP_K, 4),
    ("layer_skip", {}, TOP_P, 4),  # q and p both under top-p
    ("eagle3", {"tree": "D2-BF2"}, TOP_P, 4),
    ("ngram", {"prompt_lookup_min": 1, "ngram_draft_length": "fixed"}, PENALIZED, 4),
    ("eagle3", {"tree": "D2-BF2"}, PENALIZED, 4),
    # multi-round rejection sampling, where a config asks for it instead of keyed verification (the default)
    ("layer_skip", {"sampled_verification": "rejection"}, TOP_K, 4),  # q sampled by the draft
    ("eagle3", {"tree": "D2-BF2", "sampled_verification": "rejection"}, TOP_P, 4),
    ("ngram", {"prompt_lookup_min": 1, "ngram_draft_length": "fixed", "sampled_verification": "rejection"},
     PENALIZED, 4),
]


def count_tree_drafts(llm: LLM) -> list[int]:
    """A list that counts, as `llm` decodes, the drafts that are trees (a node whose parent is not the node
    before it), so that a tree case cannot pass on chains alone."""
    drafter, counter = llm.engine.speculator.drafter, [0]
    propose = drafter.propose

    def counting(requests):
        draft = propose(requests)
        for row, n in zip(draft.parents, draft.num_nodes()):
            counter[0] += row[:n].tolist() != list(range(-1, n - 1))
        return draft

    drafter.propose = counting
    return counter


def shape(method: str, options: dict) -> str:
    """What a case drafts: "chain", or a tree ("D2-BF2", "choices", n-gram "branches", suffix's own "tree")."""
    if "tree" in options:
        return "choices" if isinstance(options["tree"], list) else options["tree"]
    return "branches" if "ngram_branches" in options else "tree" if method == "suffix" else "chain"


def case_id(method: str, options: dict, sampling: dict, max_tokens: int) -> str:
    kind = "top_k" if sampling is TOP_K else "top_p" if sampling is TOP_P else "penalized"
    return f"{method}-{shape(method, options)}-{kind}" + ("-rejection" if "sampled_verification" in options else "")


@pytest.mark.parametrize("method, options, sampling, max_tokens", [pytest.param(*c, id=case_id(*c)) for c in CASES])
def test_sampled_output_follows_the_target(models, plain_tokens, method, options, sampling, max_tokens):
    """The method's sampled output has the plain target's distribution, token by token and pair by pair;
    first, that the case was not vacuous: drafts were both accepted and rejected (many of each), some at
    depth 2, a tree case verified trees, and every KV block came back."""
    plain, heads = models
    config = {"method": method, "num_speculative_tokens": 2, "sampled": True, **options}
    if method in heads:
        config["model"] = heads[method]
    if method == "layer_skip":
        config["num_layers"] = 2
    spec = plain.with_speculative_config(every_step(config), max_num_seqs=256)
    trees = count_tree_drafts(spec)
    outs = spec.generate([{"prompt_token_ids": PROMPT}] * N, params(sampling, max_tokens))
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert accepted >= N // 20 and drafted - accepted >= N // 20, (drafted, accepted)  # many of each
    assert sum(o.metrics["accepted_per_pos"][1] for o in outs if len(o.metrics["accepted_per_pos"]) > 1) > 0
    assert spec.engine.allocator.num_used == 0
    if shape(method, options) != "chain":
        assert trees[0] >= N // 20, trees  # the tree case verified trees
    a, b = plain_tokens(sampling)[:, :max_tokens - 1], torch.tensor([o.token_ids[1:] for o in outs])
    comparisons = [(f"token {j + 1}", a[:, j], b[:, j]) for j in range(max_tokens - 1)]
    comparisons += [(f"tokens {j + 1} and {j + 2}", a[:, j] * 320 + a[:, j + 1], b[:, j] * 320 + b[:, j + 1])
                    for j in range(max_tokens - 2)]
    for what, x, y in comparisons:
        chi2, dof, p = significance(x, y)
        assert dof >= 1 and p >= MIN_P_VALUE, f"{what}: chi2 {chi2:.1f} with {dof} dof, p = {p:.1e}"
