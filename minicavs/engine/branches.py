"""A ``cond`` inside a vertex function as a branch of the instruction program (instructions.py lowers F's steps;
a cond whose pred is a one-value static comes here). ``BRANCH pred n`` skips the then-branch and the ``JUMP``
ending it when the pred is 0 (NaN is true, as C reads it); ``JUMP n`` skips the else-branch. Each branch is its
body's steps, fused as F's, lowered inline by F's own step lowering (passed in: ``lower_step``) with the body's
placeholders given the cond's input registers; its result is aliased to the cond's register, or copied where that
value has memory of its own. So only the taken branch runs, forward and backward (∂F's conds are the backward
bodies' conds). A body value that an earlier branch on the same side of the same pred computed is reused (a cond
of several results is a node per result in F; ∂F has a cond per gradient, each recomputing the forward body)."""
from __future__ import annotations

import contextlib
import math
from typing import Callable

from ..ir.graph import Node
from ..ops.flow import flow, is_cond
from ..ops.registry import OPS, holds_tuple
from ..ops.subgraph import item_index
from .compile import Step, lower
from .lowered import NONE, Template, _cols, _rows
from .passes.alias import elide_concats


def branches(t: Template, step, statics: set, computed: bool = False) -> bool:
    """Does ``step`` lower to a branch: a cond (of one result, or a tuple of results of one float type) whose
    pred is a one-value static of the result's (the program's) float type (in a body: the placeholder of one),
    which every loop reads where it runs (``computed``: or such a value in a register, a static program's,
    read by IF); else an APPLY."""
    node = step.outputs[0]
    if step.fused or not is_cond(node) or len(step.outputs) != 1:
        return False
    if holds_tuple(node) and not all(d == node.dtype for _, d in node.attrs["_types"]):
        return False
    pred = t.origins.get(step.inputs[0], step.inputs[0])
    given = pred in statics or computed and step.inputs[0] in t.regs
    return given and pred.dtype == node.dtype and node.dtype.is_float and math.prod(pred.shape) == 1


def _test(t: Template, pred: Node) -> tuple:
    """(the instruction of a branch on ``pred`` skipping n, as a function of n; its guard): BRANCH on its static
    buffer, else (a value the program computed) IF on its register. The guard names the branch's sides (values
    an earlier branch computed under the same guard are reused: a static's sides only, since a register's value
    may change between two conds)."""
    origin = t.origins.get(pred, pred)
    if ("static", origin) in t.buffers or pred not in t.regs:
        buf = t.buf(("static", origin))
        return (lambda n: ("BRANCH", buf, n)), buf
    reg = t.regs[pred]
    return (lambda n: ("IF", n, reg)), ("IF", len(t.code))


def lower_cond(t: Template, step, statics: set, device, singles: dict, lower_step: Callable) -> None:
    """A cond as a branch: BRANCH skips the then-branch (and the JUMP ending it) when the pred is 0, JUMP skips
    the else-branch; each branch is its body's steps lowered inline, its result given to the cond's register,
    so only the taken branch runs (NaN in the other is never computed, nor read)."""
    node, (pred, *args) = step.outputs[0], step.inputs
    (_, then), (_, else_) = flow(node).bodies
    if holds_tuple(node):
        lower_sides(t, step, (statics, device, singles), lower_step)
        return
    kept = t.has_memory(node)
    out = t.regs[node] if node in t.regs else t.scratch_reg(node) if kept else t.reg(node)
    branch, (test, guard) = len(t.code), _test(t, pred)
    t.emit(*test(0))
    for body, side in ((then, 1), (else_, 0)):
        if side == 0:
            jump = len(t.code)
            t.emit("JUMP", 0)
        with _direct(t, node, body.outputs[0]):   # (a parameter's gradient: into its accumulator)
            value = inline(t, body, args, (statics, device, singles), lower_step, (guard, side))[0]
        if not _writes_direct(t, node, value):
            _result(t, node, out, kept, value)
    t.code[branch] = test(jump - branch)
    t.code[jump] = ("JUMP", len(t.code) - jump - 1)


@contextlib.contextmanager
def _direct(t: Template, node: Node, result: Node):
    """While a body is lowered: its result computed straight into the accumulator ``node`` is computed into
    (a block's parameter gradient), as ``node`` would be."""
    if node not in t.direct and node not in t.direct_blocks:
        yield
        return
    table = t.direct if node in t.direct else t.direct_blocks
    table[result] = table[node]
    try:
        yield
    finally:
        del table[result]


def _writes_direct(t: Template, node: Node, value: int) -> bool:
    """Was a branch's result register ``value`` bound to the accumulator of ``node`` (nothing to copy)?"""
    key = ("pgrad", t.direct[node], "set") if node in t.direct else ("pgrad", t.direct_blocks[node], "block") \
        if node in t.direct_blocks else None
    if key is None or key not in t.buffers:
        return False
    for code in reversed(t.code):
        if code[0] in ("BIND", "SCRATCH", "ALIAS", "COLS") and code[1] == value:
            return code[0] == "BIND" and code[2] == t.buffers[key]
    return False


def inline(t: Template, body, args: list, where: tuple, lower_step: Callable, side: tuple,
           wanted: tuple | None = None, into: dict | None = None) -> list:
    """The registers of ``body``'s results (``wanted``: those of them only, the steps they read) after its steps, lowered as F's own with its placeholders given
    ``args``' registers (``where``: lower_step's statics, device and single kernels); the body's nodes get
    registers of this inlining alone. A step whose values an earlier
    branch on the same side of the same pred computed (a node per result of one cond; ∂F's conds, one per
    gradient, each recomputing the forward body) reuses them: that branch ran if this one runs."""
    outer, outer_literals, outer_guard = t.regs, t.literals, t.guard
    t.regs, t.literals, t.guard = dict(outer), {}, outer_guard + (side,)
    seen = t.computed.setdefault(t.guard, {})
    try:
        t.regs.update((placeholder, outer[x]) for placeholder, x in zip(body.args, args) if x in outer)
        t.origins.update((placeholder, t.origins.get(x, x)) for placeholder, x in zip(body.args, args))
        keys = _value_keys(body, [outer.get(x, -1) for x in args])   # (-1: a placeholder no wanted value reads)
        wanted = tuple(body.outputs) if wanted is None else wanted
        steps, concats = body_steps(body, wanted, where[1], where[2])
        into = into or {}
        parts = _concat_views(t, concats, into)
        # (results a kernel writes straight into the memory given them)
        t.regs.update((o, into[o]) for step in steps if step.fused or _zero(step) for o in step.outputs
                      if o in into and o not in parts)
        for step in steps:
            outs = step.outputs
            literal = OPS[outs[0].op].literal
            if not step.fused and not step.inputs and literal is not None and literal(outs[0]) is not None:
                t.literals[outs[0]] = step   # (lowered where read as a value: a kernel folds it)
            elif all(keys[o] in seen for o in outs) and not parts.intersection(outs):
                t.regs.update((o, seen[keys[o]]) for o in outs)
            else:
                lower_step(t, step, *where)
                for o in outs:
                    seen.setdefault(keys[o], t.regs[o])
        for c, _ in concats:
            seen.setdefault(keys[c], t.regs[c])
        for out in wanted:
            if out in t.literals:   # (a literal result: given a value)
                lower_step(t, t.literals.pop(out), *where)
        return [t.regs[out] for out in wanted]
    finally:
        t.regs, t.literals, t.guard = outer, outer_literals, outer_guard


def _zero(step) -> bool:
    """Is ``step`` zeros (ZERO writes them into a register's memory)?"""
    native = OPS[step.outputs[0].op].native
    return native is not None and native(step.outputs[0]) == "zero"


def _value_keys(body, arg_regs: list) -> dict:
    """Per node of ``body``, what identifies its value: its op, attributes, type and its inputs' keys (a
    placeholder: the register it reads); a node with attributes that do not hash is only itself."""
    keys: dict = {p: ("register", r) for p, r in zip(body.args, arg_regs)}
    for n in body.computed:
        try:
            attrs = tuple(sorted(n.attrs.items()))
            hash(attrs)
        except TypeError:
            keys[n] = ("node", id(n))
            continue
        keys[n] = (n.op, attrs, n.shape, n.dtype, tuple(keys[x] for x in n.inputs))
    return keys


def body_steps(body, wanted: tuple, device, singles: dict) -> tuple[list, list]:
    """A body's steps, fused as F's are (compile.lower), and the concats its kernels write in place
    (alias.elide_concats, as F's), once per body and device (kept with the function's single kernels)."""
    key = ("body", body, wanted)
    if key not in singles:
        steps = lower([[Step.of(n) for n in body.computed]], set(body.outputs), device.fused)[0][0]
        steps, concats = elide_concats(steps)
        read = set(wanted) | {m for _, blocks in concats for m, _, _ in blocks}
        live = []
        for step in reversed(steps):   # (a literal folded into its kernels is read by no step: dropped)
            if read.intersection(step.outputs):
                live.append(step)
                read.update(step.inputs)
        singles[key] = live[::-1], concats
    return singles[key]


def _concat_views(t: Template, concats: list, into: dict) -> set:
    """Each elided concat's value (in the memory ``into`` gives it, else scratch) and its parts as column blocks
    of it (the parts' kernels write there); returns the parts."""
    parts = set()
    for c, blocks in concats:
        if c in into:
            t.regs[c] = into[c]
        else:
            t.scratch_reg(c)
        for m, a, _ in blocks:
            t.emit("COLS", t.reg(m), t.regs[c], a)
            parts.add(m)
    return parts


def _result(t: Template, node: Node, out: int, kept: bool, value: int) -> None:
    """A branch's result into the cond's register: copied into its memory, or (``kept`` False) aliased."""
    if kept:
        t.emit("COPY", out, value, _rows(node), _cols(node))
    else:
        t.emit("ALIAS", out, value)


def lower_sides(t: Template, step, where: tuple, lower_step: Callable) -> None:
    """A cond of several results (a static graph's), or one that keeps each side's own results too
    (ops/cond_grad.py: its results, then the then-side's, then the else-side's), as a branch: each result an item
    reads gets a register (the item's own memory where it has
    some, memory of its own for a side result, else one each side aliases), each side writes its results and its
    own side results alone (the other side's are read only by branches on that side); items read those
    registers (t.tuples, as a loop's)."""
    node, (pred, *args) = step.outputs[0], step.inputs
    (_, then), (_, else_) = flow(node).bodies
    types = node.attrs["_types"]
    n_out, n_then, _ = node.attrs.get("_sides") or (len(types), 0, 0)   # (a static graph's cond: its results only)
    bound = {item_index(n): r for n, r in t.regs.items() if item_index(n) is not None and n.inputs[0] is node}
    memory, results = set(bound.values()), {}
    for i in sorted(i for tn, i in t.items if tn is node):
        if i in bound:
            results[i] = bound[i]
        elif i >= n_out:   # (a side result: a register valid whichever side runs)
            results[i] = _own_memory(t, types[i], f"{node.name or 'cond'}.{i}")
            memory.add(results[i])
        else:
            results[i] = t.reg(name=f"{node.name or 'cond'}.{i}")
    t.tuples[node] = [results.get(i) for i in range(len(types))]
    t.reg(node)   # (the tuple's own register, unused: its items read ``t.tuples``)
    branch, (test, guard) = len(t.code), _test(t, pred)
    t.emit(*test(0))
    _side(t, then, args, list(range(n_out + n_then)), results, memory, where, lower_step, (guard, 1))
    jump = len(t.code)
    t.emit("JUMP", 0)
    slots = list(range(n_out)) + list(range(n_out + n_then, len(types)))
    _side(t, else_, args, slots, results, memory, where, lower_step, (guard, 0))
    t.code[branch] = test(jump - branch)
    t.code[jump] = ("JUMP", len(t.code) - jump - 1)


def _side(t: Template, body, args: list, slots: list, results: dict, memory: set, where: tuple,
          lower_step: Callable, side: tuple) -> None:
    """One side's body lowered inline for the results read (``slots``: the tuple's index of each body output),
    each given to its register: written there by its kernel, else copied into memory or aliased."""
    pairs = [(body.outputs[k], results[i]) for k, i in enumerate(slots) if i in results]
    if not pairs:
        return
    into = {o: r for o, r in pairs if r in memory}
    regs = inline(t, body, args, where, lower_step, side, tuple(o for o, _ in pairs), into)
    for (o, r), value in zip(pairs, regs):
        if value == r:
            continue
        if r in memory:
            t.emit("COPY", r, value, _rows(o), _cols(o))
        else:
            t.emit("ALIAS", r, value)


def _own_memory(t: Template, typ: tuple, name: str) -> int:
    """A register over memory of its own for a value of type ``typ``: scratch rows, else the fixed arena."""
    shape, _ = typ
    r = t.reg(name=name)
    cols = math.prod(shape[1:]) if shape and shape[0] is None else math.prod(shape)
    if shape and shape[0] is None:
        t.emit("SCRATCH", r, t.scratch, cols)
        t.scratch += cols
    else:
        t.emit("BIND", r, t.buf(("fixed",)), NONE, t.fixed, cols)
        t.fixed += cols
    return r
