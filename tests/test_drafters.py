"""Each drafting method: what it proposes, and that the engine's output never depends on it."""
from __future__ import annotations

import pytest
import torch
from conftest import assert_greedy_equal, every_step, save_tiny_model

from specdec import LLM, SamplingParams, SpecdecError
from specdec.drafting.base import Draft
from specdec.drafting.ngram import NgramIndex

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick", "Hello world", "1 2 3 4 5 6 1 2 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def reference(target_dir):
    return [o.token_ids for o in LLM(str(target_dir)).generate(PROMPTS, GREEDY)]


def test_ngram_index_finds_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    index = NgramIndex(1, 3)
    index.extend(0, tokens)
    assert index.lookup(tokens, 2) == ([7, 5], 3)  # [1, 2, 3] last seen before 7
    assert index.lookup(tokens, 2, latest=False) == ([9, 1], 3)  # the oldest occurrence
    assert index.lookup(tokens + [4], 3) == ([], 0)  # 4 never appeared before
    tokens.append(9)
    index.extend(0, tokens)
    assert index.lookup(tokens, 2) == ([1, 2], 3)  # [2, 3, 9] was seen at the start


def test_frequent_ngram_match_follows_the_most_common_continuation():
    """A phrase the text continued twice one way and once (latest) another: "frequent" drafts the common
    wording, depth by depth among the occurrences that still agree; equal counts go to the latest."""
    tokens = [1, 2, 5, 6, 9, 1, 2, 5, 6, 8, 1, 2, 7, 3, 4, 1, 2]
    index = NgramIndex(1, 2)
    index.extend(0, tokens)
    assert index.lookup(tokens, 3) == ([7, 3, 4], 2)
    assert index.lookup_frequent(tokens, 3) == ([5, 6, 8], 2)  # 5, 6 twice; then 9 and 8 once each: the latest
    assert index.lookup_frequent(tokens + [4], 3) == ([1, 2], 1)  # [2, 4] never seen; [4] once, near the end
    assert index.lookup_frequent(tokens + [11], 3) == ([], 0)


def test_frequent_ngram_match_drafts_through_the_drafter():
    from specdec.drafting import DraftRequest
    from specdec.drafting.ngram import NgramDrafter

    tokens = [1, 2, 5, 6, 9, 1, 2, 5, 6, 8, 1, 2, 7, 3, 4, 1, 2]
    drafter = NgramDrafter(4, 1, 2, match="frequent")  # a full 2-token match drafts k = 4
    draft = drafter.propose([DraftRequest(0, tokens, len(tokens), 4)])
    assert draft.tokens[0].tolist() == [5, 6, 8, 1]
    # With branches, the voted continuation leads and the latest one with another first token follows
    # (a 2-token match below prompt_lookup_max = 3 drafts 2 tokens per branch).
    branched = NgramDrafter(4, 1, 3, match="frequent", branches=2).propose(
        [DraftRequest(0, tokens, len(tokens), 4)])
    assert branched.tokens[0].tolist() == [5, 6, 7, 3]
    assert branched.parents[0].tolist() == [-1, 0, -1, 2]


@pytest.mark.parametrize("mode, expected", [("adaptive", [0, 1, 2, 4, 6, 6]), ("fixed", [6] * 6)])
def test_ngram_draft_length_follows_the_match_length(mode, expected):
    """Short matches rarely continue far, so adaptive drafts grow with the match: 2^(n-1), k for a full match."""
    from specdec.drafting import DraftRequest
    from specdec.drafting.ngram import NgramDrafter

    drafter = NgramDrafter(6, 1, 5, adaptive=mode == "adaptive")
    assert [drafter.draft_length(n) for n in range(6)] == expected
    text = list(range(100, 120))
    for n, length in zip(range(1, 6), expected[1:]):  # a suffix matching exactly n tokens of `text`
        tokens = text + [7] * (5 - n) + text[:n]
        draft = drafter.propose([DraftRequest(n, tokens, len(tokens), 6)])
        assert draft.tokens[0, : draft.num_nodes()[0]].tolist() == text[n:n + length]


def test_ngram_drafts_say_what_they_rest_on_and_draft_whole_when_the_plan_sizes_them():
    """`Draft.evidence`: a token match's length ("match n"), a text match's bucket ("text 16", "text 8", "text 3"),
    None where nothing matched. Asked with `sized_by_plan`, the whole budget comes back (the cost model cuts it by
    what drafts of that evidence kept); without it, the drafter's own cut by match length."""
    from specdec.drafting import DraftRequest
    from specdec.drafting.ngram import NgramDrafter

    drafter = NgramDrafter(6, 1, 5)
    text = list(range(100, 120))
    for n in range(1, 6):
        tokens = text + [7] * (5 - n) + text[:n]
        own = drafter.propose([DraftRequest(n, tokens, len(tokens), 6)])
        whole = drafter.propose([DraftRequest(n, tokens, len(tokens), 6, sized_by_plan=True)])
        assert own.evidence == whole.evidence == [f"match {n}"]
        assert whole.tokens[0].tolist() == text[n:n + 6]
        assert own.num_nodes()[0] == drafter.draft_length(n)
    nothing = drafter.propose([DraftRequest(9, [1, 2, 3], 3, 6, sized_by_plan=True)])
    assert nothing.evidence == [None] and nothing.num_nodes() == [0]


def test_ngram_index_is_incremental():
    a, b = NgramIndex(1, 2), NgramIndex(1, 2)
    tokens = [5, 6, 5, 6, 7, 5]
    for end in range(1, len(tokens) + 1):
        a.extend(0, tokens[:end])
    b.extend(0, tokens)
    assert a.positions == b.positions


def test_shared_ngram_pool_drafts_from_other_requests():
    from specdec.drafting import DraftRequest
    from specdec.drafting.ngram import NgramDrafter

    finished, fresh = [10, 11, 12, 13, 14, 15], [20, 11, 12]
    for pool, expected in [("request", []), ("shared", [13, 14])]:
        drafter = NgramDrafter(2, 1, 3, pool=pool)
        drafter.propose([DraftRequest(0, finished, len(finished), 2)])
        drafter.release(0)  # request 0 finished; a shared pool keeps its text
        draft = drafter.propose([DraftRequest(1, fresh, len(fresh), 2)])
        assert draft.tokens[0, : draft.num_nodes()[0]].tolist() == expected
        drafter.release(1)
        drafter.forget()  # between benchmark passes: finished texts are gone
        draft = drafter.propose([DraftRequest(2, fresh, len(fresh), 2)])
        assert draft.tokens[0, : draft.num_nodes()[0]].tolist() == []


import string  # noqa: E402


class WordTokenizer:
    """Greedy longest match over a fixed vocabulary: a copy that starts mid-word tokenizes differently."""

    VOCAB = ["The", " city", " of", " Montreal", " hosts", " it", " in", " June", "city", '":', ' "', "Mont", "real",
             "Mon", *string.printable]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        while text:
            i = max((i for i, v in enumerate(self.VOCAB) if text.startswith(v)), key=lambda i: len(self.VOCAB[i]))
            ids.append(i)
            text = text[len(self.VOCAB[i]):]
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.VOCAB[i] for i in ids)


def test_ngram_text_match_copies_across_token_boundaries():
    """`"city": "Mont` ends in a token (Mont) the text never had (it has " Montreal"), so no n-gram of tokens
    matches; the text's suffix "Mont" does, and what followed it, "real hosts it in June.", is re-encoded: one
    token after a 4-character match (adaptive), k after a long one, nothing without a tokenizer."""
    from specdec.drafting import DraftRequest
    from specdec.drafting.ngram import NgramDrafter

    tok = WordTokenizer()
    tokens = tok.encode('The city of Montreal hosts it in June.\n{"city": "Mont')
    assert tok.decode(tokens[-2:]) == ' "Mont' and tokens[-1] not in tokens[:-1]

    def draft(drafter: NgramDrafter, ids: list[int]) -> str:
        d = drafter.propose([DraftRequest(0, ids, len(ids), 4)])
        drafter.release(0)
        return tok.decode(d.tokens[0, : d.num_nodes()[0]].tolist())

    assert draft(NgramDrafter(4, 1, 4), tokens) == ""
    assert draft(NgramDrafter(4, 1, 4, tokenizer=tok), tokens) == "real"
    assert draft(NgramDrafter(4, 1, 4, tokenizer=tok, adaptive=False), tokens) == "real hosts it in"
    longer = tok.encode("The city of Montreal hosts it in June.\nThe city of Montr")  # ... " ", "Mont", "r"
    assert draft(NgramDrafter(4, 1, 4), longer) == ""
    assert draft(NgramDrafter(4, 1, 4, tokenizer=tok), longer) == "eal hosts"  # 16+ characters: k tokens


def test_ngram_text_matches_are_evidence_by_their_length():
    """A text match's evidence is its length bucket; with `sized_by_plan` it drafts the whole budget it re-encodes
    (its own cut: 1 token below 8 characters, 2 below 16, k from 16)."""
    from specdec.drafting import DraftRequest
    from specdec.drafting.ngram import NgramDrafter

    tok = WordTokenizer()
    cases = {'The city of Montreal hosts it in June.\n{"city": "Mont': ("text 3", "real", "real hosts it in"),
             "The city of Montreal hosts it in June.\nA city of Mont": ("text 8", "real hosts", "real hosts it in"),
             "The city of Montreal hosts it in June.\nThe city of Montr": ("text 16", "eal hosts", "eal hosts")}
    for text, (evidence, own, whole) in cases.items():
        ids = tok.encode(text)
        for sized, want in ((False, own), (True, whole)):
            drafter = NgramDrafter(4, 1, 4, tokenizer=tok)
            d = drafter.propose([DraftRequest(0, ids, len(ids), 4, sized_by_plan=sized)])
            assert d.evidence == [evidence] and tok.decode(d.tokens[0, : d.num_nodes()[0]].tolist()) == want


def test_ngram_branches_are_distinct_continuations_of_the_best_matches():
    from specdec.drafting import DraftRequest
    from specdec.drafting.ngram import NgramDrafter

    tokens = [1, 2, 3, 7, 8, 1, 2, 3, 5, 6, 9, 2, 3, 4, 1, 2, 3]  # [1, 2, 3] was followed by 7, later by 5
    drafter = NgramDrafter(6, 1, 4, branches=3)  # a 3-token match drafts 2^2 = 4 tokens
    draft = drafter.propose([DraftRequest(0, tokens, len(tokens), 6)])
    assert draft.tokens[0].tolist() == [5, 6, 9, 2, 7, 8]  # latest occurrence first, the older one gets the rest
    assert draft.parents[0].tolist() == [-1, 0, 1, 2, -1, 4]  # two branches from the last committed token


@pytest.mark.parametrize("branches", [2, 3])
def test_ngram_branches_are_lossless(target_dir, reference, branches):
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "ngram", "num_speculative_tokens": 6,
                                                              "ngram_branches": branches}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0


def test_latest_ngram_match_is_lossless(target_dir, reference):  # the default, "frequent", is tested everywhere
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "ngram", "num_speculative_tokens": 5,
                                                              "ngram_match": "latest"}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_shared_ngram_pool_is_lossless(target_dir, reference):
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "ngram", "num_speculative_tokens": 3,
                                                              "ngram_pool": "shared", "ngram_match": "oldest"}))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_draft_model_is_lossless_and_a_self_draft_is_always_accepted(target_dir, other_draft_dir, reference):
    other = LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(other_draft_dir),
                                                                "num_speculative_tokens": 3}))
    assert [o.token_ids for o in other.generate(PROMPTS, GREEDY)] == reference
    self_draft = LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(target_dir),
                                                                     "num_speculative_tokens": 4}))
    outs = self_draft.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    for o in outs:  # proves the draft cache stays aligned with the target's through every rewind
        assert o.metrics["acceptance_rate"] == 1.0
    assert self_draft.engine.allocator.num_used == 0


TREES = ["D2-BF2", [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]]
DYNAMIC = {"topk": 3, "num_steps": 3, "num_draft_tokens": 7}


@pytest.mark.parametrize("tree", TREES + [DYNAMIC])
def test_draft_model_trees_are_lossless_and_a_self_draft_keeps_its_best_path(target_dir, other_draft_dir,
                                                                             reference, tree):
    other = LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(other_draft_dir),
                                                                "tree": tree}))
    assert_greedy_equal(other, other.generate(PROMPTS, GREEDY), reference)  # trees: steps over 16 rows
    self_draft = LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(target_dir),
                                                                     "tree": tree}))
    outs = self_draft.generate(PROMPTS, GREEDY)
    assert_greedy_equal(self_draft, outs, reference)
    depth = 2 if tree == "D2-BF2" else 3  # the dynamic tree's best path is 3 deep: its scores are highest
    for o in outs:  # the rank-0 path is the target's own greedy choice: accepted to full depth every step
        m = o.metrics  # but the last two, whose trees lose their deepest nodes to the max_tokens budget
        assert m["accepted_per_pos"][0] == m["num_drafts"], m
        assert m["num_accepted_tokens"] >= depth * (m["num_drafts"] - 2), m
    assert self_draft.engine.allocator.num_used == 0


@pytest.mark.parametrize("tree", TREES + [DYNAMIC])
def test_layer_skip_trees_are_lossless(target_dir, reference, tree):
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "layer_skip", "num_layers": 2, "tree": tree}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert_greedy_equal(llm, outs, reference)
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_dispatcher_switches_between_trees_and_chains_losslessly(target_dir, reference):
    """Requests of different lengths: the batch shrinks from 3 to 1, so the same drafter (and draft cache)
    serves a chain, then a tree, step after step (a self-draft, so no request backs off to one token)."""
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(target_dir),
                                                              "num_speculative_tokens": 2, "tree": "D2-BF2",
                                                              "dispatch": {"2": "chain-2"}}))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 8, 12)]
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [ref[:n] for ref, n in zip(reference, (20, 8, 12))]
    first, second = outs[0].metrics, outs[1].metrics
    assert second["num_draft_tokens"] <= 2 * second["num_drafts"]  # never alone: chains of 2 only
    assert first["num_draft_tokens"] > 2 * first["num_drafts"]  # alone at the end: 6-node trees


def test_sampled_tree_drafts_keep_seeded_output(target_dir, other_draft_dir):
    """Top-k tree children are deterministic proposals; seeded sampling repeats exactly with them."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(other_draft_dir),
                                                              "tree": "D2-BF2"}))
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == first


def test_draft_model_survives_preemption(target_dir, reference):
    llm = LLM(str(target_dir), block_size=4, num_kv_blocks=14,
              speculative_config=every_step({"method": "draft_model", "model": str(target_dir),
                                             "num_speculative_tokens": 3}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference


def test_layer_skip_is_lossless(target_dir, reference):
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "layer_skip", "num_layers": 2,
                                                              "num_speculative_tokens": 3}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0


def test_layer_skip_with_all_but_one_layer_matches_itself(tmp_path):
    """A 2-layer target whose last layer is zeroed: its first layer predicts exactly what it does."""
    path = save_tiny_model(tmp_path, "llama", num_hidden_layers=2)
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    for name in weights:
        if name.startswith("model.layers.1.") and (name.endswith("o_proj.weight") or name.endswith("down_proj.weight")):
            weights[name].zero_()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(path), speculative_config=every_step({"method": "layer_skip", "num_layers": 1,
                                                        "num_speculative_tokens": 4}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(o.metrics["acceptance_rate"] == 1.0 for o in outs)


def test_sampled_draft_model_output_follows_the_target(target_dir, other_draft_dir):
    """First speculative step (tokens 1 and 2) with a different random draft model at temperature 1."""
    from test_speculative import MIN_P_VALUE, p_value

    n, prompt = 2000, {"prompt_token_ids": [5, 6, 7]}
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=4, ignore_eos=True, seed=i) for i in range(n)]
    plain = LLM(str(target_dir), max_num_seqs=256)
    spec = LLM(str(target_dir), max_num_seqs=256, speculative_config=every_step({
        "method": "draft_model", "model": str(other_draft_dir), "num_speculative_tokens": 2}))
    a = torch.tensor([o.token_ids[1:3] for o in plain.generate([prompt] * n, params)])
    outs = spec.generate([prompt] * n, params)
    b = torch.tensor([o.token_ids[1:3] for o in outs])
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0
    for pos in range(2):
        ca, cb = torch.bincount(a[:, pos], minlength=320).double(), torch.bincount(b[:, pos], minlength=320).double()
        keep = (ca + cb) >= 20
        ca, cb = torch.cat([ca[keep], ca[~keep].sum()[None]]), torch.cat([cb[keep], cb[~keep].sum()[None]])
        expected = (ca + cb) / 2
        chi2 = (((ca - expected) ** 2 + (cb - expected) ** 2) / expected.clamp(min=1e-9)).sum().item()
        dof = len(ca) - 1
        assert p_value(chi2, dof) >= MIN_P_VALUE, (pos, chi2, dof)


def test_draft_with_another_vocabulary_is_refused(tmp_path, target_dir):
    draft = save_tiny_model(tmp_path / "d", "llama", vocab_size=300)
    with pytest.raises(SpecdecError, match="vocab size 300 but the target has 320"):
        LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(draft)}))


@pytest.mark.parametrize("config, message", [
    ({"method": "layer_skip", "num_layers": 4}, r"num_layers=4 must be in \[1, 3\]"),
    ({"method": "layer_skip"}, "needs 'num_layers'"),
    ({"method": "draft_model"}, "needs 'model'"),
    ({"method": "draft_model", "model": "/no/such/draft"}, "not found"),
])
def test_bad_drafter_configs(target_dir, config, message):
    with pytest.raises(SpecdecError, match=message):
        LLM(str(target_dir), speculative_config=every_step(config))


def test_quantized_self_drafts_with_a_low_bit_copy_of_the_target(tmp_path_factory):
    """A float32 target drafted for by its own Q4_0 copy: lossless, and the copy often agrees with the target
    (43% of drafts on this random model)."""
    from conftest import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("tiny128"), "llama", intermediate_size=128)
    plain = LLM(str(path), speculative_config="off")
    ref = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    spec = plain.with_speculative_config(every_step({"method": "quantized_self", "quantization": "q4_0",
                                                     "num_speculative_tokens": 3}))
    outs = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0.25 * sum(o.metrics["num_draft_tokens"] for o in outs)
    assert spec.engine.speculator.drafter.model.quantization == "q4_0"


def test_quantized_self_refuses_what_the_target_cannot_take(tiny_llama_dir):
    with pytest.raises(SpecdecError, match="112 inputs, not a multiple of q4_0's block of 32"):
        LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "quantized_self"}))
    with pytest.raises(SpecdecError, match=r"unknown quantization 'q2'; choose one of "
                                           r"\['iq4_nl', 'iq4_xs', 'mxfp4', 'q4_0', 'q4_1', 'q4_k'"):
        LLM(str(tiny_llama_dir), speculative_config=every_step({"method": "quantized_self", "quantization": "q2"}))


@pytest.mark.parametrize("tokens, parents, message", [
    ([[1, 2]], [[-1, 0]], None),
    ([[1, 2, 0]], [[-1, -1, -2]], None),  # two branches, then padding
    ([[1, 99]], [[-1, 0]], "token ids must be in"),
    ([[1, -3]], [[-1, 0]], "token ids must be in"),
    ([[1, 2]], [[-1, 1]], "earlier node"),  # a node is its own parent
    ([[1, 2]], [[-1, 5]], "earlier node"),
    ([[1, 2]], [[-3, 0]], "earlier node"),
    ([[1, 2, 3]], [[-1, -2, 1]], "padding"),  # a node after padding
])
def test_a_malformed_draft_is_refused_with_what_is_wrong(tokens, parents, message):
    draft = Draft(torch.tensor(tokens), torch.tensor(parents))
    if message is None:
        draft.validate(1, 10)
    else:
        with pytest.raises(SpecdecError, match=message):
            draft.validate(1, 10)


def test_a_draft_model_step_where_nobody_drafts_claims_no_draft_cache(target_dir):
    """All requests throttled or paused (budget 0): nothing is fed, so the draft cache must not claim the
    sequence's K/V (a later catch-up would otherwise read slots that were never written)."""
    from specdec.drafting import DraftRequest

    llm = LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(target_dir),
                                                              "num_speculative_tokens": 2}))
    drafter = llm.engine.speculator.drafter
    request = DraftRequest(7, [5, 6, 7, 8, 9], 5, 0, params=GREEDY, block_table=[1, 2])
    assert drafter.propose([request]).num_nodes() == [0]
    assert drafter.cached_prefix(request) == 0
    drafting = DraftRequest(7, [5, 6, 7, 8, 9], 5, 2, params=GREEDY, block_table=[1, 2])
    assert drafter.propose([drafting]).num_nodes() == [2]
    assert drafter.cached_prefix(drafting) == 5  # the committed tokens were fed


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("tree", [{"topk": 4, "num_steps": 4, "num_draft_tokens": 20}, "D2-BF4"])
def test_trees_of_20_nodes_are_lossless_at_1_4_and_16_sequences(target_dir, other_draft_dir, batch, tree):
    """A float target verifying trees of 20 nodes for up to 16 sequences at once (steps of up to 336 rows) gives
    plain greedy output token for token: every row count runs through the same row-invariant kernels."""
    prompts = [f"{i} {PROMPTS[i % 3]} {i * 7}" for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = [o.token_ids for o in LLM(str(target_dir)).generate(prompts, params)]
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "draft_model", "model": str(other_draft_dir),
                                                              "tree": tree}))
    outs = [o for i in range(0, 16, batch) for o in llm.generate(prompts[i:i + batch], params)]
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_drafts"] for o in outs) > 0 and llm.engine.allocator.num_used == 0


# ---- the n-gram drafter against a brute-force search (its drafts, not only the output) -------------------------
def brute_force_ngram(tokens: list[int], k: int, n_min: int, n_max: int, match: str, adaptive: bool) -> list[int]:
    """What the n-gram drafter's documentation says it drafts, by scanning the whole text: the longest suffix of
    n_max..n_min tokens seen earlier; the tokens after its latest (or oldest) occurrence, or, "frequent", at each
    position the token most of its (latest 64) occurrences still agreeing continue with, ties to the latest;
    adaptive: min(k, 2^(n-1)) tokens after an n-token match shorter than n_max."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        ends = [e for e in range(n, L) if tokens[e - n:e] == tokens[L - n:]]  # where a continuation starts
        if not ends:
            continue
        length = k if not adaptive or n >= n_max else min(k, 2 ** (n - 1))
        if match != "frequent":
            start = ends[-1] if match == "latest" else ends[0]
            return tokens[start:start + k][:length]
        voters, draft = list(reversed(ends))[:64], []
        while len(draft) < k:
            nexts = [tokens[s + len(draft)] for s in voters if s + len(draft) < L]
            if not nexts:
                break
            best = max(dict.fromkeys(nexts), key=nexts.count)  # the first (latest) of the most common
            draft.append(best)
            voters = [s for s in voters if s + len(draft) - 1 < L and tokens[s + len(draft) - 1] == best]
        return draft[:length]
    return []


def ngram_mismatches(seed: int, match: str, adaptive: bool, steps: int = 120) -> list[tuple[int, list, list]]:
    """The drafter fed a random text over a small alphabet (so it repeats) one token at a time, as the engine
    feeds it; every position where its draft differs from the brute force."""
    import random

    from specdec.drafting import DraftRequest
    from specdec.drafting.ngram import NgramDrafter

    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(8)]
    drafter = NgramDrafter(5, 1, 3, match=match, adaptive=adaptive)
    bad = []
    for _ in range(steps):
        tokens.append(rng.randrange(6) if rng.random() < 0.4 else tokens[rng.randrange(len(tokens))])
        got = drafter.propose([DraftRequest(0, tokens, 1, 5)]).host_rows()[0][0]
        want = brute_force_ngram(tokens, 5, 1, 3, match, adaptive)
        if got != want:
            bad.append((len(tokens), got, want))
    return bad


@pytest.mark.parametrize("match", ["frequent", "latest", "oldest"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_ngram_drafts_equal_a_brute_force_search(match, adaptive):
    for seed in range(4):
        assert ngram_mismatches(seed, match, adaptive) == []


def test_the_brute_force_reference_catches_a_planted_ngram_bug(monkeypatch):
    """Planted: the index skips the newest position (an off-by-one in `extend`). Output equality could never show it
    (verification corrects any draft); the reference does, at once."""
    def extend(self, text_id, tokens):
        self.texts[text_id] = tokens
        start = self.indexed.get(text_id, 0)
        for end in range(max(start, 1), len(tokens) - 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.positions[tuple(tokens[end - n:end])].append((text_id, end))
        self.indexed[text_id] = max(start, len(tokens) - 1)

    monkeypatch.setattr(NgramIndex, "extend", extend)
    assert len(ngram_mismatches(0, "latest", True)) >= 5
    monkeypatch.undo()
    from specdec.drafting.ngram import NgramDrafter  # planted: adaptive drafts one token more than the rule says

    monkeypatch.setattr(NgramDrafter, "draft_length", lambda self, n: min(self.k, 2 ** n) if n else 0)
    assert len(ngram_mismatches(0, "frequent", True)) >= 5
