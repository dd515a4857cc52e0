"""Prompt lookup (n-gram) drafting: propose what followed the last time the current suffix appeared.

An index per sequence maps every n-gram (n in [prompt_lookup_min, prompt_lookup_max]) to the positions
right after its occurrences. It is updated only with newly committed tokens, so a step costs
O(new tokens * n-gram sizes), never a scan of the whole history.
"""
from __future__ import annotations

from collections import defaultdict

from specdec.drafting.base import Draft, DraftRequest, Drafter


class NgramIndex:
    """n-gram -> positions that followed it, for one token sequence."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.positions: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.length = 0  # tokens indexed so far

    def extend(self, tokens: list[int]) -> None:
        """Index n-grams ending before each new position: their continuation is that position."""
        for end in range(max(self.length, 1), len(tokens)):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.positions[tuple(tokens[end - n:end])].append(end)
        self.length = max(self.length, len(tokens))

    def lookup(self, tokens: list[int], k: int, latest: bool = True) -> list[int]:
        """Up to k tokens that followed the longest matching suffix earlier in `tokens`."""
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            starts = self.positions.get(tuple(tokens[L - n:]))
            if starts:
                start = starts[-1] if latest else starts[0]
                # the suffix's own occurrence ends at L and is not indexed yet, so start < L
                return tokens[start:start + k]
        return []


class NgramDrafter(Drafter):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
                 match: str = "latest") -> None:
        self.k, self.n_min, self.n_max = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self.latest = match == "latest"
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, requests: list[DraftRequest]) -> Draft:
        proposals = []
        for r in requests:
            index = self.indexes.setdefault(r.seq_id, NgramIndex(self.n_min, self.n_max))
            index.extend(r.token_ids)
            proposals.append(index.lookup(r.token_ids, min(self.k, r.max_tokens), self.latest))
        return Draft.chains(proposals)

    def release(self, seq_id: int) -> None:
        self.indexes.pop(seq_id, None)
