"""Preparing the next batch while the current one runs (``train.prefetch``), on one background thread.

    with closing(prefetched(prepare, batches)) as stream:
        for prepared in stream:        # prepare(batches[i + 1]) runs while the caller uses prepared i
            step(prepared)

Overlap pays only where the main thread leaves the interpreter: numpy's GEMMs and the generated kernels
(cffi) release the GIL, Python dispatch does not, so on 2 cores the gain is at most the preparation's share
of a step (docs/benchmarks.md has the measurements). ``prepare`` must be pure with respect to what the caller's step
reads and writes: the trainer's prepares inputs, schedules and memory plans, never parameters, the
workspace or anything random (dropout is keyed by the step, read when the step runs).

An error raised by ``prepare(item)`` reaches the caller when it asks for that item, not before: the items
before it are used as they would be without prefetching. Closing the stream (the ``closing`` above, also on
an error or KeyboardInterrupt in the caller's loop) cancels the preparation not yet started and waits for
the one running, so no thread outlives the loop.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

Item = TypeVar("Item")
Prepared = TypeVar("Prepared")


def prefetched(prepare: Callable[[Item], Prepared], items: Sequence[Item],
               ahead: bool = True) -> Iterator[Prepared]:
    """``prepare(item)`` for each item in order; with ``ahead``, the next one on a background thread while
    the caller works on the current one (without: in the caller's thread, when asked for)."""
    if not ahead or len(items) < 2:
        for item in items:
            yield prepare(item)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="minicavs-prefetch") as pool:
        pending = pool.submit(prepare, items[0])
        try:
            for i in range(len(items)):
                current = pending.result()   # the worker's exception, re-raised here in the caller's thread
                pending = pool.submit(prepare, items[i + 1]) if i + 1 < len(items) else None
                yield current
        finally:   # closed early (an error, a break, KeyboardInterrupt): drop what has not started
            if pending is not None:
                pending.cancel()
    # leaving the with-block joins the worker thread (after the preparation it may still be running)
