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
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from specdec.config import SpecdecError
from specdec.drafting import Draft, Drafter, DraftRequest, SpeculativeConfig
from specdec.engine.layout import StepLayout
from specdec.engine.model_runner import ModelRunner
from specdec.engine.planner import DraftPlanner
from specdec.engine.sequence import Sequence, SpecStats
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
        self.planner = DraftPlanner()  # the cost model: what drafts keep and cost, and the rows each step verifies
        self._rows: list[int] = []  # this step's draft budget per sequence (`drafts`)
        self._early: Draft | None = None  # this step's draft when made before its plan (`Drafter.drafts_first`)
        self._evidence: list[Hashable] = []  # what each sequence's draft this step rests on (None: no key)

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

    def plan_rows(self, seqs: list[Sequence], context: float | None = None) -> list[int]:
        """Each sequence's draft budget this step: the rows the cost model expects to pay (`DraftPlanner`), with its
        probes, the whole budget where a shape is pinned or no costs are measured or the config is not adaptive. A
        tree (or a drafter that sizes its own drafts) is all its nodes or none."""
        shape = self.shape_for(len(seqs))
        budgets = [self.budget(s, shape) for s in seqs] if shape.k else [0] * len(seqs)
        planner = self.planner
        planner.plan, self._early, self._evidence = None, None, [None] * len(seqs)
        if self.pinned is not None or planner.cost is None or not self.cfg.adaptive or not any(budgets):
            return budgets
        if context is None:  # the batch's mean length
            context = sum(len(s.token_ids) for s in seqs) / len(seqs)
        whole = shape.tree is not None or shape.dynamic is not None or self.drafter.sizes_own_drafts
        if self.drafter.drafts_first and not whole and not self.feature_layers:
            return self._plan_drafted(seqs, budgets, shape, context)
        return planner.plan_budgets(seqs, budgets, shape.depth, whole, context)

    def _plan_drafted(self, seqs: list[Sequence], budgets: list[int], shape: SpecShape, context: float
                      ) -> list[int]:
        """`plan_rows` for a drafter that `drafts_first`: its whole-budget draft now, then the rows of it that pay
        (`DraftPlanner.plan_proposed`); a step with no draft plans nothing. A request whose proposals have cost more
        than its drafts saved is asked for none, but on one step in WORTH_PROBE (`DraftPlanner.asks`). What the
        proposals not verified would have kept is learnt from the tokens committed since (`DraftPlanner.shadow`)."""
        start = time.perf_counter()
        planner = self.planner
        planner.learn_shadows(seqs)
        waiting = [bool(b) and not planner.asks(s) for s, b in zip(seqs, budgets)]  # not asked: still idle
        budgets = [0 if w else b for b, w in zip(budgets, waiting)]
        if not any(budgets):
            return planner.probe(seqs, budgets, [0] * len(seqs), False, waiting, shadowed=True)
        keyed = self.cfg.sampled_verification == "keyed"
        asked = [i for i, b in enumerate(budgets) if b]  # the drafter sees these alone (the others' text waits)
        requests = [draft_request(seqs[i], budgets[i], shape, keyed) for i in asked]
        for r in requests:
            r.sized_by_plan = True
        draft = self.propose([seqs[i] for i in asked], requests).spread(asked, len(seqs))
        draft, self._evidence, rows = planner.plan_proposed(seqs, budgets, draft, start, context, waiting)
        self._early = draft
        return rows

    def shape_for(self, batch_size: int) -> SpecShape:
        """This step's draft shape: the pinned one (tune), else the config's for the batch size (its dispatch table's
        entry where it has one)."""
        if self.pinned is not None:
            return self.pinned
        return self.cfg.shape_for(batch_size)

    def record_step(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step of `batch_size` sequences ran, emitting `tokens` in `seconds` (`DraftPlanner.record_step`; a
        pinned shape's steps are not the plans')."""
        if self.pinned is None:
            self.planner.record_step(batch_size, speculated, tokens, seconds)

    def drafts(self, seqs: list[Sequence]) -> bool:
        """Whether a decode step of these sequences takes the speculative path: rows the cost model plans for (unless
        every one samples and the config drafts for greedy requests only), a drafter that watches the target at
        every step (recycling, Jacobi) whatever it drafts, or the text a structured request's grammar forces
        (jump-forward)."""
        start = time.perf_counter()
        drafting = self.cfg.sampled or any(s.params.greedy for s in seqs)
        context = sum(len(s.token_ids) for s in seqs) / len(seqs)
        self.planner.start_step(context)
        self._early, self._evidence = None, [None] * len(seqs)
        self._rows = self.plan_rows(seqs, context) if drafting else [0] * len(seqs)
        self.planner.planned(time.perf_counter() - start)
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
        early, requests, planner = self._early, None, self.planner
        if early is not None:  # made whole before the plan (`_plan_drafted`): cut to the planned rows below
            draft = early
        else:
            requests = [draft_request(s, k, shape, keyed) for s, k in zip(seqs, rows)]
            if any(rows) and planner.plan is not None:  # for a drafter that sizes its own drafts (switch, hybrid)
                row_cost = planner.row_cost(len(seqs), sum(rows), planner.step[1])
                plain_seconds = planner.plain_seconds(len(seqs), planner.step[1])
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
            seconds += planner.step[2]
        planner.drafted(len(seqs), sum(len(d) for d in drafted), max(rows), seconds, early is not None)
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
                self.planner.record(seq.seq_id, self._evidence[i] if i < len(self._evidence) else None, depth,
                                    len(nodes))
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
        self.planner.release(seq_id)
        self.drafter.release(seq_id)

    def forget(self) -> None:
        """The drafter drops what it learnt from finished requests (none may be running), and so does the cost model
        (what drafts kept; not the costs, which describe the machine)."""
        self.planner.forget()
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
