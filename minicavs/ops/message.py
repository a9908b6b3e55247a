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

The runners move the rows (GATHER, TAKE, PUT and ADJ among the opcodes of engine/codegen/machine.py);
each op's ``rows`` record below says what its rows live in.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class RowMovement:
    """A message op's row movement: ``buffer`` names what the rows live in; ``into_task``: the forward moves
    rows into the task (gather, pull). The movements themselves are opcodes (engine/codegen/machine.py)."""

    buffer: str
    into_task: bool


GATHER = RowMovement("scatter tensor", True)
PULL = RowMovement("pull buffer", True)
SCATTER = RowMovement("scatter tensor", False)   # rows in place: the task's slice is its rows
PUSH = RowMovement("push buffer", False)

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
