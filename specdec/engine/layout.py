"""A step's row layout, computed once per step and read by every stage after the forward (vLLM v1's
`SpecDecodeMetadata`): which rows of the hidden states and of the logits each sequence owns, and which it keeps.

Sequence i feeds its num_fed[i] scheduled tokens (a prefill chunk, or its last committed token), then its
num_drafts[i] draft nodes; the forward's hidden states hold the sequences one after another:

    hidden rows   | seq 0: t t t t | seq 1: t d d d | seq 2: t d |      starts = [0, 4, 8, 10]
    logits rows                    | seq 1: t d d d | seq 2: t d |      (seq 0: a chunk short of its prompt's end)

A sequence whose input is then fully cached is `ready`: it chooses tokens from 1 + num_drafts[i] logits rows, the
distribution after its last fed token, then after each draft node's path. The logits have a layout of their own,
`logits`: ready sequence k feeds one row (its last token) and its draft nodes. After verification a sequence keeps
the rows of its fed tokens and of its accepted draft nodes (`kept_rows`: their K/V are moved down right after the
fed tokens, and their target features go to the drafter).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class StepLayout:
    num_fed: list[int]  # [B] tokens sequence i feeds before its draft
    num_drafts: list[int]  # [B] its draft nodes (0 in a plain or prefill step)
    ready: list[int]  # the sequences that choose tokens this step, in batch order
    starts: list[int]  # [B + 1] sequence i owns rows starts[i] .. starts[i + 1]

    @classmethod
    def build(cls, num_fed: list[int], num_drafts: list[int], ready: list[int] | None = None) -> StepLayout:
        """ready: None when every sequence chooses tokens."""
        starts = list(itertools.accumulate((f + d for f, d in zip(num_fed, num_drafts)), initial=0))
        return cls(num_fed, num_drafts, list(range(len(num_fed))) if ready is None else ready, starts)

    @classmethod
    def of_drafts(cls, num_drafts: list[int]) -> StepLayout:
        """The logits' layout: every sequence's last fed token, then its draft nodes."""
        return cls.build([1] * len(num_drafts), num_drafts)

    def rows(self, i: int) -> range:
        return range(self.starts[i], self.starts[i + 1])

    def fed_rows(self, i: int) -> slice:
        return slice(self.starts[i], self.starts[i] + self.num_fed[i])

    def kept_rows(self, i: int, accepted_nodes: list[int]) -> list[int]:
        """The rows sequence i keeps after verification: its fed tokens', then its accepted draft nodes'."""
        first, after = self.starts[i], self.starts[i] + self.num_fed[i]
        return [*range(first, after), *(after + node for node in accepted_nodes)]

    def kept_index(self, i: int, accepted_nodes: list[int]) -> slice | list[int]:
        """`kept_rows` as an index: a slice where they are consecutive (a chain's accepted prefix), so taking
        them is a view."""
        if accepted_nodes == list(range(len(accepted_nodes))):
            return slice(self.starts[i], self.starts[i] + self.num_fed[i] + len(accepted_nodes))
        return self.kept_rows(i, accepted_nodes)

    @cached_property
    def logits_rows(self) -> list[int]:
        """The hidden row of every logits row: each ready sequence's last fed token, then its draft nodes."""
        return [r for i in self.ready for r in range(self.starts[i] + self.num_fed[i] - 1, self.starts[i + 1])]

    @cached_property
    def logits(self) -> StepLayout:
        """The layout of the step's logits (ready sequence k is sequence k there)."""
        return StepLayout.of_drafts([self.num_drafts[i] for i in self.ready])
