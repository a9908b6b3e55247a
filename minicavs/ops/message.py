"""The four message ops of a vertex function (§3.1) as IR nodes, with their row movement and its adjoint.

``gather`` and ``pull`` are leaves whose rows are moved in (taken from children's scattered rows, or from an
external buffer); ``scatter`` and ``push`` are identities that mark F's outputs, whose rows are moved out.
In the schedule-first layout (DESIGN.md) every vertex has a fixed row, so each movement is one row gather or
one row write per task, given the task's index (a host index array, a slice, or a strided view):

    op       forward (a task's rows)                           adjoint (backward, same rows)
    gather   take the children's rows of the scatter tensor    scatter-add into their gradient rows
    pull     take rows of the pull buffer                      put rows into the pull buffer's gradient
    scatter  its rows of the scatter tensor hold the value     read its rows of the scatter gradient
    push     put rows into the push buffer                     take rows of the push buffer's gradient

The functions below are that table; ``backend`` is the backend the rows live on (``take``/``put``/``rows``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..ir.graph import Node
from .registry import OpDef, make_node, register
from .sources import _declared, _no_impl


def as_slice(rows: np.ndarray):
    """``rows`` as a slice when they are consecutive (a kind whose tasks are adjacent), else unchanged. (The
    rows are compared as bytes with the range they would be: numpy's elementwise comparison costs a few
    microseconds at the few rows of a batch of one.)"""
    n = len(rows)
    if n:
        first = int(rows[0])
        if int(rows[-1]) - first == n - 1 and (
                n < 3 or rows.tobytes() == np.arange(first, first + n, dtype=rows.dtype).tobytes()):
            return slice(first, first + n)
    return rows


def row_index(rows: np.ndarray):
    """Rows of a pull or push buffer as an index: a slice (no fancy indexing) when they are consecutive,
    as they are for a kind whose vertices are in global id order (the leaves of a batch, say)."""
    return as_slice(rows) if len(rows) > 32 else rows


def take_rows(backend, buf, rows: np.ndarray):
    """``buf[rows]``: a view when the rows are consecutive, else one row gather (pull forward, push adjoint)."""
    index = row_index(rows)
    return buf[index] if isinstance(index, slice) else backend.take(buf, rows)


def put_rows(backend, dst, rows: np.ndarray, src) -> None:
    """``dst[rows] = src`` for distinct rows: a slice assignment when they are consecutive, else one row
    scatter (push forward, pull adjoint)."""
    index = row_index(rows)
    if isinstance(index, slice):
        dst[index] = src
    else:
        backend.put(dst, rows, src)


def gather_rows(backend, scatter, child_rows: np.ndarray, view):
    """Gather forward: the children's rows of the scatter tensor; ``view`` = (start, step) when they are an
    evenly strided block (a strided view, no copy; step 0: all the shared zero row), else None."""
    if view is None:
        return backend.take(scatter, child_rows)
    start, step = view
    count = len(child_rows)
    if step:
        return scatter[start:start + step * (count - 1) + 1:step]
    return backend.xp.broadcast_to(scatter[start], (count,) + scatter.shape[1:])


def gather_adjoint(backend, scatter_grad, child_rows: np.ndarray, view, grad, forest: bool, row_kernels) -> None:
    """Gather's adjoint: the task's gradient added into its children's rows of the scatter gradient. In a
    forest each child has one parent, so its gradient is written once, not added; a DAG's rows add up
    (repeated rows in one task too)."""
    if view is not None:   # distinct rows: a strided view, no fancy indexing
        start, step = view
        if step and forest:   # (step 0: only the sentinel row, whose gradient is discarded)
            scatter_grad[start:start + step * (len(child_rows) - 1) + 1:step] = grad
        elif step:
            scatter_grad[start:start + step * (len(child_rows) - 1) + 1:step] += grad
    elif forest:
        backend.put(scatter_grad, child_rows, grad)
    else:
        xp = backend.xp
        row_kernels.scatter_add(scatter_grad, child_rows,
                                xp.broadcast_to(grad, (len(child_rows),) + scatter_grad.shape[1:]))


@dataclass(frozen=True)
class RowMovement:
    """A message op's row movement (``forward``) and the movement of its gradient (``adjoint``); ``buffer``
    names what the rows live in; ``into_task``: the forward moves rows into the task (gather, pull)."""

    buffer: str
    into_task: bool
    forward: Callable
    adjoint: Callable


GATHER = RowMovement("scatter tensor", True, gather_rows, gather_adjoint)
PULL = RowMovement("pull buffer", True, take_rows, put_rows)
SCATTER = RowMovement("scatter tensor", False, None, None)   # rows in place: the task's slice is its rows
PUSH = RowMovement("push buffer", False, put_rows, take_rows)

register(OpDef("gather", infer=lambda k, shape, dtype: _declared(shape, dtype), impl=_no_impl, vjp=None,
               source=True, rows=GATHER))
register(OpDef("pull", infer=lambda shape, dtype: _declared(shape, dtype), impl=_no_impl, vjp=None,
               source=True, rows=PULL))
register(OpDef("scatter", infer=lambda x: (x.shape, x.dtype), impl=lambda xp, x: x,
               vjp=lambda g, y, x: (g,), identity=True, rows=SCATTER))
register(OpDef("push", infer=lambda x: (x.shape, x.dtype), impl=lambda xp, x: x,
               vjp=lambda g, y, x: (g,), identity=True, rows=PUSH))


def gather_node(k: int, shape: tuple, dtype) -> Node:
    return make_node("gather", (), {"k": int(k), "shape": (None,) + tuple(shape), "dtype": dtype},
                     name=f"gather{k}")


def pull_node(name: str, shape: tuple, dtype) -> Node:
    return make_node("pull", (), {"shape": (None,) + tuple(shape), "dtype": dtype}, name=name)


def scatter_node(x: Node) -> Node:
    return make_node("scatter", (x,), name="scatter")


def push_node(x: Node, name: str) -> Node:
    return make_node("push", (x,), name=name)
