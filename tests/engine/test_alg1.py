"""The vertex-centric runtime against the serial policy and an engine-free unrolled reference (float64)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.engine.backend import array_module, to_host
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.explain import check, explain
from minicavs.runtime.inputs import InputGraph, make_batch
from minicavs.train.testing import check_model_grads

from .. import cells


def equal(a, b, ref=None):
    """DESIGN.md's "equal" for float64 runs: max|a - b| <= 1e-10 * max(1, max|ref|)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ref = a if ref is None else np.asarray(ref)
    tol = 1e-10 * max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    assert a.shape == b.shape and (a.size == 0 or np.max(np.abs(a - b)) <= tol), (np.max(np.abs(a - b)), tol)


def dense(g):
    """A gradient (dense or row-sparse, on any device) as a host array: copied back explicitly."""
    if hasattr(g, "to_dense"):
        g = g.to_dense(array_module(g.rows))
    return to_host(g)


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


RUNNERS = ["device", "reference"]   # the device's runner (the C runner here) and the reference runner


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5), size=st.integers(1, 6))
def test_batched_equals_serial_and_unrolled_reference(name, runner, seed, k, size):
    """On each runner, through the one binder: the batched pass equals the serial policy's and the
    engine-free unrolled reference."""
    build, make_graph = CASES[name]
    rng = np.random.default_rng(seed)
    case = build(rng)
    case.model.options = EngineOptions(runner=runner)
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


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_finite_differences_through_the_model(name, runner):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(1)
    case = build(rng)
    case.model.options = EngineOptions(runner=runner)
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
    train = case.model.forward_backward(graphs, feeds, case.params)
    # Inference keeps only values that cross from the eager phase into the task loop; training keeps all.
    kept, trained = res.states["G"].tensors[0], train.states["G"].tensors[0]
    assert 0 < len(kept) < len(trained) and all(not n.op == "gather" for n in kept)
    off = case.model.infer(graphs, feeds, case.params, options=EngineOptions(False, False))
    assert all(not t for t in off.states["G"].tensors)
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
    # full binary trees, kinds leaf/internal: one leaf and `height` internal vertices on the longest path
    bound = 1 + int(make_batch(graphs).height.max())
    report = explain(case.model, graphs, feeds, case.params, policy="agenda").structures[0]
    assert report.policy == "agenda" and report.lower_bound == bound and report.tasks >= bound
    assert f"policy 'agenda', lower bound {bound}" in str(explain(case.model, graphs, feeds, case.params,
                                                                    policy="agenda"))


def test_param_gradients_shaped_like_params():
    rng = np.random.default_rng(4)
    case = cells.tree_fc(rng)
    graphs = [random_tree(rng, 4, 2, full_binary=True)]
    res, _ = run_case(case, graphs, rng)
    for k, v in case.params.items():
        assert dense(res.grads[k]).shape == v.shape


def test_tree_encoder_chain_decoder_composition():
    rng = np.random.default_rng(6)
    model, params = cells.encoder_decoder(rng)
    trees = [random_tree(rng, n, 2, full_binary=True) for n in (3, 1, 4)]
    chains = [InputGraph.chain(n) for n in (2, 3, 1)]
    offsets = np.cumsum([0] + [t.num_vertices for t in trees])
    roots = np.array([offsets[k] + t.roots()[0] for k, t in enumerate(trees)])
    feeds = {"xs": rng.standard_normal((sum(int(np.sum(t.num_children() == 0)) for t in trees), 3)),
             "roots": roots, "dec_sample": np.repeat(np.arange(3), [c.num_vertices for c in chains]),
             "target": rng.uniform(-1, 1, (6, 1))}
    graphs = {"enc": trees, "dec": chains}
    rep = check(model, graphs, feeds, params)
    assert rep["max"] <= 1e-10 and "grad Wl" in rep
    check_model_grads(model, graphs, feeds, params, directions=2)
    # The decoder depends on the encoder: changing an encoder weight changes the loss.
    base = model.forward_backward(graphs, feeds, params)
    assert np.abs(dense(base.grads["Wl"])).max() > 0
    with pytest.raises(TypeError, match="several structures"):
        model.forward_backward(trees, feeds, params)


def _tree_lstm_inputs(rng):
    case = cells.binary_tree_lstm(rng)
    graphs = [random_tree(rng, n, 2, full_binary=True) for n in (3, 2)]
    per = [case.data(rng, g) for g in graphs]
    return case, graphs, cells.batch_feeds(case, graphs, per)


@pytest.mark.parametrize("bad, match", [
    (lambda g: [InputGraph([[1], [0]])], r"sample 0, vertex [01]: lies on a cycle"),
    (lambda g: [g[0], InputGraph([[], [5]])], r"sample 1, vertex 1: child index 5 out of range"),
    (lambda g: [InputGraph([[], [], [], [0, 1, 2]])], r"sample 0, vertex 3: 3 children, more than the arity 2"),
    (lambda g: [], "empty batch"),
    (lambda g: [g[0], InputGraph([])], "sample 1: empty graph"),
])
def test_bad_input_graphs_raise_and_change_nothing(bad, match):
    from minicavs.core.errors import InputGraphError
    rng = np.random.default_rng(7)
    case, graphs, feeds = _tree_lstm_inputs(rng)
    before = case.model.forward_backward(graphs, feeds, case.params)
    snapshot = {k: v.copy() for k, v in case.params.items()}
    with pytest.raises(InputGraphError, match=match):
        case.model.forward_backward(bad(graphs), feeds, case.params)
    after = case.model.forward_backward(graphs, feeds, case.params)
    assert all(np.array_equal(case.params[k], v) for k, v in snapshot.items())
    assert after.loss == before.loss
    assert all(np.array_equal(dense(after.grads[k]), dense(before.grads[k])) for k in before.grads)


def test_pull_buffer_with_wrong_number_of_rows():
    from minicavs.core.errors import FeedError
    rng = np.random.default_rng(8)
    case, graphs, feeds = _tree_lstm_inputs(rng)
    feeds = dict(feeds, words=feeds["words"][:-1])
    with pytest.raises(FeedError, match=r"pull buffer 'x' has \d+ rows, the batch has \d+ vertices that pull it"):
        case.model.forward_backward(graphs, feeds, case.params)


@pytest.mark.parametrize("bad_value, match", [(10 ** 6, "out of range"), (-1, "out of range")])
def test_a_bad_word_id_names_the_sample_and_vertex_that_pull_it(bad_value, match):
    """The feed is in vertex order: the error says which leaf of which tree the bad entry belongs to."""
    from minicavs.core.errors import FeedError
    rng = np.random.default_rng(8)
    case, graphs, feeds = _tree_lstm_inputs(rng)
    leaves = [(i, v) for i, g in enumerate(graphs) for v in np.flatnonzero(g.num_children() == 0)]
    for position in (0, len(leaves) - 1, len(leaves) // 2):
        words = feeds["words"].copy()
        words[position] = bad_value
        sample, vertex = leaves[position]
        with pytest.raises(FeedError, match=rf"{match}.*row {position} of pull buffer 'x' of structure '\w+', "
                                            rf"pulled by sample {sample}, vertex {vertex}$"):
            case.model.forward_backward(graphs, dict(feeds, words=words), case.params)


def test_float32_run_matches_float64():
    """float32 is the default dtype; it agrees with float64 by DESIGN.md's float32 rule."""
    graphs = [random_tree(np.random.default_rng(9), n, 2, full_binary=True) for n in (5, 2, 7)]
    runs = {}
    for dtype in ("float32", "float64"):
        rng = np.random.default_rng(10)
        case = cells.binary_tree_lstm(rng, dtype=dtype)
        per = [case.data(rng, g) for g in graphs]
        runs[dtype] = case.model.forward_backward(graphs, cells.batch_feeds(case, graphs, per), case.params)
    r32, r64 = runs["float32"], runs["float64"]
    assert all(dense(g).dtype == np.float32 for g in r32.grads.values())
    assert abs(r32.loss - r64.loss) <= 1e-5 * max(1.0, abs(r64.loss))
    for k, g in r64.grads.items():
        ref = dense(g)
        assert np.max(np.abs(dense(r32.grads[k]) - ref)) <= 1e-5 * max(1.0, np.max(np.abs(ref))), k


@pytest.mark.parametrize("name", ["binary_tree_lstm", "child_sum", "child_sum_dag", "tree_fc"])
def test_scatter_gradient_rows_no_parent_writes_are_zero(name, monkeypatch):
    """Backward writes (not adds) each forest child's gradient once and zeroes only the other rows:
    with fresh buffers full of NaN, results must not change."""
    build, make_graph = CASES[name]
    rng = np.random.default_rng(21)
    case = build(rng)
    graphs = [make_graph(rng, n) for n in (3, 5, 1)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    ref = case.model.forward_backward(graphs, feeds, case.params, RunContext())
    empty_like = np.empty_like

    def poisoned(a, *args, **kw):
        out = empty_like(a, *args, **kw)
        if out.dtype.kind == "f":
            out.fill(np.nan)
        return out
    monkeypatch.setattr(np, "empty_like", poisoned)
    got = case.model.forward_backward(graphs, feeds, case.params, RunContext())
    assert_same(ref, got)


def test_pull_gradients_only_where_something_needs_them():
    """Tree-FC pulls plain inputs: no gradient is computed for them. A Tree-LSTM pulls embedding rows (a
    parameter) and a decoder pulls an encoder's pushes: both need theirs."""
    rng = np.random.default_rng(8)
    fc = cells.tree_fc(rng).model.structures[0]
    assert fc.pull_grads == set()
    assert not [leaf for fn in fc.compiled.values() for leaf in fn.leaf_grads if leaf.op == "pull"]
    lstm = cells.binary_tree_lstm(rng).model.structures[0]
    assert lstm.pull_grads == set(lstm.pulls) and any(
        leaf.op == "pull" for fn in lstm.compiled.values() for leaf in fn.leaf_grads)
    model, _ = cells.encoder_decoder(rng)
    enc, dec = model.structures
    assert enc.pull_grads == set() and dec.pull_grads == {"ctx"}


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("name", ["binary_tree_lstm", "chain_lstm", "tree_fc"])
def test_fusion_groups_are_the_groups_the_engine_lowers(name, streaming):
    """``fusion_groups()`` (what a backend renders without compiling) lists exactly the groups ``phases``
    turns into kernels under the same switches."""
    case = CASES[name][0](np.random.default_rng(0))
    opts = EngineOptions(streaming=streaming)
    for s in case.model.structures:
        for fn in s.compiled.values():
            fwd, bwd = fn.phases(opts)
            lowered = sorted(tuple(n.id for n in g.nodes) for ph in (fwd, bwd) for gs in ph.groups for g in gs)
            listed = sorted(tuple(n.id for n in g.nodes) for g in fn.fusion_groups(opts))
            assert lowered and lowered == listed
