"""A one-line progress bar with live throughput; quiet when stderr is not a terminal."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, unit: str, every: float = 0.5, stream=None):
        self.total, self.label, self.unit, self.every = total, label, unit, every
        self.stream = stream or sys.stderr
        self.live = getattr(self.stream, "isatty", lambda: False)()
        self.start = self.last = time.perf_counter()
        self.done = 0
        self.units = 0

    def update(self, units: int, **info) -> None:
        self.done += 1
        self.units += units
        now = time.perf_counter()
        if self.live and (now - self.last >= self.every or self.done == self.total):
            self.last = now
            rate = self.units / max(now - self.start, 1e-9)
            width = 24
            fill = int(width * self.done / max(self.total, 1))
            extra = " ".join(f"{k} {v:.4g}" for k, v in info.items())
            self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                              f"{rate:,.0f} {self.unit}/s {extra}\033[K")
            self.stream.flush()

    def close(self) -> float:
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()
        return time.perf_counter() - self.start
