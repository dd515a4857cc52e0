"""A retrieval datastore: a corpus of token ids (documents separated by -1) and its suffix array, and what follows
a sequence's longest suffix found in it (REST's lookup, `drafting/retrieval.py`'s drafter reads it).

The suffix array is sorted by each suffix's first `max_match + SORT_DEPTH_EXTRA` tokens (prefix doubling in numpy,
int32: 4 bytes a corpus token, 8 with the tokens). A lookup is binary searches in it: natively where the kernels run
(csrc/suffix.h, comparing tokens in place), else over packed keys in numpy; both give the same answers.
"""
from __future__ import annotations

import numpy as np
import torch

from specdec.drafting.suffix import Node
from specdec.models.cpu import native

SORT_DEPTH_EXTRA = 32  # the suffix array orders suffixes by max_match + this many tokens


def suffix_array(tokens: np.ndarray, depth: int) -> np.ndarray:
    """Start positions of the suffixes of `tokens` ordered by their first `depth` tokens (ties by position), with
    a separator (-1) before every token and the end before everything (prefix doubling: log2(depth) sorts)."""
    n = len(tokens)
    rank = tokens.astype(np.int64) + 2  # end of text 0, separator 1, token t: t + 2
    sa = np.argsort(rank, kind="stable")
    k = 1
    while k < depth:
        nxt = np.zeros(n, dtype=np.int64)
        nxt[:n - k] = rank[k:]
        sa = np.lexsort((nxt, rank))
        r, x = rank[sa], nxt[sa]
        new = np.cumsum(np.r_[True, (r[1:] != r[:-1]) | (x[1:] != x[:-1])])
        rank = np.empty(n, dtype=np.int64)
        rank[sa] = new
        k *= 2
        if new[-1] == n:  # every suffix told apart
            break
    return sa.astype(np.int32)


class Datastore:
    """A corpus and its suffix array: occurrences of a token sequence and what follows them.

    A lookup is binary searches in the suffix array: natively, comparing the suffixes' tokens in place (csrc/suffix.h);
    without the native kernels, in C by `np.searchsorted`, not a Python loop over windows: each sorted suffix's first
    `max_match` tokens are packed into keys of `per_key` tokens each (their ranks, `bits` bits apiece, in a uint64), so
    the keys of chunk c ascend within every range of equal earlier chunks, and a query narrows its range chunk by chunk
    (on the default model's 1.5 M-token answers: 296 us a longest-match lookup as Python bisection over windows, tens
    of microseconds by keys, packed on the first such lookup: 8 bytes a token per key)."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray, pad: int, max_match: int = 16) -> None:
        self.n, self.sa = len(tokens), sa
        # ranks as the suffix array sorts them: end of text (padding) 0, separator 1, token t: t + 2
        self.bits = max(2, int(tokens.max(initial=0)) + 2).bit_length()
        self.per_key = 64 // self.bits
        self.chunks = -(-max_match // self.per_key)
        pad = max(pad, self.chunks * self.per_key)  # windows and keys never run off the end
        self.tokens = np.concatenate([tokens, np.full(pad, -2, dtype=np.int32)])
        self._keys: list[np.ndarray] | None = None
        self._native = None  # the native lookups' views of the arrays (`native_views`), made on the first lookup

    @property
    def keys(self) -> list[np.ndarray]:
        """Per chunk of per_key tokens: [n] uint64, in suffix-array order (the numpy lookups')."""
        if self._keys is None:
            rank = (self.tokens.astype(np.int64) + 2).astype(np.uint64)
            starts = self.sa.astype(np.int64)
            self._keys = []
            for c in range(self.chunks):
                key = np.zeros(self.n, dtype=np.uint64)
                for j in range(self.per_key):
                    key = (key << np.uint64(self.bits)) | rank[starts + c * self.per_key + j]
                self._keys.append(key)
        return self._keys

    def native_views(self) -> tuple | None:
        """(the native module, its views of the suffix array and tokens): the lookups in one call each
        (csrc/suffix.h, the same answers); None where the kernels cannot be built (the numpy path then)."""
        if self._native is None:
            ok = native.available() and self.sa.dtype == np.int32 and self.tokens.dtype == np.int32
            self._native = (native.ops(), torch.from_numpy(np.ascontiguousarray(self.sa)),
                            torch.from_numpy(self.tokens)) if ok else False
        return self._native or None

    @classmethod
    def build(cls, tokens: np.ndarray, max_match: int, depth: int) -> Datastore:
        return cls(tokens, suffix_array(tokens, max_match + SORT_DEPTH_EXTRA), max_match + depth, max_match)

    def find(self, query: list[int]) -> tuple[int, int]:
        """The suffix-array range [lo, hi) of the suffixes that start with `query` (at most max_match tokens)."""
        lo, hi, per, bits = 0, self.n, self.per_key, self.bits
        if len(query) > per * len(self.keys):
            raise ValueError(f"a query of {len(query)} tokens is longer than the datastore's keys")
        top = (1 << bits) - 1
        for c in range(0, len(query), per):
            part = query[c:c + per]
            low = 0
            for t in part:
                if not 0 <= t + 2 <= top:  # a token the corpus never holds
                    return lo, lo
                low = (low << bits) | (t + 2)
            free = bits * (per - len(part))  # the chunk's tokens past the query: anything
            keys = self.keys[c // per][lo:hi]
            a = int(np.searchsorted(keys, np.uint64(low << free), "left"))
            b = int(np.searchsorted(keys, np.uint64((low << free) | ((1 << free) - 1)), "right"))
            lo, hi = lo + a, lo + b
            if lo >= hi:
                return lo, lo
        return lo, hi

    def longest_match(self, context: list[int], min_match: int, max_match: int) -> tuple[int, int, int]:
        """(length, lo, hi) of the longest suffix of `context` (min_match..max_match tokens) found in the corpus;
        length 0 when none is."""
        if (views := self.native_views()) is not None:
            if max_match > self.chunks * self.per_key:
                raise ValueError(f"a query of {max_match} tokens is longer than the datastore's keys")
            m, lo, hi = views[0].suffix_longest_match(views[1], views[2], context[-max_match:], min_match, max_match)
            return m, lo, hi
        lo_m, hi_m = min_match - 1, min(max_match, len(context))
        best = (0, 0, 0)
        while lo_m < hi_m:  # bisection on the length: a present suffix's shorter suffixes are present too
            mid = (lo_m + hi_m + 1) // 2
            a, b = self.find(context[len(context) - mid:])
            if b > a:
                lo_m, best = mid, (mid, a, b)
            else:
                hi_m = mid - 1
        return best

    def continuations(self, lo: int, hi: int, m: int, depth: int, max_candidates: int) -> np.ndarray:
        """[n, depth] the tokens after up to `max_candidates` occurrences (evenly spread over [lo, hi)); a
        document's end shows as a negative id."""
        n = min(hi - lo, max_candidates)
        span = hi - 1 - lo  # n indices from lo to hi - 1, evenly spread (rounded half up), distinct since n <= span + 1
        idx = lo + (np.arange(n, dtype=np.int64) * (2 * span) + (n - 1)) // (2 * (n - 1)) if n > 1 else \
            np.array([lo], dtype=np.int64)
        starts = self.sa[idx].astype(np.int64) + m
        return self.tokens[starts[:, None] + np.arange(depth)]

    def voted_chain(self, lo: int, hi: int, m: int, depth: int, max_candidates: int) -> list[int]:
        """`voted_chain` of `continuations`, in one native call where the kernels run."""
        if (views := self.native_views()) is not None:
            return views[0].suffix_voted_chain(views[1], views[2], lo, hi, m, depth, max_candidates)
        return voted_chain(self.continuations(lo, hi, m, depth, max_candidates))


def count_trie(rows: np.ndarray) -> Node:
    """A trie of the continuations, each node counting the rows through it (a row stops at its first negative id)."""
    root = Node()
    for row in rows.tolist():
        node = root
        for t in row:
            if t < 0:
                break
            child = node.get(t) or node.add(t)
            child.count += 1
            node = child
    return root


def voted_chain(rows: np.ndarray) -> list[int]:
    """The continuation most rows [n, depth] agree on, token by token (each position's most frequent token among the
    rows that agree so far; ties: the first row's), up to a document's end. On host lists: n is at most
    `max_candidates`, where numpy's per-call overhead would cost more than the counting."""
    chain, candidates = [], rows.tolist()
    for j in range(rows.shape[1]):
        counts: dict[int, int] = {}
        for row in candidates:
            if row[j] >= 0:
                counts[row[j]] = counts.get(row[j], 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)  # the first maximum
        chain.append(token)
        candidates = [row for row in candidates if row[j] == token]
    return chain
