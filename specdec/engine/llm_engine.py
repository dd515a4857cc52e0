"""The engine core: schedule -> draft -> run the model -> choose tokens -> commit, one `step()` at a time.

What a request looks like from outside (text, stop strings, updates, outputs) is `outputs.OutputProcessor`'s;
where each sequence's rows sit in a step is `layout.StepLayout`'s; where a step's time goes is `step_times`'.
"""
from __future__ import annotations

import gc
import itertools
import logging
import random
import time
from typing import TYPE_CHECKING

import torch

from specdec.config import EngineConfig, SamplingParams, SpecdecError
from specdec.drafting import DraftEnv, ForwardClock, SpeculativeConfig, build_drafter
from specdec.engine.commit import StepOutput, keep
from specdec.engine.graphs import GraphRunner
from specdec.engine.layout import StepLayout
from specdec.engine.model_runner import ModelRunner
from specdec.engine.outputs import OutputProcessor, RequestOutput, RequestUpdate, eos_ids
from specdec.engine.parallel import TPRunner, Workers
from specdec.engine.scheduler import ScheduledBatch, Scheduler
from specdec.engine.sequence import Sequence
from specdec.engine.speculator import Speculator
from specdec.engine.step_cost import engine_costs
from specdec.engine.step_times import StepTimes
from specdec.engine.token_choice import Choice, StepDrafts, choose_tokens
from specdec.kv_cache import BlockAllocator, KVPool
from specdec.models.llama import LlamaModel
from specdec.sampling import TokenLogprob, token_logprobs
from specdec.structured import GrammarCompiler, GrammarState, compiler_for

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("specdec.engine")


def freeze_heap() -> None:
    """Hide what the process holds once an engine is built (the model, the tokenizer, a datastore: about 225,000
    objects with the default model) from Python's cyclic collector (`gc.freeze`), as vLLM and SGLang do at startup.
    Otherwise each full collection walks them all: 126 ms on a Zen 4, about once in 4 s of speculative decoding at
    batch 4 (drafting's lists and dicts fill the young generations; plain decoding allocates almost none), a cost
    speculation paid and plain decoding did not. What an earlier engine froze is unfrozen and collected first, so
    an engine dropped since (in a reference cycle) is freed, not kept for good."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer: PreTrainedTokenizerBase, cfg: EngineConfig | None = None,
                 speculative: SpeculativeConfig | None = None, workers: Workers | None = None) -> None:
        """workers: the other tensor-parallel ranks, when `model` is rank 0's shard (see engine.parallel)."""
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg or EngineConfig()
        self.speculative = speculative
        if speculative is not None and workers is not None:  # before any rank allocates for this engine
            speculative.info.check_tensor_parallel(workers.tp.world)
        mcfg = model.config
        self.max_model_len = min(self.cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        bs = self.cfg.block_size
        num_blocks = self.cfg.num_kv_blocks
        if num_blocks is None:
            by_memory = int(self.cfg.kv_cache_memory_gb * 2**30 // KVPool.bytes_per_block(model.kv_config, bs,
                                                                                            model.kv_dtype))
            by_need = self.cfg.max_num_seqs * -(-self.max_model_len // bs) + 1
            num_blocks = max(2, min(by_memory, by_need))
        self.allocator = BlockAllocator(num_blocks, bs, self.cfg.enable_prefix_caching)
        if (num_blocks - 1) * bs < self.max_model_len:
            self.max_model_len = (num_blocks - 1) * bs  # one sequence must always fit
        self.kv = KVPool(model.kv_config, num_blocks, bs, model.kv_dtype, model.device)
        self.allocator.pools.append(self.kv)
        graphs = GraphRunner(model, self.kv, bs, self.cfg.max_num_seqs, self.max_model_len, capture=True) \
            if model.device.type == "cuda" and not self.cfg.enforce_eager and workers is None else None
        self.runner = ModelRunner(model, self.kv, bs, graphs) if workers is None else \
            TPRunner(model, self.kv, bs, workers)
        self.speculator = None
        self._speculated = False  # whether the last step drafted (the cost model's record)
        clock = ForwardClock()  # the drafter's model forwards
        if speculative is not None:
            env = DraftEnv(model, self.kv, tokenizer, num_blocks, bs, self.runner.inputs, self.allocator.pools,
                           workers.tp.world if workers is not None else 1, clock)
            self.speculator = Speculator(build_drafter(speculative, env), self.runner, speculative, tokenizer)
        self.feature_layers = self.speculator.feature_layers if self.speculator is not None else ()
        if self.speculator is not None:
            self.allocator.match_next_token = self.speculator.cache_reads_next_token
        self.scheduler = Scheduler(self.cfg, self.allocator, speculative.num_draft_tokens if speculative else 0,
                                   speculative.num_slots if speculative else 0,
                                   self.speculator.cached_prefix if self.speculator is not None else None)
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.outputs = OutputProcessor(tokenizer)
        cuda = model.device.type == "cuda"  # there the accounting waits for the device: off until switched on
        self.step_times = StepTimes(clock, torch.cuda.synchronize if cuda else None, on=not cuda)
        self._ids = itertools.count()
        self._requests: dict[int, Sequence] = {}  # request id -> its sequence, until its output is handed out
        self._grammars: GrammarCompiler | None = None  # built at the first structured request (0.3 s)
        self.num_failed = 0  # requests failed by a step that raised with them alone
        if self.speculator is not None:  # what verifying n rows costs here (cached, else measured now)
            self.speculator.planner.cost = engine_costs(self)
        freeze_heap()

    def grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """A fresh grammar state for a request's structured output (None without one); compiling a bad
        schema, regex or grammar raises a SpecdecError naming the field."""
        if params.structured_output is None:
            return None
        if self._grammars is None:
            self._grammars = compiler_for(self.tokenizer, self.model.config.vocab_size, list(self.eos_token_ids))
        return self._grammars.state(params.structured_output)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, share_prompt_with: int | None = None,
                    stream: bool = False) -> int:
        """Queue a request; returns its id. `share_prompt_with`: an earlier request with the same prompt (another of
        n choices); this one waits for that one's prefill and shares its prompt's K/V blocks (through the prefix
        cache). stream: every update carries the output's text so far (decoded incrementally)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise SpecdecError("prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise SpecdecError(f"prompt has {n} tokens but the model context is {self.max_model_len} tokens; "
                               f"shorten it to at most {self.max_model_len - 1}")
        vocab = self.model.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise SpecdecError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise SpecdecError(f"invalid logit_bias: token id {max(params.logit_bias)} is outside the vocabulary "
                               f"[0, {vocab})")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        grammar = self.grammar_state(params)
        seq = Sequence(next(self._ids), list(prompt_token_ids), params, self.max_model_len, self.eos_token_ids,
                       generator, params.seed if params.seed is not None else random.getrandbits(64), grammar=grammar)
        source = self._requests.get(share_prompt_with) if share_prompt_with is not None else None
        if source is not None and source.prompt_token_ids == seq.prompt_token_ids:
            seq.prompt_source = source
        self.scheduler.add(seq)
        self._requests[seq.seq_id] = seq
        self.outputs.add(seq, stream)
        return seq.seq_id

    def abort(self, request_id: int, reason: str = "abort", stop_reason: str | None = None) -> RequestOutput | None:
        """End a request now (a client gone: "abort"; a server limit: "length", with why in stop_reason) and return
        its output: what it generated so far. None for a request whose output was already handed out (or unknown)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        if not seq.is_finished:
            self._finish(seq, reason, stop_reason)
        return self._output(seq)

    def sequence(self, request_id: int) -> Sequence:
        """A running request's engine state (for the engine's own tests and measuring tools; front doors read
        `RequestUpdate`s)."""
        return self._requests[request_id]

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if self.speculator is not None:  # a feature drafter's K/V follows it to the end, for the prefix cache
            self.speculator.catch_up([seq], final=True)
        self.outputs.finished(seq)
        self.scheduler.finish(seq, reason, stop_reason)
        if self.speculator is not None:
            self.speculator.release(seq.seq_id)

    def forget_finished(self) -> None:
        """Make the drafter drop what it learnt from finished requests (see `Drafter.forget`)."""
        if self.has_unfinished():
            raise SpecdecError("forget_finished() while requests run: their drafter state would be lost")
        if self.speculator is not None:
            self.speculator.forget()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def draft_head(self) -> str | None:
        """The directory of the draft head speculation drafts with (None without a head method)."""
        return self.speculator.head_path if self.speculator is not None else None

    def reload_draft(self, path: str) -> None:
        """Draft with the head in `path` from the next step on: loaded and prepared (quantized, its native step
        built at first use) as the first one was. Not thread-safe (call it between steps, from the thread that
        steps). Requests in flight go on with it; the output is unchanged (verification decides every token). A
        head of another method or shape, or one that does not load, raises a SpecdecError naming why, and the
        current head keeps drafting."""
        if self.speculator is None:
            raise SpecdecError("this engine does not speculate (speculative_config off), so it has no draft head to "
                               "reload; start it with a head method (eagle, eagle3 or mtp)")
        self.speculator.reload_head(str(path))
        log.info("drafting with the head in %s", path)

    def stats(self) -> dict:
        """A snapshot of the engine's gauges and cumulative counters (what /metrics exports)."""
        totals = self.speculator.totals if self.speculator is not None else None
        alloc = self.allocator
        return {
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": alloc.num_used + alloc.num_cached_free,  # held by requests or by the prefix cache
            "kv_blocks_total": alloc.num_blocks - 1,
            "kv_blocks_cached": alloc.num_cached_free,  # kept only by the prefix cache (evictable)
            "prefix_cache_queried_tokens": alloc.prefix_queried_tokens,
            "prefix_cache_hit_tokens": alloc.prefix_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "spec_num_drafts": totals.num_drafts if totals else 0,
            "spec_num_draft_tokens": totals.num_draft_tokens if totals else 0,
            "spec_num_accepted_tokens": totals.num_accepted_tokens if totals else 0,
            "spec_accepted_per_pos": list(totals.accepted_per_pos) if totals else [],
            "spec_draft_failures": totals.num_draft_failures if totals else 0,
            "requests_failed": self.num_failed,
        }

    def step(self) -> list[RequestUpdate]:
        """Advance every scheduled sequence: schedule -> draft -> run the model -> choose tokens -> commit.
        Returns an update per request that gained tokens or finished. `step_times` accounts for each phase."""
        self.step_times.begin()
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        self.step_times.mark("schedule")
        try:
            outputs = self._compute(batch)
        except SpecdecError:  # the engine's own failure (a tensor-parallel rank gone): every request's
            raise
        except Exception as e:  # noqa: BLE001  anything else: only the request at fault may fail
            self._isolate(batch, e)
            updates = [self._update(seq, [], None) for seq in batch.seqs if seq.is_finished]
            self.step_times.end(batch.is_prefill, 0)
            return updates
        updates = self._commit_step(batch, outputs)
        emitted = sum(len(u.new_token_ids) for u in updates)
        self.step_times.end(batch.is_prefill, emitted)
        if self.speculator is not None and not batch.is_prefill:
            self.speculator.record_step(len(batch.seqs), self._speculated, emitted, time.perf_counter() - start)
        return updates

    def _commit_step(self, batch: ScheduledBatch, outputs: list[StepOutput]) -> list[RequestUpdate]:
        """The commit, in one direction (`commit`): decide what each sequence keeps, then account for it once: the
        scheduler caches it, the sequences that stopped finish, the drafter takes the others' target features,
        and their full blocks enter the prefix cache."""
        self.scheduler.cleared(batch)
        kept = [keep(seq, out, self.outputs) for seq, out in zip(batch.seqs, outputs)]
        self.scheduler.update(kept)
        for k in kept:
            if k.finish_reason is not None:
                self._finish(k.seq, k.finish_reason, k.stop_reason)
        running = [seq for seq in batch.seqs if not seq.is_finished]
        if self.speculator is not None:
            self.speculator.catch_up(running)
        self.scheduler.settle(running)
        return [self._update(k.seq, k.tokens, k.logprobs) for k in kept if k.tokens is not None]

    def _update(self, seq: Sequence, new_ids: list[int], new_logprobs: list[TokenLogprob] | None) -> RequestUpdate:
        update = self.outputs.update(seq, new_ids, new_logprobs)
        if update.finished:  # its output is handed out: the engine forgets the request
            self._requests.pop(seq.seq_id, None)
        return update

    def _compute(self, batch: ScheduledBatch) -> list[StepOutput]:
        """One forward and the tokens it yields. Every sequence feeds its scheduled tokens (a prefill chunk, or its
        last token) and, in a speculative decode step, its draft after them; a sequence whose input is then fully
        cached chooses its next tokens through `token_choice` (no drafts: a plain step). A prefill or plain step
        still gathers the target features a feature drafter will need."""
        seqs, counts, times = batch.seqs, batch.num_new_tokens, self.step_times
        speculating = self.speculator is not None and not batch.is_prefill and self.speculator.drafts(seqs)
        self._speculated = speculating
        drafts = self.speculator.draft(seqs) if speculating else StepDrafts.none(len(seqs))
        times.mark_draft()
        feeds = [s.token_ids[s.num_cached:s.num_cached + n] + d for s, n, d in zip(seqs, counts, drafts.tokens)]
        layout = StepLayout.build(counts, drafts.counts,
                                  [i for i, (s, n) in enumerate(zip(seqs, counts)) if s.num_uncached == n])
        tables, starts = [s.block_table.blocks for s in seqs], [s.num_cached for s in seqs]
        trees = drafts.trees if drafts.any_tree else None
        logits = None
        if layout.ready:  # the LM head in the forward's own call where the model runs natively
            hidden, features, logits = self.runner.run_logits(tables, starts, feeds, trees, self.feature_layers,
                                                              layout.logits_rows)
        else:
            hidden, features = self.runner.run(tables, starts, feeds, trees, self.feature_layers)
        times.mark("target_forward")
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            if seq.params.prompt_logprobs is not None:
                self._prompt_logprobs(seq, hidden, layout.starts[i], n)
        times.mark("logits")
        choice = None
        if logits is not None:  # each ready sequence's rows: after its last fed token, then after each draft node
            chosen = [seqs[i] for i in layout.ready]
            if speculating:  # a decode step: every sequence feeds its one last token, so all are ready
                choice = choose_tokens(chosen, logits, drafts, layout.logits, self.speculator.watches_target,
                                       self.speculator.cfg.sampled_verification == "rejection")
                times.mark("token_choice")
                self.speculator.settle(chosen, drafts, layout.logits, logits, choice)
                times.mark("settle")
            else:
                choice = choose_tokens(chosen, logits, StepDrafts.none(len(chosen)), layout.logits)
                times.mark("token_choice")
        return self._step_outputs(layout, features, choice)

    @staticmethod
    def _step_outputs(layout: StepLayout, features: torch.Tensor | None, choice: Choice | None) -> list[StepOutput]:
        """What each sequence produced: a prefill chunk short of its prompt's end, its fed tokens; a ready sequence,
        also its accepted draft nodes (moved to the slots after the fed tokens) and the tokens it emits."""
        outputs, ready = [], {i: k for k, i in enumerate(layout.ready)}  # sequence -> its place among the ready
        for i, n in enumerate(layout.num_fed):
            k = ready.get(i)
            if k is None:
                outputs.append(StepOutput(n, None, None if features is None else features[layout.fed_rows(i)]))
                continue
            nodes = choice.result.accepted_nodes[k]
            rows = layout.kept_index(i, nodes)
            outputs.append(StepOutput(n, choice.result.emitted_tokens[k],
                                      None if features is None else features[rows], choice.logprobs[k]))
        return outputs

    def _isolate(self, batch: ScheduledBatch, error: Exception) -> None:
        """A step raised before any sequence kept anything from it. A sequence that ran alone fails (finish
        reason "error", the cause in stop_reason); a batch's sequences are each run alone next (scheduler
        `suspects`), so the others go on, and with greedy decoding their tokens are those of an unbroken run
        (the kernels are batch-invariant)."""
        if len(batch.seqs) > 1:
            log.warning("a step of %d sequences failed (%s: %s); running each alone", len(batch.seqs),
                        type(error).__name__, error)
            self.scheduler.suspect(batch.seqs)
            return
        seq = batch.seqs[0]
        log.error("request %d failed: %s: %s", seq.seq_id, type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        self.num_failed += 1
        self._finish(seq, "error", f"{type(error).__name__}: {error}")

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, row: int, n: int) -> None:
        """Log-probabilities of the prompt tokens this prefill chunk predicts (rows row .. row + n - 1 hold
        positions num_cached ..; each predicts the next position), appended once each (a preempted sequence
        prefills again and adds nothing)."""
        first = seq.num_cached + 1  # the position row `row` predicts
        done = len(seq.prompt_logprobs) + 1  # positions 1 .. done - 1 are recorded
        last = min(seq.num_cached + n, seq.num_prompt_tokens - 1)  # the last prompt position predicted
        if last < done:
            return
        rows = [row + p - first for p in range(done, last + 1)]
        logits = self.runner.logits(hidden, rows)
        seq.prompt_logprobs += token_logprobs(logits, seq.prompt_token_ids[done:last + 1], seq.params.prompt_logprobs)

    def decode(self, token_ids: list[int]) -> str:
        return self.outputs.decode(token_ids)

    def _output(self, seq: Sequence) -> RequestOutput:
        """A finished request's result, handed out once: the engine forgets the request."""
        self._requests.pop(seq.seq_id, None)
        return self.outputs.output(seq)

