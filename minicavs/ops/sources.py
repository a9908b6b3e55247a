"""Leaves of a graph (inputs, parameters, constants) and value-free fills (zeros_like, ones_like)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core.dtypes import as_dtype, float32
from ..core.errors import ShapeError
from ..ir.graph import Node
from .registry import OpDef, make_node, register


def _declared(shape=(), dtype=float32, **_):
    shape = tuple(shape)
    for i, d in enumerate(shape):
        if d is not None and (not isinstance(d, (int, np.integer)) or d < 0):
            raise ShapeError(f"bad dimension {d!r} in shape {shape}")
        if d is None and i != 0:
            raise ShapeError(f"only the leading (row) axis may be None, got shape {shape}")
    return shape, as_dtype(dtype)


def _no_impl(xp, **attrs):
    raise RuntimeError("leaf nodes are supplied by the executor, not computed")


register(OpDef("input", infer=_declared, impl=_no_impl, vjp=None, source=True))
register(OpDef("param", infer=_declared, impl=_no_impl, vjp=None, source=True))
# Constants are not fused (a kernel reads them as inputs), but a scalar one is inlined as a literal.
_ON_DEVICE: dict = {}   # (id(value), device module) -> (value, its device copy)


def _constant(xp, value, dtype):
    """A constant's value on ``xp``'s device: copied over once per constant, not once per run (a constant is
    never written: ops do not modify their inputs)."""
    if xp is np:
        return value
    key = (id(value), xp.__name__)
    hit = _ON_DEVICE.get(key)
    if hit is None or hit[0] is not value:
        hit = _ON_DEVICE[key] = (value, xp.asarray(value))
    return hit[1]


register(OpDef("constant", infer=lambda value, dtype: (value.shape, as_dtype(dtype)),
               impl=_constant, vjp=None,
               expr=lambda value, dtype: value.item() if value.size == 1 else None, fuse=False, source=True,
               literal=lambda n: n.attrs["value"] if n.attrs["value"].size == 1 else None,
               from_shape=lambda xp, n: _constant(xp, **n.attrs)))
register(OpDef("zeros_like", infer=lambda x: (x.shape, x.dtype),
               impl=lambda xp, x: xp.zeros_like(x), vjp=None, expr=lambda x: 0.0, fuse=False,
               native=lambda node: "zero", from_shape=lambda xp, n: xp.zeros(n.shape, n.dtype.np)))
register(OpDef("ones_like", infer=lambda x: (x.shape, x.dtype),
               impl=lambda xp, x: xp.ones_like(x), vjp=None, expr=lambda x: 1.0, fuse=False,
               from_shape=lambda xp, n: xp.ones(n.shape, n.dtype.np)))


def input(shape: Sequence, dtype=float32, name: str | None = None) -> Node:
    """A value fed at run time. ``shape`` may start with None: rows known only at run time."""
    shape, dtype = _declared(shape, dtype)
    return make_node("input", (), {"shape": shape, "dtype": dtype}, name=name)


def param_node(name: str, shape: Sequence, dtype=float32, frozen: bool = False) -> Node:
    """The symbolic handle of a parameter; its value is looked up by ``name`` when the graph runs.
    ``frozen``: a parameter that is not trained (pretrained embeddings kept fixed), so no gradient is
    derived for it (see :func:`trainable`)."""
    attrs = {"shape": tuple(shape), "dtype": as_dtype(dtype)}
    if frozen:   # (only then: the attrs of every other parameter stay what they were)
        attrs["frozen"] = True
    return make_node("param", (), attrs, name=name)


def trainable(node: Node) -> bool:
    """Whether gradients are wanted for ``node``: a float parameter that is not frozen. The model and the
    compiled vertex functions differentiate with respect to these only, so a frozen parameter costs no
    gradient computation (nor does a pull that only a frozen parameter feeds)."""
    return node.op == "param" and node.dtype.is_float and not node.attrs.get("frozen", False)


def constant(value, dtype=None) -> Node:
    """A value baked into the graph (copied, so later changes to ``value`` do not leak in)."""
    arr = np.array(value, dtype=None if dtype is None else as_dtype(dtype).np)
    dt = as_dtype(arr.dtype if dtype is None else dtype)
    return make_node("constant", (), {"value": arr.astype(dt.np), "dtype": dt})


def as_node(x, like: Node) -> Node:
    """Python numbers and arrays become constants of ``like``'s dtype."""
    return x if isinstance(x, Node) else constant(x, like.dtype)


def zeros_like(x: Node) -> Node:
    return make_node("zeros_like", (x,))


def ones_like(x: Node) -> Node:
    return make_node("ones_like", (x,))


__all__ = ["input", "param_node", "trainable", "constant", "as_node", "zeros_like", "ones_like"]
