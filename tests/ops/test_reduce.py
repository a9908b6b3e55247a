"""Table-driven checks of the reduce ops (see tests/ops/specs.py): forward vs tests/reference.py, gradients
vs finite differences."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import minicavs.ops as ops
import minicavs.ops.reduce as reduce_ops

from .specs import SPECS, Arg, Case, check_backward_types, check_forward, check_gradient, params_for


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("reduce"))
def test_forward_matches_reference(spec, case, dtype, rows):
    check_forward(spec, case, dtype, rows)


@pytest.mark.parametrize("spec,case", params_for("reduce", gradient=True))
def test_gradient_matches_finite_differences(spec, case):
    check_gradient(spec, case)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("reduce", gradient=True))
def test_backward_values_have_declared_types(spec, case, dtype, rows):
    check_backward_types(spec, case, dtype, rows)


@settings(deadline=None, max_examples=40)
@given(data=st.data(), name=st.sampled_from(["sum", "mean"]))
def test_random_axes(data, name):
    """Any shape (maybe with a row axis), any set of axes written with either sign, keepdims or not."""
    shape = data.draw(array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=3), label="shape")
    rows = shape[0]
    if data.draw(st.booleans(), label="row axis"):
        shape = (None,) + tuple(shape[1:])
    nd = len(shape)
    chosen = data.draw(st.lists(st.integers(0, nd - 1), unique=True, max_size=nd), label="axes")
    axes = tuple(a - nd if data.draw(st.booleans()) else a for a in chosen)
    axis = None if not axes and data.draw(st.booleans()) else axes
    keep = data.draw(st.booleans(), label="keepdims")
    fn = getattr(ops, name)
    case = Case("random", (Arg(shape),), lambda x: fn(x, axis=axis, keepdims=keep),
                kwargs={"axes": axis, "keepdims": keep})
    for dtype in ("float32", "float64"):
        check_forward(SPECS[name], case, dtype, rows)
    check_gradient(SPECS[name], case, rows)


@settings(deadline=None, max_examples=40)
@given(data=st.data())
def test_random_sum_to(data):
    """sum_to undoes any numpy broadcast: drop some leading axes, squash some others to 1."""
    shape = data.draw(array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=3), label="shape")
    lead = data.draw(st.integers(0, len(shape)), label="dropped")
    target = tuple(1 if data.draw(st.booleans()) else d for d in shape[lead:])
    if target == tuple(shape):
        target = target[1:]
    case = Case("random", (Arg(tuple(shape)),), lambda x: ops.sum_to(x, target), kwargs={"shape": target})
    for dtype in ("float32", "float64"):
        check_forward(SPECS["sum_to"], case, dtype, 3)
    check_gradient(SPECS["sum_to"], case)


def test_broadcast_like_of_a_scalar_is_a_read_only_view_equal_to_numpys():
    """The zero-stride fast path (a full sum's gradient) gives np.broadcast_to's value, shape, dtype and
    read-only view; other gradients take np.broadcast_to itself."""
    from minicavs.ops.reduce import _broadcast_like
    for g in (np.asarray(np.float32(2.5)), np.float64(-1.5)):   # a 0-d array, a numpy scalar
        for shape, axes in (((37,), (0,)), ((0,), (0,)), ((3, 4), (0, 1)), ((), ())):
            out = _broadcast_like(np, g, shape, axes, False)
            want = np.broadcast_to(g, shape)
            assert type(out) is np.ndarray and out.shape == want.shape and out.dtype == want.dtype
            assert np.array_equal(out, want) and not out.flags.writeable
    rows = np.arange(3, dtype=np.float64)
    assert np.array_equal(_broadcast_like(np, rows, (4, 3), (0,), False), np.broadcast_to(rows, (4, 3)))


@pytest.mark.parametrize("spec,case", [p for p in params_for("reduce", gradient=True) if p.values[0].name == "sum"])
def test_column_sums_by_gemv_match_reference_and_differences(spec, case, monkeypatch):
    """The sum table with every float matrix summed over its rows through ``ones @ x`` (BLAS's gemv), the
    path of 64k+ elements: forced here for every size."""
    monkeypatch.setattr(reduce_ops, "GEMV_ELEMENTS", 1)
    for dtype in ("float32", "float64"):
        for rows in (3, 1):
            check_forward(spec, case, dtype, rows)
    check_gradient(spec, case)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("keepdims", [False, True])
def test_large_column_sums_equal_numpy(dtype, keepdims):
    x = np.random.default_rng(3).standard_normal((700, 101)).astype(dtype)   # past GEMV_ELEMENTS
    assert x.size >= reduce_ops.GEMV_ELEMENTS
    got = reduce_ops._sum_impl(np, x, (0,), keepdims)
    want = x.astype(np.float64).sum(0, keepdims=keepdims)
    assert got.dtype == x.dtype and got.shape == want.shape
    assert np.abs(got - want).max() <= (1e-4 if dtype == "float32" else 1e-11)
    for other in (x[:, ::2], x.astype(np.int64)):   # strided or integer: numpy's own sum
        assert np.array_equal(reduce_ops._sum_impl(np, other, (0,), keepdims), other.sum(0, keepdims=keepdims))
