"""A ``foreach`` inside a vertex function as a loop of the instruction program (instructions.py lowers F's
steps; a foreach of a fixed trip count over per-row values comes here). ``LOOP trips n`` sets the loop counter to
0 (no trips: skips the body and its ``ENDLOOP``); ``ENDLOOP trips n`` adds 1 to it and goes back to the body's
first instruction while it is below ``trips``. The body is lowered inline once by F's own step lowering
(branches.inline, as a cond's bodies are): a per-row input (rows, T, D) is a matrix of flat rows of T x D, and
``STEPCOLS`` points its placeholder at the counter's column block (t x D); a stacked output is copied into the
result's block at t x width; each carried state lives in memory of its own (the result's, for a final state),
the body's new state copied there at the end of the body. Only F: ∂F's loops (tuple nodes over saved states)
are still APPLY, which the C loops decline."""
from __future__ import annotations

from typing import Callable

from ..ops.control import flow, is_loop
from ..ops.registry import holds_tuple
from .branches import inline
from .lowered import Template, _cols, _rows


def loops(t: Template, step) -> bool:
    """Does ``step`` lower to a loop: one result of a foreach of fixed length, forward, saving nothing, whose
    inputs, states and body results are per-row values of the result's float type, whose body holds no loop
    (one counter) and returns no placeholder (each state is computed, not handed on)."""
    node = step.outputs[0]
    if step.fused or node.op != "foreach" or len(step.outputs) != 1 or holds_tuple(node):
        return False
    f = flow(node)
    if f is None or f.counted or f.reverse or f.saves or not node.dtype.is_float:
        return False
    body = f.bodies[0][1]
    values = list(step.inputs[:f.iterated + f.states]) + list(body.outputs) + [node]
    if not all(v.has_rows and v.dtype == node.dtype for v in values):
        return False
    return not any(is_loop(n) for n in body.computed) and not set(body.outputs).intersection(body.args)


def lower_loop(t: Template, step, statics: set, device, singles: dict, lower_step: Callable) -> None:
    """A foreach as LOOP ... ENDLOOP around its body lowered inline: the per-step input blocks (STEPCOLS), the
    body's steps, the picked output's block copied into the result, the new states copied into their memory."""
    node = step.outputs[0]
    f, pick = flow(node), node.attrs.get("_pick")
    body, result = f.bodies[0][1], pick[0] if pick else 0
    out = t.regs[node] if node in t.regs else t.scratch_reg(node)
    xs, inits = step.inputs[:f.iterated], step.inputs[f.iterated:f.iterated + f.states]
    slots, states = body.args[:f.iterated], body.args[f.iterated:f.iterated + f.states]
    placed = {p: t.regs[c] for p, c in zip(body.args[f.iterated + f.states:], step.inputs[f.iterated + f.states:])}
    t.origins.update((p, t.origins.get(c, c)) for p, c in zip(body.args[f.iterated + f.states:],
                                                                step.inputs[f.iterated + f.states:]))
    for j, (p, init) in enumerate(zip(states, inits)):
        placed[p] = out if result == f.outputs + j else _scratch(t, p)
        t.emit("COPY", placed[p], t.regs[init], _rows(p), _cols(p))
    placed.update((p, t.reg(name=f"{p.name or 'x'}[t]")) for p in slots)
    begin = len(t.code)
    t.emit("LOOP", f.length, 0)
    for p, x in zip(slots, xs):
        t.emit("STEPCOLS", placed[p], t.regs[x], _cols(p))
    outer = dict(t.regs)
    t.regs.update(placed)
    try:
        regs = inline(t, body, list(body.args), (statics, device, singles), lower_step, ("loop", begin))
    finally:
        t.regs = outer
    if result < f.outputs:   # the picked output's step block
        block = t.reg(name=f"{node.name or 'out'}[t]")
        t.emit("STEPCOLS", block, out, _cols(body.outputs[result]))
        t.emit("COPY", block, regs[result], _rows(node), _cols(body.outputs[result]))
    for j, p in enumerate(states):
        t.emit("COPY", placed[p], regs[f.outputs + j], _rows(p), _cols(p))
    t.emit("ENDLOOP", f.length, len(t.code) - begin)
    t.code[begin] = ("LOOP", f.length, len(t.code) - 1 - begin)


def _scratch(t: Template, node) -> int:
    """A state's memory of its own (scratch of the task's rows), its register not kept as ``node``'s."""
    r = t.scratch_reg(node)
    del t.regs[node]
    return r
