"""Runs F over the tasks of a schedule (forward) and ∂F over them in reverse (backward, Alg. 1).

Memory moves only at F's entrance and exit: gather takes the children's scattered rows (one ``take`` per
child slot and task), pull takes rows of an external buffer, scatter writes the task's contiguous rows of the
shared scatter tensor, push writes rows of an external buffer. Backward reads forward values from their
dynamic tensors at the same offsets and *adds* gradients: gather's adjoint scatter-adds into the children's
rows of the scatter-gradient tensor, so a DAG vertex with several parents receives all contributions.

Each pass runs in three phases per vertex kind (§3.4, and DESIGN.md's schedule-first layout): with eager
batching, eager nodes run once over all vertices of the kind before the task loop; the task loop runs the
recurrent nodes (and, with a switch off, the eager or lazy ones too) task by task; with lazy batching, lazy
nodes (pushes, parameter and pull gradients) run once over all vertices after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .backend import Backend as Device
from .compile import POST, PRE, TASK, CompiledFunction, EngineOptions, Phases, _computed  # noqa: F401 (re-exported)
from .cpu import CPU
from .memory import MemoryPlan, Workspace
from .ops.message import as_slice, gather_adjoint, gather_rows, put_rows, row_index, take_rows
from .program import RunContext, evaluate, run_steps
from .sparse import RowSparse, add_all


@dataclass
class RunState:
    """What a forward pass leaves for backward (and for ``explain``)."""

    plan: MemoryPlan
    opts: EngineOptions
    scatter: np.ndarray | None                      # (N + 1, *message): last row stays zero
    tensors: list = field(default_factory=list)     # per kind id: {node: DynamicTensor}
    statics: list = field(default_factory=list)     # per kind id: {node: value}
    pushes: dict = field(default_factory=dict)      # push name -> buffer
    copies: dict = field(default_factory=dict)      # rows moved by gather / pull / push
    pull_bufs: dict = field(default_factory=dict)    # the pulled buffers, read again by backward
    device: Device = CPU
    workspace: Workspace | None = None              # the buffers (reused across batches) it ran in


def _device_index(xp, rows: np.ndarray):
    """:func:`row_index` for writing into an array of ``xp``: index arrays moved to its device."""
    ix = row_index(rows)
    return ix if isinstance(ix, slice) or xp is np else xp.asarray(ix)


def _stores(tensors: dict, ph: Phases, p: int, computed) -> tuple[list, list, list]:
    """The tensors phase ``p`` writes, split into (written in place by a step, copied after the
    program), and the phase's elided concats. A concat's parts are written into the concat's buffer, so
    a part stored in its own tensor is copied there; a concat stored in a tensor is its buffer."""
    concats = ph.concats[p]
    parts = {m for _, ms in concats for m, _, _ in ms}
    direct = (ph.inplace - parts) | {c for c, _ in concats}
    computed = list(computed) + [c for c, _ in concats if c not in computed]
    pairs = [(node, tensors[node]) for node in computed if node in tensors]
    return [x for x in pairs if x[0] in direct], [x for x in pairs if x[0] not in direct], concats


def _concat_buffers(xp, concats, outs: dict, local: dict, bs: int, scatter_rows=None, scattered=None) -> bool:
    """Give each elided concat its buffer (its tensor's rows, the scatter tensor's rows of this task, or a
    new array) and its parts their column blocks; True if the scatter tensor was written this way."""
    direct_scatter = False
    for c, parts in concats:
        dest = outs.get(c)
        if dest is None:
            if c is scattered and scatter_rows is not None:
                dest, direct_scatter = scatter_rows, True
            else:
                dest = xp.empty((bs, c.shape[1]), c.dtype.np)
        local[c] = dest
        for m, a, b in parts:
            outs[m] = dest[:, a:b]
    return direct_scatter


def forward(fns: list, plan: MemoryPlan, pull_bufs: dict, params, ctx: RunContext, message,
            dtype, training: bool = True, workspace: Workspace | None = None,
            opts: EngineOptions = EngineOptions(), device: Device = CPU) -> RunState:
    """Evaluate F at every vertex: eager phase, task loop, lazy phase. ``fns[kid]`` compiles kind ``kid``.
    Arrays (parameters, pull buffers, the workspace's buffers) are ``device``'s; the workspace (the model's,
    reused across batches; a fresh one by default) is kept in the state for backward."""
    n = plan.num_vertices
    xp = device.xp
    workspace = Workspace(xp) if workspace is None else workspace
    state = RunState(plan, opts, None, copies={"gather": 0, "gathered": 0, "pull": 0, "push": 0},
                     pull_bufs=pull_bufs, device=device, workspace=workspace)
    if message is not None:
        state.scatter = workspace.scatter_rows(n + 1, tuple(message), dtype.np)
        state.scatter[n] = 0
    for name, order in plan.push_order.items():
        shape = next(f.pushes[name].vshape for f in fns if f is not None and name in f.pushes)
        state.pushes[name] = xp.zeros((len(order),) + shape, dtype.np)
    active = []
    for kid, fn in enumerate(fns):
        kp = plan.kinds[kid] if kid < len(plan.kinds) else None
        tensors, static = {}, {}
        if fn is not None and kp is not None:
            evaluate(fn.static_fwd, static, {}, params, ctx, xp=xp)
            ph, _ = fn.phases(opts, device)
            keep = list(dict.fromkeys((fn.fwd_tensors if training else []) + [x for r in ph.reads for x in r]))
            tensors = workspace.tensors(workspace.forward, kid, keep, kp.n)
            active.append(kid)
        state.tensors.append(tensors)
        state.statics.append(static)

    def chunk(kid, p, sl, grows, cctx, copies):
        """Fill phase ``p``'s leaves, run its program and write its outputs, for rows ``sl`` of the kind."""
        fn, kp, tensors = fns[kid], plan.kinds[kid], state.tensors[kid]
        ph, _ = fn.phases(opts, device)
        bs = sl.stop - sl.start
        cctx.row_keys = kp.row_keys[sl]
        local = dict(state.statics[kid])   # the values computed once per batch, then this chunk's rows
        local.update((x, tensors[x].buffer[sl]) for x in ph.reads[p])
        program = ph.programs[p]
        views = [kp.views[j].get(sl.start) for j in fn.gathers] if p == TASK and opts.gather_elision else None
        for j, gnode in fn.gathers.items():
            if ph.phase[gnode] == p:
                view = None if views is None else views[j]
                local[gnode] = gather_rows(device, state.scatter, kp.child_rows[j][sl], view)
                if view is None:
                    copies["gather"] += bs
                copies["gathered"] += bs
        cat = fn.gather_concat
        if cat is not None and views is not None and ph.phase.get(cat) == p:
            k = len(views)
            if all(v is not None and v[1] == k and v[0] == views[0][0] + j for j, v in enumerate(views)):
                local[cat] = state.scatter[views[0][0]:views[0][0] + k * bs].reshape(bs, -1)
                program = ph.without_concat
        for name, pnode in fn.pulls.items():
            if ph.phase[pnode] == p:
                local[pnode] = take_rows(device, pull_bufs[name], kp.pull_rows[name][sl])
                copies["pull"] += bs
        inplace, copied, concats = stores[kid][p]
        outs = {node: t.buffer[sl] for node, t in inplace}
        direct = concats and _concat_buffers(xp, concats, outs, local, bs, state.scatter[grows] if isinstance(
            grows, slice) else None, fn.scatter_source)
        src = fn.scatter_source
        if (not direct and src in ph.inplace and src not in outs and isinstance(grows, slice)
                and ph.phase.get(src) == p):
            outs[src] = state.scatter[grows]   # the kernel computing the scattered value writes it in place
            direct = True
        run_steps(program, local, xp, cctx, outs)
        if fn.scattered is not None and ph.phase[fn.scattered] == p and not direct:
            state.scatter[grows] = local[fn.scattered]
        for name, pnode in fn.pushes.items():
            if ph.phase[pnode] == p:
                put_rows(device, state.pushes[name], kp.push_rows[name][sl], local[pnode])
                copies["push"] += bs
        for node, t in copied:
            t.buffer[sl] = local[node]

    stores = {}  # per kind and phase: the tensors that phase writes (looked up once, not per task)
    for kid in active:
        ph, _ = fns[kid].phases(opts, device)
        stores[kid] = [_stores(state.tensors[kid], ph, p, [x for x in state.tensors[kid] if ph.phase.get(x) == p])
                       for p in (PRE, TASK, POST)]
    whole = {kid: (slice(0, plan.kinds[kid].n), as_slice(plan.schedule.row[plan.kinds[kid].vertices]))
             for kid in active}
    events = None
    if opts.streaming:
        events, wcopies = device.eager(plan.tasks, lambda i, kid, koff, bs, goff, wctx, wc: chunk(
            kid, PRE, slice(koff, koff + bs), slice(goff, goff + bs), wctx, wc), ctx)
    else:
        for kid in active:
            chunk(kid, PRE, *whole[kid], ctx, state.copies)
    for t, (kid, koff, bs, goff) in enumerate(plan.tasks):
        if events is not None:
            events[t].wait()
        chunk(kid, TASK, slice(koff, koff + bs), slice(goff, goff + bs), ctx, state.copies)
    if events is not None:
        events[-1].wait()
        for k, v in wcopies.items():
            state.copies[k] += v
    for kid in active:
        chunk(kid, POST, *whole[kid], ctx, state.copies)
    ctx.row_keys = None
    return state


def _scatter_grad(xp, fns: list, plan: MemoryPlan, scatter, workspace: Workspace):
    """The gradient of the scatter tensor, before any parent has sent anything. In a forest every vertex
    that some parent gathers (with a gradient) receives exactly one write, so only the other rows (roots,
    children whose gather has no gradient) need zeros; a DAG's rows accumulate, so all start at zero."""
    sgrad = workspace.scatter_grad_rows(scatter)
    if not plan.forest:
        sgrad.fill(0)
        return sgrad
    unwritten = np.ones(len(scatter), bool)
    for kid, fn in enumerate(fns):
        kp = plan.kinds[kid] if kid < len(plan.kinds) else None
        if fn is None or kp is None:
            continue
        for leaf in fn.leaf_grads:
            if leaf in fn.gather_slot:
                unwritten[kp.child_rows[fn.gather_slot[leaf]]] = False
    sgrad[_device_index(xp, np.flatnonzero(unwritten))] = 0
    return sgrad


def backward(fns: list, state: RunState, push_grads: dict, pull_shapes: dict, params, ctx: RunContext,
             dtype) -> tuple[dict, dict]:
    """Replay the task stack in reverse. Returns (gradients of pull buffers, gradients of F's parameters)."""
    plan, opts, device = state.plan, state.opts, state.device
    xp = device.xp
    n = plan.num_vertices
    workspace = state.workspace
    sgrad = None if state.scatter is None else _scatter_grad(xp, fns, plan, state.scatter, workspace)
    pull_grads = {name: xp.zeros(shape, dtype.np) for name, shape in pull_shapes.items()}
    param_grads: dict = {}
    btensors, bstores = {}, {}
    rows_k = device.rows(dtype.np)
    active = []
    for kid, fn in enumerate(fns):
        if fn is not None and kid < len(plan.kinds) and plan.kinds[kid] is not None:
            evaluate(fn.static_bwd, state.statics[kid], {}, params, ctx, xp=xp)
            _, bph = fn.phases(opts, device)  # only values that cross phases need rows kept
            btensors[kid] = workspace.tensors(workspace.backward, kid, [x for r in bph.reads for x in r],
                                              plan.kinds[kid].n)
            bstores[kid] = [_stores(btensors[kid], bph, p, _computed(bph.programs[p])) for p in (PRE, TASK, POST)]
            active.append(kid)

    whole_rows: dict = {}

    def kind_rows(kid):
        """All of a kind's rows of the scatter tensor, in kind order: a slice when its tasks are adjacent."""
        if kid not in whole_rows:
            whole_rows[kid] = take_rows(device, state.scatter, plan.schedule.row[plan.kinds[kid].vertices])
        return whole_rows[kid]

    def compute(kid, p, sl, goff, cctx):
        """Run phase ``p`` of ∂F for rows ``sl``; returns the values (outputs are emitted by ``emit``)."""
        fn, kp, static = fns[kid], plan.kinds[kid], state.statics[kid]
        _, ph = fn.phases(opts, device)
        bs = sl.stop - sl.start
        cctx.row_keys = kp.row_keys[sl]
        local = dict(static)
        local.update((node, t.buffer[sl]) for node, t in state.tensors[kid].items())
        if fn.scatter_parts:
            rows = state.scatter[goff:goff + bs] if goff is not None else kind_rows(kid)
            local.update((x, rows[:, a:b]) for x, (a, b) in fn.scatter_parts.items() if x not in local)
        for name, x in fn.pull_reads.items():
            if x not in local:
                local[x] = take_rows(device, state.pull_bufs[name], kp.pull_rows[name][sl])
        local.update((x, btensors[kid][x].buffer[sl]) for x in ph.reads[p] if x in btensors[kid])
        for out, ct in fn.ct.items():
            if ph.phase[ct] != p:
                continue
            if out is fn.scattered:
                local[ct] = sgrad[goff:goff + bs]
            else:
                local[ct] = take_rows(device, push_grads[out.name], kp.push_rows[out.name][sl])
            if ct in btensors[kid]:
                btensors[kid][ct].buffer[sl] = local[ct]
        inplace, copied, concats = bstores[kid][p]
        outs = {node: t.buffer[sl] for node, t in inplace}
        if concats:
            _concat_buffers(xp, concats, outs, local, bs)
        run_steps(ph.programs[p], local, xp, cctx, outs)
        for node, t in copied:
            t.buffer[sl] = local[node]
        return local

    def emit(kid, p, sl, local):
        """Add phase ``p``'s gradients for rows ``sl`` to children, pull buffers and parameters."""
        fn, kp = fns[kid], plan.kinds[kid]
        _, ph = fn.phases(opts, device)
        for leaf, gnode in fn.leaf_grads.items():
            if ph.phase[gnode] != p:
                continue
            g = local[gnode]
            j = fn.gather_slot.get(leaf)
            if j is not None:
                view = kp.views[j].get(sl.start) if p == TASK and opts.gather_elision else None
                gather_adjoint(device, sgrad, kp.child_rows[j][sl], view, g, plan.forest, rows_k)
            else:
                put_rows(device, pull_grads[leaf.name], kp.pull_rows[leaf.name][sl], g)
        for name, gnode in fn.param_grads.items():
            if ph.phase[gnode] != p:
                continue
            g = local[gnode]
            prev = param_grads.get(name)
            if prev is None:
                param_grads[name] = g.copy()   # (a RowSparse's rows may be a view of the workspace)
            elif isinstance(prev, RowSparse) or isinstance(g, RowSparse):
                param_grads[name] = add_all(xp, [prev, g])
            else:
                prev += g

    def run_phase(kid, p, sl, goff=None):
        emit(kid, p, sl, compute(kid, p, sl, goff, ctx))

    order = list(reversed(plan.tasks))
    events = None
    if opts.streaming:
        pre_locals = [None] * len(order)

        def produce(i, kid, koff, bs, goff, wctx, wcopies):
            pre_locals[i] = compute(kid, PRE, slice(koff, koff + bs), goff, wctx)
        events, _ = device.eager(order, produce, ctx)
    else:
        for kid in active:
            run_phase(kid, PRE, slice(0, plan.kinds[kid].n))
    for i, (kid, koff, bs, goff) in enumerate(order):
        if events is not None:
            events[i].wait()
            emit(kid, PRE, slice(koff, koff + bs), pre_locals[i])
            if device is CPU:   # a CUDA pool could hand the memory to the eager stream while still read
                pre_locals[i] = None
        run_phase(kid, TASK, slice(koff, koff + bs), goff)
    for kid in active:
        run_phase(kid, POST, slice(0, plan.kinds[kid].n))
    ctx.row_keys = None
    if sgrad is not None:
        sgrad[n] = 0
    return pull_grads, param_grads
