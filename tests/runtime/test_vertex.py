"""Declaring vertex functions: the four message APIs and the errors raised at declaration."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import ops
from minicavs.core.errors import ShapeError
from minicavs.engine.model import Model, Structure
from minicavs.runtime.vertex import VertexFunction


def test_per_vertex_shapes_exclude_the_vertex_axis():
    W = ops.param_node("W", (4, 6))
    F = VertexFunction("cell", arity=2, message=(6,))
    with F:
        x = F.pull((4,))
        h = ops.tanh(ops.linear(x, W, ops.param_node("b", (6,)))) + F.gather(1)
        s = ops.sum(h, axis=0)               # axis 0 of the per-vertex shape (6,), not the vertex axis
        F.scatter(h)
        F.push(ops.reshape(s, (1,)))
    assert x.vshape == (4,) and h.vshape == (6,) and s.vshape == ()
    assert x.shape == (None, 4)              # the IR keeps the vertex axis, leading and unknown
    assert {n.op for n in F.graph} >= {"gather", "pull", "scatter", "push", "linear"}
    assert "gather" in F.dump() and "arity 2" in F.dump()


def test_gather_beyond_arity():
    F = VertexFunction("f", arity=2, message=(3,))
    with pytest.raises(ShapeError, match=r"gather\(2\) beyond the declared arity 2"):
        with F:
            F.gather(2)


def test_scatter_twice():
    F = VertexFunction("f", arity=1, message=(3,))
    with pytest.raises(ShapeError, match="scatter called twice"):
        with F:
            g = F.gather(0)
            F.scatter(g)
            F.scatter(ops.tanh(g))


def test_scatter_shape_must_match_gather():
    F = VertexFunction("f", arity=1, message=(3,))
    with pytest.raises(ShapeError, match=r"scatter of shape \(4,\).*message shape \(3,\)"):
        with F:
            F.scatter(ops.concat([F.gather(0), F.pull((1,))]))


def test_kinds_must_agree_on_the_message():
    leaf = VertexFunction("leaf", message=(3,))
    with leaf:
        leaf.scatter(ops.tanh(leaf.pull((3,))))
    internal = VertexFunction("internal", arity=2, message=(4,))
    with internal:
        internal.scatter(ops.slice_(ops.concat([internal.gather(0), internal.gather(1)]), 0, 4))
    x = ops.input((None, 3), name="x")
    with pytest.raises(ShapeError, match=r"gather\(0\) of 'internal' reads \(4,\) but 'leaf' scatters \(3,\); "
                                         r"name the kinds it reads"):
        Structure({"leaf": leaf, "internal": internal}, pulls={"x": x})


def test_pull_source_must_match():
    F = VertexFunction("f", message=(3,))
    with F:
        F.scatter(ops.tanh(F.pull((3,))))
    with pytest.raises(ShapeError, match="pull 'x'"):
        Structure(F, pulls={"x": ops.input((None, 2), name="x")})
    with pytest.raises(ShapeError, match="no static node produces it"):
        Structure(F)


def test_function_with_no_output_and_scalar_loss():
    F = VertexFunction("f")
    with pytest.raises(ShapeError, match="neither scatters nor pushes"):
        with F:
            F.pull((2,))
    G = VertexFunction("g", message=(2,))
    with G:
        G.push(ops.tanh(G.pull((2,))))
    s = Structure(G, pulls={"x": ops.input((None, 2), name="x")})
    with pytest.raises(ShapeError, match="loss must be a scalar"):
        Model(s, loss=s.pushed("h"))


def test_scatter_of_a_parameter_is_rejected():
    F = VertexFunction("f", message=(3,))
    with pytest.raises(ShapeError, match="does not depend on the vertex"):
        with F:
            F.scatter(ops.param_node("b", (3,)))


def test_axis_inside_vertex_function_indexes_per_vertex_shape():
    F = VertexFunction("f", message=(2,))
    with F:
        x = F.pull((2, 3))
        assert ops.sum(x, axis=1).vshape == (2,)
        assert ops.sum(x, axis=-1).shape == (None, 2)
        assert ops.transpose(x).vshape == (3, 2)
        with pytest.raises(ShapeError, match="out of range"):
            ops.sum(x, axis=2)
        F.scatter(ops.sum(x, axis=1))
    assert np.prod(F.message) == 2


# --- arity: a sweep up to the largest supported, and a clear refusal beyond it ---------------------------------

def _wide_model(arity: int, form: str, H: int = 3):
    """One kind whose vertices add up what their children scattered, as a chain of ``+`` or one ``ops.accum``:
    h = tanh(x·W + Σ_j gather(j)); the loss sums every vertex's h."""
    from minicavs.runtime.vertex import VertexFunction
    F = VertexFunction("wide", arity=arity, message=(H,), dtype="float64")
    W = ops.param_node("W", (H, H), "float64")
    with F:
        gathers = [F.gather(j) for j in range(arity)]
        if form == "sum":
            total = gathers[0]
            for g in gathers[1:]:
                total = total + g
        else:
            total = ops.accum(*gathers)
        h = ops.tanh(ops.matmul(F.pull((H,), "x"), W) + total)
        F.scatter(h)
        F.push(h)
    s = Structure(F, pulls={"x": ops.input((None, H), "float64", name="xs")})
    return Model(s, loss=ops.sum(s.pushed("h")))


def _wide_graph(arity: int):
    """A root with ``arity`` children, its first child with ``arity`` children of its own (leaves)."""
    from minicavs.runtime.inputs import InputGraph
    children = [list(range(1, arity + 1)), list(range(arity + 1, 2 * arity + 1))]
    return InputGraph(children + [[] for _ in range(2 * arity - 1)])


def _numpy_loss(graph, xs: np.ndarray, W: np.ndarray) -> float:
    """The loss of _wide_model by numpy, vertex by vertex (children have higher ids than their parents)."""
    h = np.zeros((graph.num_vertices, W.shape[1]))
    for v in reversed(range(graph.num_vertices)):
        h[v] = np.tanh(xs[v] @ W + sum((h[c] for c in graph.children(v)), np.zeros(W.shape[1])))
    return float(h.sum())


ARITIES = [2, 65, 256]   # 65: a sum of more gathers than one kernel takes operands (64)


@pytest.mark.parametrize("form", ["sum", "accum"])
@pytest.mark.parametrize("arity", ARITIES + ["MAX_ARITY"])
def test_arity_sweep_up_to_the_largest_supported_on_every_runner(arity, form):
    """Up to MAX_ARITY, building the model and running it work on both executors, the native one running the
    whole task loop itself (no fallback), and the loss equals numpy's; the gradients of both executors agree."""
    from minicavs.cpu import CPU
    from minicavs.engine.compile import EngineOptions
    from minicavs.runtime.vertex import MAX_ARITY
    from ..engine.test_alg1 import equal
    arity = MAX_ARITY if arity == "MAX_ARITY" else arity
    model = _wide_model(arity, form)
    graph = _wide_graph(arity)
    rng = np.random.default_rng(arity)
    xs, W = rng.standard_normal((graph.num_vertices, 3)) * 0.3, rng.standard_normal((3, 3)) * 0.3
    results = {}
    for runner in ("reference", "device"):
        result = model.forward_backward([graph], {"xs": xs}, {"W": W}, options=EngineOptions(runner=runner))
        equal(result.loss, _numpy_loss(graph, xs, W))
        results[runner] = result
    if CPU.runner_missing(np.float64) is None:
        state = results["device"].states["G"]
        for program in (state.program, state.backward_program):
            assert program.runner == "C runner" and program.declined is None, program.declined
    equal(results["device"].grads["W"], results["reference"].grads["W"])


@pytest.mark.parametrize("runner", ["reference", "device"])
@pytest.mark.parametrize("form", ["sum", "accum"])
def test_wide_gradients_match_finite_differences(form, runner):
    """At arity 65 (its sum split over two kernels), the gradient agrees with finite differences."""
    from minicavs.engine.compile import EngineOptions
    from minicavs.train.testing import check_model_grads
    model = _wide_model(65, form)
    model.options = EngineOptions(runner=runner)
    graph = _wide_graph(65)
    rng = np.random.default_rng(1)
    check_model_grads(model, [graph], {"xs": rng.standard_normal((graph.num_vertices, 3)) * 0.3},
                      {"W": rng.standard_normal((3, 3)) * 0.3})


def test_arity_beyond_the_largest_supported_is_refused_at_declaration():
    from minicavs.runtime.vertex import MAX_ARITY
    VertexFunction("widest", arity=MAX_ARITY, message=(3,))
    with pytest.raises(ShapeError, match=rf"vertex function 'too_wide': arity {MAX_ARITY + 1} is more than "
                                         rf"{MAX_ARITY}, the largest supported"):
        VertexFunction("too_wide", arity=MAX_ARITY + 1, message=(3,))
