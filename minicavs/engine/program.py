"""Programs as data and the step runner that runs them.

A list of steps (:class:`~minicavs.engine.compile.Step` records) says what runs (a registry op's impl, or a
generated kernel computing a fused group), on which values, into which. Static graphs (``Executor``), F and ∂F (the
engine's phases) all run through :func:`run_steps`; a step can be written straight into a buffer it is given
(``outs``: a dynamic tensor's rows, the scatter tensor's rows, a concat's column block), which is how values land where
the compiler placed them without copies.

A batch's binding of a lowered program (lowered.py) lives here too: its task table (one row per task, in the
order they run), the rows of the blocks before and after the task loop, the per-run dropout table, and every
buffer resolved once (operands.py); the device's runner then receives the :class:`BatchProgram` and runs
template x task table.
"""
from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..core.arrays import is_planned, on_device
from ..core.errors import FeedError
from ..core.random import hash_words
from ..core.sparse import RowSparse
from ..core.validate import indices
from ..ir.graph import Node, fmt_shape
from ..ops.flow import is_loop, steps_run
from ..ops.message import as_slice
from ..ops.registry import OPS
from .compile import PRE, TASK, StaticNodes, Step
from .instructions import TASK_COLUMNS
from .operands import bind_operands


@dataclass
class RunContext:
    """What an op may read besides its inputs: the dropout hash words and the train/eval switch."""

    seed: int = 0
    step: int = 0
    training: bool = True
    row_keys: Any = None  # per-row keys of the rows being computed (None: the row index)


def run_steps(steps: Sequence[Step], env: dict, xp, ctx: RunContext, outs: Mapping | None = None) -> None:
    """The step runner: run ``steps`` in order, reading and writing values in ``env``. A fused step whose
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
    kernel or runner ever sees a layout it does not expect (the C runner addresses buffers by
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
    value = getattr(value, "value", value)
    if type(value) is np.ndarray and value.shape == n.shape and value.dtype == n.dtype.np \
            and value.flags.c_contiguous and value.dtype.isnative:
        return value   # (the usual parameter: what check_value and host_layout would return, in one test)
    value = check_value(n, value, "parameter")
    return value if planned_view(value) else host_layout(value)


def planned_view(value) -> bool:
    """Is ``value`` a column block of a planned parameter buffer (ParameterSet.plan_buffer, arrays.mark_planned): a
    host array in native byte order whose last axis is contiguous, a matrix's rows at a stride at least
    their width? Read in place, not copied: a product reads it through its row stride, the column blocks of one
    merged product are one view (ops.shape.adjacent_blocks), and the runners copy a static only where they
    would copy a transposed parameter."""
    if not isinstance(value, np.ndarray) or not is_planned(value.base) or not value.dtype.isnative \
            or value.ndim not in (1, 2) or value.strides[-1] != value.itemsize:
        return False
    return value.ndim == 1 or (value.strides[0] % value.itemsize == 0
                               and value.strides[0] >= value.shape[1] * value.itemsize)


def _entries(nodes: StaticNodes) -> tuple:
    """What :func:`evaluate` reads of each of ``nodes`` (:func:`_entry`), found on first use and kept with them."""
    found = nodes.__dict__.get("entries")
    if found is None:
        found = nodes.__dict__["entries"] = tuple(map(_entry, nodes))
    return found


def _entry(n: Node) -> tuple:
    """(node, fed, its step, is it a concat: its inputs side by side), what evaluate reads of a node."""
    if n.op in ("input", "param"):
        return n, True, None, False
    step = _STEPS.get(n)
    if step is None:
        step = _STEPS[n] = Step.of(n)
    return n, False, step, OPS[n.op].column_blocks is not None


def evaluate(nodes: Sequence[Node], env: dict, feeds: Mapping, params: Mapping, ctx: RunContext,
             xp=np) -> list[Step]:
    """Evaluate ``nodes`` (in topological order; a :class:`StaticNodes` reads what it knows of them) into
    ``env``, keeping every value (for a backward pass): nodes already in ``env`` are not recomputed; returns
    the steps :func:`run_steps` ran (what :func:`record` reads). Feeds and parameters must already be arrays of
    ``xp``'s device. A concat whose value was a view of a planned parameter buffer (a merged product's weight:
    its parameters' adjacent column blocks) is that same view again while its inputs are the same arrays: a
    view follows their values, and the runners find the array they addressed last batch."""
    steps, concats = [], False
    for n, fed, step, concat in (_entries(nodes) if type(nodes) is StaticNodes else
                                 (_entry(n) for n in nodes if n not in env)):
        if n in env:
            continue
        if fed:
            env[n] = leaf_value(n, feeds, params)
            continue
        if concat:
            known = _VIEWS.get(n)
            if known is not None and all(map(operator.is_, known[0], [env.get(x) for x in n.inputs])):
                env[n] = known[1]
                continue
            concats = True
        steps.append(step)
    if steps:   # (parameters only: F's statics at inference)
        run_steps(steps, env, xp, ctx)
        for step in steps if concats else ():
            n = step.outputs[0]
            if OPS[n.op].column_blocks is not None and n in env and is_planned(getattr(env[n], "base", None)):
                _VIEWS[n] = (tuple(env[x] for x in n.inputs), env[n])
    return steps


_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # node -> its Step (made once, not per run)
_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # concat -> (its inputs' arrays, their view)


@dataclass
class StaticRun:
    """What the step runner ran of one static graph in a model run, for ``explain``: the steps, who ran
    them, the bytes each step's value holds, the row counts of the values with the row axis, and per loop
    the steps it ran (flow.steps_run: 0-d arrays, read by the reader; a loop missing ran its length)."""

    title: str
    steps: list
    runner: str
    nbytes: list
    rows: tuple
    trips: dict
    program: Any = None   # the static graph's program (static_program.py) as the device's runner ran it
    left: dict = None     # node -> why the step runner ran it, not the program
    linked: str = ""      # linked into a structure's pass (linked_head.py), or why its program ran apart ("")
    host: dict = None     # node -> what the host does for it, evaluating no op (static_sparse.py)


def record(title: str, steps: list, env: dict, xp) -> StaticRun:
    """The :class:`StaticRun` of ``steps`` that :func:`evaluate` just ran into ``env`` (a few attribute reads
    a step, no device read: it runs at every model run, so what it reads of a step's outputs is found once)."""
    rows, trips, nbytes = set(), {}, []
    for step in steps:
        outline = step.outline
        if outline is None:   # (per output: has it the row axis; the outputs that are loops)
            outline = step.outline = (tuple(node.has_rows for node in step.outputs),
                                      tuple(node for node in step.outputs if is_loop(node)))
        total = 0
        for node, with_rows in zip(step.outputs, outline[0]):
            value = env.get(node)
            if type(value) is np.ndarray:
                total += value.nbytes
                if with_rows and value.ndim:
                    rows.add(value.shape[0])
            else:
                total += value_bytes(value)
                if with_rows and getattr(value, "shape", None):
                    rows.add(int(value.shape[0]))
        nbytes.append(total)
        for node in outline[1]:
            ran = steps_run(node, env)
            if ran is not None:
                trips[node] = ran
    runner = f"Python step runner (program.run_steps, over {getattr(xp, '__name__', xp)})"
    return StaticRun(title, steps, runner, nbytes, tuple(sorted(rows)), trips)


def value_bytes(value) -> int:
    """The bytes a value holds: an array's, a row-sparse value's rows and indices, a tuple's parts."""
    if isinstance(value, tuple):
        return sum(map(value_bytes, value))
    if isinstance(value, RowSparse):
        return value_bytes(value.rows) + value_bytes(value.indices)
    return int(getattr(value, "nbytes", 0))


# --- batch programs: the lowered program bound to one batch ---------------------------------------------

COPIES = ("gather", "gathered", "pull", "push")   # the rows a pass moves, by what moved them


@dataclass(eq=False)
class BatchProgram:
    """F's (or ∂F's) lowered program (instructions.py: the kinds' templates, linked) bound to one batch: the
    task table (the blocks before the task loop, one row per task in the order they run, the blocks after it),
    every buffer resolved once (operands.bind_operands: the operands, the gradient accumulators, the eager
    stream's own), and who ran it. What a runner receives (Backend.run): it reads nothing else of the batch."""

    title: str
    lowered: Any                 # instructions.Lowered
    table: np.ndarray            # every row the runner runs, blocks included
    tasks: slice                 # the task rows of ``table``
    buffers: "Buffers"
    copies: dict                 # rows moved, by what moved them (COPIES)
    runner: str = ""             # who ran it (set by the engine)
    declined: str | None = None  # why the device's runner left it to the reference runner (None: it did not)
    eager: np.ndarray | None = None   # streaming: the eager stream's table (eager_rows), chunk t before task t
    eager_why: str | None = None      # streaming, and no eager stream: why
    dtype: Any = np.float64      # the numbers' dtype (numpy's)
    forest: bool = True          # every vertex has one parent (gather gradients written, not added)
    check: bool = False          # the runners' debug mode: every row number checked too
    tf32: bool = False           # float32 products may read TF32 inputs (engine.tf32; where the device has them)
    bound: Any = None            # operands.Bound: the operands, accumulators and the eager stream's own

    @classmethod
    def of(cls, lowered, table: np.ndarray, buffers, dtype, device, forest: bool = True, check: bool = False,
           eager: np.ndarray | None = None, workspace=None, title: str | None = None) -> "BatchProgram":
        """``lowered`` over ``table`` bound on ``device`` (a hand-written program's, or the engine's)."""
        table = np.ascontiguousarray(table, np.int64)
        eager = None if eager is None else np.ascontiguousarray(eager, np.int64)
        program = cls(title or lowered.title, lowered, table, slice(0, len(table)), buffers, {}, eager=eager,
                      dtype=np.dtype(dtype), forest=forest, check=check)
        program.bound = bind_operands(lowered, table, buffers, program.dtype, device, eager, workspace)
        return program

    @property
    def operands(self) -> list:
        return self.bound.operands

    @property
    def gradients(self) -> dict:
        """{parameter name: the accumulator this pass adds its gradient into}."""
        return self.bound.gradients

    @property
    def task_table(self) -> np.ndarray:
        return self.table[self.tasks]

    def dump(self) -> str:
        """The templates, one instruction a line, under a line that says what ran them."""
        tasks, after = self.task_table, self.table[self.tasks.stop:, 0]
        linked = int(np.isin(after, list(self.lowered.tail)).sum()) if self.lowered.tail else 0
        post = f"({len(after) - linked} rows)" + (f", then the static graph linked after them ({linked} rows)"
                                                 if linked else "")
        if self.eager is not None:
            lines = [f"{self.title}: main stream ({self.runner}): tasks 0:{len(tasks)}, task t after eager chunk "
                     f"t, then the blocks after the task loop {post}: per block or task, its template",
                     f"  eager stream ({self.runner}): chunks 0:{len(self.eager)}, chunk t the block before the "
                     "task loop of task t's kind over task t's rows"]
        else:
            lines = [f"{self.title}: one call of the {self.runner} runs the blocks before the task loop "
                     f"({self.tasks.start} rows), tasks 0:{len(tasks)} and the blocks after it {post}: per block "
                     "or task, its template"]
            if self.eager_why is not None:
                lines.append(f"  (no eager stream: {self.eager_why})")
        if self.declined is not None:
            lines.append(f"  (the device's runner declined this pass: {self.declined})")
        lines += [f"  {line}" for line in self.lowered.lines()]
        return "\n".join(lines)


def bind(lowered, compiled: list, plan, opts, buffers: "Buffers", backward: bool, device, forward_tasks=None,
         workspace=None, tail: np.ndarray | None = None) -> BatchProgram:
    """The lowered program of a pass bound to the batch on ``device``: its table (program rows of the blocks and
    the tasks: :func:`block_rows`, :func:`task_table`; backward: the forward tasks reversed, when given; ``tail``:
    rows after the blocks, a linked static graph's) and every buffer resolved (operands.bind_operands)."""
    copies = dict.fromkeys(COPIES, 0)
    if backward and forward_tasks is not None:
        tasks = np.ascontiguousarray(forward_tasks[::-1])
    else:
        tasks, task_copies = task_table(compiled, plan, opts, backward)
        for k, v in task_copies.items():
            copies[k] += v
    pre, post = block_rows(lowered, compiled, plan, opts, None if backward else copies)
    buffers.dropouts = lowered.dropouts
    eager, eager_why = eager_rows(lowered, tasks, plan.forest) if opts.streaming else (None, None)
    if eager is not None:   # (the blocks before the task loop run as the eager stream's chunks instead)
        pre = pre[:0]
    if tail is not None:   # (one concatenation with the blocks')
        table = np.concatenate([pre, tasks, post, tail])
    else:
        table = np.concatenate([pre, tasks, post]) if len(pre) or len(post) else tasks
    program = BatchProgram("∂F" if backward else "F", lowered, table, slice(len(pre), len(pre) + len(tasks)),
                           buffers, copies, eager=eager, eager_why=eager_why, dtype=np.dtype(buffers.dtype),
                           forest=plan.forest, check=opts.check, tf32=opts.tf32 and device.tf32_products)
    program.bound = bind_operands(lowered, table, buffers, program.dtype, device, eager, workspace)
    return program


@dataclass
class Buffers:
    """The batch's buffers a lowered program names, as typed fields; ``buffers[key]`` gives the array of one
    of the program's buffer keys (lowered.py), made or looked up when the binder resolves it (operands.py), once a
    pass. Index arrays (children's rows, pull and push rows, row keys) are host arrays: the binder has the device
    copy each over (Backend.index).

    ``state`` is held weakly (a proxy): the state holds its programs and they their buffers, so a strong
    reference made every batch's state, plan and buffers a reference cycle that only the cyclic garbage
    collector freed, long after the step, while later steps' arrays were allocated around them (the heap
    grew without bound)."""

    plan: Any                       # memory.MemoryPlan
    state: Any                      # the forward pass's alg1.RunState (a weak proxy to it)
    dtype: Any
    ctx: RunContext
    btensors: dict | None = None    # backward: per kind its dynamic tensors of ∂F
    sgrads: dict | None = None      # backward: per message shape the scatter gradient
    push_grads: dict | None = None  # backward: per push its gradient (dense or row-sparse)
    pull_grads: dict | None = None  # backward: per pull its gradient
    compiled: list | None = None         # each kind's compiled function (the parameter gradients' shapes)
    dropouts: list = ()             # the program's DROPOUT entries (p, site), whose table ``ctx`` decides
    head: Any = None                # a linked static graph's buffers (linked_head.py): the keys F does not name

    def __post_init__(self):
        self._sparse: dict = {}
        if not isinstance(self.state, weakref.ProxyType):   # (see the class's docstring)
            self.state = weakref.proxy(self.state)

    def __getitem__(self, key: tuple):
        return _BY_WHAT[key[0]](self, *key[1:])

    @staticmethod
    def getter(key: tuple) -> tuple:
        """(the function resolving ``key``, its arguments after the buffers): what ``buffers[key]`` calls, found
        once per program's entry by the binder (operands.py) instead of at every batch."""
        found = _BY_WHAT.get(key[0])
        return (Buffers.__getitem__, (key,)) if found is None else (found, key[1:])

    def _static(self, node, kind_id):
        value = self.state.statics[kind_id].get(node)
        return self.head[("static", node, kind_id)] if value is None else value


    def _child(self, slot, kind_id):
        return _index(self.plan.kinds[kind_id].child_rows[slot])

    def _tensor(self, node, kind_id):
        return self.state.tensors[kind_id][node].buffer

    def _btensor(self, node, kind_id):
        return self.btensors[kind_id][node].buffer

    def _scatter(self, message):
        return _prefix(self.state.workspace.scatters, message, self.state.scatters[message])

    def _sgrad(self, message):
        return _prefix(self.state.workspace.scatter_grads, message, self.sgrads[message])

    def _srows(self, kind_id):
        return _index(self.plan.scatter_rows(kind_id))

    def _pullrows(self, name, kind_id):
        return _index(self.plan.kinds[kind_id].pull_rows[name])

    def _pushrows(self, name, kind_id):
        rows = self.plan.kinds[kind_id].push_rows[name]
        if self.push_grads is not None and isinstance(self.push_grads.get(name), RowSparse):
            return self._coalesced(name)[1][rows]
        return _index(rows)

    def _pull(self, name):   # (the runner reads a buffer by base and row stride: a computed view is copied)
        buf = self.state.pull_bufs[name]
        return buf if buf.flags.c_contiguous else self.state.device.xp.ascontiguousarray(buf)

    def _push(self, name):
        return self.state.pushes[name]

    def _pullgrad(self, name):
        return self.pull_grads[name]

    def _pushgrad(self, name):
        grad = self.push_grads[name]
        if isinstance(grad, RowSparse):
            return self._coalesced(name)[0]
        return grad if grad.flags.c_contiguous else self.state.device.xp.ascontiguousarray(grad)   # (a broadcast)

    def _rowkeys(self, kind_id):   # (dropout's: uint64, the kind's rows)
        return np.ascontiguousarray(self.plan.kinds[kind_id].row_keys, np.uint64)

    def _dropout(self):
        return dropout_table(self.dropouts, self.ctx)

    def _arena(self, which, elements):
        return self.state.workspace.arena_prefix(which, elements, self.dtype)

    def _pgrad(self, name, how="add"):   # (a block computes a "set" one straight into it: no zeros needed)
        xp = self.state.device.xp
        if how == "block":   # ((parameter, first column, end), ...): one buffer, the gradients its column blocks
            lead = next(fn.param_grads[name[0][0]] for fn in self.compiled
                        if fn is not None and name[0][0] in fn.param_grads).shape[:-1]
            return xp.empty(lead + (name[-1][2],), self.dtype)
        node = next(fn.param_grads[name] for fn in self.compiled if fn is not None and name in fn.param_grads)
        return xp.empty(node.shape, self.dtype) if how == "set" else xp.zeros(node.shape, self.dtype)

    def _coalesced(self, name):
        """A row-sparse push gradient (Tree-FC's: the roots' rows) read where it is: its rows, one per index,
        which the kinds' push rows are mapped onto (-1: a zero row; TAKE writes zeros)."""
        if name not in self._sparse:
            grad = self.push_grads[name].checked(f"gradient of push '{name}'").coalesce()
            where = np.full(grad.shape[0], -1, np.int64)
            where[grad.indices] = np.arange(len(grad.indices))
            self._sparse[name] = (np.ascontiguousarray(grad.rows), where)
        return self._sparse[name]


# buffer key's first item -> the Buffers method that resolves it (plain functions: bound methods held by the
# instance would make each batch's Buffers a reference cycle)
_BY_WHAT = {what: getattr(Buffers, "_" + what) for what in (
    "static", "child", "tensor", "btensor", "scatter", "sgrad", "srows", "pullrows", "pushrows", "pull", "push",
    "pullgrad", "pushgrad", "rowkeys", "dropout", "arena", "pgrad")}
_BY_WHAT.update({what: lambda self, *rest, what=what: self.head[(what,) + rest] for what in (
    "value", "feedrows", "feedcols", "out", "stacked")})


def _index(rows) -> np.ndarray:
    return np.ascontiguousarray(rows, np.int64)


def _prefix(tensors: dict, message: tuple, view):
    """``view`` as (its workspace buffer, elements) when it is that buffer's first rows (see
    memory.DynamicTensor.prefix: the runner keeps the buffer's address), else ``view``."""
    tensor = tensors.get(message)
    return view if tensor is None else tensor.prefix(view)


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


def task_table(compiled: list, plan, opts, backward: bool) -> tuple[np.ndarray, dict]:
    """One row per task, in the order they run (backward: the stack popped, the same rows reversed), built
    with numpy: kind, kind offset, rows, scatter offset, the sibling-concat view's first row (-1: none), and
    per gather slot the strided view (start, step; step -1: none). Also the rows moved, for the program's
    copy counters."""
    arity = max((len(fn.gathers) for fn in compiled if fn is not None), default=0)
    planned = _planned_task_table(compiled, plan, opts, backward, arity)
    if planned is not None:
        return planned
    tasks = plan.task_array
    table = np.full((len(tasks), TASK_COLUMNS + 2 * arity), -1, np.int64)
    table[:, :4] = tasks
    kinds, sizes = tasks[:, 0], tasks[:, 2]
    copies = {"gather": 0, "gathered": 0, "pull": 0, "push": 0}
    for kind_id, fn in enumerate(compiled):
        kind_plan = plan.kinds[kind_id] if kind_id < len(plan.kinds) else None
        if fn is None or kind_plan is None:
            continue
        mine = kind_plan.tasks if kind_plan.tasks is not None else np.flatnonzero(kinds == kind_id)
        if not len(mine):
            continue
        slots = list(fn.gathers)
        if opts.gather_elision and slots:   # (the kind's tasks in task order, as ``mine``)
            strides = kind_plan.strides
            views = [strides[j] for j in slots]
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


def _planned_task_table(compiled: list, plan, opts, backward: bool, arity: int) -> tuple | None:
    """The task table the C planner made (planner.py) with the rows moved, where every kind gathers slots
    0..arity - 1 as it assumed; None otherwise."""
    made = plan.task_views
    if made is None or not opts.gather_elision or made.shape[1] != TASK_COLUMNS + 2 * arity \
            or len(compiled) != len(plan.view_arity) or not all(
                fn is not None and len(fn.gathers) == a and list(fn.gathers) == list(range(a))
                for fn, a in zip(compiled, plan.view_arity)):
        return None
    copies = {"gather": 0, "gathered": 0, "pull": 0, "push": 0}
    if not backward:
        for kind_id, fn in enumerate(compiled):
            kind_plan = plan.kinds[kind_id]
            if kind_plan is not None:   # (its gather slots are 0..arity - 1: a list indexed by slot)
                _count_copies(copies, _task_moves(fn, opts), kind_plan.n, plan.gather_copies[kind_id].tolist())
    return (np.ascontiguousarray(made[::-1]) if backward else made), copies


def block_rows(lowered, compiled: list, plan, opts, copies: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The table rows of the blocks before and after the task loop (each a task of all its kind's rows: kind
    offset 0, scatter offset its first scatter row, the children's concat view's first row). A kind whose
    scatter rows are no one block of rows (2Type, lattice: kinds interleaved by height) gets scatter offset
    -1: its blocks' SROWS and SPUT move those rows by the kind's row index (``srows``). ``copies``: F's row
    counters, to which the blocks' gathers, pulls and pushes are added."""
    pre, post = [], []
    firsts: dict = {}
    for b in lowered.blocks:
        kind_plan = plan.kinds[b.kind_id]
        n = kind_plan.n
        row = [b.tid, 0, n, -1, -1] + [-1] * (lowered.table_width - TASK_COLUMNS)
        if b.scatter_rows and n:
            if b.kind_id not in firsts:
                firsts[b.kind_id] = _first_scatter_row(plan, kind_plan)
            row[3] = firsts[b.kind_id]
        if b.regather and n:
            rows = as_slice(np.stack([kind_plan.child_rows[j] for j in compiled[b.kind_id].gathers],
                                     axis=1).reshape(-1))
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
            np.array(post, np.int64).reshape(-1, lowered.table_width))


def _first_scatter_row(plan, kind_plan) -> int:
    """The first of a kind's scatter rows when they are one block of rows, else -1. Its rows are its tasks'
    rows in task order, each task's a block at the task's scatter offset: one block exactly when its tasks
    are adjacent in the schedule (read off two task numbers, no index array built or compared)."""
    tasks = kind_plan.tasks
    if tasks is None:
        rows = as_slice(plan.scatter_rows(kind_plan.kind_id))
        return rows.start if isinstance(rows, slice) else -1
    first, last = int(tasks[0]), int(tasks[-1])
    return int(plan.task_array[first, 3]) if last - first == len(tasks) - 1 else -1


def _task_moves(fn, opts) -> tuple:
    """What F's task loop moves per vertex under ``opts``: (the gather slots it takes there, its pulls, its
    pushes), the copy counters' factors; found once per function and options (kept with its phases)."""
    def make() -> tuple:
        phase = fn.phases(opts).forward.phase
        return (tuple(j for j, g in fn.gathers.items() if phase[g] == TASK),
                sum(phase[p] == TASK for p in fn.pulls.values()), sum(phase[p] == TASK for p in fn.pushes.values()))
    return fn.derived(("task moves", opts.compile_key()), make)


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
    n_kinds = lowered.n_kinds
    if not any(b.phase == PRE for b in lowered.blocks):
        return None, "no block before the task loop"
    if not len(table):
        return None, "no tasks"
    if not forest:
        pre_adds, task_adds = lowered.writes("ADJ", PRE), lowered.writes("ADJ", TASK)
        if pre_adds & task_adds:
            kind = next(b.kind for b in lowered.blocks if b.phase == PRE
                        and lowered.writes("ADJ", PRE, b.tid) & task_adds)
            return None, (f"kind '{kind}' (before tasks) adds gather gradients into rows the task loop adds "
                          "into too (a DAG)")
    rows = np.array(table, np.int64, copy=True)
    rows[:, 0] += n_kinds
    return rows, None
