"""A seed decides a sampled request's tokens, whatever speculates: with keyed sampling (the default
`sampled_verification`), seeded sampled output with any drafting method, chain or tree, equals plain seeded output
token for token, at any temperature, with top-k / top-p / penalties / a bias / a grammar, alone or in a batch of
greedy and sampled requests.

The target and heads are test_sampled_methods' (a tiny random Llama given a preference for four tokens and their
successors, heads that carry it), so every method's drafts are often accepted and often rejected: an equality that
held only because nothing was drafted, or nothing rejected, is ruled out by the counts each case checks.
"""
from __future__ import annotations

import pytest
from conftest import every_step
from test_retrieval import token_file
from test_sampled_methods import CHOICES, LIKELY, PROMPT, models, prior_target  # noqa: F401  (models: a fixture)

from specdec import LLM, SamplingParams, StructuredOutput
from specdec.engine import token_choice

N = 16  # seeded requests per case
MAX_TOKENS = 10

SAMPLINGS = {
    "t0.3-top_p": dict(temperature=0.3, top_p=0.9),
    "t0.8-top_k": dict(temperature=0.8, top_k=8),
    "t1.2-penalized": dict(temperature=1.2, top_k=12, presence_penalty=0.4, frequency_penalty=0.3,
                           repetition_penalty=1.1, logit_bias={LIKELY[2]: 1.0}),
}

METHODS = {  # name: the method's keys (heads, a draft model and a corpus are filled in by `config`)
    "ngram-chain": {"method": "ngram", "prompt_lookup_min": 1, "ngram_draft_length": "fixed"},
    "ngram-branches": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "ngram_draft_length": "fixed", "ngram_branches": 2},
    "suffix-tree": {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 4.0,
                    "suffix_decoding_min_token_prob": 0.0},
    "retrieval": {"method": "retrieval", "num_speculative_tokens": 4},
    "recycle": {"method": "recycle", "num_speculative_tokens": 3},
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 3},
    "draft_model-chain": {"method": "draft_model"},
    "draft_model-tree": {"method": "draft_model", "tree": "D2-BF2"},
    "layer_skip-chain": {"method": "layer_skip", "num_layers": 2},
    "layer_skip-tree": {"method": "layer_skip", "num_layers": 2, "tree": "D2-BF2"},
    "quantized_self": {"method": "quantized_self"},
    "eagle-tree": {"method": "eagle", "tree": "D2-BF2"},
    "eagle3-chain": {"method": "eagle3"},
    "eagle3-choices": {"method": "eagle3", "tree": CHOICES},
    "mtp": {"method": "mtp"},
    "medusa-choices": {"method": "medusa", "tree": CHOICES},
    "hybrid": {"method": "hybrid", "num_speculative_tokens": 4,
               "sources": [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                           {"method": "suffix", "num_speculative_tokens": 3}]},
}


@pytest.fixture(scope="module")
def extras(models, tmp_path_factory):
    """A draft model with other random weights and the same preferences, and a retrieval corpus of LIKELY cycles
    (with detours, so its drafts are sometimes wrong)."""
    root = tmp_path_factory.mktemp("seeded")
    draft = prior_target(root / "draft", seed=1, layers=2)
    cycle = LIKELY * 4
    docs = [cycle, cycle[1:] + [7, 9], [41, 42, 40, 43] * 3, [42, 43, 43, 40, 41, 9]]
    return {"draft_model": str(draft), "retrieval": str(token_file(root / "corpus.npz", docs))}


def config(name: str, heads: dict, extras: dict) -> dict:
    cfg = {"num_speculative_tokens": 2, "sampled": True, **METHODS[name]}
    method = cfg["method"]
    if method in heads:
        cfg["model"] = heads[method]
    if method == "draft_model":
        cfg["model"] = extras["draft_model"]
    if method == "retrieval":
        cfg["corpus"] = extras["retrieval"]
    return cfg


def seeded(sampling: dict, n: int = N, first_seed: int = 100) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=first_seed + i, **sampling) for i in range(n)]


def mixed(sampling: dict) -> list[SamplingParams]:
    """Sampled requests with greedy ones between them, in one batch."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [p for s in seeded(sampling, N // 2, 500) for p in (s, greedy)]


PROMPTS = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[1:] + [40, 41]}]


def run(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate([PROMPTS[i % 2] for i in range(len(params))], params)]


@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
@pytest.mark.parametrize("name", list(METHODS))
def test_seeded_output_equals_plain_output(models, extras, name, sampling):
    plain, heads = models
    spec = plain.with_speculative_config(every_step(config(name, heads, extras)), max_num_seqs=64)
    sampling_ = SAMPLINGS[sampling]
    for params in (seeded(sampling_), mixed(sampling_)):
        outs = spec.generate([PROMPTS[i % 2] for i in range(len(params))], params)
        assert [o.token_ids for o in outs] == run(plain, params)
        drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
        accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
        assert accepted > 0 and drafted - accepted > 0, (drafted, accepted)  # drafts both kept and rejected
    assert spec.engine.allocator.num_used == 0


@pytest.mark.parametrize("name", ["ngram-chain", "eagle3-choices", "draft_model-chain"])
def test_seeded_structured_output_equals_plain_output(models, extras, name):
    """With a grammar too: every row is masked after its own path, then sampled with its position's key."""
    plain, heads = models
    spec = plain.with_speculative_config(every_step(config(name, heads, extras)), max_num_seqs=64)
    so = StructuredOutput(regex="[a-z ]{3,40}")
    params = [SamplingParams(max_tokens=MAX_TOKENS, seed=i, temperature=0.9, structured_output=so) for i in range(N)]
    assert run(spec, params) == run(plain, params)


def test_keying_by_step_instead_of_position_breaks_the_equality(models, extras, monkeypatch):
    """The equality is not vacuous: key the noise by the engine step instead of the output position (as a per-step
    generator would) and speculative output leaves plain output, since a step that emits several tokens moves
    the key once."""
    plain, heads = models
    spec = plain.with_speculative_config(every_step(config("ngram-chain", heads, extras)), max_num_seqs=64)
    steps = {"n": 0}
    keyed = token_choice.sampling_key

    def by_step(seed: int, position: int) -> int:
        return keyed(seed, steps["n"])

    params = seeded(SAMPLINGS["t0.8-top_k"])
    monkeypatch.setattr(token_choice, "sampling_key", by_step)
    for llm in (plain, spec):
        original = llm.engine.step

        def step(original=original):
            steps["n"] += 1
            return original()

        monkeypatch.setattr(llm.engine, "step", step)
    steps["n"] = 0
    plain_out = run(plain, params)
    steps["n"] = 0
    assert run(spec, params) != plain_out
