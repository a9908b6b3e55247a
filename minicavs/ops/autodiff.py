"""Reverse-mode autodiff over the IR: gradients are built as ordinary nodes, so a backward graph can be
analysed, fused and executed like any other graph."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

from ..core.errors import ShapeError
from ..ir.graph import Graph, Node, _rows_implicit, fmt_shape
from .elementwise import accum
from .nn import densify, is_row_sparse
from .registry import OPS
from .sources import ones_like, zeros_like


def _merge_gradients(gs: list[Node], made: dict | None = None) -> list[Node]:
    """The gradients summed into one value, with those of ops that know how to merge theirs
    (``OpDef.merge_gradients``: split parts into one concat) merged. ``made``: the merged nodes made so far
    in this gradient, by (op, inputs, attrs): the same merge of the same parts is the same node, so two
    values split the same way (the column blocks of two merged GEMMs, gate by gate) share one gradient
    concat (one stored value, no copy into a second)."""
    kept, mergeable = [], {}
    for g in gs:
        if OPS[g.op].merge_gradients is None:
            kept.append(g)
        else:
            mergeable.setdefault(g.op, []).append(g)
    merged = [m for op, group in mergeable.items() for m in OPS[op].merge_gradients(group)]
    if made is not None:
        merged = [made.setdefault((m.op, m.inputs, repr(sorted(m.attrs.items()))), m) for m in merged]
    return kept + merged


@contextlib.contextmanager
def _explicit_rows():
    token = _rows_implicit.set(False)  # gradient rules speak in stored axes
    try:
        yield
    finally:
        _rows_implicit.reset(token)


# the nodes the gradient being taken now flows through (a vjp rule asks: needs_gradient)
_needed: contextvars.ContextVar[set | None] = contextvars.ContextVar("needed", default=None)


def needs_gradient(x: Node) -> bool:
    """Does the gradient being taken now need ``x``'s (a vjp rule may skip the work of one it does not)? True
    outside a gradient."""
    needed = _needed.get()
    return needed is None or x in needed


def grad(outputs: Node | Sequence[Node], wrt: Sequence[Node],
         cotangents: Sequence[Node] | None = None, zeros: bool = True) -> list[Node | None]:
    """Gradient nodes of ``sum_i <outputs[i], cotangents[i]>`` with respect to each node of ``wrt``.

    Without cotangents every output must be a scalar (a loss) and is seeded with one. Fan-out is summed
    with one ``accum`` node; the gradient of a lookup table stays row-sparse. A ``wrt`` node that the outputs
    do not depend on gets ``zeros_like`` (or None with ``zeros=False``); integer nodes cannot be in ``wrt``.
    """
    outputs = [outputs] if isinstance(outputs, Node) else list(outputs)
    wrt = list(wrt)
    for w in wrt:
        if not w.dtype.is_float:
            raise TypeError(f"cannot differentiate with respect to {w.label()}: dtype {w.dtype.name} is not float")
    with _explicit_rows():
        if cotangents is None:
            for o in outputs:
                if o.shape != ():
                    raise ShapeError(f"grad: output {o.label()} has shape {fmt_shape(o.shape)}; "
                                     "give cotangents for non-scalar outputs")
            cotangents = [ones_like(o) for o in outputs]
        if len(cotangents) != len(outputs):
            raise ValueError(f"grad: {len(outputs)} outputs but {len(cotangents)} cotangents")
        for o, c in zip(outputs, cotangents):
            if c.shape != o.shape or c.dtype != o.dtype:
                raise ShapeError(f"grad: cotangent {c.dtype.name}{fmt_shape(c.shape)} does not match output "
                                 f"{o.label()} {o.dtype.name}{fmt_shape(o.shape)}")
        graph = Graph(outputs)
        wanted = set(wrt)
        needed = set()  # nodes that depend on some wrt node: only they carry gradients
        for n in graph.nodes:
            if n in wanted or any(x in needed for x in n.inputs):
                needed.add(n)
        token = _needed.set(needed)
        try:
            return _reverse(graph, outputs, cotangents, wanted, needed, wrt, zeros)
        finally:
            _needed.reset(token)


def _reverse(graph: Graph, outputs: list, cotangents: list, wanted: set, needed: set, wrt: list,
             zeros: bool) -> list:
    """The reverse pass of :func:`grad` over ``graph``: each needed node's vjp, in reverse creation order."""
    pending: dict[Node, list[Node]] = {}
    for o, c in zip(outputs, cotangents):
        pending.setdefault(o, []).append(c)
    result: dict[Node, Node] = {}
    made: dict = {}
    for n in reversed(graph.nodes):  # reverse creation order is a reverse topological order
        gs = pending.pop(n, None)
        if not gs or n not in needed:
            continue
        g = accum(*_merge_gradients(gs, made))
        if n in wanted:
            result[n] = g
        vjp = OPS[n.op].vjp
        if vjp is None or not n.inputs:
            continue
        in_grads = vjp(densify(g) if is_row_sparse(g) else g, n, *n.inputs, **n.attrs)
        for x, gx in zip(n.inputs, in_grads):
            if gx is None or x not in needed:
                continue
            if gx.shape != x.shape or gx.dtype != x.dtype:  # a wrong rule must fail loudly, here
                raise AssertionError(f"vjp of {n.label()} gave {gx.dtype.name}{fmt_shape(gx.shape)} "
                                     f"for input {x.label()} {x.dtype.name}{fmt_shape(x.shape)}")
            pending.setdefault(x, []).append(gx)
    return [result.get(w, zeros_like(w) if zeros else None) for w in wrt]
