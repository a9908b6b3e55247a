"""Ops that move data without arithmetic: reshape, transpose, concat, slice/split (views where numpy allows)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..core.arrays import is_planned
from ..core.errors import ShapeError
from ..ir.graph import Node, fmt_shape, row_lead, user_axis, user_shape
from .registry import OpDef, make_node, register


def _run_shape(shape, rows):
    return tuple(rows if d is None else d for d in shape)


def _reshape_infer(x, shape):
    return shape, x.dtype


def _native_reshape(n: Node):
    """A per-row value reshaped to another per-row shape keeps its flat row (row-major): an alias."""
    return "alias" if n.has_rows and n.inputs[0].has_rows else None


register(OpDef("reshape", infer=_reshape_infer,
               impl=lambda xp, x, shape: x.reshape(_run_shape(shape, x.shape[0] if x.ndim else None)),
               vjp=lambda g, y, x, shape: (make_node("reshape", (g,), {"shape": x.shape}),),
               native=_native_reshape))


def reshape(x: Node, shape: Sequence[int]) -> Node:
    """Reshape; one entry may be -1. A leading row axis (None) is kept and cannot be merged away."""
    shape = list(user_shape(x, shape))
    fixed_in = x.shape[1:] if x.has_rows else x.shape
    body = shape[1:] if shape and shape[0] is None else shape
    if x.has_rows != (len(shape) > 0 and shape[0] is None):
        raise ShapeError(f"reshape {fmt_shape(x.shape)} -> {fmt_shape(tuple(shape))}: "
                         "the row axis (None) must stay leading")
    if any(d is None for d in body):
        raise ShapeError(f"reshape: only the leading axis may be None, got {fmt_shape(tuple(shape))}")
    total = math.prod(fixed_in)
    if body.count(-1) > 1:
        raise ShapeError(f"reshape: at most one -1 in {fmt_shape(tuple(shape))}")
    if -1 in body:
        known = math.prod(d for d in body if d != -1)
        if known == 0 or total % known:
            raise ShapeError(f"reshape {fmt_shape(x.shape)} -> {fmt_shape(tuple(shape))}: sizes do not fit")
        body[body.index(-1)] = total // known
    if math.prod(body) != total:
        raise ShapeError(f"reshape {fmt_shape(x.shape)} -> {fmt_shape(tuple(shape))}: sizes do not fit")
    out = ((None,) if x.has_rows else ()) + tuple(int(d) for d in body)
    return x if out == x.shape else make_node("reshape", (x,), {"shape": out})


def _perm_infer(x, perm):
    if sorted(perm) != list(range(x.ndim)):
        raise ShapeError(f"perm {perm} is not a permutation of the axes of {fmt_shape(x.shape)}")
    return tuple(x.shape[p] for p in perm), x.dtype


def _inverse(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _native_transpose(n: Node):
    """A 2-D value: the transposed flag (a view). A per-row value of three axes with its last two swapped:
    each row's matrix transposed into a new flat row (so every per-row value keeps its row-major layout)."""
    if n.attrs["perm"] == (1, 0):
        return "transpose"
    if n.has_rows and n.ndim == 3 and n.attrs["perm"] == (0, 2, 1):
        return "transpose_rows"
    return None


register(OpDef("transpose", infer=_perm_infer, impl=lambda xp, x, perm: xp.transpose(x, perm),
               vjp=lambda g, y, x, perm: (make_node("transpose", (g,), {"perm": _inverse(perm)}),),
               native=_native_transpose))


def transpose(x: Node, perm: Sequence[int] | None = None) -> Node:
    """Permute axes (default: reverse the axes a user sees; a vertex axis stays first in F)."""
    lead = row_lead(x)
    n = x.ndim - lead
    perm = tuple(reversed(range(n))) if perm is None else tuple(perm)
    if len(perm) != n:
        raise ShapeError(f"transpose: perm {perm} has {len(perm)} axes, the shape has {n}")
    full = tuple(range(lead)) + tuple(user_axis(x, p, "perm entry") for p in perm)
    return make_node("transpose", (x,), {"perm": full})


def swap_last(x: Node) -> Node:
    perm = tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2)
    return make_node("transpose", (x,), {"perm": perm})


def _column_blocks_axis(n: Node) -> bool:
    """Is ``n``'s axis 1 a run of column blocks of its flat rows: a 2-D value's columns, or axis 1 of a per-row
    value of any number of axes (a block of it is ``prod(shape[2:])`` flat columns per entry)?"""
    return n.attrs["axis"] == 1 and (n.ndim == 2 or (n.has_rows and n.ndim > 2))


def _concat_infer(*xs, axis):
    first = xs[0]
    for x in xs[1:]:
        if x.dtype != first.dtype:
            raise ShapeError(f"dtypes {first.dtype.name} and {x.dtype.name} differ")
        if x.ndim != first.ndim or any(a != b for i, (a, b) in enumerate(zip(first.shape, x.shape)) if i != axis):
            raise ShapeError(f"shapes {fmt_shape(first.shape)} and {fmt_shape(x.shape)} differ off axis {axis}")
    sizes = [x.shape[axis] for x in xs]
    total = None if None in sizes else sum(sizes)
    return first.shape[:axis] + (total,) + first.shape[axis + 1:], first.dtype


def _concat_vjp(g, y, *xs, axis):
    out, start = [], 0
    for x in xs:
        stop = start + x.shape[axis]
        out.append(make_node("slice", (g,), {"axis": axis, "start": start, "stop": stop}))
        start = stop
    return tuple(out)


def _concat_column_blocks(n: Node) -> list | None:
    """For a concat of distinct per-row vectors along the last axis: [(part, first column, end)]."""
    if n.ndim != 2 or n.attrs["axis"] not in (-1, 1) or len(set(n.inputs)) < len(n.inputs):
        return None
    bounds = [0]
    for x in n.inputs:
        bounds.append(bounds[-1] + x.shape[1])
    return [(x, a, b) for x, a, b in zip(n.inputs, bounds[:-1], bounds[1:])]


def adjacent_blocks(xs, axis: int) -> "np.ndarray | None":
    """The concatenation of host arrays ``xs`` along their last axis (``axis``: 1 for matrices, 0 for
    vectors) as a read-only view, when they are adjacent blocks of one buffer (parameters laid out by
    ParameterSet.plan_buffer); else None. (A slice of the buffer, not ``as_strided``: this runs for every
    merged weight of every batch, and a slice costs a tenth as much.)"""
    first = xs[0]
    if not isinstance(first, np.ndarray) or first.ndim not in (1, 2) or axis != first.ndim - 1:
        return None
    base = first.base
    if not is_planned(base) or first.strides != base.strides or first.shape[:-1] != base.shape[:-1]:
        return None
    origin = base.__array_interface__["data"][0]
    start = at = first.__array_interface__["data"][0] - origin
    for x in xs:
        if (not isinstance(x, np.ndarray) or x.base is not base or x.strides != base.strides
                or x.shape[:-1] != base.shape[:-1] or x.__array_interface__["data"][0] - origin != at):
            return None
        at += x.shape[-1] * base.itemsize
    if at > base.shape[-1] * base.itemsize:
        return None
    view = base[..., start // base.itemsize:at // base.itemsize]
    view.flags.writeable = False
    return view


def _concat_impl(xp, *xs, axis):
    view = adjacent_blocks(xs, axis) if xp is np else None
    return xp.concatenate(xs, axis=axis) if view is None else view


register(OpDef("concat", infer=_concat_infer,
               impl=_concat_impl, vjp=_concat_vjp,
               column_blocks=_concat_column_blocks,
               native=lambda n: "concat" if _column_blocks_axis(n) else None))


def concat(xs: Sequence[Node], axis: int = -1) -> Node:
    xs = tuple(xs)
    if not xs:
        raise ShapeError("concat: no inputs")
    if len(xs) == 1:
        return xs[0]
    if any(x.shape[user_axis(xs[0], axis)] is None for x in xs):
        raise ShapeError("concat: cannot concatenate along the row axis (its length is known only at run time)")
    return make_node("concat", xs, {"axis": user_axis(xs[0], axis)})


def _slice_infer(x, axis, start, stop):
    return x.shape[:axis] + (stop - start,) + x.shape[axis + 1:], x.dtype


def _index(axis, start, stop):
    return (slice(None),) * axis + (slice(start, stop),)


register(OpDef("slice", infer=_slice_infer,
               impl=lambda xp, x, axis, start, stop: x[_index(axis, start, stop)],
               vjp=lambda g, y, x, axis, start, stop: (
                   make_node("unslice", (g, x), {"axis": axis, "start": start, "stop": stop}),),
               native=lambda n: "cols" if _column_blocks_axis(n) or _static_vector_block(n) else None,
               last_axis_block=lambda n: (n.attrs["start"], n.attrs["stop"]) if n.attrs["axis"] == n.ndim - 1
               else None))


def _static_vector_block(n: Node) -> bool:
    """Is ``n`` a block of a row-free vector (one flat row: a block of its columns), the gradient of a bias
    in a planned bias buffer, say?"""
    return n.ndim == 1 and not n.has_rows and n.attrs["axis"] == 0


def _unslice_impl(xp, g, x, axis, start, stop):
    out = xp.zeros(x.shape, dtype=g.dtype)
    out[_index(axis, start, stop)] = g
    return out


def _merge_unslices(gs: list) -> list:
    """Gradients of slices that tile their source exactly (the parts of a split) become one concat,
    instead of a zero-filled array per part summed together."""
    groups: dict = {}
    for g in gs:
        groups.setdefault((g.inputs[1].id, g.attrs["axis"]), []).append(g)
    out = []
    for (_, axis), parts in groups.items():
        parts.sort(key=lambda g: g.attrs["start"])
        ends = [0] + [g.attrs["stop"] for g in parts]
        full = parts[0].inputs[1].shape[axis]
        if len(parts) > 1 and all(g.attrs["start"] == e for g, e in zip(parts, ends)) and ends[-1] == full:
            out.append(make_node("concat", tuple(g.inputs[0] for g in parts), {"axis": axis}))
        else:
            out.extend(parts)
    return out


# unslice(g, x): zeros shaped like x with g written at [start:stop] on axis; the adjoint of slice.
register(OpDef("unslice", infer=lambda g, x, axis, start, stop: (x.shape, g.dtype), impl=_unslice_impl,
               vjp=lambda gg, y, g, x, axis, start, stop: (
                   make_node("slice", (gg,), {"axis": axis, "start": start, "stop": stop}), None),
               merge_gradients=_merge_unslices,
               native=lambda n: "unslice" if _column_blocks_axis(n) else None))


def slice_(x: Node, start: int, stop: int, axis: int = -1) -> Node:
    """x[start:stop] along ``axis`` (a numpy view); not along the row axis."""
    ax = user_axis(x, axis)
    n = x.shape[ax]
    if n is None:
        raise ShapeError("slice: cannot slice the row axis (its length is known only at run time)")
    if not (0 <= start < stop <= n):
        raise ShapeError(f"slice [{start}:{stop}] out of range for axis {axis} of length {n}")
    return make_node("slice", (x,), {"axis": ax, "start": int(start), "stop": int(stop)})


def split(x: Node, sections, axis: int = -1) -> list[Node]:
    """Split into ``sections`` equal parts (an int) or parts of the given sizes (a list); views."""
    n = x.shape[user_axis(x, axis)]
    if n is None:
        raise ShapeError("split: cannot split the row axis")
    if isinstance(sections, int):
        if sections <= 0 or n % sections:
            raise ShapeError(f"split: axis of length {n} does not split into {sections} equal parts")
        sizes = [n // sections] * sections
    else:
        sizes = [int(s) for s in sections]
        if sum(sizes) != n or min(sizes) <= 0:
            raise ShapeError(f"split: sizes {sizes} do not add up to the axis length {n}")
    out, start = [], 0
    for s in sizes:
        out.append(slice_(x, start, start + s, axis))
        start += s
    return out
