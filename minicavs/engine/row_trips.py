"""A loop with a trip count per row (``foreach(steps=lengths)`` in a static graph: padded sequences) in a static
program, run over its active rows alone (engine/loops.py calls this module where the template lowers such a loop).

The loop runs the batch's longest row's steps (LOOPN over a one-value static the program's binder computes from
the lengths: ("longest", lengths)). Before it, its per-row values (iterated inputs, initial states, captured
values) are copied with their rows longest first (ROWPERM by ("roworder", lengths, length, "order"): a stable
sort, so rows of one length keep their order); each step then runs over the rows still running, a prefix of
them (ROWS: the step's entry of ("rowsactive", lengths, length), the count of rows longer than the step), so a
finished row does no work: its states stay as they were, its output blocks as they were zeroed, and it adds
nothing to a sum over the rows (a loop's gradient's parameter gradients). After the loop its per-row results are
put back in the rows' order (ROWPERM by the inverse order). The tables are made on the host from the lengths
when bound, checked there (one per row, each in [0, length]); every runner checks the active-row table again
where it reads it.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Node
from ..ops.row_steps import checked_row_trips
from ..ops.flow import flow
from .lowered import Template

LONGEST, ORDER, ACTIVE = "longest", "roworder", "rowsactive"


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


class Prefix:
    """The instructions that run per-row loop ``node`` over its active rows in template ``t``: its per-row values
    copied longest row first before it (:meth:`sorted`), its per-row results written in that order and put back
    after it (:meth:`results`, :meth:`close`), the rows of each step set first in its body (:meth:`step`)."""

    def __init__(self, t: Template, node: Node, inputs):
        f = flow(node)
        lengths = t.origins.get(inputs[-1], inputs[-1])
        self.t = t
        self.order = t.buf((ORDER, lengths, f.length, "order"))
        self.inverse = t.buf((ORDER, lengths, f.length, "inverse"))
        self.active = t.buf((ACTIVE, lengths, f.length))
        self.back: list = []   # (a result's register, the register the loop writes it to, its columns, put back?)

    def sorted(self, reg: int, cols: int, name: str = "x") -> int:
        """A copy of per-row value ``reg`` (``cols`` numbers a row) with its rows longest first: the one made
        for an earlier loop over the same lengths where there is one (``t.sorted``: a static program writes a
        value once; a gradient's loop reads its forward's inputs and saved states; under the same branches)."""
        out = self.t.sorted.get((self.t.guard, self.order, reg))
        if out is None:
            out = self.t.sorted[self.t.guard, self.order, reg] = self._scratch(cols, f"{name} sorted")
            self.t.emit("ROWPERM", out, reg, self.order, cols)
        return out

    def results(self, results: dict, shapes: list, unread: frozenset) -> dict:
        """``results`` (result index -> register) with each per-row one (``shapes[i]``: has rows, rows, cols)
        replaced by scratch the loop writes in sorted order, put back by :meth:`close` but for the ``unread``
        ones (row_trips.unread_past_run: only the gradient's loop reads them, from the sorted copy)."""
        mine = {}
        for i, reg in results.items():
            has_rows, _, cols = shapes[i]
            mine[i] = self._scratch(cols, "result sorted") if has_rows else reg
            if has_rows:
                self.back.append((reg, mine[i], cols, i not in unread))
                self.t.sorted[self.t.guard, self.order, reg] = mine[i]
        return mine

    def step(self, order: tuple) -> None:
        """The step's rows: the active ones (ROWS, the loop's order: first, stride, depth)."""
        self.t.emit("ROWS", self.active, *order)

    def close(self, depth: int) -> None:
        """After the loop: the task's rows again, and the per-row results put back in the rows' order."""
        self.t.emit("ROWS", -1, 0, 0, depth)
        for reg, mine, cols, read in self.back:
            if read:
                self.t.emit("ROWPERM", reg, mine, self.inverse, cols)

    def _scratch(self, cols: int, name: str) -> int:
        r = self.t.reg(name=name)
        self.t.emit("SCRATCH", r, self.t.scratch, cols)
        self.t.scratch += cols
        return r


def bound(value, key: tuple, rows: int) -> np.ndarray:
    """What the binder gets for a LONGEST, ORDER or ACTIVE key (int64, on the host) from the lengths' ``value``
    (checked on the host: one per row, each in [0, length])."""
    what, lengths, length = key[:3]
    trips = checked_row_trips(value, rows, length, lengths.label())
    if what == LONGEST:
        return np.array([int(trips.max(initial=0))], np.int64)
    if what == ACTIVE:   # (rows longer than step t: those not ending at or before it)
        return len(trips) - np.cumsum(np.bincount(trips, minlength=length + 1)[:length])
    order = np.argsort(-trips, kind="stable")
    if key[3] == "order":
        return order
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return inverse
