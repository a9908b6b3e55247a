"""Table-driven checks of the nn ops (see tests/ops/specs.py): forward vs tests/reference.py, gradients
vs finite differences."""
import numpy as np
import pytest

import minicavs.ops as ops
from minicavs.ops.autodiff import grad
from minicavs.core.errors import FeedError, ShapeError
from minicavs.engine.executor import Executor, RunContext, run
from minicavs.ir.graph import Graph
from minicavs.core.sparse import RowSparse
from minicavs.train.testing import check_grads

from .. import reference as R
from .specs import check_backward_types, check_forward, check_gradient, dense_of, params_for


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("nn"))
def test_forward_matches_reference(spec, case, dtype, rows):
    check_forward(spec, case, dtype, rows)


@pytest.mark.parametrize("spec,case", params_for("nn", gradient=True))
def test_gradient_matches_finite_differences(spec, case):
    check_gradient(spec, case)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("nn", gradient=True))
def test_backward_values_have_declared_types(spec, case, dtype, rows):
    check_backward_types(spec, case, dtype, rows)


# --- lookup: the table gradient is row-sparse ----------------------------------------------------------

def _table_case(idx_value, table_shape=(6, 3), seed=0):
    rng = np.random.default_rng(seed)
    table = ops.param_node("table", table_shape, "float64")
    idx = ops.input((None,) + np.shape(idx_value)[1:], "int64", name="idx")
    w = ops.input((None,) + table_shape[1:], "float64", name="w")
    loss = ops.sum(ops.lookup(table, idx) * w)
    values = {"table": rng.standard_normal(table_shape)}
    feeds = {idx: np.asarray(idx_value), w: rng.standard_normal((len(idx_value),) + table_shape[1:])}
    return table, idx, w, loss, values, feeds


def test_lookup_gradient_is_row_sparse_at_run_time():
    table, idx, w, loss, params, feeds = _table_case([4, 1, 4])
    (gt,) = grad(loss, [table])
    assert ops.is_row_sparse(gt)
    # nothing in the backward graph holds a dense table-shaped value
    for n in Graph([gt]).nodes:
        if n.shape == table.shape and n.op != "param":
            assert ops.is_row_sparse(n), f"{n.label()} would be a dense table-sized array"
    value = Executor([gt]).run(feeds, params)[0]
    assert isinstance(value, RowSparse)
    assert value.shape == (6, 3)
    assert len(value.indices) == 3  # one row per looked-up index: no dense table was built
    expected = R.lookup_grad(feeds[w], feeds[idx], params["table"])
    np.testing.assert_allclose(dense_of(value), expected, rtol=0, atol=1e-15)
    check_grads(loss, [table], feeds, params)


def test_lookup_gradient_accumulates_repeated_indices():
    table, idx, w, loss, params, feeds = _table_case([2, 2, 0, 2])
    value = Executor(grad(loss, [table])).run(feeds, params)[0]
    dense = dense_of(value)
    gw = feeds[w]
    np.testing.assert_allclose(dense[2], gw[0] + gw[1] + gw[3], rtol=1e-15, atol=0)
    np.testing.assert_allclose(dense[0], gw[2], rtol=1e-15, atol=0)
    assert not dense[[1, 3, 4, 5]].any()
    check_grads(loss, [table], feeds, params)


def test_two_lookups_of_one_table_stay_sparse():
    table = ops.param_node("table", (5, 2), "float64")
    i = ops.input((None,), "int64", name="i")
    j = ops.input((None,), "int64", name="j")
    loss = ops.sum(ops.tanh(ops.lookup(table, i))) + ops.sum(ops.square(ops.lookup(table, j)))
    (gt,) = grad(loss, [table])
    assert gt.op == "accum" and ops.is_row_sparse(gt)
    params = {"table": np.random.default_rng(1).standard_normal((5, 2))}
    feeds = {i: np.array([0, 3, 3]), j: np.array([3, 4])}
    value = Executor([gt]).run(feeds, params)[0]
    assert isinstance(value, RowSparse)
    t = params["table"]
    expected = np.zeros((5, 2))
    for k in feeds[i]:
        expected[k] += 1 - np.tanh(t[k]) ** 2
    for k in feeds[j]:
        expected[k] += 2 * t[k]
    np.testing.assert_allclose(dense_of(value), expected, rtol=1e-14, atol=0)
    check_grads(loss, [table], feeds, params)


def test_sparse_plus_dense_gradient_is_dense():
    """A table both looked up and used densely (a weight penalty): the accumulated gradient is dense."""
    table = ops.param_node("table", (4, 3), "float64")
    idx = ops.input((None,), "int64", name="idx")
    loss = ops.sum(ops.sigmoid(ops.lookup(table, idx))) + ops.sum(ops.square(table)) * 0.5
    (gt,) = grad(loss, [table])
    assert not ops.is_row_sparse(gt)
    params = {"table": np.random.default_rng(2).standard_normal((4, 3))}
    feeds = {idx: np.array([1, 1, 3])}
    value = Executor([gt]).run(feeds, params)[0]
    assert isinstance(value, np.ndarray) and value.shape == (4, 3)
    t = params["table"]
    s = R.sigmoid(t)
    expected = t.copy()
    expected[1] += 2 * s[1] * (1 - s[1])
    expected[3] += s[3] * (1 - s[3])
    np.testing.assert_allclose(value, expected, rtol=1e-13, atol=0)
    check_grads(loss, [table], feeds, params)


def test_lookup_of_a_computed_table_densifies_before_the_next_rule():
    w = ops.param_node("w", (4, 2), "float64")
    idx = ops.input((None,), "int64", name="idx")
    table = ops.tanh(w) * 3.0
    loss = ops.sum(ops.square(ops.lookup(table, idx)))
    params = {"w": np.random.default_rng(3).standard_normal((4, 2))}
    feeds = {idx: np.array([0, 2, 2, 1])}
    (gw,) = grad(loss, [w])
    assert isinstance(Executor([gw]).run(feeds, params)[0], np.ndarray)
    check_grads(loss, [w], feeds, params)


def test_lookup_index_out_of_range_raises_feed_error():
    table = ops.param_node("table", (3, 2))
    idx = ops.input((None,), "int64", name="idx")
    with pytest.raises(FeedError, match="lookup: index 3 out of range"):
        run(ops.lookup(table, idx), {idx: np.array([0, 3])}, {"table": np.zeros((3, 2), np.float32)})


def test_cross_entropy_label_out_of_range_raises_feed_error():
    logits = ops.input((None, 3), name="logits")
    labels = ops.input((None,), "int64", name="labels")
    with pytest.raises(FeedError, match="softmax_cross_entropy: label -1"):
        run(ops.softmax_cross_entropy(logits, labels),
            {logits: np.zeros((2, 3), np.float32), labels: np.array([0, -1])})


# --- dropout: masks are a pure function of (seed, step, site, row key, column) -------------------------

def _dropout_graph(cols, p, site=3):
    x = ops.input((None, cols), "float64", name="x")
    return x, ops.dropout(x, p, site=site)


def test_dropout_batch_equals_rows_alone_with_their_keys():
    x, y = _dropout_graph(7, 0.5)
    ex = Executor([y])
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((5, 7))
    keys = np.array([17, 3, 2 ** 40 + 5, 0, 99], dtype=np.uint64)
    batched = ex.run({x: xv}, ctx=RunContext(seed=4, step=9, row_keys=keys))[0]
    for r in range(5):
        alone = ex.run({x: xv[r:r + 1]}, ctx=RunContext(seed=4, step=9, row_keys=keys[r:r + 1]))[0]
        np.testing.assert_array_equal(alone[0], batched[r])
    # and a permuted batch with permuted keys gives the permuted result
    perm = np.array([3, 0, 4, 1, 2])
    shuffled = ex.run({x: xv[perm]}, ctx=RunContext(seed=4, step=9, row_keys=keys[perm]))[0]
    np.testing.assert_array_equal(shuffled, batched[perm])
    np.testing.assert_array_equal(
        batched, R.dropout(xv, 0.5, 3, seed=4, step=9, row_keys=keys))


def _mask(seed=0, step=0, site=3, keys=None, shape=(8, 64), p=0.5):
    x, y = _dropout_graph(shape[1], p, site)
    out = run(y, {x: np.ones(shape)}, ctx=RunContext(seed=seed, step=step, row_keys=keys))
    return out != 0


def test_dropout_masks_change_with_seed_step_site_and_row_key():
    base = _mask()
    assert 0.3 < base.mean() < 0.7
    for other in (_mask(seed=1), _mask(step=1), _mask(site=4), _mask(keys=np.arange(8, dtype=np.uint64) + 8)):
        assert (other != base).mean() > 0.3  # independent masks differ in about half the places
    np.testing.assert_array_equal(_mask(), base)  # and the same words give the same mask


def test_dropout_identity_when_p_is_zero_or_not_training():
    x = ops.input((None, 5), "float64", name="x")
    xv = np.random.default_rng(1).standard_normal((4, 5))
    np.testing.assert_array_equal(run(ops.dropout(x, 0.0), {x: xv}, ctx=RunContext(seed=3)), xv)
    np.testing.assert_array_equal(run(ops.dropout(x, 0.7), {x: xv}, ctx=RunContext(training=False)), xv)
    # and the gradient is the identity too
    (gx,) = grad(ops.sum(ops.dropout(x, 0.7) * 2.0), [x])
    np.testing.assert_array_equal(run(gx, {x: xv}, ctx=RunContext(training=False)), np.full((4, 5), 2.0))


@pytest.mark.parametrize("p", [0.1, 0.3, 0.75])
def test_dropout_keep_fraction_is_near_one_minus_p(p):
    x, y = _dropout_graph(1000, p)
    out = run(y, {x: np.ones((100, 1000))}, ctx=RunContext(seed=7, step=2))
    kept = out != 0
    # 1e5 Bernoulli draws: the standard deviation of the fraction is below 0.0016
    assert abs(kept.mean() - (1 - p)) < 0.01
    np.testing.assert_allclose(out[kept], 1.0 / (1.0 - p), rtol=1e-15)
    # and no column or row pattern: each column's keep rate is also near 1 - p
    assert abs(kept.mean(axis=0).mean() - (1 - p)) < 0.01 and kept.mean(axis=0).std() < 0.1


def test_dropout_row_key_count_must_match_rows():
    x, y = _dropout_graph(3, 0.5)
    with pytest.raises(FeedError, match="row keys"):
        run(y, {x: np.ones((4, 3))}, ctx=RunContext(row_keys=np.arange(3, dtype=np.uint64)))


def test_dropout_rejects_p_out_of_range():
    x = ops.input((None, 3), name="x")
    for p in (-0.1, 1.0):
        with pytest.raises(ShapeError, match="dropout"):
            ops.dropout(x, p)


def test_reference_hash_twins_agree():
    """The vectorised reference hash equals the docstring formula in plain Python integers."""
    words = [(0, 0, 0, 0, 0), (1, 2, 3, 4, 5), (2 ** 63, 7, 1, 2 ** 40 + 3, 1023)]
    for w in words:
        assert R.hash_uniform(*w).item() == R.hash_uniform_int(*w)


@pytest.mark.parametrize("shape, transpose", [((0, 5), False), ((), False), ((3,), False), ((4, 2, 3), False),
                                              ((6, 4), True)])
def test_dropout_kernel_path_handles_any_shape_and_layout(shape, transpose):
    """The compiled dropout (x times the kernel's mask) equals x times the numpy reference mask for empty,
    0-d, 1-d, 3-d and transposed (non-contiguous) values."""
    from minicavs.ops.nn import _dropout_impl, dropout_mask
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    x = x.T if transpose else x
    ctx = RunContext(seed=1, step=2)
    got = _dropout_impl(np, x, 0.5, 3, ctx)
    assert got.shape == x.shape and np.array_equal(got, x * dropout_mask(x.shape, 0.5, 3, ctx, x.dtype))
