"""A pull stage that is one lookup of a parameter table by fed ids taken in place of its static graph
(minicavs/engine/pull_lookup.py): the tree models' runs skip the static graph for their pulls, give in float64 on
every runner the loss, outputs and gradients of the static graph's run and the same record for explain, and bad
ids raise the static graph's error, naming the vertex, with nothing left behind."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.core.errors import FeedError
from minicavs.cuda import Cuda
from minicavs.engine import pull_lookup
from minicavs.engine.static_program import StaticGraphs

from .test_static_program import _equal, _model, _run

RUNNERS = [("reference", False), ("device", False), ("device", True)]


def _static_graph(monkeypatch):
    """Every pull stage through its static graph (what ran before)."""
    monkeypatch.setattr(pull_lookup, "pulled", lambda *args: False)


def _pull_runs(monkeypatch) -> list:
    """The titles of the static graphs run, recorded as they run."""
    titles: list = []
    run = StaticGraphs.run

    def counting(self, nodes, explicit, env, feeds, params, ctx, options, static, title, *rest):
        titles.append(title)
        return run(self, nodes, explicit, env, feeds, params, ctx, options, static, title, *rest)
    monkeypatch.setattr(StaticGraphs, "run", counting)
    return titles


@pytest.mark.parametrize("name", ["tree_lstm", "tree_gru"])
def test_the_pulls_lookup_runs_no_static_graph_and_keeps_its_record(name, tmp_path, monkeypatch):
    t, graphs, feeds = _model(name, tmp_path)
    params = {k: p.value for k, p in t.params.items()}
    titles = _pull_runs(monkeypatch)
    got = t.model.infer(graphs, feeds, params)
    assert not [title for title in titles if "pulls" in title], titles
    ran = [run for run in got.static if "pulls" in run.title]
    with monkeypatch.context() as m:
        _static_graph(m)
        want = [run for run in t.model.infer(graphs, feeds, params).static if "pulls" in run.title]
    assert len(ran) == len(want) == 1
    for field in ("title", "runner", "nbytes", "rows", "trips", "program", "left", "linked"):
        assert getattr(ran[0], field) == getattr(want[0], field), field
    assert [s.outputs for s in ran[0].steps] == [s.outputs for s in want[0].steps]


@pytest.mark.parametrize("runner,emulated", RUNNERS)
def test_the_pulls_lookup_equals_the_static_graph_on_every_runner(cuda_standin, runner, emulated, tmp_path,
                                                                   monkeypatch):
    t, graphs, feeds = _model("tree_lstm", tmp_path)
    device = Cuda(cuda_standin) if emulated else None
    got = _run(t, graphs, feeds, runner, device, check=True)
    with monkeypatch.context() as m:
        _static_graph(m)
        want = _run(t, graphs, feeds, runner, device, check=True)
    _equal(got, want, f"{runner}{' (emulated CUDA)' * emulated}: training step")
    if device is None:
        params = {k: p.value for k, p in t.params.items()}
        got = t.model.infer(graphs, feeds, params)
        with monkeypatch.context() as m:
            _static_graph(m)
            want = t.model.infer(graphs, feeds, params)
        assert abs(got.loss - want.loss) <= 1e-12 * max(1.0, abs(want.loss))
        for k in want.outputs:
            np.testing.assert_allclose(got.outputs[k], want.outputs[k], rtol=0, atol=1e-12)


def _words(feeds) -> str:
    return next(k for k, v in feeds.items() if "word" in str(k))


@pytest.mark.parametrize("bad", ["past the table", "negative", "float", "missing"])
def test_bad_ids_raise_the_static_graphs_error_and_leave_nothing_behind(bad, tmp_path, monkeypatch):
    t, graphs, feeds = _model("tree_lstm", tmp_path)
    params = {k: p.value for k, p in t.params.items()}
    before = t.model.infer(graphs, feeds, params)
    key = _words(feeds)
    words = np.array(feeds[key])
    rows = params[next(n for n in params if n == "E" or n.endswith("E"))].shape[0]
    changed = {"past the table": lambda w: np.where(np.arange(len(w)) == 2, rows, w),
               "negative": lambda w: np.where(np.arange(len(w)) == 2, -1, w),
               "float": lambda w: w.astype(np.float64) + 0.5}
    wrong = {k: v for k, v in feeds.items() if k != key}
    if bad != "missing":
        wrong[key] = changed[bad](words)
    with pytest.raises(FeedError) as got:
        t.model.infer(graphs, wrong, params)
    with monkeypatch.context() as m:
        _static_graph(m)
        with pytest.raises(FeedError) as want:
            t.model.infer(graphs, wrong, params)
    assert str(got.value) == str(want.value)
    if bad in ("past the table", "negative"):
        assert "vertex" in str(got.value), str(got.value)
    after = t.model.infer(graphs, feeds, params)
    assert after.loss == before.loss
    for k in before.outputs:
        np.testing.assert_array_equal(after.outputs[k], before.outputs[k])
