"""The cost model's part of a speculative step (`engine.cost`), kept apart from driving the drafter (`speculator`):
what each request's drafts kept, per evidence and position; which rows a step verifies; which chain among a
request's alternatives; whether proposing still pays for a request; the probes; and what each step's time teaches.

    plan_budgets(...)    the rows of drafts not yet made (a chain's positions, a whole tree) that pay
    plan_proposed(...)   the rows of drafts made first (`Drafter.drafts_first`) that pay, after choosing among their
                         alternatives; what proposing was worth to each request it asked
    probe(...)           the planned rows with this step's probes added
    learn_shadows(...)   what the proposals not verified would have kept, read off the tokens committed since
    drafted(...)         what drafting took this step (the plan's expected time becomes the measured one)
    record(...)          a verified draft's kept tokens, per evidence
    record_step(...)     a whole step's tokens and seconds, against its plan

The planner reads sequences and drafts as plain values; the drafter is the speculator's alone.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable

from specdec.drafting import Draft
from specdec.engine.cost import (
    DECAY,
    PRIOR_WEIGHT,
    PROBE_EVERY,
    PROBE_SHARE,
    REQUEST_WEIGHT,
    WORTH_PROBE,
    Acceptance,
    Calibration,
    DraftingWorth,
    Item,
    Plan,
    Prediction,
    TimeCalibration,
    plan,
    prior_rates,
)
from specdec.engine.sequence import Sequence
from specdec.engine.step_cost import STALL, Recent, StepCost

SHADOWS = 16  # unverified proposals a request keeps pending (each is decided within its length in committed tokens)


class DraftPlanner:
    def __init__(self) -> None:
        # The verification costs the engine measured (None: every draft takes its whole budget), what drafts kept
        # per position by their evidence (`Draft.evidence`, None for a drafter that gives none; every request's, and
        # each request's own, recent first), the drafter's moving seconds by the step's largest budget, and the
        # predictions against the steps' times.
        self.cost: StepCost | None = None
        self.source: dict[Hashable, Acceptance] = {}
        self.acceptance: dict[int, dict[Hashable, Acceptance]] = {}
        self.idle: dict[int, int] = {}  # seq_id -> its steps since it last drafted
        self.draft_s: dict[tuple[int, int], Recent] = {}  # (batch size, largest budget) -> drafting seconds
        self.worth: dict[int, DraftingWorth] = {}  # seq_id -> what proposing first saved it and cost it
        self.prediction = Prediction()
        self.calibration: dict[int, Calibration] = {}  # batch size -> its drafts' added / expected tokens
        self.timing: dict[int, TimeCalibration] = {}  # batch size -> its drafting steps' measured / predicted time
        self.steps = 0  # decode steps planned (probes fall on every PROBE_EVERY-th)
        self.probe_credit = 0.0  # the seconds probes may still spend: PROBE_SHARE of every decode step's
        self.plan: Plan | None = None  # this step's
        self.step = (0, 0.0, 0.0)  # this step's drafted rows, mean context and drafting seconds
        # this step's planning seconds beyond its drafting, and per batch size its plain steps' recent median: never
        # spent by plain decoding (`planned`)
        self._planning_s = 0.0
        self.planning: dict[int, Recent] = {}
        self._factor = 1.0  # the calibration this step's plan took its gains at
        self._time_factor = 1.0  # and its drafting steps' time at (`TimeCalibration`)
        self._verified = 0  # drafts verified so far (what the plans learn from)
        self._quiet: tuple[int, int] | None = None  # (batch size, drafts verified) at a plan that drafted nothing
        # seq_id -> the proposals it made and did not verify, pending until the tokens committed since decide them:
        # (its length then, the chain, its evidence), `shadow`
        self._shadows: dict[int, list[tuple[int, list[int], Hashable]]] = {}

    def start_step(self, context: float) -> None:
        """A decode step begins, its batch's mean context `context`: nothing planned or drafted yet."""
        self.step, self.plan, self._planning_s = (0, context, 0.0), None, 0.0

    def planned(self, seconds: float) -> None:
        """Planning this step took `seconds`, a draft made first included (that part is drafting, `step`). The rest
        is the speculating engine's own host work (on a Zen 4 about 0.1 ms a request, in 5 ms steps at batch 1),
        which a plain engine never does. The plans price plain steps as this engine runs them, planning included
        (kept out of the plain steps' costs, and so out of the drafting steps' intercept they shrink toward, batch 4
        and 16 verified more rows and ran at 0.90-0.93x plain where they ran at 0.97-1.00x: Zen 4, Spec-Bench,
        alternated); the prediction's plain decoding is without it (with it, batch 1's predicted speedups ran 14%
        over the measured ones), `record_step`."""
        self._planning_s = max(0.0, seconds - self.step[2])

    # ---- what drafts keep ---------------------------------------------------------------------------------
    def rates(self, seq_id: int, levels: int, every: list[float] | None = None, evidence: Hashable = None
              ) -> list[float]:
        """g(0..levels-1): the chance this request's next draft (resting on `evidence`) keeps its first j + 1 tokens
        (or tree levels). `every`: every request's rates for this evidence and at least `levels` positions, when the
        caller has them (a plan asks once a step)."""
        if every is None:
            every = self.every_rates(levels, evidence)
        own = self.acceptance.get(seq_id, {}).get(evidence)
        return own.rates(levels, every, REQUEST_WEIGHT) if own is not None else every[:levels]

    def every_rates(self, levels: int, evidence: Hashable = None) -> list[float]:
        """What every request's drafts resting on `evidence` kept per position, shrunk toward the prior."""
        source = self.source.get(evidence)
        return source.rates(levels, prior_rates(levels), PRIOR_WEIGHT) if source is not None else prior_rates(levels)

    def record(self, seq_id: int, evidence: Hashable, depth: int, accepted: int) -> None:
        """A draft resting on `evidence` kept `accepted` of its first `depth` tokens (or tree levels)."""
        self._record(seq_id, evidence, depth, accepted)
        self._verified += 1

    def _record(self, seq_id: int, evidence: Hashable, depth: int, accepted: int) -> None:
        self.source.setdefault(evidence, Acceptance()).record(depth, accepted)
        own = self.acceptance.setdefault(seq_id, {})
        own.setdefault(evidence, Acceptance(decay=DECAY)).record(depth, accepted)

    # ---- plans --------------------------------------------------------------------------------------------
    def plan_budgets(self, seqs: list[Sequence], budgets: list[int], depth: int, whole: bool, context: float
                     ) -> list[int]:
        """The rows of drafts not made yet: each position of a request's chain an item worth what its drafts kept
        there (a tree, `whole`, one item of all its nodes and levels up to `depth`), priced with the drafter's
        measured time. Where no draft paid at the last plan of this batch size and nothing was learnt since, none
        pays now either (planned again on every probe step)."""
        quiet = (len(seqs), self._verified)
        factor = self._factor = self.token_calibration(len(seqs)).factor
        levels = max(min(b, depth) if whole else b for b in budgets)
        every: list[float] = []  # every request's rates, once a step (when anything is priced)
        known: dict[int, list[float]] = {}

        def gains(i: int) -> list[float]:  # request i's chain positions (a tree's levels) at the calibration
            if i not in known:
                every[:] = every or self.every_rates(levels)
                b = budgets[i]
                known[i] = [x * factor for x in self.rates(seqs[i].seq_id, min(b, depth) if whole else b, every)]
            return known[i]

        def gain(i: int, a: int, b: int) -> float:  # what request i's rows a..b-1 are expected to add
            return (sum(gains(i)) if a == 0 else 0.0) if whole else sum(gains(i)[a:b])

        draft_s = self.draft_seconds(len(seqs), max(budgets))
        if self._quiet == quiet and (self.steps + 1) % PROBE_EVERY:
            return self.probe(seqs, budgets, [0] * len(seqs), whole, gain=gain, draft_seconds=draft_s)
        items = []
        for i, b in enumerate(budgets):
            if b:
                items += [Item(i, b, sum(gains(i)))] if whole else [Item(i, 1, x) for x in gains(i)]
        self.plan = self._plan(items, len(seqs), context, draft_s)
        self._quiet = None if self.plan.drafts else quiet
        return self.probe(seqs, budgets, list(self.plan.rows), whole, gain=gain, draft_seconds=draft_s)

    def plan_proposed(self, seqs: list[Sequence], budgets: list[int], draft: Draft, start: float, context: float,
                      waiting: list[bool]) -> tuple[Draft, list[Hashable], list[int]]:
        """The rows of a draft made first for the whole budgets (proposing began at `start`): each request's positions
        priced by what drafts of the same evidence kept (its own and every request's); where the draft offers other
        chains (`Draft.alternatives`) the one priced highest is verified (`choose`). Drafting is already paid, so the
        plan weighs the rows alone; each asked request's proposal is weighed against what its rows are expected to
        save (`DraftingWorth`). A proposal given no rows is learnt from the tokens committed after it (`shadow`), so
        a request's proposals are measured without verifying them: no forward probes. Returns the draft, its
        evidence per request and the rows with this step's (deeper) probes."""
        factor = self._factor = self.token_calibration(len(seqs)).factor
        every: dict[Hashable, list[float]] = {}  # evidence -> every request's rates, once a step
        known: dict[tuple[int, int, Hashable], list[float]] = {}  # (request, positions, evidence): `choose` priced

        def rates(i: int, n: int, e: Hashable) -> list[float]:
            if (i, n, e) not in known:
                if e not in every:
                    every[e] = self.every_rates(max(budgets), e)
                known[i, n, e] = [g * factor for g in self.rates(seqs[i].seq_id, n, every[e], e)]
            return known[i, n, e]

        evidence = list(draft.evidence) if draft.evidence is not None else [None] * len(seqs)
        if draft.alternatives is not None:
            draft, evidence = self.choose(seqs, draft, evidence, budgets, context, rates)
        lengths = [min(len(t), b) for t, b in zip(draft.host_rows()[0], budgets)]
        seconds = time.perf_counter() - start
        self.step = (0, self.step[1], seconds)
        gains: list[list[float]] = [rates(i, n, e) if n else [] for i, (n, e) in enumerate(zip(lengths, evidence))]
        rows = [0] * len(seqs)
        if any(lengths):
            self.plan = self._plan([Item(i, 1, g) for i, row in enumerate(gains) for g in row], len(seqs), context,
                                   0.0)
            rows = list(self.plan.rows)
        self.weigh_proposals(seqs, budgets, gains, rows, seconds / sum(1 for b in budgets if b))
        rows = self.probe(seqs, lengths, rows, False, waiting, gain=lambda i, a, b: sum(gains[i][a:b]), shadowed=True)
        for i, (chain, n) in enumerate(zip(draft.host_rows()[0], lengths)):
            if n and not rows[i]:
                self.shadow(seqs[i], chain[:n], evidence[i])
        return draft, evidence, rows

    def _plan(self, items: list[Item], batch: int, context: float, draft_seconds: float) -> Plan:
        self._time_factor = self._timing(batch)
        return plan(items, batch, context, self.cost, draft_seconds, self._time_factor)

    def _timing(self, batch: int) -> float:
        timing = self.time_calibration(batch)
        return timing.factor if timing is not None else 1.0

    def token_calibration(self, batch: int) -> Calibration:
        """The batch size's ratio of the tokens its drafts added to those its plans expected, else the nearest batch
        size's (the smaller of two as near), else none measured (1). Per batch size because a plan overrates what it
        picks the more, the more candidates it picks among (64 chain positions a step at batch 16), and batch 1's
        steps outnumber the others in one shared ratio: at batch 16 on a Zen 3 a step verified 8 rows that paid
        only if 6 of them were kept, and 4 were, while the shared ratio stood at 1.00."""
        if batch in self.calibration or not self.calibration:
            return self.calibration.get(batch) or Calibration()
        return self.calibration[min(self.calibration, key=lambda b: (abs(b - batch), b))]

    def time_calibration(self, batch: int) -> TimeCalibration | None:
        """The batch size's drafting-step time calibration, else the nearest batch size's (the smaller of two as
        near): a batch that shrinks as its requests finish passes through many sizes, each with few drafting steps
        of its own, and nearby sizes run over their costs alike (on a Zen 4 at batch 16, the drafting steps of
        sizes 8-16 by 12-18%)."""
        if batch in self.timing or not self.timing:
            return self.timing.get(batch)
        return self.timing[min(self.timing, key=lambda b: (abs(b - batch), b))]

    def asks(self, seq: Sequence) -> bool:
        """Whether the request is asked for a proposal this step: while its proposals have paid, else once in
        WORTH_PROBE steps and once in WORTH_PROBE + 1 in turn (a fixed period can meet a text that alternates in
        one phase every time: a draft right on even lengths only, asked on odd ones), which keeps its record live:
        what a proposal would have kept is learnt without verifying it (`shadow`)."""
        worth = self.worth.get(seq.seq_id)
        if worth is None or worth.pays:
            return True
        if worth.skipped + 1 >= WORTH_PROBE + worth.rounds % 2:
            worth.skipped, worth.rounds = 0, worth.rounds + 1
            return True
        worth.skipped += 1
        return False

    def weigh_proposals(self, seqs: list[Sequence], budgets: list[int], gains: list[list[float]], rows: list[int],
                        share: float) -> None:
        """Each asked request's proposal against what its planned rows are expected to save: the tokens they add at
        plain decoding's seconds per token, less its share of the rows' time; `share`: its part of the proposing."""
        p = self.plan if any(rows) else None
        extra = (p.seconds - p.plain_seconds) / sum(rows) if p is not None else 0.0  # seconds a row adds
        for i, (s, b) in enumerate(zip(seqs, budgets)):
            if b:
                saved = sum(gains[i][:rows[i]]) * p.plain_seconds / len(seqs) - rows[i] * extra if rows[i] else 0.0
                self.worth.setdefault(s.seq_id, DraftingWorth()).record(saved, share)

    def choose(self, seqs: list[Sequence], draft: Draft, evidence: list[Hashable], budgets: list[int],
               context: float, rates: Callable[[int, int, Hashable], list[float]]) -> tuple[Draft, list[Hashable]]:
        """Each request's chain among its draft's row and its alternatives: the one whose positions are expected to
        keep the most tokens beyond what their rows cost (the sum of max(0, g(j) - c), c the price of a row this step
        in plain steps of one request; ties: the row). The others are kept to learn what they would have kept
        (`shadow`)."""
        c = self.row_cost(len(seqs), 0, context)
        chosen, chosen_evidence = [], []
        for i, (row, e, others) in enumerate(zip(draft.host_rows()[0], evidence, draft.alternatives)):
            options = [(row, e), *others]
            values = [sum(max(0.0, g - c) for g in rates(i, min(len(t), budgets[i]), ev)) if t else -1.0
                      for t, ev in options]
            best = max(range(len(options)), key=values.__getitem__)  # the first maximum: the row among equals
            chosen.append(options[best][0][:budgets[i]])
            chosen_evidence.append(options[best][1] if options[best][0] else None)
            for n, (t, ev) in enumerate(options):
                if n != best and t:
                    self.shadow(seqs[i], t[:budgets[i]], ev)
        out = Draft.chains(chosen)
        out.evidence = chosen_evidence
        return out, chosen_evidence

    def shadow(self, seq: Sequence, tokens: list[int], evidence: Hashable) -> None:
        """A proposal of `seq` that is not verified (a chain passed over, or one the plan gave no rows): learnt once
        the tokens committed after it decide it (`learn_shadows`)."""
        pending = self._shadows.setdefault(seq.seq_id, [])
        pending.append((len(seq.token_ids), list(tokens), evidence))
        del pending[:-SHADOWS]

    def learn_shadows(self, seqs: list[Sequence]) -> None:
        """What the requests' unverified proposals would have kept, read off the tokens committed since: a draft token
        is kept exactly when it is the token the target emits there (greedy, and sampled too, where a one-hot draft
        token is accepted with the target's own probability of it), so equality measures acceptance. A chain is
        learnt once decided: a token that differs, or every token matched; until then it waits (learnt after one
        plain step, a chain whose first token matched would count as a draft that reached one position, and the
        positions after it would be learnt from the chains that failed early alone). Learnt as verified drafts of
        the same evidence are, so an evidence that is not verified keeps being measured."""
        for s in seqs:
            pending = self._shadows.get(s.seq_id)
            if not pending:
                continue
            waiting = []
            for length, tokens, e in pending:
                after = s.token_ids[length:]
                n = 0
                while n < len(tokens) and n < len(after) and tokens[n] == after[n]:
                    n += 1
                if n == len(after) < len(tokens):  # every token since matched and the chain goes on
                    waiting.append((length, tokens, e))
                else:
                    self._record(s.seq_id, e, len(tokens), n)
            self._shadows[s.seq_id] = waiting

    def probe(self, seqs: list[Sequence], budgets: list[int], rows: list[int], whole: bool,
              waiting: list[bool] | None = None, gain: Callable[[int, int, int], float] | None = None,
              draft_seconds: float = 0.0, shadowed: bool = False) -> list[int]:
        """The planned rows with this step's probes added: one row (or the whole tree) for a request idle for
        PROBE_EVERY steps, on every PROBE_EVERY-th step (a position's estimate learns only from drafts that reach
        it), and one more on every PROBE_EVERY-th draft; the longest idle first, as many as the probe credit pays
        for (`afford`). `waiting`: the requests not asked for a proposal this step (`asks`), idle all the same.
        `gain(i, a, b)`: what request i's rows a..b-1 are expected to add; `draft_seconds`: what drafting adds to a
        step that drafted nothing. `shadowed`: the requests' proposals not verified are learnt all the same
        (`learn_shadows`), so an idle one is not probed (only the deeper probes past the rows that pay remain: a
        shadow is learnt from its whole chain only while it is given no rows). The probes of idle requests may spend
        PROBE_SHARE (2%) of the decode time, and at batch 4 on a Zen 3, where a row costs a sixth of a plain step,
        they spent it on rows that the shadows measure for free."""
        self.steps += 1
        wanted = []  # (steps idle, request, rows)
        for i, (s, b) in enumerate(zip(seqs, budgets)):
            idle = 0 if rows[i] or not (b or (waiting and waiting[i])) else self.idle.get(s.seq_id, 0) + 1
            if b and idle >= PROBE_EVERY and self.steps % PROBE_EVERY == 0 and not shadowed:  # one row (a tree)
                wanted.append((idle, i, b if whole else 1))
            elif not whole and 0 < rows[i] < b and s.spec.num_drafts % PROBE_EVERY == PROBE_EVERY - 1:
                wanted.append((0, i, 1))  # a deeper probe: the position after the ones that pay
            self.idle[s.seq_id] = idle
        if wanted:
            self.afford(seqs, rows, sorted(wanted, key=lambda w: -w[0]), gain, draft_seconds)
        return rows

    def afford(self, seqs: list[Sequence], rows: list[int], wanted: list[tuple[int, int, int]],
               gain: Callable[[int, int, int], float] | None, draft_seconds: float) -> None:
        """The probes `wanted` (steps idle, request, rows) in order, while the seconds they add to the step stay
        within the credit (all of them where the costs are not this machine's measured ones); then the step's plan is
        theirs too."""
        batch, context = len(seqs), self.step[1]
        before, planned = list(rows), sum(rows)
        time_factor = self._time_factor if self.plan is not None else self._timing(batch)
        priced = self.cost is not None and self.cost.online  # (a made-up table's seconds are not this machine's)
        base = self.cost(batch + planned, context, batch) if priced else 0.0
        spent, added = 0.0, 0
        for _, i, n in wanted:
            if priced:
                extra = self.cost(batch + planned + added + n, context, batch) - base
                extra = (extra + (0.0 if planned else draft_seconds)) * time_factor
                if extra > self.probe_credit:
                    break
                spent = extra
            rows[i] += n
            added += n
            self.idle[seqs[i].seq_id] = 0
        if not added or self.cost is None:
            return
        self.probe_credit -= spent
        plain = self.cost(batch, context, batch)
        p = self.plan = self.plan or Plan([0] * batch, float(batch), plain, plain)
        self._time_factor = time_factor
        if not planned:
            p.draft_seconds = draft_seconds
        p.rows = list(rows)
        p.tokens += sum(gain(i, before[i], rows[i]) for i in range(batch) if rows[i] > before[i]) if gain else 0.0
        p.seconds = (self.cost(batch + sum(rows), context, batch) + p.draft_seconds) * time_factor

    # ---- costs --------------------------------------------------------------------------------------------
    def row_cost(self, batch: int, rows: int, context: float) -> float:
        """What one more verified row costs a step of `batch` sequences verifying `rows` draft rows, in plain steps
        of one sequence (a plain step of the batch emits `batch` tokens)."""
        c = self.cost
        one_more = c(batch + rows + 1, context, batch) - c(batch + rows, context, batch)
        return max(0.0, one_more) * batch / c(batch, context, batch)

    def plain_seconds(self, batch: int, context: float) -> float:
        """A plain step's seconds per sequence."""
        return self.cost(batch, context, batch) / batch

    def draft_seconds(self, batch: int, budget: int) -> float:
        """What drafting is expected to take for `batch` sequences at this largest budget: the recent median of the
        nearest budget measured at this batch size, else of the nearest batch size scaled by the sequences (a
        drafter's host work grows with them); 0 before any."""
        if not self.draft_s:
            return 0.0
        near = min(self.draft_s, key=lambda k: (k[0] != batch, abs(k[0] - batch), abs(k[1] - budget), k))
        return self.draft_s[near].value * (1.0 if near[0] == batch else batch / near[0])

    def drafted(self, batch: int, rows: int, largest: int, seconds: float, early: bool) -> None:
        """This step drafted `rows` rows (`largest` the largest budget) in `seconds` (`early`: a draft made before
        its plan, whose time is already in them and not learnt again): the drafting time is learnt (but a stall, or
        a drafter's one-time work on new requests, indexing their prompts), and the plan's expected drafting time
        becomes the measured one."""
        if not early and largest and not (self.draft_s and seconds > STALL * self.draft_seconds(batch, largest)):
            self.draft_s.setdefault((batch, largest), Recent()).add(seconds)
        if self.plan is not None:
            self.plan.seconds += (seconds - self.plan.draft_seconds) * self._time_factor
            self.plan.draft_seconds = seconds
        self.step = (rows, self.step[1], seconds)

    def record_step(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step of `batch_size` sequences ran, emitting `tokens` in `seconds`: its time corrects the cost
        model's (less the drafting, and for a plain step the planning, `planned`), and a drafting step's plan is
        checked against it."""
        if self.cost is None:
            return
        self.probe_credit = min(self.probe_credit + PROBE_SHARE * seconds, 2 * seconds)  # (two steps' worth: no
        # more than a round of probes saved up)
        rows, context, draft_s = self.step if speculated else (0, *self.step[1:])  # (a draft made first and cut to
        # no rows took its drafting time all the same)
        planned = self.plan if speculated and rows and self.plan is not None else None
        if planned is not None and any(planned.rows):  # what the drafts added against what the plan expected
            if batch_size not in self.calibration:  # a new size starts from its nearest's
                self.calibration[batch_size] = dataclasses.replace(self.token_calibration(batch_size))
            self.calibration[batch_size].record(tokens - batch_size, (planned.tokens - batch_size) / self._factor)
            # and what the step took against its costs (not the time factor the plan priced it at)
            if self.cost.online:  # (a made-up table's seconds are not this machine's); a new size starts from its
                if batch_size not in self.timing:  # nearest's
                    near = self.time_calibration(batch_size)
                    self.timing[batch_size] = dataclasses.replace(near) if near is not None else TimeCalibration()
                self.timing[batch_size].record(seconds, planned.seconds / self._time_factor)
        if planned is None:  # a plain step: predicted as one, with what its drafting took
            plain = self.cost(batch_size, context, batch_size)
            planned = Plan([0] * batch_size, batch_size, plain + draft_s, plain)
            self.planning.setdefault(batch_size, Recent()).add(self._planning_s)
        planning = self.planning.get(batch_size)  # what plain decoding would take: as the plain steps, less this
        planned.plain_seconds -= planning.value if planning is not None else 0.0  # engine's planning in them
        self.prediction.add(planned, tokens, seconds)
        self.cost.observe(batch_size, batch_size + rows, context, seconds - draft_s)
        self.step, self.plan, self._planning_s = (0, 0.0, 0.0), None, 0.0

    def release(self, seq_id: int) -> None:
        """The sequence finished or was aborted."""
        self.acceptance.pop(seq_id, None)
        self.idle.pop(seq_id, None)
        self._shadows.pop(seq_id, None)
        self.worth.pop(seq_id, None)

    def forget(self) -> None:
        """What drafts kept is dropped (not the costs, which describe the machine)."""
        self.source, self.prediction = {}, Prediction()
