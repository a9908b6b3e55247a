"""Table-driven checks of the elementwise ops (see tests/ops/specs.py): forward vs tests/reference.py, gradients
vs finite differences."""
import numpy as np
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


# --- where: what its docstring promises about gradients -----------------------------------------------

def _where_setup():
    import numpy as np
    p = ops.input((None, 4), "float64", name="p")
    a = ops.input((None, 4), "float64", name="a")
    b = ops.input((None, 4), "float64", name="b")
    mask = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    return p, a, b, mask


def test_where_gives_the_unselected_side_an_exact_zero_even_for_a_nan_cotangent():
    import numpy as np
    from minicavs.ops.autodiff import grad
    from minicavs.engine.executor import run
    p, a, b, mask = _where_setup()
    g = ops.input((None, 4), "float64", name="g")
    ga, gb = grad(ops.where(p, a, b), [a, b], cotangents=[g])
    cot = np.where(mask > 0, 2.0, np.nan)   # NaN exactly where a is not chosen
    got_a, got_b = run([ga, gb], {p: mask, a: np.ones((2, 4)), b: np.ones((2, 4)), g: cot})
    assert np.array_equal(got_a, np.where(mask > 0, 2.0, 0.0))
    assert np.isnan(got_b[mask <= 0]).all() and np.array_equal(got_b[mask > 0], np.zeros(int((mask > 0).sum())))


@pytest.mark.parametrize("fusion", [False, True])
def test_where_safe_pattern_keeps_sqrt_at_zero_out_of_the_gradient(fusion):
    """The docstring's pattern (choose the input first) gives finite gradients where x is 0; the naive one
    gives NaN there, the caveat it documents. Both through the unfused ops and a generated kernel."""
    import numpy as np
    from minicavs.ops.autodiff import grad
    from minicavs.engine.executor import run
    x = ops.input((None, 4), "float64", name="x")
    ok = ops.ge(x, 1e-3)
    safe = ops.where(ok, ops.sqrt(ops.where(ok, x, 1.0)), 0.0)
    naive = ops.where(ok, ops.sqrt(x), ops.zeros_like(x))
    xv = np.array([[0.0, 4.0, 0.0, 0.25], [9.0, 0.0, 1.0, 0.0]])
    (g_safe,) = grad(ops.sum(safe), [x])
    (g_naive,) = grad(ops.sum(naive), [x])
    if fusion:
        from minicavs.ir.graph import Graph
        from minicavs.engine.passes.fusion import fuse
        from minicavs.cpu import compiler as ccomp
        env = {x: xv}
        for grp in fuse(list(Graph([g_safe]).nodes), [g_safe]):
            missing = [i for i in grp.inputs if i not in env]
            for node, val in zip(missing, run(missing, env)):
                env[node] = val
            env[grp.output] = ccomp.build(grp)([env[i] for i in grp.inputs])
        got = env[g_safe]
    else:
        got = run(g_safe, {x: xv})
    want = np.where(xv > 0, 0.5 / np.sqrt(np.where(xv > 0, xv, 1.0)), 0.0)
    assert np.max(np.abs(got - want)) <= 1e-12
    with np.errstate(invalid="ignore", divide="ignore"):
        assert np.isnan(run(g_naive, {x: xv})[xv == 0]).all()


PREDICATES = np.array([np.nan, 0.0, -0.0, -1.0, 2.0, np.inf, -np.inf, -1e-30])
CHOSEN_A = np.array([True, False, False, True, True, True, True, True])   # any nonzero value, NaN included


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_where_takes_any_nonzero_predicate_as_true_nan_included(dtype):
    """As numpy's where and C's ``static_cast<bool>`` read a value: -1, NaN and inf choose ``a``, 0 and -0
    choose ``b``; on the registry's impl, the fusion expr's numpy oracle and a generated C kernel."""
    from minicavs.cpu import compiler as ccomp
    from minicavs.engine.executor import run
    from minicavs.engine.passes.fusion import fuse
    from minicavs.ir.graph import Graph
    p, a, b = (ops.input((None, 8), dtype, name=n) for n in "pab")
    out = ops.where(p, a, b) * 1.0
    pv = PREDICATES.astype(dtype).reshape(1, 8)
    av, bv = np.full((1, 8), 3.0, dtype), np.full((1, 8), -5.0, dtype)
    want = np.where(CHOSEN_A, 3.0, -5.0).reshape(1, 8)
    assert np.array_equal(run(out, {p: pv, a: av, b: bv}), want)
    (group,) = fuse(list(Graph([out]).nodes), [out])
    values = {p: pv, a: av, b: bv}
    assert np.array_equal(np.broadcast_to(group.evaluate([values[i] for i in group.inputs]), (1, 8)), want)
    kernel = ccomp.build(group)
    if kernel is None:
        pytest.skip("no C compiler")
    assert np.array_equal(kernel([values[i] for i in group.inputs]), want)


def test_where_refuses_a_predicate_of_another_dtype():
    from minicavs.core.errors import ShapeError
    x = ops.input((None, 3), "float32", name="x")
    flag = ops.input((None, 3), "int64", name="flag")
    with pytest.raises(ShapeError, match=r"where: the predicate is int64.*float32.*ge\(x, y\)"):
        ops.where(flag, x, x)


def test_where_in_a_vertex_function_runs_fused_on_the_native_executor():
    """F with a per-vertex where (a select in its fused kernel): the C runner lowers it (no fallback)
    and equals the reference runner, loss and gradients."""
    import numpy as np
    from minicavs.engine.compile import EngineOptions
    from minicavs.runtime.inputs import InputGraph
    from minicavs.engine.model import Model, Structure
    from minicavs.runtime.vertex import VertexFunction
    from minicavs.cpu import CPU
    if CPU.runner_missing(np.float64) is not None:
        pytest.skip("no C compiler or BLAS: the C runner cannot run here")
    W = ops.param_node("W", (2, 3), "float64")
    F = VertexFunction("v", arity=1, message=(3,), dtype="float64")
    with F:
        z = F.pull((2,)) @ W + F.gather(0)
        positive = ops.step(z)
        h = ops.where(positive, ops.tanh(z), ops.sqrt(ops.where(positive, 1.0, ops.neg(z))) * 0.5)
        F.scatter(h)
        F.push(h)
    s = Structure(F, pulls={"x": ops.input((None, 2), "float64", name="xs")})
    model = Model(s, loss=ops.sum(ops.square(s.pushed("h"))))
    rng = np.random.default_rng(3)
    graphs = [InputGraph.chain(n) for n in (4, 2)]
    feeds, vals = {"xs": rng.standard_normal((6, 2))}, {"W": rng.standard_normal((2, 3))}
    reference = model.forward_backward(graphs, feeds, vals, options=EngineOptions(runner="reference"))
    native = model.forward_backward(graphs, feeds, vals, options=EngineOptions(runner="device"))
    for state in native.states.values():
        for program in (state.program, state.backward_program):
            assert program.runner == "C runner" and program.declined is None, program.declined
            assert "APPLY" not in program.dump()
    assert abs(native.loss - reference.loss) <= 1e-10 * max(1.0, abs(reference.loss))
    scale = max(1.0, float(np.max(np.abs(reference.grads["W"]))))
    assert np.max(np.abs(native.grads["W"] - reference.grads["W"])) <= 1e-10 * scale
