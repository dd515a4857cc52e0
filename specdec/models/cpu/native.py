"""Build and load the C++ kernels for quantized weights (csrc/), once per machine and instruction set.

They are compiled on first use with torch's extension builder (g++ and ninja). By default for the CPU they run
on (`-march=native`: AVX2, AVX-VNNI or AVX512-VNNI are picked up by the compiler, a portable scalar path
otherwise); `ops(isa)` or $SPECDEC_ISA picks another path, one of ISAS, to test or compare it:

  isa          compiler flags                         csrc/simd.h path    CPU flags it needs
  native       -march=native                          the best of below   (none)
  avx2         -march=x86-64 -mavx2 -mfma -mf16c      AVX2                avx2 fma f16c
  avx512       avx2's + -mavx512{f,bw,dq,vl,vnni}     AVX-512 + VNNI      + avx512f bw dq vl avx512_vnni
  avx512vnni   avx2's + -mavx512vnni -mavx512vl       AVX2 + VNNI         + avx512_vnni avx512vl
  avxvnni      avx2's + -mavxvnni                     AVX2 + VNNI         + avx_vnni
  portable     -march=x86-64 (no AVX)                 scalar              (none)

The vector paths give the same bits (VNNI computes exactly AVX2's integers); the scalar path adds the same
products in another order (per block of 32, not in 8 lanes), so its outputs differ from theirs in float32 rounding.
Each is its own build, cached under $SPECDEC_CACHE (default ~/.cache/specdec) and keyed by the source, the
compiler flags and the CPU's feature flags, so a copied cache never runs code built for another CPU; each loads
as its own module, so several can be compared in one process. `-fopenmp` makes at::parallel_for parallel; the
extension then links libgomp.so.1, the runtime torch has already loaded, so both share one thread pool.
`-ffp-contract=off` keeps every multiply-add exactly as written, so each output element is computed by the same
instructions in every call: a row's bits do not depend on the batch.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
from functools import cache, lru_cache
from pathlib import Path
from types import ModuleType

from specdec.config import cache_root

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "bindings.cpp"  # the one translation unit: includes every header beside it
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-fopenmp"]  # every ISA's, then its own
ISA_ENV = "SPECDEC_ISA"  # the process's default ISA

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_AVX2 = ["-march=x86-64", "-mavx2", "-mfma", "-mf16c"]
# name: (compiler flags, /proc/cpuinfo flags the CPU must have to run the build)
ISAS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "native": (["-march=native"], ()),
    "avx2": (_AVX2, ("avx2", "fma", "f16c")),
    "avx512": (_AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"],
               ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")),
    "avx512vnni": (_AVX2 + ["-mavx512vnni", "-mavx512vl"], ("avx2", "fma", "f16c", "avx512_vnni", "avx512vl")),
    "avxvnni": (_AVX2 + ["-mavxvnni"], ("avx2", "fma", "f16c", "avx_vnni")),
    "portable": (["-march=x86-64"] if _X86 else [], ()),  # elsewhere the compiler's default target
}


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled on this machine (no compiler, a failed build, or an instruction
    set this CPU cannot execute)."""


def _cpuinfo(*keys: str) -> str | None:
    """The first /proc/cpuinfo line's value whose name starts with one of `keys` (None: no such line, or no file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def _cpu_flags() -> str:
    return _cpuinfo("flags", "Features") or platform.processor() or platform.machine()


def resolve_isa(isa: str | None = None) -> str:
    """`isa`, else $SPECDEC_ISA, else "native"; a name not in ISAS is a ValueError naming the choices."""
    isa = isa or os.environ.get(ISA_ENV) or "native"
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r} for the native kernels; choose one of {list(ISAS)} "
                         f"(argument isa or ${ISA_ENV})")
    return isa


def missing_cpu_flags(isa: str | None = None) -> list[str]:
    """The CPU flags `isa` needs that this CPU lacks (none: it can run that build)."""
    have = set(_cpu_flags().split())
    return [flag for flag in ISAS[resolve_isa(isa)][1] if flag not in have]


def runnable_isas() -> list[str]:
    """The instruction sets this CPU can execute, "native" and "portable" always among them."""
    return [isa for isa in ISAS if not missing_cpu_flags(isa)]


def distinct_isas() -> list[str]:
    """Every code path this CPU can run, each once: "native", then each runnable ISA whose path (its build's
    `isa()`) is not native's. What the tests run every kernel on; builds the native kernels to learn their path."""
    path = ops("native").isa()
    return ["native"] + [isa for isa in runnable_isas() if isa not in ("native", path)]


@lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("AuthenticAMD", "GenuineIntel"), else "" (another OS or architecture)."""
    return _cpuinfo("vendor_id") or ""


def vendor_flags(vendor: str) -> list[str]:
    """Defines that tune the kernels to a vendor's caches: the interleaved weights are prefetched non-temporally on
    AMD (kept out of the shared L3, measured faster on Zen 4) and into L1 elsewhere (on Intel, non-temporal
    prefetches of the stream made a decode step 2.3x slower: csrc/gemm.h). The same bits either way."""
    return ["-DSPECDEC_STREAM_NTA"] if vendor == "AuthenticAMD" else []


def compiler_flags(isa: str | None = None) -> list[str]:
    return FLAGS + ISAS[resolve_isa(isa)][0] + vendor_flags(cpu_vendor())


def build_key(isa: str | None = None) -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    h.update(" ".join(compiler_flags(isa)).encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def cache_dir(isa: str | None = None) -> Path:
    """Where the build of these sources for this CPU and instruction set lives."""
    return cache_root() / "kernels" / build_key(isa)


@cache
def ops(isa: str | None = None) -> ModuleType:
    """The compiled module (`QMatrix`, `Layer`, `linear`, `dequantize_rows`, `isa`, ...) for instruction set
    `isa`, default $SPECDEC_ISA (read on the first call) else "native"; one module's objects are not accepted by
    another's functions. Raises ValueError for an unknown name, KernelBuildError for a failed build or an
    instruction set this CPU cannot run."""
    isa = resolve_isa(isa)
    missing = missing_cpu_flags(isa)
    if missing:
        raise KernelBuildError(f"this CPU cannot run the native kernels built for {isa!r}: /proc/cpuinfo lacks "
                               f"{' '.join(missing)}; choose one of {runnable_isas()} (argument isa or ${ISA_ENV})")
    return _build(isa)


@cache
def _build(isa: str):
    import torch.utils.cpp_extension as ext

    key, cache = build_key(isa), cache_dir(isa)
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
                            extra_cflags=compiler_flags(isa), extra_ldflags=["-fopenmp"], build_directory=str(cache),
                            verbose=False)
    except Exception as err:  # compiler missing, or a build error: say which and how to avoid the kernels
        raise KernelBuildError(
            f"could not build the native quantized kernels ({type(err).__name__}: {str(err)[-500:]}); "
            "install g++ and ninja, or load the model with dtype='float32' or 'bfloat16'") from err


def available(isa: str | None = None) -> bool:
    try:
        ops(isa)
        return True
    except KernelBuildError:
        return False
