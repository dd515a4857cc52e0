"""Retrieval drafting (REST): the suffix array against a brute-force sort, hand-worked lookups and trees, that
the engine's output never depends on the corpus (greedy identity, sampled distribution), and bad corpora."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import every_step
from test_drafters import GREEDY, PROMPTS, reference, target_dir  # noqa: F401 (module fixtures)
from test_speculative import MIN_P_VALUE, chi_square_two_sample, p_value

from specdec import LLM, SamplingParams, SpecdecError
from specdec.drafting import retrieval
from specdec.drafting.base import DraftRequest
from specdec.drafting.datastore import Datastore, count_trie, suffix_array, voted_chain
from specdec.drafting.retrieval import RetrievalDrafter, evidence
from specdec.drafting.suffix import grow


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(retrieval, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache"


def token_file(path, docs: list[list[int]], meta: dict | None = None):
    lengths = [len(d) for d in docs]
    np.savez(path, tokens=np.array([t for d in docs for t in d], dtype=np.int64),
             offsets=np.array([0, *np.cumsum(lengths)], dtype=np.int64),
             **({"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)} if meta else {}))
    return path


@pytest.mark.parametrize("seed", range(5))
def test_suffix_array_orders_suffixes_like_a_sort_of_their_windows(seed):
    rng = random.Random(seed)
    tokens = np.array([rng.choice([-1, 0, 1, 2, 3]) if rng.random() < 0.2 else rng.randrange(4)
                       for _ in range(rng.randrange(1, 300))], dtype=np.int32)
    depth = rng.choice([1, 3, 8, 40])
    sa = suffix_array(tokens, depth)
    key = lambda s: [t + 2 for t in tokens[s:s + depth].tolist()] + [0] * max(0, s + depth - len(tokens))  # noqa: E731
    assert sorted(sa.tolist()) == list(range(len(tokens)))
    assert [key(s) for s in sa] == sorted(key(s) for s in range(len(tokens)))


def test_lookups_continuations_and_tree_on_a_hand_worked_corpus():
    tokens = np.array([5, 6, 7, 5, 6, 8, -1, 5, 6, 7, 9, -1], dtype=np.int32)
    store = Datastore.build(tokens, max_match=4, depth=3)
    assert store.find([5, 6]) == (2, 5) and store.find([5, 6, 7]) == (2, 4) and store.find([4]) == (2, 2)
    assert store.longest_match([1, 2, 5, 6, 7], 1, 4) == (3, 2, 4)  # [5, 6, 7]: twice
    assert store.longest_match([1, 2, 3], 1, 4)[0] == 0
    m, lo, hi = store.longest_match([1, 5, 6], 1, 4)
    rows = store.continuations(lo, hi, m, 3, 64)
    assert m == 2 and sorted(rows.tolist()) == [[7, 5, 6], [7, 9, -1], [8, -1, 5]]
    # 7 followed twice, 8 once; after 7: 5 and 9 once each (the document ends after 9 and after 8)
    expected = ([7, 8, 5, 9], [-1, -1, 0, 0], pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3]))
    assert grow(count_trie(rows), 4, 3, 0.1) == expected
    assert store.continuations(lo, hi, m, 3, 1).tolist() == [[7, 5, 6]]  # fewer candidates: spread, the first


def test_the_drafter_takes_the_longest_match_and_respects_the_budget():
    docs = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 7, 8], [2, 3, 7, 1]]
    tokens = np.array([t for d in docs for t in [*d, -1]], dtype=np.int32)
    drafter = RetrievalDrafter(Datastore.build(tokens, 4, 4), num_speculative_tokens=4, max_match=4, min_match=1,
                               min_token_prob=0.0)
    draft = drafter.propose([DraftRequest(0, [0, 1, 2, 3], 4, 4), DraftRequest(1, [0, 2, 3], 3, 1),
                             DraftRequest(2, [0, 0], 2, 4)])
    assert draft.num_nodes() == [3, 1, 0]  # [1, 2, 3] once, then the document ends; [2, 3] thrice; 0 never
    assert draft.tokens[0, :3].tolist() == [4, 5, 6] and draft.parents[0, :3].tolist() == [-1, 0, 1]
    assert draft.tokens[1, 0].item() == 7  # 7 follows [2, 3] twice, 4 once


def test_asked_for_its_whole_budget_the_drafter_proposes_the_voted_chain_and_names_its_match():
    """`sized_by_plan` (the cost model cuts the draft): the chain most continuations agree on, token by token, with
    its match length bucketed by powers of two; without it the tree of continuations, with the same evidence."""
    docs = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 7, 8], [2, 3, 7, 1], [2, 3, 7, 8, 5]]
    tokens = np.array([t for d in docs for t in [*d, -1]], dtype=np.int32)
    drafter = RetrievalDrafter(Datastore.build(tokens, 4, 4), num_speculative_tokens=4, max_match=4, min_match=1,
                               min_token_prob=0.0)
    draft = drafter.propose([DraftRequest(0, [0, 2, 3], 3, 4, sized_by_plan=True),
                             DraftRequest(1, [0, 1, 2, 3], 4, 4, sized_by_plan=True),
                             DraftRequest(2, [0, 0], 2, 4, sized_by_plan=True)])
    # [2, 3]: followed by 4 once, 7 thrice; after 7: 8 twice, 1 once; after 7 8: the document ends, then 5
    assert draft.host_rows() == ([[7, 8, 5], [4, 5, 6], []], [[-1, 0, 1], [-1, 0, 1], []])
    assert draft.evidence == ["retrieval 2", "retrieval 2", None] and draft.scores is None
    tree = drafter.propose([DraftRequest(0, [0, 2, 3], 3, 4)])
    assert tree.num_nodes() == [4] and tree.tokens[0, :2].tolist() == [7, 8] and tree.evidence == ["retrieval 2"]
    assert [evidence(m) for m in (2, 3, 4, 7, 8, 15, 16)] == \
        ["retrieval 2", "retrieval 2", "retrieval 4", "retrieval 4", "retrieval 8", "retrieval 8", "retrieval 16"]
    assert voted_chain(np.array([[5, 1, -1], [6, 2, 3], [5, 2, -1], [6, 4, 4]])) == [5, 1]  # ties: the first row's


@pytest.mark.parametrize("seed", range(3))
def test_the_drafters_bounded_lookup_finds_the_longest_match_at_every_step(seed):
    """The drafter looks first at the longest a match can be (its last one plus the tokens added since): on sequences
    growing by random steps, sometimes copying the corpus and sometimes not, it finds what a full bisection finds."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(20):
        corpus += [rng.randrange(6) for _ in range(rng.randrange(5, 60))] + [-1]
    store = Datastore.build(np.array(corpus, dtype=np.int32), 8, 4)
    drafter = RetrievalDrafter(store, 4, max_match=8, min_match=2)
    for seq_id in range(10):
        context = [rng.randrange(6)]
        for _ in range(40):
            if rng.random() < 0.5:  # copy a stretch of the corpus
                start = rng.randrange(len(corpus) - 8)
                context += [t for t in corpus[start:start + rng.randrange(1, 6)] if t >= 0]
            else:
                context += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            assert drafter.match(DraftRequest(seq_id, list(context), 1, 4)) == store.longest_match(context, 2, 8)
        drafter.release(seq_id)
    assert not drafter.last


def test_retrieval_is_lossless_and_drafts_from_the_corpus(target_dir, reference, tmp_path):
    """A corpus holding the target's own answers: drafts are accepted, and the output is plain greedy's."""
    corpus = token_file(tmp_path / "answers.npz", [list(r) for r in reference])
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "retrieval", "corpus": str(corpus),
                                                              "num_speculative_tokens": 6}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["acceptance_length"] for o in outs) / len(outs) >= 3


def test_the_answers_of_the_training_pipeline_are_a_corpus(target_dir, reference, tmp_path):
    """The layout of the package's answers file (answer_ids, offsets, prompt_index, sampled) read as a token file."""
    lengths = [len(r) for r in reference]
    corpus = tmp_path / "answers-0.npz"
    np.savez_compressed(corpus, answer_ids=np.array([t for r in reference for t in r], np.uint16),
                        offsets=np.array([0, *np.cumsum(lengths)], np.int64),
                        prompt_index=np.arange(len(reference), dtype=np.int32),
                        sampled=np.zeros(len(reference), bool))
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "retrieval", "corpus": str(corpus),
                                                              "num_speculative_tokens": 6}))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["acceptance_length"] for o in outs) / len(outs) >= 3


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_text_corpora_are_tokenized_once_and_cached(target_dir, reference, tmp_path, private_cache, kind):
    llm = LLM(str(target_dir))
    texts = [llm.tokenizer.decode(r) for r in reference]
    path = tmp_path / f"corpus.{'txt' if kind == 'text' else 'jsonl'}"
    path.write_text("\n\n".join(t.replace("\n\n", "\n") for t in texts) if kind == "text" else "\n".join(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": t}]})
        for t in texts))
    config = {"method": "retrieval", "corpus": str(path), "num_speculative_tokens": 4}
    outs = LLM(str(target_dir), speculative_config=every_step(config)).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert len(list(private_cache.glob("*.npz"))) == 1
    again = LLM(str(target_dir), speculative_config=every_step(config))  # reads the cached datastore
    assert [o.token_ids for o in again.generate(PROMPTS, GREEDY)] == reference


def test_the_datastore_is_cached_under_specdec_cache(target_dir, reference, tmp_path, monkeypatch):
    """Without a folder of its own (CACHE_DIR), the datastore is cached under $SPECDEC_CACHE, as the kernels' builds
    and converted tokenizers are (the tests point it at a folder of theirs, never the user's ~/.cache)."""
    monkeypatch.setattr(retrieval, "CACHE_DIR", None)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "specdec"))
    corpus = token_file(tmp_path / "answers.npz", [list(r) for r in reference])
    LLM(str(target_dir), speculative_config=every_step({"method": "retrieval", "corpus": str(corpus),
                                                        "num_speculative_tokens": 4}))
    assert len(list((tmp_path / "specdec" / "retrieval").glob("*.npz"))) == 1


SAMPLED_PROMPT = [5, 6, 7]


def likely_corpus(path, model) -> str:
    """Token documents continuing the prompt's end ([6, 7]) with each of the target's 3 likeliest first tokens,
    then its 1st, 2nd and 4th choices after that token: drafts that are often, not always, accepted."""
    from specdec.training.targets import target_outputs

    docs = []
    for first in target_outputs(model, SAMPLED_PROMPT, ())[2][-1].topk(3).indices.tolist():
        likely = target_outputs(model, SAMPLED_PROMPT + [first], ())[2][-1].topk(4).indices.tolist()
        docs += [[6, 7, first, likely[0], 11], [6, 7, first, likely[1], 12], [6, 7, first, likely[3], 13],
                 [6, 7, first, likely[0], 14]]
    return str(token_file(path, docs))


def assert_first_step_follows_plain(plain: LLM, spec: LLM, n: int = 2000, prompt: list[int] = SAMPLED_PROMPT,
                                    last: int = 2) -> None:
    """Tokens 1 .. last (by default 1 and 2, the first speculative step) at temperature 1, top-k 8, seeded,
    with and without the drafter: two-sample chi-square per position, failing under a p-value of 1e-4."""
    prompts = [{"prompt_token_ids": prompt}] * n
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=last + 2, ignore_eos=True, seed=i) for i in range(n)]
    a = torch.tensor([o.token_ids[1:last + 1] for o in plain.generate(prompts, params)])
    outs = spec.generate(prompts, params)
    b = torch.tensor([o.token_ids[1:last + 1] for o in outs])
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 100  # drafts were accepted and rejected
    for pos in range(last):
        chi2, dof = chi_square_two_sample(a[:, pos], b[:, pos])
        assert dof >= 1 and p_value(chi2, dof) >= MIN_P_VALUE, (pos, chi2, dof)


def test_sampled_output_with_retrieval_follows_the_target(target_dir, tmp_path):
    plain = LLM(str(target_dir), max_num_seqs=256)
    spec = LLM(str(target_dir), max_num_seqs=256, speculative_config=every_step({
        "method": "retrieval", "corpus": likely_corpus(tmp_path / "c.npz", plain.engine.model),
        "num_speculative_tokens": 4, "min_token_prob": 0.0}))
    assert_first_step_follows_plain(plain, spec)


def test_bad_corpora_are_refused_and_nothing_is_cached(target_dir, tmp_path, private_cache):
    def refused(path, message, **extra):
        with pytest.raises(SpecdecError, match=message):
            LLM(str(target_dir), speculative_config=every_step({"method": "retrieval", "corpus": str(path), **extra}))

    refused(tmp_path / "missing.txt", "does not exist")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    refused(tmp_path / "blob.bin", "not a text file")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    refused(tmp_path / "latin.txt", "not UTF-8 text")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    refused(tmp_path / "bad.jsonl", r"bad.jsonl:2: expected a JSON object")
    refused(token_file(tmp_path / "other.npz", [[1, 2, 3]], {"model": "0123456789abcdef"}), "another model")
    refused(token_file(tmp_path / "big.npz", [[5] * 50]), "more than max_corpus_tokens=40", max_corpus_tokens=40)
    (tmp_path / "long.txt").write_text("the cat sat on the mat. " * 40)
    refused(tmp_path / "long.txt", "more than max_corpus_tokens=100", max_corpus_tokens=100)  # found tokenizing
    refused(tmp_path / "long.txt", "far larger than max_corpus_tokens=30", max_corpus_tokens=30)  # by its size
    refused(token_file(tmp_path / "ids.npz", [[1, 99999]]), "outside the target's vocabulary")
    refused(tmp_path / "x.txt", "needs 'corpus'", corpus="")
    refused(tmp_path / "x.txt", "min_match=5 exceeds max_match=3", min_match=5, max_match=3)
    assert not private_cache.exists() or not list(private_cache.glob("*"))


# ---- the datastore against a brute-force scan of the corpus (the drafts' source, not only the output) ----------
def retrieval_mismatches(seed: int, queries: int = 60, ids: list[int] = (0, 1, 2, 3, 4)) -> list[tuple]:
    """A random corpus over a small alphabet (`ids`; documents separated by -1) and random contexts: where the suffix
    array's longest match, its number of occurrences or the continuations after them differ from scanning the
    corpus for the longest suffix of the context (2..8 tokens) and reading what follows each occurrence (up to 4
    tokens, cut at a document's end)."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(12):
        corpus += [rng.choice(ids) for _ in range(rng.randrange(3, 40))] + [-1]
    store = Datastore.build(np.array(corpus, dtype=np.int32), 8, 4)
    bad = []
    for _ in range(queries):
        context = [rng.choice(ids) for _ in range(rng.randrange(2, 12))]
        want_m, places = 0, []
        for m in range(min(8, len(context)), 1, -1):
            places = [s for s in range(len(corpus) - m + 1) if corpus[s:s + m] == context[-m:]]
            if places:
                want_m = m
                break
        want = sorted(until_negative(corpus[s + want_m:s + want_m + 4]) for s in places)
        m, lo, hi = store.longest_match(context, 2, 8)
        got = [] if m == 0 else sorted(map(until_negative, store.continuations(lo, hi, m, 4, 10**6).tolist()))
        if (m, hi - lo if m else 0, got) != (want_m, len(places) if want_m else 0, want if want_m else []):
            bad.append((context, (m, got), (want_m, want)))
    return bad


def until_negative(row: list[int]) -> tuple[int, ...]:
    """A continuation up to a document's end (a negative id)."""
    return tuple(row[:next((i for i, t in enumerate(row) if t < 0), len(row))])


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("ids", [(0, 1, 2, 3, 4), (0, 70_000, 150_000, 262_140, 5), (0, 1, 2 ** 30)],
                         ids=["small vocabulary", "18-bit ids", "31-bit ids"])
def test_the_datastore_finds_what_a_brute_force_scan_finds(ids, path, monkeypatch):
    """Its keys pack 64 // bits tokens each (4 of a 49k vocabulary, 3 of 18-bit ids, 2 of 31-bit ids): a query of 8
    tokens narrows over 2 to 4 keys, the last one partly; the native lookup (csrc/suffix.h) and numpy's alike."""
    if path == "numpy":
        monkeypatch.setattr(Datastore, "native_views", lambda self: None)
    else:
        assert Datastore.build(np.array([1, 2, -1], dtype=np.int32), 8, 4).native_views() is not None
    for seed in range(5):
        assert retrieval_mismatches(seed, ids=list(ids)) == []


@pytest.mark.parametrize("seed", range(4))
def test_the_native_voted_chain_is_the_voted_chain_of_the_continuations(seed):
    """Every match of a random corpus of few distinct tokens (many occurrences, ties, documents ending inside the
    depth): the chain of csrc/suffix.h equals `voted_chain` over numpy's continuations, with few or many candidates."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(40):
        corpus += [rng.randrange(4) for _ in range(rng.randrange(1, 30))] + [-1]
    store = Datastore.build(np.array(corpus, dtype=np.int32), 8, 6)
    assert store.native_views() is not None
    for _ in range(200):
        context = [rng.randrange(4) for _ in range(rng.randrange(2, 10))]
        m, lo, hi = store.longest_match(context, 1, 8)
        if m:
            for depth, candidates in ((1, 1), (6, 3), (6, 64), (4, 10**6)):
                want = voted_chain(store.continuations(lo, hi, m, depth, candidates))
                assert store.voted_chain(lo, hi, m, depth, candidates) == want


def test_the_brute_force_scan_catches_a_planted_datastore_bug(monkeypatch):
    """Planted: the suffix array sorted by 2 tokens instead of max_match + 32, so a longer query's occurrences are
    not contiguous in it: the scan tells at once, where output equality never would (verification corrects drafts)."""
    from specdec.drafting import datastore

    real = datastore.suffix_array
    monkeypatch.setattr(datastore, "suffix_array", lambda tokens, depth: real(tokens, 2))
    assert sum(len(retrieval_mismatches(seed)) for seed in range(5)) >= 5
