"""Programs as data and the one interpreter that runs them.

A program is a list of :class:`~minicavs.compile.Step` records: what runs (a registry op's impl, or a generated kernel computing
a fused group), on which values, into which. Static graphs (``Executor``), F and ∂F (the engine's phases)
all run through :func:`run_steps`; a step can be written straight into a buffer it is given (``outs``: a
dynamic tensor's rows, the scatter tensor's rows, a concat's column block), which is how values land where
the compiler placed them without copies.

A batch's binding of a lowered program (instructions.py) lives here too: its task table (one row per task, in
the order they run), the rows of the blocks before and after the task loop, and the per-run dropout table;
the device's runner then runs template x task table.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .arrays import on_device
from .codegen.native import OPS as OPCODE_IDS
from .errors import FeedError
from .graph import Node, fmt_shape
from .instructions import TASK_COLUMNS
from .random import hash_words
from .compile import POST, PRE, TASK, Step
from .ops.message import as_slice, gather_adjoint, put_rows, row_index, take_rows
from .sparse import RowSparse, add_all
from .validate import indices


@dataclass
class RunContext:
    """What an op may read besides its inputs: the dropout hash words and the train/eval switch."""

    seed: int = 0
    step: int = 0
    training: bool = True
    row_keys: Any = None  # per-row keys of the rows being computed (None: the row index)


def run_steps(steps: Sequence[Step], env: dict, xp, ctx: RunContext, outs: Mapping | None = None) -> None:
    """The interpreter: run ``steps`` in order, reading and writing values in ``env``. A fused step whose
    output is in ``outs`` writes its result there (no copy)."""
    outs = outs or {}
    for step in steps:
        args = [env[x] for x in step.inputs]
        try:
            if step.fused:
                for node, value in zip(step.outputs, step.run(args, [outs.get(o) for o in step.outputs])):
                    env[node] = value
            elif step.needs_ctx:
                env[step.outputs[0]] = step.run(xp, *args, ctx=ctx, **step.attrs)
            else:
                env[step.outputs[0]] = step.run(xp, *args, **step.attrs)
        except FeedError as e:
            raise _located(e, step.outputs[0]) from None
        for x in step.frees:
            del env[x]


def _located(e: FeedError, n: Node) -> FeedError:
    """``e`` with the node it came from and that node's inputs, so a message about an op's operand
    ('labels of shape (2,)') also names the input the user fed ('input#3 'labels''). It keeps the bad
    entry's ``row`` (validate.indices) and names the ``node``, for Model.run to say which vertex it was."""
    located = FeedError(f"{e} [at {n.label()} of {', '.join(x.label() for x in n.inputs)}]")
    located.row, located.node = getattr(e, "row", None), n
    return located


def check_value(node: Node, value, what: str):
    """Return ``value`` as an array of the node's dtype, or raise naming the node and both shapes. Arrays
    of another array module (a device's) are checked and kept there."""
    want = node.dtype.np
    if type(value) is np.ndarray and value.dtype == want and (value.shape == node.shape or (
            value.ndim == node.ndim and all(d is None or d == a for d, a in zip(node.shape, value.shape)))):
        return value   # the common case (a parameter, a fed array of the declared shape), checked in two lines
    if (isinstance(value, np.ndarray) or on_device(value)) and value.dtype.kind != "O":
        arr = value
    elif want.kind in "iu":   # a list: numpy would turn [1, True] into ints and [2**63, 1] into floats
        arr = indices(value, f"{what} {node.label()}: value", dtype=None)
    else:
        arr = np.asarray(value)
    if arr.dtype != want:
        if arr.dtype.kind != want.kind and not (arr.dtype.kind in "iu" and want.kind in "iu"):
            raise FeedError(f"{what} {node.label()}: got dtype {arr.dtype}, declared {node.dtype.name}")
        if want.kind in "iu" and arr.size and not np.can_cast(arr.dtype, want):   # would values wrap?
            info = np.iinfo(want)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise FeedError(f"{what} {node.label()}: value {lo if lo < info.min else hi} does not fit "
                                f"its declared dtype {node.dtype.name}")
        arr = arr.astype(want)
    if arr.ndim != node.ndim or any(d is not None and d != a for d, a in zip(node.shape, arr.shape)):
        raise FeedError(f"{what} {node.label()}: got shape {arr.shape}, declared {fmt_shape(node.shape)}")
    return arr


def host_layout(value):
    """``value`` as a C-contiguous array in native byte order when it is a numpy array laid out otherwise
    (Fortran order, strided or negative-stride views, broadcast views of stride 0, big-endian), else
    ``value`` itself. Feeds and parameters pass through here once, where they enter a run, so that no
    kernel or executor ever sees a layout it does not expect (the native executor addresses buffers by
    base pointer and row stride). A copy is made only when needed: an array already so laid out is read in
    place (a run never writes to its feeds or parameters), so a caller's array is never written either way."""
    if isinstance(value, np.ndarray) and not (value.flags.c_contiguous and value.dtype.isnative):
        return np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("="))
    return value


def is_fed(n: Node) -> bool:
    """Inputs and parameters: values a graph is given, not computed."""
    return n.op in ("input", "param")


def leaf_value(n: Node, feeds: Mapping, params: Mapping):
    """The value of an ``input`` (from feeds, by node or name) or ``param`` (by name) node, checked."""
    if n.op == "input":
        if n in feeds:
            value = feeds[n]
        elif n.name is not None and n.name in feeds:
            value = feeds[n.name]
        else:
            raise FeedError(f"missing feed for input {n.label()} {fmt_shape(n.shape)}")
        return host_layout(check_value(n, value, "feed for input"))
    try:   # (one lookup: a ParameterSet's ``in`` and ``[]`` are a Python call each)
        value = params[n.name]
    except KeyError:
        raise FeedError(f"missing value for parameter '{n.name}' {fmt_shape(n.shape)}") from None
    return host_layout(check_value(n, getattr(value, "value", value), "parameter"))


def evaluate(nodes: Sequence[Node], env: dict, feeds: Mapping, params: Mapping, ctx: RunContext, xp=np) -> None:
    """Evaluate ``nodes`` (in topological order) into ``env``, keeping every value (for a backward pass):
    nodes already in ``env`` are not recomputed. Feeds and parameters must already be arrays of ``xp``'s
    device."""
    steps = []
    for n in nodes:
        if n in env:
            continue
        if n.op in ("input", "param"):   # (is_fed, inlined: it runs for every node of every pass)
            env[n] = leaf_value(n, feeds, params)
        else:
            step = _STEPS.get(n)
            if step is None:
                step = _STEPS[n] = Step.of(n)
            steps.append(step)
    if steps:   # (parameters only: F's statics at inference)
        run_steps(steps, env, xp, ctx)


_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # node -> its Step (made once, not per run)


# --- batch programs: a compiled template bound to one batch -------------------------------------------

PHASE_NAMES = ("before tasks", "task", "after tasks")


class Block:
    """The bound steps of one phase of one vertex kind over some of its rows (one task's, or all the kind's
    rows before / after the task loop), in the order they run:

    ``views``     values bound to arrays at bind time: a tensor's rows, a strided block of the scatter
                  tensor (an elided gather), a slice of a pull buffer
    ``takes``     values copied in by one row gather at run time (a gather, a pull by index)
    ``stores_in`` values copied into a tensor before the steps (a cotangent a later phase reads again)
    ``outs``      where steps write in place (a tensor's rows, the scatter tensor's rows)
    ``concats``   elided concats: the buffer the parts' kernels write their column blocks into (None: new)
    ``steps``     the compiled steps (registry ops and fused kernels)
    ``writes``    values copied out after the steps (``dst[index] = value``)
    ``puts``      values moved out by one row scatter (a push)
    ``adjoints``  backward only: gradients added into children's rows (gather) or put into a pull buffer's
                  gradient; ``param_grads``: gradients summed into F's parameter gradients

    Each entry keeps where it reads or writes as (template, *args), rendered only by
    :meth:`BatchProgram.dump`. ``stream``: "eager" when the block
    runs on the second stream (its ``adjoints`` and ``param_grads`` still run on the main one)."""

    __slots__ = ("kind", "kid", "phase", "task", "rows", "row_keys", "stream", "views", "takes", "stores_in",
                 "outs", "concats", "steps", "writes", "puts", "adjoints", "param_grads")

    def __init__(self, kind: str, kid: int, phase: int, task, rows: slice, row_keys, stream: str = "main"):
        self.kind, self.kid, self.phase, self.task, self.rows = kind, kid, phase, task, rows
        self.row_keys, self.stream = row_keys, stream
        self.views, self.takes, self.stores_in, self.outs, self.concats = [], [], [], [], []
        self.steps, self.writes, self.puts, self.adjoints, self.param_grads = [], [], [], [], []

    def empty(self) -> bool:
        return not (self.takes or self.stores_in or self.steps or self.writes or self.puts or self.adjoints
                    or self.param_grads)

    def keep_read(self) -> None:
        """Drop views and takes that nothing in the block reads (backward binds every forward tensor of the
        kind, then keeps those its steps, copies and gradients use)."""
        read = {x for step in self.steps for x in step.inputs}
        read.update(n for n, *_ in self.stores_in + self.writes + self.puts + self.adjoints)
        read.update(n for _, n in self.param_grads)
        self.views = [v for v in self.views if v[0] in read]
        self.takes = [t for t in self.takes if t[0] in read]

    @property
    def size(self) -> int:
        return self.rows.stop - self.rows.start

    def header(self) -> str:
        where = f"task {self.task}" if self.task is not None else PHASE_NAMES[self.phase]
        stream = " [eager stream]" if self.stream == "eager" else ""
        return f"{where}: kind '{self.kind}' rows {self.rows.start}:{self.rows.stop}{stream}"

    def lines(self) -> list[str]:
        """The bound steps as text, one a line: ``value = where it is read from``, the steps with
        ``-> where they write``, ``where = value`` for copies out, ``where += value`` for adjoints."""
        out = [f"{_name(n)} = {_where(what)}" for n, _, what in self.views]
        out += [f"{_name(n)} = {_where(what)}" for n, _, _, what in self.takes]
        out += [f"{_where(what)} = {_name(n)}" for n, _, what in self.stores_in]
        writes_to = {n: _where(what) for n, _, what in self.outs}
        for c, parts, _, what in self.concats:
            writes_to[c] = _where(what)
            writes_to.update((m, f"{_where(what)}[:, {a}:{b}]") for m, a, b in parts)
        for step in self.steps:
            into = [writes_to[o] for o in step.outputs if o in writes_to]
            out.append(step.text(_name) + (f"  -> {', '.join(into)}" if into else ""))
        out += [f"{_where(what)} = {_name(n)}" for n, _, _, what in self.writes]
        out += [f"{_where(what)} = {_name(n)}" for n, _, _, what in self.puts]
        out += [f"{_where(what)} += {_name(n)}" for n, _, _, _, what in self.adjoints]
        out += [f"grad '{name}' += {_name(n)}" for name, n in self.param_grads]
        return out


def _name(n: Node) -> str:
    return n.name or f"%{n.id}"


def _where(what: tuple) -> str:
    """Render a location kept as (template, *args) at bind time: formatting is left to dump()."""
    template, *args = what
    return template.format(*(_name(a) if isinstance(a, Node) else _rows_text(a)
                             if isinstance(a, (slice, np.ndarray)) else a for a in args))


class BatchProgram:
    """F's (or ∂F's) steps bound to one batch: the blocks before the task loop, one block per task (in the
    order they run: forward order, or the task stack popped for backward) and the blocks after it."""

    def __init__(self, title: str, before: list, tasks: list, after: list, copies: dict):
        self.title, self.before, self.tasks, self.after, self.copies = title, before, tasks, after, copies
        self.native = None   # the task loop as instructions (instructions.Lowered), when the native executor ran it
        self.task_table = None
        self.native_table = None   # the task table with the native blocks' rows (None: the blocks ran in Python)
        self.native_why = None   # why the Python interpreter ran the task loop (None: the native executor did)
        self.runner = "native executor"   # who ran ``native``: the C executor or the reference runner
        self.eager_table = None   # streaming: the eager stream's table (eager_rows), which the runner ran
        self.eager_why = None     # streaming, and no eager table: why

    def blocks(self) -> list:
        return self.before + self.tasks + self.after

    def dump(self) -> str:
        """One bound step per line, jaxpr-like, block by block."""
        lines = [f"{self.title}:"]
        for block in self.before:
            lines.append(f"  {block.header()}")
            lines += [f"    {line}" for line in block.lines()]
        if self.native is not None:
            if self.eager_table is not None:
                lines.append(f"  main stream ({self.runner}): tasks 0:{len(self.task_table)}, task t after eager "
                             "chunk t, then the blocks after the task loop: per block or task, its template")
                lines.append(f"  eager stream ({self.runner}): chunks 0:{len(self.eager_table)}, chunk t the "
                             "block before the task loop of task t's kind over task t's rows")
            elif self.native_table is not None:
                lines.append(f"  one native call: the blocks before the task loop, tasks 0:{len(self.task_table)}, "
                             f"the blocks after it ({self.runner}): per block or task, its template")
                if self.eager_why is not None:
                    lines.append(f"  (no eager stream: {self.eager_why})")
            else:
                lines.append(f"  tasks 0:{len(self.task_table)} ({self.runner}): per task, its kind's template")
                if self.native_why is not None:
                    lines.append(f"  (blocks before and after the task loop in Python: {self.native_why})")
            lines += [f"    {line}" for line in self.native.lines(blocks=self.native_table is not None)]
        elif self.native_why is not None and self.native_why != "executor 'python'":
            lines.append(f"  (task loop in Python: {self.native_why})")
        for block in self.tasks + self.after:
            lines.append(f"  {block.header()}")
            lines += [f"    {line}" for line in block.lines()]
        return "\n".join(lines)


def run_block(block: Block, statics: dict, xp, ctx: RunContext, backend) -> dict:
    """The interpreter of bound steps: move rows in, run the block's steps, move rows out. Returns the
    block's values (backward emits its gradients from them with :func:`emit_gradients`)."""
    # dropout's row keys where its kernel reads them: on a device, a view of the plan's keys copied over once
    ctx.row_keys = block.row_keys if xp is np or block.row_keys is None else backend.index(block.row_keys)
    env = dict(statics)
    for node, array, _ in block.views:
        env[node] = array
    for node, buffer, index, _ in block.takes:
        env[node] = backend.take(buffer, index)
    for node, dst, _ in block.stores_in:
        dst[...] = env[node]
    outs = {node: array for node, array, _ in block.outs}
    for concat, parts, dest, _ in block.concats:
        if dest is None:
            dest = xp.empty((block.size, concat.shape[1]), concat.dtype.np)
        env[concat] = dest
        for part, a, b in parts:
            outs[part] = dest[:, a:b]
    run_steps(block.steps, env, xp, ctx, outs)
    for node, dst, index, _ in block.writes:
        dst[index] = env[node]
    for node, buffer, index, _ in block.puts:
        if isinstance(index, slice):
            buffer[index] = env[node]
        else:
            backend.put(buffer, index, env[node])
    return env


def emit_gradients(block: Block, env: dict, param_grads: dict, xp) -> None:
    """Backward: add the block's gradients into children's rows and pull buffers' gradients (the message
    ops' adjoints, ops/message.py) and into F's parameter gradients."""
    for node, adjoint, before, after, _ in block.adjoints:
        adjoint(*before, env[node], *after)
    for name, node in block.param_grads:
        g = env[node]
        prev = param_grads.get(name)
        if prev is None:
            param_grads[name] = g.copy()   # (a RowSparse's rows may be a view of the workspace)
        elif isinstance(prev, RowSparse) or isinstance(g, RowSparse):
            param_grads[name] = add_all(xp, [prev, g])
        else:
            prev += g


def _rows_text(index) -> str:
    if isinstance(index, slice):
        return f"{index.start}:{index.stop}" + (f":{index.step}" if index.step not in (None, 1) else "")
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def _with_tensors(places: list, tensors: dict) -> list:
    """Per phase: the alias pass's (in place, copied, concats) with each value's dynamic tensor."""
    return [([(n, tensors[n]) for n in inplace], [(n, tensors[n]) for n in copied], concats)
            for inplace, copied, concats in places]


def _scatter_names(scatters: dict, what: str = "scatter") -> dict:
    """{message shape: how dump() names its scatter tensor}: ``scatter``, or ``scatter(3,)`` per shape when the
    kinds scatter several."""
    return {m: what if len(scatters) == 1 else f"{what}{fmt_shape(m)}" for m in scatters}


def bind_forward(fns: list, plan, state, opts, device, active: list, training: bool = True,
                 with_tasks: bool = True, with_blocks: bool = True) -> BatchProgram:
    """F's phases bound to the batch: every block's views, row indices and output buffers (placed by the
    alias pass at compile time) made now, so the task loop only runs them. A gather reads, and a kind
    writes, the scatter tensor of its message shape (``gather_messages`` / ``scatter_message``)."""
    copies = {"gather": 0, "gathered": 0, "pull": 0, "push": 0}
    streaming = opts.streaming and with_tasks   # (a runner that runs the task loop runs the eager blocks too)
    if not (with_tasks or with_blocks):   # the native executor runs every block
        return BatchProgram("F", [], [], [], copies)
    scatters, pull_bufs = state.scatters, state.pull_bufs
    names = _scatter_names(scatters)
    stores = {kid: _with_tensors(fns[kid].placement(opts, device, training)[1], state.tensors[kid]) for kid in active}
    phases = {kid: fns[kid].phases(opts, device)[0] for kid in active}   # looked up once, not per block

    def bind(kid, phase, task_rows, scatter_rows, task, stream="main") -> Block:
        fn, kind_plan, tensors = fns[kid], plan.kinds[kid], state.tensors[kid]
        kind_phases = phases[kid]
        block = Block(kind_plan.name, kid, phase, task, task_rows, kind_plan.row_keys[task_rows], stream)
        bs = task_rows.stop - task_rows.start
        for x in kind_phases.reads[phase]:
            if x in tensors:
                block.views.append((x, tensors[x].buffer[task_rows], ("tensor {}[{}]", x, task_rows)))
            else:   # the lazy phase reads the scattered value back from the scatter tensor (alias.py)
                _bind_rows(block, x, scatters[fn.scatter_message], scatter_rows, fn.lazy_scatter_reads(opts, device)[x],
                           names[fn.scatter_message])
        program = kind_phases.programs[phase]
        elide = phase == TASK and opts.gather_elision
        views = [kind_plan.views[j].get(task_rows.start) for j in fn.gathers] if elide else None
        for j, gnode in fn.gathers.items():
            if kind_phases.phase[gnode] != phase:
                continue
            view = None if views is None else views[j]
            child_rows = kind_plan.child_rows[j][task_rows]
            message = fn.gather_messages[j]
            scatter, name = scatters[message], names[message]
            if view is None:
                block.takes.append((gnode, scatter, child_rows, (f"take {name}[{{}}]", child_rows)))
                copies["gather"] += bs
            else:
                start, step = view
                if step:
                    block.views.append((gnode, scatter[start:start + step * (bs - 1) + 1:step],
                                        (f"view {name}[{{}}]", slice(start, start + step * (bs - 1) + 1, step))))
                else:
                    block.views.append((gnode, device.xp.broadcast_to(scatter[start], (bs,) + scatter.shape[1:]),
                                        (f"view {name}[{{}}] (zero row) x {{}}", start, bs)))
            copies["gathered"] += bs
        cat = fn.gather_concat
        if cat is not None and views is not None and kind_phases.phase.get(cat) == phase:
            k = len(views)
            if all(v is not None and v[1] == k and v[0] == views[0][0] + j for j, v in enumerate(views)):
                first = views[0][0]
                message = cat.inputs[0].vshape   # (the alias pass made it only of gathers of one message)
                block.views.append((cat, scatters[message][first:first + k * bs].reshape(bs, -1),
                                    (f"view {names[message]}[{{}}] as {{}} rows", slice(first, first + k * bs), bs)))
                program = kind_phases.without_concat
        for name, pnode in fn.pulls.items():
            if kind_phases.phase[pnode] == phase:
                rows = kind_plan.pull_rows[name][task_rows]
                index = row_index(rows)
                if isinstance(index, slice):
                    block.views.append((pnode, pull_bufs[name][index], ("view pull {}[{}]", name, index)))
                else:
                    block.takes.append((pnode, pull_bufs[name], rows, ("take pull {}[{}]", name, rows)))
                copies["pull"] += bs
        inplace, copied, concats = stores[kid][phase]
        block.outs += [(node, t.buffer[task_rows], ("tensor {}[{}]", node, task_rows)) for node, t in inplace]
        written = {node for node, _, _ in block.outs} | {m for _, parts in concats for m, _, _ in parts}
        src, direct = fn.scatter_source, False
        rows_contiguous = isinstance(scatter_rows, slice)
        own = scatters.get(fn.scatter_message)   # the scatter tensor of this kind's message
        where = (f"{names.get(fn.scatter_message)}[{{}}]", scatter_rows)
        for c, parts in concats:
            dest = next((a for node, a, _ in block.outs if node is c), None)
            what = next((w for node, _, w in block.outs if node is c), None)
            if dest is None and c is src and rows_contiguous:
                dest, what, direct = own[scatter_rows], where, True
            block.concats.append((c, parts, dest, what or ("new {}", c)))
        if (not direct and src in kind_phases.inplace and src not in written and rows_contiguous
                and kind_phases.phase.get(src) == phase):
            block.outs.append((src, own[scatter_rows], where))   # the kernel computing it writes it in place
            direct = True
        block.steps = program
        if fn.scattered is not None and kind_phases.phase[fn.scattered] == phase and not direct:
            block.writes.append((fn.scattered, own, scatter_rows, where))
        for name, pnode in fn.pushes.items():
            if kind_phases.phase[pnode] == phase:
                index = row_index(kind_plan.push_rows[name][task_rows])
                block.puts.append((pnode, state.pushes[name], index, ("push {}[{}]", name, index)))
                copies["push"] += bs
        block.writes += [(node, t.buffer, task_rows, ("tensor {}[{}]", node, task_rows)) for node, t in copied]
        return block

    whole = {kid: (slice(0, plan.kinds[kid].n), as_slice(plan.scatter_rows(kid)))
             for kid in active} if with_blocks or streaming else {}
    tasks = [(kid, slice(koff, koff + bs), slice(scatter_offset, scatter_offset + bs))
             for kid, koff, bs, scatter_offset in plan.tasks] if with_tasks else []
    if streaming:   # eager nodes on the second stream, task by task ahead of the recurrent path
        before = [bind(kid, PRE, task_rows, scatter_rows, t, "eager")
                  for t, (kid, task_rows, scatter_rows) in enumerate(tasks)]
    else:   # (without blocks: the native executor runs them too)
        before = _nonempty(bind(kid, PRE, *whole[kid], None) for kid in active) if with_blocks else []
    per_task = [bind(kid, TASK, task_rows, scatter_rows, t) for t, (kid, task_rows, scatter_rows) in enumerate(tasks)] \
        if with_tasks else []   # (without: the native executor runs the task loop)
    after = _nonempty(bind(kid, POST, *whole[kid], None) for kid in active) if with_blocks else []
    return BatchProgram("F", before, per_task, after, copies)


def _sparse_rows(dst, grad: RowSparse, push_rows: np.ndarray) -> None:
    """``dst = grad[push_rows]`` for a row-sparse ``grad``: zeros, plus its rows that fall on ``push_rows``
    (added up where an index repeats)."""
    dst[...] = 0
    where = np.full(grad.shape[0], -1, np.int64)
    where[push_rows] = np.arange(len(push_rows))
    at = where[np.asarray(grad.indices)]
    hit = at >= 0
    np.add.at(dst, at[hit], grad.rows[hit])


def _bind_rows(block: Block, x: Node, buffer, rows, cols: tuple, name: str) -> None:
    """Bind ``x`` to columns ``cols`` of ``buffer``'s ``rows`` (a slice: a view; an index array: one take)."""
    a, b = cols
    part = buffer if (a, b) == (0, buffer.shape[1]) else buffer[:, a:b]
    if isinstance(rows, slice):
        block.views.append((x, part[rows], (f"view {name}[{{}}][:, {a}:{b}]", rows)))
    else:
        block.takes.append((x, part, rows, (f"take {name}[{{}}][:, {a}:{b}]", rows)))


def _bind_regathered(block: Block, cat: Node, scatter, child_rows: list, name: str, device) -> None:
    """Bind the concat of a kind's gathers, over all its rows, to the children's rows of ``scatter`` (which
    holds F's values when ∂F is bound): a view (a reshape) when child j of vertex i is row start + k*i + j,
    else the children's rows interleaved, gathered now in one take."""
    k, n = len(child_rows), len(child_rows[0])
    rows = np.stack(child_rows, axis=1).reshape(-1)
    index = as_slice(rows)
    if isinstance(index, slice):
        block.views.append((cat, scatter[index].reshape(n, -1), (f"view {name}[{{}}] as {{}} rows", index, n)))
    else:
        block.views.append((cat, device.take(scatter, rows).reshape(n, -1),
                            (f"taken when bound: {name}[{{}}] as rows of {k}", rows)))


def _nonempty(blocks) -> list:
    """Blocks before or after the task loop with something to do (a kind may have no eager or lazy work)."""
    return [b for b in blocks if not b.empty()]


def bind_backward(fns: list, plan, state, opts, device, active: list, btensors: dict, scatter_grads: dict,
                  push_grads: dict, pull_grads: dict, row_kernels, with_tasks: bool = True,
                  with_blocks: bool = True) -> BatchProgram:
    """∂F's phases bound to the batch: the task stack popped (tasks in reverse), forward values read back
    from their tensors, the scatter tensors and the pull buffers at the same rows, gradients added into the
    children's rows of the scatter gradients (``scatter_grads``: one per message shape) and into the pull
    buffers' gradients."""
    streaming = opts.streaming and with_tasks   # (a runner that runs the task loop runs the eager blocks too)
    if not (with_tasks or with_blocks):   # the native executor runs every block
        return BatchProgram("∂F", [], [], [], {})
    scatters = state.scatters
    names, grad_names = _scatter_names(scatters), _scatter_names(scatters, "scatter grad")
    stores = {kid: _with_tensors(fns[kid].placement(opts, device)[3], btensors[kid]) for kid in active}
    phases = {kid: fns[kid].phases(opts, device)[1] for kid in active}   # looked up once, not per block
    whole_rows: dict = {}

    def kind_rows(kid):
        """All of a kind's rows of the scatter tensor, in kind order: a slice when its tasks are adjacent."""
        if kid not in whole_rows:
            rows = plan.scatter_rows(kid)
            index = row_index(rows)
            whole_rows[kid] = (take_rows(device, scatters[fns[kid].scatter_message], rows), index)
        return whole_rows[kid]

    def bind(kid, phase, task_rows, scatter_offset, task, stream="main") -> Block:
        fn, kind_plan = fns[kid], plan.kinds[kid]
        kind_phases = phases[kid]
        block = Block(kind_plan.name, kid, phase, task, task_rows, kind_plan.row_keys[task_rows], stream)
        bs = task_rows.stop - task_rows.start
        bound = set()

        def view(node, array, what):
            block.views.append((node, array, what))
            bound.add(node)

        for node, t in state.tensors[kid].items():
            view(node, t.buffer[task_rows], ("tensor {}[{}]", node, task_rows))
        if phase == POST:
            for cat in fn.lazy_gather_reads(opts, device):   # gathered again from the scatter tensor
                scatter = scatters[cat.inputs[0].vshape]
                _bind_regathered(block, cat, scatter, [kind_plan.child_rows[j] for j in fn.gathers],
                                 names[cat.inputs[0].vshape], device)
                bound.add(cat)
        if fn.scatter_parts:
            if scatter_offset is not None:
                where = slice(scatter_offset, scatter_offset + bs)
                rows = scatters[fn.scatter_message][where]
            else:
                rows, where = kind_rows(kid)
            for x, (a, b) in fn.scatter_parts.items():
                if x not in bound:
                    view(x, rows[:, a:b], (f"view {names[fn.scatter_message]}[{{}}][:, {{}}:{{}}]", where, a, b))
        for name, x in fn.pull_reads.items():
            if x not in bound:
                pull_rows = kind_plan.pull_rows[name][task_rows]
                index = row_index(pull_rows)
                if isinstance(index, slice):
                    view(x, state.pull_bufs[name][index], ("view pull {}[{}]", name, index))
                else:
                    block.takes.append((x, state.pull_bufs[name], pull_rows, ("take pull {}[{}]", name, pull_rows)))
        for x in kind_phases.reads[phase]:
            if x in btensors[kid]:
                view(x, btensors[kid][x].buffer[task_rows], ("tensor {}[{}]", x, task_rows))
            elif x not in bound:   # the scattered value's cotangent, read back from the scatter gradient
                rows = plan.scatter_rows(kid)
                _bind_rows(block, x, scatter_grads[fn.scatter_message], as_slice(rows),
                           fn.lazy_scatter_reads(opts, device)[x], grad_names[fn.scatter_message])
                bound.add(x)
        for out, ct in fn.ct.items():
            if kind_phases.phase[ct] != phase:
                continue
            if out is fn.scattered:
                view(ct, scatter_grads[fn.scatter_message][scatter_offset:scatter_offset + bs],
                     (f"view {grad_names[fn.scatter_message]}[{{}}]", slice(scatter_offset, scatter_offset + bs)))
            else:
                push_rows = kind_plan.push_rows[out.name][task_rows]
                index = row_index(push_rows)
                grad = push_grads[out.name]
                if isinstance(grad, RowSparse):   # a few rows: put into zeros, where ∂F keeps the cotangent
                    stored = btensors[kid].get(ct)
                    dst = stored.buffer[task_rows] if stored is not None else device.xp.empty((bs,) + ct.vshape,
                                                                                             grad.dtype)
                    _sparse_rows(dst, grad, push_rows)
                    view(ct, dst, ("push grad {}[{}] ({} rows put into zeros when bound)", out.name, push_rows,
                                   len(grad.indices)))
                    continue
                if isinstance(index, slice):
                    view(ct, push_grads[out.name][index], ("view push grad {}[{}]", out.name, index))
                else:
                    block.takes.append((ct, push_grads[out.name], push_rows,
                                        ("take push grad {}[{}]", out.name, push_rows)))
            if ct in btensors[kid]:
                block.stores_in.append((ct, btensors[kid][ct].buffer[task_rows], ("tensor {}[{}]", ct, task_rows)))
        inplace, copied, concats = stores[kid][phase]
        block.outs += [(node, t.buffer[task_rows], ("tensor {}[{}]", node, task_rows)) for node, t in inplace]
        for c, parts in concats:
            dest = next((a for node, a, _ in block.outs if node is c), None)
            what = next((w for node, _, w in block.outs if node is c), None)
            block.concats.append((c, parts, dest, what or ("new {}", c)))
        block.steps = kind_phases.programs[phase]
        block.writes += [(node, t.buffer, task_rows, ("tensor {}[{}]", node, task_rows)) for node, t in copied]
        for leaf, gnode in fn.leaf_grads.items():
            if kind_phases.phase[gnode] != phase:
                continue
            j = fn.gather_slot.get(leaf)
            if j is not None:
                elided = kind_plan.views[j].get(task_rows.start) if phase == TASK and opts.gather_elision else None
                child_rows = kind_plan.child_rows[j][task_rows]
                message = fn.gather_messages[j]
                if elided is not None:
                    start, step = elided
                    what = (f"{grad_names[message]}[{{}}]", slice(start, start + step * (bs - 1) + 1, step))
                else:
                    what = (f"{grad_names[message]}[{{}}]", child_rows)
                block.adjoints.append((gnode, gather_adjoint, (device, scatter_grads[message], child_rows, elided),
                                       (plan.forest, row_kernels), what))
            else:
                pull_rows = kind_plan.pull_rows[leaf.name][task_rows]
                block.adjoints.append((gnode, put_rows, (device, pull_grads[leaf.name], pull_rows), (),
                                       ("pull grad {}[{}]", leaf.name, pull_rows)))
        block.param_grads += [(name, gnode) for name, gnode in fn.param_grads.items()
                              if kind_phases.phase[gnode] == phase]
        block.keep_read()
        return block

    stack = [(kid, slice(koff, koff + bs), scatter_offset) for kid, koff, bs, scatter_offset in reversed(plan.tasks)] \
        if with_tasks else []
    if streaming:
        before = [bind(kid, PRE, task_rows, scatter_offset, len(stack) - 1 - i, "eager")
                  for i, (kid, task_rows, scatter_offset) in enumerate(stack)]
    elif with_blocks:
        before = _nonempty(bind(kid, PRE, slice(0, plan.kinds[kid].n), None, None) for kid in active)
    else:   # (the native executor runs the blocks too)
        before = []
    per_task = [bind(kid, TASK, task_rows, scatter_offset, len(stack) - 1 - i)
                for i, (kid, task_rows, scatter_offset) in enumerate(stack)] if with_tasks else []
    after = _nonempty(bind(kid, POST, slice(0, plan.kinds[kid].n), None, None) for kid in active) \
        if with_blocks else []
    return BatchProgram("∂F", before, per_task, after, {})


# --- per batch: the lowered program's task table (instructions.py) and its per-run tables -----------------

def dropout_table(dropouts: list, ctx) -> np.ndarray:
    """The DROPOUT entries' table for a run under ``ctx``: per entry (p, site) the hash word of (seed, step,
    site), the keep threshold ceil(p * 2^24) and the scale 1 / (1 - p) as a double's bits (random.py's hash,
    as ops.nn.kernel_dropout); outside training, or at p = 0, threshold 0 and scale 1 (every value kept as it
    is)."""
    table = np.zeros((max(1, len(dropouts)), 3), np.int64)
    for i, (p, site) in enumerate(dropouts):
        if ctx.training and p != 0.0:
            table[i, 0] = hash_words(ctx.seed, ctx.step, site)[0].view(np.int64)
            table[i, 1] = math.ceil(p * (1 << 24))
            table[i, 2] = np.float64(1.0 / (1.0 - p)).view(np.int64)
        else:
            table[i, 2] = np.float64(1.0).view(np.int64)
    return table


def task_table(fns: list, plan, opts, backward: bool) -> tuple[np.ndarray, dict]:
    """One row per task, in the order they run (backward: the stack popped, the same rows reversed), built
    with numpy: kind, kind offset, rows, scatter offset, the sibling-concat view's first row (-1: none), and
    per gather slot the strided view (start, step; step -1: none). Also the rows moved, for the program's
    copy counters."""
    arity = max((len(fn.gathers) for fn in fns if fn is not None), default=0)
    made = plan.task_views   # the native planner's (cpu/planner.py), for kinds that gather slots 0..arity - 1
    if made is not None and opts.gather_elision and made.shape[1] == TASK_COLUMNS + 2 * arity \
            and len(fns) == len(plan.view_arity) and all(
                fn is not None and len(fn.gathers) == a and list(fn.gathers) == list(range(a))
                for fn, a in zip(fns, plan.view_arity)):
        copies = {"gather": 0, "gathered": 0, "pull": 0, "push": 0}
        if not backward:
            for kid, fn in enumerate(fns):
                kind_plan = plan.kinds[kid]
                if kind_plan is not None:   # (its gather slots are 0..arity - 1: a list indexed by slot)
                    _count_copies(copies, _task_moves(fn, opts), kind_plan.n, plan.gather_copies[kid].tolist())
        return (np.ascontiguousarray(made[::-1]) if backward else made), copies
    tasks = plan.task_array if plan.task_array is not None else np.array(plan.tasks, np.int64).reshape(-1, 4)
    table = np.full((len(tasks), TASK_COLUMNS + 2 * arity), -1, np.int64)
    table[:, :4] = tasks
    kinds, sizes = tasks[:, 0], tasks[:, 2]
    copies = {"gather": 0, "gathered": 0, "pull": 0, "push": 0}
    for kid, fn in enumerate(fns):
        kind_plan = plan.kinds[kid] if kid < len(plan.kinds) else None
        if fn is None or kind_plan is None:
            continue
        mine = kind_plan.tasks if kind_plan.tasks is not None else np.flatnonzero(kinds == kid)
        if not len(mine):
            continue
        slots = list(fn.gathers)
        if opts.gather_elision and slots:   # (the kind's tasks in task order, as ``mine``)
            views = [kind_plan.strides[j] for j in slots]
            if slots == list(range(len(slots))) and kind_plan.view_table is not None \
                    and kind_plan.view_table.shape[1] == 2 * len(slots):
                table[mine, TASK_COLUMNS:TASK_COLUMNS + 2 * len(slots)] = kind_plan.view_table
            else:
                for j, (start, step) in zip(slots, views):
                    table[mine, TASK_COLUMNS + 2 * j] = start
                    table[mine, TASK_COLUMNS + 2 * j + 1] = step
        else:
            views = [(table[mine, TASK_COLUMNS + 2 * j], table[mine, TASK_COLUMNS + 2 * j + 1]) for j in slots]
        views = dict(zip(slots, views))
        if opts.gather_elision and len(slots) >= 2:   # the children side by side: F's concat, ∂F's gradient
            k = len(slots)
            first = views[slots[0]][0]
            ok = views[slots[0]][1] == k
            for i, j in enumerate(slots[1:], 1):
                start, step = views[j]
                ok &= (step == k) & (start == first + i)
            table[mine, 4] = np.where(ok, first, -1)
        if not backward:
            bs = sizes[mine]
            rows = kind_plan.n   # (its tasks' rows)
            moves = _task_moves(fn, opts)
            _count_copies(copies, moves, rows, {j: int(bs[views[j][1] < 0].sum()) if opts.gather_elision else rows
                                                for j in moves[0]})
    if backward:
        table = table[::-1]
    return np.ascontiguousarray(table), copies


def block_rows(lowered, fns: list, plan, opts, copies: dict | None = None):
    """The task-table rows of the blocks before and after the task loop (each a task of all its kind's rows:
    kind offset 0, scatter offset its first scatter row, the children's concat view's first row), or why this
    pass runs them in Python (the linked program's ``blocks_why``). A kind whose scatter rows are no one block
    of rows (2Type, lattice: kinds interleaved by height) gets scatter offset -1: its blocks' SROWS and SPUT
    move those rows by the kind's row index (``srows``). ``copies``: F's row counters, to which the blocks'
    gathers, pulls and pushes are added."""
    if lowered.blocks_why is not None:
        return None, None, lowered.blocks_why
    pre, post = [], []
    firsts: dict = {}
    for b in lowered.blocks:
        kind_plan = plan.kinds[b.kid]
        n = kind_plan.n
        row = [b.tid, 0, n, -1, -1] + [-1] * (lowered.table_width - TASK_COLUMNS)
        if b.scatter_rows and n:
            if b.kid not in firsts:
                rows = as_slice(plan.scatter_rows(b.kid))
                firsts[b.kid] = rows.start if isinstance(rows, slice) else -1
            row[3] = firsts[b.kid]
        if b.regather and n:
            rows = as_slice(np.stack([kind_plan.child_rows[j] for j in fns[b.kid].gathers], axis=1).reshape(-1))
            if isinstance(rows, slice):
                row[4] = rows.start
        if copies is not None:
            gathers, pulls, pushes = b.moves
            copies["gather"] += n * gathers
            copies["gathered"] += n * gathers
            copies["pull"] += n * pulls
            copies["push"] += n * pushes
        (pre if b.phase == PRE else post).append(row)
    return (np.array(pre, np.int64).reshape(-1, lowered.table_width),
            np.array(post, np.int64).reshape(-1, lowered.table_width), None)


def _task_moves(fn, opts) -> tuple:
    """What F's task loop moves per vertex under ``opts``: (the gather slots it takes there, its pulls, its
    pushes), the copy counters' factors; found once per function and options (kept with its phases)."""
    key = ("task moves", opts.compiled)
    found = fn._phases.get(key)
    if found is None:
        phase = fn.phases(opts)[0].phase
        found = fn._phases[key] = (tuple(j for j, g in fn.gathers.items() if phase[g] == TASK),
                                   sum(phase[p] == TASK for p in fn.pulls.values()),
                                   sum(phase[p] == TASK for p in fn.pushes.values()))
    return found


def _count_copies(copies: dict, moves: tuple, rows: int, gather_rows) -> None:
    """Add one kind's row moves in its task loop (``moves``: :func:`_task_moves`; ``rows`` vertices;
    ``gather_rows[j]``: the rows gather slot j copies, those of the tasks where it is no view) to the
    program's counters."""
    slots, pulls, pushes = moves
    copies["gathered"] += rows * len(slots)
    copies["gather"] += sum([gather_rows[j] for j in slots])
    copies["pull"] += rows * pulls
    copies["push"] += rows * pushes


# --- streaming: the blocks before the task loop as a second table, one chunk per task ----------------------

def eager_rows(lowered, table: np.ndarray, forest: bool) -> tuple[np.ndarray | None, str | None]:
    """(The eager stream's table, None) or (None, why the pass cannot stream). Row t, for task row t of
    ``table`` (the task table, in run order): its kind's template of the block before the task loop over the
    task's rows (the same kind offset, rows, scatter offset and views; a kind with no such block: a template
    of no instructions), so a runner can run chunk t on its second stream ahead of task t and task t waits
    for it. Exact because a block before the task loop computes eager nodes, row by row: its parameter
    gradients are accumulated chunk by chunk (instructions.link lowers them so under streaming) and its
    scatter rows are the task's, a view at the task's scatter offset. Refused where chunks would race with
    the task loop: a block that adds gather gradients into rows that tasks add into too (a DAG's)."""
    if lowered.blocks_why is not None:
        return None, lowered.blocks_why
    nk = len(lowered.ranges) // 3
    if not any(b.phase == PRE for b in lowered.blocks):
        return None, "no block before the task loop"
    if not len(table):
        return None, "no tasks"
    if not forest:
        pre_adds, task_adds = _writes(lowered, "ADJ", PRE), _writes(lowered, "ADJ", TASK)
        if pre_adds & task_adds:
            kind = next(b.template.kind for b in lowered.blocks if b.phase == PRE
                        and _writes(lowered, "ADJ", PRE, b.tid) & task_adds)
            return None, (f"kind '{kind}' (before tasks) adds gather gradients into rows the task loop adds "
                          "into too (a DAG)")
    rows = np.array(table, np.int64, copy=True)
    rows[:, 0] += nk
    return rows, None


def eager_accumulators(lowered) -> list:
    """Buffer ids of the parameter-gradient accumulators that both the eager stream (the blocks before the task
    loop) and the task loop add into: a runner gives the eager stream its own (zeros) and adds it after the
    pass, so the two streams never add into one buffer at once."""
    found = lowered.__dict__.get("_eager_accumulators")
    if found is None:
        found = lowered.__dict__["_eager_accumulators"] = sorted(_writes(lowered, "GACC", PRE)
                                                                & _writes(lowered, "GACC", TASK))
    return found


def _writes(lowered, opcode: str, phase: int, tid: int | None = None) -> set:
    """The buffer ids (the first operand) of ``opcode``'s instructions in the templates of ``phase`` (or the
    one template ``tid``)."""
    nk = len(lowered.ranges) // 3
    first = {TASK: 0, PRE: nk, POST: 2 * nk}[phase]   # (instructions.Lowered's template ids)
    tids = range(first, first + nk) if tid is None else [tid]
    found = set()
    for t in tids:
        begin, end = lowered.ranges[t]
        code = lowered.code[begin:end]
        found.update(code[code[:, 0] == OPCODE_IDS[opcode], 1].tolist())
    return found
