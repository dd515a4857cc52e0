"""Switch drafting: each step, each request drafts with one of several methods, chosen by what each one's drafts
have been keeping.

    {"method": "switch", "num_speculative_tokens": 4, "sources": [
        {"method": "ngram", "num_speculative_tokens": 4},
        {"method": "eagle3", "model": "...", "num_speculative_tokens": 1}]}

Each source's drafts are weighed by what a step with them is worth, tokens emitted over cost in plain steps:

    a draft of L nodes:       (1 + kept(L)) / (1 + L c)              c = token_cost + context_cost * context / 1000
    asking a source:          (1 + kept) / (1 + size c + h)          its mean kept tokens and draft size

where kept(L) is the mean accepted tokens of the source's drafts of L nodes, learnt online per source and size and
scaled by how the request's own drafts of that source have kept against that mean (shrunk toward it by REQUEST_PRIOR
drafts: a head that fails on one request's text is asked less there, not elsewhere), and c is what verifying one
node costs at the request's context (each verified row attends over all of it: on two Zen 4 cores 0.03-0.1 of a
plain step at 64 tokens of context, 0.2-0.25 at 2,000). The sources are asked in order, each only for the requests
the ones before it left undecided; a source's draft is taken when it is worth at least a plain step (1) and at least
what asking any later source is worth, else the request goes on. A source whose drafting costs (a head: h, its
measured forward time per request asked over the request's share of a plain step, `DraftRequest.plain_seconds`;
head_cost before either is known) is asked only where that is worth more than a plain step (and on one request
in PROBE_EVERY where it is not, to keep its estimate live). So where the request's own text repeats (a long n-gram
match keeps several tokens) the n-gram's chain is verified and the head is not asked; where it does not, the head
drafts; where nothing pays (a long context, drafts that keep little) nothing is drafted.

What a draft keeps is read off the sequence itself, once its committed tokens decide it: its longest path that
they follow. That is what verification kept where the draft was verified (greedy, or keyed sampling:
a node is accepted exactly when it is the target's own token), and what it would have kept where it was passed
over, so every draft a source makes teaches its estimate, taken or not, and a source that lost at a size is still
measured there.

Sources that all draft first (`Drafter.drafts_first`: the n-gram's chains, retrieval; cheap host work that names
what each draft rests on) are weighed by the engine's cost model instead: the switch asks every source for every
request's whole budget and hands the engine each request's chains with their evidence (the first as its row, the
others as `Draft.alternatives`); the cost model verifies the one it prices highest and measures the others against
the tokens committed (`DraftPlanner.choose`). The built-in model's default is such a switch, over the n-gram and
retrieval over the model's own answers.

Unlike `hybrid`, nothing is merged: a step verifies one source's chain (or static tree) per request, so a chain
keeps the engine's causal fast path and a step costs one drafter.

A source that reads the target's features (a head: at most one) consumes them when asked, and otherwise once
CATCH_UP_ROWS of them wait (the prompt's at a request's first step; `catch_up` for steps that draft nothing and at a
request's end): the switch holds each request's rows meanwhile and hands them over at once, so the head drafts what
it would have drafted running every step, and its K/V follows the sequence within CATCH_UP_ROWS, which the prefix cache
needs (a block is shared only where the head's K/V holds it too).

Proposals are deterministic (q = one-hot), whatever the source drew them from, as in `hybrid`: greedy output is
plain decoding's and sampled output keeps the target's distribution.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from specdec.config import SpecdecError
from specdec.drafting.base import Draft, DraftEnv, Drafter, DraftRequest, check_number
from specdec.drafting.nested import NestedDrafter, build_sources
from specdec.drafting.registry import SpeculativeConfig, register_method
from specdec.tree import ROOT

MAX_SIZE = 16  # draft sizes are learnt separately up to this many nodes (larger ones share the last estimate)
PRIOR_KEPT, PRIOR_DRAFTS = 4.0, 8.0  # every estimate starts at half a token per draft, as if from 8 drafts
CATCH_UP_ROWS = 64  # a head not asked catches up anyway once this many feature rows wait for it
SECONDS_WEIGHT = 0.1  # a head's measured drafting time: a moving mean over its recent asks, this weight each
REQUEST_PRIOR = 4.0  # a request's own drafts of a source weigh in against the source's mean as if it had this many


@dataclass
class SwitchOptions:
    sources: list = field(default_factory=list)  # speculative configs (dicts), in the order they are asked
    # What a draft costs, in plain steps at the request's context: verifying each node costs what the engine's cost
    # model measured (`DraftRequest.row_cost`), or without one token_cost + context_cost per 1,000 tokens of context
    # (each verified row attends over all of it); a source that reads the target's features (a head) costs its
    # measured forward time more (head_cost plain steps until it is measured).
    token_cost: float = 0.1
    context_cost: float = 0.07
    head_cost: float = 0.15

    def __post_init__(self) -> None:
        check_number("token_cost", self.token_cost, 0, 1)
        check_number("context_cost", self.context_cost, 0, 1)
        check_number("head_cost", self.head_cost, 0, 1)
        if not isinstance(self.sources, list) or len(self.sources) < 2:
            raise SpecdecError("method 'switch' needs 'sources': a list of at least two speculative configs, asked in "
                               'order, e.g. [{"method": "ngram", "num_speculative_tokens": 4}, {"method": "eagle3", '
                               '"model": "HEAD", "num_speculative_tokens": 1}]')
        for src in self.sources:
            if not isinstance(src, dict) or "method" not in src:
                raise SpecdecError(f"switch source {src!r} must be a speculative config with a 'method'")
            if src["method"] in ("switch", "hybrid"):
                raise SpecdecError(f"a switch source cannot itself be {src['method']!r}")


@dataclass
class _Source:
    drafter: Drafter
    cfg: SpeculativeConfig
    kept: list[float]  # per draft size (index = nodes - 1): tokens its drafts of that size kept
    drafts: list[float]  # per draft size: drafts measured
    cost: float = 0.0  # plain steps its drafting costs beside the verification (a head's forward), until measured
    skipped: int = 0  # requests it was not asked for since its last probe
    seconds: float | None = None  # its drafting's measured seconds per request asked (a moving mean; heads only)

    def drafting_cost(self, plain_seconds: float | None) -> float:
        """Plain steps its drafting costs a request: measured where both its time and a plain step's are known."""
        if not self.cost or self.seconds is None or not plain_seconds:
            return self.cost
        return self.seconds / plain_seconds

    def expected(self, size: int) -> float:
        """Tokens a draft of `size` nodes keeps, as far as its measured drafts of that size say."""
        s = min(size, MAX_SIZE) - 1
        return (self.kept[s] + PRIOR_KEPT) / (self.drafts[s] + PRIOR_DRAFTS)

    def mean(self) -> float:
        """Tokens a draft of this source keeps, over every size it drafted."""
        return (sum(self.kept) + PRIOR_KEPT) / (sum(self.drafts) + PRIOR_DRAFTS)

    def scale(self, record: list[float] | None) -> float:
        """How this request's drafts of the source have kept against the source's mean: its own kept tokens and
        drafts `record` shrunk toward the mean by REQUEST_PRIOR drafts' worth (1 for a request with none yet)."""
        mean = self.mean()
        if not record:
            return 1.0
        return (record[0] + REQUEST_PRIOR * mean) / ((record[1] + REQUEST_PRIOR) * mean)

    def mean_size(self) -> float:
        """Nodes in a draft of this source, on average (1 before any is measured)."""
        n = sum(self.drafts)
        return sum((s + 1) * d for s, d in enumerate(self.drafts)) / n if n else 1.0

    def worth(self, node_cost: float, scale: float = 1.0, plain_seconds: float | None = None) -> float:
        """What asking this source is worth: tokens a step emits with its draft over the step's cost, in plain
        steps (1 + kept) / (1 + its nodes' verification + its own drafting); `scale`: the request's own (`scale`)."""
        return (1.0 + scale * self.mean()) / (1.0 + self.mean_size() * node_cost + self.drafting_cost(plain_seconds))


@dataclass
class _Made:
    """A draft a source made for a request, measured once the committed tokens decide it."""

    source: int
    length: int  # the sequence length when it was drafted
    paths: list[tuple[int, ...]]  # per node, its token path from the root

    def kept(self, token_ids: list[int]) -> int | None:
        """Nodes of its longest path that the committed tokens follow; None until they decide it (every path
        either left by them or covered)."""
        after = token_ids[self.length:]
        best = 0
        for path in self.paths:
            n = 0
            while n < len(path) and n < len(after) and after[n] == path[n]:
                n += 1
            if n == len(after) < len(path):  # followed so far, not covered yet
                return None
            best = max(best, n)
        return best


@dataclass
class _Held:
    """Target features of a request gathered while the head was not asked: rows from token `start` on."""

    epoch: int
    start: int
    rows: list[torch.Tensor]

    def end(self) -> int:
        return self.start + sum(len(t) for t in self.rows)


@register_method("switch", SwitchOptions, verify_cost_keys=("token_cost",))
class SwitchDrafter(NestedDrafter):
    sizes_own_drafts = True
    PROBE_EVERY = 16  # a source that does not pay to ask is asked once in so many requests anyway
    MAX_MADE = 32  # drafts of a request awaiting their measure (the oldest dropped beyond it)

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig, env: DraftEnv | None = None) -> SwitchDrafter:
        o = cfg.options
        return cls(build_sources(cfg, env), o.token_cost, o.context_cost, o.head_cost)

    def __init__(self, sources: list[tuple[Drafter, SpeculativeConfig]], token_cost: float = 0.1,
                 context_cost: float = 0.07, head_cost: float = 0.15) -> None:
        self.sources = [_Source(d, c, [0.0] * MAX_SIZE, [0.0] * MAX_SIZE, head_cost if d.feature_layers else 0.0)
                        for d, c in sources]
        self.nest([s.drafter for s in self.sources], "switch")
        self.featured = self.sources[self.featured_index] if self.featured_index is not None else None
        self.token_cost, self.context_cost = token_cost, context_cost
        # Sources that all draft first (n-gram, retrieval: host work that names its evidence) are all asked, and the
        # engine's cost model chooses each request's chain among theirs by what drafts of each evidence kept
        # (`Draft.alternatives`), rather than this method's own weighing.
        self.drafts_first = all(s.drafter.drafts_first for s in self.sources)
        self.sizes_own_drafts = not self.drafts_first
        self.made: dict[int, list[_Made]] = {}  # seq_id -> its drafts not measured yet
        self.records: dict[int, list[list[float]]] = {}  # seq_id -> per source: [kept tokens, drafts] measured
        self.held: dict[int, _Held] = {}
        self.taken = [0] * len(self.sources)  # per source: request-steps whose draft was verified (reports, tests)

    def reload_head(self, path: str) -> None:
        """The head source takes the head in `path`; what its drafts kept starts over (it described the old head)."""
        super().reload_head(path)
        self.featured.kept, self.featured.drafts = [0.0] * MAX_SIZE, [0.0] * MAX_SIZE

    # ---- learning from the committed tokens ------------------------------------------------------------
    def learn(self, r: DraftRequest) -> None:
        """Measure the request's drafts that its committed tokens decide."""
        waiting = []
        for made in self.made.get(r.seq_id, []):
            kept = made.kept(r.token_ids)
            if kept is None:
                waiting.append(made)
                continue
            src, s = self.sources[made.source], min(len(made.paths), MAX_SIZE) - 1
            src.kept[s] += kept
            src.drafts[s] += 1
            record = self.records.setdefault(r.seq_id, [[0.0, 0.0] for _ in self.sources])[made.source]
            record[0] += kept
            record[1] += 1
        self.made[r.seq_id] = waiting[-self.MAX_MADE:]

    # ---- drafting ------------------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest]) -> Draft:
        if self.drafts_first and requests and requests[0].sized_by_plan:
            return self.propose_all(requests)
        rows: list[tuple[list[int], list[int]]] = [([], []) for _ in requests]
        undecided = []
        for i, r in enumerate(requests):
            self.learn(r)
            self.hold(r)
            if r.max_tokens > 0:
                undecided.append(i)
        for n, src in enumerate(self.sources):
            if src.cost:  # a source that costs to ask is asked only where that pays, and on probes
                undecided = [i for i in undecided if self.asks(n, requests[i])]
            if not undecided:
                continue
            subs = [self.request_for(src, requests[i], src.cfg.shape) for i in undecided]
            start = time.perf_counter()
            tokens, parents = src.drafter.propose(subs).host_rows()
            if src.cost:  # a head's forward: its time per request asked
                each = (time.perf_counter() - start) / len(subs)
                old = each if src.seconds is None else src.seconds
                src.seconds = (1 - SECONDS_WEIGHT) * old + SECONDS_WEIGHT * each
            left = []
            for i, t, p in zip(undecided, tokens, parents):
                if not t:
                    left.append(i)
                    continue
                r = requests[i]
                self.made.setdefault(r.seq_id, []).append(_Made(n, len(r.token_ids), node_paths(t, p)))
                record = self.records.get(r.seq_id)
                scale = src.scale(record and record[n])
                mine = (1.0 + scale * src.expected(len(t))) / (1.0 + len(t) * self.node_cost(r))  # drafting done
                later = max((self.worth_asking(m, r) for m in range(n + 1, len(self.sources))), default=0.0)
                if mine < max(later, 1.0):
                    left.append(i)
                    continue
                rows[i] = (t, p)
                self.taken[n] += 1
            undecided = left
        self.feed_head(requests, CATCH_UP_ROWS)
        return Draft.from_rows(rows)

    def propose_all(self, requests: list[DraftRequest]) -> Draft:
        """Every source's whole-budget chain for every request: each request's row is the first source's chain that
        is not empty, the others its alternatives, each with its evidence (the cost model chooses among them)."""
        options: list[list[tuple[list[int], object]]] = [[] for _ in requests]
        for src in self.sources:
            k = src.cfg.num_speculative_tokens
            draft = src.drafter.propose([r if r.max_tokens <= k else dataclasses.replace(r, max_tokens=k)
                                         for r in requests])
            evidence = draft.evidence or [None] * len(requests)
            for i, (tokens, e) in enumerate(zip(draft.host_rows()[0], evidence)):
                if tokens:
                    options[i].append((tokens, e))
        out = Draft.chains([o[0][0] if o else [] for o in options])
        out.evidence = [o[0][1] if o else None for o in options]
        out.alternatives = [o[1:] for o in options]
        return out

    def catch_up(self, requests: list[DraftRequest]) -> None:
        """The engine's catch-up (steps that drafted nothing, a finishing sequence): every row held for these
        requests goes to the head now."""
        for r in requests:
            self.hold(r)
        self.feed_head(requests, 1)

    def feed_head(self, requests: list[DraftRequest], min_rows: int) -> None:
        """Feed the head the feature rows held for each request with at least `min_rows` of them (at every step:
        CATCH_UP_ROWS, the prompt's at the request's first): its K/V then follows the sequence within them, so
        the request's blocks enter the prefix cache (a block is shared only where the head's K/V holds it too) and
        a later ask never waits on a long catch-up. Its draft there (one token) is measured like any other."""
        if self.featured is None:
            return
        late = [r for r in requests if self.held_rows(r) >= min_rows]
        if not late:
            return
        subs = [dataclasses.replace(self.request_for(self.featured, r, self.featured.cfg.shape), max_tokens=1)
                for r in late]
        for r, t, p in zip(late, *self.featured.drafter.propose(subs).host_rows()):
            if t:
                self.made.setdefault(r.seq_id, []).append(_Made(self.featured_index, len(r.token_ids),
                                                                node_paths(t, p)))

    def asks(self, n: int, r: DraftRequest) -> bool:
        """Whether source n, whose drafting costs, is asked for this request: where asking it is worth more than a
        plain step (`worth_asking`), and every PROBE_EVERY-th time it was not (its estimates learn only from its
        own drafts)."""
        src = self.sources[n]
        if self.worth_asking(n, r) >= 1.0:
            return True
        src.skipped += 1
        if src.skipped < self.PROBE_EVERY:
            return False
        src.skipped = 0
        return True

    def worth_asking(self, n: int, r: DraftRequest) -> float:
        """What asking source n for this request is worth (`_Source.worth`), scaled by the request's own record."""
        record = self.records.get(r.seq_id)
        src = self.sources[n]
        return src.worth(self.node_cost(r), src.scale(record and record[n]), r.plain_seconds)

    def held_rows(self, r: DraftRequest) -> int:
        """Feature rows held for the head for this request."""
        held = self.held.get(r.seq_id)
        return held.end() - held.start if held is not None else 0

    def node_cost(self, r: DraftRequest) -> float:
        """Plain steps that verifying one node costs at the request's context: what the engine measured this step
        (`DraftRequest.row_cost`), else token_cost + context_cost per 1,000 tokens."""
        if r.row_cost is not None:
            return r.row_cost
        return self.token_cost + self.context_cost * len(r.token_ids) / 1000

    def request_for(self, src: _Source, r: DraftRequest, shape: object) -> DraftRequest:
        """The request as source `src` sees it: its own budget and shape, and for the head every feature row
        gathered since it was last asked."""
        features, start = None, r.features_start
        if src is self.featured:
            held = self.held.pop(r.seq_id, None)
            if held is not None and held.rows:
                start, features = held.start, held.rows[0] if len(held.rows) == 1 else torch.cat(held.rows)
        return dataclasses.replace(r, max_tokens=min(shape.num_tokens, r.max_tokens), tree=shape.tree, dynamic=None,
                                   features=features, features_start=start)

    def hold(self, r: DraftRequest) -> None:
        """Keep the request's new target features until the head is asked (a new epoch starts over)."""
        if self.featured is None or r.features is None:
            return
        held = self.held.get(r.seq_id)
        if held is None or held.epoch != r.epoch or held.end() != r.features_start:
            held = self.held[r.seq_id] = _Held(r.epoch, r.features_start, [])
        held.rows.append(r.features)

    # ---- forwarded hooks (NestedDrafter), and this method's own state -------------------------------------
    def forget(self) -> None:
        super().forget()
        for s in self.sources:
            s.kept, s.drafts, s.skipped = [0.0] * MAX_SIZE, [0.0] * MAX_SIZE, 0
        self.taken = [0] * len(self.sources)

    def release(self, seq_id: int) -> None:
        self.made.pop(seq_id, None)
        self.records.pop(seq_id, None)
        self.held.pop(seq_id, None)
        super().release(seq_id)


def node_paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Each node's token path from the root (parents come before their children)."""
    paths: list[tuple[int, ...]] = []
    for t, p in zip(tokens, parents):
        paths.append((t,) if p == ROOT else paths[p] + (t,))
    return paths
