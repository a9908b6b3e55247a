"""Runs F over the tasks of a schedule (forward) and ∂F over them in reverse (backward, Alg. 1).

Memory moves only at F's entrance and exit: gather takes the children's scattered rows (one ``take`` per
child slot and task), pull takes rows of an external buffer, scatter writes the task's contiguous rows of the
shared scatter tensor, push writes rows of an external buffer. Backward reads forward values from their
dynamic tensors at the same offsets and *adds* gradients: gather's adjoint scatter-adds into the children's
rows of the scatter-gradient tensor, so a DAG vertex with several parents receives all contributions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .autodiff import grad
from .executor import RunContext, eval_nodes
from .graph import Graph
from .memory import DynamicTensor, MemoryPlan
from .ops import input as input_node
from .ops.registry import OPS
from .sparse import RowSparse, add_all
from .vertex import VertexFunction


def _program(nodes):
    return [(n, OPS[n.op].impl, n.inputs, n.attrs, OPS[n.op].needs_ctx) for n in nodes]


class CompiledFunction:
    """F and ∂F of one vertex kind, split into what runs once per batch and what runs per task."""

    def __init__(self, F: VertexFunction):
        self.F = F
        g = F.graph
        self.gathers = dict(sorted(F.gathers.items()))
        self.pulls = dict(F.pulls)
        self.pushes = dict(F.pushes)
        self.scattered = F.scattered
        leaves = set(self.gathers.values()) | set(self.pulls.values())
        fwd = [n for n in g.nodes if n not in leaves]
        # Row-free nodes depend only on parameters and constants: evaluated once per batch.
        self.static_fwd = [n for n in fwd if not n.has_rows]
        self.row_fwd = _program([n for n in fwd if n.has_rows])
        self.fwd_nodes = set(g.nodes)

        # ∂F: cotangents of scatter and pushes in; gradients of gathers, pulls and parameters out.
        outs = list(F.outputs)
        self.ct = {o: input_node(o.shape, o.dtype, name=f"d{o.name}") for o in outs}
        wrt_leaves = list(self.gathers.values()) + [p for p in self.pulls.values() if p.dtype.is_float]
        params = [p for p in g.params if p.dtype.is_float]
        grads = grad(outs, wrt_leaves + params, [self.ct[o] for o in outs], zeros=False)
        self.leaf_grads = {leaf: gnode for leaf, gnode in zip(wrt_leaves, grads) if gnode is not None}
        self.param_grads = {p.name: gnode for p, gnode in zip(params, grads[len(wrt_leaves):])
                            if gnode is not None}
        bgraph = Graph(list(self.leaf_grads.values()) + list(self.param_grads.values()))
        cts = set(self.ct.values())
        bwd = [n for n in bgraph.nodes if n not in self.fwd_nodes and n not in cts]
        per_task = set()
        for n in bwd:  # per task: everything downstream of a per-vertex value
            if n.has_rows or any(x in per_task or x in cts or (x in self.fwd_nodes and x.has_rows)
                                 for x in n.inputs):
                per_task.add(n)
        for n in bwd:
            if n.has_rows and any(x in per_task and not x.has_rows for x in n.inputs):
                raise ValueError(f"vertex function '{F.name}': {n.label()} mixes vertices in ∂F")
        self.static_bwd = [n for n in bwd if n not in per_task]
        self.task_bwd = _program([n for n in bwd if n in per_task])
        # Every per-vertex symbol of F and ∂F gets a dynamic tensor.
        self.row_nodes = [n for n in g.nodes if n.has_rows and n not in self.pushes.values()
                          and n is not self.scattered] + [n for n in bwd if n in per_task and n.has_rows]

    @property
    def params(self):
        return self.F.graph.params


@dataclass
class RunState:
    """What a forward pass leaves for backward (and for ``explain``)."""

    plan: MemoryPlan
    scatter: np.ndarray | None                      # (N + 1, *message): last row stays zero
    tensors: list = field(default_factory=list)     # per kind id: {node: DynamicTensor}
    statics: list = field(default_factory=list)     # per kind id: {node: value}
    pushes: dict = field(default_factory=dict)      # push name -> buffer
    copies: dict = field(default_factory=dict)      # rows moved by gather / pull / push


def _value(x, local, static):
    v = local.get(x)
    return static[x] if v is None else v


def forward(fns: list, plan: MemoryPlan, pull_bufs: dict, params, ctx: RunContext, message,
            dtype, training: bool = True, pool: dict | None = None) -> RunState:
    """Evaluate F at every vertex, task by task. ``fns[kid]`` is the CompiledFunction of kind ``kid``."""
    n = plan.num_vertices
    pool = {} if pool is None else pool
    state = RunState(plan, None, copies={"gather": 0, "pull": 0, "push": 0})
    if message is not None:
        scatter = np.empty((n + 1,) + tuple(message), dtype.np)
        scatter[n] = 0
        state.scatter = scatter
    for name, order in plan.push_order.items():
        shape = next(f.pushes[name].vshape for f in fns if f is not None and name in f.pushes)
        state.pushes[name] = np.zeros((len(order),) + shape, dtype.np)
    for kid, fn in enumerate(fns):
        kp = plan.kinds[kid] if kid < len(plan.kinds) else None
        tensors, static = {}, {}
        if fn is not None and kp is not None:
            eval_nodes(fn.static_fwd, static, {}, params, ctx)
            if training:
                for node in fn.row_nodes:
                    key = (kid, node)
                    if key not in pool:
                        pool[key] = DynamicTensor(node.name or node.op, node.vshape, node.dtype.np)
                    tensors[node] = pool[key]
                    pool[key].resize(kp.n)
        state.tensors.append(tensors)
        state.statics.append(static)
    for kid, koff, bs, goff in plan.tasks:
        fn, kp, tensors, static = fns[kid], plan.kinds[kid], state.tensors[kid], state.statics[kid]
        sl = slice(koff, koff + bs)
        ctx.row_keys = kp.row_keys[sl]
        local = {}
        for j, gnode in fn.gathers.items():
            rows = kp.child_rows[j][sl]
            local[gnode] = np.take(state.scatter, rows, axis=0)
            state.copies["gather"] += bs
        for name, pnode in fn.pulls.items():
            local[pnode] = np.take(pull_bufs[name], kp.pull_rows[name][sl], axis=0)
            state.copies["pull"] += bs
        for node, impl, ins, attrs, needs_ctx in fn.row_fwd:
            args = [_value(x, local, static) for x in ins]
            out = impl(np, *args, ctx=ctx, **attrs) if needs_ctx else impl(np, *args, **attrs)
            local[node] = out
        if fn.scattered is not None:
            state.scatter[goff:goff + bs] = local[fn.scattered]
        for name, pnode in fn.pushes.items():
            state.pushes[name][kp.push_rows[name][sl]] = local[pnode]
            state.copies["push"] += bs
        if tensors:
            for node, t in tensors.items():
                if node in local:
                    t.buffer[sl] = local[node]
    ctx.row_keys = None
    return state


def backward(fns: list, state: RunState, push_grads: dict, pull_shapes: dict, params, ctx: RunContext,
             dtype) -> tuple[dict, dict]:
    """Replay the task stack in reverse. Returns (gradients of pull buffers, gradients of F's parameters)."""
    plan = state.plan
    n = plan.num_vertices
    sgrad = None if state.scatter is None else np.zeros_like(state.scatter)
    pull_grads = {name: np.zeros(shape, dtype.np) for name, shape in pull_shapes.items()}
    param_grads: dict = {}
    for kid, fn in enumerate(fns):
        if fn is not None and kid < len(plan.kinds) and plan.kinds[kid] is not None:
            eval_nodes(fn.static_bwd, state.statics[kid], {}, params, ctx)
    for kid, koff, bs, goff in reversed(plan.tasks):
        fn, kp, tensors, static = fns[kid], plan.kinds[kid], state.tensors[kid], state.statics[kid]
        sl = slice(koff, koff + bs)
        ctx.row_keys = kp.row_keys[sl]
        local = {node: t.buffer[sl] for node, t in tensors.items()}
        for out, ct in fn.ct.items():
            if out is fn.scattered:
                local[ct] = sgrad[goff:goff + bs]
            else:
                local[ct] = np.take(push_grads[out.name], kp.push_rows[out.name][sl], axis=0)
        for node, impl, ins, attrs, needs_ctx in fn.task_bwd:
            args = [_value(x, local, static) for x in ins]
            local[node] = impl(np, *args, ctx=ctx, **attrs) if needs_ctx else impl(np, *args, **attrs)
        for leaf, gnode in fn.leaf_grads.items():
            g = _value(gnode, local, static)
            if leaf.op == "gather":
                rows = kp.child_rows[leaf.attrs["k"]][sl]
                if plan.forest:
                    sgrad[rows] += g  # duplicate rows only at the discarded sentinel row n
                else:
                    np.add.at(sgrad, rows, g)
            else:
                pull_grads[leaf.name][kp.pull_rows[leaf.name][sl]] = g
        for name, gnode in fn.param_grads.items():
            g = _value(gnode, local, static)
            prev = param_grads.get(name)
            if prev is None:
                param_grads[name] = g.copy() if isinstance(g, np.ndarray) else g
            elif isinstance(prev, RowSparse) or isinstance(g, RowSparse):
                param_grads[name] = add_all(np, [prev, g])
            else:
                prev += g
    ctx.row_keys = None
    if sgrad is not None:
        sgrad[n] = 0
    return pull_grads, param_grads
