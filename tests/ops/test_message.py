"""Table-driven checks of the message ops (see tests/ops/specs.py): forward vs tests/reference.py, gradients
vs finite differences; row indices as slices where they are consecutive."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.ops.message import as_slice

from .specs import check_backward_types, check_forward, check_gradient, params_for


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("message"))
def test_forward_matches_reference(spec, case, dtype, rows):
    check_forward(spec, case, dtype, rows)


@pytest.mark.parametrize("spec,case", params_for("message", gradient=True))
def test_gradient_matches_finite_differences(spec, case):
    check_gradient(spec, case)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("message", gradient=True))
def test_backward_values_have_declared_types(spec, case, dtype, rows):
    check_backward_types(spec, case, dtype, rows)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.integers(0, 12), max_size=8), dtype=st.sampled_from(["int64", "int32", "intp"]),
       step=st.sampled_from([1, 2]))
def test_rows_are_a_slice_exactly_when_consecutive(rows, dtype, step):
    """as_slice (which the native blocks' scatter rows and the regathered concat rely on: the C runner writes
    rows first..first + n - 1) against the plain definition, for any rows, also a strided view's."""
    a = np.repeat(np.array(rows, dtype), step)[::step]
    got = as_slice(a)
    if len(rows) and all(r == rows[0] + i for i, r in enumerate(rows)):
        assert got == slice(rows[0], rows[0] + len(rows))
    else:
        assert got is a


def test_rows_out_of_order_or_with_a_gap_stay_an_index():
    for rows in ([3, 5, 4, 6], [6, 5, 4, 3], [0, 2], [2, 3, 3, 5], [1, 1, 2]):
        a = np.array(rows, np.int64)
        assert as_slice(a) is a
    assert as_slice(np.array([7, 8, 9], np.int64)) == slice(7, 10)
