"""Alg. 1: F over the tasks of a schedule (forward) and ∂F over the task stack popped (backward).

Each pass binds the compiled F or ∂F to the batch (program.py: a BatchProgram of blocks whose views, row
indices and output buffers are made before the loop) and runs it: the blocks before the task loop (eager
nodes over all vertices of a kind, §3.4; streaming: task by task on the second stream), one block per task,
the blocks after it (lazy nodes: pushes, parameter and pull gradients). Memory moves only at F's entrance and
exit (ops/message.py): gather takes the children's scattered rows, pull takes rows of an external buffer,
scatter writes the task's contiguous rows of the scatter tensor of its kind's message shape (shared by the kinds
scattering that shape; a gather reads the tensor of the shape it declared), push writes rows of an external
buffer. Backward reads forward values from their dynamic tensors at the same offsets and *adds* gradients:
gather's adjoint scatter-adds into the children's rows of the scatter-gradient tensor, so a DAG vertex with
several parents receives all contributions. Every buffer comes from the model's workspace (memory.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from . import instructions, program as binding, reference

from .backend import Backend as Device
from .compile import POST, PRE, TASK, CompiledFunction, EngineOptions  # noqa: F401 (the engine's public names)
from .cpu import CPU
from .memory import MemoryPlan, Workspace
from .ops.message import row_index
from .program import BatchProgram, RunContext, bind_backward, bind_forward, emit_gradients, evaluate, run_block
from .sparse import RowSparse, add_all, densify

def _native(fns: list, active: list, opts: EngineOptions, device: Device, dtype, backward: bool,
            workspace: Workspace, training: bool = True):
    """(The task loop lowered for the native executor, None) or (None, why the Python interpreter runs it:
    another executor asked for, no compiler or BLAS (cpu/native.py warned once), an op the lowering cannot
    express). The reason is kept on the program (``native_why``, shown by dump())."""
    if opts.executor == "python":
        return None, "executor 'python'"
    why = device.runner_missing(dtype.np) if opts.executor == "native" else None
    if why is not None:
        return None, why
    lowered = instructions.link(fns, sorted(active), opts, device, backward, training, workspace.programs)
    return (None, lowered) if isinstance(lowered, str) else (lowered, None)


def _runner(opts: EngineOptions, device: Device):
    """(Who runs the lowered program, its run function): the reference runner over the device's arrays when
    asked for, else the device's own runner (the C executor on the CPU)."""
    if opts.executor == "reference":
        return "reference runner", functools.partial(reference.run, device=device)
    return device.runner_name, device.run_program


def _resolver(fns: list, plan: MemoryPlan, state: "RunState", dtype, ctx: RunContext, dropouts: list,
              btensors=None, sgrads=None, push_grads=None, pull_grads=None):
    """``key -> array`` for the buffers a lowered program names (instructions.py's buffer keys; ``dropouts``:
    the program's DROPOUT entries, whose table ``ctx`` decides)."""
    xp = state.device.xp

    def index(a):   # (host arrays: a device's runner copies each over once)
        return np.ascontiguousarray(a, np.int64)

    sparse: dict = {}

    def coalesced(name):
        """A row-sparse push gradient (Tree-FC's: the roots' rows) read where it is: its rows, one per index,
        which the kinds' push rows are mapped onto (-1: a zero row; the executor's TAKE writes zeros)."""
        if name not in sparse:
            grad = push_grads[name].checked(f"gradient of push '{name}'").coalesce()
            where = np.full(grad.shape[0], -1, np.int64)
            where[grad.indices] = np.arange(len(grad.indices))
            sparse[name] = (np.ascontiguousarray(grad.rows), where)
        return sparse[name]

    def resolve(key):   # (the kinds of key most programs have most of come first)
        what = key[0]
        if what == "static":
            return state.statics[key[2]][key[1]]
        if what == "child":
            return index(plan.kinds[key[2]].child_rows[key[1]])
        if what == "tensor":
            return state.tensors[key[2]][key[1]].buffer
        if what == "btensor":
            return btensors[key[2]][key[1]].buffer
        if what == "scatter":
            return _prefix(state.workspace.scatters, key[1], state.scatters[key[1]])
        if what == "sgrad":
            return _prefix(state.workspace.scatter_grads, key[1], sgrads[key[1]])
        if what == "srows":
            return index(plan.scatter_rows(key[1]))
        if what == "pullrows":
            return index(plan.kinds[key[2]].pull_rows[key[1]])
        if what == "pushrows":
            if push_grads is not None and isinstance(push_grads.get(key[1]), RowSparse):
                return coalesced(key[1])[1][plan.kinds[key[2]].push_rows[key[1]]]
            return index(plan.kinds[key[2]].push_rows[key[1]])
        if what == "pull":   # (the executor reads a buffer by base and row stride: a computed view is copied)
            buf = state.pull_bufs[key[1]]
            return buf if buf.flags.c_contiguous else xp.ascontiguousarray(buf)
        if what == "push":
            return state.pushes[key[1]]
        if what == "pullgrad":
            return pull_grads[key[1]]
        if what == "pushgrad":
            grad = push_grads[key[1]]
            if isinstance(grad, RowSparse):
                return coalesced(key[1])[0]
            return grad if grad.flags.c_contiguous else xp.ascontiguousarray(grad)   # (e.g. a broadcast)
        if what == "rowkeys":   # (dropout's: uint64, the kind's rows)
            return np.ascontiguousarray(plan.kinds[key[1]].row_keys, np.uint64)
        if what == "dropout":
            return binding.dropout_table(dropouts, ctx)
        if what == "arena":
            return state.workspace.arena_prefix(key[1], key[2], dtype)
        if what == "pgrad":   # (a block computes a "set" one straight into it: no zeros needed)
            node = next(fn.param_grads[key[1]] for fn in fns if fn is not None and key[1] in fn.param_grads)
            return xp.empty(node.shape, dtype) if key[-1] == "set" else xp.zeros(node.shape, dtype)
        raise KeyError(key)
    return resolve


def _prefix(tensors: dict, message: tuple, view):
    """``view`` as (its workspace buffer, elements) when it is that buffer's first rows (see
    memory.DynamicTensor.prefix: the executor keeps the buffer's address), else ``view``."""
    tensor = tensors.get(message)
    return view if tensor is None else tensor.prefix(view)


@dataclass
class RunState:
    """What a forward pass leaves for backward (and for ``explain``)."""

    plan: MemoryPlan
    opts: EngineOptions
    scatters: dict                                  # message shape -> (N + 1, *shape); last row stays zero
    tensors: list = field(default_factory=list)     # per kind id: {node: DynamicTensor}
    statics: list = field(default_factory=list)     # per kind id: {node: value}
    pushes: dict = field(default_factory=dict)      # push name -> buffer
    copies: dict = field(default_factory=dict)      # rows moved by gather / pull / push
    pull_bufs: dict = field(default_factory=dict)    # the pulled buffers, read again by backward
    device: Device = CPU
    workspace: Workspace | None = None              # the buffers (reused across batches) it ran in
    program: BatchProgram | None = None             # F bound to the batch (what ran)
    backward_program: BatchProgram | None = None    # ∂F bound to the batch, once backward has run

    @property
    def scatter(self):
        """The scatter tensor when every kind scatters one shape (the usual case), else None."""
        return next(iter(self.scatters.values())) if len(self.scatters) == 1 else None


def _with_blocks(table: np.ndarray, pre: np.ndarray, post: np.ndarray) -> np.ndarray:
    """The task table with the rows of the blocks before and after the task loop (program.block_rows)."""
    return np.concatenate([pre, table, post]) if len(pre) or len(post) else table


def _streamed(program: BatchProgram, lowered, table: np.ndarray, blocks: tuple, opts: EngineOptions,
              forest: bool) -> np.ndarray:
    """The table the runner's main stream runs; streaming, the blocks before the task loop become the eager
    stream's table instead (program.eager_rows; kept on the program, or why not)."""
    pre, post = blocks
    if opts.streaming:
        program.eager_table, program.eager_why = binding.eager_rows(lowered, table, forest)
        if program.eager_table is not None:
            pre = pre[:0]
    return _with_blocks(table, pre, post)


def _device_index(xp, rows: np.ndarray):
    """:func:`row_index` for writing into an array of ``xp``: index arrays moved to its device."""
    ix = row_index(rows)
    return ix if isinstance(ix, slice) or xp is np else xp.asarray(ix)


def forward(fns: list, plan: MemoryPlan, pull_bufs: dict, params, ctx: RunContext, messages,
            dtype, training: bool = True, workspace: Workspace | None = None,
            opts: EngineOptions = EngineOptions(), device: Device = CPU) -> RunState:
    """Evaluate F at every vertex: eager phase, task loop, lazy phase. ``fns[kid]`` compiles kind ``kid``.
    Arrays (parameters, pull buffers, the workspace's buffers) are ``device``'s; the workspace (the model's,
    reused across batches; a fresh one by default) is kept in the state for backward. ``messages``: the
    scattered shapes (the structure's :attr:`message_shapes`), one scatter tensor each."""
    n = plan.num_vertices
    xp = device.xp
    workspace = Workspace(xp) if workspace is None else workspace
    state = RunState(plan, opts, {}, copies={"gather": 0, "gathered": 0, "pull": 0, "push": 0},
                     pull_bufs=pull_bufs, device=device, workspace=workspace)
    for shape in messages:
        state.scatters[tuple(shape)] = workspace.scatter_rows(n + 1, tuple(shape), dtype.np)
        state.scatters[tuple(shape)][n] = 0
    for name, order in plan.push_order.items():
        shape = next(f.pushes[name].vshape for f in fns if f is not None and name in f.pushes)
        state.pushes[name] = xp.zeros((len(order),) + shape, dtype.np)
    active = []
    for kid, fn in enumerate(fns):
        kind_plan = plan.kinds[kid] if kid < len(plan.kinds) else None
        tensors, static = {}, {}
        if fn is not None and kind_plan is not None:
            evaluate(fn.static_fwd, static, {}, params, ctx, xp=xp)
            stored = fn.placement(opts, device, training)[0]
            tensors = workspace.tensors(workspace.forward, kid, stored, kind_plan.n)
            active.append(kid)
        state.tensors.append(tensors)
        state.statics.append(static)

    native, why = _native(fns, active, opts, device, dtype, False, workspace, training)
    blocks = None
    if native is not None:
        block_copies = {"gather": 0, "gathered": 0, "pull": 0, "push": 0}
        pre, post, why = binding.block_rows(native, fns, plan, opts, copies=block_copies)
        blocks = None if why is not None else (pre, post)
    program = bind_forward(fns, plan, state, opts, device, active, training, with_tasks=native is None,
                           with_blocks=blocks is None)
    program.native_why = why
    state.program = program
    state.copies = program.copies
    statics = state.statics
    events = None
    # Alg. 1, forward: the eager phase (or, streaming, the eager stream task by task), then per task V_t:
    # gather the children's rows, evaluate F, scatter and push the results; then the lazy phase.
    if opts.streaming and native is None:   # (a runner runs its eager blocks batched, before the tasks)
        events, _ = device.eager([(block,) for block in program.before],
                                 lambda i, block, worker_ctx, _:
                                 run_block(block, statics[block.kid], xp, worker_ctx, device), ctx)
    else:
        for block in program.before:
            run_block(block, statics[block.kid], xp, ctx, device)
    if native is not None:
        table, copies = binding.task_table(fns, plan, opts, backward=False)
        program.native, program.task_table = native, table
        program.runner, run = _runner(opts, device)
        for k, v in copies.items():
            program.copies[k] += v
        if blocks is not None:   # one call runs the blocks before the task loop, the tasks and the blocks after
            for k, v in block_copies.items():
                program.copies[k] += v
            table = program.native_table = _streamed(program, native, table, blocks, opts, plan.forest)
        run(native, table, _resolver(fns, plan, state, dtype.np, ctx, native.dropouts), dtype.np, plan.forest,
            workspace, eager=program.eager_table)
    for t, block in enumerate(program.tasks):
        if events is not None:
            events[t].wait()
        run_block(block, statics[block.kid], xp, ctx, device)
    if events is not None:
        events[-1].wait()
    for block in program.after:
        run_block(block, statics[block.kid], xp, ctx, device)
    ctx.row_keys = None
    return state


def _scatter_grad(xp, fns: list, plan: MemoryPlan, message: tuple, scatter, workspace: Workspace):
    """The gradient of the scatter tensor of ``message``, before any parent has sent anything. In a forest
    every vertex that some parent gathers (with a gradient) receives exactly one write, so only the other
    rows (roots, children whose gather of this message has no gradient) need zeros; a DAG's rows
    accumulate, so all start at zero."""
    sgrad = workspace.scatter_grad_rows(scatter)
    if not plan.forest:
        sgrad.fill(0)
        return sgrad
    unwritten = np.ones(len(scatter), bool)
    for kid, fn in enumerate(fns):
        kind_plan = plan.kinds[kid] if kid < len(plan.kinds) else None
        if fn is None or kind_plan is None:
            continue
        for leaf in fn.leaf_grads:
            slot = fn.gather_slot.get(leaf)
            if slot is not None and fn.gather_messages[slot] == message:
                unwritten[kind_plan.child_rows[slot]] = False
    sgrad[_device_index(xp, np.flatnonzero(unwritten))] = 0
    return sgrad


def _dense_where_tasks_read(fns: list, active: list, opts, device, push_grads: dict) -> dict:
    """Push gradients as the task loop needs them: dense where some kind's task program reads its rows (it
    takes them task by task); elsewhere a row-sparse gradient (Tree-FC's: the roots' rows only) stays
    sparse, and the phase before or after the loop puts its few rows into zeros (program.bind_backward)."""
    out = dict(push_grads)
    for kid in active:
        fn = fns[kid]
        kp = fn.phases(opts, device)[1]
        for o, ct in fn.ct.items():
            if o is not fn.scattered and (kp.phase[ct] == TASK or device.xp is not np):
                out[o.name] = densify(device.xp, out[o.name])
    return out


def backward(fns: list, state: RunState, push_grads: dict, pull_shapes: dict, params, ctx: RunContext,
             dtype) -> tuple[dict, dict]:
    """Replay the task stack in reverse. Returns (gradients of pull buffers, gradients of F's parameters)."""
    plan, opts, device = state.plan, state.opts, state.device
    xp = device.xp
    n = plan.num_vertices
    workspace = state.workspace
    sgrads = {message: _scatter_grad(xp, fns, plan, message, scatter, workspace)
              for message, scatter in state.scatters.items()}
    pull_grads = {name: xp.zeros(shape, dtype.np) for name, shape in pull_shapes.items()}
    param_grads: dict = {}
    btensors = {}
    row_kernels = device.rows(dtype.np)
    active = []
    for kid, fn in enumerate(fns):
        if fn is not None and kid < len(plan.kinds) and plan.kinds[kid] is not None:
            evaluate(fn.static_bwd, state.statics[kid], {}, params, ctx, xp=xp)
            stored = fn.placement(opts, device)[2]   # only values that cross phases need rows kept
            btensors[kid] = workspace.tensors(workspace.backward, kid, stored, plan.kinds[kid].n)
            active.append(kid)

    push_grads = _dense_where_tasks_read(fns, active, opts, device, push_grads)
    native, why = _native(fns, active, opts, device, dtype, True, workspace)
    blocks = None
    if native is not None:
        pre, post, why = binding.block_rows(native, fns, plan, opts)
        blocks = None if why is not None else (pre, post)
    program = bind_backward(fns, plan, state, opts, device, active, btensors, sgrads, push_grads, pull_grads,
                            row_kernels, with_tasks=native is None, with_blocks=blocks is None)
    program.native_why = why
    state.backward_program = program
    statics = state.statics
    events = None
    # Alg. 1, backward: pop the task stack; per task V_t run ∂F at the same rows and add the gradients into
    # the children's rows; the eager phase (or stream) before it and the lazy phase after it.
    if opts.streaming and native is None:
        pre_envs = [None] * len(program.before)

        def produce(i, block, worker_ctx, _):
            pre_envs[i] = run_block(block, statics[block.kid], xp, worker_ctx, device)
        events, _ = device.eager([(block,) for block in program.before], produce, ctx)
    else:
        for block in program.before:
            emit_gradients(block, run_block(block, statics[block.kid], xp, ctx, device), param_grads, xp)
    if native is not None:
        forward_table = state.program.task_table   # (F's, when the native executor ran F: the rows reversed)
        table = np.ascontiguousarray(forward_table[::-1]) if forward_table is not None else \
            binding.task_table(fns, plan, opts, backward=True)[0]
        program.native, program.task_table = native, table
        program.runner, run = _runner(opts, device)
        if blocks is not None:
            table = program.native_table = _streamed(program, native, table, blocks, opts, plan.forest)
        resolve = _resolver(fns, plan, state, dtype.np, ctx, native.dropouts, btensors, sgrads, push_grads,
                            pull_grads)
        for name, g in run(native, table, resolve, dtype.np, plan.forest, workspace,
                           eager=program.eager_table).items():
            prev = param_grads.get(name)
            if prev is None:
                param_grads[name] = g
            elif isinstance(prev, RowSparse):
                param_grads[name] = add_all(xp, [prev, g])
            else:
                prev += g
    for i, block in enumerate(program.tasks):
        if events is not None:
            events[i].wait()
            emit_gradients(program.before[i], pre_envs[i], param_grads, xp)
            if device is CPU:   # a CUDA pool could hand the memory to the eager stream while still read
                pre_envs[i] = None
        emit_gradients(block, run_block(block, statics[block.kid], xp, ctx, device), param_grads, xp)
    for block in program.after:
        emit_gradients(block, run_block(block, statics[block.kid], xp, ctx, device), param_grads, xp)
    ctx.row_keys = None
    for sgrad in sgrads.values():
        sgrad[n] = 0
    return pull_grads, param_grads
