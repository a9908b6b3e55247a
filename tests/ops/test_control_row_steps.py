"""foreach with a trip count per row (minicavs/ops/control.py, ``steps`` of shape (None,)): forward against a
plain numpy loop per row, float64 central finite differences for rows of 0, 1, several and the most steps,
padding that does no work (the body sees the active rows alone, NaN there reaches nothing, gradients past a
row's length exactly zero) and bad trip counts refused, naming ``steps``."""
from __future__ import annotations

import numpy as np
import pytest

import minicavs.ops as ops
from minicavs import control as C
from minicavs.core.errors import FeedError, ShapeError
from minicavs.engine.executor import run
from minicavs.ops.autodiff import grad
from minicavs.ops.subgraph import Subgraph
from minicavs.train.testing import check_grads

F64 = "float64"
T, E, H = 4, 3, 2


def _graph():
    """h' = tanh(x W + h U + c) with c a per-row value read from outside; outputs h' and h' * x[:1] * a."""
    xs, h0 = ops.input((None, T, E), F64, name="xs"), ops.input((None, H), F64, name="h0")
    ctx, lengths = ops.input((None, H), F64, name="ctx"), ops.input((None,), "int64", name="lengths")
    W, U, a = ops.param_node("W", (E, H), F64), ops.param_node("U", (H, H), F64), ops.param_node("a", (), F64)

    def body(x, h):
        h2 = ops.tanh(ops.matmul(x, W) + ops.matmul(h, U) + ctx)
        return [h2, h2 * ops.slice_(x, 0, 1) * a], h2
    (y1, y2), hT = C.foreach(body, xs, h0, steps=lengths, name="rnn")
    return (xs, h0, ctx, lengths), (W, U, a), [y1, y2, hT]


def _values(lengths, seed=0):
    rng = np.random.default_rng(seed)
    n = len(lengths)
    feeds = [rng.standard_normal((n, T, E)), rng.standard_normal((n, H)), 0.3 * rng.standard_normal((n, H)),
             np.asarray(lengths, np.int64)]
    params = {"W": 0.5 * rng.standard_normal((E, H)), "U": 0.5 * rng.standard_normal((H, H)), "a": 1.3}
    return feeds, params


def _reference(X, H0, ctx, lengths, params):
    """The loop row by row in numpy, each row for its own number of steps."""
    y1, y2, hT = np.zeros((len(X), T, H)), np.zeros((len(X), T, H)), H0.copy()
    for r, n in enumerate(lengths):
        h = H0[r]
        for t in range(n):
            h = np.tanh(X[r, t] @ params["W"] + h @ params["U"] + ctx[r])
            y1[r, t], y2[r, t] = h, h * X[r, t, :1] * params["a"]
        hT[r] = h
    return y1, y2, hT


def _close(got, want, tol=1e-10):
    assert got.shape == want.shape
    assert np.max(np.abs(got - want), initial=0.0) <= tol * max(1.0, float(np.max(np.abs(want), initial=0.0)))


@pytest.mark.parametrize("lengths", [[0, T, 1, 3], [T, 3, 1, 0], [2, 2, 2], [0, 0], [T]],
                         ids=["unsorted", "longest-first", "equal", "none-run", "one-row"])
def test_each_row_runs_its_own_steps_as_a_numpy_loop_does(lengths):
    inputs, _, outputs = _graph()
    feeds, params = _values(lengths)
    got = run(outputs, dict(zip(inputs, feeds)), params)
    for g, w in zip(got, _reference(*feeds, params)):
        _close(np.asarray(g), w)


def test_gradients_match_finite_differences_for_rows_of_0_1_several_and_the_most_steps():
    inputs, (W, U, a), outputs = _graph()
    feeds, params = _values([0, 1, 3, T], seed=3)
    xs, h0, ctx, _ = inputs
    check_grads(outputs, [xs, h0, ctx, W, U, a], dict(zip(inputs, feeds)), params)


def test_padding_does_no_work_and_reaches_no_value_or_gradient(monkeypatch):
    """NaN past each row's length: the forward and every gradient are those of any other padding, bit for
    bit; a position past a row's length gets exactly zero gradient; the bodies saw the active rows alone."""
    inputs, (W, U, a), outputs = _graph()
    xs, h0, ctx, lengths = inputs
    loss = sum(ops.sum(o * o) for o in outputs)
    wrt = [xs, h0, ctx, W, U, a]
    grads = grad(loss, wrt)
    trips = [1, T, 0, 2]
    feeds, params = _values(trips, seed=5)
    past = np.arange(T)[None, :] >= np.asarray(trips)[:, None]
    rows_seen: dict = {"rnn": [], "backward": []}
    real_run = Subgraph.run

    def counting(self, xp, values):
        if self.name in rows_seen:
            rows_seen[self.name].append(len(values[0]))
        return real_run(self, xp, values)
    monkeypatch.setattr(Subgraph, "run", counting)
    results = []
    for pad in (np.nan, 7.0):
        X = feeds[0].copy()
        X[past] = pad
        results.append(run([loss] + grads, dict(zip(inputs, [X] + feeds[1:])), params))
    active = [int(np.sum(np.asarray(trips) > t)) for t in range(T)]   # [3, 2, 1, 1]
    assert rows_seen["rnn"] == active * 2   # per step the body ran on the rows with trips > t, no other
    assert rows_seen["backward"] == active[::-1] * 2   # and so did the backward's, in reverse
    for with_nan, other in zip(*results):
        assert np.isfinite(with_nan).all() and np.array_equal(with_nan, other)
    g_xs = results[0][1]
    assert not np.any(g_xs[past]) and np.all(np.any(g_xs[~past] != 0, axis=-1))


@pytest.mark.parametrize("trips, match", [
    ([1, -1, 2], r"steps\[1\] = -1: a row's trip count must be in \[0, 4\]"),
    ([1, T + 1, 2], r"steps\[1\] = 5: a row's trip count must be in \[0, 4\]"),
    ([1, 2], r"steps has shape \(2,\); it must hold one trip count per row \(3 rows\)"),
])
def test_a_bad_trip_count_is_refused_naming_steps_and_the_loop(trips, match):
    inputs, _, outputs = _graph()
    feeds, params = _values([1, 2, 3])
    feeds[3] = np.asarray(trips, np.int64)
    with pytest.raises(FeedError, match=match) as info:
        run(outputs, dict(zip(inputs, feeds)), params)
    assert "foreach 'rnn'" in str(info.value) and "'lengths'" in str(info.value)


@pytest.mark.parametrize("steps", [ops.input((None, 2), "int64", name="s"), ops.input((None,), F64, name="s")])
def test_steps_of_another_shape_or_dtype_is_refused_when_declared(steps):
    xs, s0 = ops.input((None, T, E), F64, name="xs"), ops.input((None, E), F64, name="s0")
    with pytest.raises(ShapeError, match=r"steps must be one integer value .* or, in a static graph, one per row"):
        C.foreach(lambda x, s: ([], s + x), xs, s0, steps=steps)


def test_a_trip_count_per_vertex_is_refused_inside_a_vertex_function():
    from minicavs.runtime.vertex import VertexFunction
    F = VertexFunction("v", arity=1, message=(2,), dtype=F64)
    with F:
        h, x, per_vertex = F.gather(0), F.pull((T, 2)), F.pull((), "n", dtype="int64")
        assert per_vertex.shape == (None,)
        with pytest.raises(ShapeError, match="in a static graph, one per row"):
            C.foreach(lambda xt, s: ([], s + xt), x, h, steps=per_vertex)
        F.scatter(h)
