"""One-time work: announced once per kind while someone listens, its seconds counted once when nested."""
from __future__ import annotations

import time

import pytest

from minicavs.core import onetime


def test_nested_work_counts_once_and_each_kind_is_announced_once():
    said: list = []
    before = onetime.seconds()
    with onetime.announcing(said.append):
        start = time.perf_counter()
        with onetime.one_time("compiling kernels"):
            time.sleep(0.02)
            with onetime.one_time("learning the FSM"):   # (an FSM's learning compiles a kernel: nested)
                time.sleep(0.02)
        with onetime.one_time("compiling kernels"):
            time.sleep(0.02)
        elapsed = time.perf_counter() - start
    counted = onetime.seconds() - before
    assert said == ["compiling kernels ...", "learning the FSM ..."]
    assert 0.06 <= counted <= elapsed
    with onetime.one_time("compiling kernels"):   # nobody listens any more
        pass
    assert said == ["compiling kernels ...", "learning the FSM ..."]


def test_failed_work_still_counts_and_the_error_passes():
    before = onetime.seconds()
    with pytest.raises(RuntimeError, match="C compiler failed"):
        with onetime.one_time("compiling kernels"):
            time.sleep(0.01)
            raise RuntimeError("C compiler failed")
    assert onetime.seconds() - before >= 0.01
    with onetime.one_time("outer"):     # the nesting depth came back to 0: this is outermost again
        time.sleep(0.01)
    assert onetime.seconds() - before >= 0.02
