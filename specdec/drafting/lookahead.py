"""Lookahead decoding (Fu et al. 2024): Jacobi iterations over a window of guessed future tokens feed an
n-gram pool, and n-grams from the pool that start with the last committed token are verified.

Each step one tree hangs from the last committed token (at position L - 1):

    guess branches:  up to G pool n-grams keyed by that token, N - 1 tokens each       (verification branch)
    window:          W guesses for positions L .. L + W - 1, as one chain                   (lookahead branch)

Branches that share a prefix share nodes. The target scores every node in the one verification forward;
`observe_draft` then hands back its most likely token after each of them. After window token i it is the
next Jacobi iterate for position L + i + 1, so the iterates form a new level over the window's positions,
and every diagonal through the last N - 1 levels and the new one (level -(N-1) at p - N + 1, ..., the new
level at p) is an n-gram trajectory that goes into the pool. The next window starts where the committed
text now ends, from the newest iterate at each position (the pool's continuation, or the previous token,
where none reaches).

The window is also a draft like any other: when the Jacobi iterates have converged it is accepted as is.
Proposals are deterministic (q = one-hot), so verification stays lossless at any temperature. The pool and
levels are per request; their size is bounded by `lookahead_max_pool` n-grams per key and N - 1 levels.
"""
from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, check_int
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.tree import ROOT


@dataclass
class LookaheadOptions:
    lookahead_window: int = 4  # W: Jacobi window (future positions guessed and iterated each step)
    lookahead_ngram: int = 3  # N: n-gram size (each verified guess is N - 1 tokens after the last token)
    lookahead_guesses: int = 2  # G: pool n-grams verified per step
    lookahead_max_pool: int = 8  # n-grams kept per first token (the most recent)

    def __post_init__(self) -> None:
        check_int("lookahead_window", self.lookahead_window, 1, 15)
        check_int("lookahead_ngram", self.lookahead_ngram, 2, 16)
        check_int("lookahead_guesses", self.lookahead_guesses, 0, 15)
        check_int("lookahead_max_pool", self.lookahead_max_pool, 1, 1024)


class NgramPool:
    """first token -> its most recent distinct continuations (N - 1 tokens each), newest first."""

    def __init__(self, max_per_key: int) -> None:
        self.max_per_key = max_per_key
        self.grams: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: tuple[int, ...]) -> None:
        conts = self.grams.setdefault(gram[0], OrderedDict())
        conts.pop(gram[1:], None)
        conts[gram[1:]] = None
        while len(conts) > self.max_per_key:
            conts.popitem(last=False)

    def lookup(self, token: int, n: int) -> list[tuple[int, ...]]:
        conts = self.grams.get(token)
        return list(reversed(conts))[:n] if conts else []

    def __len__(self) -> int:
        return sum(len(c) for c in self.grams.values())


@dataclass
class _State:
    """One request's Jacobi state: the last N - 1 levels (position -> token), oldest first, the pool, and what
    was fed in the last draft (its root position and, per window position, the node that held it)."""

    levels: deque
    pool: NgramPool
    window_nodes: dict[int, int] = field(default_factory=dict)  # position -> node index in the last draft
    root: int = -1  # position of the last draft's root (the last committed token then)


@register_method("lookahead", LookaheadOptions, trees=True)
class LookaheadDrafter(Drafter):
    observe_drafts = True

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv | None = None) -> LookaheadDrafter:
        o = cfg.options
        return cls(cfg.num_speculative_tokens, o.lookahead_window, o.lookahead_ngram, o.lookahead_guesses,
                   o.lookahead_max_pool)

    def __init__(self, num_speculative_tokens: int, window: int = 4, ngram: int = 3, guesses: int = 2,
                 max_pool: int = 8) -> None:
        self.k, self.W, self.N, self.G, self.max_pool = num_speculative_tokens, window, ngram, guesses, max_pool
        self.states: dict[int, _State] = {}

    def propose(self, requests: list[DraftRequest]) -> Draft:
        return Draft.from_rows([self._draft(r) for r in requests])

    def _draft(self, r: DraftRequest) -> tuple[list[int], list[int]]:
        state = self.states.get(r.seq_id)
        if state is None:
            state = self.states[r.seq_id] = _State(deque(maxlen=self.N - 1), NgramPool(self.max_pool))
            state.levels.append(self._initial_window(r.token_ids))
        L = len(r.token_ids)
        state.root, state.window_nodes = L - 1, {}
        budget = min(self.k, r.max_tokens)
        depth = budget if r.max_depth is None else min(budget, r.max_depth)
        if budget <= 0 or depth <= 0:
            return [], []
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

        def insert(chain: list[int]) -> list[int]:
            """Add a chain below the root, sharing nodes with earlier ones; the node of each token kept."""
            nodes, parent = [], ROOT
            for t in chain[:depth]:
                node = children.get((parent, t))
                if node is None:
                    if len(tokens) == budget:
                        break
                    node = children[(parent, t)] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                nodes.append(node)
                parent = node
            return nodes

        for gram in state.pool.lookup(r.token_ids[-1], self.G):
            insert(list(gram))
        window = self._window(state, r.token_ids)
        for i, node in enumerate(insert(window)):
            state.window_nodes[L + i] = node
        return tokens, parents

    def _initial_window(self, token_ids: list[int]) -> dict[int, int]:
        """Guesses before any iteration: tokens drawn from the prompt (seeded by its content, so a run repeats)."""
        rng = random.Random(hash(tuple(token_ids[-64:])))
        L = len(token_ids)
        return {L + i: rng.choice(token_ids) for i in range(self.W)}

    def _window(self, state: _State, token_ids: list[int]) -> list[int]:
        """This step's W guesses for positions L .. L + W - 1: the newest iterate at each position; past the
        last one, the pool's continuation of the previous guess, or that guess again."""
        newest, L = state.levels[-1], len(token_ids)
        window: list[int] = []
        prev = token_ids[-1]
        for p in range(L, L + self.W):
            t = newest.get(p)
            if t is None:
                conts = state.pool.lookup(prev, 1)
                t = conts[0][0] if conts else prev
            window.append(t)
            prev = t
        return window

    def observe_draft(self, seq_id: int, tokens: list[int], predictions: list[int]) -> None:
        """predictions[0]: the target's most likely token after the root; predictions[1 + j]: after node j."""
        state = self.states.get(seq_id)
        if state is None or not state.window_nodes:
            return
        fed = {p: tokens[node] for p, node in state.window_nodes.items() if node < len(tokens)}
        new = {state.root + 1: predictions[0]}
        for p, node in state.window_nodes.items():
            if node + 1 < len(predictions):
                new[p + 1] = predictions[node + 1]
        state.levels[-1] = fed  # the level that was actually fed (guesses cut by the budget are gone)
        history = list(state.levels)  # oldest first; the fed level last
        for p, t in new.items():
            gram = [t]
            for back, level in enumerate(reversed(history), start=1):
                if len(gram) == self.N:
                    break
                prev = level.get(p - back)
                if prev is None:
                    break
                gram.append(prev)
            if len(gram) == self.N:
                state.pool.add(tuple(reversed(gram)))
        state.levels.append(new)

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
