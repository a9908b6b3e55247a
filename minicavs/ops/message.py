"""The four message ops of a vertex function (§3.1) as IR nodes.

``gather`` and ``pull`` are leaves whose rows the engine supplies (taken from children's scattered rows, or
from an external buffer); ``scatter`` and ``push`` are identities that mark F's outputs. Their gradients are
the engine's business: gather's adjoint is a row scatter-add into the children's gradient rows, pull's
flows out to the static graph that produced the pull buffer.
"""
from __future__ import annotations

from ..graph import Node
from .registry import OpDef, make_node, register
from .sources import _declared, _no_impl

register(OpDef("gather", infer=lambda k, shape, dtype: _declared(shape, dtype), impl=_no_impl, vjp=None))
register(OpDef("pull", infer=lambda shape, dtype: _declared(shape, dtype), impl=_no_impl, vjp=None))
register(OpDef("scatter", infer=lambda x: (x.shape, x.dtype), impl=lambda xp, x: x,
               vjp=lambda g, y, x: (g,)))
register(OpDef("push", infer=lambda x: (x.shape, x.dtype), impl=lambda xp, x: x,
               vjp=lambda g, y, x: (g,)))


def gather_node(k: int, shape: tuple, dtype) -> Node:
    return make_node("gather", (), {"k": int(k), "shape": (None,) + tuple(shape), "dtype": dtype},
                     name=f"gather{k}")


def pull_node(name: str, shape: tuple, dtype) -> Node:
    return make_node("pull", (), {"shape": (None,) + tuple(shape), "dtype": dtype}, name=name)


def scatter_node(x: Node) -> Node:
    return make_node("scatter", (x,), name="scatter")


def push_node(x: Node, name: str) -> Node:
    return make_node("push", (x,), name=name)
