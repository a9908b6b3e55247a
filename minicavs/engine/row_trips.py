"""A loop with a trip count per row (``foreach(steps=lengths)`` in a static graph: padded sequences) in a static
program, as masks (engine/loops.py calls this module where the template lowers such a loop).

The loop runs the batch's longest row's steps (LOOPN over a one-value static the program's binder computes from
the lengths: ("longest", lengths)); step t reads column t of a float mask of the rows still running (("running",
lengths): 1 where t < lengths[r], made on the host from the lengths when bound, checked there: one per row, each
in [0, length]). After the body a row that has finished keeps its states and writes zeros as its outputs: each
new state and output is ``where(running, new, old)``, a select, so what a finished row computes (NaN or not)
reaches no value. A loop that also sums over its rows (a carried value without the row axis: the parameter
gradients of a loop's gradient) must see nothing of a finished row: its cotangents (the carried states with the
row axis, and the iterated inputs that are neither the forward loop's inputs nor its saved states) are masked to
zero where the body reads them, so that row adds exact zeros (its recomputed forward values are the finished
row's own, finite where the forward's were). Any other loop of that kind is declined (the step runner runs it).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..core.errors import FeedError
from ..ir.graph import Node
from ..ops import elementwise as E
from ..ops.flow import flow, is_loop
from ..ops.sources import input as placeholder
from .compile import Step
from .lowered import Template, _cols

RUNNING, LONGEST = "running", "longest"


def per_row(node: Node) -> bool:
    """Has loop ``node`` a trip count per row (its last input, an int value with the row axis)?"""
    f = flow(node)
    return f is not None and f.counted and "cond" not in dict(f.bodies) and node.inputs[-1].has_rows


def refusal(node: Node, inputs) -> str | None:
    """Why a per-row loop is not lowered as masks (None: it is): one that sums over its rows and is no other
    loop's gradient (its cotangents unknown)."""
    f = flow(node)
    body = f.bodies[0][1]
    sums = [p for p in body.args[f.iterated:f.iterated + f.states] if not p.has_rows]
    sums += [o for o in body.outputs[:f.outputs] if not o.has_rows]
    if sums and not _forward_values(inputs, f):
        return "a loop with a trip count per row that sums over its rows (not a loop's gradient)"
    return None


def _forward_values(inputs, f) -> set:
    """The iterated inputs of a loop's gradient that are forward values: the forward loop's saved states (items
    of a loop) and that loop's own inputs (empty: ``inputs`` are no loop's gradient's)."""
    saved = [x for x in inputs[:f.iterated] if x.inputs and is_loop(x.inputs[0])]
    forwards = {x.inputs[0] for x in saved}
    return set(saved) | {x for loop in forwards for x in loop.inputs}


class Masks:
    """The masks of one per-row loop being lowered into template ``t``."""

    def __init__(self, t: Template, node: Node, inputs, where: tuple, lower_step: Callable):
        self.t, self.where, self.lower_step = t, where, lower_step   # (where: lower_step's statics, device, singles)
        self.f = f = flow(node)
        lengths = inputs[-1]
        self.matrix = t.reg(name=f"running {lengths.name or lengths.id}")
        t.emit("STATIC", self.matrix, t.buf((RUNNING, lengths, f.length)))
        self.longest = t.buf((LONGEST, lengths, f.length))
        body = f.bodies[0][1]
        self.summing = any(not p.has_rows for p in body.args[f.iterated:f.iterated + f.states]) or \
            any(not o.has_rows for o in body.outputs[:f.outputs])
        forward = _forward_values(inputs, f)
        self.cotangents = {p for p, x in zip(body.args[:f.iterated], inputs) if x not in forward}
        self.cotangents |= set(body.args[f.iterated:f.iterated + f.states])
        self.column = None

    def step(self, order: tuple) -> None:
        """The running mask's column of this step (STEPCOLS, the loop's order)."""
        self.column = self.t.reg(name="running[t]")
        self.t.emit("STEPCOLS", self.column, self.matrix, 1, *order)

    def entry(self, p: Node, reg: int) -> int:
        """The register the body reads for placeholder ``p``: a cotangent of a summing loop masked to zero."""
        if not (self.summing and p in self.cotangents and p.has_rows and p.dtype.is_float):
            return reg
        out = self.t.reg(name=f"{p.name or 'x'} running")
        self.t.emit("SCRATCH", out, self.t.scratch, _cols(p))
        self.t.scratch += _cols(p)
        self._where(p, reg, None, out)
        return out

    def select(self, node: Node, dst: int, new: int) -> None:
        """dst = where(running, new, dst): a finished row keeps what ``dst`` holds (its state, its zero); the
        select goes to scratch first (a kernel's output never aliases its input: its pointers are restrict)."""
        chosen = self.t.reg(name=f"{node.name or 'x'} chosen")
        self.t.emit("SCRATCH", chosen, self.t.scratch, _cols(node))
        self.t.scratch += _cols(node)
        self._where(node, new, dst, chosen)
        self.t.emit("COPY", dst, chosen, -1, _cols(node))

    def _where(self, like: Node, new: int, old: int | None, out: int) -> None:
        """One elementwise step over ``like``'s rows into ``out`` (a fused kernel, as F's single nodes):
        where(running, new, old), or new x running."""
        singles = self.where[2]
        key = ("row mask", _cols(like), like.dtype.name, old is None)
        if key not in singles:
            m = placeholder((None, 1), like.dtype.name, name="running")
            a = placeholder((None, _cols(like)), like.dtype.name, name="new")
            b = placeholder((None, _cols(like)), like.dtype.name, name="old")
            singles[key] = (m, a, b, a * m if old is None else E.where(m, a, b))   # (a cotangent: finite, so
            # times 0 is 0)
        m, a, b, y = singles[key]
        t = self.t
        t.regs.update({m: self.column, a: new, y: out} | ({} if old is None else {b: old}))
        self.lower_step(t, Step.of(y), *self.where)
        for x in (m, a, b, y):
            t.regs.pop(x, None)


def bound(value, key: tuple, rows: int) -> np.ndarray:
    """What the binder gets for a RUNNING or LONGEST key: from the lengths' ``value`` (checked on the host)."""
    what, lengths, length = key
    trips = np.asarray(value)
    if trips.shape != (rows,):
        raise FeedError(f"{lengths.label()}: trip counts of shape {trips.shape} where the static graph's rows "
                        f"are {rows}")
    bad = np.flatnonzero((trips < 0) | (trips > length))
    if bad.size:
        r = int(bad[0])
        raise FeedError(f"{lengths.label()}[{r}] = {trips[r]}: a row's trip count must be in [0, {length}] (the "
                        "loop's length)")
    if what == LONGEST:
        return np.array([int(trips.max(initial=0))], np.int64)
    return (np.arange(length)[None, :] < trips[:, None])
