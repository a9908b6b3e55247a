"""Eager / lazy / recurrent classes of the Tree-LSTM's F and ∂F against a table derived by hand."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.passes.classify import EAGER, LAZY, RECURRENT, classify

from ... import cells
from ..test_alg1 import CASES, assert_same, dense, random_tree


@pytest.fixture(scope="module")
def tree_lstm():
    case = cells.binary_tree_lstm(np.random.default_rng(0))
    s = case.model.structures[0]
    return s.compiled["leaf"], s.compiled["internal"]


def by_class(classes, nodes):
    return {n.op if not n.name else n.name: classes[n] for n in nodes}


def test_forward_classes(tree_lstm):
    leaf, internal = tree_lstm
    # A leaf gathers nothing: its whole F, scatter and push included, depends only on its pull.
    assert {c for n, c in leaf.fwd_class.items()} == {EAGER}
    # Internal: everything between the gathers and the scatter is recurrent; the push is lazy;
    # parameters are eager (they depend on no gather).
    table = {n: c for n, c in internal.fwd_class.items()}
    push = internal.pushes["h"]
    scatter = internal.scattered
    assert table[push] == LAZY and table[scatter] == RECURRENT
    for n, c in table.items():
        if n.op == "param":
            assert c == EAGER, n
        elif n is not push:
            assert c == RECURRENT, n   # h feeds both the scatter (via concat) and the push


def test_backward_classes(tree_lstm):
    leaf, internal = tree_lstm
    bi = internal.bwd_class
    ct_scatter, ct_push = internal.ct[internal.scattered], internal.ct[internal.pushes["h"]]
    assert bi[ct_scatter] == RECURRENT and bi[ct_push] == EAGER
    for leaf_node, g in internal.leaf_grads.items():      # gradients sent to the children
        assert bi[g] == RECURRENT, leaf_node
    for name, g in internal.param_grads.items():          # gradients of U, U_f1, U_f2, b_i, b_f
        assert bi[g] == LAZY, name
    bl = leaf.bwd_class
    # A leaf sends nothing to children: all work on the parents' gradient can wait for the whole loop.
    assert RECURRENT not in set(bl.values())
    assert bl[leaf.ct[leaf.scattered]] == LAZY and bl[leaf.ct[leaf.pushes["h"]]] == EAGER
    assert all(bl[g] == LAZY for g in leaf.param_grads.values())
    assert all(bl[g] == LAZY for g in leaf.leaf_grads.values())   # the pull gradient (embedding rows)
    # Work on the push gradient alone (through o, tanh(c)) is eager in both kinds.
    assert any(c == EAGER and n.op == "mul" for n, c in bi.items())


def test_classify_small_graph():
    from minicavs import ops
    g0 = ops.input((None, 2), name="g")       # stands for a gather
    x = ops.input((None, 2), name="x")        # a pull
    e = ops.tanh(x)                            # eager
    r = ops.add(g0, e)                         # recurrent
    s = ops.mul(r, 2.0)                        # the scatter
    lz = ops.exp(r)                            # lazy: depends on g0, feeds no scatter
    nodes = sorted({g0, x, e, r, s, lz, *s.inputs}, key=lambda n: n.id)
    c = classify(nodes, [g0], [s])
    assert (c[g0], c[x], c[e], c[r], c[s], c[lz]) == (RECURRENT, EAGER, EAGER, RECURRENT, RECURRENT, LAZY)


OFF = EngineOptions(lazy_batching=False, eager_batching=False, fusion=False, gather_elision=False,
                    merge_gemms=False)
SWITCHES = [OFF] + [replace(OFF, **{k: True}) for k in ("lazy_batching", "eager_batching", "fusion",
                                                        "gather_elision", "merge_gemms")] + [EngineOptions()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_switch_combinations_equal_all_off(name):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(11)
    case = build(rng)
    graphs = [make_graph(rng, n) for n in (4, 1, 6, 3)]
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)
    runs = [case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=o) for o in SWITCHES]
    for r in runs[1:]:
        assert_same(runs[0], r)
    for o in SWITCHES[1:]:
        inf = case.model.infer(graphs, feeds, case.params, options=o)
        ref = case.model.infer(graphs, feeds, case.params, options=SWITCHES[0])
        assert_same(ref, inf)


def test_switches_with_dropout_equal_all_off():
    rng = np.random.default_rng(12)
    case = cells.binary_tree_lstm(rng, p_drop=0.3)
    graphs = [random_tree(rng, n, 2, full_binary=True) for n in (5, 2, 7)]
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)
    runs = [case.model.forward_backward(graphs, feeds, case.params, RunContext(seed=3, step=2), options=o)
            for o in SWITCHES]
    for r in runs[1:]:
        assert_same(runs[0], r)
    assert np.abs(dense(runs[0].grads["W"])).max() > 0


def test_dump_shows_classes(tree_lstm):
    leaf, internal = tree_lstm
    text = internal.dump()
    assert "recurrent" in text and "lazy" in text and "eager" in text and "∂F" in text


STREAMING = [EngineOptions(streaming=True), replace(OFF, streaming=True)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_streaming_equals_all_off_and_repeats_identically(name):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(13)
    case = build(rng)
    graphs = [make_graph(rng, n) for n in (5, 2, 7, 1)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    ref = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=SWITCHES[0])
    for opts in STREAMING:
        first = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=opts)
        assert_same(ref, first)
        for _ in range(20):   # a race would show as a difference between repeated runs
            again = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=opts)
            assert again.loss == first.loss
            for k in first.grads:
                assert np.array_equal(dense(again.grads[k]), dense(first.grads[k])), k


def test_streaming_with_dropout_and_errors():
    rng = np.random.default_rng(14)
    case = cells.binary_tree_lstm(rng, p_drop=0.3)
    graphs = [random_tree(rng, n, 2, full_binary=True) for n in (6, 3)]
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)
    ref = case.model.forward_backward(graphs, feeds, case.params, RunContext(seed=2), options=SWITCHES[0])
    got = case.model.forward_backward(graphs, feeds, case.params, RunContext(seed=2), options=STREAMING[0])
    assert_same(ref, got)



def test_dot_shows_classes(tree_lstm):
    leaf, internal = tree_lstm
    assert "[recurrent]" in internal.to_dot() and "[lazy]" in internal.to_dot()
    assert "[eager]" in internal.to_dot(backward=True) and internal.to_dot().startswith("digraph")
