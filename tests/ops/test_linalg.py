"""Table-driven checks of the linalg ops (see tests/ops/specs.py): forward vs tests/reference.py, gradients
vs finite differences."""
import importlib

import pytest

from .specs import check_backward_types, check_forward, check_gradient, params_for


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("linalg"))
def test_forward_matches_reference(spec, case, dtype, rows):
    check_forward(spec, case, dtype, rows)


@pytest.mark.parametrize("spec,case", params_for("linalg", gradient=True))
def test_gradient_matches_finite_differences(spec, case):
    check_gradient(spec, case)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("linalg", gradient=True))
def test_backward_values_have_declared_types(spec, case, dtype, rows):
    check_backward_types(spec, case, dtype, rows)


@pytest.mark.parametrize("spec,case", params_for("linalg", gradient=True))
def test_linear_with_the_bias_in_the_blas_call_matches_reference_and_differences(spec, case, monkeypatch):
    """The same table through cpu/library.Library.linear (bias as the GEMM's C operand, beta = 1), which only
    products of 64k+ outputs take: forced here for every size."""
    monkeypatch.setattr(importlib.import_module("minicavs.cpu.library"), "LINEAR_ELEMENTS", 1)
    for dtype in ("float32", "float64"):
        for rows in (3, 1):
            check_forward(spec, case, dtype, rows)
    check_gradient(spec, case)
