"""GEMM merging (passes/gemm.py): what merges and what must not, on small hand-built vertex functions, the
rewritten functions against the declared ones (float64, DESIGN.md's "equal") and finite differences, and the
switch seen in dump() and explain()."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from minicavs import ops
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.explain import explain
from minicavs.engine.model import Model, Structure
from minicavs.engine.passes import gemm
from minicavs.engine.passes.gemm import merge_groups, merge_products, operands
from minicavs.train.testing import check_model_grads
from minicavs.runtime.vertex import VertexFunction

from ... import cells
from ..test_alg1 import CASES, assert_same, random_tree

F64 = "float64"
ON, OFF = EngineOptions(), EngineOptions(merge_gemms=False)


def P(name, shape):
    return ops.param_node(name, shape, F64)


def merged_sets(F, pad_limit=None):
    return [{p.name or p.op for p, _, _ in members} for _, members in merge_groups(F, pad_limit)]


@pytest.fixture
def padded(monkeypatch):
    """Every merge the pass can make, zero padding of any size included (the default limits it)."""
    monkeypatch.setattr(gemm, "PAD_LIMIT", 10**9)
    monkeypatch.setattr(gemm, "WEIGHT_LIMIT", 10**9)


def test_products_of_one_left_operand_merge_and_keep_their_biases():
    W1, W2, W3, b1 = P("W1", (3, 2)), P("W2", (3, 4)), P("W3", (3, 1)), P("b1", (2,))
    F = VertexFunction("f", message=(7,), dtype=F64)
    with F:
        x = ops.tanh(F.pull((3,)))
        y1 = ops.linear(x, W1, b1)
        y2 = ops.matmul(x, W2)
        y3 = ops.matmul(x, W3)
        F.scatter(ops.concat([y1, y2, ops.sigmoid(y3)]))
    merged, merges = merge_products(F)
    assert len(merges) == 1 and merges[0].products == (y1, y2, y3) and merges[0].zero_entries == 0
    Y = merges[0].merged
    assert Y.inputs[0] is x and Y.inputs[1].shape == (3, 7) and Y.shape == (None, 7)
    assert len(Y.inputs) == 2                         # b1 is added to y1's block, in the consumer's kernel
    biased, = [n for n in merged.graph.nodes if b1 in n.inputs]
    assert biased.op == "add" and biased.inputs[0].op == "slice" and biased.inputs[0].inputs[0] is Y
    assert set(merged.params) == {W1, W2, W3, b1}     # the declared parameters stay the parameters
    assert merged.pulls == F.pulls and merged.gathers == F.gathers and merged.name == F.name


def test_concat_blocks_merge_with_zero_padding_up_to_a_limit():
    """The binary Tree-LSTM's shape: [h1; h2]·U, h1·Uf1, h2·Uf2 -> one GEMM of a (2H, 5H) weight."""
    case = cells.binary_tree_lstm(np.random.default_rng(0))
    F = case.model.structures[0].compiled["internal"].F
    assert merged_sets(F, pad_limit=10**6) == [{"linear"}]   # one group
    (L, members), = merge_groups(F, pad_limit=10**6)
    assert L.op == "concat" and [(a, b) for _, a, b in members] == [(0, 6), (0, 3), (3, 6)]
    _, (m,) = merge_products(F, pad_limit=10**6)
    assert m.merged.inputs[1].shape == (6, 15) and m.zero_entries == 2 * 3 * 3
    assert "one GEMM" in m.text() and "20% of the weight zero padding" in m.text()
    assert merge_groups(F, pad_limit=0) == []                # no two products read the same value
    assert merge_groups(F, pad_limit=17) == [] and len(merge_groups(F, pad_limit=18)) == 1   # 18 zero entries
    assert merge_groups(F, 18, weight_limit=89) == [] and len(merge_groups(F, 18, weight_limit=90)) == 1   # of 6 x 15
    assert merge_groups(F) == []                             # the default: no padding


def test_products_of_different_classes_do_not_merge():
    """h·W1 feeds the scatter (recurrent), h·W2 only the push (lazy): merged, the lazy product would run in
    the task loop instead of once after it. x·Wx (eager) + h·Wh (recurrent) likewise stays two GEMMs."""
    W1, W2, Wx, Wh = P("W1", (2, 2)), P("W2", (2, 2)), P("Wx", (3, 2)), P("Wh", (2, 2))
    F = VertexFunction("f", arity=1, message=(2,), dtype=F64)
    with F:
        h = F.gather(0)
        x = F.pull((3,))
        F.scatter(ops.tanh(h @ W1 + x @ Wx + h @ Wh))
        F.push(h @ W2)
    groups = merge_groups(F)
    assert [{p.inputs[1].name for p, _, _ in members} for _, members in groups] == [{"W1", "Wh"}]


def test_products_that_cannot_merge():
    """Not candidates: a product over the vertex axis (xᵀ·y, a transposed use whose result is row-free),
    a per-vertex batch of matrices ((2, K) per vertex times W), and a product whose right operand depends on
    the vertex. A group whose merged GEMM would read its own output is dropped."""
    W, W2 = P("W", (3, 3)), P("W2", (6, 3))
    F = VertexFunction("f", message=(3,), dtype=F64)
    with F:
        x = F.pull((3,))
        m = ops.reshape(ops.concat([x, x]), (2, 3))      # (2, 3) per vertex
        batched = ops.matmul(m, W)                       # 3-D: not a candidate
        y = x @ W
        L = ops.concat([x, ops.tanh(y)])                 # L depends on y
        z = L @ W2                                       # x is a block of L, but merging y into L·W' is a cycle
        F.scatter(ops.sum(batched, axis=0) + z)
    assert operands(batched) is None
    assert merge_groups(F) == []
    g = ops.input((None, 3), F64)
    outer = ops.matmul(ops.transpose(g), g)              # static graph: xᵀ·x sums over rows
    assert operands(outer) is None


def test_rewritten_functions_equal_the_declared_ones_on_random_trees_chains_and_dags(padded):
    for name, (build, make_graph) in sorted(CASES.items()):
        rng = np.random.default_rng(5)
        case = build(rng)
        graphs = [make_graph(rng, n) for n in (4, 1, 6, 3)]
        feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
        for opts in (ON, replace(ON, fusion=False), replace(ON, lazy_batching=False, eager_batching=False)):
            off = case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                              options=replace(opts, merge_gemms=False))
            on = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=opts)
            assert_same(off, on)


@pytest.mark.parametrize("name", ["binary_tree_lstm", "child_sum"])
def test_merged_cells_match_finite_differences(name, padded):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(2)
    case = build(rng)
    s = case.model.structures[0]
    assert any(fn.variant(ON).merges for fn in s.compiled.values())   # the rewrite is what is checked
    graphs = [make_graph(rng, n) for n in (3, 5)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    case.model.options = ON
    report = check_model_grads(case.model, graphs, feeds, case.params, directions=2)
    assert set(report) == set(case.params)


def test_dropout_masks_follow_the_declared_sites(padded):
    rng = np.random.default_rng(3)
    case = cells.binary_tree_lstm(rng, p_drop=0.4)
    graphs = [random_tree(rng, n, 2, full_binary=True) for n in (5, 3)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    runs = [case.model.forward_backward(graphs, feeds, case.params, RunContext(seed=4, step=1), options=o)
            for o in (OFF, ON)]
    assert case.model.structures[0].compiled["internal"].variant(ON).merges
    assert_same(*runs)


def test_switch_is_visible_in_dump_and_explain(padded):
    case = cells.binary_tree_lstm(np.random.default_rng(0))
    internal = case.model.structures[0].compiled["internal"]
    assert internal.variant(OFF) is internal and internal.variant(ON) is not internal
    assert internal.variant(ON) is internal.variant(ON)   # compiled once
    assert "GEMMs merged" in internal.dump(ON) and "GEMMs merged" not in internal.dump(OFF)
    leaf = case.model.structures[0].compiled["leaf"]
    assert leaf.variant(ON) is leaf                       # nothing to merge: the same compiled function
    rng = np.random.default_rng(0)
    graphs = [random_tree(rng, 4, 2, full_binary=True)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    case.model.options = ON
    where = explain(case.model, graphs, feeds, case.params).structures[0].where
    assert where["internal"]["merged GEMMs"] == 1 and where["leaf"]["merged GEMMs"] == 0
    # One GEMM per task in F where there were three (plus its bias-free twin in ∂F).
    products = [st for st in internal.variant(ON).phases(ON).forward.programs[1] if st.outputs[0] in
                {m.merged for m in internal.variant(ON).merges}]
    assert len(products) == 1


def test_a_structure_of_a_merged_function_keeps_parameter_names_and_gradients():
    W1, W2 = ops.param_node("W1", (2, 3), F64), ops.param_node("W2", (2, 3), F64)
    F = VertexFunction("f", arity=1, message=(3,), dtype=F64)
    with F:
        x = F.pull((2,))
        h = ops.tanh(x @ W1) * ops.sigmoid(x @ W2) + F.gather(0)
        F.scatter(h)
        F.push(h)
    s = Structure(F, pulls={"x": ops.input((None, 2), F64, name="x")})
    model = Model(s, loss=ops.sum(s.pushed("h") * s.pushed("h")))
    rng = np.random.default_rng(0)
    params = {"W1": rng.standard_normal((2, 3)), "W2": rng.standard_normal((2, 3))}
    graphs = [random_tree(rng, 5, 1)]
    feeds = {"x": rng.standard_normal((5, 2))}
    off = model.forward_backward(graphs, feeds, params, RunContext(), options=OFF)
    on = model.forward_backward(graphs, feeds, params, RunContext(), options=ON)
    assert set(on.grads) == {"W1", "W2"} and s.compiled["f"].variant(ON).merges
    assert_same(off, on)
