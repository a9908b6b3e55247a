"""Small models written with the ops: a 2-layer MLP classifier and an LSTM cell (single step and unrolled).
Forward against numpy implementations written here; gradients of every parameter and input against
finite differences."""
import numpy as np
import pytest

import minicavs.ops as ops
from minicavs.engine.executor import Executor
from minicavs.ir.graph import rows_implicit
from minicavs.train.testing import check_grads

TOL = {"float32": 1e-5, "float64": 1e-10}


def assert_close(actual, expected, dtype):
    """DESIGN.md: max|a - b| <= tol * max(1, max|ref|)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == np.dtype(dtype)
    scale = max(1.0, float(np.max(np.abs(expected))))
    assert float(np.max(np.abs(actual - expected))) <= TOL[dtype] * scale


# --- numpy models ------------------------------------------------------------------------------------

def np_sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def np_mlp_loss(x, labels, W1, b1, W2, b2):
    h = np.maximum(x @ W1 + b1, 0.0)
    logits = h @ W2 + b2
    m = logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(axis=1)) + m[:, 0]
    return np.mean(lse - logits[np.arange(len(labels)), labels])


def np_lstm_step(x, h, c, W, b):
    z = np.concatenate([x, h], axis=1) @ W + b
    H = h.shape[1]
    i, f, o, g = (z[:, k * H:(k + 1) * H] for k in range(4))
    c2 = np_sigmoid(f) * c + np_sigmoid(i) * np.tanh(g)
    return np_sigmoid(o) * np.tanh(c2), c2


# --- the MLP -----------------------------------------------------------------------------------------

D, H, C, N = 4, 5, 3, 6


def mlp_graph(dtype):
    x = ops.input((None, D), dtype, name="x")
    labels = ops.input((None,), "int64", name="labels")
    W1, b1 = ops.param_node("W1", (D, H), dtype), ops.param_node("b1", (H,), dtype)
    W2, b2 = ops.param_node("W2", (H, C), dtype), ops.param_node("b2", (C,), dtype)
    h = ops.relu(ops.linear(x, W1, b1))
    loss = ops.mean(ops.softmax_cross_entropy(ops.linear(h, W2, b2), labels))
    return x, labels, (W1, b1, W2, b2), loss


def mlp_data(seed=0):
    rng = np.random.default_rng(seed)
    params = {"W1": rng.standard_normal((D, H)), "b1": rng.standard_normal(H) * 0.5,
              "W2": rng.standard_normal((H, C)), "b2": rng.standard_normal(C) * 0.5}
    x = rng.standard_normal((N, D))
    labels = rng.integers(0, C, N)
    pre = x @ params["W1"] + params["b1"]
    assert np.min(np.abs(pre)) > 1e-3, "pick another seed: a ReLU input sits near its kink"
    return x, labels, params


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mlp_forward_matches_numpy(dtype):
    x, labels, nodes, loss = mlp_graph(dtype)
    xv, yv, params = mlp_data()
    p = {k: v.astype(dtype) for k, v in params.items()}
    got = Executor([loss]).run({x: xv.astype(dtype), labels: yv}, p)[0]
    expected = np_mlp_loss(xv.astype(dtype).astype(np.float64), yv,
                           *(p[k].astype(np.float64) for k in ("W1", "b1", "W2", "b2")))
    assert_close(got, expected, dtype)


def test_mlp_gradients_match_finite_differences():
    x, labels, nodes, loss = mlp_graph("float64")
    xv, yv, params = mlp_data()
    check_grads(loss, [x, *nodes], {x: xv, labels: yv}, params)


# --- the LSTM cell -----------------------------------------------------------------------------------

XD, HD = 3, 2


def lstm_step(x, h, c, W, b):
    z = ops.linear(ops.concat([x, h], axis=-1), W, b)
    i, f, o, g = ops.split(z, 4, axis=-1)
    c2 = ops.sigmoid(f) * c + ops.sigmoid(i) * ops.tanh(g)
    return ops.sigmoid(o) * ops.tanh(c2), c2


def lstm_nodes(dtype, steps=1):
    xs = [ops.input((None, XD), dtype, name=f"x{t}") for t in range(steps)]
    h0, c0 = ops.input((None, HD), dtype, name="h0"), ops.input((None, HD), dtype, name="c0")
    W, b = ops.param_node("W", (XD + HD, 4 * HD), dtype), ops.param_node("b", (4 * HD,), dtype)
    return xs, h0, c0, W, b


def lstm_data(steps=1, rows=3, seed=1):
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((rows, XD)) for _ in range(steps)]
    h0, c0 = rng.standard_normal((rows, HD)) * 0.5, rng.standard_normal((rows, HD))
    params = {"W": rng.standard_normal((XD + HD, 4 * HD)) * 0.7, "b": rng.standard_normal(4 * HD) * 0.3}
    return xs, h0, c0, params


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lstm_cell_forward_matches_numpy(dtype):
    (x,), h0, c0, W, b = lstm_nodes(dtype)
    h1, c1 = lstm_step(x, h0, c0, W, b)
    (xv,), hv, cv, params = lstm_data()
    cast = {k: v.astype(dtype) for k, v in params.items()}
    feeds = {x: xv.astype(dtype), h0: hv.astype(dtype), c0: cv.astype(dtype)}
    got_h, got_c = Executor([h1, c1]).run(feeds, cast)
    up = {k: v.astype(np.float64) for k, v in feeds.items()}
    exp_h, exp_c = np_lstm_step(up[x], up[h0], up[c0], cast["W"].astype(np.float64), cast["b"].astype(np.float64))
    assert_close(got_h, exp_h, dtype)
    assert_close(got_c, exp_c, dtype)


def test_lstm_cell_gradients_match_finite_differences():
    (x,), h0, c0, W, b = lstm_nodes("float64")
    h1, c1 = lstm_step(x, h0, c0, W, b)
    (xv,), hv, cv, params = lstm_data()
    check_grads([h1, c1], [x, h0, c0, W, b], {x: xv, h0: hv, c0: cv}, params)


def test_unrolled_lstm_shares_weights_across_steps():
    steps = 3
    xs, h0, c0, W, b = lstm_nodes("float64", steps)
    h, c = h0, c0
    for x in xs:
        h, c = lstm_step(x, h, c, W, b)
    target = ops.input((None, HD), "float64", name="target")
    loss = ops.mse(h, target) + ops.mean(c)
    xv, hv, cv, params = lstm_data(steps)
    tv = np.random.default_rng(2).standard_normal(hv.shape)
    feeds = {**dict(zip(xs, xv)), h0: hv, c0: cv, target: tv}
    eh, ec = hv, cv
    for xt in xv:
        eh, ec = np_lstm_step(xt, eh, ec, params["W"], params["b"])
    got = Executor([loss]).run(feeds, params)[0]
    assert_close(got, np.mean((eh - tv) ** 2) + np.mean(ec), "float64")
    check_grads(loss, [*xs, h0, c0, W, b], feeds, params)


def test_lstm_cell_as_a_vertex_function_uses_batchless_axes():
    """The same cell written inside a rows_implicit scope (axes index the per-vertex shape (K,))."""
    (x,), h0, c0, W, b = lstm_nodes("float64")
    with rows_implicit():
        z = ops.linear(ops.concat([x, h0], axis=0), W, b)
        i, f, o, g = ops.split(z, 4, axis=0)
        c1 = ops.sigmoid(f) * c0 + ops.sigmoid(i) * ops.tanh(g)
        h1 = ops.sigmoid(o) * ops.tanh(c1)
    assert h1.shape == (None, HD)
    (xv,), hv, cv, params = lstm_data()
    got_h, got_c = Executor([h1, c1]).run({x: xv, h0: hv, c0: cv}, params)
    exp_h, exp_c = np_lstm_step(xv, hv, cv, params["W"], params["b"])
    assert_close(got_h, exp_h, "float64")
    assert_close(got_c, exp_c, "float64")
    check_grads([h1, c1], [x, h0, c0, W, b], {x: xv, h0: hv, c0: cv}, params, directions=3)
