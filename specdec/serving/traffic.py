"""Traffic recording (`specdec serve --record-traffic DIR`): what the server served, for training a draft head on
the deployment's own traffic, and `read_traffic` to read it back.

Record format: one JSON object per line (UTF-8), one line per finished choice (a request with n choices, or
several completion prompts, writes one line for each), in the order they finished:

    {"model": str,          the target's fingerprint (`specdec.models.loader.model_fingerprint(engine.model)`)
     "prompt_ids": [int],   the token ids the engine was given (chat: after the chat template and tools)
     "output_ids": [int],   the token ids the target generated (`RequestOutput.token_ids`: the stop token that
                            ended it included; a stop string's tokens kept whole, though the answer's text is cut)
     "finish_reason": str,  "stop" or "length" (the engine's reason: a tool call finished with "stop")
     "temperature": float,  the request's sampling temperature as the engine applied it (0 = greedy)
     "time": float}         unix seconds when it finished

Only requests that finished are written: one aborted (its client gone, the server shutting down) or failed by
the engine is not, so every record is a whole answer of the target.

Files: DIR/traffic-<UTC start time, YYYYmmddTHHMMSS.ffffffZ>-<pid>.jsonl, a new one at each start and once the
current one holds `max_records` lines (10,000), a tenth of the size cap, or is a day old; so several servers may
share DIR. DIR is made 0700 and each file 0600 (set so, whatever the umask); a DIR that already exists and that
other users may enter is used as it is, with a warning. Each line is written and flushed whole (no fsync: a crash
of the process loses nothing written, one of the machine at most what the OS had not yet written); a line cut short
by a crash while it was written is what `read_traffic` skips.

What is kept (`Recording`): at start and at each new file, DIR's traffic files last written more than `max_days`
ago are deleted, then the oldest ones until those left and a new file fit in `max_mb` (so DIR holds at most the
cap, give or take one record). Only traffic-*.jsonl files in DIR are ever deleted. A request sent with
`"record": false` is not written.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from specdec.config import SpecdecError

log = logging.getLogger("specdec.server")

MAX_RECORDS = 10_000  # lines per file
MAX_MB = 1024.0  # DIR's traffic files together, by default
FILES_PER_CAP = 10  # a file is closed once it holds this fraction of the cap, so the oldest tenth goes first
FILE_SECONDS = 86_400  # and once it is a day old, so the retention by age deletes whole files on time
DIR_MODE, FILE_MODE = 0o700, 0o600


@dataclass
class Recording:
    """What `specdec serve --record-traffic DIR` writes and keeps (see the module's docstring)."""

    directory: str | Path
    max_mb: float = MAX_MB  # --record-traffic-max-mb: the files together; past it the oldest are deleted
    max_days: float | None = None  # --record-traffic-days: files last written longer ago are deleted (None: kept)

    def __post_init__(self) -> None:
        if not self.max_mb > 0:
            raise SpecdecError(f"invalid --record-traffic-max-mb {self.max_mb}: must be positive")
        if self.max_days is not None and not self.max_days > 0:
            raise SpecdecError(f"invalid --record-traffic-days {self.max_days}: must be positive")


class TrafficRecorder:
    """Appends records to DIR's current file; call `record` from where outputs are finished (the engine thread:
    a small write and a flush, no fsync)."""

    def __init__(self, where: Recording | str | Path, model: str, max_records: int = MAX_RECORDS) -> None:
        """where: a Recording, or DIR with the default caps; model: the target's fingerprint, in every record."""
        self.recording = where if isinstance(where, Recording) else Recording(where)
        self.directory, self.model = Path(self.recording.directory).expanduser(), model
        self.max_records, self.max_bytes = max_records, int(self.recording.max_mb * 2**20)
        self.max_file_bytes = max(1, self.max_bytes // FILES_PER_CAP)
        self._make_directory()
        self.path: Path | None = None  # the file being written
        self._file: IO[bytes] | None = None
        self._lines = self._bytes = 0
        self._opened = 0.0  # when the current file was made
        self._failing = False  # the last write failed (logged once until one succeeds)
        self._lock = threading.Lock()
        self._prune()

    def _make_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, mode=DIR_MODE)
            os.chmod(self.directory, DIR_MODE)  # mkdir's mode passes through the umask
        except FileExistsError:
            if not self.directory.is_dir():
                raise SpecdecError(f"cannot record traffic in {self.directory}: it is not a directory") from None
            mode = stat.S_IMODE(self.directory.stat().st_mode)
            if mode & 0o077:
                log.warning("traffic recording: %s is open to other users (mode %o); its files are 0600, but "
                            "`chmod 700 %s` hides their names too", self.directory, mode, self.directory)
        except OSError as e:
            raise SpecdecError(f"cannot record traffic in {self.directory}: {e}") from None
        if not os.access(self.directory, os.W_OK):
            raise SpecdecError(f"cannot record traffic in {self.directory}: it is not writable")

    def record(self, prompt_ids: Sequence[int], output_ids: Sequence[int], finish_reason: str,
               temperature: float) -> None:
        """One finished request. A failed write (disk full) is logged, never raised: serving goes on."""
        line = (json.dumps({"model": self.model, "prompt_ids": list(prompt_ids), "output_ids": list(output_ids),
                            "finish_reason": finish_reason, "temperature": float(temperature),
                            "time": round(time.time(), 3)}, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                if self._full(len(line)):
                    self._open()
                self._file.write(line)
                self._file.flush()
                self._lines, self._bytes = self._lines + 1, self._bytes + len(line)
                self._failing = False
            except OSError as e:
                if not self._failing:
                    log.warning("traffic recording: cannot write to %s (%s); requests are still served", self.path, e)
                self._failing = True

    def _full(self, size: int) -> bool:
        """Whether the next line of `size` bytes goes to a new file (a new file takes one line whatever its size)."""
        return (self._file is None or self._lines >= self.max_records or time.time() - self._opened > FILE_SECONDS
                or (self._lines > 0 and self._bytes + size > self.max_file_bytes))

    def _open(self) -> None:
        """A new file named by the time now (a name already taken waits for the next microsecond), made 0600
        once what is kept leaves room for it."""
        self.close_file()
        self._prune()
        while True:
            now = time.time_ns() // 1000  # microseconds
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 1_000_000)) + f".{now % 1_000_000:06d}Z"
            self.path = self.directory / f"traffic-{stamp}-{os.getpid()}.jsonl"
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            except FileExistsError:
                continue
            os.fchmod(fd, FILE_MODE)  # as for the directory: the umask may have taken bits away
            self._file = os.fdopen(fd, "wb")  # kept open across records
            self._lines = self._bytes = 0
            self._opened = time.time()
            return

    def _prune(self) -> None:
        """Delete DIR's traffic files last written before the retention, then the oldest until the others and a new
        file fit in the cap. The file being written is closed first (or none is open yet)."""
        files = []
        for path in sorted(self.directory.glob("traffic-*.jsonl")):  # oldest first: names start with the time
            try:
                files.append((path, path.stat()))
            except FileNotFoundError:  # another server sharing DIR deleted it meanwhile
                continue
        days = self.recording.max_days
        cutoff = time.time() - days * 86_400 if days is not None else None
        total = sum(st.st_size for _, st in files)
        gone, freed = 0, 0
        for path, st in files:
            if (cutoff is None or st.st_mtime >= cutoff) and total + self.max_file_bytes <= self.max_bytes:
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                log.warning("traffic recording: cannot delete %s (%s)", path, e)
                continue
            total, gone, freed = total - st.st_size, gone + 1, freed + st.st_size
        if gone:
            log.info("traffic recording: deleted the %d oldest file(s) in %s (%.1f MiB) to keep %s", gone,
                     self.directory, freed / 2**20, f"{self.recording.max_mb:g} MiB and {days:g} days at most"
                     if days is not None else f"{self.recording.max_mb:g} MiB at most")

    def close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Close the current file (a later record starts a new one)."""
        with self._lock:
            self.close_file()


def read_traffic(directory: str | Path, model: str | None = None) -> list[dict]:
    """Every record in DIR's traffic-*.jsonl files, oldest file first, each file in order (see the module's
    docstring for the format); with `model`, only the records of that target fingerprint. A file's last line
    that does not parse (cut short by a crash, or still being written) is skipped; a bad line before it is a
    SpecdecError naming the file and line."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise SpecdecError(f"no traffic directory {directory}")
    records = []
    for path in sorted(directory.glob("traffic-*.jsonl")):
        lines = path.read_bytes().split(b"\n")
        if lines and not lines[-1]:
            lines.pop()  # the newline after the last whole line
        for number, raw in enumerate(lines, 1):
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                if number == len(lines):
                    break  # cut short: the line being written when the writer stopped
                raise SpecdecError(f"{path}:{number} is not a JSON record: {e}") from None
            if model is None or record.get("model") == model:
                records.append(record)
    return records
