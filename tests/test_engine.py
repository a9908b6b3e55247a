"""The vertex-centric runtime against the serial policy and an engine-free unrolled reference (float64)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.executor import RunContext
from minicavs.explain import check, explain
from minicavs.inputs import InputGraph
from minicavs.testing import check_model_grads

from . import cells


def equal(a, b, ref=None):
    """DESIGN.md's "equal" for float64 runs: max|a - b| <= 1e-10 * max(1, max|ref|)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = a if ref is None else np.asarray(ref)
    tol = 1e-10 * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    assert a.shape == b.shape and (a.size == 0 or np.max(np.abs(a - b)) <= tol), (np.max(np.abs(a - b)), tol)


def dense(g):
    return g.to_dense() if hasattr(g, "to_dense") else np.asarray(g)


def random_tree(rng, n, arity, full_binary=False):
    """A random tree with ``n`` vertices and at most ``arity`` children each, ids shuffled."""
    if full_binary:
        nodes = list(range(n))  # build by merging: n leaves -> 2n - 1 vertices
        children = [[] for _ in range(n)]
        while len(nodes) > 1:
            i = int(rng.integers(0, len(nodes) - 1))
            a, b = nodes[i], nodes[i + 1]
            children.append([a, b])
            nodes[i:i + 2] = [len(children) - 1]
    else:
        children = [[] for _ in range(n)]
        for v in range(1, n):
            while True:
                p = int(rng.integers(0, v))
                if len(children[p]) < arity:
                    children[p].append(v)
                    break
    perm = rng.permutation(len(children))
    out = [None] * len(children)
    for v, ch in enumerate(children):
        out[perm[v]] = [int(perm[c]) for c in ch]
    return InputGraph(out)


def random_dag(rng, n, arity):
    """Vertices may have several parents; each vertex's children come from earlier vertices."""
    children = [[] for _ in range(n)]
    for v in range(1, n):
        k = int(rng.integers(0, min(arity, v) + 1))
        children[v] = [int(c) for c in rng.choice(v, size=k, replace=False)]
    return InputGraph(children)


def run_case(case, graphs, rng, policy=None, ctx=None):
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)
    return case.model.forward_backward(graphs, feeds, case.params, ctx or RunContext(), policy=policy), per


def assert_same(r1, r2):
    equal(r1.loss, r2.loss)
    for s in r1.pushes:
        for name in r1.pushes[s]:
            equal(r1.pushes[s][name], r2.pushes[s][name])
    assert set(r1.grads) == set(r2.grads)
    for k in r1.grads:
        equal(dense(r1.grads[k]), dense(r2.grads[k]))


def assert_matches_reference(case, graphs, per, result):
    total, grads = 0.0, {}
    for g, d in zip(graphs, per):
        loss, gr = cells.unrolled_reference(case, g, cells.batch_feeds(case, [g], [d]))
        total += loss
        for k, v in gr.items():
            grads[k] = grads.get(k, 0) + v
    equal(result.loss, total)
    for k, v in grads.items():
        equal(dense(result.grads[k]), v)


CASES = {
    "binary_tree_lstm": (cells.binary_tree_lstm, lambda rng, n: random_tree(rng, n, 2, full_binary=True)),
    "child_sum": (cells.child_sum_tree_lstm, lambda rng, n: random_tree(rng, 2 * n, 3)),
    "child_sum_dag": (cells.child_sum_tree_lstm, lambda rng, n: random_dag(rng, 2 * n, 3)),
    "chain_lstm": (cells.chain_lstm, lambda rng, n: InputGraph.chain(n)),
    "tree_fc": (cells.tree_fc, lambda rng, n: random_tree(rng, n, 2, full_binary=True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5), size=st.integers(1, 6))
def test_batched_equals_serial_and_unrolled_reference(name, seed, k, size):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(seed)
    case = build(rng)
    graphs = [make_graph(rng, int(rng.integers(1, size + 1))) for _ in range(k)]
    state = rng.bit_generator.state
    batched, per = run_case(case, graphs, rng)
    rng.bit_generator.state = state
    serial, _ = run_case(case, graphs, rng, policy="serial")
    assert_same(batched, serial)
    assert_matches_reference(case, graphs, per, batched)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 6))
def test_dropout_masks_do_not_depend_on_batching(seed, k):
    rng = np.random.default_rng(seed)
    case = cells.binary_tree_lstm(rng, p_drop=0.4)
    graphs = [random_tree(rng, int(rng.integers(1, 7)), 2, full_binary=True) for _ in range(k)]
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)
    ctx = dict(seed=seed % 1000, step=3)
    batched = case.model.forward_backward(graphs, feeds, case.params, RunContext(**ctx))
    serial = case.model.forward_backward(graphs, feeds, case.params, RunContext(**ctx), policy="serial")
    assert_same(batched, serial)
    # A sample run alone, under its own sample id, draws the same masks as inside the batch.
    rows = batched.per_sample("G", "h")
    for i, (g, d) in enumerate(zip(graphs, per)):
        alone = case.model.forward_backward([g], cells.batch_feeds(case, [g], [d]), case.params,
                                            RunContext(**ctx), sample_ids=[i])
        equal(alone.per_sample("G", "h")[0], rows[i])
    off = case.model.forward_backward(graphs, feeds, case.params, RunContext(**ctx, training=False))
    assert abs(off.loss - batched.loss) > 1e-9  # dropout really did something


@pytest.mark.parametrize("name", sorted(CASES))
def test_finite_differences_through_the_model(name):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(1)
    case = build(rng)
    graphs = [make_graph(rng, n) for n in (3, 1, 5)]
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)
    report = check_model_grads(case.model, graphs, feeds, case.params, directions=2)
    assert set(report) == set(case.params)


def test_inference_returns_pushes_per_sample_and_keeps_no_state():
    rng = np.random.default_rng(2)
    case = cells.chain_lstm(rng)
    graphs = [InputGraph.chain(n) for n in (3, 1, 4)]
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)
    res = case.model.infer(graphs, feeds, case.params)
    rows = res.per_sample("G", "h")
    assert [r.shape for r in rows] == [(3, 3), (1, 3), (4, 3)]
    assert res.grads == {}
    assert all(not t for t in res.states["G"].tensors)
    train = case.model.forward_backward(graphs, feeds, case.params)
    equal(np.concatenate(rows), train.pushes["G"]["h"])


def test_check_and_explain_report():
    rng = np.random.default_rng(3)
    case = cells.binary_tree_lstm(rng)
    graphs = [random_tree(rng, n, 2, full_binary=True) for n in (4, 2, 6)]
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)
    rep = check(case.model, graphs, feeds, case.params)
    assert rep["max"] <= 1e-10 and "grad U" in rep and "loss" in rep
    text = str(explain(case.model, graphs, feeds, case.params))
    n = sum(g.num_vertices for g in graphs)
    assert f"{n} vertices" in text and "gather" in text and "KiB" in text


def test_param_gradients_shaped_like_params():
    rng = np.random.default_rng(4)
    case = cells.tree_fc(rng)
    graphs = [random_tree(rng, 4, 2, full_binary=True)]
    res, _ = run_case(case, graphs, rng)
    for k, v in case.params.items():
        assert dense(res.grads[k]).shape == v.shape
