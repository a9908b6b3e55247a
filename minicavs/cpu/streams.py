"""Streams and events on the CPU: a stream is a worker thread that runs submitted work in order.

The engine puts eager work on one stream and the recurrent path on the caller's thread (§3.4), and waits on
an event where a recurrent node consumes an eager result. The same three calls (``submit``, ``Event.set``,
``Event.wait``) map onto a CUDA stream, ``cudaEventRecord`` and ``cudaStreamWaitEvent``. numpy releases the
GIL inside BLAS and large ufunc loops, which is where two threads can overlap on two cores.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable


class Event:
    """Set by the producing stream; ``wait`` blocks, and re-raises the producer's error if it failed."""

    __slots__ = ("_flag", "error")

    def __init__(self):
        self._flag = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._flag.set()

    def wait(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise self.error


class Stream:
    """Work submitted here runs in submission order on one daemon thread."""

    def __init__(self, name: str = "eager"):
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"minicavs-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, done = self._queue.get()
            try:
                fn()
                done.set()
            except BaseException as e:  # handed to whoever waits
                done.set(e)

    def submit(self, fn: Callable[[], None]) -> Event:
        done = Event()
        self._queue.put((fn, done))
        return done


_streams: dict[str, Stream] = {}
_lock = threading.Lock()


def get_stream(name: str = "eager") -> Stream:
    """One long-lived stream per name (threads are not created per batch)."""
    with _lock:
        if name not in _streams:
            _streams[name] = Stream(name)
        return _streams[name]
