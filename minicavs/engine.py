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

from dataclasses import dataclass, field, replace

import numpy as np

from .autodiff import grad
from .device import CPU, Device
from .executor import RunContext, eval_nodes
from .graph import Graph, consumers as consumers_of
from .kernels import FUSED, lower, plan
from .memory import DynamicTensor, MemoryPlan
from .ops import input as input_node
from .ops.registry import OPS
from .passes.classify import EAGER, LAZY, classify
from .passes.fusion import fusible
from .sparse import RowSparse, add_all
from .vertex import VertexFunction

PRE, TASK, POST = 0, 1, 2


@dataclass(frozen=True)
class EngineOptions:
    """The optimisation switches; every combination computes the same numbers (DESIGN.md's "equal")."""

    lazy_batching: bool = True
    eager_batching: bool = True
    streaming: bool = False   # eager work on a second stream, task by task ahead of the recurrent path
    fusion: bool = True       # fused elementwise groups run as generated C kernels
    gather_elision: bool = True   # a gather whose child rows are an evenly strided block reads a view


@dataclass
class Phases:
    """Per phase (PRE, TASK, POST): the program and the values it reads that another phase computed."""

    programs: list
    reads: list
    phase: dict
    groups: list = field(default_factory=lambda: [[], [], []])   # per phase: fused groups that became kernels
    without_concat: list | None = None   # the task program when the gather concat is a view (gather elision)
    inplace: set = field(default_factory=set)   # nodes whose step can write into a given ``out``
    concats: list = field(default_factory=lambda: [[], [], []])   # per phase: (concat, [(member, a, b)])


def _phases(nodes, classes, leaves, opts: EngineOptions, eager_leaves=()) -> Phases:
    """Assign each node to PRE, TASK or POST by its class and the switches.

    A value with the vertex axis leading is stored in a dynamic tensor and can be read by any later phase;
    with fusion, an eager elementwise node that only feeds elementwise nodes joins its consumers' phase.
    A row-dependent value without it (a transposed block, a partial parameter gradient) is only meaningful
    inside the phase that computed it, so it is computed in every phase that consumes it."""
    def own(n):
        c = classes[n]
        return PRE if c == EAGER and opts.eager_batching else POST if c == LAZY and opts.lazy_batching \
            else TASK

    phase = {n: (PRE if (n in eager_leaves and opts.eager_batching) else TASK) for n in leaves}
    consumers = consumers_of(nodes)
    where: dict = {}
    for n in reversed(nodes):
        cs = consumers[n]
        if (opts.fusion and n.has_rows and classes[n] == EAGER and fusible(n) and cs
                and all(fusible(c) and c.has_rows for c in cs)):
            # Cheap elementwise work feeding only elementwise work: computed inside its consumers' kernel
            # (recomputing is free, a stored array read back is not), not in a pass of its own.
            where[n] = {min(min(where[c]) for c in cs)}
        elif n.has_rows or not cs:
            where[n] = {own(n)}
        else:
            where[n] = set().union(*(where[c] for c in consumers[n]))
    programs, reads = [[], [], []], [[], [], []]
    for n in nodes:
        phase[n] = min(where[n])
        for p in sorted(where[n]):
            programs[p].append((n, OPS[n.op].impl, n.inputs, n.attrs, OPS[n.op].needs_ctx))
            for x in n.inputs:
                if x in phase and p not in where.get(x, {phase[x]}) and x not in reads[p]:
                    if not x.has_rows:
                        raise AssertionError(f"{x.label()} crosses phases without a vertex axis")
                    reads[p].append(x)
    return Phases(programs, reads, phase)


class CompiledFunction:
    """F and ∂F of one vertex kind: classified, split into phases, everything static done once."""

    def __init__(self, F: VertexFunction, pull_grads=None):
        """``pull_grads``: names of the pulls whose gradient something needs (default: every float pull);
        a pull of plain data (Tree-FC's random inputs) then costs no gradient at all."""
        self.F = F
        g = F.graph
        self.gathers = dict(sorted(F.gathers.items()))
        self.pulls = dict(F.pulls)
        self.pushes = dict(F.pushes)
        self.scattered = F.scattered
        leaves = list(self.gathers.values()) + list(self.pulls.values())
        fwd = [n for n in g.nodes if n not in leaves]
        # Row-free nodes depend only on parameters and constants: evaluated once per batch.
        self.static_fwd = [n for n in fwd if not n.has_rows]
        self.row_fwd = [n for n in fwd if n.has_rows]
        self.fwd_nodes = set(g.nodes)
        self.fwd_class = classify(g.nodes, self.gathers.values(),
                                  [] if self.scattered is None else [self.scattered])

        # ∂F: cotangents of scatter and pushes in; gradients of gathers, pulls and parameters out.
        outs = list(F.outputs)
        self.ct = {o: input_node(o.shape, o.dtype, name=f"d{o.name}") for o in outs}
        wrt_leaves = list(self.gathers.values()) + [p for name, p in self.pulls.items() if p.dtype.is_float
                                                    and (pull_grads is None or name in pull_grads)]
        params = [p for p in g.params if p.dtype.is_float]
        grads = grad(outs, wrt_leaves + params, [self.ct[o] for o in outs], zeros=False)
        self.leaf_grads = {leaf: gn for leaf, gn in zip(wrt_leaves, grads) if gn is not None}
        self.param_grads = {p.name: gn for p, gn in zip(params, grads[len(wrt_leaves):]) if gn is not None}
        bgraph = Graph(list(self.leaf_grads.values()) + list(self.param_grads.values()))
        cts = set(self.ct.values())
        bwd = [n for n in bgraph.nodes if n not in self.fwd_nodes and n not in cts]
        per_task = set()
        for n in bwd:  # everything downstream of a per-vertex value runs over vertices
            if n.has_rows or any(x in per_task or x in cts or (x in self.fwd_nodes and x.has_rows)
                                 for x in n.inputs):
                per_task.add(n)
        for n in bwd:
            if n.has_rows and any(x in per_task and not x.has_rows for x in n.inputs):
                raise ValueError(f"vertex function '{F.name}': {n.label()} mixes vertices in ∂F")
        self.static_bwd = [n for n in bwd if n not in per_task]
        self.row_bwd = [n for n in bwd if n in per_task]
        ct_scatter = [self.ct[self.scattered]] if self.scattered is not None else []
        gather_grads = [self.leaf_grads[gn] for gn in self.gathers.values() if gn in self.leaf_grads]
        self.bwd_class = classify([c for c in self.ct.values()] + self.row_bwd, ct_scatter, gather_grads)
        # Every per-vertex symbol of F gets a dynamic tensor when training (backward reads them); symbols of
        # ∂F get one when a later phase reads them.
        # [gather(0); ...; gather(K-1)] of a complete tree's siblings side by side is a reshape of the
        # scatter tensor (when gather elision finds the children rows start + K*i + j).
        slots = list(self.gathers.values())
        self.gather_concat = next((n for n in self.row_fwd if n.op == "concat" and list(n.inputs) == slots
                                   and n.attrs["axis"] in (-1, n.ndim - 1) and len(slots) > 1
                                   and all(len(x.vshape) == 1 for x in slots)
                                   and len({x.vshape for x in slots}) == 1), None)   # one scatter tensor
        # The value the scatter tensor receives (``scatter`` is an identity op on it).
        sc = self.scattered
        self.scatter_source = sc.inputs[0] if sc is not None and sc.op == "scatter" else sc
        bwd_inputs = {x for n in self.row_bwd for x in n.inputs}
        # What ∂F reads of the scattered value (or of the parts of a scattered concat such as [h, c]) it
        # reads back from the scatter tensor, which holds it anyway: no second copy in a tensor of its own.
        parts = {}
        if sc is not None and len(self.scatter_source.shape) == 2:
            src = self.scatter_source
            parts[src] = (0, src.shape[1])
            parts.update((x, (a, b)) for x, a, b in _column_blocks(src) or ())
        self.scatter_parts = {n: ab for n, ab in parts.items() if n in bwd_inputs}
        # Pulled rows ∂F reads are read again from the pull buffer, which outlives the backward pass.
        self.pull_reads = {name: n for name, n in self.pulls.items() if n in bwd_inputs}
        self.fwd_tensors = [n for n in g.nodes if n.has_rows and n in bwd_inputs and n not in self.scatter_parts
                            and n not in self.pull_reads.values()]
        self._phases: dict = {}

    def _split(self, opts: EngineOptions) -> tuple[Phases, Phases]:
        """F's and ∂F's phases under ``opts``, before fused groups are lowered to a device's kernels."""
        if opts.streaming:  # the eager stream computes eager nodes, in chunks of one task
            opts = replace(opts, eager_batching=True)
        fwd = _phases(self.row_fwd, self.fwd_class, list(self.gathers.values()) + list(self.pulls.values()),
                      opts, eager_leaves=set(self.pulls.values()))
        push_cts = [c for o, c in self.ct.items() if o is not self.scattered]
        bwd = _phases(self.row_bwd, self.bwd_class, list(self.ct.values()), opts, eager_leaves=set(push_cts))
        return fwd, bwd

    def phases(self, opts: EngineOptions, device: Device = CPU) -> tuple[Phases, Phases]:
        """The phases ``device`` runs: with fusion, each fused group is one of the device's kernels."""
        key = (opts, device)
        if key not in self._phases:
            fwd, bwd = self._split(opts)
            if opts.fusion:
                self._lower(fwd, bwd, device)
            fwd.without_concat = [st for st in fwd.programs[TASK] if st[0] is not self.gather_concat]
            self._phases[key] = (fwd, bwd)
        return self._phases[key]

    def _keep(self, fwd: Phases, bwd: Phases) -> set:
        """Values read outside the phase program computing them: fused groups must write them."""
        crossing = {x for ph in (fwd, bwd) for r in ph.reads for x in r}
        return crossing | set(self.fwd_tensors) | set(self.pushes.values()) | set(self.leaf_grads.values()) \
            | set(self.param_grads.values()) | ({self.scattered} if self.scattered is not None else set())

    def fusion_groups(self, opts: EngineOptions = EngineOptions()) -> list:
        """Every fused group of F and ∂F under ``opts`` (target-neutral, whether or not a C compiler is
        here): what the C backend compiles and the CUDA backend renders."""
        fwd, bwd = self._split(replace(opts, fusion=True))
        keep = self._keep(fwd, bwd)
        return [g for prog in fwd.programs + bwd.programs for g in plan(prog, keep)]

    def _lower(self, fwd: Phases, bwd: Phases, device: Device) -> None:
        """Fuse each phase's elementwise nodes into kernels; values read outside a phase end a group."""
        programs, groups = lower(fwd.programs + bwd.programs, self._keep(fwd, bwd), device.fused)
        for i, ph in enumerate((fwd, bwd)):
            ph.programs, ph.groups = programs[3 * i:3 * i + 3], groups[3 * i:3 * i + 3]
            ph.inplace = {o for gs in ph.groups for g in gs for o in g.outputs}
            for p in (PRE, TASK, POST):
                ph.programs[p], ph.concats[p] = _elide_concats(ph.programs[p])

    @property
    def params(self):
        return self.F.graph.params

    def labels(self) -> tuple[dict, dict, list]:
        """Class labels of F's and ∂F's nodes ('static' = once per batch) and ∂F's outputs."""
        fl = {n: ("static" if not n.has_rows else c) for n, c in self.fwd_class.items()}
        bl = dict(self.bwd_class)
        bl.update({n: "static" for n in self.static_bwd})
        bl.update({n: "forward value" for n in self.fwd_nodes})
        return fl, bl, list(self.leaf_grads.values()) + list(self.param_grads.values())

    def dump(self, opts: EngineOptions | None = None) -> str:
        """F and ∂F, one line per node, with every node's class (eager / lazy / recurrent / static); then
        the steps each phase runs under ``opts`` (default: the default switches), fused groups shown as
        ``fused[ops] -> outputs``."""
        fl, bl, outs = self.labels()
        text = (f"F of '{self.F.name}':\n{self.F.graph.dump(fl)}\n"
                f"∂F of '{self.F.name}':\n{Graph(outs).dump(bl)}")
        lines = []
        for label, ph in zip(("F", "∂F"), self.phases(opts or EngineOptions())):
            for p, when in ((PRE, "before tasks"), (TASK, "per task"), (POST, "after tasks")):
                if ph.programs[p]:
                    lines.append(f"{label} {when}: {len(ph.programs[p])} steps")
                    lines += [f"  {_step_text(st)}" for st in ph.programs[p]]
        return text + "\nsteps:\n" + "\n".join(lines)

    def to_dot(self, backward: bool = False) -> str:
        """Graphviz source of F (or ∂F) with the classes in the node labels."""
        fl, bl, outs = self.labels()
        return Graph(outs).to_dot(bl) if backward else self.F.graph.to_dot(fl)


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

    @property
    def scatter(self):
        """The scatter tensor when every kind scatters one shape (the usual case), else None."""
        return next(iter(self.scatters.values())) if len(self.scatters) == 1 else None


def _run(xp, program, local, static, ctx, outs) -> None:
    """Run the steps in order; a step whose node is in ``outs`` writes its result there (no copy)."""
    for node, impl, ins, attrs, needs_ctx in program:
        args = [local[x] if x in local else static[x] for x in ins]
        if needs_ctx:
            local[node] = impl(xp, *args, ctx=ctx, **attrs)
        elif attrs is FUSED:  # node is the tuple of the group's outputs
            for o, y in zip(node, impl(args, [outs.get(o) for o in node])):
                local[o] = y
        else:
            local[node] = impl(xp, *args, **attrs)


def _as_slice(rows: np.ndarray):
    """``rows`` as a slice when they are consecutive (a kind whose tasks are adjacent), else unchanged."""
    if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and bool(np.all(np.diff(rows) == 1)):
        return slice(int(rows[0]), int(rows[0]) + len(rows))
    return rows


def _index(rows: np.ndarray):
    """Rows of a pull or push buffer as an index: a slice (no fancy indexing) when they are consecutive,
    as they are for a kind whose vertices are in global id order (the leaves of a batch, say)."""
    return _as_slice(rows) if len(rows) > 32 else rows


def _device_index(xp, rows: np.ndarray):
    """:func:`_index` for writing into an array of ``xp``: index arrays moved to its device."""
    ix = _index(rows)
    return ix if isinstance(ix, slice) or xp is np else xp.asarray(ix)


def _rows_of(device: Device, buf, rows: np.ndarray):
    """``buf[rows]``: a view when the rows are consecutive, else one row gather."""
    ix = _index(rows)
    return buf[ix] if isinstance(ix, slice) else device.take(buf, rows)


def _put(device: Device, dst, rows: np.ndarray, src) -> None:
    """``dst[rows] = src`` for distinct rows: a slice assignment when they are consecutive, else one row
    scatter."""
    ix = _index(rows)
    if isinstance(ix, slice):
        dst[ix] = src
    else:
        device.put(dst, rows, src)


def _step_text(step) -> str:
    node, impl, ins, attrs, _ = step
    if attrs is FUSED:
        names = ", ".join(o.name or f"%{o.id}" for o in node)
        return f"fused[{' '.join(n.op for n in impl.group.nodes)}] -> {names}"
    return f"{node.op} -> {node.name or f'%{node.id}'}"


def _computed(program) -> list:
    """Nodes a program computes (a fused step computes all its group's outputs)."""
    return [x for node, *_, attrs, _ in program for x in (node if attrs is FUSED else (node,))]


def _column_blocks(n) -> list | None:
    """For a concat of distinct per-vertex vectors along the last axis: [(part, first column, end)]."""
    if n.op != "concat" or n.ndim != 2 or n.attrs["axis"] not in (-1, 1) or len(set(n.inputs)) < len(n.inputs):
        return None
    bounds = np.cumsum([0] + [x.shape[1] for x in n.inputs]).tolist()
    return [(x, a, b) for x, a, b in zip(n.inputs, bounds[:-1], bounds[1:])]


def _elide_concats(program: list) -> tuple[list, list]:
    """Concats along the last axis whose parts are all outputs of fused steps of this program: the kernels
    write the parts straight into column blocks of the concat's buffer and the concat step disappears."""
    made = {o for st in program if st[3] is FUSED for o in st[0]}
    out, concats, taken = [], [], set()
    for st in program:
        n = st[0]
        blocks = _column_blocks(n) if st[3] is not FUSED else None
        if blocks and all(x in made and x not in taken for x in n.inputs):
            concats.append((n, blocks))
            taken.update(n.inputs)
            continue
        out.append(st)
    return out, concats


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


def _tensors(pool, kid, nodes, n, xp):
    out = {}
    for node in nodes:
        t = pool.get((kid, node))
        if t is None:
            t = pool[(kid, node)] = DynamicTensor(node.name or node.op, node.vshape, node.dtype.np, xp)
        t.resize(n)
        out[node] = t
    return out


def forward(fns: list, plan: MemoryPlan, pull_bufs: dict, params, ctx: RunContext, messages,
            dtype, training: bool = True, pool: dict | None = None,
            opts: EngineOptions = EngineOptions(), device: Device = CPU) -> RunState:
    """Evaluate F at every vertex: eager phase, task loop, lazy phase. ``fns[kid]`` compiles kind ``kid``.
    Arrays (parameters, pull buffers, the pool's tensors) are ``device``'s. ``messages``: the scattered
    shapes (one scatter tensor each, indexed by every vertex's row; a gather reads the tensor of its shape,
    and the structure has checked that its children's kinds scatter that shape)."""
    n = plan.num_vertices
    xp = device.xp
    pool = {} if pool is None else pool
    state = RunState(plan, opts, {}, copies={"gather": 0, "gathered": 0, "pull": 0, "push": 0},
                     pull_bufs=pull_bufs, device=device)
    if messages is not None and not isinstance(messages, list):
        messages = [tuple(messages)]    # one shape given as a shape
    for shape in messages or ():
        state.scatters[tuple(shape)] = xp.empty((n + 1,) + tuple(shape), dtype.np)
        state.scatters[tuple(shape)][n] = 0
    for name, order in plan.push_order.items():
        shape = next(f.pushes[name].vshape for f in fns if f is not None and name in f.pushes)
        state.pushes[name] = xp.zeros((len(order),) + shape, dtype.np)
    active = []
    for kid, fn in enumerate(fns):
        kp = plan.kinds[kid] if kid < len(plan.kinds) else None
        tensors, static = {}, {}
        if fn is not None and kp is not None:
            eval_nodes(fn.static_fwd, static, {}, params, ctx, xp=xp)
            ph, _ = fn.phases(opts, device)
            keep = list(dict.fromkeys((fn.fwd_tensors if training else []) + [x for r in ph.reads for x in r]))
            tensors = _tensors(pool, kid, keep, kp.n, xp)
            active.append(kid)
        state.tensors.append(tensors)
        state.statics.append(static)

    def chunk(kid, p, sl, grows, cctx, copies):
        """Fill phase ``p``'s leaves, run its program and write its outputs, for rows ``sl`` of the kind."""
        fn, kp, tensors = fns[kid], plan.kinds[kid], state.tensors[kid]
        ph, _ = fn.phases(opts, device)
        bs = sl.stop - sl.start
        cctx.row_keys = kp.row_keys[sl]
        local = {x: tensors[x].buffer[sl] for x in ph.reads[p]}
        program = ph.programs[p]
        views = [kp.views[j].get(sl.start) for j in fn.gathers] if p == TASK and opts.gather_elision else None
        for j, gnode in fn.gathers.items():
            if ph.phase[gnode] == p:
                sc = state.scatters[gnode.vshape]
                if views is None or views[j] is None:
                    local[gnode] = device.take(sc, kp.child_rows[j][sl])
                    copies["gather"] += bs
                else:
                    start, step = views[j]
                    local[gnode] = (sc[start:start + step * (bs - 1) + 1:step] if step else
                                    xp.broadcast_to(sc[start], (bs,) + sc.shape[1:]))
                copies["gathered"] += bs
        cat = fn.gather_concat
        if cat is not None and views is not None and ph.phase.get(cat) == p:
            k = len(views)
            if all(v is not None and v[1] == k and v[0] == views[0][0] + j for j, v in enumerate(views)):
                sc = state.scatters[cat.inputs[0].vshape]
                local[cat] = sc[views[0][0]:views[0][0] + k * bs].reshape(bs, -1)
                program = ph.without_concat
        for name, pnode in fn.pulls.items():
            if ph.phase[pnode] == p:
                local[pnode] = _rows_of(device, pull_bufs[name], kp.pull_rows[name][sl])
                copies["pull"] += bs
        inplace, copied, concats = stores[kid][p]
        outs = {node: t.buffer[sl] for node, t in inplace}
        own = state.scatters[fn.scattered.vshape] if fn.scattered is not None else None
        direct = concats and _concat_buffers(xp, concats, outs, local, bs, own[grows] if isinstance(
            grows, slice) and own is not None else None, fn.scatter_source)
        src = fn.scatter_source
        if (not direct and src in ph.inplace and src not in outs and isinstance(grows, slice)
                and ph.phase.get(src) == p):
            outs[src] = own[grows]   # the kernel computing the scattered value writes it in place
            direct = True
        _run(xp, program, local, state.statics[kid], cctx, outs)
        if fn.scattered is not None and ph.phase[fn.scattered] == p and not direct:
            own[grows] = local[fn.scattered]
        for name, pnode in fn.pushes.items():
            if ph.phase[pnode] == p:
                _put(device, state.pushes[name], kp.push_rows[name][sl], local[pnode])
                copies["push"] += bs
        for node, t in copied:
            t.buffer[sl] = local[node]

    stores = {}  # per kind and phase: the tensors that phase writes (looked up once, not per task)
    for kid in active:
        ph, _ = fns[kid].phases(opts, device)
        stores[kid] = [_stores(state.tensors[kid], ph, p, [x for x in state.tensors[kid] if ph.phase.get(x) == p])
                       for p in (PRE, TASK, POST)]
    whole = {kid: (slice(0, plan.kinds[kid].n), _as_slice(plan.schedule.row[plan.kinds[kid].vertices]))
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


def _scatter_grad(xp, fns: list, plan: MemoryPlan, scatter, shape: tuple):
    """The gradient of the scatter tensor of message ``shape``, before any parent has sent anything. In a
    forest every vertex that some parent gathers (with a gradient) receives exactly one write, so only the
    other rows (roots, children whose gather has no gradient) need zeros; a DAG's rows accumulate, so all
    start at zero."""
    if not plan.forest:
        return xp.zeros_like(scatter)
    sgrad = xp.empty_like(scatter)
    unwritten = np.ones(len(scatter), bool)
    for kid, fn in enumerate(fns):
        kp = plan.kinds[kid] if kid < len(plan.kinds) else None
        if fn is None or kp is None:
            continue
        for leaf in fn.leaf_grads:
            if leaf.op == "gather" and leaf.vshape == shape:
                unwritten[kp.child_rows[leaf.attrs["k"]]] = False
    sgrad[_device_index(xp, np.flatnonzero(unwritten))] = 0
    return sgrad


def backward(fns: list, state: RunState, push_grads: dict, pull_shapes: dict, params, ctx: RunContext,
             dtype) -> tuple[dict, dict]:
    """Replay the task stack in reverse. Returns (gradients of pull buffers, gradients of F's parameters)."""
    plan, opts, device = state.plan, state.opts, state.device
    xp = device.xp
    n = plan.num_vertices
    sgrads = {shape: _scatter_grad(xp, fns, plan, sc, shape) for shape, sc in state.scatters.items()}
    pull_grads = {name: xp.zeros(shape, dtype.np) for name, shape in pull_shapes.items()}
    param_grads: dict = {}
    pool: dict = {}
    btensors, bstores = {}, {}
    rows_k = device.rows(dtype.np)
    active = []
    for kid, fn in enumerate(fns):
        if fn is not None and kid < len(plan.kinds) and plan.kinds[kid] is not None:
            eval_nodes(fn.static_bwd, state.statics[kid], {}, params, ctx, xp=xp)
            _, bph = fn.phases(opts, device)  # only values that cross phases need rows kept
            btensors[kid] = _tensors(pool, kid, [x for r in bph.reads for x in r], plan.kinds[kid].n, xp)
            bstores[kid] = [_stores(btensors[kid], bph, p, _computed(bph.programs[p])) for p in (PRE, TASK, POST)]
            active.append(kid)

    whole_rows: dict = {}

    def kind_rows(kid):
        """All of a kind's rows of the scatter tensor, in kind order: a slice when its tasks are adjacent."""
        if kid not in whole_rows:
            own = state.scatters[fns[kid].scattered.vshape]
            whole_rows[kid] = _rows_of(device, own, plan.schedule.row[plan.kinds[kid].vertices])
        return whole_rows[kid]

    def compute(kid, p, sl, goff, cctx):
        """Run phase ``p`` of ∂F for rows ``sl``; returns the values (outputs are emitted by ``emit``)."""
        fn, kp, static = fns[kid], plan.kinds[kid], state.statics[kid]
        _, ph = fn.phases(opts, device)
        bs = sl.stop - sl.start
        cctx.row_keys = kp.row_keys[sl]
        local = {node: t.buffer[sl] for node, t in state.tensors[kid].items()}
        if fn.scatter_parts:
            rows = state.scatters[fn.scattered.vshape][goff:goff + bs] if goff is not None else kind_rows(kid)
            local.update((x, rows[:, a:b]) for x, (a, b) in fn.scatter_parts.items() if x not in local)
        for name, x in fn.pull_reads.items():
            if x not in local:
                local[x] = _rows_of(device, state.pull_bufs[name], kp.pull_rows[name][sl])
        local.update((x, btensors[kid][x].buffer[sl]) for x in ph.reads[p] if x in btensors[kid])
        for out, ct in fn.ct.items():
            if ph.phase[ct] != p:
                continue
            if out is fn.scattered:
                local[ct] = sgrads[out.vshape][goff:goff + bs]
            else:
                local[ct] = _rows_of(device, push_grads[out.name], kp.push_rows[out.name][sl])
            if ct in btensors[kid]:
                btensors[kid][ct].buffer[sl] = local[ct]
        inplace, copied, concats = bstores[kid][p]
        outs = {node: t.buffer[sl] for node, t in inplace}
        if concats:
            _concat_buffers(xp, concats, outs, local, bs)
        _run(xp, ph.programs[p], local, static, cctx, outs)
        for node, t in copied:
            t.buffer[sl] = local[node]
        return local

    def emit(kid, p, sl, local):
        """Add phase ``p``'s gradients for rows ``sl`` to children, pull buffers and parameters."""
        fn, kp, static = fns[kid], plan.kinds[kid], state.statics[kid]
        _, ph = fn.phases(opts, device)
        for leaf, gnode in fn.leaf_grads.items():
            if ph.phase[gnode] != p:
                continue
            g = local[gnode] if gnode in local else static[gnode]
            if leaf.op == "gather":
                j = leaf.attrs["k"]
                sgrad = sgrads[leaf.vshape]
                view = kp.views[j].get(sl.start) if p == TASK and opts.gather_elision else None
                rows = kp.child_rows[j][sl]
                if view is not None:  # distinct rows: a strided view, no fancy indexing
                    start, step = view
                    if step and plan.forest:  # (step 0: only the sentinel row, whose gradient is discarded)
                        sgrad[start:start + step * (len(rows) - 1) + 1:step] = g
                    elif step:
                        sgrad[start:start + step * (len(rows) - 1) + 1:step] += g
                elif plan.forest:   # each child has one parent: its gradient is written once, not added
                    device.put(sgrad, rows, g)
                else:  # one pass over the task's rows; repeated rows (DAGs) add up
                    rows_k.scatter_add(sgrad, rows, xp.broadcast_to(g, (len(rows),) + sgrad.shape[1:]))
            else:
                _put(device, pull_grads[leaf.name], kp.pull_rows[leaf.name][sl], g)
        for name, gnode in fn.param_grads.items():
            if ph.phase[gnode] != p:
                continue
            g = local[gnode]
            prev = param_grads.get(name)
            if prev is None:
                param_grads[name] = g if isinstance(g, RowSparse) else g.copy()
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
    for sgrad in sgrads.values():
        sgrad[n] = 0
    return pull_grads, param_grads
