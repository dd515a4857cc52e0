"""Machine facts a benchmark reports beside its figures: the CPU, torch's threads, and memory bandwidth (the
roofline of batch-1 decoding), sampled again beside every prompt because it drifts on shared machines."""
from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from specdec.engine.step_cost import cpu_model

BANDWIDTH_BUFFER_BYTES = 512 * 2**20  # far beyond any CPU cache, so the bandwidth is DRAM's
BANDWIDTH_REPEATS = 5


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info



def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Fastest of `repeats` timed calls after one untimed one: the least-disturbed run on a noisy machine."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device) -> dict:
    """Read bandwidth (a full-tensor sum) and STREAM-style copy bandwidth (bytes read + written by copy_)."""
    a = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    read_s = best_seconds(a.sum, BANDWIDTH_REPEATS, device)
    copy_s = best_seconds(lambda: b.copy_(a), BANDWIDTH_REPEATS, device)
    nbytes = a.numel() * a.element_size()
    return {"buffer_bytes": nbytes, "repeats": BANDWIDTH_REPEATS, "threads": torch.get_num_threads(),
            "read_bytes_per_s": nbytes / read_s, "copy_bytes_per_s": 2 * nbytes / copy_s}


def read_bandwidth_probe(device: torch.device) -> Callable[[], float]:
    """A quick read-bandwidth sample (bytes/s), taken beside every prompt: this machine's bandwidth drifts
    by tens of percent within minutes, so the roofline is also judged against the bandwidth of the moment."""
    a = torch.ones(BANDWIDTH_BUFFER_BYTES // 8, dtype=torch.float32, device=device)
    return lambda: a.numel() * a.element_size() / best_seconds(a.sum, 3, device)
