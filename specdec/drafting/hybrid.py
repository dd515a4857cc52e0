"""Hybrid drafting: one verification tree merged from several drafting methods (a head, suffix, retrieval,
n-gram, recycled candidates...), each node kept by its estimated chance of being accepted.

Every source drafts its own chain or tree each step. Their paths are merged by token (a path two sources both
propose is one node). Each source's node gets an estimate of its acceptance probability:

    score = b * g_source(depth)

b is the source's own belief (its `Draft.scores`, e.g. suffix decoding's share of continuations; or the
product of its q along the path when it drafts from a distribution; else 1), and g calibrates it online: per
source and depth, (accepted nodes + 1) / (sum of b over its verified nodes + 2), learnt from what the target
kept at the next step. A merged node scores the best of its sources, capped by its parent's score (a node is
never likelier than its parent). The tree grows best first from the root while its next node's score is at
least `min_score` (the cost of verifying one more token, in plain steps: `tools/verify_cost.py` measures it)
and it has fewer than `num_speculative_tokens` nodes (`min_score` is the engine's measured cost of one more row this
step where it has one, `DraftRequest.row_cost`). Its best node is always taken, and on every
`PROBE_EVERY`-th step so is the path of best children below it, down to the depth cap (probes: g(d) only
learns from verified nodes, so without them a depth whose estimate fell under `min_score` after a few unlucky
steps would never be verified again to raise it).

A source that does not pay is not asked: while its depth-1 calibration g(1) is under `min_score` (every node it
could add alone would score under it, since b <= 1 and a node never outscores its parent) it drafts only every
`PROBE_EVERY`-th step, enough to learn when it starts to pay again, so a weak source costs little time. The
source that reads the target's features drafts every step (its K/V follows the sequence), and every source
drafts at a request's first step (suffix decoding learns there where the prompt ends).

Proposals are deterministic (q = one-hot), whatever the sources drew them from: a token proposed independently
of the target's randomness and verified as one-hot is accepted with probability p(x) and otherwise resampled
from p without x, so greedy output is identical to plain decoding and sampled output keeps the target's
distribution.
"""
from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

from specdec.config import SpecdecError
from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, check_number
from specdec.drafting.nested import NestedDrafter, build_sources
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.tree import PAD, ROOT


@dataclass
class HybridOptions:
    sources: list = field(default_factory=list)  # speculative configs (dicts) of the methods to merge
    min_score: float = 0.15  # a node is verified only if its estimated acceptance is at least this

    def __post_init__(self) -> None:
        if not isinstance(self.sources, list) or not self.sources:
            raise SpecdecError("method 'hybrid' needs 'sources': a list of speculative configs to merge, e.g. "
                               '[{"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix"}]')
        for src in self.sources:
            if not isinstance(src, dict) or "method" not in src:
                raise SpecdecError(f"hybrid source {src!r} must be a speculative config with a 'method'")
            if src["method"] == "hybrid":
                raise SpecdecError("a hybrid source cannot itself be 'hybrid'")
        check_number("min_score", self.min_score, 0, 1)


@dataclass
class _Source:
    drafter: Drafter
    cfg: SpeculativeConfig
    accepted: list[float]  # per depth (1-based index - 1): accepted nodes
    believed: list[float]  # per depth: sum of b over verified nodes

    def calibration(self, depth: int) -> float:
        d = min(depth, len(self.accepted)) - 1
        return (self.accepted[d] + 1.0) / (self.believed[d] + 2.0)


@dataclass
class _Pending:
    """A request's last merged tree, to learn from what the target kept of it."""

    length: int  # the sequence length when it was drafted
    epoch: int
    paths: list[tuple[int, ...]]  # per node, its token path from the root
    beliefs: list[dict[int, float]]  # per node: source index -> b


@register_method("hybrid", HybridOptions, verify_cost_keys=("min_score",))  # `specdec tune` measures min_score
class HybridDrafter(NestedDrafter):
    MAX_DEPTH = 16
    PROBE_EVERY = 8  # a source whose g(1) is under min_score drafts only this one step in so many

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv | None = None) -> HybridDrafter:
        return cls(build_sources(cfg, env), cfg.num_speculative_tokens, cfg.options.min_score)

    def __init__(self, sources: list[tuple[Drafter, SpeculativeConfig]], num_speculative_tokens: int,
                 min_score: float = 0.15) -> None:
        self.sources = [_Source(d, c, [0.0] * self.MAX_DEPTH, [0.0] * self.MAX_DEPTH) for d, c in sources]
        for s in self.sources:
            s.drafter.path_scores = True  # a head's belief in its nodes (b below), where it has one
        self.nest([s.drafter for s in self.sources], "hybrid")
        self.featured = self.sources[self.featured_index] if self.featured_index is not None else None
        self.k, self.min_score = num_speculative_tokens, min_score
        self.pending: dict[int, _Pending] = {}
        self.steps = 0  # propose calls, for the probes of sources that do not pay
        self.known: set[int] = set()  # requests every source has seen
        self.asked = [0] * len(self.sources)  # per source: steps it drafted (for reports and tests)

    def reload_head(self, path: str) -> None:
        """The head source takes the head in `path`; its calibration starts over (it described the old head)."""
        super().reload_head(path)
        self.featured.accepted, self.featured.believed = [0.0] * self.MAX_DEPTH, [0.0] * self.MAX_DEPTH

    # ---- learning from the last verification ---------------------------------------------------------
    def learn(self, r: DraftRequest) -> None:
        last = self.pending.pop(r.seq_id, None)
        if last is None or last.epoch != r.epoch or len(r.token_ids) <= last.length:
            return
        kept = tuple(r.token_ids[last.length:len(r.token_ids) - 1])  # the accepted drafts (then one more token)
        for path, beliefs in zip(last.paths, last.beliefs):
            hit = len(path) <= len(kept) and kept[:len(path)] == path
            d = min(len(path), self.MAX_DEPTH) - 1
            for i, b in beliefs.items():
                self.sources[i].believed[d] += b
                self.sources[i].accepted[d] += hit

    # ---- drafting ------------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> Draft:
        for r in requests:
            self.learn(r)
        self.steps += 1
        periodic = self.steps % self.PROBE_EVERY == 0
        probe = periodic or any(r.seq_id not in self.known for r in requests)
        self.known.update(r.seq_id for r in requests)
        least = min(self.threshold(r) for r in requests) if requests else self.min_score
        drafts = []
        for n, src in enumerate(self.sources):
            if not (probe or src is self.featured or src.calibration(1) >= least):
                drafts.append(Draft.from_rows([([], [])] * len(requests)))
                continue
            self.asked[n] += 1
            shape = src.cfg.shape
            subs = [dataclasses.replace(r, max_tokens=min(shape.num_tokens, r.max_tokens), tree=shape.tree,
                                        dynamic=None, features=r.features if src is self.featured else None)
                    for r in requests]
            drafts.append(src.drafter.propose(subs))
        return Draft.from_rows([self.merge(i, r, drafts, periodic) for i, r in enumerate(requests)])

    def threshold(self, r: DraftRequest) -> float:
        """The least score a node is verified at: what one more row costs this step (`DraftRequest.row_cost`, the
        engine's measured costs), else `min_score`."""
        return r.row_cost if r.row_cost is not None else self.min_score

    def merge(self, i: int, r: DraftRequest, drafts: list[Draft], probe: bool = False) -> tuple[list[int], list[int]]:
        budget, threshold = min(self.k, r.max_tokens), self.threshold(r)
        depth_cap = budget if r.max_depth is None else min(budget, r.max_depth)
        nodes: dict[tuple[int, ...], dict[int, float]] = {}  # path -> source -> b
        for s, draft in enumerate(drafts):
            if draft.tokens.numel() == 0:
                continue
            parents, tokens = draft.parents[i].tolist(), draft.tokens[i].tolist()
            paths: list[tuple[int, ...]] = []
            beliefs: list[float] = []
            for j, (p, t) in enumerate(zip(parents, tokens)):
                if p == PAD or j >= min(self.sources[s].cfg.shape.num_tokens, r.max_tokens):
                    break
                paths.append((t,) if p == ROOT else paths[p] + (t,))
                b = float(draft.scores[i, j]) if draft.scores is not None else 1.0
                if draft.probs is not None:
                    b = float(draft.probs[i, j, t]) * (beliefs[p] if p != ROOT else 1.0)
                beliefs.append(b)
                by_source = nodes.setdefault(paths[-1], {})
                by_source[s] = max(b, by_source.get(s, 0.0))
        children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for path in nodes:
            children.setdefault(path[:-1], []).append(path)

        def score(path: tuple[int, ...]) -> float:
            return max(b * self.sources[s].calibration(len(path)) for s, b in nodes[path].items())

        forced: set[tuple[int, ...]] = set()  # always verified (probes): the best node, on probe steps its path
        level = children.get((), [])
        while level and (not forced or probe and len(forced) < depth_cap):
            forced.add(max(level, key=score))
            level = children.get(max(forced, key=len), [])
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, ...], int] = {}
        heap = [(-score(c), n, c) for n, c in enumerate(children.get((), []))]
        heapq.heapify(heap)
        tie = len(heap)
        while heap and len(tokens) < budget:
            neg, _, path = heapq.heappop(heap)
            if -neg < threshold and path not in forced:
                continue
            index[path] = len(tokens)
            tokens.append(path[-1])
            parents.append(ROOT if len(path) == 1 else index[path[:-1]])
            if len(path) < depth_cap:
                for c in children.get(path, []):
                    heapq.heappush(heap, (-min(score(c), -neg), tie, c))
                    tie += 1
        if tokens:
            paths = sorted(index, key=index.get)
            self.pending[r.seq_id] = _Pending(len(r.token_ids), r.epoch, paths, [nodes[p] for p in paths])
        return tokens, parents

    # ---- forwarded hooks (NestedDrafter), and this method's own state -------------------------------------
    def forget(self) -> None:
        super().forget()
        for s in self.sources:
            s.accepted, s.believed = [0.0] * self.MAX_DEPTH, [0.0] * self.MAX_DEPTH
        self.steps, self.asked = 0, [0] * len(self.sources)

    def release(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)
        self.known.discard(seq_id)
        super().release(seq_id)
