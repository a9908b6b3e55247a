"""Table-driven checks of the sources ops (see tests/ops/specs.py): forward vs tests/reference.py, gradients
vs finite differences."""
import pytest

from .specs import (check_backward_types, check_expr, check_forward, check_gradient, expr_params,
                    params_for)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("sources"))
def test_forward_matches_reference(spec, case, dtype, rows):
    check_forward(spec, case, dtype, rows)


@pytest.mark.parametrize("spec,case", params_for("sources", gradient=True))
def test_gradient_matches_finite_differences(spec, case):
    check_gradient(spec, case)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("sources", gradient=True))
def test_backward_values_have_declared_types(spec, case, dtype, rows):
    check_backward_types(spec, case, dtype, rows)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", expr_params("sources"))
def test_fusion_expr_matches_reference(spec, case, dtype, rows):
    check_expr(spec, case, dtype, rows)
