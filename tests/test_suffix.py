"""Suffix decoding: the frequency tries (hand-worked tables), their memory bound, the trees they grow, and
that the engine's output never depends on them."""
from __future__ import annotations

import random

import pytest
from conftest import every_step
from test_drafters import GREEDY, PROMPTS, reference, target_dir  # noqa: F401 (module fixtures)

from specdec import LLM, SpecdecError
from specdec.drafting.base import DraftRequest
from specdec.drafting.suffix import SuffixDrafter, SuffixTrie, TextIndex, grow


def table(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every stored substring with its count."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.children().items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def test_trie_counts_every_substring_up_to_its_depth():
    trie = SuffixTrie(3)
    trie.add([1, 2, 1, 3, 1, 2])
    assert table(trie) == {
        (1,): 3, (2,): 2, (3,): 1,
        (1, 2): 2, (2, 1): 1, (1, 3): 1, (3, 1): 1,
        (1, 2, 1): 1, (2, 1, 3): 1, (1, 3, 1): 1, (3, 1, 2): 1,
    }
    assert trie.num_nodes == 11


def test_trie_grows_incrementally_to_the_same_table():
    tokens = [4, 5, 4, 5, 6, 4, 5, 4, 7, 5, 4, 5]
    whole, parts = SuffixTrie(4), SuffixTrie(4)
    whole.add(tokens)
    active = None
    for start in range(0, len(tokens), 5):
        active = parts.add(tokens[start:start + 5], active)
    assert table(parts) == table(whole)
    assert parts.num_nodes == whole.num_nodes == len(table(whole))


def test_uncounting_a_text_leaves_the_table_of_the_others():
    """On random texts over 3 tokens (periodic runs included, where one suffix's node lies below another's),
    adding texts A, B, C and taking B away gives exactly the trie of A and C, node count included."""
    rng = random.Random(1)
    for _ in range(2000):
        depth = rng.randrange(1, 6)
        a, b, c = ([rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(3))
        trie, expected = SuffixTrie(depth), SuffixTrie(depth)
        for text in (a, b, c):
            trie.add(text)
        trie.add(b, sign=-1)
        expected.add(a)
        expected.add(c)
        assert table(trie) == table(expected), (depth, a, b, c)
        assert trie.num_nodes == len(table(expected))


def test_match_finds_the_longest_suffix_that_was_continued():
    trie = SuffixTrie(8)
    tokens = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    trie.add(tokens)
    node, n = trie.match(tokens)
    assert n == 3 and set(node.children()) == {9}  # [1, 2, 3] seen once before, followed by 9
    node, n = trie.match(tokens + [5])
    assert (node, n) == (None, 0)  # 5 never appeared before
    node, n = trie.match([7, 2, 3])
    assert n == 2 and {t: c.count for t, c in node.children().items()} == {9: 1, 8: 1}


def test_grow_takes_the_most_probable_continuations_above_the_threshold():
    trie = SuffixTrie(6)
    # [0, 1] is continued by 2 three times and by 3 once; [0, 1, 2] by 5 twice and by 6 once
    trie.add([0, 1, 2, 5, 0, 1, 2, 5, 0, 1, 2, 6, 0, 1, 3, 0])
    node, n = trie.match([0, 1])
    assert n == 2
    tokens, parents, probs = grow(node, max_nodes=8, max_depth=2, min_prob=0.2)
    # 2: 3/4; 5: 3/4 * 2/3 = 1/2; then 1/4 each (equal ones in the order they were reached): 3, 6, and 0
    # under 3 ([0, 1, 3, 0]); the depth cap keeps the third level out
    assert tokens == [2, 5, 3, 6, 0] and parents == [-1, 0, -1, 0, 2]
    assert probs == pytest.approx([0.75, 0.5, 0.25, 0.25, 0.25])
    tokens, parents, _ = grow(node, max_nodes=8, max_depth=2, min_prob=0.3)
    assert tokens == [2, 5] and parents == [-1, 0]  # the 1/4 ones fall below 0.3
    tokens, _, _ = grow(node, max_nodes=1, max_depth=2, min_prob=0.0)
    assert tokens == [2]


def test_a_texts_index_answers_as_its_trie_does():
    """A request's own text is searched in place (TextIndex) instead of a trie of its substrings: on random texts
    (periodic runs included), every depth, and the text growing step by step, the match and the grown tree equal
    the trie's, tokens, parents and probabilities."""
    rng = random.Random(2)
    for _ in range(400):
        depth = rng.randrange(1, 8)
        text = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(1, 40))]
        index = TextIndex(depth)
        for end in sorted({rng.randrange(1, len(text) + 1) for _ in range(3)} | {len(text)}):
            trie = SuffixTrie(depth)
            trie.add(text[:end])
            index.update(text[:end])
            (want, n), (got, m) = trie.match(text[:end]), index.match(text[:end])
            assert n == m, (depth, text[:end])
            if want is not None:
                assert got.count == want.count
                for max_nodes, min_prob in ((8, 0.1), (20, 0.0)):
                    assert grow(got, max_nodes, depth, min_prob) == grow(want, max_nodes, depth, min_prob)
    index.update([5, 6])  # a rewound text is indexed again
    assert index.length == 2 and index.match([5, 6]) == (None, 0)


def test_the_drafter_sizes_its_tree_by_the_match_length():
    drafter = SuffixDrafter(8, max_depth=16, max_cached_requests=0, max_spec_factor=1.0, min_token_prob=0.1)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    draft = drafter.propose([DraftRequest(0, tokens, len(tokens), 8)])
    assert draft.tokens[0].tolist() == [4, 5, 6] and draft.parents[0].tolist() == [-1, 0, 1]  # 3 matched: 3 nodes
    tokens.append(4)
    draft = drafter.propose([DraftRequest(0, tokens, 1, 8)])
    assert draft.tokens[0].tolist() == [5, 6, 7, 8]  # a 4-token match earns 4
    draft = drafter.propose([DraftRequest(0, tokens, 0, 2)])
    assert draft.tokens[0].tolist() == [5, 6]  # never more than the step may verify


def test_global_trie_learns_finished_outputs_and_forgets_the_oldest():
    drafter = SuffixDrafter(4, max_depth=4, max_cached_requests=2)
    outputs = {1: [10, 11, 12, 13], 2: [20, 21, 22, 23], 3: [30, 31, 32, 33]}
    for seq_id, out in outputs.items():
        prompt = [7, 7]
        drafter.propose([DraftRequest(seq_id, prompt + out[:1], 1, 4)])  # the prompt ends before the first output
        tokens = prompt + out
        drafter.propose([DraftRequest(seq_id, tokens, 3, 4)])
        drafter.release(seq_id)
    expected = SuffixTrie(4)
    for out in (outputs[2], outputs[3]):  # only the last two outputs; the prompts never enter
        expected.add(out)
    assert table(drafter.global_trie) == table(expected)
    assert drafter.global_trie.num_nodes == len(table(expected))
    assert not drafter.texts  # nothing kept for finished requests
    # a new request that starts like a cached output is drafted from the global trie
    draft = drafter.propose([DraftRequest(9, [5, 30, 31], 3, 4)])
    assert draft.tokens[0].tolist() == [32, 33]


@pytest.mark.parametrize("options", [{},
                                     {"suffix_decoding_max_spec_factor": 4.0, "suffix_decoding_min_token_prob": 0.0},
                                     {"suffix_decoding_max_tree_depth": 2, "suffix_decoding_max_cached_requests": 0}])
def test_suffix_decoding_is_lossless(target_dir, reference, options):
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "suffix", "num_speculative_tokens": 6,
                                                              **options}))
    for _ in range(2):  # the second round also drafts from the first round's outputs (global trie)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_suffix_decoding_one_request_at_a_time_repeats_itself(target_dir, reference):
    """Batch 1, a request after another: the global trie holds the earlier answer, which is drafted whole."""
    llm = LLM(str(target_dir), speculative_config=every_step({"method": "suffix", "num_speculative_tokens": 8}))
    first = llm.generate(PROMPTS[:1], GREEDY)[0]
    again = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert first.token_ids == again.token_ids == reference[0]
    assert again.metrics["acceptance_length"] > first.metrics["acceptance_length"]
    assert again.metrics["acceptance_length"] >= 3
    llm.engine.forget_finished()  # benchmarks do this between passes: the answer is no longer cached
    fresh = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert fresh.token_ids == reference[0] and fresh.metrics["acceptance_length"] == first.metrics["acceptance_length"]


@pytest.mark.parametrize("key, value, message", [
    ("suffix_decoding_max_tree_depth", 0, "suffix_decoding_max_tree_depth"),
    ("suffix_decoding_max_cached_requests", -1, "suffix_decoding_max_cached_requests"),
    ("suffix_decoding_max_spec_factor", 0, "suffix_decoding_max_spec_factor"),
    ("suffix_decoding_min_token_prob", 1.5, "suffix_decoding_min_token_prob"),
])
def test_bad_suffix_options_are_refused(target_dir, key, value, message):
    with pytest.raises(SpecdecError, match=message):
        LLM(str(target_dir), speculative_config=every_step({"method": "suffix", "num_speculative_tokens": 4,
                                                            key: value}))


def brute_force_table(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Every substring of up to `depth` tokens of the texts, counted by scanning them."""
    out: dict[tuple[int, ...], int] = {}
    for text in texts:
        for i in range(len(text)):
            for j in range(i + 1, min(i + depth, len(text)) + 1):
                out[tuple(text[i:j])] = out.get(tuple(text[i:j]), 0) + 1
    return out


def trie_mismatches(seed: int, cases: int = 300) -> int:
    """Random texts over 3 tokens, added in random pieces (continuing each text's trailing suffixes) and one of
    them taken away: how many tries differ from the brute-force count of the texts left."""
    rng = random.Random(seed)
    bad = 0
    for _ in range(cases):
        depth = rng.randrange(1, 6)
        texts = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
        trie = SuffixTrie(depth)
        for text in texts:
            active, at = None, 0
            while at < len(text):
                step = rng.randrange(1, 5)
                active = trie.add(text[at:at + step], active)
                at += step
        trie.add(texts[1], sign=-1)
        bad += table(trie) != brute_force_table([texts[0], texts[2]], depth)
    return bad


def test_trie_counts_equal_a_brute_force_count():
    assert trie_mismatches(3) == 0


def test_the_brute_force_count_catches_a_planted_trie_bug(monkeypatch):
    """Planted: the trie keeps one level too many (`keep = max_depth`), so it stores substrings a token longer than
    its depth; drafts from it would still verify to the same output, but the count differs at once."""
    real = SuffixTrie.add

    def add(self, tokens, active=None, sign=1):
        self.max_depth += 1
        try:
            return real(self, tokens, active, sign)
        finally:
            self.max_depth -= 1

    monkeypatch.setattr(SuffixTrie, "add", add)
    assert trie_mismatches(3) > 50
