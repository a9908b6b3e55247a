"""Reductions and their adjoints: sum/mean over axes, sum_to (undoing broadcasting), broadcast_like."""
from __future__ import annotations

import numpy as np

from ..core.errors import ShapeError
from ..ir.graph import Node, fmt_shape, user_axes
from .registry import OpDef, RowLowering, make_node, register


def _reduced(shape, axes, keepdims):
    return tuple((1 if i in axes else d) for i, d in enumerate(shape) if keepdims or i not in axes)


def _reduce_infer(x, axes, keepdims):
    return _reduced(x.shape, axes, keepdims), x.dtype


def _mean_infer(x, axes, keepdims):
    if not x.dtype.is_float:  # numpy's mean of integers is a float: the declared dtype would be wrong
        raise ShapeError(f"needs a float input, got {x.dtype.name}{fmt_shape(x.shape)}")
    return _reduce_infer(x, axes, keepdims)


def _expand(xp, g, axes, keepdims):
    return g if keepdims else xp.expand_dims(g, axes)


# Column sums of a float matrix with at least this many elements run as a matrix-vector product with ones.
GEMV_ELEMENTS = 1 << 16


def _sum_impl(xp, x, axes, keepdims):
    """numpy's sum, except a large float matrix summed over its rows (a bias gradient: 37 MB of Var-LSTM
    softmax-layer gradient per step): ``ones @ x`` reads it once at memory speed through BLAS's gemv (and
    on its threads), 1.9 ms here where ``x.sum(0)``'s row-by-row adds took 3.2 ms. The same sequential
    float accumulation per column either way."""
    if (tuple(axes) == (0,) and x.ndim == 2 and x.dtype.kind == "f" and x.size >= GEMV_ELEMENTS
            and x.flags.c_contiguous):
        y = xp.ones(x.shape[0], x.dtype) @ x
        return y[None] if keepdims else y
    if xp is np:   # numpy's add.reduce is what np.sum calls, without its ~2 us of argument handling (a loss head)
        return np.add.reduce(x, axis=axes, keepdims=keepdims)
    return xp.sum(x, axis=axes, keepdims=keepdims)


def _over_rows(n) -> bool:
    """A sum over axis 0 alone of a 2-D value, or of a per-row value of any number of axes (its flat rows
    summed: the result keeps their row-major layout), or over the rows and the steps of a per-row value stacked
    over steps (rows, T, n) (a loop's bias gradient: its rows x T rows of n summed)."""
    x, axes = n.inputs[0], tuple(n.attrs["axes"])
    steps = axes == (0, 1) and x.has_rows and x.ndim == 3
    return steps or (axes == (0,) and (x.ndim == 2 or (x.has_rows and x.ndim > 2)))


def _column_sum(n) -> bool:
    """A sum of a per-row value of one axis over its rows (one number a row, a static program's column), or of
    a per-row value of two axes over both (a loop's stacked per-step losses: its columns' sums summed)."""
    x = n.inputs[0]
    every = tuple(range(x.ndim)) if x.ndim == 2 else (0,)
    return tuple(sorted(n.attrs["axes"])) == every and not n.attrs["keepdims"] and x.has_rows and x.ndim <= 2


register(OpDef(
    "sum", infer=_reduce_infer, impl=_sum_impl,
    vjp=lambda g, out, x, axes, keepdims: (broadcast_like(g, x, axes, keepdims),),
    native=lambda n: "sum_rows" if _over_rows(n) and not n.attrs["keepdims"] else None,
    row_lowering=RowLowering("sum_rows", lambda n: _column_sum(n) or None)))


register(OpDef(
    "mean", infer=_mean_infer,
    impl=lambda xp, x, axes, keepdims: xp.mean(x, axis=axes, keepdims=keepdims),
    vjp=lambda g, out, x, axes, keepdims: (mean_grad(g, x, axes, keepdims),)))


def _count(shape, axes):
    n = 1
    for a in axes:
        n *= shape[a]
    return n


def _broadcast_like(xp, g, shape, axes, keepdims):
    """``g`` broadcast to ``shape`` (a read-only view). A scalar (the gradient of a full sum: every model's
    loss) becomes a view with zero strides directly: np.broadcast_to's argument handling cost ~8 us,
    most of a batch-1 loss head's backward."""
    if xp is np and (isinstance(g, np.generic) or (type(g) is np.ndarray and g.ndim == 0)):
        g = np.asarray(g)   # (a numpy scalar: what numpy's arithmetic on 0-d arrays returns)
        out = np.ndarray(shape, g.dtype, g, 0, (0,) * len(shape))
        out.flags.writeable = False
        return out
    return xp.broadcast_to(_expand(xp, g, axes, keepdims), shape)


def _row_broadcast(n) -> bool:
    """A row broadcast over the run's rows of a value of at most two axes (ROWOP's row function 3); or one
    number over both axes of a per-row value of two (the gradient of a full sum: that number's row first)."""
    target = n.inputs[1]
    every = tuple(sorted(n.attrs["axes"])) == (0, 1) and n.inputs[0].ndim == 0
    return (tuple(n.attrs["axes"]) == (0,) or every) and not n.attrs["keepdims"] and target.has_rows \
        and target.ndim <= 2


# broadcast_like(g, x): g (reduced over `axes` of x) broadcast back to x's shape; adjoint of sum.
register(OpDef(
    "broadcast_like", infer=lambda g, x, axes, keepdims: (x.shape, g.dtype),
    impl=lambda xp, g, x, axes, keepdims: _broadcast_like(xp, g, x.shape, axes, keepdims),
    vjp=lambda gg, out, g, x, axes, keepdims: (make_node("sum", (gg,), {"axes": axes, "keepdims": keepdims}),
                                               None),
    row_lowering=RowLowering("rowop", _row_broadcast, fn=3, output_cols=True)))

# mean_grad(g, x): the adjoint of mean, i.e. broadcast_like divided by the (run-time) element count.
register(OpDef(
    "mean_grad", infer=lambda g, x, axes, keepdims: (x.shape, g.dtype),
    impl=lambda xp, g, x, axes, keepdims: xp.broadcast_to(
        _expand(xp, g, axes, keepdims) / g.dtype.type(_count(x.shape, axes)), x.shape),
    vjp=lambda gg, out, g, x, axes, keepdims: (make_node("mean", (gg,), {"axes": axes, "keepdims": keepdims}),
                                               None)))


def _sum_to_infer(x, axes, shape):
    return shape, x.dtype


def _sum_to_impl(xp, x, axes, shape):
    y = xp.sum(x, axis=axes) if axes else x
    lead = x.ndim - len(shape)
    return y.reshape(tuple(x.shape[i + lead] if d is None else d for i, d in enumerate(shape)))


register(OpDef(
    "sum_to", infer=_sum_to_infer, impl=_sum_to_impl,
    vjp=lambda g, out, x, axes, shape: (
        broadcast_like(g, x, tuple(range(x.ndim - len(shape))), False),),
    native=lambda n: "sum_rows" if _over_rows(n) and (n.inputs[0].has_rows or len(n.attrs["shape"]) == 1)
    else None))


def sum(x: Node, axis=None, keepdims: bool = False) -> Node:
    """Sum over ``axis`` (None: every axis a user sees; inside a vertex function, not the vertex axis)."""
    return make_node("sum", (x,), {"axes": user_axes(x, axis), "keepdims": bool(keepdims)})


def mean(x: Node, axis=None, keepdims: bool = False) -> Node:
    return make_node("mean", (x,), {"axes": user_axes(x, axis), "keepdims": bool(keepdims)})


def broadcast_like(g: Node, x: Node, axes: tuple, keepdims: bool) -> Node:
    return make_node("broadcast_like", (g, x), {"axes": tuple(axes), "keepdims": bool(keepdims)})


def mean_grad(g: Node, x: Node, axes: tuple, keepdims: bool) -> Node:
    return make_node("mean_grad", (g, x), {"axes": tuple(axes), "keepdims": bool(keepdims)})


def sum_to(x: Node, shape: tuple) -> Node:
    """Sum ``x`` down to ``shape``, the inverse of numpy broadcasting (used by gradients)."""
    shape = tuple(shape)
    if x.shape == shape:
        return x
    lead = x.ndim - len(shape)
    if lead < 0:
        raise ShapeError(f"cannot sum {fmt_shape(x.shape)} down to {fmt_shape(shape)}")
    axes = list(range(lead))
    for i, d in enumerate(shape):
        xd = x.shape[i + lead]
        if d == 1 and xd != 1:
            axes.append(i + lead)
        elif d != xd and not (d is None or xd is None):
            raise ShapeError(f"cannot sum {fmt_shape(x.shape)} down to {fmt_shape(shape)}")
    return make_node("sum_to", (x,), {"axes": tuple(axes), "shape": shape})
