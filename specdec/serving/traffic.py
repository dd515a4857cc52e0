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

Files: DIR/traffic-<UTC start time, YYYYmmddTHHMMSS.ffffffZ>-<pid>.jsonl, a new one after `max_records` lines
(10,000) and at each start, so several servers may share DIR. Each line is written and flushed whole (no fsync:
a crash of the process loses nothing written, one of the machine at most what the OS had not yet written); a
line cut short by a crash while it was written is what `read_traffic` skips.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from specdec.config import SpecdecError

log = logging.getLogger("specdec.server")

MAX_RECORDS = 10_000  # lines per file


class TrafficRecorder:
    """Appends records to DIR's current file; call `record` from where outputs are finished (the engine thread:
    a small write and a flush, no fsync)."""

    def __init__(self, directory: str | Path, model: str, max_records: int = MAX_RECORDS) -> None:
        """model: the target's fingerprint, written in every record."""
        self.directory, self.model, self.max_records = Path(directory).expanduser(), model, max_records
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecdecError(f"cannot record traffic in {self.directory}: {e}") from None
        if not os.access(self.directory, os.W_OK):
            raise SpecdecError(f"cannot record traffic in {self.directory}: it is not writable")
        self.path: Path | None = None  # the file being written
        self._file: IO[bytes] | None = None
        self._lines = 0
        self._failing = False  # the last write failed (logged once until one succeeds)
        self._lock = threading.Lock()

    def record(self, prompt_ids: Sequence[int], output_ids: Sequence[int], finish_reason: str,
               temperature: float) -> None:
        """One finished request. A failed write (disk full) is logged, never raised: serving goes on."""
        line = json.dumps({"model": self.model, "prompt_ids": list(prompt_ids), "output_ids": list(output_ids),
                           "finish_reason": finish_reason, "temperature": float(temperature),
                           "time": round(time.time(), 3)}, separators=(",", ":")) + "\n"
        with self._lock:
            try:
                if self._file is None or self._lines >= self.max_records:
                    self._open()
                self._file.write(line.encode())
                self._file.flush()
                self._lines += 1
                self._failing = False
            except OSError as e:
                if not self._failing:
                    log.warning("traffic recording: cannot write to %s (%s); requests are still served", self.path, e)
                self._failing = True

    def _open(self) -> None:
        """A new file named by the time now (a name already taken waits for the next microsecond)."""
        self.close_file()
        while True:
            now = time.time_ns() // 1000  # microseconds
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 1_000_000)) + f".{now % 1_000_000:06d}Z"
            self.path = self.directory / f"traffic-{stamp}-{os.getpid()}.jsonl"
            try:
                self._file, self._lines = open(self.path, "xb"), 0  # kept open across records
                return
            except FileExistsError:
                continue

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
