"""Declaring vertex functions: the four message APIs and the errors raised at declaration."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import ops
from minicavs.errors import ShapeError
from minicavs.model import Model, Structure
from minicavs.vertex import VertexFunction


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
