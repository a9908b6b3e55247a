"""Table-driven checks of the elementwise ops (see tests/ops/specs.py): forward vs tests/reference.py, gradients
vs finite differences."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import minicavs.ops as ops

from .specs import (SPECS, Arg, Case, away, check_backward_types, check_expr, check_forward, check_gradient,
                    expr_params, grid, normal, params_for)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("elementwise"))
def test_forward_matches_reference(spec, case, dtype, rows):
    check_forward(spec, case, dtype, rows)


@pytest.mark.parametrize("spec,case", params_for("elementwise", gradient=True))
def test_gradient_matches_finite_differences(spec, case):
    check_gradient(spec, case)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("elementwise", gradient=True))
def test_backward_values_have_declared_types(spec, case, dtype, rows):
    check_backward_types(spec, case, dtype, rows)


_GENS = {"div": (normal, away(0.5, 2.0)), "maximum": (grid(0), grid(1))}


@settings(deadline=None, max_examples=40)
@given(data=st.data(), name=st.sampled_from(["add", "sub", "mul", "div", "maximum"]))
def test_random_broadcast_shapes(data, name):
    """Any numpy-broadcastable pair (some leading axes declared as the None row axis): forward in both
    dtypes and gradients reduced back to each operand's shape."""
    shapes = data.draw(mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3))
    out = shapes.result_shape
    declared = []
    for s in shapes.input_shapes:
        as_rows = len(s) == len(out) and len(s) > 0 and s[0] == out[0] and data.draw(st.booleans())
        declared.append((None,) + tuple(s[1:]) if as_rows else tuple(s))
    rows = out[0] if any(d and d[0] is None for d in declared) else 3
    ga, gb = _GENS.get(name, (normal, normal))
    case = Case("random", (Arg(declared[0], ga), Arg(declared[1], gb)), getattr(ops, name))
    for dtype in ("float32", "float64"):
        check_forward(SPECS[name], case, dtype, rows)
    check_gradient(SPECS[name], case, rows)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", expr_params("elementwise"))
def test_fusion_expr_matches_reference(spec, case, dtype, rows):
    check_expr(spec, case, dtype, rows)
