"""A loop with a trip count per row (``foreach(steps=lengths)`` in a static graph: padded sequences) in a static
program, as masks (engine/loops.py calls this module where the template lowers such a loop).

The loop runs the batch's longest row's steps (LOOPN over a one-value static the program's binder computes from
the lengths: ("longest", lengths)); step t reads column t of a float mask of the rows still running (("running",
lengths): 1 where t < lengths[r], made on the host from the lengths when bound, checked there: one per row, each
in [0, length]). After the body a row that has finished keeps its states and writes zeros as its outputs: each
new state and output is ``where(running, new, old)``, a select, so what a finished row computes (NaN or not)
reaches no value. A loop that also sums over its rows (a carried value without the row axis: the parameter
gradients of a loop's gradient) must see nothing of a finished row: what the body reads of its per-row values
(the carried state cotangents, the iterated inputs and cotangents; not the forward's saved states, the finished
row's own, finite where its forward was) is selected to zero for a finished row, so that row adds exact zeros
and a NaN in its padding reaches no gradient. A loop of that kind that is no loop's gradient is declined (the
step runner runs it).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..ir.graph import Node
from ..ops import elementwise as E
from ..ops.row_steps import checked_row_trips
from ..ops.flow import flow, is_loop
from ..ops.sources import input as placeholder
from .compile import Step
from .lowered import Template, _cols

RUNNING, LONGEST = "running", "longest"


def per_row(node: Node) -> bool:
    """Has loop ``node`` a trip count per row (its last input, an int value with the row axis)?"""
    f = flow(node)
    return f is not None and f.counted and "cond" not in dict(f.bodies) and node.inputs[-1].has_rows


def unread_past_run(node: Node) -> frozenset:
    """The stacked results of per-row loop ``node`` that nothing reads past the steps it runs: a saving loop's
    residuals and saved pre-step states (ops/loop_grad.py), which only its gradient's reverse loop reads, over
    the same steps (its parameters' terms summed in that loop): not zeroed first (in a bucketed batch most of a
    stacked value's T steps are past its longest row: the logits' 75 x 10k columns a row)."""
    f = flow(node)
    residuals = node.attrs.get("_residuals")
    if not per_row(node) or residuals is None or not node.attrs.get("_save"):
        return frozenset()
    first_saved = f.outputs + f.states
    return frozenset(range(f.outputs - residuals, f.outputs)) | frozenset(range(first_saved,
                                                                               first_saved + f.states))


def refusal(node: Node, inputs) -> str | None:
    """Why a per-row loop is not lowered as masks (None: it is): one that sums over its rows and is no other
    loop's gradient (its cotangents unknown)."""
    f = flow(node)
    body = f.bodies[0][1]
    sums = [p for p in body.args[f.iterated:f.iterated + f.states] if not p.has_rows]
    sums += [o for o in body.outputs[:f.outputs] if not o.has_rows]
    if sums and not _saved(inputs, f):
        return "a loop with a trip count per row that sums over its rows (not a loop's gradient)"
    return None


def _saved(inputs, f) -> set:
    """The iterated inputs of a loop's gradient that are its forward loop's saved states (items of a loop;
    empty: ``inputs`` are no loop's gradient's)."""
    return {x for x in inputs[:f.iterated] if x.inputs and is_loop(x.inputs[0])}


class Masks:
    """The masks of one per-row loop being lowered into template ``t``."""

    def __init__(self, t: Template, node: Node, inputs, where: tuple, lower_step: Callable):
        self.t, self.where, self.lower_step = t, where, lower_step   # (where: lower_step's statics, device, singles)
        self.f = f = flow(node)
        lengths = inputs[-1]
        self.matrix = t.reg(name=f"running {lengths.name or lengths.id}")
        t.emit("STATIC", self.matrix, t.buf((RUNNING, lengths, f.length)))
        body = f.bodies[0][1]
        summing = any(not p.has_rows for p in body.args[f.iterated:f.iterated + f.states]) or \
            any(not o.has_rows for o in body.outputs[:f.outputs])
        saved = _saved(inputs, f)
        masked = [p for p, x in zip(body.args[:f.iterated], inputs) if x not in saved]
        masked += list(body.args[f.iterated:f.iterated + f.states])
        self.masked = {p for p in masked if summing and p.has_rows and p.dtype.is_float}
        self.zero, self.column = None, None
        self.zero_column = t.reg(name="zero")   # (what a finished row's output is: selected, not multiplied)
        t.emit("SCRATCH", self.zero_column, t.scratch, 1)
        t.emit("ZERO", self.zero_column, -1, 1)
        t.scratch += 1
        if self.masked:   # (what a finished row's masked values read: zeros, selected, so NaN reaches nothing)
            width = max(_cols(p) for p in self.masked)
            self.zero = t.reg(name="zeros")
            t.emit("SCRATCH", self.zero, t.scratch, width)
            t.emit("ZERO", self.zero, -1, width)
            t.scratch += width

    def step(self, order: tuple) -> None:
        """The running mask's column of this step (STEPCOLS, the loop's order)."""
        self.column = self.t.reg(name="running[t]")
        self.t.emit("STEPCOLS", self.column, self.matrix, 1, *order)

    def entry(self, p: Node, reg: int) -> int:
        """The register the body reads for placeholder ``p``: in a summing loop, a value other than a saved
        state selected to zero on a finished row."""
        if p not in self.masked:
            return reg
        out = self.t.reg(name=f"{p.name or 'x'} running")
        self.t.emit("SCRATCH", out, self.t.scratch, _cols(p))
        self.t.scratch += _cols(p)
        self._where(p, reg, self.zero, out)
        return out

    def select(self, node: Node, dst: int, new: int) -> None:
        """dst = where(running, new, dst): a finished row keeps what ``dst`` holds (its state, its zero); the
        select goes to scratch first (a kernel's output never aliases its input: its pointers are restrict)."""
        chosen = self.t.reg(name=f"{node.name or 'x'} chosen")
        self.t.emit("SCRATCH", chosen, self.t.scratch, _cols(node))
        self.t.scratch += _cols(node)
        self._where(node, new, dst, chosen)
        self.t.emit("COPY", dst, chosen, -1, _cols(node))

    def put(self, node: Node, block: int, new: int) -> None:
        """block = where(running, new, 0): a step's output block, written by the select itself (the block
        holds nothing it reads: zeroed with its stacked value)."""
        self._where(node, new, self.zero_column, block, old_cols=1)

    def _where(self, like: Node, new: int, old: int, out: int, old_cols: int | None = None) -> None:
        """where(running, new, old) over ``like``'s rows into ``out``: one elementwise step (a fused kernel, as
        F's single nodes); ``old_cols`` 1: one column, the same for every column."""
        singles = self.where[2]
        old_cols = _cols(like) if old_cols is None else old_cols
        key = ("row mask", _cols(like), like.dtype.name, old_cols)
        if key not in singles:
            m = placeholder((None, 1), like.dtype.name, name="running")
            a = placeholder((None, _cols(like)), like.dtype.name, name="new")
            b = placeholder((None, old_cols), like.dtype.name, name="old")
            singles[key] = (m, a, b, E.where(m, a, b))
        m, a, b, y = singles[key]
        t = self.t
        t.regs.update({m: self.column, a: new, b: old, y: out})
        self.lower_step(t, Step.of(y), *self.where)
        for x in (m, a, b, y):
            t.regs.pop(x, None)


def bound(value, key: tuple, rows: int) -> np.ndarray:
    """What the binder gets for a RUNNING or LONGEST key: from the lengths' ``value`` (checked on the host)."""
    what, lengths, length = key
    trips = checked_row_trips(value, rows, length, lengths.label())   # (one per row, each in [0, length])
    if what == LONGEST:
        return np.array([int(trips.max(initial=0))], np.int64)
    return (np.arange(length)[None, :] < trips[:, None])
