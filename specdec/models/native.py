"""Build and load the C++ kernels for quantized weights (csrc/), once per machine.

They are compiled on first use with torch's extension builder (g++ and ninja), for the CPU they run on
(`-march=native`: AVX2, AVX-VNNI or AVX512-VNNI are picked up by the compiler, a portable scalar path
otherwise). The build is cached under $SPECDEC_CACHE (default ~/.cache/specdec), keyed by the source, the
compiler flags and the CPU's feature flags, so a copied cache never runs code built for another CPU.
`-fopenmp` makes at::parallel_for parallel; the extension then links libgomp.so.1, the runtime torch has
already loaded, so both share one thread pool. `-ffp-contract=off` keeps every multiply-add exactly as written, so each output element is computed by
the same instructions in every call: a row's bits do not depend on the batch.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
from functools import lru_cache
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "quant.cpp"  # includes the headers beside it
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fopenmp"]


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled on this machine (no compiler, or a failed build)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the build of these sources for this CPU lives."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "kernels" / build_key()


@lru_cache(maxsize=1)
def ops():
    """The compiled module (`QMatrix`, `Layer`, `linear`, `dequantize_rows`, `isa`); raises KernelBuildError."""
    import torch.utils.cpp_extension as ext

    key, cache = build_key(), cache_dir()
    (cache / "src").mkdir(parents=True, exist_ok=True)
    try:
        # One build at a time per cache, under a kernel-held lock that dies with its process. torch's own lock
        # file does not: a process killed while building left it behind and every later load waited on it
        # forever; under ours, a lock file still there is such a leftover and is removed.
        with open(cache / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (cache / "lock").unlink(missing_ok=True)
            # The sources are built from a copy in the cache, so that every checkout and install of this
            # version writes the same build file (torch rebuilds whenever the source path changes).
            for path in CSRC.iterdir():
                copy = cache / "src" / path.name
                if not copy.exists() or copy.read_bytes() != path.read_bytes():
                    copy.write_bytes(path.read_bytes())
            return ext.load(name=f"specdec_quant_{key}", sources=[str(cache / "src" / SOURCE.name)],
                            extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(cache), verbose=False)
    except Exception as err:  # compiler missing, or a build error: say which and how to avoid the kernels
        raise KernelBuildError(
            f"could not build the native quantized kernels ({type(err).__name__}: {str(err)[-500:]}); "
            "install g++ and ninja, or load the model with dtype='float32' or 'bfloat16'") from err


def available() -> bool:
    try:
        ops()
        return True
    except KernelBuildError:
        return False
