"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): draft the continuations that most often followed the
current suffix, as a tree whose size follows how long and how sure the match is.

Two frequency tables of bounded depth (`suffix_decoding_max_tree_depth`) count every substring of their texts
up to that length:
- the request's own prompt and output, searched in place (`TextIndex`: the trie's answers from the text with
  numpy, nothing built per request);
- a global trie over the outputs of the last `suffix_decoding_max_cached_requests` finished requests (the
  oldest is subtracted out when a new one comes in, so memory stays bounded: about `max_tree_depth` nodes per
  cached output token at most).

A step finds, in each trie, the longest suffix of the sequence (p tokens) that has a continuation. From that
node it grows a tree best first: a child's estimated probability is its parent's times the share of the
parent's continuations that go its way. Nodes are taken while their probability is at least
`suffix_decoding_min_token_prob` and the tree has fewer than `max_spec_factor * p` nodes (a longer match
earns a larger tree) and `num_speculative_tokens`. The trie whose tree has the larger expected number of
accepted tokens (the sum of its nodes' probabilities) drafts. Proposals are deterministic (q = one-hot), so
greedy verification keeps the output identical to plain decoding and sampling keeps the target's
distribution.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, check_int, check_number
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.tree import ROOT


@dataclass
class SuffixOptions:
    """Keys as vLLM's suffix decoding names them."""

    suffix_decoding_max_tree_depth: int = 24  # longest suffix matched, and deepest path kept in a trie
    suffix_decoding_max_cached_requests: int = 256  # finished outputs kept in the global trie (0: none)
    suffix_decoding_max_spec_factor: float = 1.0  # a tree has at most factor * (match length) nodes
    suffix_decoding_min_token_prob: float = 0.1  # nodes estimated less likely than this are not drafted

    def __post_init__(self) -> None:
        check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1, 256)
        check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0, 1 << 20)
        check_number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0, 64, open_low=True)
        check_number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0, 1)


class Node:
    """A substring's occurrence count and its one-token extensions. Most nodes of a text's trie have one
    child, so that case lives in two slots and only branching nodes hold a dict (a node then takes about 70
    bytes instead of about 300)."""

    __slots__ = ("count", "token", "child", "more")

    def __init__(self) -> None:
        self.count = 0
        self.token, self.child = -1, None  # the only child, when there is exactly one
        self.more: dict[int, Node] | None = None  # token -> child, when there are several

    def get(self, token: int) -> Node | None:
        if self.more is not None:
            return self.more.get(token)
        return self.child if self.token == token else None

    def add(self, token: int) -> Node:
        node = Node()
        if self.more is not None:
            self.more[token] = node
        elif self.child is None:
            self.token, self.child = token, node
        else:
            self.more, self.token, self.child = {self.token: self.child, token: node}, -1, None
        return node

    def remove(self, token: int) -> None:
        if self.more is None:
            self.token, self.child = -1, None
            return
        del self.more[token]
        if len(self.more) == 1:
            (self.token, self.child), = self.more.items()
            self.more = None

    def children(self) -> dict[int, Node]:
        if self.more is not None:
            return self.more
        return {self.token: self.child} if self.child is not None else {}


class SuffixTrie:
    """Occurrence counts of every substring (up to `max_depth` tokens) of the texts added to it."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 0

    def add(self, tokens: list[int], active: list[Node] | None = None, sign: int = 1) -> list[Node]:
        """Count (sign=1) or uncount (sign=-1) the substrings ending at each of `tokens`, continuing the text
        whose trailing suffixes are the nodes `active` (shortest first; None: a new text). Returns the nodes of
        the text's trailing suffixes, to continue it later. Uncounting removes nodes that reach zero."""
        active = list(active or [])
        keep = self.max_depth - 1  # a node of the deepest suffix has no child: it would exceed max_depth
        for t in tokens:
            nxt = []
            # deepest first: in periodic text a shorter suffix's extension can hold a longer one's below it,
            # and uncounting the deeper one first keeps a node from being taken away twice
            for node in reversed([self.root, *active[:keep]]):
                child = node.get(t)
                if child is None:
                    if sign < 0:
                        continue  # not counted: nothing to take away
                    child = node.add(t)
                    self.num_nodes += 1
                child.count += sign
                if child.count <= 0:
                    node.remove(t)
                    self.num_nodes -= 1 + _subtree_size(child)
                    continue
                nxt.append(child)
            active = nxt[::-1]
        return active

    def match(self, tokens: list[int]) -> tuple[Node | None, int]:
        """The node of the longest suffix of `tokens` (at most max_depth) that has a continuation, and its length.
        A suffix's presence implies every shorter one's, so the longest present suffix is found by bisection."""
        def walk(n: int) -> Node | None:
            node = self.root
            for t in tokens[len(tokens) - n:]:
                node = node.get(t)
                if node is None:
                    return None
            return node

        lo, hi = 0, min(self.max_depth, len(tokens))  # walk(lo) exists (the root); find the largest that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if walk(mid) is not None:
                lo = mid
            else:
                hi = mid - 1
        for n in range(lo, 0, -1):  # the deepest present suffix may have no continuation yet: back off
            node = walk(n)
            if node.child is not None or node.more:
                return node, n
        return None, 0


class TextIndex:
    """The same answers as a SuffixTrie over one text (`match`, and nodes with a `count` and `children()`), found
    in the text itself with numpy: a node is the array of positions where its substring ends. A request's own
    text (its prompt, then its output) is searched this way instead of a trie of every substring up to
    max_depth, whose Python nodes cost ~3 us each to build: ~40 ms for a 600-token prompt (an agent's tools and
    instructions), paid again by every request. A step now costs a few vector scans of the text."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.text = np.empty(256, dtype=np.int64)
        self.length = 0

    def update(self, tokens: list[int]) -> None:
        """Make the text `tokens`: append what is new (the text only grows, except after a rewind)."""
        n = len(tokens)
        if n < self.length:
            self.length = 0
        if n > len(self.text):
            grown = np.empty(max(n, 2 * len(self.text)), dtype=np.int64)
            grown[:self.length] = self.text[:self.length]
            self.text = grown
        self.text[self.length:n] = tokens[self.length:]
        self.length = n

    def match(self, tokens: list[int]) -> tuple[IndexNode | None, int]:
        """The node of the longest suffix of the text (fewer than max_depth tokens, like a trie's deepest nodes
        with children) that occurred before with a token after it, and its length; `tokens` is the text."""
        T, L = self.text, self.length
        if L < 2 or self.max_depth < 2:
            return None, 0
        ends = np.flatnonzero(T[:L - 1] == T[L - 1])  # earlier occurrences of the last token
        n = 0
        while len(ends) and n + 1 < min(self.max_depth, L):
            n += 1
            if n == self.max_depth - 1 or n == L - 1:
                break
            longer = ends[ends >= n]
            longer = longer[T[longer - n] == T[L - 1 - n]]
            if not len(longer):
                break
            ends = longer
        if n == 0:
            return None, 0
        return IndexNode(self, np.append(ends, L - 1), n), n


class IndexNode:
    """A substring of a TextIndex's text: where its occurrences end (`ends`) and its length."""

    __slots__ = ("index", "ends", "depth")

    def __init__(self, index: TextIndex, ends: np.ndarray, depth: int) -> None:
        self.index, self.ends, self.depth = index, ends, depth

    @property
    def count(self) -> int:
        return len(self.ends)

    def children(self) -> dict[int, IndexNode]:
        """Continuations in the order they first occur (a trie's insertion order)."""
        if self.depth >= self.index.max_depth:
            return {}
        ends = self.ends[self.ends + 1 < self.index.length] + 1
        nxt = self.index.text[ends]
        tokens, first, inverse = np.unique(nxt, return_index=True, return_inverse=True)
        return {int(tokens[k]): IndexNode(self.index, ends[inverse == k], self.depth + 1) for k in np.argsort(first)}


def _subtree_size(node: Node) -> int:
    size, stack = 0, list(node.children().values())
    while stack:
        n = stack.pop()
        size += 1
        stack.extend(n.children().values())
    return size


def grow(node: Node | IndexNode, max_nodes: int, max_depth: int, min_prob: float
         ) -> tuple[list[int], list[int], list[float]]:
    """The most probable continuations of `node` as a tree, best first: tokens, parents (ROOT for its children)
    and each node's estimated probability (their sum is the expected number of accepted tokens)."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    tie = 0
    heap: list[tuple[float, int, int, int, Node, int]] = []  # (-prob, tie, token, parent index, node, depth)

    def push(parent: Node, index: int, prob: float, depth: int) -> None:
        nonlocal tie
        if depth > max_depth:
            return
        children = parent.children()
        total = sum(c.count for c in children.values())
        for t, child in children.items():
            p = prob * child.count / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, tie, t, index, child, depth))
                tie += 1

    push(node, ROOT, 1.0, 1)
    while heap and len(tokens) < max_nodes:
        neg, _, t, parent, child, depth = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        probs.append(-neg)
        push(child, len(tokens) - 1, -neg, depth + 1)
    return tokens, parents, probs


@dataclass
class _Text:
    """A running request: its text indexed, the live token list, and where its prompt ends (what follows goes to
    the global trie when it finishes)."""

    index: TextIndex
    tokens: list[int]
    prompt_len: int


@register_method("suffix", SuffixOptions)
class SuffixDrafter(Drafter):
    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv | None = None) -> SuffixDrafter:
        o = cfg.options
        return cls(cfg.num_speculative_tokens, o.suffix_decoding_max_tree_depth, o.suffix_decoding_max_cached_requests,
                   o.suffix_decoding_max_spec_factor, o.suffix_decoding_min_token_prob)

    def __init__(self, num_speculative_tokens: int, max_depth: int = 24, max_cached_requests: int = 256,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        self.k, self.max_depth, self.max_cached = num_speculative_tokens, max_depth, max_cached_requests
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self.global_trie = SuffixTrie(max_depth)
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # outputs in the global trie, oldest first
        self.texts: dict[int, _Text] = {}

    def propose(self, requests: list[DraftRequest]) -> Draft:
        rows = []
        for r in requests:
            text = self.texts.get(r.seq_id)
            if text is None:
                text = self.texts[r.seq_id] = _Text(TextIndex(self.max_depth), r.token_ids,
                                                    len(r.token_ids) - r.num_new)
            text.tokens = r.token_ids
            text.index.update(r.token_ids)
            rows.append(self.draft_one(text.index, r))
        return Draft.from_rows(rows)

    def draft_one(self, own: TextIndex, r: DraftRequest) -> tuple[list[int], list[int], list[float]]:
        """The better of the two trees (by expected accepted tokens), from the request's own text and from the
        global trie, for one request."""
        budget = min(self.k, r.max_tokens)
        depth = budget if r.max_depth is None else min(budget, r.max_depth)
        best: tuple[list[int], list[int], list[float]] = ([], [], [])
        for source in (own, self.global_trie):
            node, n = source.match(r.token_ids)
            if node is not None and depth > 0:
                found = grow(node, min(budget, math.ceil(self.factor * n)), depth, self.min_prob)
                if sum(found[2]) > sum(best[2]):
                    best = found
        return best

    def forget(self) -> None:
        self.global_trie = SuffixTrie(self.max_depth)
        self.cached.clear()

    def release(self, seq_id: int) -> None:
        text = self.texts.pop(seq_id, None)
        if text is None or self.max_cached == 0:
            return
        output = list(text.tokens[text.prompt_len:])
        if not output:
            return
        self.global_trie.add(output)
        self.cached[seq_id] = output
        while len(self.cached) > self.max_cached:
            _, old = self.cached.popitem(last=False)
            self.global_trie.add(old, sign=-1)
