"""Fusion grouping: kernel counts for the Tree-LSTM, and every group's expression equals its nodes run one by
one (float32 and float64)."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import ops
from minicavs.engine.executor import Executor
from minicavs.ir.graph import Graph
from minicavs.ops.registry import OPS
from minicavs.engine.passes.fusion import fuse, fusible

from ... import cells


def count_kernels(nodes: list, outputs: list = ()) -> int:
    """Fused elementwise kernels plus every other non-leaf node: what one evaluation launches."""
    others = sum(1 for n in nodes if not fusible(n) and not OPS[n.op].source)
    return len(fuse(nodes, outputs)) + others


@pytest.fixture(scope="module")
def internal():
    case = cells.binary_tree_lstm(np.random.default_rng(0))
    return case.model.structures[0].compiled["internal"]


def test_tree_lstm_internal_kernel_counts(internal):
    nodes = list(internal.row_fwd)
    groups = fuse(nodes, internal.F.outputs)
    sizes = sorted(len(g.nodes) for g in groups)
    # c = σ(i)⊙tanh(u) + f1⊙c1 + f2⊙c2 is one group (σ, tanh, ⊙, +, ⊙, +, ⊙ and the two σ of f1, f2);
    # h = σ(o)⊙tanh(c) another (c is also scattered, so it ends its group).
    assert max(sizes) >= 8 and len(groups) < sum(sizes)
    before = sum(1 for n in nodes if n.op not in ("constant",))
    after = count_kernels(nodes, internal.F.outputs)
    assert after < before - 8, (before, after)


def test_backward_graph_fuses_too(internal):
    nodes = [n for n in internal.row_bwd]
    outs = list(internal.leaf_grads.values()) + list(internal.param_grads.values())
    groups = fuse(nodes, outs)
    assert any(len(g.nodes) >= 4 for g in groups)
    assert count_kernels(nodes, outs) < len(nodes)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_group_expression_equals_node_by_node(dtype):
    rng = np.random.default_rng(1)
    x = ops.input((None, 4), dtype, name="x")
    y = ops.input((None, 4), dtype, name="y")
    b = ops.input((4,), dtype, name="b")
    z = ops.sigmoid(x * 0.5 + b) * ops.tanh(y) - ops.exp(-ops.square(y)) / (ops.relu(x) + 2.0)
    out = ops.maximum(z, ops.sqrt(ops.abs(x) + 1.0)) ** 2.0
    g = Graph([out])
    groups = fuse(list(g.nodes), [out])
    assert len(groups) == 1 and groups[0].output is out
    feeds = {x: rng.standard_normal((5, 4)), y: rng.standard_normal((5, 4)), b: rng.standard_normal(4)}
    want = Executor([out]).run(feeds)[0]
    got = groups[0].evaluate([np.asarray(feeds[i], dtype) for i in groups[0].inputs])
    assert groups[0].broadcast == ["full", "row", "full"] or set(groups[0].broadcast) <= {"full", "row"}
    tol = 1e-12 if dtype == "float64" else 1e-5
    assert got.dtype == np.dtype(dtype)
    assert np.max(np.abs(got - want)) <= tol * max(1.0, np.max(np.abs(want)))


def test_values_needed_outside_become_extra_outputs():
    x = ops.input((None, 3), name="x")
    h = ops.tanh(x)
    out = ops.exp(h) + ops.neg(h)
    # h used twice inside one group: fused, computed once in the expression DAG
    (g,) = fuse(list(Graph([out]).nodes), [out])
    assert len(g.nodes) == 4 and g.outputs == [out]
    # h also needed outside (as when it is both scattered and pushed): one group that writes h and out
    (g,) = fuse(list(Graph([out, h]).nodes), [out, h])
    assert len(g.nodes) == 4 and g.outputs == [h, out]
    v = np.linspace(-2, 2, 6).reshape(2, 3)
    got_h, got_out = g.evaluate_all([v])
    assert np.allclose(got_h, np.tanh(v)) and np.allclose(got_out, np.exp(np.tanh(v)) - np.tanh(v))


def test_no_group_that_a_path_leaves_and_reenters():
    x = ops.input((None, 3), name="x")
    h = ops.tanh(x)
    y = ops.matmul(h, ops.input((3, 3), name="W"))   # a consumer that is not elementwise
    z = ops.sigmoid(y) * h
    groups = fuse(list(Graph([z]).nodes), [z])
    assert sorted(len(g.nodes) for g in groups) == [1, 2]
    assert [g.outputs for g in groups] == [[h], [z]]
