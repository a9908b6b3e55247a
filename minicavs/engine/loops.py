"""A ``foreach`` inside a vertex function as a loop of the instruction program (instructions.py lowers F's and
∂F's steps; a foreach of a fixed trip count whose per-step values are per-row comes here). ``LOOP trips n`` sets
the loop counter to 0 (no trips: skips the body and its ``ENDLOOP``); ``ENDLOOP trips n`` adds 1 to it and goes
back to the body's first instruction while it is below ``trips``. The body is lowered inline once by F's own
step lowering (branches.inline, as a cond's bodies are). A per-row value (rows, T, D) is a matrix of flat rows
of T x D: ``STEPCOLS`` points a register at the counter's step block (step t: columns t x D, counted from the
end for a reverse loop), so an input's slice is a view, and a stacked output's step (a saved pre-step state's,
for the gradient) is copied into its block. Each carried state lives in memory of its own (the result's, for a
final state), the body's new state copied there at the end of the body.

∂F's loops (the gradient of a foreach is a reverse foreach over the saved pre-step states, carrying the state
cotangents and the sums of the captured values' gradients: states without a row axis) are tuple nodes: every
result gets memory, and each ``item`` of it (:func:`lower_item`) is a view of its result or a copy into the
item's own memory."""
from __future__ import annotations

from typing import Callable

from ..ir.graph import Node
from ..ops.flow import flow, is_foreach, is_loop
from ..ops.registry import OPS, holds_tuple
from ..ops.subgraph import item_index
from .branches import body_steps, inline
from .lowered import NONE, Template, _cols, _rows


def loops(t: Template, step) -> bool:
    """Does ``step`` lower to a loop: a foreach (or one result of one) of fixed length, of one float type,
    whose sliced inputs, stacked outputs and saved states are per-row, whose body holds no loop (one counter)
    and returns no placeholder nor a view of one (each result is computed, not handed on)."""
    node = step.outputs[0]
    if step.fused or not is_foreach(node) or len(step.outputs) != 1:
        return False
    f = flow(node)
    if f is None or f.counted or not node.dtype.is_float:
        return False
    body = f.bodies[0][1]
    states = body.args[f.iterated:f.iterated + f.states]
    per_step = list(step.inputs[:f.iterated]) + list(body.outputs[:f.outputs]) + (list(states) if f.saves else [])
    if not all(v.has_rows for v in per_step):
        return False
    if any(v.dtype != node.dtype for v in list(step.inputs[:f.iterated + f.states]) + list(body.outputs)):
        return False
    return not any(is_loop(n) for n in body.computed) and not _views_of_args(body).intersection(body.outputs)


# how the lowering runs a node as a view of its input (a column block, a reshape keeping the flat rows, a 2-D
# transpose: the registry's ``native`` kinds)
_VIEWS = ("cols", "alias", "transpose")


def _may_view(n: Node) -> bool:
    opdef = OPS[n.op]
    return opdef.identity or (opdef.native is not None and opdef.native(n) in _VIEWS)


def _views_of_args(body) -> set:
    """The body's placeholders and the values that may be views of one (a new state that is one may be
    overwritten by another state's copy before its own: a swap of two states)."""
    views = set(body.args)
    for n in body.computed:
        if _may_view(n) and n.inputs and n.inputs[0] in views:
            views.add(n)
    return views


def lower_loop(t: Template, step, statics: set, device, singles: dict, lower_step: Callable) -> None:
    """A foreach as LOOP ... ENDLOOP around its body lowered inline: the saved states' and input blocks
    (STEPCOLS), the body's steps, the wanted outputs' blocks copied, the new states copied into their memory.
    Only what the node's results read is computed (∂F's per-vertex node carries no parameter gradients)."""
    node = step.outputs[0]
    f = flow(node)
    body = f.bodies[0][1]
    results = _results(t, node, f, body)
    outs, carried = _needed(f, body, results, device, singles)
    slots, states = body.args[:f.iterated], body.args[f.iterated:f.iterated + f.states]
    placed = _carried(t, step, f, body, results, carried)
    placed.update((p, t.reg(name=f"{p.name or 'x'}[t]")) for p in slots)
    begin = len(t.code)
    t.emit("LOOP", f.length, 0, 0)
    order = (f.length - 1, -1) if f.reverse else (0, 1)
    for j in carried:
        if f.outputs + f.states + j in results:   # (the gradient's saved pre-step state)
            _into_block(t, results[f.outputs + f.states + j], placed[states[j]], states[j], order)
    for p, x in zip(slots, step.inputs[:f.iterated]):
        t.emit("STEPCOLS", placed[p], t.regs[x], _cols(p), *order, 0)
    wanted = tuple(body.outputs[k] for k in outs) + tuple(body.outputs[f.outputs + j] for j in carried)
    outer = dict(t.regs)
    t.regs.update(placed)
    try:
        regs = inline(t, body, list(body.args), (statics, device, singles), lower_step, ("loop", begin), wanted)
    finally:
        t.regs = outer
    for k, reg in zip(outs, regs):
        _into_block(t, results[k], reg, body.outputs[k], order)
    for j, reg in zip(carried, regs[len(outs):]):
        t.emit("COPY", placed[states[j]], reg, _rows(states[j]), _cols(states[j]))
    t.emit("ENDLOOP", f.length, len(t.code) - begin, 0)
    t.code[begin] = ("LOOP", f.length, len(t.code) - 1 - begin, 0)


def _needed(f, body, results: dict, device, singles: dict) -> tuple[list, list]:
    """The outputs wanted and the states carried: those wanted, and those the steps computing a carried or
    wanted value read (a fused step reads what any of its outputs does)."""
    outs = [k for k in range(f.outputs) if k in results]
    carried = {j for j in range(f.states) if f.outputs + j in results or f.outputs + f.states + j in results}
    states = body.args[f.iterated:f.iterated + f.states]
    while True:
        wanted = tuple(body.outputs[k] for k in outs) + tuple(body.outputs[f.outputs + j] for j in sorted(carried))
        steps, concats = body_steps(body, wanted, device, singles)
        read = set(wanted).union(*(step.inputs for step in steps), *(c.inputs for c, _ in concats))
        more = carried | {j for j, p in enumerate(states) if p in read}
        if more == carried:
            return outs, sorted(carried)
        carried = more


def _results(t: Template, node: Node, f, body) -> dict:
    """Result index (among the loop's outputs, final states and saved states) -> the register of its memory:
    the results a tuple node holds (all, or those it picks) that an item of it reads (their registers kept in
    ``t.tuples`` for its items, in its order), else the one the node is (a picked result, or the only one)."""
    pick = node.attrs.get("_pick")
    if not holds_tuple(node):
        return {pick[0] if pick else 0: t.regs[node] if node in t.regs else t.scratch_reg(node)}
    states = body.args[f.iterated:f.iterated + f.states]
    shapes = [(True, -1, f.length * _cols(o)) for o in body.outputs[:f.outputs]]
    shapes += [(p.has_rows, _rows(p), _cols(p)) for p in states]
    shapes += [(True, -1, f.length * _cols(p)) for p in states] if f.saves else []
    held = pick if pick is not None else range(len(shapes))
    results = {i: _memory(t, *shapes[i], f"{node.name or 'loop'}.{i}") for at, i in enumerate(held)
               if (node, at) in t.items}   # (a result no item reads here is not computed)
    t.tuples[node] = [results.get(i) for i in held]
    return results


def _carried(t: Template, step, f, body, results: dict, carried: list) -> dict:
    """Placeholder -> register before the loop: the captured values' own, each carried state's memory (its
    final result's, else its own) with the initial state copied in."""
    captured = f.iterated + f.states
    placed = {p: t.regs[c] for p, c in zip(body.args[captured:], step.inputs[captured:])}
    t.origins.update((p, t.origins.get(c, c)) for p, c in zip(body.args[captured:], step.inputs[captured:]))
    for j in carried:
        p, mine = body.args[f.iterated + j], results.get(f.outputs + j)
        placed[p] = mine if mine is not None else _memory(t, p.has_rows, _rows(p), _cols(p), f"{p.name or 's'}")
        t.emit("COPY", placed[p], t.regs[step.inputs[f.iterated + j]], _rows(p), _cols(p))
    return placed


def _into_block(t: Template, stacked: int, value: int, node: Node, order: tuple) -> None:
    """The step's value (``node``'s shape) copied into its block of the stacked register."""
    block = t.reg(name="block[t]")
    t.emit("STEPCOLS", block, stacked, _cols(node), *order, 0)
    t.emit("COPY", block, value, -1, _cols(node))


def _memory(t: Template, has_rows: bool, rows: int, cols: int, name: str) -> int:
    """A register over memory of its own: scratch for the task's rows, else a region of the fixed arena."""
    r = t.reg(name=name)
    if has_rows:
        t.emit("SCRATCH", r, t.scratch, cols)
        t.scratch += cols
    else:
        t.emit("BIND", r, t.buf(("fixed",)), NONE, t.fixed, cols)
        t.fixed += rows * cols
    return r


def lower_item(t: Template, step) -> bool:
    """An item of a loop lowered here: a view of its result, or (the item has memory of its own: a stored
    tensor, a gradient accumulator) a copy into it. False: not one."""
    node = step.outputs[0]
    index = item_index(node)
    if index is None or step.inputs[0] not in t.tuples:
        return False
    value = t.tuples[step.inputs[0]][index]
    kept = t.has_memory(node)
    if kept:
        out = t.regs[node] if node in t.regs else t.scratch_reg(node)
        t.emit("COPY", out, value, _rows(node), _cols(node))
    else:
        t.emit("ALIAS", t.reg(node), value)
    return True
