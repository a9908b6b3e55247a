"""The CPU's worker-thread streams (cpu/streams.py): work submitted runs in order on the stream's thread, and
an error there reaches the thread that waits for it (the C runner's eager call is submitted so)."""
from __future__ import annotations

import threading

import pytest

from minicavs.cpu.streams import get_stream


def test_submitted_work_runs_in_order_on_the_streams_thread():
    ran = []
    events = [get_stream("eager").submit(lambda i=i: ran.append((i, threading.get_ident()))) for i in range(5)]
    for ev in events:
        ev.wait()
    assert [i for i, _ in ran] == list(range(5))
    assert {t for _, t in ran} != {threading.get_ident()} and len({t for _, t in ran}) == 1


def test_an_error_on_the_stream_reaches_the_waiting_thread():
    def boom():
        raise ValueError("boom on the eager stream")
    first = get_stream("eager").submit(lambda: None)
    failing = get_stream("eager").submit(boom)
    after = get_stream("eager").submit(lambda: None)
    first.wait()
    with pytest.raises(ValueError, match="boom on the eager stream"):
        failing.wait()
    after.wait()   # (the stream goes on with the next work)
