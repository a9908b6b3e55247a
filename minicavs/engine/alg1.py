"""Alg. 1: F over the tasks of a schedule (forward) and ∂F over the task stack popped (backward).

Each pass is one lowered program (instructions.py: per kind its template of F or ∂F, linked once and kept in
the workspace) bound to the batch (program.py: a task table of the blocks before the task loop (eager nodes
over all vertices of a kind, §3.4), one row per task, the blocks after it (lazy nodes: pushes, parameter and
pull gradients), and the batch's buffers), and run by the device's runner in one call: the C runner on the
CPU, the CUDA runner on a GPU, the reference runner (reference.py: one Python function per opcode) when
asked for or where the device's runner declines the program. Memory moves only at F's entrance and exit:
gather takes the children's scattered rows, pull takes rows of an external buffer, scatter writes the task's
contiguous rows of the scatter tensor of its kind's message shape, push writes rows of an external buffer.
Backward reads forward values from their dynamic tensors at the same offsets and *adds* gradients: gather's
adjoint adds into the children's rows of the scatter-gradient tensor, so a DAG vertex with several parents
receives all contributions. Every buffer comes from the model's workspace (memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.sparse import densify
from ..ops.message import row_index
from ..runtime.memory import MemoryPlan, Workspace
from . import instructions, program as binding, reference
from .backend import Backend as Device, default_device
from .compile import TASK, EngineOptions
from .program import BatchProgram, Buffers, RunContext, evaluate


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
    device: Device | None = None
    workspace: Workspace | None = None              # the buffers (reused across batches) it ran in
    program: BatchProgram | None = None             # F bound to the batch (what ran)
    backward_program: BatchProgram | None = None    # ∂F bound to the batch, once backward has run
    active: list = field(default_factory=list)      # the kind ids with vertices in this batch

    @property
    def scatter(self):
        """The scatter tensor when every kind scatters one shape (the usual case), else None."""
        return next(iter(self.scatters.values())) if len(self.scatters) == 1 else None


def _run(program: BatchProgram, state: RunState) -> dict:
    """Run a bound program on the state's device: its own runner (Backend.run, the one call the seam has), or the
    reference runner on the same device when asked for (``runner: reference``) or when the device's runner
    declines the program (said in dump()). Returns the parameter-gradient accumulators it added into (the eager
    stream's added in)."""
    device = state.device
    why = None if state.opts.runner == "reference" else device.runner_declines(program)
    if state.opts.runner != "reference" and why is None:
        program.runner = device.runner_name
        device.run(program)
    else:
        program.runner, program.declined = "reference runner", why
        reference.run(program, device)
    gradients = program.gradients
    for name, accumulator in program.bound.eager_gradients.items():
        gradients[name] += accumulator
    return gradients


def _link(compiled: list, state: RunState, backward: bool, training: bool = True):
    return instructions.link(compiled, state.active, state.opts, state.device, backward, training,
                             state.workspace.programs)


def forward(compiled: list, plan: MemoryPlan, pull_bufs: dict, params, ctx: RunContext, messages,
            dtype, training: bool = True, workspace: Workspace | None = None,
            opts: EngineOptions = EngineOptions(), device: Device | None = None, head=None) -> RunState:
    """Evaluate F at every vertex: eager phase, task loop, lazy phase. ``compiled[kind_id]`` compiles kind ``kind_id``.
    Arrays (parameters, pull buffers, the workspace's buffers) are ``device``'s; the workspace (the model's,
    reused across batches; a fresh one by default) is kept in the state for backward. ``messages``: the
    scattered shapes (the structure's ``message_shapes``), one scatter tensor each. ``head``: a static graph on
    top of the pushes (linked_head.LinkedHead), linked into the program after its blocks: the same call runs it."""
    device = default_device() if device is None else device
    n, xp = plan.num_vertices, device.xp
    workspace = Workspace(xp) if workspace is None else workspace
    state = RunState(plan, opts, {}, pull_bufs=pull_bufs, device=device, workspace=workspace)
    for shape in map(tuple, messages):   # one scatter tensor per message shape; row n: the absent child's zeros
        state.scatters[shape] = workspace.scatter_rows(n + 1, shape, dtype.np)
        state.scatters[shape][n] = 0
    for name, order in plan.push_order.items():
        shape = next(f.pushes[name].vshape for f in compiled if f is not None and name in f.pushes)
        state.pushes[name] = xp.zeros((len(order),) + shape, dtype.np)
    for kind_id, fn in enumerate(compiled):   # F's static part (parameters' products, say), the kind's dynamic tensors
        tensors, static = {}, {}
        if fn is not None and kind_id < len(plan.kinds) and plan.kinds[kind_id] is not None:
            evaluate(fn.static_fwd, static, {}, params, ctx, xp=xp)
            stored = fn.placement(opts, device, training).forward_stored
            tensors = workspace.tensors(workspace.forward, kind_id, stored, plan.kinds[kind_id].n)
            state.active.append(kind_id)
        state.tensors.append(tensors)
        state.statics.append(static)
    # Alg. 1, forward: the eager blocks, then per task V_t: gather the children's rows, evaluate F, scatter and
    # push the results; then the lazy blocks: one call of the device's runner
    buffers = Buffers(plan, state, dtype.np, ctx, compiled=compiled)
    lowered, tail = _link(compiled, state, False, training), None
    if head is not None:
        lowered, buffers, tail = head.link(lowered, buffers, state)
    state.program = binding.bind(lowered, compiled, plan, opts, buffers, backward=False, device=device,
                                 workspace=workspace, tail=tail)
    state.copies = state.program.copies
    _run(state.program, state)
    if head is not None:
        head.finish(state.program)
    return state


def backward(compiled: list, state: RunState, push_grads: dict, pull_shapes: dict, params, ctx: RunContext,
             dtype) -> tuple[dict, dict]:
    """Replay the task stack in reverse. Returns (gradients of pull buffers, gradients of F's parameters)."""
    plan, opts, device, workspace = state.plan, state.opts, state.device, state.workspace
    xp = device.xp
    sgrads = {message: _scatter_grad(xp, compiled, plan, message, scatter, workspace)
              for message, scatter in state.scatters.items()}
    pull_grads = {name: xp.zeros(shape, dtype.np) for name, shape in pull_shapes.items()}
    btensors = {}
    for kind_id in state.active:   # ∂F's static part and the tensors of values that cross its phases
        fn = compiled[kind_id]
        evaluate(fn.static_bwd, state.statics[kind_id], {}, params, ctx, xp=xp)
        stored = fn.placement(opts, device).backward_stored
        btensors[kind_id] = workspace.tensors(workspace.backward, kind_id, stored, plan.kinds[kind_id].n)
    push_grads = _dense_where_tasks_read(compiled, state.active, opts, device, push_grads)
    # Alg. 1, backward: the eager blocks, then the task stack popped: per task V_t run ∂F at the same rows and
    # add the gradients into the children's rows; then the lazy blocks (parameter and pull gradients)
    buffers = Buffers(plan, state, dtype.np, ctx, btensors, sgrads, push_grads, pull_grads, compiled)
    program = state.backward_program = binding.bind(_link(compiled, state, True), compiled, plan, opts, buffers,
                                                    backward=True, device=device,
                                                    forward_tasks=state.program.task_table, workspace=workspace)
    param_grads = _run(program, state)
    for sgrad in sgrads.values():
        sgrad[plan.num_vertices] = 0
    return pull_grads, param_grads


def _device_index(xp, rows: np.ndarray):
    """:func:`row_index` for writing into an array of ``xp``: index arrays moved to its device."""
    ix = row_index(rows)
    return ix if isinstance(ix, slice) or xp is np else xp.asarray(ix)


def _scatter_grad(xp, compiled: list, plan: MemoryPlan, message: tuple, scatter, workspace: Workspace):
    """The gradient of the scatter tensor of ``message``, before any parent has sent anything. In a forest
    every vertex that some parent gathers (with a gradient) receives exactly one write, so only the other
    rows (roots, children whose gather of this message has no gradient) need zeros; a DAG's rows
    accumulate, so all start at zero."""
    sgrad = workspace.scatter_grad_rows(scatter)
    if not plan.forest:
        sgrad.fill(0)
        return sgrad
    unwritten = np.ones(len(scatter), bool)
    for kind_id, fn in enumerate(compiled):
        kind_plan = plan.kinds[kind_id] if kind_id < len(plan.kinds) else None
        if fn is None or kind_plan is None:
            continue
        for leaf in fn.leaf_grads:
            slot = fn.gather_slot.get(leaf)
            if slot is not None and fn.gather_messages[slot] == message:
                unwritten[kind_plan.child_rows[slot]] = False
    sgrad[_device_index(xp, np.flatnonzero(unwritten))] = 0
    return sgrad


def _dense_where_tasks_read(compiled: list, active: list, opts, device, push_grads: dict) -> dict:
    """Push gradients as the task loop needs them: dense where some kind's steps read its rows (it
    takes them task by task); elsewhere a row-sparse gradient (Tree-FC's: the roots' rows only) stays
    sparse, and the phase before or after the loop reads its few rows where they are (program.Buffers: the
    rows it lacks read as zeros)."""
    out = dict(push_grads)
    for kind_id in active:
        fn = compiled[kind_id]
        backward_phases = fn.phases(opts, device).backward
        for o, ct in fn.ct.items():
            if o is not fn.scattered and (backward_phases.phase[ct] == TASK or device.xp is not np):
                out[o.name] = densify(device.xp, out[o.name])
    return out
