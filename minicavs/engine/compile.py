"""Compile once, in the open: F and ∂F of a vertex kind become phases of steps (:class:`Step`, defined here)
per (engine options, backend), built when the model is built; instructions.py lowers them to the templates
the runners run.

Classification (passes/classify.py) splits each into phases (§3.4: eager nodes before the task loop, recurrent
nodes per task, lazy nodes after it); fusion (passes/fusion.py) groups each phase's elementwise nodes, and
each group becomes one generated kernel of the backend (C on the CPU, CUDA on CuPy) that reads strided views
and can write straight into a dynamic tensor's rows. Concats whose parts all come from fused kernels
disappear: the kernels write the parts into column blocks of the concat's buffer.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Sequence

from ..ir.graph import Graph, Node, consumers
from ..ops.autodiff import grad
from ..ops.flow import flow
from ..ops import input as input_node
from ..ops.registry import OPS, last_axis_block
from ..ops.sources import trainable
from ..ops.subgraph import item_index
from ..runtime.vertex import VertexFunction
from .backend import Backend, default_device
from .passes import alias, gemm
from .passes.classify import EAGER, LAZY, classify
from .passes.fusion import FusedGroup, broadcast_kind, fuse, fusible

class Step:
    """One step: ``outputs = run(inputs)``.

    ``fused`` steps run a generated kernel as ``run(arrays, outs)`` (one entry of ``outs`` per output: an
    array to write into, or None) and compute every output of their group; the other steps run a registry
    op's impl as ``run(xp, *arrays, **attrs)`` (plus ``ctx=`` when ``needs_ctx``). ``frees``: values no later
    step reads (a static graph drops them to save memory)."""

    __slots__ = ("run", "inputs", "outputs", "attrs", "needs_ctx", "fused", "frees", "outline")

    def __init__(self, run: Callable, inputs: Sequence[Node], outputs: Sequence[Node], attrs: dict | None = None,
                 needs_ctx: bool = False, fused: bool = False, frees: tuple = ()):
        self.run = run
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.attrs = attrs or {}
        self.needs_ctx = needs_ctx
        self.fused = fused
        self.frees = frees
        self.outline = None   # what a record of a run reads of its outputs (program.record), found once

    @classmethod
    def of(cls, node: Node, frees: tuple = ()) -> "Step":
        """The step computing ``node`` with its op's impl."""
        opdef = OPS[node.op]
        return cls(opdef.impl, node.inputs, (node,), node.attrs, opdef.needs_ctx, frees=frees)

    @property
    def node(self) -> Node:
        """The one node an unfused step computes."""
        return self.outputs[0]

    def text(self, names: Callable[[Node], str] | None = None) -> str:
        """``out = op in...`` (fused: ``fused[ops] ...``), jaxpr-like."""
        name = names or _default_name
        outs = ", ".join(name(o) for o in self.outputs)
        if self.fused:
            what = f"fused[{' '.join(n.op for n in self.run.group.nodes)}]"
        else:
            op = self.outputs[0].op
            what = op + (" (bias added by its kernel)" if self.run is OPS[op].without_bias else "")
        args = " ".join(name(x) for x in self.inputs)
        return f"{outs} = {what}" + (f" {args}" if args else "")

    def __repr__(self) -> str:
        return f"<Step {self.text()}>"


def _default_name(n: Node) -> str:
    return n.name or f"%{n.id}"


PRE, TASK, POST = 0, 1, 2


class StaticNodes(tuple):
    """A static graph's nodes in topological order, as program.evaluate takes them: it finds what it reads of
    each node (fed or not, its step, a concat or not) once and keeps it here, instead of at every run. A tuple:
    what was found from its nodes cannot go stale."""


@dataclass(frozen=True)
class EngineOptions:
    """The optimisation switches; every combination computes the same numbers (DESIGN.md's "equal")."""

    lazy_batching: bool = True
    eager_batching: bool = True
    streaming: bool = False   # eager work on a second stream, task by task ahead of the recurrent path
    fusion: bool = True       # fused elementwise groups run as generated C kernels
    gather_elision: bool = True   # a gather whose child rows are evenly strided reads a view
    merge_gemms: bool = True      # products of F sharing a left operand run as one GEMM (passes/gemm.py)
    plan_layout: bool = True      # merged weights and biases as views of planned parameter buffers
    # (passes/layout.py): no weight copy per batch; the parameters become strided views of one buffer each,
    # laid out by Model.plan_buffers (the Trainer's construction), never by a run
    runner: str = "device"    # who runs a pass: the device's runner (the C runner on the CPU, the CUDA runner);
    # "reference": the same program run by reference.py (one Python function per opcode: slow, the definition)
    check: bool = False       # the runners' debug mode: every address and row number bounds-checked (slower)
    tf32: bool = False        # CUDA float32 products with TF32 inputs (10-bit mantissas; not "equal" numbers)

    def __post_init__(self):
        if self.runner not in RUNNERS:
            raise ValueError(f"runner {self.runner!r}: expected one of {', '.join(RUNNERS)}")

    def compile_key(self) -> "EngineOptions":
        """The options that decide what is compiled (the runner, the check and TF32 only decide how it runs):
        the key of every cache of compiled passes, templates and task tables. Kept on the instance: every
        lookup of compiled phases asks for it, and ``replace`` costs microseconds."""
        found = self.__dict__.get("_compiled")
        if found is None:   # one instance per distinct value: the caches keyed by it then hit by identity
            found = self if self.runner == "device" and not self.check and not self.tf32 else \
                replace(self, runner="device", check=False, tf32=False)
            found = _COMPILED.setdefault(found._fields(), found)
            object.__setattr__(self, "_compiled", found)   # (a cache, not a field: eq and hash ignore it)
        return found

    def __getstate__(self) -> dict:   # the fields only: the caches (a str's hash) are this process's
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def _fields(self) -> tuple:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)

    def __hash__(self) -> int:   # computed once: options key every compiled-phase cache
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash(self._fields())
            object.__setattr__(self, "_hash", found)
        return found


RUNNERS = ("device", "reference")
_COMPILED: dict = {}   # field values -> the one EngineOptions instance ``compile_key`` returns for them


@dataclass
class Phases:
    """Per phase (PRE, TASK, POST): the kind's steps and the values they read that another phase computed."""

    programs: list
    reads: list
    phase: dict
    groups: list = field(default_factory=lambda: [[], [], []])   # per phase: fused groups that became kernels
    inplace: set = field(default_factory=set)   # nodes whose step can write into a given ``out``
    concats: list = field(default_factory=lambda: [[], [], []])   # per phase: (concat, [(member, a, b)])


class Passes(NamedTuple):
    """A vertex function's phases: F's and ∂F's."""

    forward: Phases
    backward: Phases


class PhasePlaces(NamedTuple):
    """Where the values one phase computes into dynamic tensors go (passes/alias.py)."""

    inplace: list     # written in place by the phase's steps (a fused kernel's output, an elided concat)
    copied: list      # copied into their tensors after the steps
    concats: list     # the elided concats: (concat, [(member, first column, end)])


class Placement(NamedTuple):
    """Where F's and ∂F's values live (:meth:`CompiledFunction.placement`)."""

    forward_stored: list    # F's values kept in dynamic tensors (∂F reads them, or another phase of F)
    forward: list           # per phase of F: its PhasePlaces
    backward_stored: list   # ∂F's values kept in dynamic tensors (read by another phase of ∂F)
    backward: list          # per phase of ∂F: its PhasePlaces


def _phases(nodes, classes, leaves, opts: EngineOptions, eager_leaves=()) -> Phases:
    """Assign each node to PRE, TASK or POST by its class and the switches.

    A value with the vertex axis leading is stored in a dynamic tensor and can be read by any later phase;
    with fusion, an eager elementwise node that only feeds elementwise nodes joins its consumers' phase.
    A row-dependent value without it (a transposed column block, a partial parameter gradient) is only meaningful
    inside the phase that computed it, so it is computed in every phase that consumes it."""
    def own(n):
        c = classes[n]
        return PRE if c == EAGER and opts.eager_batching else POST if c == LAZY and opts.lazy_batching \
            else TASK

    phase = {n: (PRE if (n in eager_leaves and opts.eager_batching) else TASK) for n in leaves}
    users = consumers(nodes)
    where: dict = {}
    for n in reversed(nodes):
        cs = users[n]
        if (opts.fusion and n.has_rows and classes[n] == EAGER and fusible(n) and cs
                and all(fusible(c) and c.has_rows for c in cs)):
            # Cheap elementwise work feeding only elementwise work: computed inside its consumers' kernel
            # (recomputing is free, a stored array read back is not), not in a pass of its own.
            where[n] = {min(min(where[c]) for c in cs)}
        elif cs and _product_block(n, users) and all(c.has_rows for c in cs):
            # A column block of a product read only through such blocks (a merged GEMM's, passes/gemm.py):
            # a view, taken again in each phase that reads it, so that the product is the one value stored
            # across phases, as a cell's fused product is, not each column block copied into a tensor of its own.
            where[n] = set().union(*(where[c] for c in cs))
        elif cs and _step_block(n):
            # One step's block of a per-row value stacked over steps (a loop's, ops/loop_grad.py): a view,
            # taken again in each phase that reads it, so that the stacked value is what crosses phases.
            where[n] = set().union(*(where[c] for c in cs))
        elif n.has_rows or not cs:
            where[n] = {own(n)}
        else:
            where[n] = set().union(*(where[c] for c in users[n]))
    for n in nodes:   # an item of a per-row tuple (a loop's result) is computed with it; what crosses is the item
        if item_index(n) is not None and n.inputs[0].has_rows and n.inputs[0] in where:
            where[n] = where[n.inputs[0]]
    programs, reads = [[], [], []], [[], [], []]
    for n in nodes:
        phase[n] = min(where[n])
        for p in sorted(where[n]):
            programs[p].append(Step.of(n))
            for x in n.inputs:
                if x in phase and p not in where.get(x, {phase[x]}) and x not in reads[p]:
                    if not x.has_rows:
                        raise AssertionError(f"{x.label()} crosses phases without a vertex axis")
                    reads[p].append(x)
    return Phases(programs, reads, phase)


def _keeps_sides(n: Node) -> bool:
    """Does ``n`` keep what its gradient reads (a cond's side results, a loop's saved values: ops/cond_grad.py,
    loop_grad.py), its branches or loop writing its items in place?"""
    f = flow(n)
    return f is not None and f.kept


def _step_block(n: Node) -> bool:
    """Is ``n`` a per-row view of one step of a stacked per-row value: a slice along its axis 1 (of three
    axes or more), or a per-row reshape of one?"""
    opdef = OPS[n.op]
    if not n.has_rows or not n.inputs or not n.inputs[0].has_rows or opdef.native is None:
        return False
    how = opdef.native(n)
    if how == "alias":
        return _step_block(n.inputs[0])
    return how == "cols" and n.attrs.get("axis") == 1 and n.ndim == n.inputs[0].ndim >= 3


def _product_block(n: Node, users: dict) -> bool:
    """Is ``n`` a per-row column block (a view) of a product whose every reader takes such a block?"""
    if last_axis_block(n) is None or not n.has_rows or OPS[n.op].native(n) != "cols":
        return False
    source = n.inputs[0]
    return OPS[source.op].product is not None and source.has_rows and all(
        last_axis_block(u) is not None for u in users[source])


class CompiledFunction:
    """F and ∂F of one vertex kind: classified, split into phases, everything static done once."""

    def __init__(self, F: VertexFunction, pull_grads=None, merges: Sequence[gemm.Merge] = ()):
        """``pull_grads``: names of the pulls whose gradient something needs (default: every float pull);
        a pull of plain data (Tree-FC's random inputs) then costs no gradient at all. ``merges``: the GEMM
        merges that made ``F`` (see :meth:`variant`)."""
        self.F = F
        self.pull_grads = pull_grads
        self.merges = list(merges)
        # plan_layout -> the merged variant; a merged function is its own variant
        self._merged: dict = {True: self, False: self} if merges else {}
        self.layout = None   # the planned parameter buffers to follow (a model's: Model sets it), else F's own
        g = F.graph
        self.gathers = dict(sorted(F.gathers.items()))
        self.gather_slot = {node: k for k, node in self.gathers.items()}
        self.pulls = dict(F.pulls)
        self.pushes = dict(F.pushes)
        self.scattered = F.scattered
        self._forward(g)
        self._differentiate(F, pull_grads)
        g = self.graph
        # Where each value lives (passes/alias.py): the scatter tensor, the pull buffers, or a dynamic tensor.
        bwd_inputs = {x for n in self.row_bwd for x in n.inputs}
        self.scatter_message = alias.scatter_message(self.scattered)   # the scatter tensor it writes
        self.gather_messages = alias.gather_messages(self.gathers)       # the scatter tensor each gather reads
        self.gather_concat = alias.gather_concat(self.row_fwd, list(self.gathers.values()))
        self.scatter_source = alias.scatter_source(self.scattered)
        self.scatter_parts = alias.scatter_parts(self.scattered, bwd_inputs)
        self.scatter_columns = alias.scatter_parts(self.scattered, set(g.nodes))   # every part, whoever reads it
        self.pull_reads = alias.pull_reads(self.pulls, bwd_inputs)
        self.fwd_tensors = alias.forward_tensors(g.nodes, bwd_inputs, self.scatter_parts, self.pull_reads)
        self._phases: dict = {}
        self._derived: dict = {}

    def _forward(self, g: Graph) -> None:
        """F's nodes (``g``'s), classified: the static ones (once per batch) and those over vertices."""
        self.graph = g
        leaves = list(self.gathers.values()) + list(self.pulls.values())
        fwd = [n for n in g.nodes if n not in leaves]
        # Row-free nodes depend only on parameters and constants: evaluated once per batch.
        self.static_fwd = StaticNodes(n for n in fwd if not n.has_rows)
        self.row_fwd = [n for n in fwd if n.has_rows]
        self.fwd_nodes = set(g.nodes)
        self.fwd_class = classify(g.nodes, self.gathers.values(),
                                  [] if self.scattered is None else [self.scattered])

    def _differentiate(self, F: VertexFunction, pull_grads) -> None:
        """∂F: cotangents of scatter and pushes in; gradients of gathers, pulls and parameters out; its nodes
        split into the static ones (once per batch) and those that run over vertices, each classified."""
        outs = list(F.outputs)
        self.ct = {o: input_node(o.shape, o.dtype, name=f"d{o.name}") for o in outs}
        wrt_leaves = list(self.gathers.values()) + [p for name, p in self.pulls.items() if p.dtype.is_float
                                                    and (pull_grads is None or name in pull_grads)]
        params = [p for p in F.graph.params if trainable(p)]   # a frozen parameter gets no gradient
        grads = grad(outs, wrt_leaves + params, [self.ct[o] for o in outs], zeros=False)
        self.leaf_grads = {leaf: gn for leaf, gn in zip(wrt_leaves, grads) if gn is not None}
        self.param_grads = {p.name: gn for p, gn in zip(params, grads[len(wrt_leaves):]) if gn is not None}
        bgraph = Graph(list(self.leaf_grads.values()) + list(self.param_grads.values()))
        saved = [n for n in bgraph.nodes if item_index(n) is not None and n.inputs[0] in self.fwd_nodes]
        if saved:   # what a loop of F saved for ∂F (ops/loop_grad.py): F's values, stored per vertex
            self._forward(Graph(list(F.graph.outputs) + saved))
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
        self.static_bwd = StaticNodes(n for n in bwd if n not in per_task)
        self.row_bwd = [n for n in bwd if n in per_task]
        ct_scatter = [self.ct[self.scattered]] if self.scattered is not None else []
        gather_grads = [self.leaf_grads[gn] for gn in self.gathers.values() if gn in self.leaf_grads]
        self.bwd_class = classify([c for c in self.ct.values()] + self.row_bwd, ct_scatter, gather_grads)

    def derived(self, key: tuple, make):
        """What a later stage derives from this function once (a template, its single kernels, the copy
        counters' factors), made by ``make()`` the first time ``key`` is asked for and kept with the function."""
        found = self._derived.get(key)
        if found is None:
            found = self._derived[key] = make()
        return found

    def variant(self, opts: EngineOptions) -> "CompiledFunction":
        """The compiled function that runs under ``opts``: with ``merge_gemms``, the one of F with its
        products merged (passes/gemm.py; F's graph is rewritten before autodiff, so ∂F has its own merged
        GEMMs), compiled on first use; itself when nothing merges. With ``plan_layout`` too, the merged
        weights are views of planned parameter buffers (passes/layout.py) where an order serves them."""
        if not opts.merge_gemms:
            return self
        found = self._merged.get(opts.plan_layout)
        if found is None:
            merged_F, merges = gemm.merge_products(self.F, plan_layout=opts.plan_layout,
                                                   planned=self.layout)
            found = self._merged[opts.plan_layout] = CompiledFunction(merged_F, self.pull_grads, merges) \
                if merges else self
        return found

    def _split(self, opts: EngineOptions) -> Passes:
        """F's and ∂F's phases under ``opts``, before fused groups are lowered to a device's kernels."""
        if opts.streaming:  # the eager stream computes eager nodes, in chunks of one task
            opts = replace(opts, eager_batching=True)
        fwd = _phases(self.row_fwd, self.fwd_class, list(self.gathers.values()) + list(self.pulls.values()),
                      opts, eager_leaves=set(self.pulls.values()))
        push_cts = [c for o, c in self.ct.items() if o is not self.scattered]
        bwd = _phases(self.row_bwd, self.bwd_class, list(self.ct.values()), opts, eager_leaves=set(push_cts))
        return Passes(fwd, bwd)

    def phases(self, opts: EngineOptions, device: Backend | None = None) -> Passes:
        """The phases ``device`` runs (default: the CPU): with fusion, each fused group is one of the
        device's kernels. Compiled once per (options, device)."""
        device = default_device() if device is None else device
        opts = opts.compile_key()
        key = (opts, device)
        if key not in self._phases:
            fwd, bwd = self._split(opts)
            if opts.fusion:
                self._lower(fwd, bwd, device)
            self._phases[key] = Passes(fwd, bwd)
        return self._phases[key]

    def placement(self, opts: EngineOptions, device: Backend | None = None, training: bool = True) -> Placement:
        """Where F's and ∂F's values live under ``opts`` (passes/alias.py), decided once. ``training``: F keeps
        what ∂F reads, else only values crossing phases."""
        device = default_device() if device is None else device
        opts = opts.compile_key()
        key = ("placement", opts, device, training)
        if key not in self._phases:
            fwd, bwd = self.phases(opts, device)
            lazy = self.lazy_scatter_reads(opts, device)
            regathered = self.lazy_gather_reads(opts, device)
            f_stored = list(dict.fromkeys(([x for x in self.fwd_tensors if x not in regathered] if training else [])
                                          + [x for r in fwd.reads for x in r if x not in lazy]))
            b_stored = [x for r in bwd.reads for x in r if x not in lazy]
            b_stored += [x for x in _block_temporaries(bwd) if x not in b_stored]
            f_places = [PhasePlaces(*alias.stores(set(f_stored), fwd.inplace, fwd.concats[p],
                                                  [x for x in f_stored if fwd.phase.get(x) == p]), fwd.concats[p])
                        for p in (PRE, TASK, POST)]
            b_places = [PhasePlaces(*alias.stores(set(b_stored), bwd.inplace, bwd.concats[p],
                                                  _computed(bwd.programs[p])), bwd.concats[p])
                        for p in (PRE, TASK, POST)]
            self._phases[key] = Placement(f_stored, f_places, b_stored, b_places)
        return self._phases[key]

    def lazy_scatter_reads(self, opts: EngineOptions, device: Backend | None = None) -> dict:
        """{value: (first column, end)}: values that only the lazy phase (after the task loop) reads from
        another phase and that the scatter tensor already holds when it runs: F's scattered value and its
        column blocks (scattered in an earlier phase), ∂F's cotangent of the scattered value (its rows of the
        scatter gradient are complete once the vertex's own task ran). The lazy phase reads them from those
        rows at the kind's rows (passes/alias.py), so no dynamic tensor keeps a copy."""
        fwd, bwd = self.phases(opts, device)
        out = {}
        if self.scattered is not None and fwd.phase.get(self.scattered, PRE) < POST:
            out.update((x, cols) for x, cols in self.scatter_columns.items()
                       if x not in fwd.reads[PRE] and x not in fwd.reads[TASK] and x not in self.fwd_tensors)
            ct = self.ct[self.scattered]
            if bwd.phase.get(ct) == TASK and ct not in bwd.reads[PRE]:
                out[ct] = (0, ct.shape[-1])
        return out

    def lazy_gather_reads(self, opts: EngineOptions, device: Backend | None = None) -> set:
        """The concat of the gathers (``[h_left; h_right]``) when only ∂F's lazy phase reads it (Tree-FC's
        dW = Σ [h_l; h_r]ᵀ·dy): that phase gathers it again from the scatter tensor, which still holds the
        children's rows (a view when the children are side by side, else one row gather), instead of every
        task copying it into a dynamic tensor."""
        cat = self.gather_concat
        if cat is None or cat not in self.fwd_tensors:
            return set()
        fwd, bwd = self.phases(opts, device)
        if fwd.phase.get(cat) != TASK:
            return set()
        early = {x for p in (PRE, TASK) for step in bwd.programs[p] for x in step.inputs}
        return set() if cat in early else {cat}

    def _keep(self, fwd: Phases, bwd: Phases) -> set:
        """Values read outside the phase program computing them: fused groups must write them."""
        crossing = {x for phases in (fwd, bwd) for reads in phases.reads for x in reads}
        return crossing | set(self.fwd_tensors) | set(self.pushes.values()) | set(self.leaf_grads.values()) \
            | set(self.param_grads.values()) | ({self.scattered} if self.scattered is not None else set())

    def fusion_groups(self, opts: EngineOptions = EngineOptions()) -> list:
        """Every fused group of F and ∂F under ``opts`` (target-neutral, whether or not a C compiler is
        here): what the C backend compiles and the CUDA backend renders."""
        fwd, bwd = self._split(replace(opts, fusion=True))
        keep = self._keep(fwd, bwd)
        return [g for prog in fwd.programs + bwd.programs for g in group_kernels(prog, keep)]

    def _lower(self, fwd: Phases, bwd: Phases, device: Backend) -> None:
        """Fuse each phase's elementwise nodes into kernels; values read outside a phase end a group."""
        programs, groups = lower(fwd.programs + bwd.programs, self._keep(fwd, bwd), device.fused)
        for i, phases in enumerate((fwd, bwd)):
            phases.programs, phases.groups = programs[3 * i:3 * i + 3], groups[3 * i:3 * i + 3]
            phases.inplace = {o for gs in phases.groups for g in gs for o in g.outputs}
            phases.inplace |= {o for prog in phases.programs for st in prog for o in st.outputs
                               if item_index(o) is not None and _keeps_sides(o.inputs[0])}
            for phase in (PRE, TASK, POST):
                phases.programs[phase], phases.concats[phase] = alias.elide_concats(phases.programs[phase])

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
        ``fused[ops] -> outputs``. With ``merge_gemms`` in ``opts``, the merged function's (its merges
        listed first)."""
        if opts is not None and self.variant(opts) is not self:
            return self.variant(opts).dump(opts)
        fl, bl, outs = self.labels()
        merged = "".join(f"\n  {m.text()}" for m in self.merges)
        text = (f"F of '{self.F.name}'" + (f" (GEMMs merged:{merged})" if merged else "")
                + f":\n{self.F.graph.dump(fl)}\n∂F of '{self.F.name}':\n{Graph(outs).dump(bl)}")
        lines = []
        for label, phases in zip(("F", "∂F"), self.phases(opts or EngineOptions())):
            for phase, when in ((PRE, "before tasks"), (TASK, "per task"), (POST, "after tasks")):
                if phases.programs[phase]:
                    lines.append(f"{label} {when}: {len(phases.programs[phase])} steps")
                    lines += [f"  {_step_text(st)}" for st in phases.programs[phase]]
        return text + "\nsteps:\n" + "\n".join(lines)

    def to_dot(self, backward: bool = False) -> str:
        """Graphviz source of F (or ∂F) with the classes in the node labels."""
        fl, bl, outs = self.labels()
        return Graph(outs).to_dot(bl) if backward else self.F.graph.to_dot(fl)


def _step_text(step: Step) -> str:
    names = ", ".join(o.name or f"%{o.id}" for o in step.outputs)
    if step.fused:
        return f"fused[{' '.join(n.op for n in step.run.group.nodes)}] -> {names}"
    return f"{step.outputs[0].op} -> {names}"


def _block_temporaries(phases: Phases) -> list:
    """Per-vertex values the phases before and after the task loop compute with fused kernels (and their
    elided concats): kept in dynamic tensors of the workspace, reused batch after batch, rather than in
    arrays allocated per batch: a block's values are all of a kind's rows, often hundreds of MB, and a fresh
    array of that size costs its page faults every batch."""
    out = []
    for p in (PRE, POST):
        parts = {m for _, ms in phases.concats[p] for m, _, _ in ms}
        out += [o for st in phases.programs[p] if st.fused for o in st.outputs if o.has_rows and o not in parts]
        out += [c for c, _ in phases.concats[p]]
    return list(dict.fromkeys(out))


def _computed(program) -> list:
    """Nodes a program computes (a fused step computes all its group's outputs)."""
    return [x for step in program for x in step.outputs]


class FusedStep:
    """The impl of a fused step: ``step(arrays, outs)`` with one entry of ``outs`` per output (an array to
    write into, or None) returns the list of outputs."""

    __slots__ = ("kernel", "group")

    def __init__(self, kernel, group: FusedGroup):
        self.kernel = kernel
        self.group = group

    def __call__(self, arrays, outs: list) -> list:
        ys = self.kernel(arrays, outs)
        return ys if isinstance(ys, list) else [ys]

    def __repr__(self) -> str:
        return f"<fused {' '.join(n.op for n in self.group.nodes)}>"


def group_kernels(program: list, keep: set) -> list[FusedGroup]:
    """The groups of a program (unfused steps) worth a kernel. Target-neutral: the C path compiles them
    here, the CUDA path renders the same groups (codegen/cuda.py).

    An op with a bias input (``OpDef.bias_input``: linear) feeding only one group hands its bias add to the
    group (``FusedGroup.biased``): the linear step then only multiplies, and ``tanh(x·W + b)`` is one matmul and one kernel. A group is worth a
    kernel if it has more than one node or absorbs a bias."""
    nodes = [step.outputs[0] for step in program]
    member = set(nodes)
    users = consumers(nodes)
    out = []
    for g in fuse(nodes, [n for n in nodes if n in keep]):
        inside = set(g.nodes)
        for x in list(g.inputs):
            bias = OPS[x.op].bias_input
            if (bias is not None and x in member and x not in keep and x.shape == g.output.shape
                    and users[x] and all(u in inside for u in users[x])):
                b = x.inputs[bias]
                g.biased[x] = b
                if b not in g.inputs:
                    g.inputs.append(b)
                    g.broadcast.append(broadcast_kind(b, g.output))
        if len(g.nodes) > 1 or g.biased:
            out.append(g)
    return out


def lower(programs: Sequence[list], keep: set, build: Callable) -> tuple[list[list], list[list]]:
    """Replace the multi-node fusible groups of every program by fused steps (``Step(FusedStep, inputs,
    outputs, fused=True)``); ``keep`` are nodes read outside their program (group outputs). ``build`` makes
    the kernels of a list of groups (None where a group stays unfused): a backend's ``fused``, one run for all
    programs. Returns the new programs and, per program, the groups that
    became kernels."""
    grouped = [group_kernels(prog, keep) for prog in programs]
    flat = [g for gs in grouped for g in gs]
    kernels = build(flat) if flat else []
    kernel_of = {id(g): k for g, k in zip(flat, kernels)}
    out_programs, out_groups = [], []
    for prog, groups in zip(programs, grouped):
        live = [g for g in groups if kernel_of[id(g)] is not None]
        absorbed = {n: g for g in live for n in g.nodes}
        unbiased = {x for g in live for x in g.biased}
        steps, seen = [], set()
        for st in prog:
            node = st.outputs[0]
            g = absorbed.get(node)
            if node in unbiased:   # its group adds the bias
                rest = [x for i, x in enumerate(node.inputs) if i != OPS[node.op].bias_input]
                steps.append(Step(OPS[node.op].without_bias, rest, (node,)))
            elif g is None:
                steps.append(st)
            elif id(g) not in seen:
                seen.add(id(g))
                steps.append(Step(FusedStep(kernel_of[id(g)], g), g.inputs, g.outputs, fused=True))
        out_programs.append(_toposort(steps))
        out_groups.append(live)
    return out_programs, out_groups


def _toposort(steps: list) -> list:
    """Order steps so each runs after the steps computing its inputs, staying close to the given order
    (a fused group must run after all its members' inputs and before any reader of its outputs)."""
    producer = {}
    for i, st in enumerate(steps):
        for n in st.outputs:
            producer[n] = i
    deps = [{producer[x] for x in st.inputs if x in producer and producer[x] != i} for i, st in enumerate(steps)]
    users: list = [[] for _ in steps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    waiting = [len(d) for d in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(steps[i])
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, u)
    assert len(order) == len(steps), "fused groups formed a cycle"
    return order
