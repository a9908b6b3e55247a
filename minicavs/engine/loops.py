"""A ``foreach`` or ``while_loop`` inside a vertex function as a loop of the instruction program (instructions.py
lowers F's and ∂F's steps; a loop whose per-step values are per-row or one row comes here). Each loop has a
depth (the loops around it), and each depth a counter and a trip count: ``LOOP trips n depth`` sets them (0 and
``trips``; no trips: skips the body and its ``ENDLOOP``), ``LOOPN count most n depth`` sets the trip count from
a one-value int64 static read where the loop runs (``foreach(steps=n)`` with ``n`` computed without the row
axis; ∂F's reverse loop over the steps a while_loop ran), refused outside [0, most]; ``ENDLOOP trips n depth``
adds 1 to the counter and goes back to the body's first instruction while it is below the trip count. A
while_loop's condition is lowered at the top of the body, then ``WHILE n cond`` leaves the loop when its one
value is 0 (``trips`` is its max_iterations). The body is lowered inline once by F's own step lowering
(branches.inline, as a cond's bodies are). A per-row value (rows, T, D) is a matrix of flat rows of T x D:
``STEPCOLS`` points a register at the counter's step block (step t: columns t x D, counted from the last step
run for a reverse loop), so an input's slice is a view, and a stacked output's step (a saved pre-step state's,
for the gradient) is copied into its block; a loop that may stop early zeroes those first. Each carried state
lives in memory of its own (the result's, for a final state), the body's new state copied there at the end of
the body (one handed on from a state copied aside first).

∂F's loops (the gradient of a loop is a reverse foreach over the saved pre-step states, carrying the state
cotangents and the sums of the captured values' gradients: states without a row axis; a while_loop's over the
steps it ran, a count the gradient computes as a static) are tuple nodes: every result gets memory, and each
``item`` of it (:func:`lower_item`) is a view of its result or a copy into the item's own memory."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..core.dtypes import int64
from ..ir.graph import Node
from ..ops.flow import flow, is_loop
from ..ops.registry import OPS, holds_tuple
from ..ops.subgraph import item_index
from .branches import body_steps, inline
from .codegen.opcodes import MAX_DEPTH
from .lowered import NONE, Template, _cols, _rows
from . import row_trips


def loops(t: Template, step, ints: bool = False) -> bool:
    """Does ``step`` lower to a loop: a foreach or while_loop (or one result of one) of one float type (``ints``:
    its iterated inputs may be int values, which a static program binds in that float type), whose
    trip count is fixed, a one-value int64 static (``steps=``, read where the loop runs) or a while_loop's
    condition (one value of that type, computed in the loop), whose per-step values (sliced inputs, stacked
    outputs, saved states) are per-row or one row, which nests at most MAX_DEPTH deep and whose steps-run
    count no one reads here (an int)."""
    node = step.outputs[0]
    if step.fused or not is_loop(node) or len(step.outputs) != 1:
        return False
    f = flow(node)
    if f is None or not node.dtype.is_float or _depth(t) >= MAX_DEPTH or \
            (_reads_count(t, node, f) and not ints):   # (a static program hands its count out: STEPS)
        return False
    test = dict(f.bodies).get("cond")
    if f.counted and test is None and _trip_count(t, step) is None:
        return False
    if test is not None and (test.outputs[0].dtype != node.dtype or test.outputs[0].has_rows):
        return False
    if any(x in t.literals and not (f.iterated <= i < f.iterated + f.states and _zero(x))
           for i, x in enumerate(step.inputs)):   # (a body's literal input: only a zero initial state, ZERO)
        return False
    body = f.bodies[0][1]
    states = body.args[f.iterated:f.iterated + f.states]
    per_step = list(body.args[:f.iterated]) + list(body.outputs[:f.outputs]) + (list(states) if f.saves else [])
    if not all(v.has_rows or _rows(v) == 1 for v in per_step):
        return False
    iterated = [] if ints else list(step.inputs[:f.iterated])
    iterated += [v for v in step.inputs[:f.iterated] if ints and v.dtype.is_float]
    return all(v.dtype == node.dtype for v in iterated + list(step.inputs[f.iterated:f.iterated + f.states])
               + list(body.outputs))


def _zero(x: Node) -> bool:
    """Is literal ``x`` (a constant the lowering folds into kernels) all zeros?"""
    value = OPS[x.op].literal(x)
    return value is not None and not np.any(value)


def _depth(t: Template) -> int:
    """How many loops the instructions being lowered are inside (the depth of a loop lowered now)."""
    return sum(1 for guard in t.guard if guard[0] == "loop")


def _first_saved(f) -> int:
    """The result index of a loop's first saved state (after its outputs, final states and a while_loop's
    count)."""
    return f.outputs + f.states + (1 if "cond" in dict(f.bodies) else 0)


def _reads_count(t: Template, node: Node, f) -> bool:
    """Is a while_loop's count of steps run (an int64 result) what ``node`` is, or one of its items read outside
    a loop's body? (Inside one, a nested while's gradient, STEPS writes it in the program's float type into
    memory of its own, which only that body's loops read: LOOPR.)"""
    if "cond" not in dict(f.bodies):
        return False
    count, pick = f.outputs + f.states, node.attrs.get("_pick")
    held = pick if pick is not None else range(_first_saved(f) + (f.states if f.saves else 0))
    if not holds_tuple(node):
        return count in held
    return _depth(t) == 0 and any(i == count and (node, at) in t.items for at, i in enumerate(held))


def _trip_count(t: Template, step) -> tuple | None:
    """Where a foreach's run-time trip count (its last input, one int64 value for every row) is: ("static",
    its buffer), a one-value static the template binds; ("register", its register), a while_loop's count that
    STEPS wrote (inside a loop's body, or in a static program); None: neither."""
    count = step.inputs[-1]
    origin = t.origins.get(count, count)
    if row_trips.per_row(step.outputs[0]):   # (a static graph's: the longest row's, bound from the lengths)
        return ("static", t.buf((row_trips.LONGEST, origin, step.outputs[0].attrs["length"]))) if _depth(t) == 0 \
            else None
    if origin.dtype != int64 or math.prod(origin.shape) != 1 or origin.has_rows:
        return None
    if ("static", origin) in t.buffers:
        return "static", t.buffers[("static", origin)]
    return ("register", t.regs[count]) if count in t.regs else None   # (at depth 0: a static program's while)


# how the lowering runs a node as a view of its input (a column block, a reshape keeping the flat rows, a 2-D
# transpose: the registry's ``native`` kinds)
_VIEWS = ("cols", "alias", "transpose")


def _may_view(n: Node) -> bool:
    opdef = OPS[n.op]
    return opdef.identity or (opdef.native is not None and opdef.native(n) in _VIEWS)


def _views_of_states(body, states) -> set:
    """The values of ``body`` that may be views of one of its ``states``' placeholders (a new state that is
    one may be overwritten by another state's copy before its own: a swap of two states)."""
    views = set(states)
    for n in body.computed:
        if _may_view(n) and n.inputs and n.inputs[0] in views:
            views.add(n)
    return views


def lower_loop(t: Template, step, statics: set, device, singles: dict, lower_step: Callable) -> None:
    """A loop as LOOP (LOOPN: its trip count read where it runs) ... ENDLOOP around its body lowered inline: a
    while_loop's condition and WHILE first, the saved states' and input blocks (STEPCOLS), the body's steps,
    the wanted outputs' blocks copied, the new states copied into their memory. Only what the node's results
    read is computed (∂F's per-vertex node carries no parameter gradients)."""
    node = step.outputs[0]
    f = flow(node)
    body, test = f.bodies[0][1], dict(f.bodies).get("cond")
    results = _results(t, node, f, body)
    prefix = row_trips.Prefix(t, node, step.inputs) if row_trips.per_row(node) else None
    if prefix is not None:   # (its per-row results written longest row first, put back after it)
        results = prefix.results(results, _shapes(f, body), row_trips.unread_past_run(node))
    outs, carried = _needed(f, body, results, device, singles, test)
    slots, states = body.args[:f.iterated], body.args[f.iterated:f.iterated + f.states]
    placed = _carried(t, step, f, body, results, carried, prefix)
    placed.update((p, t.reg(name=f"{p.name or 'x'}[t]")) for p in slots)
    if f.counted:   # (steps not run stay zero)
        _zero_stacked(t, f, body, results, row_trips.unread_past_run(node))
    outer = dict(t.regs)
    sources = [outer[x] if prefix is None or not p.has_rows else prefix.sorted(outer[x], f.length * _cols(p))
               for p, x in zip(slots, step.inputs[:f.iterated])]
    depth, begin = _depth(t), len(t.code)
    t.emit("LOOP", f.length, 0, depth)
    order = (-1, -1, depth) if f.reverse else (0, 1, depth)
    if prefix is not None:   # (first in the body: every instruction after it runs over the step's active rows)
        prefix.step(order)
    t.regs.update(placed)
    t.items.update((n.inputs[0], item_index(n)) for sub in (body, test) if sub is not None for n in sub.computed
                   if item_index(n) is not None)   # (a loop inside: the results its items read)
    try:
        exit_at = _test(t, test, body, (statics, device, singles), lower_step, begin) if test else None
        for p, source in zip(slots, sources):
            t.emit("STEPCOLS", placed[p], source, _cols(p), *order)
        for j in carried:
            if _first_saved(f) + j in results:   # (the gradient's saved pre-step state)
                _into_block(t, results[_first_saved(f) + j], placed[states[j]], states[j], order)
        blocks = [_block(t, results[k], body.outputs[k], order) for k in outs]   # (a kernel writes its step there)
        added = _added(f, body, carried)
        wanted = tuple(body.outputs[k] for k in outs) + tuple(added.get(j, body.outputs[f.outputs + j])
                                                              for j in carried)
        regs = inline(t, body, list(body.args), (statics, device, singles), lower_step, ("loop", begin), wanted,
                      {body.outputs[k]: b for k, b in zip(outs, blocks)})
    finally:
        t.regs = outer
    for k, reg, block in zip(outs, regs, blocks):
        if reg != block:
            t.emit("COPY", block, reg, _rows(body.outputs[k]), _cols(body.outputs[k]))
    new = dict(zip(carried, regs[len(outs):]))
    for j in added:   # (a sum over the steps: its term added in place)
        _add_in_place(t, begin, placed[states[j]], new.pop(j), states[j])
    _new_states(t, body, states, f.outputs, list(new), list(new.values()), placed)
    t.emit("ENDLOOP", f.length, len(t.code) - begin, depth)
    _close(t, step, f, begin, exit_at)
    if prefix is not None:
        prefix.close(depth)
    if f.outputs + f.states in results and test is not None:   # (its count of steps run, read in this body)
        t.emit("STEPS", results[f.outputs + f.states], depth)


def _added(f, body, carried: list) -> dict:
    """Carried state j -> the term v where its new value is ``state + v`` (v a product, a column sum: computed
    by an instruction of its own) and nothing else reads the state or the sum (a loop's gradient summing a
    parameter's over the steps): ADD v into the state's memory, rather than the sum computed aside and
    copied."""
    states = body.args[f.iterated:f.iterated + f.states]
    readers: dict = {}
    for n in body.computed:
        for x in n.inputs:
            readers.setdefault(x, []).append(n)
    found = {}
    for j in carried:
        p, new = states[j], body.outputs[f.outputs + j]
        if p.has_rows or not OPS[new.op].sums or len(new.inputs) != 2 or readers.get(new):
            continue
        others = [x for x in new.inputs if x is not p]
        term = OPS[others[0].op] if len(others) == 1 else None   # (one an instruction of its own computes)
        if term is not None and not (term.fusible or term.source) and others[0] not in states and \
                readers.get(p) == [new] and readers.get(others[0]) == [new] and \
                list(body.outputs).count(new) == 1 and others[0] not in body.outputs:
            found[j] = others[0]
    return found


def _add_in_place(t: Template, begin: int, total: int, term: int, state: Node) -> None:
    """total += term: the body's product that computed ``term`` made to add into ``total`` itself (GEMM's bias
    -2: BLAS's beta 1, no product written aside and read again), else an ADD."""
    for i in range(len(t.code) - 1, begin, -1):
        code = t.code[i]
        if code[0] == "GEMM" and code[1] == term and code[7] == -1:
            t.code[i] = ("GEMM", total) + tuple(code[2:7]) + (-2,)
            return
    t.emit("ADD", total, term, _rows(state), _cols(state))


def _new_states(t: Template, body, states, first: int, carried: list, regs: list, placed: dict) -> None:
    """Each carried state's new value copied into its memory (a per-row loop's: its active rows); a new
    value that may be a view of a state (a state handed on: its own unchanged, or another's) is first copied
    aside, so no state's copy overwrites what another's still reads."""
    views = _views_of_states(body, states)
    sources = []
    for j, reg in zip(carried, regs):
        new, p = body.outputs[first + j], states[j]
        if new is p:   # (unchanged: nothing to copy)
            continue
        if new in views:
            aside = _memory(t, p.has_rows, _rows(p), _cols(p), f"{p.name or 's'}'")
            t.emit("COPY", aside, reg, _rows(p), _cols(p))
            reg = aside
        sources.append((placed[p], reg, p))
    for dst, reg, p in sources:
        t.emit("COPY", dst, reg, _rows(p), _cols(p))


def _close(t: Template, step, f, begin: int, exit_at: int | None) -> None:
    """The loop's opening (LOOP; LOOPN or LOOPR over a run-time trip count, in a static or a register) and its
    WHILE given their targets: past the ENDLOOP just emitted."""
    end = len(t.code) - 1
    where = _trip_count(t, step) if f.counted and exit_at is None else None
    if where is not None and where[0] == "static":
        t.code[begin] = ("LOOPN", where[1], f.length, end - begin, t.code[begin][3])
    elif where is not None:
        t.code[begin] = ("LOOPR", f.length, end - begin, t.code[begin][3], where[1])
    else:
        t.code[begin] = ("LOOP", f.length, end - begin, t.code[begin][3])
    if exit_at is not None:
        t.code[exit_at] = ("WHILE", end - exit_at, t.code[exit_at][2])


def _test(t: Template, test, body, where: tuple, lower_step: Callable, begin: int) -> int:
    """A while_loop's condition lowered inline over the loop's registers (its placeholders are the body's:
    the states and captured values) and WHILE on its one value; returns WHILE's index (its target is set
    when the loop closes)."""
    (pred,) = inline(t, test, list(body.args), where, lower_step, ("loop", begin), (test.outputs[0],))
    t.emit("WHILE", 0, pred)
    return len(t.code) - 1


def _zero_stacked(t: Template, f, body, results: dict, unread: frozenset = frozenset()) -> None:
    """A loop that may stop early: its stacked outputs and saved states zeroed first (their steps not run),
    but for the ``unread`` results, which nothing reads past the steps run."""
    states = body.args[f.iterated:f.iterated + f.states]
    stacked = [(k, body.outputs[k]) for k in range(f.outputs)] + [(_first_saved(f) + j, p)
                                                                 for j, p in enumerate(states)]
    for i, v in stacked:
        if i in results and i not in unread:
            t.emit("ZERO", results[i], _rows(v), f.length * _cols(v))


def _needed(f, body, results: dict, device, singles: dict, test=None) -> tuple[list, list]:
    """The outputs wanted and the states carried: those wanted, those a while_loop's condition reads, and
    those the steps computing a carried or wanted value read (a fused step reads what any of its outputs
    does)."""
    outs = [k for k in range(f.outputs) if k in results]
    carried = {j for j in range(f.states) if f.outputs + j in results or _first_saved(f) + j in results}
    states = body.args[f.iterated:f.iterated + f.states]
    if test is not None:
        steps, _ = body_steps(test, (test.outputs[0],), device, singles)
        read = {test.outputs[0]}.union(*(step.inputs for step in steps))
        carried |= {j for j, p in enumerate(test.args[f.iterated:f.iterated + f.states]) if p in read}
    while True:
        wanted = tuple(body.outputs[k] for k in outs) + tuple(body.outputs[f.outputs + j] for j in sorted(carried))
        steps, concats = body_steps(body, wanted, device, singles)
        read = set(wanted).union(*(step.inputs for step in steps), *(c.inputs for c, _ in concats))
        more = carried | {j for j, p in enumerate(states) if p in read}
        if more == carried:
            return outs, sorted(carried)
        carried = more


def _results(t: Template, node: Node, f, body) -> dict:
    """Result index (among the loop's outputs, final states, a while_loop's count and saved states) -> the
    register of its memory:
    the results a tuple node holds (all, or those it picks) that an item of it reads (their registers kept in
    ``t.tuples`` for its items, in its order), else the one the node is (a picked result, or the only one)."""
    pick = node.attrs.get("_pick")
    if not holds_tuple(node):
        return {pick[0] if pick else 0: t.regs[node] if node in t.regs else t.scratch_reg(node)}
    shapes = _shapes(f, body)
    held = pick if pick is not None else range(len(shapes))
    # (an item with memory of its own, a stored tensor, is the result's memory: loop_grad.py's saved values)
    bound = {item_index(n): r for n, r in t.regs.items() if item_index(n) is not None and n.inputs[0] is node}
    results = {i: bound[at] if at in bound else _memory(t, *shapes[i], f"{node.name or 'loop'}.{i}")
               for at, i in enumerate(held) if (node, at) in t.items}   # (a result no item reads: not computed)
    t.tuples[node] = [results.get(i) for i in held]
    t.reg(node)   # (the tuple's own register, unused: its items read ``t.tuples``)
    return results


def _shapes(f, body) -> list:
    """Per result of the loop (its outputs, final states, a while_loop's count, saved states): (has rows, rows,
    columns) of its memory: a stacked per-row value's rows of its steps side by side, a stacked one-row value's
    steps as rows (its items' (steps, ...) shape)."""
    def stacked(v: Node) -> tuple:
        return (True, _rows(v), f.length * _cols(v)) if v.has_rows else (False, f.length * _rows(v), _cols(v))
    states = body.args[f.iterated:f.iterated + f.states]
    shapes = [stacked(o) for o in body.outputs[:f.outputs]]
    shapes += [(p.has_rows, _rows(p), _cols(p)) for p in states]
    shapes += [(False, 1, 1)] * (_first_saved(f) - f.outputs - f.states)   # (a while_loop's count: STEPS's)
    return shapes + ([stacked(p) for p in states] if f.saves else [])


def _carried(t: Template, step, f, body, results: dict, carried: list, prefix=None) -> dict:
    """Placeholder -> register before the loop: the captured values' own, each carried state's memory (its
    final result's, else its own) with the initial state copied in (a literal zero: zeroed); ``prefix`` (a
    per-row loop's row_trips.Prefix): per-row ones copied with their rows longest first."""
    captured = f.iterated + f.states
    placed = {p: t.regs[c] if prefix is None or not p.has_rows else prefix.sorted(t.regs[c], _cols(p), p.name or "x")
              for p, c in zip(body.args[captured:], step.inputs[captured:])}
    t.origins.update((p, t.origins.get(c, c)) for p, c in zip(body.args[captured:], step.inputs[captured:]))
    for j in carried:
        p, mine, first = body.args[f.iterated + j], results.get(f.outputs + j), step.inputs[f.iterated + j]
        placed[p] = mine if mine is not None else _memory(t, p.has_rows, _rows(p), _cols(p), f"{p.name or 's'}")
        if first in t.literals:   # (a zero: loops() takes no other literal)
            t.emit("ZERO", placed[p], _rows(p), _cols(p))
        elif prefix is not None and p.has_rows:
            t.emit("ROWPERM", placed[p], t.regs[first], prefix.order, _cols(p))
        else:
            t.emit("COPY", placed[p], t.regs[first], _rows(p), _cols(p))
    return placed


def _block(t: Template, stacked: int, node: Node, order: tuple) -> int:
    """A register at the step's block of the stacked register (``node``'s shape: per-row or one row)."""
    block = t.reg(name="block[t]")
    t.emit("STEPCOLS", block, stacked, _cols(node), *order)
    return block


def _into_block(t: Template, stacked: int, value: int, node: Node, order: tuple) -> None:
    """The step's value (``node``'s shape: per-row or one row) copied into its block of the stacked register."""
    block = t.reg(name="block[t]")
    t.emit("STEPCOLS", block, stacked, _cols(node), *order)
    t.emit("COPY", block, value, _rows(node), _cols(node))


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
        if out != value:   # (a cond's result written in place: ops/cond_grad.py)
            t.emit("COPY", out, value, _rows(node), _cols(node))
    else:
        t.emit("ALIAS", t.reg(node), value)
    # (a per-row loop's result kept in its sorted order too: row_trips.Prefix)
    t.sorted.update({(guard, order, t.regs[node]): copy for (guard, order, r), copy in list(t.sorted.items())
                     if r == value})
    return True
