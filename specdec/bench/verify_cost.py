"""What verification costs on this machine: one target forward (all layers, LM head, argmax) feeding n tokens of
one sequence, against a plain decode step (n = 1). A hybrid tree is worth growing by one node only while that
node's chance of being accepted exceeds the extra time it takes to verify, in plain steps; `specdec tune`
measures that here, through the engine's measuring interface (`Measuring.time_verification`), and sets the
hybrid's `min_score` from it.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llama_cpp import Llama

    from specdec.engine.measuring import Measuring


def llamacpp_step_times(model: Llama, context: int, tokens: list[int], repeats: int = 9) -> dict[int, float]:
    """`engine.step_cost.time_verification` for llama.cpp (a `load_llamacpp(..., logits_all=True)` model: every fed
    row's logits, as verification needs): the same committed ids, each step evaluated after them and dropped again."""
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


def token_cost(measuring: Measuring, context: int, nodes: int, repeats: int = 9) -> float:
    """The extra time of verifying one more token, in plain steps, averaged over a tree of `nodes` drafts:
    (t(1 + nodes) - t(1)) / (nodes * t(1))."""
    t = measuring.time_verification(context, [1, 1 + nodes], repeats)
    return max(0.0, (t[1 + nodes] - t[1]) / (nodes * t[1]))
