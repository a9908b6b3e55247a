"""Loops of a static graph inside its instruction program (engine/static_program.py): a ``foreach`` or a
``while_loop`` there, and the reverse foreach of its gradient, are the loops F's lowering already makes
(engine/loops.py: LOOP/LOOPN ... ENDLOOP, STEPCOLS per step), since a static graph is a vertex function with one
task and no messages.

What a static graph adds to F's loops: it iterates over int values (a decoder's target ids, a language model's
next words). Such a value, one int per row and step, is given to the program in its float type (a whole number
per entry, exact: checked when bound) so that a step's column of it is a STEPCOLS view as any other, and the only
instructions that read it are the row functions' labels (ROWOP with its labels in a register). What else reads an
int inside a body (an index into a table, arithmetic on ids) keeps the graph on the step runner, and says so.
"""
from __future__ import annotations

from ..ir.graph import Node
from ..ops.flow import flow, is_cond, is_loop
from ..ops.registry import OPS, holds_tuple
from ..ops.subgraph import item_index
from . import instructions, static_branches
from .loops import loops, lower_loop


def flow_refusal(n: Node) -> str | None:
    """Why no instruction computes control-flow node ``n`` (a loop, a result of one, a cond) in a static
    program; None: the program lowers it (a loop the lowering then declines is given back, with its reason)."""
    if is_cond(n):
        return static_branches.refusal(n)
    if item_index(n) is not None:
        return None if n.dtype.is_float or is_count(n) else f"an {n.dtype.name} result of a loop (its steps run)"
    if not is_loop(n):
        return "a tuple value no instruction holds" if holds_tuple(n) else None
    f = flow(n)
    if not n.dtype.is_float:
        return f"a loop of {n.dtype.name} values"
    for _, body in f.bodies:
        why = _int_reads(body)
        if why is not None:
            return why
    return None


def is_count(n: Node) -> bool:
    """Is ``n`` a while_loop's count of steps run (an int64 item, outside any body): the program writes it in its
    float type (STEPS) and hands it out converted (:func:`as_int`)."""
    f = flow(n.inputs[0]) if item_index(n) is not None and is_loop(n.inputs[0]) else None
    if f is None or "cond" not in dict(f.bodies):
        return False
    pick = n.inputs[0].attrs.get("_pick")
    held = pick if pick is not None else range(f.outputs + f.states + 1)
    return item_index(n) < len(held) and held[item_index(n)] == f.outputs + f.states


def as_int(value, n: Node):
    """A count the program wrote in its float type (a whole number) as ``n``'s int value, on the same device."""
    return value.astype(n.dtype.np)


def _int_reads(body) -> str | None:
    """Why ``body`` (and the bodies in it) reads an int value otherwise than as a row function's labels or a
    loop's iterated input (None: it does not)."""
    for n in body.computed:
        for i, x in enumerate(n.inputs):
            if not x.dtype.is_float and not _reads_int(n, i):
                return f"{n.label()} in loop body '{body.name}' reads the int value {x.label()} (a static " \
                       "program reads a loop's int values as labels only)"
        if not n.dtype.is_float and not holds_tuple(n):
            return f"{n.label()} in loop body '{body.name}' computes an {n.dtype.name} value"
        f = flow(n)
        for _, inner in (f.bodies if f is not None else ()):
            why = _int_reads(inner)
            if why is not None:
                return why
    return None


def _reads_int(n: Node, i: int) -> bool:
    """Does ``n`` read its input ``i`` as a program reads an int value: a row function's labels (its last
    input), a loop's iterated input, a one-value trip count?"""
    lowering = OPS[n.op].row_lowering
    if lowering is not None and lowering.labels and i == len(n.inputs) - 1:
        return True
    f = flow(n) if is_loop(n) else None
    return f is not None and (i < f.iterated or (f.counted and i == len(n.inputs) - 1))


def read_as_float(n: Node) -> bool:
    """Is ``n`` an int value the program reads in its float type (one int per row and step: a loop's input)?"""
    return not n.dtype.is_float and n.has_rows


def lower_step(t, step, statics: set, device, singles: dict, own_step, is_own) -> None:
    """One step of a static program: a loop or a cond (their bodies' steps lowered by this function again), a row
    function (``own_step``, where ``is_own`` says so), or F's step lowering."""
    node = None if step.fused else step.outputs[0]
    if node is not None and is_loop(node):
        for x in step.inputs:
            if x not in t.regs and x in statics:
                t.emit("STATIC", t.reg(x), t.buf(("static", x)))
        if loops(t, step, ints=True):
            lower_loop(t, step, statics, device, singles, _again(own_step, is_own))
            return
        raise instructions.Unsupported(f"{node.label()}: a loop F's lowering does not take (a trip count it "
                                       "cannot read where the loop runs, per-step values of another shape)")
    if node is not None and is_cond(node):
        static_branches.lower(t, step, statics, device, singles, _again(own_step, is_own))
    elif node is not None and is_own(node):
        own_step(t, step, statics)
    else:
        instructions._step(t, step, statics, device, singles)


def _again(own_step, is_own):
    """This module's step lowering, as a loop's body lowers its steps (loops.lower_loop's ``lower_step``)."""
    def step_lowering(t, step, statics, device, singles) -> None:
        lower_step(t, step, statics, device, singles, own_step, is_own)
    return step_lowering


def label_classes(nodes) -> dict:
    """Int value -> the classes of the labels a loop of ``nodes`` reads it as (the fewest of its readers': its
    entries are checked against them when bound, on the host, so that no runner meets a label out of range)."""
    classes: dict = {}
    for n in nodes:
        f = flow(n) if is_loop(n) else None
        if f is None:
            continue
        for _, body in f.bodies:
            for x, p in zip(n.inputs[:f.iterated], body.args[:f.iterated]):
                if x.dtype.is_float:
                    continue
                for reader in body.computed:
                    lowering = OPS[reader.op].row_lowering
                    if lowering is not None and lowering.labels and reader.inputs[-1] is p:
                        cols = reader.inputs[lowering.source].shape[-1]
                        classes[x] = min(classes.get(x, cols), cols)
    return classes
