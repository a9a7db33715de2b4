"""How long each stage of a run was busy (`convert --upload`: download, convert, check, upload),
for the result: a stage is busy while at least one of its steps runs, whatever the number of its
threads or workers, so that the sum of the stages against the wall time measures their overlap."""

from __future__ import annotations

import contextlib
import threading
import time

DOWNLOAD, CONVERT, CHECK, UPLOAD = "download", "convert", "check", "upload"
STAGES = (DOWNLOAD, CONVERT, CHECK, UPLOAD)


class StageClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, int] = dict.fromkeys(STAGES, 0)
        self._since: dict[str, float] = {}
        self._busy: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def start(self, stage: str) -> None:
        with self._lock:
            if self._running[stage] == 0:
                self._since[stage] = time.perf_counter()
            self._running[stage] += 1

    def stop(self, stage: str) -> None:
        with self._lock:
            self._running[stage] -= 1
            if self._running[stage] == 0:
                self._busy[stage] += time.perf_counter() - self._since.pop(stage)

    @contextlib.contextmanager
    def busy(self, stage: str):
        self.start(stage)
        try:
            yield
        finally:
            self.stop(stage)

    def seconds(self) -> dict[str, float]:
        """Each stage's busy seconds so far (a step still running counted to now)."""
        now = time.perf_counter()
        with self._lock:
            return {s: round(self._busy[s] + (now - self._since[s] if s in self._since else 0.0), 3) for s in STAGES}
