"""One-time work: compiling C kernels on a cold cache, learning an FSM batching policy. It takes seconds, once,
and would otherwise pass silently inside the first epoch and drag down its throughput figure. The code doing
it wraps it in :func:`one_time`; whoever reports progress (the trainer) listens with :func:`announcing` to say
what is happening (one line per kind of work) and reads :func:`seconds` to leave that time out of a rate.

A base module with no imports from the package, so the compiler and the scheduler can use it.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

_lock = threading.Lock()
_listeners: list = []
_seconds = 0.0          # every process-wide second spent in outermost one-time work so far
_depth = threading.local()


def seconds() -> float:
    """Seconds spent in one-time work by this process so far (nested work counted once)."""
    return _seconds


@contextmanager
def one_time(what: str) -> Iterator[None]:
    """Run the body as one-time work described by ``what`` (e.g. ``compiling kernels (once, cached in
    ~/.cache/minicavs)``): listeners hear ``what`` before it starts, and its time adds to :func:`seconds`."""
    global _seconds
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(what)
    outer = not getattr(_depth, "n", 0)
    _depth.n = getattr(_depth, "n", 0) + 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _depth.n -= 1
        if outer:
            with _lock:
                _seconds += time.perf_counter() - start


@contextmanager
def announcing(log: Callable[[str], None]) -> Iterator[None]:
    """While in the block, ``log`` each kind of one-time work once, as it starts (``compiling kernels ...``)."""
    said: set = set()

    def listener(what: str) -> None:
        if what not in said:
            said.add(what)
            log(what + " ...")
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)
