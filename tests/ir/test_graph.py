"""The IR: text and DOT dumps, shape/dtype errors at declaration, feed errors at run time, and the
``rows_implicit`` scope in which axis arguments index the batch-less (per-vertex) shape."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minicavs.ops as ops
from minicavs.core.errors import FeedError, ShapeError
from minicavs.engine.executor import Executor, run
from minicavs.ir.graph import Graph, Node, rows_implicit
from minicavs.ops import make_node


def small_graph():
    x = ops.input((None, 3), name="x")
    W = ops.param_node("W", (3, 4))
    b = ops.param_node("b", (4,))
    h = ops.tanh(x @ W + b)
    loss = ops.mean(ops.sum(h * h, axis=-1))
    return x, W, b, h, loss


# --- dumps -------------------------------------------------------------------------------------------

def test_text_dump_has_one_line_per_node_with_ops_and_types():
    x, W, b, h, loss = small_graph()
    g = Graph([loss, h])
    text = g.dump()
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    body, ret = lines[1:-2], lines[-2]
    assert len(body) == len(g.nodes) == 9
    for k, (line, n) in enumerate(zip(body, g.nodes)):
        assert line.strip().startswith(f"%{k}:"), line
        assert f" = {n.op}" in line, line
    assert "f32[?,3] = input" in body[0] and "'x'" in body[0]
    assert "f32[3,4] = param" in body[1] and "'W'" in body[1]
    assert re.search(r"f32\[\?,4\] = matmul %0 %1", text)
    assert re.search(r"f32\[\?\] = sum %\d+ axes=\(1,\) keepdims=False", text)
    assert re.search(r"f32\[\] = mean", text)
    idx = {n: k for k, n in enumerate(g.nodes)}
    assert ret.strip() == f"return %{idx[loss]}, %{idx[h]}"


def test_text_dump_shows_labels_and_dtypes():
    x = ops.input((2,), "float64", name="x")
    i = ops.input((None,), "int32", name="i")
    y = ops.exp(x)
    text = Graph([y, i]).dump(labels={y: "eager"})
    assert "f64[2] = input" in text and "i32[?] = input" in text
    assert re.search(r"f64\[2\] = exp %0\s+# eager", text)


def test_dot_export_is_a_digraph_with_one_node_line_per_node():
    x, W, b, h, loss = small_graph()
    g = Graph([loss])
    dot = g.to_dot(labels={h: "recurrent"})
    lines = dot.splitlines()
    assert lines[0] == "digraph G {" and lines[-1] == "}"
    node_lines = [line for line in lines if re.match(r'\s*n\d+ \[label=".*"', line)]
    edge_lines = [line for line in lines if re.match(r"\s*n\d+ -> n\d+;$", line)]
    assert len(node_lines) == len(g.nodes)
    assert len(edge_lines) == sum(len(n.inputs) for n in g.nodes)
    for line, n in zip(node_lines, g.nodes):
        assert n.op in line
    assert any("tanh" in line and "[recurrent]" in line for line in node_lines)
    assert dot.count("{") == dot.count("}") and dot.count('"') % 2 == 0
    assert sum("peripheries=2" in line for line in node_lines) == 1  # the output
    # every edge names declared nodes, and points forward in topological order
    for line in edge_lines:
        a, b_ = map(int, re.findall(r"n(\d+)", line))
        assert a < b_ < len(g.nodes)


# --- shape and dtype errors at declaration -----------------------------------------------------------

def test_broadcast_error_names_op_and_both_shapes():
    x = ops.input((None, 3), name="x")
    y = ops.input((4,), name="y")
    with pytest.raises(ShapeError) as e:
        ops.add(x, y)
    msg = str(e.value)
    assert msg.startswith("add") and "(?, 3)" in msg and "(4,)" in msg
    with pytest.raises(ShapeError, match=r"^mul: .*\(\?, 3\).*\(4,\)"):
        x * y


def test_matmul_inner_mismatch_names_op_and_both_shapes():
    a = ops.input((None, 3), name="a")
    w = ops.param_node("W", (4, 5))
    with pytest.raises(ShapeError) as e:
        a @ w
    msg = str(e.value)
    assert msg.startswith("matmul") and "(?, 3)" in msg and "(4, 5)" in msg and "inner" in msg
    with pytest.raises(ShapeError, match=r"^matmul: .*at least 2 axes"):
        ops.matmul(ops.input((3,)), w)


@pytest.mark.parametrize("make, pattern", [
    (lambda: ops.linear(ops.input((None, 3)), ops.param_node("W", (4, 2)), ops.param_node("b", (2,))),
     r"^linear: .*\(\?, 3\) @ \(4, 2\)"),
    (lambda: ops.concat([ops.input((None, 2)), ops.input((2, 3))]), r"^concat: .*\(\?, 2\).*\(2, 3\)"),
    (lambda: ops.reshape(ops.input((None, 6)), (None, 4)), r"reshape \(\?, 6\) -> \(\?, 4\)"),
    (lambda: ops.softmax_cross_entropy(ops.input((None, 4)), ops.input((None, 2), "int64")),
     r"^softmax_cross_entropy: .*\(\?, 4\).*\(\?, 2\)"),
    (lambda: ops.add(ops.input((3,), "float32"), ops.input((3,), "float64")), r"^add: .*float32.*float64"),
    (lambda: ops.exp(ops.input((3,), "int64")), r"^exp: .*float"),
    (lambda: ops.sum(ops.input((None, 3)), axis=2), r"^axis 2 out of range for shape \(\?, 3\)"),
    (lambda: ops.slice_(ops.input((None, 3)), 2, 5), r"slice \[2:5\] out of range"),
    (lambda: ops.split(ops.input((None, 5)), 2), r"split: .*5.*2 equal parts"),
    (lambda: ops.lookup(ops.param_node("E", (5, 3)), ops.input((None,))), r"^lookup: .*integer indices"),
    (lambda: make_node("add", (ops.input((3,)), ops.input((2,))), name="h"), r"^add 'h': .*\(3,\).*\(2,\)"),
])
def test_declaration_errors_are_clear(make, pattern):
    with pytest.raises(ShapeError, match=pattern):
        make()


@pytest.mark.parametrize("bad", ["float16", "complex64", "floot", object, np.uint8])
def test_unknown_dtype_raises_type_error(bad):
    with pytest.raises(TypeError, match=r"unknown dtype .*supports float32, float64, int32, int64"):
        ops.input((3,), bad)
    with pytest.raises(TypeError, match="unknown dtype"):
        ops.param_node("p", (3,), bad)


@pytest.mark.parametrize("shape", [(3, None), (None, None), (-1,), (2.5,)])
def test_bad_declared_shapes(shape):
    with pytest.raises(ShapeError, match="shape"):
        ops.input(shape)


def test_non_node_inputs_unknown_ops_and_truth_values():
    x = ops.input((3,))
    with pytest.raises(TypeError, match="input 1 is ndarray"):
        make_node("add", (x, np.ones(3)))
    with pytest.raises(ShapeError, match="unknown op 'frobnicate'"):
        make_node("frobnicate", (x,))
    with pytest.raises(TypeError, match="truth value"):
        bool(x)
    with pytest.raises(TypeError, match="at least one operand"):
        ops.add(1.0, 2.0)


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_broadcast_shape_rule_matches_numpy(data):
    """Declared shapes follow numpy broadcasting; a failing pair raises naming both shapes."""
    from hypothesis.extra.numpy import array_shapes
    sa = data.draw(array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3), label="a")
    sb = data.draw(array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3), label="b")
    a, b = ops.input(sa), ops.input(sb)
    try:
        expected = np.broadcast_shapes(sa, sb)
    except ValueError:
        with pytest.raises(ShapeError) as e:
            ops.mul(a, b)
        fmt = [("(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")") for s in (sa, sb)]
        assert fmt[0] in str(e.value) and fmt[1] in str(e.value)
    else:
        assert ops.mul(a, b).shape == expected


# --- feed errors at run time -------------------------------------------------------------------------

def test_missing_feed_names_the_input():
    x = ops.input((None, 3), name="tokens")
    y = ops.input((None, 3))
    out = x + y
    with pytest.raises(FeedError, match=r"missing feed for input input#\d+ 'tokens' \(\?, 3\)"):
        run(out, {y: np.zeros((2, 3), np.float32)})
    with pytest.raises(FeedError, match=r"missing feed for input input#\d+ \(\?, 3\)"):
        run(out, {"tokens": np.zeros((2, 3), np.float32)})


def test_missing_parameter_names_it():
    W = ops.param_node("W_out", (3, 2))
    x = ops.input((None, 3), name="x")
    with pytest.raises(FeedError, match=r"missing value for parameter 'W_out' \(3, 2\)"):
        run(x @ W, {x: np.zeros((1, 3), np.float32)})


@pytest.mark.parametrize("value, pattern", [
    (np.zeros((2, 4), np.float32), r"'x'.*got shape \(2, 4\), declared \(\?, 3\)"),
    (np.zeros((3,), np.float32), r"'x'.*got shape \(3,\), declared \(\?, 3\)"),
    (np.zeros((1, 2, 3), np.float32), r"'x'.*got shape \(1, 2, 3\)"),
    (np.zeros((2, 3), np.int64), r"'x'.*got dtype int64, declared float32"),
])
def test_wrong_feed_raises_feed_error(value, pattern):
    x = ops.input((None, 3), name="x")
    with pytest.raises(FeedError, match=pattern):
        run(ops.exp(x), {x: value})


def test_wrong_parameter_shape_raises_feed_error():
    W = ops.param_node("W", (3, 2))
    x = ops.input((None, 3), name="x")
    with pytest.raises(FeedError, match=r"parameter .*'W'.*got shape \(2, 3\), declared \(3, 2\)"):
        run(x @ W, {x: np.zeros((1, 3), np.float32)}, {"W": np.zeros((2, 3), np.float32)})


def test_feeds_by_name_and_integer_widths():
    i = ops.input((None,), "int32", name="i")
    t = ops.param_node("E", (4, 2))
    out = run(ops.lookup(t, i), {"i": [3, 0]}, {"E": np.arange(8, dtype=np.float32).reshape(4, 2)})
    np.testing.assert_array_equal(out, [[6, 7], [0, 1]])


# --- the rows_implicit scope -------------------------------------------------------------------------

def test_rows_implicit_axes_index_the_batchless_shape():
    x = ops.input((None, 4), "float64", name="x")
    xv = np.arange(12.0).reshape(3, 4)
    with rows_implicit():
        s0 = ops.sum(x, axis=0)        # the per-vertex axis of length 4
        sm1 = ops.mean(x, axis=-1)
        sall = ops.sum(x)              # every axis a vertex function sees: not the vertex axis
        sk = ops.sum(x, axis=0, keepdims=True)
        sm = ops.softmax(x, axis=0)
        with pytest.raises(ShapeError, match=r"axis 1 out of range for shape \(4,\)"):
            ops.sum(x, axis=1)
    assert s0.shape == sm1.shape == sall.shape == (None,)
    assert sk.shape == (None, 1) and sm.shape == (None, 4)
    outside = ops.sum(x, axis=0)       # outside the scope axis 0 is the row axis
    assert outside.shape == (4,)
    v0, vm1, vall, vk, vsm, vout = Executor([s0, sm1, sall, sk, sm, outside]).run({x: xv})
    np.testing.assert_allclose(v0, xv.sum(axis=1))
    np.testing.assert_allclose(vm1, xv.mean(axis=1))
    np.testing.assert_allclose(vall, xv.sum(axis=1))
    np.testing.assert_allclose(vk, xv.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(vsm, np.exp(xv) / np.exp(xv).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(vout, xv.sum(axis=0))


def test_rows_implicit_shape_arguments_exclude_the_row_axis():
    x = ops.input((None, 6), "float64", name="x")
    with rows_implicit():
        r = ops.reshape(x, (2, 3))
        t = ops.transpose(r)               # reverses the per-vertex axes only
        c = ops.concat([x, x], axis=0)
        a, b = ops.split(x, [2, 4], axis=0)
    assert (r.shape, t.shape, c.shape, a.shape, b.shape) == (
        (None, 2, 3), (None, 3, 2), (None, 12), (None, 2), (None, 4))
    xv = np.arange(12.0).reshape(2, 6)
    vt, va = Executor([t, a]).run({x: xv})
    np.testing.assert_array_equal(vt, xv.reshape(2, 2, 3).transpose(0, 2, 1))
    np.testing.assert_array_equal(va, xv[:, :2])


def test_rows_implicit_scope_is_restored_after_an_error():
    x = ops.input((None, 3), name="x")
    with pytest.raises(ShapeError):
        with rows_implicit():
            ops.sum(x, axis=3)
    assert ops.sum(x, axis=0).shape == (3,)


# --- graphs ------------------------------------------------------------------------------------------

def test_graph_is_topologically_ordered_and_shares_nodes():
    x, W, b, h, loss = small_graph()
    g = Graph([loss, h, loss])
    pos = {n: k for k, n in enumerate(g.nodes)}
    assert len(pos) == len(g.nodes)  # every node once
    for n in g.nodes:
        assert all(pos[i] < pos[n] for i in n.inputs)
    assert g.inputs == (x,) and set(g.params) == {W, b}
    consumers = g.consumers()
    assert len(consumers[h]) == 2 and consumers[loss] == []
    assert isinstance(g.nodes[0], Node) and len(g) == len(list(g))
