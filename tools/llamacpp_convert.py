"""llama.cpp's own converter (convert_hf_to_gguf.py, from the llama-cpp-python sdist we pin for the peer benchmarks) run
on a Hugging Face directory: the independent writer that checks specdec's reading of llama.cpp's GGUF layout.

The sdist is fetched once with pip (by package name) and its converter, `conversion/` and vendored `gguf-py` are kept
under $SPECDEC_CACHE/llama-cpp-convert/VERSION. The vocabulary step is skipped: its pre-tokenizer check knows only
published tokenizers (not a test's tiny trained BPE), and the tensors and model keys are what is checked.

    python tools/llamacpp_convert.py MODEL_DIR OUT.gguf [--outtype f32|f16|q8_0]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # as Makefile's bench-peers
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# Runs in the converter's own process: its modules first on the path, every model class's set_vocab a no-op.
_DRIVER = """
import sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "gguf-py")]
import convert_hf_to_gguf as conv
_get = conv.get_model_class
def get_model_class(*args, **kwargs):
    cls = _get(*args, **kwargs)
    for klass in cls.__mro__:
        if "set_vocab" in vars(klass):
            klass.set_vocab = lambda self: None
    return cls
conv.get_model_class = get_model_class
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outfile", sys.argv[3], "--outtype", sys.argv[4]]
conv.main()
"""


def converter_dir() -> Path:
    """Where the converter is kept, fetched and unpacked on first use."""
    from specdec.config import cache_root

    root = cache_root() / "llama-cpp-convert" / VERSION
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root.parent))  # same filesystem: renamed into place at once
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(_KEEP) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(staging, members=members, filter="data")
        try:
            os.replace(staging, root)  # atomic: a concurrent fetch either wins or finds it there
        except OSError:
            if not (root / "convert_hf_to_gguf.py").is_file():
                raise
    return root


def convert(model_dir: str | Path, out: str | Path, outtype: str = "f32") -> Path:
    """llama.cpp's GGUF of `model_dir` at `out` (no vocabulary)."""
    root = converter_dir()
    result = subprocess.run([sys.executable, "-c", _DRIVER, str(root), str(model_dir), str(out), outtype],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir}:\n{result.stderr[-3000:]}")
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    args = ap.parse_args(argv)
    print(convert(args.model_dir, args.out, args.outtype))


if __name__ == "__main__":
    main()
