"""Neural-network ops: softmax family and losses, dropout, row lookup (embedding) with row-sparse gradients."""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..core.arrays import as_module
from ..core.errors import FeedError, ShapeError
from ..core.random import hash_words, uniform
from ..core.sparse import RowSparse, densify as _densify
from ..core.validate import check_labels, indices
from ..ir.graph import Node, fmt_shape, user_axis
from .elementwise import exp, mul, neg, sub, unbroadcast
from .reduce import mean_grad
from .registry import OpDef, RowLowering, make_node, native_kernels, register
from .sources import as_node


def no_second_order(name):
    def vjp(*args, **attrs):
        raise NotImplementedError(f"{name} has no gradient: second-order derivatives through it are not supported")
    return vjp


def _same(x, **attrs):
    if not x.dtype.is_float:
        raise ShapeError(f"needs a float input, got {x.dtype.name}")
    return x.shape, x.dtype


def _keepsum(x, axis):
    return make_node("sum", (x,), {"axes": (axis,), "keepdims": True})


def _softmax_impl(xp, x, axis):
    e = x - x.max(axis=axis, keepdims=True)   # (the array methods: the same reductions without the
    xp.exp(e, out=e)                          # module functions' dispatch, microseconds at a batch of one)
    e /= e.sum(axis=axis, keepdims=True)
    return e


def _log_softmax_impl(xp, x, axis):
    z = x - xp.max(x, axis=axis, keepdims=True)
    return z - xp.log(xp.sum(xp.exp(z), axis=axis, keepdims=True))


def _rows_2d(x: Node) -> bool:
    """A matrix of the run's rows (what a static program's row functions take)."""
    return x.ndim == 2 and x.has_rows


register(OpDef("softmax", infer=_same, impl=_softmax_impl,
               vjp=lambda g, y, x, axis: (mul(y, sub(g, _keepsum(mul(g, y), axis))),),
               row_lowering=RowLowering("rowop", lambda n: _rows_2d(n.inputs[0]) and n.attrs.get("axis") in (-1, 1),
                                        fn=0)))
register(OpDef("log_softmax", infer=_same, impl=_log_softmax_impl,
               vjp=lambda g, y, x, axis: (sub(g, mul(exp(y), _keepsum(g, axis))),)))


def softmax(x: Node, axis: int = -1) -> Node:
    return make_node("softmax", (x,), {"axis": user_axis(x, axis)})


def log_softmax(x: Node, axis: int = -1) -> Node:
    return make_node("log_softmax", (x,), {"axis": user_axis(x, axis)})


# --- softmax cross-entropy with integer labels ------------------------------------------------------

def _xent_infer(logits, labels, *weight):
    if not logits.dtype.is_float or labels.dtype.is_float:
        raise ShapeError(f"needs float logits and integer labels, got {logits.dtype.name} and {labels.dtype.name}")
    if logits.ndim < 1 or len(labels.shape) != logits.ndim - 1 or any(
            a != b and a is not None and b is not None for a, b in zip(logits.shape[:-1], labels.shape)):
        raise ShapeError(f"logits {fmt_shape(logits.shape)} need labels of shape {fmt_shape(logits.shape[:-1])}, "
                         f"got {fmt_shape(labels.shape)}")
    if weight:
        w = weight[0]
        if w.dtype != logits.dtype or w.shape != labels.shape:
            raise ShapeError(f"weight {w.dtype.name}{fmt_shape(w.shape)} must match labels {fmt_shape(labels.shape)} "
                             f"and logits dtype {logits.dtype.name}")
    return labels.shape, logits.dtype


def _native_xent(xp, dtype):
    """The backend's one-pass cross-entropy kernels for arrays of ``xp`` and ``dtype`` (the C library's on
    the CPU), else None."""
    kernels = native_kernels(xp, dtype)
    return kernels if hasattr(kernels, "xent") else None


def _xent_impl(xp, logits, labels, *weight):
    lib = _native_xent(xp, logits.dtype)
    if lib is not None and logits.ndim >= 1 and logits.shape[-1]:   # one pass per row, no temporaries
        loss = lib.xent(logits, labels, "softmax_cross_entropy")   # (it checks the labels)
        return loss * weight[0] if weight else loss
    labels = as_module(xp, check_labels(logits, labels))   # checked where they live (the host), then over
    m = xp.max(logits, axis=-1, keepdims=True)
    lse = (m + xp.log(xp.sum(xp.exp(logits - m), axis=-1, keepdims=True)))[..., 0]  # one (rows, classes) temp
    loss = lse - xp.take_along_axis(logits, labels[..., None].astype(np.intp), axis=-1)[..., 0]
    return loss * weight[0] if weight else loss


def _xent_vjp(g, y, logits, labels, *weight):
    if weight:
        gl = make_node("xent_grad", (mul(g, weight[0]), logits, labels))
        return gl, None, mul(g, make_node("softmax_cross_entropy", (logits, labels)))
    return make_node("xent_grad", (g, logits, labels)), None


def _xent_grad_impl(xp, g, logits, labels):
    lib = _native_xent(xp, logits.dtype)
    if lib is not None and logits.ndim >= 1 and logits.shape[-1]:
        return lib.xent_grad(xp.asarray(g, logits.dtype), logits, labels)   # (it checks the labels)
    labels = as_module(xp, check_labels(logits, labels, "xent_grad"))
    p = _softmax_impl(xp, logits, -1)          # a fresh array: updated in place below
    idx = labels[..., None].astype(np.intp)
    xp.put_along_axis(p, idx, xp.take_along_axis(p, idx, axis=-1) - 1, axis=-1)
    p *= g[..., None]
    return p


register(OpDef("softmax_cross_entropy", infer=_xent_infer, impl=_xent_impl, vjp=_xent_vjp,
               row_lowering=RowLowering("rowop", lambda n: len(n.inputs) == 2 and _rows_2d(n.inputs[0]), fn=1,
                                        labels=True)))
# xent_grad(g, logits, labels) = (softmax(logits) - onehot(labels)) * g[..., None]
register(OpDef("xent_grad", infer=lambda g, logits, labels: (logits.shape, logits.dtype),
               impl=_xent_grad_impl, vjp=no_second_order("xent_grad"),
               row_lowering=RowLowering("rowop", lambda n: _rows_2d(n.inputs[1]) and n.inputs[0].ndim == 1, fn=2,
                                        source=1, gradient=0, labels=True)))


def softmax_cross_entropy(logits: Node, labels: Node, weight: Node | None = None) -> Node:
    """Per-row loss ``weight * (logsumexp(logits) - logits[label])``; weight 0 masks a row out."""
    args = (logits, labels) + (() if weight is None else (as_node(weight, logits),))
    return make_node("softmax_cross_entropy", args)


# --- mean squared error -----------------------------------------------------------------------------

def _mse_infer(a, b):
    from .elementwise import _float_binary_infer
    _float_binary_infer(a, b)
    return (), a.dtype


def _mse_vjp(g, y, a, b):
    d = sub(a, b)
    gd = mul(mean_grad(g, d, tuple(range(d.ndim)), False), mul(d, 2.0))
    return unbroadcast(gd, a), unbroadcast(neg(gd), b)


register(OpDef("mse", infer=_mse_infer, impl=lambda xp, a, b: xp.mean(xp.square(a - b)), vjp=_mse_vjp))


def mse(a: Node, b) -> Node:
    """mean((a - b)**2) over every element (b broadcasts against a)."""
    return make_node("mse", (a, as_node(b, a)))


# --- dropout ----------------------------------------------------------------------------------------

_sites = itertools.count()


def _row_keys(rows: int, site, ctx, xp=np) -> np.ndarray:
    """The dropout row keys of ``rows`` rows (made on ``xp``'s device when none are given: no copy)."""
    keys = getattr(ctx, "row_keys", None)
    if keys is None:
        return xp.arange(rows, dtype=np.uint64)
    if getattr(keys, "shape", (len(keys),)) != (rows,):
        raise FeedError(f"dropout site {site}: {len(keys)} row keys for {rows} rows")
    return indices(keys, f"dropout site {site}: row key", dtype=np.uint64, at="row")


def dropout_mask(shape, p, site, ctx, dtype):
    """The keep-mask scaled by 1/(1-p): a pure function of (seed, step, site, row key, column); the numpy
    reference of the kernels' masks (codegen/library_source.py, codegen/cuda.py)."""
    keys = _row_keys(shape[0] if shape else 1, site, ctx)
    cols = np.arange(math.prod(shape[1:]), dtype=np.uint64)
    u = uniform(ctx.seed, ctx.step, site, np.asarray(keys)[:, None], cols[None, :])
    return ((u >= p) * (1.0 / (1.0 - p))).astype(dtype).reshape(shape)


def _dropout_impl(xp, x, p, site, ctx):
    if not ctx.training or p == 0.0:
        return x
    rows = _dropout_kernels(xp, x.dtype)
    if rows is None:
        return x * xp.asarray(dropout_mask(x.shape, p, site, ctx, x.dtype))
    return kernel_dropout(xp, x, p, site, ctx, rows)


def kernel_dropout(xp, x, p, site, ctx, rows):
    """``x`` times its mask, made by a kernel (``rows.dropout``: the C library's or the CUDA row kernels'):
    the same bits as :func:`dropout_mask`, the mask never built on its own (nor copied to a device)."""
    n = x.shape[0] if x.ndim else 1
    keys = as_module(xp, _row_keys(n, site, ctx, xp))   # (uint64 keys need no range check: no device read)
    h = int(hash_words(ctx.seed, ctx.step, site)[0])
    return rows.dropout(x.reshape(n, math.prod(x.shape[1:])), keys, h, float(p)).reshape(x.shape)


def _dropout_kernels(xp, dtype):
    """The dropout kernel for arrays of ``xp``: the backend's (the C library, CUDA's row kernels), else None."""
    kernels = native_kernels(xp, dtype)
    return kernels if hasattr(kernels, "dropout") else None


register(OpDef("dropout", infer=lambda x, p, site: _same(x), impl=_dropout_impl, needs_ctx=True,
               vjp=lambda g, y, x, p, site: (make_node("dropout", (g,), {"p": p, "site": site}),),
               native=lambda node: "dropout" if node.has_rows else None))


def dropout(x: Node, p: float, site: int | None = None) -> Node:
    """Inverted dropout. The mask hashes (seed, step, site, row key, column): see :mod:`minicavs.core.random`.

    ``site`` names this dropout for the hash; pass a fixed number to keep masks stable across programs that
    build their graphs in a different order (default: a process-wide counter)."""
    if not 0.0 <= p < 1.0:
        raise ShapeError(f"dropout: p={p} must be in [0, 1)")
    return make_node("dropout", (x,), {"p": float(p), "site": next(_sites) if site is None else int(site)})


# --- row lookup (embedding) -------------------------------------------------------------------------

def _lookup_infer(table, idx):
    if table.ndim < 1 or idx.dtype.is_float:
        raise ShapeError(f"needs a table with at least one axis and integer indices, got "
                         f"{table.dtype.name}{fmt_shape(table.shape)} and {idx.dtype.name}{fmt_shape(idx.shape)}")
    return idx.shape + table.shape[1:], table.dtype


def _lookup_impl(xp, table, idx):
    idx = as_module(xp, indices(idx, "lookup: index", size=table.shape[0], of=f" for a table of {table.shape[0]} rows"))
    return table.take(idx, axis=0)   # (the method: numpy's module function adds its dispatch, ~1 us)


def _lookup_grad_impl(xp, g, idx, table):
    return RowSparse(idx.reshape(-1), g.reshape((-1,) + table.shape[1:]), table.shape)


register(OpDef("lookup", infer=_lookup_infer, impl=_lookup_impl,
               vjp=lambda g, y, table, idx: (make_node("lookup_grad", (g, idx, table)), None),
               row_lowering=RowLowering("take", lambda n: n.inputs[0].ndim == 2 and n.inputs[1].ndim in (1, 2)
                                        and n.inputs[1].has_rows),
               row_groups=lambda n: [(n, n.inputs[1])]))
# lookup_grad(g, idx, table): the row-sparse gradient of the table (indices + rows, never a dense table);
# the table input only gives the dense shape (its row count may be known only at run time).
register(OpDef("lookup_grad", infer=lambda g, idx, table: (table.shape, g.dtype), impl=_lookup_grad_impl,
               vjp=no_second_order("lookup_grad"), row_groups=lambda n: [(n, n.inputs[2]), (n.inputs[0], n.inputs[1])]))
register(OpDef("densify", infer=lambda x: (x.shape, x.dtype), impl=lambda xp, x: _densify(xp, x),
               vjp=lambda g, y, x: (g,)))


def lookup(table: Node, idx: Node) -> Node:
    """Rows of ``table`` at integer ``idx``: shape idx.shape + table.shape[1:].

    The table may be a parameter (an embedding) or computed rows such as a push buffer (e.g. picking
    the roots' rows); either way its gradient is row-sparse until something needs it dense."""
    return make_node("lookup", (table, idx))


def is_row_sparse(n: Node) -> bool:
    """True if the node's value at run time is a RowSparse (a lookup gradient or a sum of them only)."""
    if n.op == "lookup_grad":
        return True
    return n.op == "accum" and all(is_row_sparse(x) for x in n.inputs)


def row_sparse_parts(n: Node) -> list:
    """The lookup gradients row-sparse ``n`` sums (itself, for one), in the order their rows stack (add_all's)."""
    if n.op == "lookup_grad":
        return [n]
    return [part for x in n.inputs for part in row_sparse_parts(x)]


def densify(x: Node) -> Node:
    return make_node("densify", (x,)) if is_row_sparse(x) else x
