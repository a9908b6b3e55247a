"""Reverse-mode autodiff over the IR: fan-out, broadcasting, integer inputs, unconnected and intermediate
nodes, cotangents, higher order. Values are compared with hand-derived numpy formulas and with finite
differences (``check_grads``)."""
import numpy as np
import pytest

import minicavs.ops as ops
from minicavs.ops.autodiff import grad
from minicavs.core.errors import ShapeError
from minicavs.engine.executor import Executor, run
from minicavs.ir.graph import Graph
from minicavs.train.testing import check_grads

from .. import reference as R

F64 = "float64"


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_fan_out_is_accumulated_once():
    x = ops.input((None, 4), F64, name="x")
    loss = ops.sum(ops.tanh(x) * x + ops.exp(x))  # x feeds tanh, mul and exp
    (gx,) = grad(loss, [x])
    assert gx.op == "accum" and len(gx.inputs) == 3
    xv = _rng().uniform(-1, 1, (3, 4))
    t = np.tanh(xv)
    np.testing.assert_allclose(run(gx, {x: xv}), (1 - t * t) * xv + t + np.exp(xv), rtol=1e-13)
    check_grads(loss, [x], {x: xv})


def test_fan_out_of_the_same_node_twice_into_one_op():
    x = ops.input((3,), F64, name="x")
    loss = ops.sum(x * x)  # both operands of one node
    (gx,) = grad(loss, [x])
    xv = np.array([0.5, -2.0, 3.0])
    np.testing.assert_allclose(run(gx, {x: xv}), 2 * xv, rtol=1e-15)


def test_bias_gradient_is_reduced_over_rows():
    x = ops.input((None, 3), F64, name="x")
    b = ops.param_node("b", (3,), F64)
    loss = ops.sum(ops.tanh(x + b))
    gx, gb = grad(loss, [x, b])
    assert gx.shape == (None, 3) and gb.shape == (3,)
    xv, bv = _rng(1).standard_normal((5, 3)), _rng(2).standard_normal(3)
    d = 1 - np.tanh(xv + bv) ** 2
    vx, vb = Executor([gx, gb]).run({x: xv}, {"b": bv})
    assert vb.shape == (3,)
    np.testing.assert_allclose(vx, d, rtol=1e-14)
    np.testing.assert_allclose(vb, d.sum(axis=0), rtol=1e-14)
    check_grads(loss, [x, b], {x: xv}, {"b": bv})


def test_size_one_and_scalar_operands_get_gradients_of_their_own_shape():
    x = ops.input((None, 4), F64, name="x")
    s = ops.input((None, 1), F64, name="s")   # a per-row scale
    c = ops.input((), F64, name="c")          # a scalar
    r = ops.input((1, 4), F64, name="r")      # a size-1 leading axis (not the row axis)
    loss = ops.sum(ops.sigmoid(x * s + c) * r)
    gx, gs, gc, gr = grad(loss, [x, s, c, r])
    assert (gx.shape, gs.shape, gc.shape, gr.shape) == ((None, 4), (None, 1), (), (1, 4))
    rng = _rng(3)
    feeds = {x: rng.standard_normal((3, 4)), s: rng.standard_normal((3, 1)), c: np.array(0.3),
             r: rng.standard_normal((1, 4))}
    y = R.sigmoid(feeds[x] * feeds[s] + 0.3)
    d = y * (1 - y) * feeds[r]
    vs, vc, vr = Executor([gs, gc, gr]).run(feeds)
    np.testing.assert_allclose(vs, (d * feeds[x]).sum(axis=1, keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(vc, d.sum(), rtol=1e-13)
    np.testing.assert_allclose(vr, y.sum(axis=0, keepdims=True), rtol=1e-13)
    check_grads(loss, [x, s, c, r], feeds)


def test_integer_inputs_get_no_gradient():
    logits = ops.input((None, 4), F64, name="logits")
    labels = ops.input((None,), "int64", name="labels")
    table = ops.param_node("table", (5, 4), F64)
    idx = ops.input((None,), "int32", name="idx")
    loss = ops.mean(ops.softmax_cross_entropy(logits + ops.lookup(table, idx), labels))
    grads = grad(loss, [logits, table])
    for n in Graph(grads).nodes:  # the only integer nodes are the given integer inputs themselves
        assert n.dtype.is_float or n in (labels, idx), n
    for node in (labels, idx):
        with pytest.raises(TypeError, match="not float"):
            grad(loss, [node])
    feeds = {logits: _rng(4).standard_normal((3, 4)), labels: np.array([0, 3, 3]), idx: np.array([4, 0, 4])}
    check_grads(loss, [logits, table], feeds, {"table": _rng(5).standard_normal((5, 4))})


def test_unconnected_wrt_gets_zeros_or_none():
    x = ops.input((None, 2), F64, name="x")
    z = ops.input((None, 3), F64, name="z")
    p = ops.param_node("p", (2, 2), F64)
    loss = ops.sum(ops.exp(x))
    gx, gz, gp = grad(loss, [x, z, p])
    assert gz.op == "zeros_like" and gz.shape == z.shape and gp.shape == (2, 2)
    xv, zv = np.zeros((4, 2)), np.ones((4, 3))
    vx, vz, vp = Executor([gx, gz, gp]).run({x: xv, z: zv}, {"p": np.ones((2, 2))})
    np.testing.assert_array_equal(vz, np.zeros((4, 3)))
    np.testing.assert_array_equal(vp, np.zeros((2, 2)))
    np.testing.assert_array_equal(vx, np.ones((4, 2)))
    assert grad(loss, [x, z], zeros=False)[1] is None


def test_non_scalar_output_needs_a_cotangent():
    x = ops.input((None, 3), F64, name="x")
    y = ops.tanh(x)
    with pytest.raises(ShapeError, match=r"tanh#\d+.*\(\?, 3\).*cotangent"):
        grad(y, [x])
    ct = ops.input((None, 3), F64, name="ct")
    (gx,) = grad(y, [x], [ct])
    xv, cv = _rng(6).standard_normal((2, 3)), _rng(7).standard_normal((2, 3))
    np.testing.assert_allclose(run(gx, {x: xv, ct: cv}), cv * (1 - np.tanh(xv) ** 2), rtol=1e-14)
    with pytest.raises(ShapeError, match="cotangent"):
        grad(y, [x], [ops.input((None, 4), F64)])
    with pytest.raises(ValueError, match="2 cotangents"):
        grad(y, [x], [ct, ct])


def test_gradient_of_an_intermediate_node():
    x = ops.input((None, 3), F64, name="x")
    w = ops.param_node("W", (3, 2), F64)
    h = ops.tanh(x @ w)
    loss = ops.sum(h * h) + ops.sum(x)
    gh, gx, gl = grad(loss, [h, x, loss])
    xv, wv = _rng(8).standard_normal((4, 3)), _rng(9).standard_normal((3, 2))
    vh, vx, vl = Executor([gh, gx, gl]).run({x: xv}, {"W": wv})
    hv = np.tanh(xv @ wv)
    np.testing.assert_allclose(vh, 2 * hv, rtol=1e-14)
    np.testing.assert_allclose(vx, (2 * hv * (1 - hv * hv)) @ wv.T + 1, rtol=1e-13)
    assert vl == 1.0


def test_several_outputs_sum_their_contributions():
    x = ops.input((3,), F64, name="x")
    a, b = ops.sum(ops.square(x)), ops.sum(x * 3.0)
    (gx,) = grad([a, b, a], [x])  # a listed twice counts twice
    xv = np.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(run(gx, {x: xv}), 4 * xv + 3, rtol=1e-15)


def test_backward_graph_is_deterministic():
    x = ops.input((None, 3), F64, name="x")
    w = ops.param_node("W", (3, 3), F64)
    loss = ops.mean(ops.relu(x @ w) * ops.sigmoid(x) + x)
    assert Graph(grad(loss, [x, w])).dump() == Graph(grad(loss, [x, w])).dump()


def test_deep_chain_needs_no_recursion():
    x = ops.input((2,), F64, name="x")
    y = x
    for _ in range(3000):
        y = ops.tanh(y) * 0.5 + 0.1
    (gx,) = grad(ops.sum(y), [x])
    assert len(Graph([gx])) > 6000
    assert np.all(np.isfinite(run(gx, {x: np.array([0.3, -0.2])})))


def test_second_order_through_gradient_rules():
    """Gradient rules are ordinary IR nodes, so they differentiate again (sum's adjoint, sum_to, ...)."""
    x = ops.input((None, 3), F64, name="x")
    b = ops.input((3,), F64, name="b")
    loss = ops.sum(ops.pow(x + b, 3.0)) + ops.mean(ops.tanh(x) * b)
    gx, gb = grad(loss, [x, b])
    rng = _rng(10)
    feeds = {x: rng.standard_normal((4, 3)), b: rng.standard_normal(3)}
    check_grads([gx, gb], [x, b], feeds)
    # d2/dx2 of sum(x^3) is 6x: check it exactly too
    (g,) = grad(ops.sum(ops.pow(x, 3.0)), [x])
    (gg,) = grad(ops.sum(g), [x])
    np.testing.assert_allclose(run(gg, {x: feeds[x]}), 6 * feeds[x], rtol=1e-14)


def test_second_order_through_shape_and_reduction_adjoints():
    x = ops.input((None, 4), F64, name="x")
    a, c = ops.split(x, [1, 3])
    y = ops.concat([ops.square(c), ops.exp(a)], axis=-1)
    z = ops.transpose(ops.reshape(x, (None, 2, 2)), (0, 2, 1))
    loss = (ops.mean(ops.softmax(y) * y) + ops.sum(ops.log_softmax(x) * x)
            + ops.sum(ops.square(z) * ops.constant([[1.0, -2.0], [0.5, 3.0]], F64)))
    (gx,) = grad(loss, [x])
    check_grads(gx, [x], {x: _rng(11).uniform(-1, 1, (3, 4))})


def test_split_gradient_is_one_concat_not_zero_filled_parts():
    import minicavs.ops as O
    from minicavs.ops.autodiff import grad
    from minicavs.ir.graph import Graph
    x = O.input((None, 6), "float64", name="x")
    a, b, c = O.split(x, 3)
    (g,) = grad(O.sum(O.tanh(a) * O.exp(b) + c * c), [x])
    ops_used = {n.op for n in Graph([g]).nodes}
    assert g.op == "concat" and "unslice" not in ops_used
    (g2,) = grad(O.sum(O.tanh(a) + c), [x])          # b unused: parts do not tile, fall back to unslice
    assert "unslice" in {n.op for n in Graph([g2]).nodes}
