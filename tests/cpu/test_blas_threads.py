"""cpu/blas_threads.py: the count set is the count numpy's BLAS reports (threadpoolctl reads it back, an observer
independent of the setter), through OpenBLAS's own symbol or threadpoolctl, and a bad count is refused."""
from __future__ import annotations

import pytest

from minicavs.cpu import blas_threads
from minicavs.cpu.blas_threads import BlasThreadsError, set_blas_threads

threadpoolctl = pytest.importorskip("threadpoolctl")   # (the test extra: the observer)


def _reported() -> set:
    return {i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}


@pytest.fixture
def restored():
    """Give the BLAS its thread count back after the test (other tests run with it)."""
    before = _reported()
    yield
    set_blas_threads(max(before))


@pytest.mark.parametrize("threads", [1, 2, 1])
def test_the_count_set_is_what_the_blas_reports(restored, threads):
    how = set_blas_threads(threads)
    assert _reported() == {threads}
    assert how.startswith("OpenBLAS ") or how.startswith("threadpoolctl")


def test_without_openblas_symbols_threadpoolctl_sets_it(restored, monkeypatch):
    monkeypatch.setattr(blas_threads, "_openblas_setter", lambda: None)
    for threads in (2, 1):
        assert set_blas_threads(threads).startswith("threadpoolctl")
        assert _reported() == {threads}


def test_no_way_to_set_it_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(blas_threads, "_openblas_setter", lambda: None)
    monkeypatch.setattr(blas_threads, "_threadpoolctl_setter", lambda threads: None)
    with pytest.raises(BlasThreadsError, match="cannot set 3 BLAS thread.*OPENBLAS_NUM_THREADS"):
        set_blas_threads(3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_count_is_refused_and_changes_nothing(bad):
    before = _reported()
    with pytest.raises(BlasThreadsError, match=r"BLAS threads: .* is not an integer >= 1"):
        set_blas_threads(bad)
    assert _reported() == before


def test_more_threads_than_the_library_runs_is_refused_and_the_count_kept(restored):
    if blas_threads._openblas_setter() is None:
        pytest.skip("numpy's BLAS is not OpenBLAS: its limit is threadpoolctl's business")
    set_blas_threads(1)
    with pytest.raises(BlasThreadsError, match=r"OpenBLAS runs \d+ when asked for 100000 .*; left at 1"):
        set_blas_threads(100_000)
    assert _reported() == {1}
