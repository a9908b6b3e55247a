"""A one-line progress bar with live throughput, elapsed time and ETA; quiet when stderr is not a terminal."""
from __future__ import annotations

import sys
import time


def duration(seconds: float) -> str:
    """``75`` -> ``1:15``, ``3725`` -> ``1:02:05``."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, total: int, label: str, unit: str, every: float = 0.5, stream=None):
        self.total, self.label, self.unit, self.every = total, label, unit, every
        self.stream = stream or sys.stderr
        self.live = getattr(self.stream, "isatty", lambda: False)()
        self.start = self.last = time.perf_counter()
        self.done = 0
        self.units = 0

    def line(self, now: float, **info) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.units / elapsed
        width = 24
        fill = int(width * self.done / max(self.total, 1))
        left = elapsed / max(self.done, 1) * (self.total - self.done)
        extra = "".join(f" {k} {v:.4g}" for k, v in info.items())
        return (f"{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} batches, "
                f"{rate:,.0f} {self.unit}/s{extra}, {duration(elapsed)} elapsed, ETA {duration(left)}")

    def update(self, units: int, **info) -> None:
        self.done += 1
        self.units += units
        now = time.perf_counter()
        if self.live and (now - self.last >= self.every or self.done == self.total):
            self.last = now
            self.stream.write(f"\r{self.line(now, **info)}\033[K")
            self.stream.flush()

    def close(self) -> float:
        if self.live:
            self.stream.write("\r\033[K")
            self.stream.flush()
        return time.perf_counter() - self.start
