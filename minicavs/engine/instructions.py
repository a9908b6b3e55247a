"""The batch program: F and ∂F of every kind lowered to one instruction stream (VPPS's script), run by a runner.

Per vertex kind and direction (F or ∂F) the kind's steps are lowered once to a *template*: fixed-width
int64 instructions (codegen/machine.py's ``OPCODES``) whose addresses are relative to a task's rows (its offset
in the kind's dynamic tensors, its offset in the scatter tensor, its children's rows through the kind's index
arrays, the task's gather views). :func:`link` joins the kinds' templates into one program (a ``Lowered``).
Per batch, program.py binds it: the task table (kind, row offset, rows, scatter offset, the gather views and
the sibling-concat view per task, built with numpy) and the batch's buffers (program.Buffers: the workspace's
tensors, the scatter tensors and their gradients, pull and push buffers, the kind's index arrays, parameters,
parameter-gradient accumulators, one scratch arena), each resolved once by the binder (operands.py). A runner
then expands template x task table: the C runner in one C call (cpu/c_runner.py), the CUDA runner in one C call
that issues every launch (cuda/issue.py), the reference runner (reference.py), which defines every opcode, one
Python function each, on any device.

The blocks before and after the task loop (eager and lazy batching: one block per kind over all its rows) are
templates too, run as one task each of all the kind's rows (kind offset 0, scatter offset the kind's first
scatter row; program.block_rows adds their rows before and after the task table), so one call runs a pass's
blocks, tasks and blocks. A block reads and writes its kind's scatter rows through SROWS and SPUT: a view at
the scatter offset, as a task's BIND, when the batch lays those rows out contiguously (the cavs schedule of
one kind, or of leaf/internal kinds); else (scatter offset -1: 2Type's and the lattice's kinds interleaved by
height) rows copied in by the kind's row index (``srows``) and computed rows put back after the steps. So
the contiguous case copies nothing, and the other needs no second template.

Every step lowers: a step no other opcode expresses (an op with no lowering, a broadcast no kernel computes,
a fused group with more arguments than a kernel call passes) is an APPLY of its op's own implementation,
which the reference and CUDA runners run and the C runner declines (that pass then runs on the reference
runner on the same device, and dump() says why); a cond whose pred is a one-value static is a branch
(branches.py), a foreach or while_loop a loop (loops.py). Values of any shape are matrices of flat rows
(codegen/machine.matrix_shape).

Streaming runs the blocks before the task loop as a second table of the same templates, one chunk per task
over the task's rows (program.eager_rows), on the runner's second stream; a parameter gradient such a block
computes is then accumulated (GACC), never computed straight into its accumulator, since each chunk adds its
rows' part.

A per-row value of any number of axes is a matrix of flat rows of prod(vshape) numbers, row-major (MV-RNN's
(H, H) matrix per vertex: H² columns): a reshape keeping the row axis aliases the register (per-row
registers are never transposed and their rows are contiguous), a slice, concat or unslice along axis 1 is a
column block, a sum over the rows is SUMROWS over the flat columns, a fused group runs its kernel over
the flat rows (when each input broadcasts there as over its shape), a product with a per-row operand of
three axes is BMM (one product per row, an operand either per-row or a static), and a per-row transpose of
the last two axes is TRANSROWS, a copy: a flag would have to be honoured by every reader of the value (the
APPLY steps that share the kind's tensors, fused kernels, copies into stored tensors), while the copy keeps
every per-row value in the one layout they all assume.

Registers: every value of a template is a register (pointer, row stride, transposed flag, buffer) set by the
instruction that binds or computes it; views (contiguous rows, column slices, strided gathers, transposes,
identities) only set registers, computed values get a region of the scratch arena (``off`` x the task's
rows). Parameter gradients computed per task are added into accumulators zeroed per batch; one that a block
alone computes is computed straight into its accumulator.

Dropout (DROPOUT) multiplies by the mask of the task's row keys (the kind's ``rowkeys`` buffer) and one entry of
a per-run table (``dropout``: the hash word of (seed, step, site), threshold and scale; see
program.dropout_table), so a template serves every step and the masks are those of ops.nn's dropout.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.graph import Node
from ..ops.registry import OPS, holds_tuple
from ..ops.subgraph import item_index
from .branches import branches, lower_cond
from .loops import loops, lower_item, lower_loop
from .codegen.machine import ARG_KINDS, MAX_ARGS, OPCODES, OPS as OPCODE, WIDTH
from .compile import POST, PRE, TASK
from .passes.fusion import fuse, fusible
from .lowered import (BUFFER_OPERANDS, buffer_operands, KIND_ROWS, PHASE_WORDS, SCATTER_ROWS, TASK_COLUMNS,  # noqa: F401
                      Lowered, Template, _cols, _rows)
from .passes.layout import gradient_blocks


class Unsupported(Exception):
    """The lowering met steps it cannot have made (a value read before anything binds it: a
    compiler bug, not a user's op; every op lowers, APPLY the last resort)."""




def _col_offset(node: Node) -> int:
    """The first flat column of a column block along axis 1 (a slice's, an unslice's): ``start`` entries of axis 1,
    each prod(shape[2:]) numbers of the flat row (1 for a 2-D value)."""
    return int(node.attrs["start"]) * _width(node.shape[2:])


def _dim(d) -> int:
    return -1 if d is None else int(d)


# --- lowering a kind's steps -------------------------------------------------------------------------------

def _single_kernel(node: Node, device, singles: dict):
    """(group, kernel) of an elementwise node fusion left alone (``singles``: the function's, kept with it), or
    None when no kernel computes its broadcast."""
    if node not in singles:
        groups = fuse([node], [node])
        singles[node] = None if len(groups) != 1 or "other" in groups[0].broadcast else \
            (groups[0], device.fused(groups)[0])
    return singles[node]


def _flat_broadcast(x: Node, kind: str, out: Node) -> bool:
    """Does input ``x`` of a fused group broadcast the same way over ``out``'s flat rows as over its shape?
    A full operand and a scalar always; a row (read at the column) when it is as wide as a flat row; a
    column (read once per row) when each of its rows is one number."""
    if kind in ("full", "scalar"):
        return True
    if kind == "row":
        return _width(x.shape) == _cols(out)
    return kind == "col" and x.has_rows and _cols(x) == 1


def _bound(t: Template, inputs) -> None:
    """Every input has a register; a body's literal (a kernel folds it where it can) gets one here, when a
    step reads it as a value."""
    for x in inputs:
        if x not in t.regs and x in t.literals:
            _apply(t, t.literals.pop(x))
        if x not in t.regs:
            raise Unsupported(f"{x.label()} is read before anything binds it")


def _kernel_step(t: Template, group, kernel, inputs, outputs) -> bool:
    """A fused group as one FUSED instruction; False (nothing emitted) where the runners' kernels cannot run
    it: no compiled kernel, an output of more axes whose inputs do not broadcast over its flat rows as over its
    shape (or that has no row axis), more arguments than a kernel call passes."""
    if kernel is None or getattr(kernel, "address", None) == 0:   # (a C kernel without its uniform twin)
        return False
    out = group.output
    if out.ndim > 2 and (not out.has_rows or not all(   # (per-row values of more axes: over their flat rows)
            _flat_broadcast(x, kind, out) for x, kind in zip(inputs, group.broadcast))):
        return False
    if len(inputs) + len(outputs) > MAX_ARGS:
        return False
    _bound(t, inputs)
    args = []
    for x, kind in zip(inputs, group.broadcast):
        args += [t.regs[x], ARG_KINDS[kind]]
    for y in outputs:
        r = t.regs[y] if y in t.regs else t.scratch_reg(y)
        args += [r, ARG_KINDS["full"]]
    if kernel not in t.kernels:
        t.kernels.append(kernel)
    t.emit("FUSED", t.kernels.index(kernel), len(args) // 2, _rows(out), _cols(out), len(t.pool))
    t.pool += args
    return True


def _apply(t: Template, step) -> None:
    """APPLY: a step no other opcode expresses (an op with no lowering, such as a reshape that is not a view; a
    broadcast no kernel computes; a fused group too wide for a kernel call) runs as its op's own
    implementation over its inputs' values. Its outputs get scratch (or the registers already given them)."""
    _bound(t, step.inputs)
    outs = [t.regs[y] if y in t.regs else t.reg(y) if holds_tuple(y) else t.scratch_reg(y) for y in step.outputs]
    keys = t.buf(("rowkeys",)) if step.needs_ctx and any(x.has_rows for x in step.outputs) else -1
    t.emit("APPLY", len(t.steps), len(t.pool), keys)
    t.pool += [t.regs[x] for x in step.inputs] + outs
    t.steps.append(step)


def _step(t: Template, step, statics: set, device, singles: dict) -> None:
    """One step's instructions (its inputs are registers already)."""
    if lower_item(t, step):   # (an item of a loop lowered here: its tuple has no register)
        return
    for x in step.inputs:
        if x not in t.regs and x in statics:
            t.emit("STATIC", t.reg(x), t.buf(("static", x)))
    _bound(t, [x for x in step.inputs if x not in t.literals])
    if step.fused:
        if not _kernel_step(t, step.run.group, step.run.kernel, step.inputs, step.outputs):
            _apply(t, step)
        return
    node = step.outputs[0]
    opdef = OPS[node.op]
    how = opdef.native(node) if opdef.native is not None else None
    if how == "dropout":   # the mask of the task's row keys (a per-batch table entry)
        out = t.scratch_reg(node)
        t.emit("DROPOUT", out, t.regs[step.inputs[0]], _cols(node), t.buf(("rowkeys",)), t.buf(("dropout",)),
               len(t.dropouts))
        t.dropouts.append((float(node.attrs["p"]), int(node.attrs["site"])))
        return
    if opdef.identity and not opdef.needs_ctx:
        t.emit("ALIAS", t.reg(node), t.regs[step.inputs[0]])
        return
    if how == "zero":   # (into memory given it: a cond's result, engine/branches.py)
        out = t.regs[node] if node in t.regs else t.scratch_reg(node)
        t.emit("ZERO", out, _rows(node), _cols(node))
        return
    if branches(t, step, statics):
        lower_cond(t, step, statics, device, singles, _step)
        return
    if loops(t, step):
        lower_loop(t, step, statics, device, singles, _step)
        return
    if how is None:
        single = _single_kernel(node, device, singles) if fusible(node) else None
        if single is None or not _kernel_step(t, *single, single[0].inputs, single[0].outputs):
            _apply(t, step)
        return
    _lowering(t, step, how)


def _lowering(t: Template, step, how: str) -> None:
    """The instructions of the op's own lowering ``how`` (OpDef.native: the opcode that computes it)."""
    node = step.outputs[0]
    _bound(t, step.inputs)
    ins = [t.regs[x] for x in step.inputs]
    if how == "cols":
        t.emit("COLS", t.reg(node), ins[0], _col_offset(node))
    elif how == "alias":   # a per-row reshape: the same flat rows (per-row registers are never transposed)
        t.emit("ALIAS", t.reg(node), ins[0])
    elif how == "transpose":
        t.emit("TRANSPOSE", t.reg(node), ins[0])
    elif how == "transpose_rows":
        _, rows, cols = step.inputs[0].shape
        if rows == 1 or cols == 1:   # a row or column vector per row: the same flat numbers
            t.emit("ALIAS", t.reg(node), ins[0])
        else:
            t.emit("TRANSROWS", t.scratch_reg(node), ins[0], rows, cols)
    elif how == "bmm":
        a, b = step.inputs[:2]
        t.emit("BMM", t.scratch_reg(node), ins[0], ins[1], node.shape[1], node.shape[2], a.shape[-1],
               int(a.has_rows), int(b.has_rows))
    elif how == "gemm":
        a = step.inputs[0]
        bias = ins[2] if len(ins) > 2 else -1
        t.emit("GEMM", t.scratch_reg(node), ins[0], ins[1], _dim(node.shape[0]), _dim(node.shape[1]),
               _dim(a.shape[1]), bias)
    elif how == "steps_gemm":
        _steps_gemm(t, step, ins)
    elif how == "concat":
        _concat(t, step, ins)
    elif how == "unslice":
        _unslice(t, step, ins[0])
    elif how == "sum_rows":
        _sum_rows(t, step, ins[0])
    else:
        raise Unsupported(f"{node.label()}: unknown native lowering {how!r}")


def _steps_gemm(t: Template, step, ins: list) -> None:
    """Σ_t a[:, t]ᵀ · b[:, t] of two stacked per-row values: each read as rows x T rows (FLAT, a view), one GEMM
    over them all (its inner dimension -T: T times the task's rows)."""
    node = step.outputs[0]
    a, b = step.inputs
    steps = a.shape[1]
    flat_a, flat_b, flat_at = (t.reg(name=f"{t.reg_names[r]} flat") for r in (ins[0], ins[1], ins[0]))
    t.emit("FLAT", flat_a, ins[0], a.shape[2], steps)
    t.emit("FLAT", flat_b, ins[1], b.shape[2], steps)
    t.emit("TRANSPOSE", flat_at, flat_a)
    t.emit("GEMM", t.scratch_reg(node), flat_at, flat_b, node.shape[0], node.shape[1], -steps, -1)


def _concat(t: Template, step, ins: list) -> None:
    """A concat along axis 1: each input copied into its column block of a scratch value."""
    node = step.outputs[0]
    out = t.scratch_reg(node)
    col = 0
    for x, r in zip(step.inputs, ins):
        part = t.reg(name=f"{t.reg_names[out]}[:, {col}:]")
        t.emit("COLS", part, out, col)
        t.emit("COPY", part, r, _rows(node), _cols(x))
        col += _cols(x)


def _unslice(t: Template, step, source: int) -> None:
    """A slice's gradient: zeros with the input copied into the slice's column block."""
    node = step.outputs[0]
    out = t.scratch_reg(node)
    t.emit("ZERO", out, _rows(node), _cols(node))
    part = t.reg(name=f"{t.reg_names[out]}[:, {_col_offset(node)}:]")
    t.emit("COLS", part, out, _col_offset(node))
    t.emit("COPY", part, source, _rows(node), _cols(step.inputs[0]))


def _sum_rows(t: Template, step, source: int) -> None:
    """A sum over the rows alone is SUMROWS over the flat columns; any other sum is an APPLY."""
    node, x = step.outputs[0], step.inputs[0]
    if x.has_rows and x.ndim == 3 and tuple(node.attrs.get("axes", ())) == (0, 1):
        flat = t.reg(name=f"{t.reg_names[source]} flat")   # (over the rows and the steps: rows x T rows)
        t.emit("FLAT", flat, source, x.shape[2], x.shape[1])
        t.emit("SUMROWS", t.scratch_reg(node), flat, -x.shape[1], x.shape[2])
        return
    if x.has_rows and _width(node.shape) != _cols(x):
        _apply(t, step)
        return
    out = t.scratch_reg(node)   # (one flat row: a static result keeps the row-major layout)
    t.emit("SUMROWS", out, source, _dim(x.shape[0]), _cols(x))


def _width(shape) -> int:
    return int(math.prod(shape))


def _steps(t: Template, steps: list, statics: set, device, singles: dict, skip_concat: Node | None = None) -> None:
    """Each step's instructions in order; ``skip_concat``'s are skipped where the task's children are side by
    side."""
    t.items.update((o.inputs[0], item_index(o)) for step in steps for o in step.outputs
                   if item_index(o) is not None)
    for step in steps:
        if skip_concat is not None and step.outputs[0] is skip_concat:
            # the sibling concat: skipped when the task's children are side by side (CATVIEW bound it)
            mark = len(t.code)
            t.emit("SKIP_IF_CAT", 0, 0)
            _step(t, step, statics, device, singles)
            t.code[mark] = ("SKIP_IF_CAT", len(t.code) - mark - 1, 0)
        else:
            _step(t, step, statics, device, singles)


def _singles(fn, device) -> dict:
    return fn.derived(("single kernels", device), dict)


def forward_template(fn, opts, device, training: bool, phase: int = TASK) -> Template:
    """F's program of one kind in ``phase``: TASK's runs per task;
    PRE's and POST's (eager and lazy batching) run once over all the kind's rows, as a task of those rows
    (program.block_rows: kind offset 0, scatter offset the kind's first scatter row)."""
    phases = fn.phases(opts, device).forward
    f_stored = fn.placement(opts, device, training).forward_stored
    inplace, copied, concats = fn.placement(opts, device, training).forward[phase]
    t = Template(fn.F.name, phase)
    statics = set(fn.static_fwd)
    smsg = fn.scatter_message
    lazy = fn.lazy_scatter_reads(opts, device) if phase != TASK else {}
    for x in phases.reads[phase]:
        if phase == TASK or x in f_stored:
            t.bind(x, ("tensor", x), KIND_ROWS, 0, _width(x.vshape))
        else:   # the lazy phase reads the scattered value back from the scatter tensor (alias.py)
            t.scatter_view(x, ("scatter", smsg), lazy[x][0], _width(smsg))
    elide = phase == TASK and opts.gather_elision
    for j, g in fn.gathers.items():
        if phases.phase[g] == phase:
            message = fn.gather_messages[j]
            width = _width(message)
            t.emit("GATHER", t.reg(g), t.buf(("scatter", message)), width, t.buf(("child", j)), j,
                   int(elide), t.scratch)
            t.scratch += width
    cat = fn.gather_concat
    cat_view = cat is not None and elide and phases.phase.get(cat) == TASK
    if cat_view:
        message = cat.inputs[0].vshape
        t.emit("CATVIEW", t.reg(cat), t.buf(("scatter", message)), _width(message), len(fn.gathers), 0)
    for name, p in fn.pulls.items():
        if phases.phase[p] == phase:
            t.take(p, ("pull", name), _width(p.vshape), ("pullrows", name))
    for node in inplace:
        t.bind(node, ("tensor", node), KIND_ROWS, 0, _width(node.vshape))
    written = set(inplace) | {m for _, parts in concats for m, _, _ in parts}
    src, direct = fn.scatter_source, False
    for c, parts in concats:
        if c not in t.regs:
            if c is src:
                t.scatter_view(c, ("scatter", smsg), 0, _width(smsg), write=True)
                direct = True
            else:
                t.scratch_reg(c)
        for m, a, _ in parts:
            t.emit("COLS", t.reg(m), t.regs[c], a)
    if (not direct and src in phases.inplace and src not in written and phases.phase.get(src) == phase):
        t.scatter_view(src, ("scatter", smsg), 0, _width(smsg), write=True)
        direct = True
    _steps(t, phases.programs[phase], statics, device, _singles(fn, device), cat if cat_view else None)
    t.put_back()
    if fn.scattered is not None and phases.phase[fn.scattered] == phase and not direct:
        t.copy_to(("scatter", smsg), SCATTER_ROWS, _width(smsg), fn.scattered)
    for name, p in fn.pushes.items():
        if phases.phase[p] == phase:
            t.emit("PUT", t.buf(("push", name)), _width(p.vshape), t.buf(("pushrows", name)), t.regs[p],
                   _cols(p))
    for node in copied:
        t.copy_to(("tensor", node), KIND_ROWS, _width(node.vshape), node)
    return t


def backward_template(fn, opts, device, phase: int = TASK, direct: bool = False) -> Template:
    """∂F's program of one kind in ``phase`` (PRE and POST: over all
    the kind's rows, as forward_template's). ``direct`` (a block whose parameter gradients no other template
    writes): each is computed straight into its accumulator (which then needs no zeros, no GACC)."""
    phases = fn.phases(opts, device).backward
    placed = fn.placement(opts, device, True)
    inplace, copied, concats = placed.backward[phase]
    b_stored = set(placed.backward_stored)
    t = Template(fn.F.name, phase)
    if direct and phase != TASK:
        _direct_gradients(t, fn, phases, phase)
    statics = set(fn.static_fwd) | set(fn.static_bwd)
    read = _backward_reads(fn, phases, phase, copied, b_stored)
    _bind_backward_inputs(t, fn, opts, device, phases, phase, read, placed.forward_stored, b_stored)
    _cotangents(t, fn, phases, phase, b_stored)
    for node in inplace:
        t.bind(node, ("btensor", node), KIND_ROWS, 0, _width(node.vshape))
    for c, parts in concats:
        if c not in t.regs:
            t.scratch_reg(c)
        for m, a, _ in parts:
            t.emit("COLS", t.reg(m), t.regs[c], a)
    grad_cat = _children_gradient(fn, phases, inplace, concats) if opts.gather_elision and phase == TASK else None
    if grad_cat is not None:
        message = fn.gather_messages[0]
        t.overlays[grad_cat] = ("CATVIEW", t.buf(("sgrad", message)), _width(message), len(fn.gathers), 1)
    _steps(t, phases.programs[phase], statics, device, _singles(fn, device))
    for node in copied:
        t.copy_to(("btensor", node), KIND_ROWS, _width(node.vshape), node)
    _adjoints(t, fn, phases, phase, opts.gather_elision and phase == TASK, grad_cat is not None)
    _parameter_gradients(t, fn, phases, phase)
    return t


def _direct_gradients(t: Template, fn, phases, phase: int) -> None:
    """The parameter gradients a block computes straight into their accumulators: each whole, or as column
    blocks of a merged product (passes/layout.gradient_blocks)."""
    t.direct = {g: name for name, g in fn.param_grads.items() if phases.phase[g] == phase and not g.has_rows}
    t.direct_blocks = gradient_blocks(t.direct, phases.programs[phase])
    covered = {name for names in t.direct_blocks.values() for name, _, _ in names}
    t.direct = {g: name for g, name in t.direct.items() if name not in covered}


def _backward_reads(fn, phases, phase: int, copied, b_stored: set) -> set:
    """What ∂F's program of ``phase`` reads: its steps' inputs, the values it copies out, its gradients and the
    cotangents kept for a later phase."""
    read = {x for step in phases.programs[phase] for x in step.inputs}
    read.update(x for x in copied)
    read.update(g for leaf, g in fn.leaf_grads.items() if phases.phase[g] == phase)
    read.update(g for g in fn.param_grads.values() if phases.phase[g] == phase)
    read.update(ct for out, ct in fn.ct.items() if phases.phase[ct] == phase and ct in b_stored)
    return read


def _bind_backward_inputs(t: Template, fn, opts, device, phases, phase: int, read: set, f_stored,
                          b_stored: set) -> None:
    """Registers for the forward values ∂F reads: F's stored tensors, the gathers again (the lazy phase), the
    scattered value's parts, the pulls, ∂F's own stored tensors and the scattered value's cotangent."""
    bound = set()
    for node in f_stored:
        if node in read:
            t.bind(node, ("tensor", node), KIND_ROWS, 0, _width(node.vshape))
        bound.add(node)
    smsg = fn.scatter_message
    if phase == POST:
        for cat in fn.lazy_gather_reads(opts, device):   # gathered again from the scatter tensor
            if cat in read:
                _regather(t, fn, cat)
            bound.add(cat)
    for x, (a, b) in (fn.scatter_parts or {}).items():
        if x not in bound:
            if x in read:
                t.scatter_view(x, ("scatter", smsg), a, _width(smsg))
            bound.add(x)
    for name, x in fn.pull_reads.items():
        if x not in bound:
            if x in read:
                t.take(x, ("pull", name), _width(x.vshape), ("pullrows", name))
            bound.add(x)
    lazy = fn.lazy_scatter_reads(opts, device) if phase != TASK else {}
    for x in phases.reads[phase]:
        if x in b_stored:
            t.bind(x, ("btensor", x), KIND_ROWS, 0, _width(x.vshape))
        elif x in lazy and x not in bound and x in read:   # the scattered value's cotangent, from the scatter gradient
            t.scatter_view(x, ("sgrad", smsg), lazy[x][0], _width(smsg))


def _cotangents(t: Template, fn, phases, phase: int, b_stored: set) -> None:
    """Registers for the cotangents of F's outputs: the scatter gradient's rows, or the push gradients taken
    (straight into ∂F's stored tensor where a later phase reads them)."""
    smsg = fn.scatter_message
    for out, ct in fn.ct.items():
        if phases.phase[ct] != phase:
            continue
        if out is fn.scattered:
            t.scatter_view(ct, ("sgrad", smsg), 0, _width(smsg))
        elif ct in b_stored:   # taken straight into the tensor that keeps it for a later phase
            width = _width(ct.vshape)
            t.bind(ct, ("btensor", ct), KIND_ROWS, 0, width)
            t.emit("TAKETO", t.regs[ct], t.buf(("pushgrad", out.name)), width, t.buf(("pushrows", out.name)),
                   _cols(ct), 0)
            continue
        else:
            t.take(ct, ("pushgrad", out.name), _width(ct.vshape), ("pushrows", out.name))
        if ct in b_stored:
            t.copy_to(("btensor", ct), KIND_ROWS, _width(ct.vshape), ct)


def _adjoints(t: Template, fn, phases, phase: int, elide: bool, into_children: bool) -> None:
    """The gathers' and pulls' gradients added into the children's scatter-gradient rows (ADJ) and the pull
    gradients (PUT); ``into_children``: the kind's steps computed them there already, so the ADJs are
    skipped when the children are side by side."""
    grads = sorted(fn.leaf_grads.items(), key=lambda lg: fn.gather_slot.get(lg[0], len(fn.gathers)))
    if into_children:
        t.emit("SKIP_IF_CAT", len(fn.gathers), 1)
        skip_at = len(t.code)
    for leaf, g in grads:
        if phases.phase[g] != phase:
            continue
        if g not in t.regs:
            raise Unsupported(f"gradient {g.label()} is not computed by the kind's steps")
        j = fn.gather_slot.get(leaf)
        if j is not None:
            message = fn.gather_messages[j]
            t.emit("ADJ", t.buf(("sgrad", message)), _width(message), t.buf(("child", j)), j, int(elide),
                   t.regs[g], _cols(g))
        else:
            t.emit("PUT", t.buf(("pullgrad", leaf.name)), _width(leaf.vshape), t.buf(("pullrows", leaf.name)),
                   t.regs[g], _cols(g))
    if into_children:
        assert [c[0] for c in t.code[skip_at:skip_at + len(fn.gathers)]] == ["ADJ"] * len(fn.gathers)


def _parameter_gradients(t: Template, fn, phases, phase: int) -> None:
    """Each parameter gradient of ``phase`` added into its accumulator (GACC), unless computed into it."""
    covered_by_block = {name for names in t.direct_blocks.values() for name, _, _ in names}
    for name, g in fn.param_grads.items():
        if phases.phase[g] == phase:
            if g not in t.regs:
                raise Unsupported(f"gradient of '{name}' is not computed by the kind's steps")
            if ("pgrad", name, "set") not in t.buffers and name not in covered_by_block:   # (else computed into it)
                t.emit("GACC", t.buf(("pgrad", name)), t.regs[g], _rows(g), _cols(g))
            t.param_grads.append(name)


def _regather(t: Template, fn, cat: Node) -> None:
    """∂F's lazy phase reads the concat of the gathers over all the kind's rows (Tree-FC's [h_l; h_r] for
    dW): a view of the scatter tensor when child j of row i is row first + k*i + j (the row of the block's
    task table says first, as a task's concat view), else the children's rows copied side by side."""
    message = fn.gather_messages[0]
    width, k = _width(message), len(fn.gathers)
    r = t.reg(cat)
    t.regathers = True
    t.emit("CATVIEW", r, t.buf(("scatter", message)), width, k, 0)
    mark = len(t.code)
    t.emit("SKIP_IF_CAT", 0, 0)
    t.scratch_reg(cat)
    for j in fn.gathers:
        part = t.reg(name=f"{t.reg_names[r]}[:, {j * width}:]")
        t.emit("COLS", part, r, j * width)
        t.emit("TAKETO", part, t.buf(("scatter", fn.gather_messages[j])), _width(fn.gather_messages[j]),
               t.buf(("child", j)), width, 0)
    t.code[mark] = ("SKIP_IF_CAT", len(t.code) - mark - 1, 0)


def _children_gradient(fn, phases, inplace, concats) -> Node | None:
    """The value whose column blocks are the gathers' gradients, slot by slot (∂F of Tree-FC's [h_l; h_r]·W
    is one product dY·Wᵀ), when the kind's steps compute it into scratch: a task whose children are side by
    side in a forest can compute it straight into their rows of the scatter gradient (CATVIEW), and the
    gathers' adjoints, copies of its column blocks there, are skipped."""
    k = len(fn.gathers)
    if k < 2 or len(set(fn.gather_messages.values())) > 1:
        return None
    width = _width(fn.gather_messages[0])
    blocks = set()
    for j, gnode in fn.gathers.items():
        g = fn.leaf_grads.get(gnode)
        if g is None or phases.phase.get(g) != TASK or OPS[g.op].native is None \
                or OPS[g.op].native(g) != "cols" or _col_offset(g) != j * width or _cols(g) != width:
            return None
        blocks.add(g.inputs[0])
    if len(blocks) != 1:
        return None
    (whole,) = blocks
    computed = {o for step in phases.programs[TASK] for o in step.outputs}
    in_concat = {c for c, _ in concats} | {m for _, parts in concats for m, _, _ in parts}
    if (whole not in computed or whole in inplace or whole in in_concat or not whole.has_rows
            or _cols(whole) != k * width):
        return None
    return whole


def template(fn, opts, device, backward: bool, training: bool = True, phase: int = TASK,
             direct: bool = False) -> Template:
    """The kind's template of ``phase``, made for the program being linked (its part: no cache of its own)."""
    try:
        return backward_template(fn, opts, device, phase, direct) if backward else \
            forward_template(fn, opts, device, training, phase)
    except Unsupported as e:
        where = "" if phase == TASK else f" ({PHASE_WORDS[phase]})"
        raise Unsupported(f"kind '{fn.F.name}'{where}: {e}") from None


def link(compiled: list, kind_ids: list, opts, device, backward: bool, training: bool = True,
         cache: dict | None = None) -> Lowered:
    """The templates of the kinds ``kind_ids`` (tasks, then the blocks before and after the task loop) as
    one program. ``cache``: where linked programs are kept (the workspace's: they live as long as the model;
    None: with the first function)."""
    if cache is None:
        cache = next(fn for fn in compiled if fn is not None).derived(("linked programs",), dict)
    # (the entry keeps its functions alive, so no other object can have their ids while it is there)
    key = (tuple(map(id, compiled)), tuple(kind_ids), opts.compile_key(), device, backward, training)
    hit = cache.get(key)
    if hit is not None:
        return hit[1]
    n_kinds = len(compiled)
    templates = [template(compiled[kind_id], opts, device, backward, training) for kind_id in kind_ids]
    for kind_id, t in zip(kind_ids, templates):
        t.tid = t.kind_id = kind_id
    blocks = _block_templates(compiled, kind_ids, opts, device, backward, training)
    ntask = len(templates)
    templates += [t for _, _, t in blocks]
    template_ids = list(kind_ids) + [tid for tid, _, _ in blocks]
    joined = _Joined(n_kinds)
    for i, (tid, t) in enumerate(zip(template_ids, templates)):
        if i == ntask:
            joined.task_keys = len(joined.keys)
        joined.append(tid, t)
    if len(templates) == ntask:
        joined.task_keys = len(joined.keys)
    kernels = joined.kernels
    lowered = Lowered("∂F" if backward else "F", template_ids, templates,
                      np.array(joined.code, np.int64).reshape(-1, WIDTH), np.array(joined.pool or [0], np.int64),
                      joined.ranges, list(joined.keys) + [("scratch",)],
                      np.array([getattr(k, "address", 0) for k in kernels] or [0], np.int64),
                      max((len(t.reg_names) for t in templates), default=1),
                      max((t.scratch for t in templates[:ntask]), default=0),
                      max((t.fixed for t in templates), default=0),
                      blocks=[_placed(tid, kind_id, t, compiled[kind_id], opts, backward)
                              for tid, kind_id, t in blocks],
                      task_keys=joined.task_keys,
                      table_width=TASK_COLUMNS + 2 * max((len(fn.gathers) for fn in compiled if fn is not None),
                                                         default=0),
                      fused=list(kernels), dropouts=joined.dropouts, steps=joined.steps)
    cache[key] = (list(compiled), lowered)
    return lowered


def _block_templates(compiled: list, kind_ids: list, opts, device, backward: bool, training: bool) -> list:
    """(template id, kind id, template) of the blocks before and after the task loop, in the order they run
    (it matters: a kind's lazy block reads gradients another kind's lazy block may add); a parameter gradient
    that one block alone computes is computed straight into its accumulator."""
    n_kinds = len(compiled)
    writers: dict = {}
    for kind_id in kind_ids:
        phases = compiled[kind_id].phases(opts, device).backward
        for name, g in compiled[kind_id].param_grads.items():
            writers.setdefault(name, []).append(phases.phase[g])
    blocks = []
    for phase in (PRE, POST):
        for kind_id in kind_ids:
            fn = compiled[kind_id]
            phases = fn.phases(opts, device).backward
            # (streaming splits the blocks before the task loop into chunks of one task: each adds into it)
            direct = backward and not (opts.streaming and phase == PRE) and all(
                writers[name] == [phase] for name, g in fn.param_grads.items() if phases.phase[g] == phase)
            t = template(fn, opts, device, backward, training, phase, direct)
            if t.code:
                blocks.append(((1 if phase == PRE else 2) * n_kinds + kind_id, kind_id, t))
    return blocks


class _Joined:
    """The program being linked: the templates' instructions one after another, each template's buffer keys,
    kernels, pool, dropout entries and steps renumbered into the program's."""

    def __init__(self, n_kinds: int):
        self.n_kinds = n_kinds
        self.keys: dict = {}
        self.kernels: list = []
        self.code: list = []
        self.pool: list = []
        self.dropouts: list = []
        self.steps: list = []
        self.ranges = np.zeros((3 * n_kinds, 2), np.int64)
        self.task_keys = 0

    def append(self, tid: int, t: Template) -> None:
        kind_id = tid % self.n_kinds
        local_buf = {i: self.keys.setdefault(_global_key(k, kind_id), len(self.keys)) for k, i in t.buffers.items()}
        local_kernel = {}
        for i, k in enumerate(t.kernels):
            if k not in self.kernels:
                self.kernels.append(k)
            local_kernel[i] = self.kernels.index(k)
        begin = len(self.code)
        for op, *args in t.code:
            args = [(local_buf[v] if v >= 0 else v) if is_buffer else local_kernel[v] if n == "kernel"
                    else v + len(self.pool) if n == "pool" else v + len(self.dropouts) if n == "entry"
                    else v + len(self.steps) if n == "step" else v
                    for n, v, is_buffer in zip(OPCODES[op], args, buffer_operands(op, args))]
            self.code.append([OPCODE[op]] + args + [0] * (WIDTH - 1 - len(args)))
        self.pool += t.pool
        self.dropouts += t.dropouts
        self.steps += t.steps
        self.ranges[tid] = (begin, len(self.code))


def _global_key(key: tuple, kind_id: int) -> tuple:
    """Buffer keys of one kind's own arrays (tensors, index arrays, statics) carry its kind id."""
    return key + (kind_id,) if key[0] in ("tensor", "btensor", "child", "pullrows", "pushrows", "srows", "static",
                                      "rowkeys") \
        else key


def _placed(tid: int, kind_id: int, t: Template, fn, opts, backward: bool) -> Template:
    """Block template ``t`` given its place in the program: its ids, the children it gathers again and F's
    rows it moves per vertex (what a batch's table needs of it)."""
    phases = fn.phases(opts).forward
    t.tid, t.kind_id, t.regather = tid, kind_id, len(fn.gathers) if t.regathers else 0
    t.moves = (0, 0, 0) if backward else (sum(phases.phase[g] == t.phase for g in fn.gathers.values()),
                                          sum(phases.phase[p] == t.phase for p in fn.pulls.values()),
                                          sum(phases.phase[p] == t.phase for p in fn.pushes.values()))
    return t
