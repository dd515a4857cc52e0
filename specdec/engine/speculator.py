"""Speculation's part of a decode step: what to draft (`draft`), and what follows verification (`settle`).

    fed rows per sequence:  [last committed token, d1, ..., dk]        (k may differ per sequence)
    target logits rows:     p(. | ..last), p(. | ..d1), ..., p(. | ..dk)
    after verification:     the K/V of `last` and the a accepted drafts stay; the cache is rewound past them

A tree is fed the same way, one row per node, with the tree mask and per-depth positions (see
model_runner). The engine runs the target and chooses the tokens (`token_choice`, the same path as a plain
step); the scheduler applies what each sequence keeps (a rewind: accepted tokens of a chain are already in
place, so nothing is copied; for a tree `settle` first moves the accepted path down to consecutive slots).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch

from specdec.config import SpecdecError
from specdec.drafting import Draft, Drafter, DraftRequest, SpeculativeConfig
from specdec.engine.cost import (
    DECAY,
    PRIOR_WEIGHT,
    PROBE_EVERY,
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
from specdec.engine.layout import StepLayout
from specdec.engine.model_runner import ModelRunner
from specdec.engine.sequence import Sequence, SpecStats
from specdec.engine.step_cost import STALL, Recent, StepCost
from specdec.engine.token_choice import Choice, StepDrafts
from specdec.structured import apply_bitmask, charge_grammar_time
from specdec.tree import PAD, SpecShape, TreeFeed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("specdec.engine")


# A feature drafter takes the target features of steps it drafted nothing in once this many rows wait, and the rest
# when its sequence finishes (`Speculator.catch_up`): a forward of its every 64 tokens costs little at any batch size.
CATCH_UP_ROWS = 64


def draft_request(seq: Sequence, max_tokens: int = 0, shape: SpecShape | None = None, keyed: bool = True
                  ) -> DraftRequest:
    """What a drafter sees of a sequence: plain values (the token and block lists are the sequence's own,
    read-only)."""
    return DraftRequest(seq.seq_id, seq.token_ids, seq.num_uncached, max_tokens, params=seq.params,
                        generator=seq.generator, sampling_seed=seq.sampling_seed if keyed else None,
                        position=len(seq.token_ids) - seq.num_prompt_tokens,
                        block_table=seq.block_table.blocks, num_cached=seq.num_cached,
                        num_prefix_hit=seq.num_prefix_hit, epoch=seq.num_preemptions,
                        tree=shape.tree if shape else None, dynamic=shape.dynamic if shape else None,
                        max_depth=seq.params.max_tokens - seq.num_output_tokens - 1)


class Speculator:
    def __init__(self, drafter: Drafter, runner: ModelRunner, cfg: SpeculativeConfig,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.drafter, self.runner, self.cfg, self.tokenizer = drafter, runner, cfg, tokenizer
        self.feature_layers = tuple(drafter.feature_layers)
        self.pinned: SpecShape | None = None  # a shape every step drafts, whatever the batch size (tune)
        self.trace: list[tuple[list[int], int]] | None = None  # when a list: (accepted nodes, drafted) per sequence
        self.totals = SpecStats()  # every request's drafts since the engine started (for /metrics)
        # The cost model (`engine.cost`): the verification costs the engine measured (None: every draft takes its
        # whole budget), what drafts kept per position by their evidence (`Draft.evidence`, None for a drafter that
        # gives none; every request's, and each request's own, recent first), the drafter's moving seconds by the
        # step's largest budget, and its predictions against the steps' times.
        self.cost: StepCost | None = None
        self.source: dict[Hashable, Acceptance] = {}
        self.acceptance: dict[int, dict[Hashable, Acceptance]] = {}
        self.idle: dict[int, int] = {}  # seq_id -> its steps since it last drafted
        self.draft_s: dict[tuple[int, int], Recent] = {}  # (batch size, largest budget) -> drafting seconds
        self.worth: dict[int, DraftingWorth] = {}  # seq_id -> what proposing first saved it and cost it
        self.prediction = Prediction()
        self.calibration = Calibration()
        self.timing: dict[int, TimeCalibration] = {}  # batch size -> its drafting steps' measured / predicted time
        self.steps = 0  # decode steps planned (probes fall on every PROBE_EVERY-th)
        self._factor = 1.0  # the calibration this step's plan took its gains at
        self._time_factor = 1.0  # and its drafting steps' time at (`TimeCalibration`)
        self._verified = 0  # drafts verified so far (what the plans learn from)
        self._quiet: tuple[int, int] | None = None  # (batch size, drafts verified) at a plan that drafted nothing
        self._rows: list[int] = []  # this step's draft budget per sequence (`drafts`)
        self._plan: Plan | None = None
        self._early: Draft | None = None  # this step's draft when made before its plan (`Drafter.drafts_first`)
        self._evidence: list[Hashable] = []  # what each sequence's draft this step rests on (None: no key)
        # seq_id -> (its length then, the chains passed over for the one verified, with their evidence): `_choose`
        self._passed: dict[int, tuple[int, list[tuple[list[int], Hashable]]]] = {}
        self._step = (0, 0.0, 0.0)  # this step's drafted rows, mean context and drafting seconds

    def budget(self, seq: Sequence, shape: SpecShape) -> int:
        """The most draft tokens the request may verify this step: none past the context or max_tokens, none for a
        sampled request when the config drafts for greedy ones only, none once its drafter failed on it."""
        if not (self.cfg.sampled or seq.params.greedy) or seq.spec.draft_error is not None:
            return 0
        room_in_context = seq.max_len - len(seq.token_ids)  # one slot per draft node
        room_in_output = seq.params.max_tokens - seq.num_output_tokens - 1  # one token per depth level
        if shape.dynamic and room_in_context < shape.num_slots:
            return 0  # the candidates it would feed do not fit before the end of the context
        return max(0, min(shape.num_tokens, room_in_context, shape.nodes_within(room_in_output)))

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

    def plan_rows(self, seqs: list[Sequence], context: float | None = None) -> list[int]:
        """Each sequence's draft budget this step: the rows the cost model expects to pay (`cost.plan`), one for a
        request idle for PROBE_EVERY steps and one more on every PROBE_EVERY-th draft (probes: a position's estimate
        learns only from drafts that reach it), the whole budget where a shape is pinned or no costs are
        measured or the config is not adaptive. A tree (or a drafter that sizes its own drafts) is all its nodes
        or none."""
        shape = self.shape_for(len(seqs))
        budgets = [self.budget(s, shape) for s in seqs] if shape.k else [0] * len(seqs)
        self._plan, self._early, self._evidence = None, None, [None] * len(seqs)
        if self.pinned is not None or self.cost is None or not self.cfg.adaptive or not any(budgets):
            return budgets
        whole = shape.tree is not None or shape.dynamic is not None or self.drafter.sizes_own_drafts
        if self.drafter.drafts_first and not whole and not self.feature_layers:
            return self._plan_drafted(seqs, budgets, shape, context)
        quiet = (len(seqs), self._verified)
        if self._quiet == quiet and (self.steps + 1) % PROBE_EVERY:  # no draft paid at the last plan and nothing
            return self._probe(seqs, budgets, [0] * len(seqs), whole)  # was learnt since: nor now (planned again
            # on every probe step, PROBE_EVERY steps apart)
        items, factor = [], self.calibration.factor
        self._factor = factor
        levels = max(min(b, shape.depth) if whole else b for b in budgets)
        every = self.every_rates(levels)  # once a step, shared by the batch
        for i, (s, b) in enumerate(zip(seqs, budgets)):
            if not b:
                continue
            g = [x * factor for x in self.rates(s.seq_id, min(b, shape.depth) if whole else b, every)]
            items += [Item(i, b, sum(g))] if whole else [Item(i, 1, x) for x in g]
        if context is None:  # the batch's mean length
            context = sum(len(s.token_ids) for s in seqs) / len(seqs)
        timing = self.timing.get(len(seqs))
        self._time_factor = timing.factor if timing is not None else 1.0
        self._plan = plan(items, len(seqs), context, self.cost, self.draft_seconds(len(seqs), max(budgets)),
                          self._time_factor)
        self._quiet = None if self._plan.drafts else quiet
        return self._probe(seqs, budgets, self._plan.rows, whole)

    def _plan_drafted(self, seqs: list[Sequence], budgets: list[int], shape: SpecShape, context: float | None
                      ) -> list[int]:
        """`plan_rows` for a drafter that `drafts_first`: its whole-budget draft now, then the rows of it the cost
        model expects to pay, each request's positions priced by what drafts of the same evidence kept (its own and
        every request's). Where the draft offers a request other chains (`Draft.alternatives`), the one priced
        highest is verified (`_choose`). Drafting is already paid, so the plan weighs the rows alone; a step with no
        draft plans nothing. A request whose proposals have cost more than its drafts saved is asked for none, but on
        one step in WORTH_PROBE (`DraftingWorth`)."""
        start = time.perf_counter()
        waiting = [bool(b) and not self._asks(s) for s, b in zip(seqs, budgets)]  # not asked: still idle
        budgets = [0 if w else b for b, w in zip(budgets, waiting)]
        asked = sum(1 for b in budgets if b)
        if not asked:
            return self._probe(seqs, budgets, [0] * len(seqs), False, waiting)
        keyed = self.cfg.sampled_verification == "keyed"
        requests = [draft_request(s, b, shape, keyed) for s, b in zip(seqs, budgets)]
        for r in requests:
            r.sized_by_plan = True
        self._learn_passed_over(seqs)
        draft = self.propose(seqs, requests)
        if context is None:
            context = sum(len(s.token_ids) for s in seqs) / len(seqs)
        factor = self._factor = self.calibration.factor
        every: dict[Hashable, list[float]] = {}  # evidence -> every request's rates, once a step
        known: dict[tuple[int, int, Hashable], list[float]] = {}  # (request, positions, evidence): `_choose` priced

        def rates(i: int, n: int, e: Hashable) -> list[float]:
            if (i, n, e) not in known:
                if e not in every:
                    every[e] = self.every_rates(max(budgets), e)
                known[i, n, e] = [g * factor for g in self.rates(seqs[i].seq_id, n, every[e], e)]
            return known[i, n, e]

        evidence = list(draft.evidence) if draft.evidence is not None else [None] * len(seqs)
        if draft.alternatives is not None:
            draft, evidence = self._choose(seqs, draft, evidence, budgets, context, rates)
        lengths = [min(len(t), b) for t, b in zip(draft.host_rows()[0], budgets)]
        self._early, self._evidence = draft, evidence
        seconds = time.perf_counter() - start
        self._step = (0, self._step[1], seconds)
        gains: list[list[float]] = [rates(i, n, e) if n else [] for i, (n, e) in enumerate(zip(lengths, evidence))]
        rows = [0] * len(seqs)
        if any(lengths):
            items = [Item(i, 1, g) for i, row in enumerate(gains) for g in row]
            timing = self.timing.get(len(seqs))
            self._time_factor = timing.factor if timing is not None else 1.0
            self._plan = plan(items, len(seqs), context, self.cost, 0.0, self._time_factor)
            rows = list(self._plan.rows)
        self._weigh_proposals(seqs, budgets, gains, rows, seconds / asked)
        return self._probe(seqs, lengths, rows, False, waiting)

    def _asks(self, seq: Sequence) -> bool:
        """Whether the request is asked for a proposal this step: while its proposals have paid, on every
        WORTH_PROBE-th step once they have not, and on a probe step once it has been idle for PROBE_EVERY (`_probe`:
        without the probe's row nothing it drafts could ever be measured again, and its proposals would never pay)."""
        worth = self.worth.get(seq.seq_id)
        probe = self.idle.get(seq.seq_id, 0) >= PROBE_EVERY and (self.steps + 1) % PROBE_EVERY == 0
        if worth is None or worth.pays or worth.skipped + 1 >= WORTH_PROBE or probe:
            if worth is not None:
                worth.skipped = 0
            return True
        worth.skipped += 1
        return False

    def _weigh_proposals(self, seqs: list[Sequence], budgets: list[int], gains: list[list[float]], rows: list[int],
                         share: float) -> None:
        """Each asked request's proposal against what its planned rows are expected to save: the tokens they add at
        plain decoding's seconds per token, less its share of the rows' time; `share`: its part of the proposing."""
        p = self._plan if any(rows) else None
        extra = (p.seconds - p.plain_seconds) / sum(rows) if p is not None else 0.0  # seconds a row adds
        for i, (s, b) in enumerate(zip(seqs, budgets)):
            if b:
                saved = sum(gains[i][:rows[i]]) * p.plain_seconds / len(seqs) - rows[i] * extra if rows[i] else 0.0
                self.worth.setdefault(s.seq_id, DraftingWorth()).record(saved, share)

    def _choose(self, seqs: list[Sequence], draft: Draft, evidence: list[Hashable], budgets: list[int],
                context: float, rates: Callable[[int, int, Hashable], list[float]]
                ) -> tuple[Draft, list[Hashable]]:
        """Each request's chain among its draft's row and its alternatives: the one whose positions are expected to
        keep the most tokens beyond what their rows cost (the sum of max(0, g(j) - c), c the price of a row this step
        in plain steps of one request; ties: the row). The others are kept to learn what they would have kept
        (`_learn_passed_over`)."""
        c = self.row_cost(len(seqs), 0, context)
        chosen, chosen_evidence = [], []
        for i, (row, e, others) in enumerate(zip(draft.host_rows()[0], evidence, draft.alternatives)):
            options = [(row, e), *others]
            values = [sum(max(0.0, g - c) for g in rates(i, min(len(t), budgets[i]), ev)) if t else -1.0
                      for t, ev in options]
            best = max(range(len(options)), key=values.__getitem__)  # the first maximum: the row among equals
            chosen.append(options[best][0][:budgets[i]])
            chosen_evidence.append(options[best][1] if options[best][0] else None)
            passed = [(t[:budgets[i]], ev) for n, (t, ev) in enumerate(options) if n != best and t]
            if passed:
                self._passed[seqs[i].seq_id] = (len(seqs[i].token_ids), passed)
        out = Draft.chains(chosen)
        out.evidence = chosen_evidence
        return out, chosen_evidence

    def _learn_passed_over(self, seqs: list[Sequence]) -> None:
        """What the chains passed over at a request's last step would have kept, read off the tokens committed since:
        a draft token is kept exactly when it is the token the target emits there (greedy, and sampled too, where a
        one-hot draft token is accepted with the target's own probability of it), so equality measures acceptance.
        It is learnt as verified drafts of the same evidence are, so an evidence that lost keeps being measured. A
        chain that matches every token committed since is measured as far as they go."""
        for s in seqs:
            passed = self._passed.pop(s.seq_id, None)
            if passed is None:
                continue
            length, chains = passed
            after = s.token_ids[length:]
            if not after:
                continue
            for tokens, e in chains:
                n = 0
                while n < len(tokens) and n < len(after) and tokens[n] == after[n]:
                    n += 1
                self._record(s.seq_id, e, len(tokens) if n < len(after) else n, n)

    def _record(self, seq_id: int, evidence: Hashable, depth: int, accepted: int) -> None:
        """A draft resting on `evidence` kept `accepted` of its first `depth` tokens (or tree levels)."""
        self.source.setdefault(evidence, Acceptance()).record(depth, accepted)
        own = self.acceptance.setdefault(seq_id, {})
        own.setdefault(evidence, Acceptance(decay=DECAY)).record(depth, accepted)

    def _probe(self, seqs: list[Sequence], budgets: list[int], rows: list[int], whole: bool,
               waiting: list[bool] | None = None) -> list[int]:
        """The planned rows with this step's probes added (see `plan_rows`). `waiting`: the requests not asked for a
        proposal this step (`_asks`), idle all the same."""
        self.steps += 1
        for i, (s, b) in enumerate(zip(seqs, budgets)):
            idle = 0 if rows[i] or not (b or (waiting and waiting[i])) else self.idle.get(s.seq_id, 0) + 1
            if b and idle >= PROBE_EVERY and self.steps % PROBE_EVERY == 0:  # a probe: one row (or the tree)
                rows[i], idle = (b if whole else 1), 0
            elif not whole and 0 < rows[i] < b and s.spec.num_drafts % PROBE_EVERY == PROBE_EVERY - 1:
                rows[i] += 1  # a deeper probe: the position after the ones that pay
            self.idle[s.seq_id] = idle
        return rows

    def row_cost(self, batch: int, rows: int, context: float) -> float:
        """What one more verified row costs a step of `batch` sequences verifying `rows` draft rows, in plain steps
        of one sequence (a plain step of the batch emits `batch` tokens)."""
        c = self.cost
        one_more = c(batch + rows + 1, context, batch) - c(batch + rows, context, batch)
        return max(0.0, one_more) * batch / c(batch, context, batch)

    def draft_seconds(self, batch: int, budget: int) -> float:
        """What drafting is expected to take for `batch` sequences at this largest budget: the recent median of the
        nearest budget measured at this batch size, else of the nearest batch size scaled by the sequences (a
        drafter's host work grows with them); 0 before any."""
        if not self.draft_s:
            return 0.0
        near = min(self.draft_s, key=lambda k: (k[0] != batch, abs(k[0] - batch), abs(k[1] - budget), k))
        return self.draft_s[near].value * (1.0 if near[0] == batch else batch / near[0])

    def shape_for(self, batch_size: int) -> SpecShape:
        """This step's draft shape: the pinned one (tune), else the config's for the batch size (its dispatch table's
        entry where it has one)."""
        if self.pinned is not None:
            return self.pinned
        return self.cfg.shape_for(batch_size)

    def record_step(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step of `batch_size` sequences ran, emitting `tokens` in `seconds`: its time corrects the cost
        model's (less the drafting), and a drafting step's plan is checked against it."""
        if self.cost is None or self.pinned is not None:
            return
        rows, context, draft_s = self._step if speculated else (0, *self._step[1:])  # (a draft made first and cut to
        # no rows took its drafting time all the same)
        planned = self._plan if speculated and rows and self._plan is not None else None
        if planned is not None and any(planned.rows):  # what the drafts added against what the plan expected
            self.calibration.record(tokens - batch_size, (planned.tokens - batch_size) / self._factor)
            # and what the step took against its costs (not the time factor the plan priced it at)
            if self.cost.online:  # (a made-up table's seconds are not this machine's)
                self.timing.setdefault(batch_size, TimeCalibration()).record(seconds,
                                                                             planned.seconds / self._time_factor)
        if planned is None:  # a plain step: predicted as one, with what its drafting took
            plain = self.cost(batch_size, context, batch_size)
            planned = Plan([0] * batch_size, batch_size, plain + draft_s, plain)
        self.prediction.add(planned, tokens, seconds)
        self.cost.observe(batch_size, batch_size + rows, context, seconds - draft_s)
        self._step, self._plan = (0, 0.0, 0.0), None

    def drafts(self, seqs: list[Sequence]) -> bool:
        """Whether a decode step of these sequences takes the speculative path: rows the cost model plans for (unless
        every one samples and the config drafts for greedy requests only), a drafter that watches the target at
        every step (recycling, Jacobi) whatever it drafts, or the text a structured request's grammar forces
        (jump-forward)."""
        drafting = self.cfg.sampled or any(s.params.greedy for s in seqs)
        self._step = (0, sum(len(s.token_ids) for s in seqs) / len(seqs), 0.0)
        self._early, self._evidence = None, [None] * len(seqs)
        self._rows = self.plan_rows(seqs, self._step[1]) if drafting else [0] * len(seqs)
        watching = (self.drafter.observe_topk or self.drafter.observe_drafts) and self.shape_for(len(seqs)).k
        return any(self._rows) or bool(watching) or (self.cfg.jump_forward > 0 and
                                                      any(s.grammar is not None for s in seqs))

    def draft(self, seqs: list[Sequence]) -> StepDrafts:
        """This step's drafts: the drafter's proposals within each request's planned rows (`drafts` plans them;
        the draft shape, chain, tree or none, follows the batch size), filtered and extended by the grammars of
        structured requests."""
        start = time.perf_counter()
        shape = self.shape_for(len(seqs))
        keyed = self.cfg.sampled_verification == "keyed"
        rows = self._rows if len(self._rows) == len(seqs) else [0] * len(seqs)
        early, requests = self._early, None
        if early is not None:  # made whole before the plan (`_plan_drafted`): cut to the planned rows below
            draft = early
        else:
            requests = [draft_request(s, k, shape, keyed) for s, k in zip(seqs, rows)]
            if any(rows) and self._plan is not None:  # for a drafter that sizes its own drafts (switch, hybrid)
                row_cost = self.row_cost(len(seqs), sum(rows), self._step[1])
                plain_seconds = self.cost(len(seqs), self._step[1], len(seqs)) / len(seqs)
                for r in requests:
                    r.row_cost, r.plain_seconds = row_cost, plain_seconds
            if any(rows) and self.feature_layers:  # hand over the target features gathered since the last draft
                for r, s in zip(requests, seqs):
                    if r.max_tokens:  # a request that does not draft keeps gathering them
                        r.features_start, r.features = s.take_features()
            draft = self.propose(seqs, requests) if any(rows) else Draft.chains([[] for _ in seqs])
        constrained = any(s.grammar is not None for s in seqs)
        if constrained:  # within each request's budget after this, maybe extended
            if requests is None:
                requests = [draft_request(s, k, shape, keyed) for s, k in zip(seqs, rows)]
            draft = self.constrain(seqs, requests, draft)
        drafted, parents = draft.host_rows()  # fed after the last token
        if not constrained:
            drafted = [row[:k] for row, k in zip(drafted, rows)]
            parents = [row[:k] for row, k in zip(parents, rows)]
        trees = [None if p == list(range(-1, len(p) - 1)) else TreeFeed.verification(p) for p in parents]
        seconds = time.perf_counter() - start
        if early is not None:  # its drafting was timed when it was made
            seconds += self._step[2]
        elif any(rows) and not (self.draft_s and seconds > STALL * self.draft_seconds(len(seqs), max(rows))):
            # (a stall, or a drafter's one-time work on new requests (indexing their prompts), is not learnt from)
            self.draft_s.setdefault((len(seqs), max(rows)), Recent()).add(seconds)
        if self._plan is not None:  # the drafting time it expected becomes the one measured
            self._plan.seconds += (seconds - self._plan.draft_seconds) * self._time_factor
            self._plan.draft_seconds = seconds
        self._step = (sum(len(d) for d in drafted), self._step[1], seconds)
        return StepDrafts(drafted, parents, trees, draft)

    @property
    def watches_target(self) -> bool:
        """Whether the drafter wants every row's argmax (`Drafter.observe_draft`)."""
        return self.drafter.observe_drafts

    def settle(self, seqs: list[Sequence], drafts: StepDrafts, layout: StepLayout, logits: torch.Tensor,
               choice: Choice) -> None:
        """After verification: show the drafter what the target did, move accepted tree nodes' K/V down to
        consecutive slots, record each request's acceptance (and its back-off). layout: the logits' rows."""
        k_obs, top1, result = self.drafter.observe_topk, choice.top1, choice.result
        for i, seq in enumerate(seqs):
            nodes, n = result.accepted_nodes[i], len(drafts.tokens[i])
            if k_obs and seq.spec.draft_error is None:  # the target's candidates after each kept token (recycling)
                kept = layout.kept_rows(i, nodes)  # the last token's and the accepted nodes' rows
                fed = [seq.token_ids[seq.num_cached]] + [drafts.tokens[i][node] for node in nodes]
                self.drafter.observe(seq.seq_id, fed, logits[kept].topk(k_obs, dim=-1).indices.tolist())
            if top1 is not None and n:  # the target's guess after every node (Jacobi iterations)
                rows = layout.rows(i)
                self.drafter.observe_draft(seq.seq_id, drafts.tokens[i], top1[rows.start:rows.stop])
            tree = drafts.trees[i]
            if tree is not None:
                self.runner.compact(seq.block_table.blocks, seq.num_cached, nodes)
            depth = n if tree is None else max(tree.rope)
            seq.spec.record(n, len(nodes), depth)
            if n:
                self._record(seq.seq_id, self._evidence[i] if i < len(self._evidence) else None, depth, len(nodes))
                self._verified += 1
            self.totals.record(n, len(nodes))
            if self.trace is not None:
                self.trace.append((nodes, n))

    def propose(self, seqs: list[Sequence], requests: list[DraftRequest]) -> Draft:
        """The drafter's proposals for the requests it still drafts for. A drafter that raises is asked again
        request by request; a request it fails on alone decodes without drafts from then on (drafts never
        decide the output, so it is unchanged), counted in /metrics; this step drafts nothing."""
        live = [i for i, s in enumerate(seqs) if s.spec.draft_error is None]
        if not live:
            return Draft.chains([[] for _ in seqs])
        try:
            return self._proposals([requests[i] for i in live]).spread(live, len(seqs))
        except Exception:  # noqa: BLE001  a drafter's failure costs speed, never a request
            for i in live:
                try:
                    self._proposals([requests[i]])
                except Exception as e:  # noqa: BLE001
                    seqs[i].spec.draft_error = f"{type(e).__name__}: {e}"
                    self.totals.num_draft_failures += 1
                    log.warning("request %d: the drafter failed (%s); it decodes without drafts",
                                seqs[i].seq_id, seqs[i].spec.draft_error)
            return Draft.chains([[] for _ in seqs])

    def _proposals(self, requests: list[DraftRequest]) -> Draft:
        draft = self.drafter.propose(requests)
        if self.cfg.info.validate_drafts:  # a user's drafter: refuse a malformed draft by name (ours are built valid)
            draft.validate(len(requests), self.runner.model.config.vocab_size)
        return draft

    def constrain(self, seqs: list[Sequence], requests: list[DraftRequest], draft: Draft) -> Draft:
        """Structured requests: drop the draft nodes their grammar forbids (with their subtrees) and draft the
        text it forces (up to the slots a step reserves; `GrammarState.filter_draft`). Dropping a node is
        lossless: a deterministic node is proposed independently of the target, and a sampled node that
        survives is one drawn from q restricted to the allowed tokens, so its q is renormalized there."""
        start = time.perf_counter()
        rows, origin = [], []
        for i, (seq, r) in enumerate(zip(seqs, requests)):
            n = min(int((draft.parents[i] != PAD).sum()), r.max_tokens)
            tokens, parents = draft.tokens[i, :n].tolist(), draft.parents[i, :n].tolist()
            if seq.grammar is None:
                rows.append((tokens, parents))
                origin.append(list(range(n)))
                continue
            room = min(self.cfg.jump_forward, seq.max_len - len(seq.token_ids),
                       seq.params.max_tokens - seq.num_output_tokens - 1)
            kept, kept_parents, index = seq.grammar.filter_draft(
                tokens, parents, self.tokenizer if self.cfg.jump_forward else None, max(0, room))
            rows.append((kept, kept_parents))
            origin.append(index)
        out = Draft.from_rows(rows)
        if draft.probs is not None and out.tokens.numel():
            out.probs = self._restricted_q(seqs, draft.probs, out, rows, origin)
        charge_grammar_time([s.grammar for s in seqs], time.perf_counter() - start)
        return out

    @staticmethod
    def _restricted_q(seqs: list[Sequence], q: torch.Tensor, out: Draft, rows: list[tuple[list[int], list[int]]],
                      origin: list[list[int]]) -> torch.Tensor:
        """Each kept node's q restricted to the tokens its grammar allows there and renormalized; one-hot for
        forced text."""
        probs = torch.zeros(*out.tokens.shape, q.shape[-1], device=q.device)
        for i, ((tokens, parents), index) in enumerate(zip(rows, origin)):
            masks = seqs[i].grammar.masks(tokens, parents) if seqs[i].grammar is not None else None
            for j, o in enumerate(index):
                if o < 0:
                    probs[i, j, tokens[j]] = 1.0
                    continue
                row = q[i, o].clone()
                if masks is not None:
                    apply_bitmask(row[None], masks[parents[j] + 1][None])
                    row = row.clamp(min=0).nan_to_num(0.0)
                    row = row / row.sum()
                probs[i, j] = row
        return probs

    # ---- what the engine asks of the drafter (it talks to the speculator only) --------------------------
    @property
    def cache_reads_next_token(self) -> bool:
        """Whether the drafter's K/V at slot t also encode token t + 1 (the prefix cache must then match it)."""
        return self.drafter.cache_reads_next_token

    def catch_up(self, seqs: list[Sequence], final: bool = False) -> None:
        """Hand a feature drafter the target features gathered over decode steps it drafted nothing in (the
        dispatcher said off, the request was paused) once CATCH_UP_ROWS of them wait, or whatever waits when
        `final` (the sequence finishes): all rows but the last (a row pairs a token's feature with the token after
        it; the next draft starts there), so its K/V follows the sequence and the sequence's blocks enter the
        prefix cache. A prompt's rows wait for the first decode step, which drafts from them. A drafter that fails
        here stops drafting for the request, as in `propose`; the output never depends on it."""
        if not self.feature_layers:
            return
        least = 2 if final else CATCH_UP_ROWS  # rows waiting (one stays behind)

        def waits(s: Sequence) -> bool:
            return s.spec.draft_error is None and bool(s.pending_features) and bool(s.block_table.blocks) and \
                s.num_cached - s.features_start >= least and (final or s.num_output_tokens > 1)

        late = [s for s in seqs if waits(s)]
        if not late:
            return
        requests = []
        for s in late:
            r = draft_request(s, 1)
            r.features_start, r.features = s.take_features(leave=1)
            requests.append(r)
        try:
            self.drafter.catch_up(requests)
        except Exception as e:  # noqa: BLE001  a drafter's failure costs speed, never a request
            for s in late:
                s.spec.draft_error = f"{type(e).__name__}: {e}"
            self.totals.num_draft_failures += len(late)
            log.warning("the drafter failed catching up on %d request(s) (%s); they decode without drafts", len(late),
                        late[0].spec.draft_error)

    def release(self, seq_id: int) -> None:
        """The sequence finished or was aborted: the drafter drops what it kept for it."""
        self.acceptance.pop(seq_id, None)
        self.idle.pop(seq_id, None)
        self._passed.pop(seq_id, None)
        self.worth.pop(seq_id, None)
        self.drafter.release(seq_id)

    def forget(self) -> None:
        """The drafter drops what it learnt from finished requests (none may be running), and so does the cost model
        (what drafts kept; not the costs, which describe the machine)."""
        self.source, self.prediction = {}, Prediction()
        self.drafter.forget()

    @property
    def head_path(self) -> str | None:
        """The directory of the head the drafter drafts with (None for a method without one)."""
        return self.drafter.head_path

    def reload_head(self, path: str) -> None:
        """The drafter drafts with the head in `path` from the next step on (between steps only)."""
        if not self.drafter.reloads_head:
            raise SpecdecError(f"method {self.cfg.method!r} drafts without a head it can reload; a server started "
                               "with an eagle, eagle3 or mtp head (alone or as a hybrid's source) can swap it")
        self.drafter.reload_head(path)

    def cached_prefix(self, seq: Sequence) -> int | None:
        """How many leading tokens of `seq` have final K/V in the drafter's own pool over the shared blocks;
        None when it keeps none there (see `Drafter.cached_prefix`)."""
        if not self.drafter.keeps_kv:  # asked per sequence and step: no request built for a drafter without K/V
            return None
        return self.drafter.cached_prefix(draft_request(seq))
