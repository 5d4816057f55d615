"""A rank's progress reports, read by the launcher's watchdog (``harness.jobs.watchdog``).

``Heartbeat(folder, rank).beat(step=3, of=50, layout="dcp")`` atomically rewrites ``rank<r>.json`` in the
job's heartbeat folder (at most every ``min_interval_s`` unless ``force``); ``Heartbeat.failed()`` writes
``rank<r>.error`` (time and traceback) when the rank's job raises. A ``Heartbeat(None, rank)`` does nothing
(a job started by hand, without a launcher). It sits below the runtime, which reports through it, and above
nothing: the training loop, the parallel checks and the benchmarks beat without importing the launcher.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path


class Heartbeat:
    def __init__(self, folder: str | os.PathLike | None, rank: int, min_interval_s: float = 0.5):
        self.folder = Path(folder) if folder else None
        self.rank, self.min_interval_s, self._last = rank, min_interval_s, 0.0

    @classmethod
    def from_cfg(cls, cfg: dict, rank: int) -> Heartbeat:
        return cls(cfg.get("heartbeat_dir"), rank)

    def beat(self, force: bool = False, **where) -> None:
        """Record that this rank is at ``where`` (e.g. ``step=3, of=50, layout="dcp"``) now."""
        now = time.time()
        if self.folder is None or (not force and now - self._last < self.min_interval_s):
            return
        self._last = now
        self._write(f"rank{self.rank}.json", json.dumps({"rank": self.rank, "pid": os.getpid(), "time": now, **where}))

    def note(self, kind: str, **fields) -> None:
        """Write ``rank<r>.<kind>`` (JSON; not a progress report): e.g. ``peer`` when this rank saw a rank of
        another node stop (``harness.jobs.peers``)."""
        if self.folder is not None:
            self._write(f"rank{self.rank}.{kind}", json.dumps({"rank": self.rank, "time": time.time(), **fields}))

    def failed(self) -> None:
        """Record the exception being handled (call from an ``except`` block)."""
        if self.folder is not None:
            self._write(f"rank{self.rank}.error", f"{time.time()}\n{traceback.format_exc()}")

    def _write(self, name: str, text: str) -> None:
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.folder / name)
