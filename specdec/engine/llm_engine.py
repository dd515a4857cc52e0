"""The engine loop: schedule -> run the model -> sample -> bookkeeping, one `step()` at a time."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specdec.config import EngineConfig, SamplingParams, SpecdecError

from specdec.drafting.registry import SpeculativeConfig
from specdec.drafting import DraftEnv, build_drafter
from specdec.engine.graphs import GraphRunner
from specdec.engine.model_runner import ModelRunner
from specdec.engine.parallel import TPRunner, Workers
from specdec.engine.scheduler import ScheduledBatch, Scheduler, StepOutput
from specdec.engine.sequence import Sequence
from specdec.engine.speculator import Speculator
from specdec.structured import GrammarCompiler, GrammarState, compiler_for, mask_logits
from specdec.kv_cache import BlockAllocator, KVPool
from specdec.models.llama import LlamaModel
from specdec.sampling import Penalized, TokenLogprob, penalize, sample_requests, token_logprobs
from specdec.tree import SpecShape

log = logging.getLogger("specdec.engine")


@dataclass
class RequestOutput:
    """What a finished (or streaming) request returns; vLLM-like names."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    metrics: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when SamplingParams.logprobs asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token after the first (prompt_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def eos_ids(model: LlamaModel, tokenizer) -> frozenset[int]:
    ids = model.config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class IncrementalText:
    """The text of a growing list of output ids, decoding only a short window each step (the prefix/read
    offsets of TGI and vLLM) instead of the whole output: the new text is decode(ids[prefix:]) minus
    decode(ids[prefix:read]), held back while it ends in an incomplete UTF-8 character."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode, self.text, self.prefix, self.read = decode, "", 0, 0

    def update(self, ids: list[int]) -> str:
        before = self.decode(ids[self.prefix:self.read])
        after = self.decode(ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(ids)
        return self.text


class LLMEngine:
    def __init__(self, model: LlamaModel, tokenizer, cfg: EngineConfig | None = None,
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
        lookahead = speculative.num_draft_tokens if speculative else 0
        self.scheduler = Scheduler(self.cfg, self.allocator, lookahead, speculative.num_slots if speculative else 0)
        graphs = GraphRunner(model, self.kv, bs, self.cfg.max_num_seqs, self.max_model_len, capture=True) \
            if model.device.type == "cuda" and not self.cfg.enforce_eager and workers is None else None
        self.runner = ModelRunner(model, self.kv, bs, graphs) if workers is None else \
            TPRunner(model, self.kv, bs, workers)
        self.speculator = None
        if speculative is not None:
            env = DraftEnv(model, self.kv, tokenizer, num_blocks, bs, self.runner.inputs, self.allocator.pools,
                           workers.tp.world if workers is not None else 1)
            self.speculator = Speculator(build_drafter(speculative, env), self.runner, speculative, tokenizer)
        self.feature_layers = self.speculator.feature_layers if self.speculator is not None else ()
        if self.speculator is not None:
            self.allocator.match_next_token = self.speculator.cache_reads_next_token
        self.eos_token_ids = eos_ids(model, tokenizer)
        self._ids = itertools.count()
        self._texts: dict[int, str] = {}
        self._detok: dict[int, IncrementalText] = {}  # sequences whose text is read while they run
        self._grammars: GrammarCompiler | None = None  # built at the first structured request (0.3 s)
        self.num_failed = 0  # requests failed by a step that raised with them alone
        # Tests and `bench --soak` only: called with each step's sequences before it computes; raising from it
        # is a fault in that step (how fault isolation is exercised without breaking a kernel).
        self.inject_fault: Callable[[list[Sequence]], None] | None = None

    def grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """A fresh grammar state for a request's structured output (None without one); compiling a bad
        schema, regex or grammar raises a SpecdecError naming the field."""
        if params.structured_output is None:
            return None
        if self._grammars is None:
            self._grammars = compiler_for(self.tokenizer, self.model.config.vocab_size, list(self.eos_token_ids))
        return self._grammars.state(params.structured_output)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    share_prompt_with: Sequence | None = None) -> Sequence:
        """Queue a request. `share_prompt_with`: an earlier request with the same prompt (another of n choices);
        this one waits for that one's prefill and shares its prompt's K/V blocks (through the prefix cache)."""
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
        seq = Sequence(next(self._ids), list(prompt_token_ids), params, self.max_model_len,
                       self.eos_token_ids, generator, grammar=grammar)
        if share_prompt_with is not None and share_prompt_with.prompt_token_ids == seq.prompt_token_ids:
            seq.prompt_source = share_prompt_with
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence, reason: str = "abort", stop_reason: str | None = None) -> None:
        """End a request now (a client gone: "abort"; a server limit: "length", with why in stop_reason)."""
        if not seq.is_finished:
            seq.stop_reason = stop_reason
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str | None = None) -> None:
        self._register_prefix(seq)  # its full blocks outlive it in the prefix cache
        self._detok.pop(seq.seq_id, None)
        self.scheduler.finish(seq, reason)
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

    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Advance every scheduled sequence; returns (sequence, tokens it gained this step)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        try:
            if self.inject_fault is not None:
                self.inject_fault(batch.seqs)
            if self.speculator is not None and not batch.is_prefill and self.speculator.drafts(batch.seqs):
                outputs = self.speculator.step(batch.seqs)
            else:
                # a prefill, plain decoding, or a batch size the dispatcher does not speculate at (and no forced
                # text to draft); the plain step still gathers the target features a feature drafter will need
                outputs = self._forward(batch)
        except SpecdecError:  # the engine's own failure (a tensor-parallel rank gone): every request's
            raise
        except Exception as e:  # noqa: BLE001  anything else: only the request at fault may fail
            return self._isolate(batch, e)
        self.scheduler.cleared(batch)
        self.scheduler.update(batch, outputs)
        events = []
        for seq, out in zip(batch.seqs, outputs):
            if out.tokens is None:
                continue
            seq.num_steps += 1
            kept = self._commit(seq, out.tokens)
            if out.logprobs is not None:
                seq.logprobs += out.logprobs[:len(kept)]
            events.append((seq, kept))
        for seq in batch.seqs:
            if not seq.is_finished:
                self._register_prefix(seq)
        return events

    def _isolate(self, batch: ScheduledBatch, error: Exception) -> list[tuple[Sequence, list[int]]]:
        """A step raised before any sequence kept anything from it. A sequence that ran alone fails (finish
        reason "error", the cause in stop_reason); a batch's sequences are each run alone next (scheduler
        `suspects`), so the others go on, and with greedy decoding their tokens are those of an unbroken run
        (the kernels are batch-invariant)."""
        if len(batch.seqs) > 1:
            log.warning("a step of %d sequences failed (%s: %s); running each alone", len(batch.seqs),
                        type(error).__name__, error)
            self.scheduler.suspect(batch.seqs)
            return []
        seq = batch.seqs[0]
        log.error("request %d failed: %s: %s", seq.seq_id, type(error).__name__, error,
                  exc_info=(type(error), error, error.__traceback__))
        self.num_failed += 1
        self.abort(seq, "error", f"{type(error).__name__}: {error}")
        return [(seq, [])]

    def _forward(self, batch: ScheduledBatch) -> list[StepOutput]:
        """A step without drafts (a prefill chunk, or plain decoding): feed the scheduled tokens, and sample
        the next token of every sequence whose input is then fully cached."""
        seqs, counts = batch.seqs, batch.num_new_tokens
        hidden, features = self.runner.run([s.block_table.blocks for s in seqs], [s.num_cached for s in seqs],
                                           [s.token_ids[s.num_cached:s.num_cached + n] for s, n in zip(seqs, counts)],
                                           feature_layers=self.feature_layers)
        ends = list(itertools.accumulate(counts))
        for seq, n, end in zip(seqs, counts, ends):
            if seq.params.prompt_logprobs is not None:
                self._prompt_logprobs(seq, hidden, end - n, n)
        ready = [i for i, (s, n) in enumerate(zip(seqs, counts)) if s.num_uncached == n]
        tokens: list[list[int] | None] = [None] * len(seqs)
        logprobs: list[list | None] = [None] * len(seqs)
        if ready:
            logits = self.runner.logits(hidden, [ends[i] - 1 for i in ready])
            asked = [k for k, i in enumerate(ready) if seqs[i].params.logprobs is not None]
            raw = logits[asked] if asked else None  # a copy: the model's own logits, before penalties
            penalized = [Penalized(k, s.params, s.prompt_token_ids, s.output_token_ids, [[]])
                         for k, s in enumerate(seqs[i] for i in ready) if s.params.penalized]
            if penalized:
                penalize(logits, penalized)
            if any(seqs[i].grammar is not None for i in ready):
                mask_logits(logits, [(seqs[i].grammar, [], [], seqs[i].params.greedy) for i in ready])
            next_tokens = sample_requests(logits, [seqs[i] for i in ready], self.model.device).tolist()
            for i, token in zip(ready, next_tokens):
                tokens[i] = [token]
            for row, k in enumerate(asked):
                logprobs[ready[k]] = token_logprobs(raw[row:row + 1], [next_tokens[k]], seqs[ready[k]].params.logprobs)
        return [StepOutput(n, t, None if features is None else features[end - n:end], lp)
                for n, t, end, lp in zip(counts, tokens, ends, logprobs)]

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

    # -- control for measuring tools (`specdec tune`) ---------------------------------------------------
    def pin_draft_shape(self, shape: SpecShape | None) -> None:
        """Draft this shape at every step, whatever the batch size (None: back to the dispatcher)."""
        if self.speculator is None:
            raise SpecdecError("this engine does not speculate: there is no draft shape to pin")
        if shape is not None and shape.num_slots > self.scheduler.lookahead:
            raise SpecdecError(f"draft shape {shape} needs {shape.num_slots} slots per step; this engine reserves "
                               f"{self.scheduler.lookahead} (its speculative config's largest shape)")
        self.speculator.pinned = shape

    @contextmanager
    def trace_speculation(self) -> Iterator[list[tuple[list[int], int]]]:
        """Within the block, every verification appends (accepted node indices, nodes drafted) per sequence."""
        if self.speculator is None:
            raise SpecdecError("this engine does not speculate: there is nothing to trace")
        self.speculator.trace = trace = []
        try:
            yield trace
        finally:
            self.speculator.trace = None

    def _register_prefix(self, seq: Sequence) -> None:
        """Offer the sequence's full blocks to the prefix cache, up to where both the target's K/V and the
        drafter's (when it keeps any in the shared blocks) hold committed tokens."""
        if not self.allocator.enable_prefix_caching:
            return
        n = min(seq.num_cached, len(seq.token_ids))
        if self.speculator is not None:
            drafted = self.speculator.cached_prefix(seq)
            n = n if drafted is None else min(n, drafted)
        self.allocator.register(seq.block_table, seq.token_ids, n)

    def _commit(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append tokens until a stop condition; finish the sequence if one fired. A structured request whose
        grammar allows no next token (it ended, e.g. past its end under ignore_eos) stops there."""
        kept = []
        if seq.grammar is not None and seq.grammar.dead:
            seq.finish_reason, seq.stop_reason = "stop", "structured output complete: no token may follow"
            self._finish(seq)
            return kept
        for token in tokens:
            kept.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            if seq.append(token) or self._hit_stop_string(seq):
                self._finish(seq)
                break
        return kept

    def _hit_stop_string(self, seq: Sequence) -> bool:
        if not seq.params.stop:
            return False
        text = self.text(seq)
        hits = [(text.find(s), s) for s in seq.params.stop if s in text]
        if not hits:
            return False
        cut, stop = min(hits)
        seq.finish_reason, seq.stop_reason = "stop", stop
        self._texts[seq.seq_id] = text[:cut]
        return True

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text(self, seq: Sequence) -> str:
        """The output text of a running sequence so far, decoded incrementally (stop strings, streaming);
        an incomplete UTF-8 character at the end is held back."""
        detok = self._detok.get(seq.seq_id)
        if detok is None:
            detok = self._detok[seq.seq_id] = IncrementalText(self.decode)
        return detok.update(seq.output_token_ids)

    def output(self, seq: Sequence, prompt: str | None = None) -> RequestOutput:
        text = self._texts.pop(seq.seq_id, None) if seq.is_finished else None
        if text is None:
            text = self.decode(seq.output_token_ids)
        return RequestOutput(seq.seq_id, prompt, seq.prompt_token_ids, seq.output_token_ids, text,
                             seq.finish_reason, seq.stop_reason, request_metrics(seq),
                             list(seq.logprobs) if seq.params.logprobs is not None else None,
                             list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None)


def request_metrics(seq: Sequence) -> dict:
    """Timing and speculation metrics of one request. acceptance_length = tokens emitted per target
    forward, bonus tokens included (TPC in the Meta paper, Spec-Bench's mean accepted tokens)."""
    n = len(seq.output_token_ids)
    end = seq.finish_time or time.perf_counter()
    ttft = (seq.first_token_time - seq.arrival_time) if seq.first_token_time else None
    decode_s = (end - seq.first_token_time) if seq.first_token_time else 0.0
    spec = seq.spec
    return {
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "accepted_per_pos": list(spec.accepted_per_pos),
        "acceptance_rate": spec.num_accepted_tokens / spec.num_draft_tokens if spec.num_draft_tokens else None,
        "acceptance_length": n / seq.num_steps if seq.num_steps else None,
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_cached_tokens": seq.num_prefix_hit,  # prompt tokens served from the prefix cache
        "num_generated_tokens": n,
        "num_steps": seq.num_steps,
        "ttft_s": ttft,
        "decode_s": decode_s,
        "e2e_s": end - seq.arrival_time,
        "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
        "grammar_s": seq.grammar.seconds if seq.grammar is not None else None,  # structured output's masks
    }
