"""What verification costs on this machine: one target forward (all layers, LM head, argmax) feeding n tokens of
one sequence, against a plain decode step (n = 1). A hybrid tree is worth growing by one node only while that
node's chance of being accepted exceeds the extra time it takes to verify, in plain steps; `specdec tune`
measures that here, with the engine's own runner, and sets the hybrid's `min_score` from it.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

from specdec.config import SamplingParams

if TYPE_CHECKING:
    from llama_cpp import Llama

    from specdec.engine.llm_engine import LLMEngine


def step_times(engine: LLMEngine, context: int, tokens: list[int], repeats: int = 9) -> dict[int, float]:
    """Median seconds of a step feeding n tokens after `context` committed ones, for each n in `tokens`. The
    shapes are interleaved repetition by repetition, so drift of the machine hits them alike; the fed tokens
    are written past the committed ones and never committed."""
    vocab = engine.model.config.vocab_size
    request_id = engine.add_request([(1000 + i) % vocab for i in range(context)],
                                    SamplingParams(temperature=0, max_tokens=max(tokens) + 1))
    seq = engine.sequence(request_id)  # a measuring tool: it feeds the runner past the engine's bookkeeping
    try:
        while seq.num_cached < context:  # the prompt's prefill
            engine.step()
        engine.allocator.allocate(seq.block_table, seq.num_cached + max(tokens))
        times: dict[int, list[float]] = {n: [] for n in tokens}
        for _ in range(repeats):
            for n in tokens:
                start = time.perf_counter()
                hidden, _ = engine.runner.run([seq.block_table.blocks], [seq.num_cached],
                                              [seq.token_ids[seq.num_cached:] + [100 % vocab] * (n - 1)])
                engine.runner.model.compute_logits(hidden).argmax(-1).tolist()  # the step's one copy back (a GPU waits)
                times[n].append(time.perf_counter() - start)
    finally:
        engine.abort(request_id)
    return {n: statistics.median(t) for n, t in times.items()}


def llamacpp_step_times(model: Llama, context: int, tokens: list[int], repeats: int = 9) -> dict[int, float]:
    """`step_times` for llama.cpp (a `load_llamacpp(..., logits_all=True)` model: every fed row's logits, as
    verification needs): the same committed ids, each step evaluated after them and dropped again."""
    vocab = model.n_vocab()
    model.reset()
    model.eval([(1000 + i) % vocab for i in range(context)])
    times: dict[int, list[float]] = {n: [] for n in tokens}
    for _ in range(repeats):
        for n in tokens:
            model.n_tokens = context  # eval first removes the K/V past n_tokens
            start = time.perf_counter()
            model.eval([(1000 + context) % vocab] + [100 % vocab] * (n - 1))
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def token_cost(engine: LLMEngine, context: int, nodes: int, repeats: int = 9) -> float:
    """The extra time of verifying one more token, in plain steps, averaged over a tree of `nodes` drafts:
    (t(1 + nodes) - t(1)) / (nodes * t(1))."""
    t = step_times(engine, context, [1, 1 + nodes], repeats)
    return max(0.0, (t[1 + nodes] - t[1]) / (nodes * t[1]))
