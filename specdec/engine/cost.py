"""The cost model: per step and per request, how many draft tokens are worth verifying, from what they are expected
to add and what they cost on this model, on this machine, at this context length.

A decode step of B sequences that verifies n draft rows beside their B last tokens emits

    B + sum of g(i, j) over the rows taken      g(i, j): the chance request i keeps its draft's first j + 1 tokens

tokens in t(B + n, context) + drafting seconds. Plain decoding emits B in t(B, context). The step takes the rows
that maximize tokens per second, best rows first (a request's g is non-increasing in j, so its rows are taken in
order): none where no draft is expected to pay, which is how a model whose drafts keep little decodes at plain
speed. A tree is one item of all its nodes, worth the tokens its request's trees have kept.

    t(rows, context)   measured once per model and machine, plus what each batch size's decode steps measured
                       beyond their forward (`step_cost.StepCost`)
    g(i, j)            per position: what this request's recent drafts kept there, shrunk toward what every
                       request's drafts of this source kept there (which starts from a prior), `Acceptance`, both per
                       evidence (what the draft rests on, `Draft.evidence`: the n-gram's match length); times
                       the moving ratio of the tokens drafts added to those the plans expected (`Calibration`: an
                       estimate taken where it is high overrates what it picks)

A request whose drafts stopped paying is still given one row once it has drafted nothing for PROBE_EVERY steps,
on every PROBE_EVERY-th step of the engine (the probes of a batch fall on one step, which alone runs the drafter),
so a text that starts to repeat is seen; the probes spend at most PROBE_SHARE of the decode time, priced like any
row (at batch 16 on a Zen 4 a probe of every request opened a second kernel pass: 22 ms on a 32 ms step), and are
part of their step's plan, so what they cost and keep is predicted and learnt like the rows that pay. A drafter that
drafts first (`Drafter.drafts_first`: the n-gram, retrieval, the switch) is not probed: the proposals its plans give
no rows are learnt from the tokens committed after them (`DraftPlanner.shadow`), at no forward's cost.

Outputs never depend on the choice: greedy and keyed-sampled tokens are plain decoding's whatever is drafted.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdec.engine.step_cost import STALL, Recent, StepCost

PRIOR = (0.5, 0.35, 0.25, 0.18, 0.13, 0.1)  # g(j) before any draft is measured (then 0.7 times the last)
PRIOR_WEIGHT = 4.0  # the prior counts as this many drafts per position
REQUEST_WEIGHT = 4.0  # a request's own drafts weigh against every request's as if these were this many
DECAY = 0.9  # a request's older drafts weigh this much less per draft (its text changes character)
PROBE_EVERY = 16  # a request that drafts nothing is given one row once in so many of its steps
PROBE_SHARE = 0.02  # ... while the probes' rows (and the drafting they add) take at most this share of the decode time
MARGIN = 1.01  # a plan must beat plain decoding's tokens per second by this much
CALIBRATION_DECAY = 0.98  # per drafting step, in the moving ratio of the tokens drafts added to those expected
TIME_PRIOR = 4.0  # drafting steps a batch size's time calibration starts from (at 1)
CALIBRATION_PRIOR = 8.0  # expected tokens the ratio starts from (at 1)
WORTH_DECAY = 0.9  # per proposal, in what proposing first saved a request and cost it (`DraftingWorth`)
WORTH_PROBE = 4  # a request whose proposals have not paid is asked for one once in this many steps


@dataclass
class Acceptance:
    """Per draft position j: drafts that reached it and drafts that kept their first j + 1 tokens (decayed for a
    request, plain counts for a source's every request)."""

    drafted: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    decay: float = 1.0

    def record(self, depth: int, accepted: int) -> None:
        """A chain of `depth` tokens (a tree: its levels) kept its first `accepted`."""
        if self.decay != 1.0:
            self.drafted = [d * self.decay for d in self.drafted]
            self.kept = [k * self.decay for k in self.kept]
        if len(self.drafted) < depth:
            self.drafted += [0.0] * (depth - len(self.drafted))
            self.kept += [0.0] * (depth - len(self.kept))
        for j in range(depth):
            self.drafted[j] += 1
        for j in range(min(accepted, depth)):
            self.kept[j] += 1

    def rates(self, n: int, prior: list[float], weight: float) -> list[float]:
        """g(0..n-1): what was kept per position shrunk toward `prior` by `weight` drafts, non-increasing."""
        out, last = [], 1.0
        for j in range(n):
            d = self.drafted[j] if j < len(self.drafted) else 0.0
            k = self.kept[j] if j < len(self.kept) else 0.0
            last = min(last, (k + weight * prior[j]) / (d + weight))
            out.append(last)
        return out


def prior_rates(n: int) -> list[float]:
    out = list(PRIOR[:n])
    while len(out) < n:
        out.append(out[-1] * 0.7)
    return out


@dataclass
class Calibration:
    """The tokens drafts added over those the plans expected, over recent drafting steps (decayed sums, starting
    from CALIBRATION_PRIOR tokens at 1): the factor expected gains are taken at."""

    added: float = CALIBRATION_PRIOR
    expected: float = CALIBRATION_PRIOR

    def record(self, added: float, expected: float) -> None:
        self.added = CALIBRATION_DECAY * self.added + added
        self.expected = CALIBRATION_DECAY * self.expected + expected

    @property
    def factor(self) -> float:
        return self.added / self.expected


@dataclass
class TimeCalibration:
    """Measured over predicted seconds of a batch size's drafting steps (each ratio clipped to 0.5-2: a stall says
    nothing of the model), a decayed mean starting from 1 with the weight of TIME_PRIOR steps: the factor drafting
    steps are priced at. What the step costs and the drafting times do not catch (a batch's drafting steps running
    a few percent over them) would otherwise tip plans that barely pay into losses."""

    ratios: float = 0.0  # decayed sums
    weight: float = 0.0

    def record(self, measured: float, predicted: float) -> None:
        if predicted > 0:
            r = min(max(measured / predicted, 0.5), 2.0)
            self.ratios = CALIBRATION_DECAY * self.ratios + r
            self.weight = CALIBRATION_DECAY * self.weight + 1

    @property
    def factor(self) -> float:
        return (TIME_PRIOR + self.ratios) / (TIME_PRIOR + self.weight)


@dataclass
class DraftingWorth:
    """What proposing first (`Drafter.drafts_first`) has been worth to a request: the seconds its planned rows were
    expected to save over plain decoding of as many tokens, against its share of the seconds the proposals took,
    over its recent proposals (decayed sums). Proposing costs host work every step, a proposal per request, whether
    a row pays or not (at batch 16 on a Zen 3: 3.9 ms of a 74 ms step, where the plans expected 0.98x plain); a
    request whose proposals have cost more than they saved is asked for one only about every WORTH_PROBE-th step,
    which keeps the record live (its text may start to repeat; what a proposal would have kept is learnt without
    verifying it, `DraftPlanner.shadow`). A proposal taking STALL times the recent median counts at that (a
    request's first one indexes its whole prompt). (Saved as the verified drafts measured it instead, batch 4 on a
    Zen 3 ran at 0.93-1.02x plain over five runs against 0.95-0.98x: no better, and not kept.)"""

    saved: float = 0.0
    spent: float = 0.0
    times: Recent = field(default_factory=Recent)  # the proposals' seconds
    skipped: int = 0  # steps it was not asked since its last proposal
    rounds: int = 0  # proposals asked for after skipping (`DraftPlanner.asks`)

    def record(self, saved: float, spent: float) -> None:
        typical = self.times.value if self.times.values else spent
        self.times.add(spent)
        self.saved = WORTH_DECAY * self.saved + max(0.0, saved)
        self.spent = WORTH_DECAY * self.spent + min(spent, STALL * typical)

    @property
    def pays(self) -> bool:
        return self.saved >= self.spent


@dataclass
class Item:
    """Rows one request may verify: a chain's next token (rows 1) or a whole tree (rows = its nodes)."""

    seq: int
    rows: int
    gain: float  # tokens it is expected to add


@dataclass
class Plan:
    """A step's choice: draft rows per sequence (0: it drafts nothing), and the predicted tokens and seconds."""

    rows: list[int]
    tokens: float
    seconds: float  # drafting included (its expected time until the drafter has run, then its measured time)
    plain_seconds: float  # what plain decoding would take for the same number of sequences
    draft_seconds: float = 0.0  # the drafting time `seconds` counts

    @property
    def drafts(self) -> bool:
        return any(self.rows)


def plan(items: list[Item], batch: int, context: float, cost: StepCost, draft_seconds: float = 0.0,
         time_factor: float = 1.0) -> Plan:
    """The items to verify: the prefix of them, best tokens per row first, that maximizes tokens per second
    (drafting costs `draft_seconds` when anything is drafted, and a drafting step `time_factor` times what the costs
    say: `TimeCalibration`), and only where it beats plain decoding by MARGIN. Items of one request must come in the
    order they are taken (a chain's positions)."""
    times = cost.widths(batch, context, sum(it.rows for it in items))  # a step verifying n rows: times[n]
    plain = times[0]
    # stable: a request's later position, never worth more than its earlier one, is never taken before it
    order = sorted(items, key=lambda it: -it.gain / it.rows)
    best_rate, best, tokens, rows = batch / plain * MARGIN, 0, float(batch), 0
    best_tokens, best_seconds = float(batch), plain
    for n, it in enumerate(order, 1):
        tokens += it.gain
        rows += it.rows
        seconds = (times[rows] + draft_seconds) * time_factor
        if tokens / seconds > best_rate:
            best_rate, best, best_tokens, best_seconds = tokens / seconds, n, tokens, seconds
    per_seq = [0] * batch
    for it in order[:best]:
        per_seq[it.seq] += it.rows
    return Plan(per_seq, best_tokens, best_seconds, plain, draft_seconds if best else 0.0)


@dataclass
class Prediction:
    """What the plans predicted against what the decode steps measured, drafting or not (bench reports it: the
    model's check). The predicted speedup is plain decoding's predicted time for the expected tokens over the
    predicted time of the steps; bench sets it beside the speedup it measures against plain decoding."""

    steps: int = 0
    tokens: float = 0.0  # expected tokens
    seconds: float = 0.0  # predicted seconds (drafting included)
    plain_seconds: float = 0.0  # plain decoding's predicted seconds for as many tokens
    measured_tokens: int = 0
    measured_seconds: float = 0.0

    def add(self, p: Plan, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += p.tokens
        self.seconds += p.seconds
        self.plain_seconds += p.tokens * p.plain_seconds / len(p.rows)
        self.measured_tokens += tokens
        self.measured_seconds += seconds

    def summary(self) -> dict:
        """The predicted speedup over plain decoding, and measured tokens and seconds per predicted ones."""
        d = asdict(self)
        d["predicted_speedup"] = self.plain_seconds / self.seconds if self.seconds else None
        d["tokens_ratio"] = self.measured_tokens / self.tokens if self.tokens else None
        d["seconds_ratio"] = self.measured_seconds / self.seconds if self.seconds else None
        return d
