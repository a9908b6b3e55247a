"""The numpy interpreter: dtypes end to end, every node's run-time value matching its declared type, freeing
of intermediates, multi-output graphs, and the Python operators that build nodes."""
import numpy as np
import pytest

import minicavs.ops as ops
from minicavs.ops.autodiff import grad
from minicavs.core.errors import ShapeError
from minicavs.engine.executor import Executor, RunContext, run
from minicavs.ir.graph import Graph

from .. import reference as R


def mixed_graph(dtype=None):
    """A graph touching most op families; ``dtype=None`` uses the defaults everywhere."""
    kw = {} if dtype is None else {"dtype": dtype}
    x = ops.input((None, 4), name="x", **kw)
    labels = ops.input((None,), "int64", name="labels")
    W = ops.param_node("W", (4, 6), **kw)
    b = ops.param_node("b", (6,), **kw)
    E = ops.param_node("E", (5, 6), **kw)
    h = ops.tanh(ops.linear(x, W, b)) + ops.lookup(E, labels)
    g1, g2 = ops.split(h, 2)
    z = ops.concat([ops.sigmoid(g1) * 2.0, ops.relu(g2) - 1.0, ops.reshape(ops.transpose(
        ops.reshape(g1, (None, 3, 1)), (0, 2, 1)), (None, 3))], axis=-1)
    z = ops.dropout(z, 0.25, site=1) / 3.0 + ops.square(ops.mean(z, axis=-1, keepdims=True))
    logits = ops.slice_(ops.log_softmax(z), 0, 5)
    loss = ops.mean(ops.softmax_cross_entropy(logits, labels)) + ops.mse(g1, 0.5) + ops.sum(ops.pow(
        ops.abs(g2) + 1.0, 1.5)) * 0.01
    return x, labels, (W, b, E), loss


def mixed_values(dtype, rows=4, seed=0):
    rng = np.random.default_rng(seed)
    params = {"W": rng.standard_normal((4, 6)), "b": rng.standard_normal(6), "E": rng.standard_normal((5, 6))}
    return (rng.standard_normal((rows, 4)).astype(dtype), rng.integers(0, 5, rows),
            {k: v.astype(dtype) for k, v in params.items()})


@pytest.mark.parametrize("dtype", [None, "float64"])
def test_every_node_value_has_its_declared_dtype_and_shape(dtype):
    """float32 by default; float64 throughout when declared so (forward and backward graphs)."""
    want = np.dtype(dtype or "float32")
    x, labels, params, loss = mixed_graph(dtype)
    grads = grad(loss, [x, *params])
    g = Graph([loss, *grads])
    for n in g.nodes:
        assert not n.dtype.is_float or n.dtype.np == want, n
    xv, lv, pv = mixed_values(want)
    rows = xv.shape[0]
    values = Executor(g.nodes).run({x: xv, labels: lv}, pv, RunContext(seed=2))
    for n, v in zip(g.nodes, values):
        dense = v.to_dense() if hasattr(v, "to_dense") else np.asarray(v)
        assert dense.dtype == n.dtype.np, f"{n.label()}: {dense.dtype} vs declared {n.dtype.name}"
        assert dense.shape == tuple(rows if d is None else d for d in n.shape), n.label()
        assert np.all(np.isfinite(dense)), n.label()


def test_defaults_are_float32_and_float64_feeds_are_cast():
    x = ops.input((None, 2), name="x")
    p = ops.param_node("p", (2,))
    assert x.dtype.name == p.dtype.name == "float32"
    y = ops.sigmoid(x * 2.0 + p) - 1
    assert y.dtype.name == "float32"
    out = run(y, {x: np.ones((3, 2))}, {"p": np.zeros(2)})  # float64 values, float32 graph
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.full((3, 2), R.sigmoid(2.0) - 1), rtol=1e-6)


def test_float32_and_float64_runs_agree_to_float32_precision():
    outs = {}
    for dtype in ("float32", "float64"):
        x, labels, params, loss = mixed_graph(dtype)
        xv, lv, pv = mixed_values(dtype)
        outs[dtype] = Executor([loss]).run({x: xv, labels: lv}, pv, RunContext(seed=2))[0]
    assert outs["float32"].dtype == np.float32 and outs["float64"].dtype == np.float64
    assert abs(float(outs["float32"]) - float(outs["float64"])) <= 1e-5 * max(1.0, abs(float(outs["float64"])))


def test_freed_intermediates_do_not_break_multi_output_graphs():
    x = ops.input((None, 3), "float64", name="x")
    a = ops.exp(x)                 # an output that later nodes also consume
    b = ops.tanh(a) * a            # consumes a twice
    c = ops.sum(b, axis=-1)
    d = ops.mean(a)                # last consumer of a
    ex = Executor([b, a, d, c, x, a])
    for rows in (2, 5, 1):         # the same executor, run again with other row counts
        xv = np.random.default_rng(rows).standard_normal((rows, 3))
        vb, va, vd, vc, vx, va2 = ex.run({x: xv})
        e = np.exp(xv)
        np.testing.assert_allclose(va, e, rtol=1e-15)
        np.testing.assert_array_equal(va2, va)
        np.testing.assert_allclose(vb, np.tanh(e) * e, rtol=1e-15)
        np.testing.assert_allclose(vc, (np.tanh(e) * e).sum(axis=1), rtol=1e-14)
        np.testing.assert_allclose(vd, e.mean(), rtol=1e-14)
        np.testing.assert_array_equal(vx, xv)
        for single, want in ((b, vb), (c, vc), (d, vd)):
            np.testing.assert_array_equal(run(single, {x: xv}), want)


def test_intermediates_are_released_after_their_last_use():
    x = ops.input((None, 3), "float64", name="x")
    a = ops.exp(x)
    b = ops.tanh(a)
    c = ops.sum(b)
    ex = Executor([c])
    freed = {x for step in ex.steps for x in step.frees}
    assert a in freed and b in freed and x in freed and c not in freed


def test_run_returns_one_array_for_one_node_and_a_list_otherwise():
    x = ops.input((2,), "float64", name="x")
    y = ops.neg(x)
    assert isinstance(run(y, {x: np.ones(2)}), np.ndarray)
    out = run([y], {x: np.ones(2)})
    assert isinstance(out, list) and len(out) == 1


def test_parameters_may_be_objects_with_a_value():
    class Holder:
        def __init__(self, value):
            self.value = value

    W = ops.param_node("W", (2, 2), "float64")
    x = ops.input((None, 2), "float64", name="x")
    out = run(x @ W, {x: np.eye(2)}, {"W": Holder(np.arange(4.0).reshape(2, 2))})
    np.testing.assert_array_equal(out, np.arange(4.0).reshape(2, 2))


# --- Python operators --------------------------------------------------------------------------------

def _const_value(n):
    assert n.op == "constant"
    return float(n.attrs["value"])


def test_python_operators_build_the_right_nodes():
    x = ops.input((None, 3), "float64", name="x")
    y = ops.input((None, 3), "float64", name="y")
    W = ops.param_node("W", (3, 2), "float64")
    cases = {
        "x + y": (x + y, "add", (x, y)), "x - y": (x - y, "sub", (x, y)), "x * y": (x * y, "mul", (x, y)),
        "x / y": (x / y, "div", (x, y)), "x @ W": (x @ W, "matmul", (x, W)), "-x": (-x, "neg", (x,)),
    }
    for text, (node, op, inputs) in cases.items():
        assert node.op == op and node.inputs == inputs, text
    p = x ** 2
    assert p.op == "pow" and p.inputs == (x,) and p.attrs["p"] == 2.0
    for node, op, const_first, value in ((x + 1.5, "add", False, 1.5), (2.0 + x, "add", True, 2.0),
                                         (x - 3, "sub", False, 3.0), (1 - x, "sub", True, 1.0),
                                         (x * 0.5, "mul", False, 0.5), (4.0 * x, "mul", True, 4.0),
                                         (x / 8, "div", False, 8.0), (1.0 / x, "div", True, 1.0)):
        assert node.op == op
        c, other = (node.inputs[0], node.inputs[1]) if const_first else (node.inputs[1], node.inputs[0])
        assert other is x and _const_value(c) == value and c.dtype.name == "float64"


def test_python_operators_compute_the_right_values():
    x = ops.input((None, 3), "float64", name="x")
    y = ops.input((None, 3), "float64", name="y")
    W = ops.param_node("W", (3, 2), "float64")
    rng = np.random.default_rng(0)
    xv, yv, wv = rng.uniform(0.5, 2, (2, 3)), rng.uniform(0.5, 2, (2, 3)), rng.standard_normal((3, 2))
    exprs = [x + y, x - y, x * y, x / y, x @ W, -x, x ** 2, x ** 0.5, 1 - x, 2.0 / x, (x - y) * (x + 1.0)]
    want = [xv + yv, xv - yv, xv * yv, xv / yv, xv @ wv, -xv, xv ** 2, np.sqrt(xv), 1 - xv, 2.0 / xv,
            (xv - yv) * (xv + 1.0)]
    got = Executor(exprs).run({x: xv, y: yv}, {"W": wv})
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-14, err_msg=f"expression {k}")


def test_unsupported_operator_uses_raise_type_error():
    x = ops.input((3,), name="x")
    with pytest.raises(TypeError):
        2 ** x
    with pytest.raises(TypeError, match="exponent"):
        x ** x
    with pytest.raises(TypeError):
        if x:  # noqa: SIM102  (a symbolic node has no truth value)
            pass


def test_integer_graphs_keep_their_declared_dtype():
    """Ops that accept integers compute integers; ops whose numpy kernel would return floats for integer
    operands (true division, mean, mse) refuse them at declaration instead of lying about the dtype."""
    i = ops.input((None, 3), "int64", name="i")
    j = ops.input((3,), "int64", name="j")
    t = ops.param_node("T", (4, 2), "int32")
    k = ops.input((None,), "int32", name="k")
    M = ops.input((3, 3), "int64", name="M")
    nodes = [i + j, i - 1, i * j, ops.maximum(i, j), ops.ge(i, j), ops.sum(i, axis=-1), ops.sum(i),
             ops.concat([i, i]), ops.reshape(i, (None, 3, 1)), ops.transpose(M), ops.slice_(i, 0, 2),
             ops.lookup(t, k), i @ M, ops.sum_to(i, (1, 3)), ops.zeros_like(i)]
    values = Executor(nodes).run({i: np.arange(6).reshape(2, 3), j: np.array([1, 2, 3]), k: np.array([3, 0]),
                                  M: np.eye(3, dtype=np.int64)}, {"T": np.arange(8).reshape(4, 2)})
    for n, v in zip(nodes, values):
        assert np.asarray(v).dtype == n.dtype.np, f"{n.label()}: {np.asarray(v).dtype} vs {n.dtype.name}"
    for make in (lambda: i / j, lambda: 1 / i, lambda: ops.mean(i), lambda: ops.mse(i, j)):
        with pytest.raises(ShapeError, match="float"):
            make()


def test_numpy_operands_on_the_left_build_one_node():
    """``array + node`` must not become an object array of nodes (numpy broadcasting over a Node)."""
    x = ops.input((None, 3), "float64", name="x")
    c = np.array([1.0, -2.0, 0.5])
    exprs = [c + x, c * x, c - x, c / (x + 3.0), np.float64(2.0) * x, np.float32(0.5) - x]
    for e in exprs:
        assert type(e) is type(x) and e.shape == (None, 3) and e.dtype.name == "float64", e
    xv = np.random.default_rng(0).uniform(-1, 1, (2, 3))
    want = [c + xv, c * xv, c - xv, c / (xv + 3.0), 2.0 * xv, 0.5 - xv]
    for g, w in zip(Executor(exprs).run({x: xv}), want):
        np.testing.assert_allclose(g, w, rtol=1e-15)
