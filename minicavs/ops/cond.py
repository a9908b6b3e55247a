"""``cond`` as an operator: only the taken branch runs; its gradient is a ``cond`` of the branches' backward graphs
(or, in a vertex function, the saving cond of cond_grad.py). control.py holds the loops and shares this module's
host read of a predicate and its gradient helper."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..core.arrays import on_device
from ..core.errors import ShapeError
from ..ir.graph import Node, _rows_implicit, fmt_shape
from .autodiff import grad
from .cond_grad import saved_cond_vjp, saving_cond, side_results
from .hoist import hoisted_cond
from .nn import densify, is_row_sparse
from .registry import OpDef, make_node, register
from .sources import zeros_like
from .subgraph import (Subgraph, _as_list, _cotangents, _extend_captures, _is_tuple_node, _merged_captures,
                       _results, _tuple_node, in_body, trace)


def _host_true(pred) -> bool:
    """A predicate's value, read on the host (one device-to-host copy on a device): true when nonzero, NaN
    included (C's and MXNet's ``static_cast<bool>``, NumPy's ``bool``, JAX's ``cond``)."""
    value = pred.get() if on_device(pred) else np.asarray(pred)
    return bool(value.reshape(-1)[0] != 0)


def _dense(g: Node | None) -> Node | None:
    return densify(g) if g is not None and is_row_sparse(g) else g


def _float_grads(outputs: list, cts: list, wrt: list) -> list:
    """Gradients (dense) of ``sum <outputs, cts>`` for the float nodes of ``wrt``, None for the others; an
    output without a cotangent (None) contributes nothing."""
    pairs = [(o, c) for o, c in zip(outputs, cts) if c is not None and o.dtype.is_float]
    want = [w for w in wrt if w.dtype.is_float]
    if not pairs:
        got = [zeros_like(w) for w in want]
    else:
        got = grad([o for o, _ in pairs], want, cotangents=[c for _, c in pairs])
    found = dict(zip(want, got))
    return [_dense(found[w]) if w in found else None for w in wrt]


def cond(pred: Node, then_fn: Callable, else_fn: Callable, inputs: Sequence[Node] | Node = ()):
    """``then_fn(*inputs)`` if ``pred`` is nonzero else ``else_fn(*inputs)``: only the taken branch runs.

    ``pred`` is one value (a size-1 shape without the row axis: a per-row choice is an elementwise ``where``),
    true when nonzero: -1 and NaN take ``then_fn``, as C, MXNet, NumPy and JAX's ``cond`` read a value.
    Each function is called once, now, on fresh symbols; values it reads from outside become inputs of the
    node. Both must return the same number of nodes with equal shapes and dtypes (checked here). Returns one
    node, or a list when the branches return a list. Gradients: the backward is a ``cond`` on the same
    predicate of the two branches' backward graphs, so the untaken branch adds exactly zero to every
    gradient (it never runs), even where it would be NaN or inf; no gradient flows into ``pred``."""
    if not isinstance(pred, Node):
        raise TypeError(f"cond: the predicate is {type(pred).__name__}, not a Node")
    if pred.has_rows or any(d != 1 for d in pred.shape):
        raise ShapeError(f"cond: the predicate {pred.label()} has shape {fmt_shape(pred.shape)}; it must be "
                         "one value (a per-row choice is an elementwise where(pred, a, b))")
    operands, _ = _as_list(inputs, "cond inputs")
    types = [(x.shape, x.dtype) for x in operands]
    then_t, then_raw = trace(then_fn, types, _fn_name(then_fn, "then_fn"))
    else_t, else_raw = trace(else_fn, types, _fn_name(else_fn, "else_fn"))
    _check_branches(then_t.graph, else_t.graph)
    captured = _merged_captures(then_t, else_t)
    then_g, else_g = _extend_captures(then_t, captured), _extend_captures(else_t, captured)
    outs = then_g.outputs
    in_vf = bool(_rows_implicit.get())
    values = operands + captured
    if in_vf and not in_body():   # one node keeping what its gradient reads (ops/cond_grad.py)
        saved = saving_cond(pred, *hoisted_cond(then_g, else_g, values, len(operands), eager_only=True),
                            len(operands))
        if saved is not None:
            return saved[0] if isinstance(then_raw, Node) else saved
    if in_vf:   # its products of values from outside made before it (ops/hoist.py)
        then_g, else_g, values = hoisted_cond(then_g, else_g, values, len(operands))
    attrs = {"then": then_g, "else_": else_g, "n_operands": len(operands), "_in_vertex_function": in_vf}
    args = [pred] + values
    if in_vf and len(outs) > 1:   # a node per result in a vertex function (a tuple cannot be stored there)
        results = [make_node("cond", args, dict(attrs, then=_only(then_g, i), else_=_only(else_g, i),
                                                shape=o.shape, dtype=o.dtype)) for i, o in enumerate(outs)]
        return results[0] if isinstance(then_raw, Node) else results
    if len(outs) == 1:
        node = make_node("cond", args, dict(attrs, shape=outs[0].shape, dtype=outs[0].dtype))
    else:
        node = _tuple_node("cond", args, dict(attrs, shape=(), dtype=outs[0].dtype),
                           [(o.shape, o.dtype) for o in outs])
    results = _results(node, len(outs))
    return results[0] if isinstance(then_raw, Node) else results


def _only(sub: Subgraph, i: int) -> Subgraph:
    """``sub`` computing its output ``i`` alone."""
    return Subgraph(sub.args, [sub.outputs[i]], sub.name)


def _fn_name(fn, default: str) -> str:
    name = getattr(fn, "__name__", default)
    return default if name == "<lambda>" else name


def _check_branches(a: Subgraph, b: Subgraph) -> None:
    if len(a.outputs) != len(b.outputs):
        raise ShapeError(f"cond: {a.name} returns {len(a.outputs)} values but {b.name} returns "
                         f"{len(b.outputs)}")
    for i, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ShapeError(f"cond: output {i} is {x.dtype.name}{fmt_shape(x.shape)} in {a.name} but "
                             f"{y.dtype.name}{fmt_shape(y.shape)} in {b.name}; both branches must agree")


def _cond_infer(pred, *args, then, else_, n_operands, _in_vertex_function, shape, dtype, _types=None, _sides=None):
    return shape, dtype


def _cond_impl(xp, pred, *values, then, else_, n_operands, _in_vertex_function, shape, dtype, _types=None,
               _sides=None):
    taken = _host_true(pred)
    outs = (then if taken else else_).run(xp, values)
    if _sides is not None:   # (each side's own results: ops/cond_grad.py)
        rows = next(v.shape[0] for v, a in zip(values, then.args) if a.has_rows)
        outs = side_results(xp, outs, _sides, taken, _types, rows)
    return tuple(outs) if _types is not None else outs[0]


def _cond_vjp(g, node, pred, *args, then, else_, n_operands, _in_vertex_function, shape, dtype, _types=None,
              _sides=None):
    if _sides is not None:   # its forward saved what the gradient reads
        if not _in_vertex_function:
            raise NotImplementedError(f"{node.label()} is the backward of a cond: its own gradient (second "
                                      "order) is not defined")
        return saved_cond_vjp(g, node, pred, args, cond)
    cts = _cotangents(g, node)
    n_out = len(then.outputs)
    given = sorted(cts)
    wanted = [i for i, x in enumerate(args) if x.dtype.is_float]
    if not wanted:
        return (None,) * (1 + len(args))

    def branch(sub: Subgraph, which: list):
        def backward(*vals):
            values, ct_vals = list(vals[:len(args)]), vals[len(args):]
            outs = sub.inline(values)
            ct = [None] * n_out
            for i, c in zip(given, ct_vals):
                ct[i] = c
            gs = _float_grads(outs, ct, values)
            return [gs[i] for i in which]
        backward.__name__ = f"{sub.name}.backward"
        return backward

    operands = list(args) + [cts[i] for i in given]
    if _in_vertex_function:   # one node per gradient there: the gradients of per-vertex values and
        # parameters' (summed over the vertices) must not share a node in ∂F
        back = [cond(pred, branch(then, [i]), branch(else_, [i]), operands)[0] for i in wanted]
    else:
        back = cond(pred, branch(then, wanted), branch(else_, wanted), operands)
    grads: list = [None] * len(args)
    for i, gnode in zip(wanted, back):
        grads[i] = gnode
    return (None, *grads)


register(OpDef("cond", infer=_cond_infer, impl=_cond_impl, vjp=_cond_vjp, fuse=False, tuple_valued=_is_tuple_node))
