"""Hugging Face Hub ids (`org/name`, `org/name@revision`) for models and draft heads, resolved to a snapshot
directory through the local Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`), downloaded where the network
allows and `HF_HUB_OFFLINE` is not set. A path that exists on disk always wins over a Hub id of the same
spelling, and an id that resolves nowhere is an error naming the cache folder and the files it lacks."""
from __future__ import annotations

import os
import re
from pathlib import Path

from specdec.config import SpecdecError

# What a snapshot needs to be usable: a config (GGUF repos have none) and weights of a format we read.
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                   "*.gguf")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[\w./-]+)?$")


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a Hub id and names nothing on disk."""
    return bool(_HUB_ID.match(name)) and not Path(name).expanduser().exists()


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub(name: str, what: str, patterns: tuple[str, ...] = ("config.json", "*.json", *WEIGHT_PATTERNS)
                ) -> Path:
    """The local snapshot directory of Hub id `name` (`what` names it in errors: "model", "draft head"): from
    the cache, else downloaded (only files matching `patterns`) unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    repo_id, _, revision = name.partition("@")
    try:
        local = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=list(patterns),
                                       local_files_only=True))
        if _usable(local):
            return local
    except HFValidationError as e:
        raise SpecdecError(f"{what} {name!r} is not a valid Hugging Face id: {e}") from None
    except Exception:  # noqa: BLE001  not cached: download below, or say what is missing
        pass
    if offline():
        raise SpecdecError(_missing(name, repo_id, what, "HF_HUB_OFFLINE is set, so nothing is downloaded"))
    try:
        fetched = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=list(patterns)))
    except Exception as e:  # noqa: BLE001  no network, no such repo, gated: the cache is all there is
        first = str(e).splitlines()[0] if str(e) else ""
        raise SpecdecError(_missing(name, repo_id, what, f"downloading failed ({type(e).__name__}: {first})")) \
            from None
    if not _usable(fetched):
        raise SpecdecError(_missing(name, repo_id, what, "the repository has no weights specdec reads"))
    return fetched


def _usable(snapshot: Path) -> bool:
    """Whether a snapshot holds weights of a format we read (a config alone is not a model)."""
    return _has([p.name for p in snapshot.iterdir()], "weights")


def _missing(name: str, repo_id: str, what: str, why: str) -> str:
    """An error naming where the cache was looked at and what of the repository is (not) there."""
    folder = cache_dir() / f"models--{repo_id.replace('/', '--')}"
    snapshots = sorted((folder / "snapshots").glob("*")) if (folder / "snapshots").is_dir() else []
    if not snapshots:
        found = f"nothing is cached under {folder}"
    else:
        have = sorted(p.name for p in snapshots[-1].iterdir())
        lacks = [w for w in ("config.json", "weights (*.safetensors, *.bin, *.pt or *.gguf)")
                 if not _has(have, w)]
        found = f"{snapshots[-1]} holds {have or 'no files'}" + (f" and lacks {', '.join(lacks)}" if lacks else "")
    return (f"{what} {name!r} is not in the Hugging Face cache {cache_dir()} and {why}: {found}. Download it "
            f"where the network allows (huggingface-cli download {repo_id}), set HF_HOME to the cache that holds "
            "it, or pass a local path")


def _has(files: list[str], want: str) -> bool:
    if want == "config.json":
        return want in files
    return any(f.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")) for f in files)
