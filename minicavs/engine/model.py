"""A model = dynamic structures (vertex functions over input graphs) + static graphs joined by push/pull.

    enc = Structure({"leaf": F_leaf, "internal": F_int}, pulls={"x": ops.lookup(E.node, words)}, kinds=leaf_internal)
    h = enc.pushed("h")                                   # (None, H): one row per pushing vertex
    loss = ops.sum(ops.softmax_cross_entropy(ops.linear(h, Wo, bo), labels)) / n_trees
    model = Model(enc, loss=loss)
    result = model.forward_backward(graphs, feeds={words: ..., labels: ..., n_trees: ...}, params=params)

Pull and push buffers have one row per vertex of the kinds that pull / push the name, in global vertex order
(sample by sample, local vertex id within a sample): :func:`minicavs.runtime.inputs.make_batch` numbering.
Structures run in the order given; a structure's pulls may depend on feeds and on earlier structures' pushes
(e.g. the root push of a tree encoder feeding the pull of a chain decoder, §3.1).
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import numpy as np

from ..core.arrays import is_planned, on_device
from ..core.errors import FeedError, InputGraphError, ShapeError
from ..core.sparse import add_all
from ..core.validate import indices
from ..ir.graph import Graph, Node, fmt_shape
from ..ops.autodiff import grad
from ..ops import input as input_node
from ..ops import ones_like
from ..ops.registry import OPS
from ..ops.sources import trainable
from ..runtime.inputs import Batch, InputGraph, make_batch
from ..runtime.memory import Workspace, plan_memory
from ..runtime.scheduler import AgendaPolicy, CavsPolicy, FsmPolicy, GreedyPolicy, depends_on_batch_only, get_policy
from ..runtime.vertex import VertexFunction
from . import linked_head, planner
from .alg1 import backward, forward
from .backend import Backend as Device, get_device  # noqa: F401 (model.get_device: the public name)
from .compile import CompiledFunction, EngineOptions, StaticNodes
from .passes import alias, gemm, layout
from .program import RunContext
from .static_program import StaticGraphs

_PUSHED: weakref.WeakSet = weakref.WeakSet()   # every structure's push-buffer nodes
PLAN_CACHE_SIZE = 4   # plans a model keeps for batches that come again (see Model._plan) ...
PLAN_CACHE_VERTICES = 1 << 19   # ... and their vertices at most (about 100 bytes each), but the last one


def by_child_count(leaf: str, internal: str) -> Callable[[Batch], tuple]:
    """A kind rule for :class:`Structure`: a vertex without children gets vertex function ``leaf``, any
    other ``internal``. Returns ``rule(batch) -> (kind id per vertex, kind names)``."""
    def rule(batch: Batch) -> tuple[np.ndarray, tuple[str, ...]]:
        return (batch.num_children() > 0).astype(np.int64), (leaf, internal)
    rule.__name__ = rule.__qualname__ = f"by_child_count({leaf!r}, {internal!r})"
    rule.leaf_internal = (leaf, internal)   # what the native planner reads (planner.py) instead of calling it
    return rule


leaf_internal = by_child_count("leaf", "internal")   # the usual rule of tree models

# Policies that schedule as cavs does whenever the kinds are one function's or the leaf/internal rule's
# (scheduler._one_kind), so the native planner's cavs schedule is theirs too.
_CAVS_WHEN_ONE_KIND = (CavsPolicy, AgendaPolicy, GreedyPolicy, FsmPolicy)


def _at_pull_row(e: FeedError, s: "Structure", batch: Batch) -> FeedError:
    """``e`` naming the sample and vertex when its bad entry is a row of one of ``s``'s pull buffers (an
    out-of-range word id in ``lookup(E, words)``): the user's feed is in vertex order, a position is not."""
    row = getattr(e, "row", None)
    names = [name for name, src in s.pulls.items() if src is getattr(e, "node", None)]
    if row is None or not names:
        return e
    users = [kind_id for kind_id, kind in enumerate(batch.kind_names)
             if kind in s.functions and names[0] in s.functions[kind].pulls]
    pullers = np.flatnonzero(np.isin(batch.kind, users))
    if row >= len(pullers):
        return e
    named = FeedError(f"{e}: row {row} of pull buffer '{names[0]}' of structure '{s.name}', pulled by "
                      f"{batch.where(int(pullers[row]))}")
    named.row, named.node = row, e.node
    return named


class Structure:
    """Vertex functions by kind, evaluated over one input graph per sample."""

    def __init__(self, functions: VertexFunction | Mapping[str, VertexFunction],
                 pulls: Mapping[str, Node] | None = None,
                 kinds: Callable[[Batch], tuple] | None = None, name: str = "G"):
        """``functions``: vertex functions by kind name. Which one runs a vertex (its kind) never depends
        on these names: it is the kind given with the vertex's graph (``InputGraph(kinds=...)``), else the
        structure's rule ``kinds(batch) -> (kind id per vertex, kind names)`` (e.g. :func:`leaf_internal`),
        else the only function; see :meth:`batch`."""
        if isinstance(functions, VertexFunction):
            functions = {functions.name: functions}
        self.name = name
        self.functions = dict(functions)
        if not self.functions:
            raise ShapeError(f"structure '{name}': no vertex function")
        if kinds is not None and not callable(kinds):
            raise ShapeError(f"structure '{name}': kinds must be a rule, kinds(batch) -> (kind ids, kind names), "
                             f"e.g. minicavs.leaf_internal; got {kinds!r}")
        self.kinds = kinds
        fs = list(self.functions.values())
        self.dtype = fs[0].dtype
        # the message each kind scatters (one scatter tensor per distinct shape)
        self.messages = {k: f.scattered.vshape for k, f in self.functions.items() if f.scattered is not None}
        self._check_gathers()
        self.message_shapes = alias.message_tensors(f.scattered for f in fs)   # one scatter tensor each
        for f in fs:
            if f.dtype != self.dtype:
                raise ShapeError(f"structure '{name}': '{f.name}' is {f.dtype.name}, others {self.dtype.name}")
            if f.gathers and not any(g.scattered is not None for g in fs):
                raise ShapeError(f"structure '{name}': '{f.name}' gathers but no vertex function scatters")
        self.pulls = dict(pulls or {})
        self.pull_shapes = self._pull_shapes(fs)
        self._pushed: dict[str, Node] = {}
        # A pull needs a gradient only if its source depends on a parameter or on another structure's
        # pushes; a pull of plain data does not.
        self.pull_grads = {name for name, src in self.pulls.items() if src.dtype.is_float and any(
            trainable(n) or n in _PUSHED for n in Graph([src]).nodes)}   # (a frozen table needs none)
        self.compiled = {k: CompiledFunction(f, self.pull_grads) for k, f in self.functions.items()}
        self._spec = False   # the native planner's view of the structure, made on first use
        # Whether a run reads the plan's row keys (dropout's: sample id << 32 | vertex id): only an op that
        # takes the run context does; without one, a batch's plan does not depend on its sample ids.
        self.reads_row_keys = any(OPS[n.op].needs_ctx for f in fs for n in f.graph.nodes)

    def _check_gathers(self) -> None:
        """Each kind scatters its own message; each gather reads the kinds it names (default: all that
        scatter), which must all scatter the gather's shape."""
        for k, f in self.functions.items():
            for j, g in sorted(f.gathers.items()):
                named = f.gather_kinds.get(j)
                for kind in named or ():
                    if kind not in self.functions:
                        raise ShapeError(f"structure '{self.name}': gather({j}) of '{k}' names kind '{kind}', "
                                         f"which has no vertex function (kinds: {', '.join(self.functions)})")
                    if kind not in self.messages:
                        raise ShapeError(f"structure '{self.name}': gather({j}) of '{k}' reads kind '{kind}', "
                                         "which scatters nothing")
                readers = {kind: self.messages[kind] for kind in (named or self.messages)}
                wrong = {kind: shape for kind, shape in readers.items() if shape != g.vshape}
                if wrong:
                    hint = "" if named else f"; name the kinds it reads: gather({j}, kinds=...)"
                    raise ShapeError(f"structure '{self.name}': gather({j}) of '{k}' reads {fmt_shape(g.vshape)} "
                                     "but " + ", ".join(f"'{kind}' scatters {fmt_shape(shape)}"
                                                 for kind, shape in wrong.items()) + hint)

    def _pull_shapes(self, fs: list) -> dict[str, tuple]:
        """Each pull's shape per vertex, checked against the static node that produces it."""
        shapes: dict[str, tuple] = {}
        for f in fs:
            for pname, pnode in f.pulls.items():
                src = self.pulls.get(pname)
                if src is None:
                    raise ShapeError(f"structure '{self.name}': '{f.name}' pulls '{pname}' but no static node "
                                     f"produces it (pass pulls={{'{pname}': node}})")
                if not src.has_rows or src.vshape != pnode.vshape or src.dtype != pnode.dtype:
                    raise ShapeError(f"structure '{self.name}': pull '{pname}' of '{f.name}' is "
                                     f"{pnode.dtype.name}{fmt_shape(pnode.vshape)} per vertex but its source "
                                     f"{src.label()} is {src.dtype.name}{fmt_shape(src.shape)}")
                shapes[pname] = pnode.vshape
        return shapes

    def pushed(self, name: str = "h") -> Node:
        """The static-graph node standing for push buffer ``name``: one row per pushing vertex."""
        if name not in self._pushed:
            shapes = {f.pushes[name].vshape for f in self.functions.values() if name in f.pushes}
            if not shapes:
                raise ShapeError(f"structure '{self.name}': no vertex function pushes '{name}'")
            if len(shapes) > 1:
                raise ShapeError(f"structure '{self.name}': push '{name}' has several shapes {sorted(shapes)}")
            self._pushed[name] = input_node((None,) + shapes.pop(), self.dtype, name=f"{self.name}.{name}")
            _PUSHED.add(self._pushed[name])
        return self._pushed[name]

    @property
    def pushes(self) -> Mapping[str, Node]:
        """The push buffers :meth:`pushed` has made so far, {name: node}: a read-only view that, unlike
        ``pushed``, never makes one (an exporter asks what the model's graphs read, and changes nothing)."""
        return MappingProxyType(self._pushed)

    def batch(self, graphs: Sequence[InputGraph]) -> Batch:
        """Flatten, assign kinds, validate (arity per kind) in one step; raises before anything runs.

        A vertex's kind (the vertex function that runs it) is, in this order: the kind given with its
        graph (``InputGraph(kinds=...)``, every vertex of that graph), the structure's kind rule, the only
        vertex function. A kind without a vertex function of that name, or a structure with several
        functions and neither, is an error naming the sample, the vertex, the kind and the functions."""
        names = tuple(self.functions)
        batch = make_batch(graphs)
        n = batch.num_vertices
        kind, source, given = self._graph_kinds(batch)
        rest = None if given is None else ~given
        how = None   # how the vertices without graph kinds got theirs: 1 rule, 2 only function
        if rest is None or rest.any():
            mapped, how = self._rule_kinds(batch, rest)
            if rest is None:
                kind = mapped
            else:
                kind[rest] = mapped[rest]
                source[rest] = how
        # (kind ids are in [0, len(names)): from the names' lookup, or checked by ``indices`` and mapped)
        batch = Batch(batch.graphs, n, batch.offsets, batch.sample, batch.local, batch.child_ptr, batch.child_idx,
                      batch.height, kind, names, batch._parents)
        nch = batch.child_ptr[1:] - batch.child_ptr[:-1]
        self._check_arity(batch, nch, how, source)
        self._check_gathered_kinds(batch, nch)
        return batch

    def _functions_named(self) -> str:
        return f"vertex functions {list(self.functions)}"

    def _graph_kinds(self, batch: Batch) -> tuple:
        """(kind id per vertex, how each got it, whether its graph gave it): the kinds given with the graphs
        (-1 elsewhere); three Nones in the usual case, no graph giving kinds."""
        if all(g.kinds is None for g in batch.graphs):
            return None, None, None
        n = batch.num_vertices
        lookup = {k: i for i, k in enumerate(self.functions)}
        kind = np.full(n, -1, np.int64)
        source = np.zeros(n, np.int8)   # how each vertex got its kind: 0 graph, 1 rule, 2 only function
        given = np.zeros(n, bool)
        for sid, g in enumerate(batch.graphs):
            if g.kinds is None:
                continue
            ids = [lookup.get(k, -1) for k in g.kinds]
            if -1 in ids:
                v = ids.index(-1)
                raise InputGraphError(f"sample {sid}, vertex {v}: kind {g.kinds[v]!r} (given with the graph) "
                                      f"has no vertex function in structure '{self.name}' ({self._functions_named()})")
            lo = int(batch.offsets[sid])
            kind[lo:lo + g.num_vertices] = ids
            given[lo:lo + g.num_vertices] = True
        return kind, source, given

    def _rule_kinds(self, batch: Batch, rest) -> tuple:
        """(kind id per vertex, 1) by the structure's kind rule, or (zeros, 2) for its only function, for the
        vertices ``rest`` (None: all) whose graphs gave no kinds."""
        n = batch.num_vertices
        functions = self._functions_named()
        if self.kinds is not None:
            rule = getattr(self.kinds, "__name__", repr(self.kinds))
            rule_kind, rule_names = self.kinds(batch)
            rule_kind = indices(rule_kind, f"structure '{self.name}': kind rule {rule}: kind id",
                                size=len(rule_names), shape=(n,), at="vertex", error=InputGraphError)
            lookup = {k: i for i, k in enumerate(self.functions)}
            to_fn = np.array([lookup.get(k, -1) for k in rule_names], np.int64)
            mapped = to_fn[rule_kind] if len(to_fn) else rule_kind
            unknown = (mapped < 0) if rest is None else (rest & (mapped < 0))
            if unknown.any():
                v = int(np.flatnonzero(unknown)[0])
                raise InputGraphError(f"{batch.where(v)}: kind {rule_names[rule_kind[v]]!r} (by the structure's "
                                      f"rule {rule}) has no vertex function in structure '{self.name}' "
                                      f"({functions})")
            return mapped, 1
        if len(self.functions) == 1:
            return np.zeros(n, np.int64), 2
        v = 0 if rest is None else int(np.flatnonzero(rest)[0])
        raise InputGraphError(f"structure '{self.name}' has {functions}, but sample {int(batch.sample[v])} "
                              f"gives no kinds: give each graph its kinds (InputGraph(..., kinds=[...])) or "
                              f"the structure a kind rule (Structure(..., kinds=minicavs.leaf_internal))")

    def _check_arity(self, batch: Batch, nch: np.ndarray, how: int | None, source) -> None:
        """No vertex has more children than its kind's arity; the error says how the vertex got its kind."""
        names = batch.kind_names
        arity = np.array([self.functions[k].arity for k in names], np.int64)
        over = nch > arity[batch.kind]
        if over.any():
            v = int(np.flatnonzero(over)[0])
            kname = names[batch.kind[v]]
            why = ("given with the graph", f"by the structure's rule {getattr(self.kinds, '__name__', '')}",
                   "the structure's only vertex function")[how if source is None else int(source[v])]
            raise InputGraphError(f"{batch.where(v)}: {int(nch[v])} children, more than the arity "
                                  f"{self.functions[kname].arity} of vertex function '{kname}' (kind '{kname}', {why})")

    def _check_gathered_kinds(self, batch: Batch, nch: np.ndarray) -> None:
        """A gather that names the kinds it reads finds only those kinds in its child slot."""
        for kind_id, kname in enumerate(batch.kind_names):
            f = self.functions[kname]
            for j, named in f.gather_kinds.items():
                if named is None:
                    continue
                allowed = np.isin(np.arange(len(batch.kind_names)),
                                  [i for i, kn in enumerate(batch.kind_names) if kn in named])
                has = np.flatnonzero((batch.kind == kind_id) & (nch > j))
                child = batch.child_idx[batch.child_ptr[has] + j]
                bad = np.flatnonzero(~allowed[batch.kind[child]])
                if len(bad):
                    v, c = int(has[bad[0]]), int(child[bad[0]])
                    raise InputGraphError(f"{batch.where(v)}: child {j} (vertex {int(batch.local[c])}) is a "
                                          f"'{batch.kind_names[batch.kind[c]]}' vertex, but gather({j}) of "
                                          f"'{kname}' reads only {', '.join(repr(x) for x in named)}")

    def prepare(self, graphs: Sequence[InputGraph], policy, sample_ids=None, native: bool = True):
        """(batch, memory plan) of ``graphs`` scheduled by ``policy``. ``native``: in one C call
        (planner.py) where it covers the structure, the policy and the graphs; else (and for any input a
        check refuses, so that the error is the reference's) the reference path: :meth:`batch`, the policy's
        schedule, :func:`~minicavs.runtime.memory.plan_memory`."""
        graphs = graphs if isinstance(graphs, list) else list(graphs)   # (read twice when the reference runs)
        if native and type(policy) in _CAVS_WHEN_ONE_KIND:
            spec = self._planner_spec()
            if spec is not None:
                made = planner.prepare(graphs, spec, sample_ids)
                if made is not None:
                    return made
        batch = self.batch(graphs)
        schedule = policy.schedule(batch)
        fs = self.functions
        plan = plan_memory(batch, schedule, {k: f.arity for k, f in fs.items()},
                           {k: tuple(f.pulls) for k, f in fs.items()},
                           {k: tuple(f.pushes) for k, f in fs.items()}, sample_ids)
        return batch, plan

    def _planner_spec(self) -> "planner.Spec | None":
        """The native planner's view of this structure (None where it does not cover it: a kind rule other
        than the leaf/internal one, gathers that name the kinds they read); made once."""
        if self._spec is False:
            names = tuple(self.functions)
            lookup = {k: i for i, k in enumerate(names)}
            rule = getattr(self.kinds, "leaf_internal", None)
            if any(named is not None for f in self.functions.values() for named in f.gather_kinds.values()):
                spec = None
            elif self.kinds is None and len(names) == 1:
                spec = (0, 0, 0)
            elif rule is not None and isinstance(rule, tuple) and len(rule) == 2:
                spec = (1, lookup.get(rule[0], -1), lookup.get(rule[1], -1))   # -1: the reference explains
            else:
                spec = None
            if spec is not None:
                fs = list(self.functions.values())
                pulls = tuple(sorted({p for f in fs for p in f.pulls}))
                pushes = tuple(sorted({p for f in fs for p in f.pushes}))
                uses = np.array([[p in f.pulls for f in fs] for p in pulls]
                                + [[p in f.pushes for f in fs] for p in pushes], np.uint8).reshape(-1, len(fs))
                spec = planner.Spec(names, *spec, np.array([f.arity for f in fs], np.int64), pulls, pushes, uses)
            self._spec = spec
        return self._spec

    def compiled_for(self, batch: Batch, opts: EngineOptions) -> list:
        """Each kind's compiled function as ``opts`` runs it (GEMMs merged or not)."""
        return [None if self.compiled.get(k) is None else self.compiled[k].variant(opts) for k in batch.kind_names]


@dataclass(frozen=True)
class Prepared:
    """A batch scheduled and planned by :meth:`Model.prepare`, ready for :meth:`Model.run`."""

    model: "Model"
    plans: dict     # structure name -> (Batch, MemoryPlan, compiled function per kind id)
    options: EngineOptions   # what the compiled functions were chosen for (merged GEMMs or not)


@dataclass
class Result:
    loss: float | None   # a 0-d device array after a training run on a device (see Model.run)
    grads: dict = field(default_factory=dict)      # parameter name -> array or RowSparse
    outputs: dict = field(default_factory=dict)    # name -> array (static graph outputs)
    pushes: dict = field(default_factory=dict)     # structure name -> {push name: buffer}
    batches: dict = field(default_factory=dict)    # structure name -> (Batch, MemoryPlan)
    states: dict = field(default_factory=dict)     # structure name -> engine RunState
    static: list = field(default_factory=list)     # program.StaticRun per static graph run, in order

    def per_sample(self, structure: str, push: str = "h") -> list[np.ndarray]:
        """The push buffer split by sample; rows in local vertex order."""
        batch, plan = self.batches[structure]
        order = plan.push_order[push]
        counts = np.bincount(batch.sample[order], minlength=len(batch.graphs))
        return np.split(self.pushes[structure][push], np.cumsum(counts)[:-1])



def _pull_buffers(s: Structure, plan, env: dict) -> dict:
    """Structure ``s``'s pull buffers, as the static graph computed them, each with one row per vertex of the
    batch that pulls it."""
    pull_bufs = {}
    for name, src in s.pulls.items():
        buf = env[src]
        want = plan.pull_rows.get(name, 0)
        if len(buf) != want:
            fed = [n.label() for n in Graph([src]).nodes if n.op == "input"]
            raise FeedError(f"structure '{s.name}': pull buffer '{name}' has {len(buf)} rows, the batch "
                            f"has {want} vertices that pull it (the buffer is {src.label()}"
                            + (f", computed from {', '.join(fed)})" if fed else ")"))
        pull_bufs[name] = buf
    return pull_bufs

class Model:
    """Structures + static graphs; one call runs forward and backward for a batch of samples."""

    def __init__(self, structures: Structure | Sequence[Structure], loss: Node | None = None,
                 outputs: Mapping[str, Node] | None = None, policy="cavs",
                 options: EngineOptions | None = None, device: Device | str = "cpu"):
        """``device``: where every array of a run lives and every kernel runs (``cpu`` or ``cuda``, or a
        :class:`~minicavs.engine.backend.Backend`); parameters passed to :meth:`run` must already be there."""
        self.structures = [structures] if isinstance(structures, Structure) else list(structures)
        names = [s.name for s in self.structures]
        if len(set(names)) != len(names):
            raise ShapeError(f"structure names must differ, got {names}")
        if loss is not None and loss.shape != ():
            raise ShapeError(f"the loss must be a scalar, got {loss.label()} {fmt_shape(loss.shape)}")
        self.loss = loss
        self.outputs = dict(outputs or {})
        self.policy = get_policy(policy)
        self.options = options or EngineOptions()
        self.device = get_device(device)
        # Forward stages: static nodes each structure's pulls need, then the loss and outputs.
        done: set = set()
        self.stages = []
        available = set()
        for s in self.structures:
            nodes = [n for n in Graph(list(s.pulls.values())).nodes if n not in done] if s.pulls else []
            for n in nodes:
                if n.op == "input" and n.name and "." in n.name and n not in available and any(
                        n in t._pushed.values() for t in self.structures):
                    raise ShapeError(f"structure '{s.name}' pulls from {n.label()}, pushed by a later structure")
            done.update(nodes)
            self.stages.append(StaticNodes(nodes))
            available.update(s._pushed.values())
        final = [x for x in ([loss] if loss is not None else []) + list(self.outputs.values())]
        self.final_stage = StaticNodes(n for n in Graph(final).nodes if n not in done) if final else StaticNodes()
        self.loss_stage = StaticNodes(n for n in Graph([loss]).nodes if n not in done) if loss is not None \
            else StaticNodes()
        self.static_nodes = done | set(self.final_stage)
        self.param_nodes = {}
        for n in self.static_nodes:
            if n.op == "param":
                self.param_nodes[n.name] = n
        for s in self.structures:
            for f in s.functions.values():
                for p in f.params:
                    self.param_nodes.setdefault(p.name, p)
        self._build_backward()
        self._static = self._static_graphs(done, final)
        self._workspaces: dict = {}
        self._plans: OrderedDict = OrderedDict()   # see _plan
        self._plans_lock = threading.Lock()        # prepare may run on the prefetch thread
        self._layouts: dict = {}                   # options -> the planned parameter buffers (see layout)
        self.planned = layout.solve([g for s in self.structures for fn in s.compiled.values()
                                     for g in gemm.layout_groups(fn.F)])
        for s in self.structures:   # one parameter layout over every function's merged products
            for fn in s.compiled.values():
                if fn.layout is None:
                    fn.layout = self.planned
        for s in self.structures:   # compile F and ∂F for the model's options and device now, not in a run
            for fn in s.compiled.values():
                fn.variant(self.options).phases(self.options, self.device)

    def _static_graphs(self, done: set, final: list) -> StaticGraphs:
        """The static graphs' programs (static_program.py), over every graph a run evaluates: the pulls' stages,
        the loss and outputs, training the loss with the gradients on top (one graph), the gradients."""
        self._training_stages = {with_outputs: StaticNodes(n for n in Graph(ends + self._early).nodes if n not in done)
                                 for with_outputs, ends in ((True, final), (False, [self.loss]))} if self.bwd else {}
        return StaticGraphs(self.stages + [self.final_stage, self.loss_stage] + (
            list(self._training_stages.values()) + list(self._push_grad_nodes.values()) + [self._static_grad_nodes]
            if self.bwd else []))

    def layout(self, options: EngineOptions | None = None) -> list[tuple]:
        """The planned parameter buffers of the merged products under ``options`` (passes/layout.py): each a
        tuple of parameter names in column order, one per buffer (:attr:`planned`, solved over every
        function's merged products at construction, so the functions agree on one order)."""
        options = (options or self.options).compile_key()
        found = self._layouts.get(options)
        if found is None:
            found = []
            for s in self.structures:
                for fn in s.compiled.values():
                    for m in fn.variant(options).merges:
                        for buffer in (m.buffer, m.bias_buffer):
                            if buffer is not None and buffer not in found:
                                found.append(buffer)
            self._layouts[options] = found
        return found

    def plan_buffers(self, params, options: EngineOptions | None = None) -> None:
        """Lay ``params`` (a ParameterSet of host arrays) out as :meth:`layout` plans under ``options``
        (default the model's), once: the merged products' weights become views of one buffer each (same
        values; nothing else changes), so they are read with no copy per batch.

        This is the one moment a parameter's storage moves (its ``value`` becomes a view of a new buffer),
        so it belongs before anyone takes an array: the Trainer calls it at construction, before it hands
        out a parameter; with a model and parameters of your own, call it after building the model and
        before taking ``params[name].value``. :meth:`run` never calls it (it reads a merged weight of
        parameters not laid out from a copy: speed only). A buffer any of whose parameters is laid out
        already is left as it is, so calling it again, or under other options, moves nothing. Does nothing
        without ``plan_layout`` and ``merge_gemms``, or on a device (CUDA keeps per-parameter arrays)."""
        options = options or self.options
        plan = getattr(params, "plan_buffer", None)
        if plan is None or not (options.plan_layout and options.merge_gemms) or self.device.xp is not np:
            return
        for names in self.layout(options):
            values = [params[n].value if n in params else None for n in names]
            if all(isinstance(v, np.ndarray) and not is_planned(v.base) for v in values):
                plan(names)

    def workspace(self, structure: str) -> Workspace:
        """The buffers the runs of ``structure`` reuse across batches (on the model's device)."""
        key = (structure, self.device)
        if key not in self._workspaces:
            self._workspaces[key] = Workspace(self.device.xp)
        return self._workspaces[key]

    def _build_backward(self):
        if self.loss is None:
            self.bwd = None
            return
        pulls = [(s, name, node) for s in self.structures for name, node in s.pulls.items()
                 if name in s.pull_grads]
        self.pull_ct = {(s.name, name): input_node(node.shape, node.dtype, name=f"d{s.name}.{name}")
                        for s, name, node in pulls}
        outs = [self.loss] + [node for _, _, node in pulls]
        cts = [ones_like(self.loss)] + [self.pull_ct[(s.name, name)] for s, name, _ in pulls]
        pushed = [(s, name, node) for s in self.structures for name, node in s._pushed.items()]
        params = sorted((n for n in self.static_nodes if trainable(n)),   # frozen parameters: no gradient
                        key=lambda n: n.name)
        grads = grad(outs, [node for _, _, node in pushed] + params, cts, zeros=False)
        self.push_grad = {(s.name, name): g for (s, name, _), g in zip(pushed, grads)}
        self.static_param_grad = {p.name: g for p, g in zip(params, grads[len(pushed):]) if g is not None}
        # the nodes each backward evaluates, in order (sorted once here, not per step)
        self._push_grad_nodes = {key: StaticNodes(Graph([g]).nodes) for key, g in self.push_grad.items()
                                 if g is not None}
        sg = list(self.static_param_grad.values())
        self._static_grad_nodes = StaticNodes(Graph(sg).nodes if sg else ())
        self.bwd = True
        everything = Graph([g for g in grads if g is not None]).nodes
        self._ct_dependents = {}
        for s in self.structures:
            dep = {ct for (name, _), ct in self.pull_ct.items() if name == s.name}
            for n in everything:
                if n not in dep and any(x in dep for x in n.inputs):
                    dep.add(n)
            self._ct_dependents[s.name] = [n for n in dep if n.op != "input"]
        # the gradients that read no pull's cotangent (the head's: its pushes' and parameters'), computed with the
        # loss in one static graph (one program: static_program.py) when training
        late = set(self.pull_ct.values()).union(*map(set, self._ct_dependents.values()))
        self._early = [g for g in list(self.push_grad.values()) + sg if g is not None and g not in late]

    # --- running ----------------------------------------------------------------------------------------

    def _graphs_by_structure(self, graphs) -> dict:
        if type(graphs) is not list and isinstance(graphs, Mapping):   # (typing's isinstance: a Python call)
            unknown = set(graphs) - {s.name for s in self.structures}
            if unknown:
                raise KeyError(f"graphs given for unknown structure(s) {sorted(unknown)}")
            return dict(graphs)
        if len(self.structures) != 1:
            raise TypeError("this model has several structures: pass graphs as {structure name: graphs}")
        return {self.structures[0].name: graphs}

    def batches(self, graphs) -> dict:
        """Each structure's flattened, kind-assigned batch of ``graphs`` (what a policy schedules)."""
        graphs = self._graphs_by_structure(graphs)
        return {s.name: s.batch(graphs[s.name]) for s in self.structures}

    def prepare(self, graphs, policy=None, sample_ids=None, options: EngineOptions | None = None) -> "Prepared":
        """Everything about a batch that does not depend on parameter values: each structure's flattened
        batch, its schedule, memory plan and compiled functions (for ``options``, default the model's), all
        validated. Pure (it reads the model, writes nothing that a run reads), so the trainer prepares the
        next batch on a background thread while one runs (``train.prefetch``); :meth:`run` takes the
        result in place of the graphs."""
        policy = self.policy if policy is None else get_policy(policy)
        options = options or self.options
        graphs = self._graphs_by_structure(graphs)
        if sample_ids is not None:   # dropout row keys: sample id << 32 | vertex id (random.row_key)
            sizes = sorted({len(g) for g in graphs.values()})
            sample_ids = indices(sample_ids, "sample id", size=1 << 32, shape=(sizes[0] if len(sizes) == 1 else None,),
                                 of=f" ({sizes} samples)")
        plans = {s.name: self._plan(s, graphs, policy, options, sample_ids)   # validate all first
                 for s in self.structures}
        return Prepared(self, plans, options)

    def forget_plans(self) -> None:
        """Drop the plans kept for batches that come again (see ``_plan``): a benchmark that replays the
        same batches measures planning as training, which reshuffles, pays it."""
        with self._plans_lock:
            self._plans.clear()

    def _plan(self, s: Structure, graphs, policy, options: EngineOptions, sample_ids=None):
        """(Batch, MemoryPlan, compiled functions) of ``graphs[s.name]``. A batch of the very same graph
        objects as one of the last few (Tree-FC: every batch the same tree) reuses that one's: flattening,
        scheduling and planning are functions of the graphs (immutable: InputGraph keeps read-only arrays),
        the policy (only one whose schedule depends on nothing else), the engine options and the sample ids,
        which together are the key; the cached objects are never written by a run."""
        if s.name not in graphs:
            raise KeyError(f"no input graphs for structure '{s.name}'")
        key = None
        given = graphs[s.name]
        if not s.reads_row_keys and sample_ids is not None and len(sample_ids) == len(given):
            sample_ids = None   # (a wrong count is still the planner's error)
        if depends_on_batch_only(policy) and isinstance(given, (list, tuple)) and all(
                type(g) is InputGraph for g in given):
            key = (s.name, tuple(given), type(policy), options,
                   None if sample_ids is None else sample_ids.tobytes())
            with self._plans_lock:
                hit = self._plans.get(key)
                if hit is not None:
                    self._plans.move_to_end(key)
                    return hit
        batch, plan = s.prepare(given, policy, sample_ids)
        planned = batch, plan, s.compiled_for(batch, options)
        if key is not None:
            with self._plans_lock:
                self._plans[key] = planned
                while len(self._plans) > 1 and (len(self._plans) > PLAN_CACHE_SIZE or sum(
                        b.num_vertices for b, _, _ in self._plans.values()) > PLAN_CACHE_VERTICES):
                    self._plans.popitem(last=False)
        return planned

    def run(self, graphs, feeds: Mapping | None = None, params: Mapping | None = None,
            ctx: RunContext | None = None, backward_pass: bool = True, policy=None,
            sample_ids=None, options: EngineOptions | None = None, outputs: bool = True) -> Result:
        """Forward (and, with a loss and ``backward_pass``, backward) over one batch of samples.

        ``graphs``: the input graphs (a dict by structure name when there are several), or the batch
        :meth:`prepare` made of them. ``sample_ids`` (one per sample, default 0..K-1) key the dropout masks
        together with the vertex id, so a sample draws the same masks in any batch that gives it the same
        id. ``outputs=False`` (a training step that reads only the loss and gradients) skips the outputs that
        the loss does not need, e.g. a classifier's softmax over every vertex."""
        device = self.device
        xp = device.xp
        feeds = dict(feeds or {}) if xp is np else {k: _feed_on(device, v) for k, v in (feeds or {}).items()}
        params = params or {}
        ctx = ctx or RunContext()
        options = options or self.options
        training = backward_pass and self.bwd is not None
        plans = self._prepared(graphs, policy, sample_ids, options).plans
        env: dict = {}
        result = Result(None)
        states, final, head = {}, linked_head.final_graph(self, training, outputs), None
        for s, stage in zip(self.structures, self.stages):
            batch, plan, compiled = plans[s.name]
            try:
                self._evaluate(stage, s.pulls.values(), env, feeds, params, ctx, result.static,
                               f"forward, the pulls of structure '{s.name}'", options, training)
            except FeedError as e:
                raise _at_pull_row(e, s, batch) from None
            pull_bufs = _pull_buffers(s, plan, env)
            if s is self.structures[-1] and final[0]:   # (the graph on top, linked into F's program)
                head = linked_head.head_for(self, s, final, env, feeds, params, ctx, training, result.static)
            st = forward(compiled, plan, pull_bufs, params, ctx, s.message_shapes, s.dtype, training=training,
                         workspace=self.workspace(s.name), opts=options, device=device, head=head)
            states[s.name] = st
            result.pushes[s.name] = st.pushes
            result.batches[s.name] = (batch, plan)
            for name, node in s._pushed.items():
                if name not in st.pushes:
                    raise FeedError(f"structure '{s.name}': no vertex in the batch pushes '{name}'")
                env[node] = st.pushes[name]
        if head is None:
            self._evaluate(final[0], final[1], env, feeds, params, ctx, result.static, final[2], options, training)
        if outputs or self.loss is None:
            result.outputs = {k: device.to_host(env[v]) for k, v in self.outputs.items()}   # for metrics: host
        result.states = states
        if self.loss is not None:
            loss = env[self.loss]
            # a training step on a device leaves its loss there: the optimizer reads it back together with
            # the step's finite flags (one device-to-host read a step); everything else reads it now
            result.loss = loss if training and on_device(loss) else float(loss)
        if training:
            result.grads = self._backward(plans, states, env, feeds, params, ctx, result.static, options)
        return result

    def _prepared(self, graphs, policy, sample_ids, options: EngineOptions) -> Prepared:
        """``graphs`` prepared (scheduled and planned), or the batch :meth:`prepare` made already, checked to
        be this model's for ``options``."""
        if not isinstance(graphs, Prepared):
            return self.prepare(graphs, policy, sample_ids, options)
        if policy is not None or sample_ids is not None:
            raise TypeError("a prepared batch was scheduled with its policy and sample ids already: "
                            "pass them to Model.prepare, not to run")
        if graphs.model is not self:
            raise ValueError("this batch was prepared by another model")
        if graphs.options != options:
            raise ValueError(f"this batch was prepared for other engine options ({graphs.options}); "
                             f"it runs with {options}")
        return graphs

    def _evaluate(self, nodes, explicit, env: dict, feeds, params, ctx, static: list, what: str, options,
                  training: bool = True) -> None:
        """Evaluate a static graph's ``nodes`` into ``env`` (static_program.py: its program on the device's
        runner, the rest on the step runner), ``explicit`` the values the model reads; what ran goes to
        ``static`` as a program.StaticRun named ``what`` (explain shows it)."""
        self._static.run(nodes, explicit, env, feeds, params, ctx, options, static, what, training, self.device)

    def _backward(self, plans, states, env, feeds, params, ctx, static: list, options) -> dict:
        """Every parameter's gradient; ``static`` gets a program.StaticRun per static graph run."""
        xp = self.device.xp
        benv = dict(env)
        for s in self.structures:  # unknown cotangents are zero until their structure has run backward
            for name, node in s.pulls.items():
                key = (s.name, name)
                if key in self.pull_ct:
                    benv[self.pull_ct[key]] = xp.zeros_like(env[node])
        grads: dict = {}
        for s in reversed(self.structures):
            batch, plan, compiled = plans[s.name]
            push_grads = {}
            for name in s._pushed:
                g = self.push_grad[(s.name, name)]
                if g is None:
                    push_grads[name] = xp.zeros_like(env[s._pushed[name]])
                else:
                    self._evaluate(self._push_grad_nodes[(s.name, name)], [g], benv, feeds, params, ctx, static,
                                   f"backward, the gradient of push '{s.name}.{name}'", options)
                    push_grads[name] = benv[g]   # may be row-sparse (a lookup picked root rows): alg1.backward
            for name in {n for f in s.functions.values() for n in f.pushes} - set(push_grads):
                push_grads[name] = xp.zeros_like(states[s.name].pushes[name])  # consumed by nothing
            pull_shapes = {name: env[src].shape for name, src in s.pulls.items() if name in s.pull_grads}
            pull_grads, pgrads = backward(compiled, states[s.name], push_grads, pull_shapes, params, ctx, s.dtype)
            for name, g in pgrads.items():
                grads[name] = add_all(xp, [grads[name], g]) if name in grads else g
            for name, g in pull_grads.items():
                benv[self.pull_ct[(s.name, name)]] = g
            for node in self._ct_dependents[s.name]:  # computed with this structure's zero cotangents
                benv.pop(node, None)
        sg = self.static_param_grad
        if sg:
            self._evaluate(self._static_grad_nodes, sg.values(), benv, feeds, params, ctx, static,
                           "backward, the parameters' gradients", options)
            for name, g in sg.items():
                grads[name] = add_all(xp, [grads[name], benv[g]]) if name in grads else benv[g]
        return grads

    def forward_backward(self, graphs, feeds=None, params=None, ctx=None, policy=None,
                         sample_ids=None, options: EngineOptions | None = None, outputs: bool = True) -> Result:
        """Forward and backward over one batch of samples: the loss, every parameter's gradient, the outputs.

        - ``graphs``: one :class:`InputGraph` per sample (a list), or ``{structure name: list}`` when the
          model has several structures, or what :meth:`prepare` returned for them;
        - ``feeds``: ``{input name: array}`` for every ``ops.input`` the model reads (word ids, labels, the
          rows of the roots, ...); rows that a pull reads are in batch vertex order: sample by sample, each
          sample's vertices in its graph's order;
        - ``params``: ``{name: array}`` for every parameter (a :class:`ParameterSet` will do);
        - ``ctx``: a :class:`RunContext` (``seed`` and ``step`` key the dropout masks; ``training``);
          default: training, seed 0, step 0;
        - ``policy``: the batching policy for this batch (default the model's, ``cavs``);
        - ``sample_ids``: one integer per sample, keying its dropout masks (default ``0..K-1``);
        - ``options``: :class:`EngineOptions` for this batch (default the model's);
        - ``outputs``: ``False`` skips the outputs the loss does not need.

        Returns a :class:`Result`: ``loss`` (a float), ``grads`` (parameter name -> array, or
        :class:`~minicavs.core.sparse.RowSparse` for a looked-up embedding), ``outputs`` (name -> numpy array),
        ``pushes`` and ``per_sample(structure, push)``."""
        return self.run(graphs, feeds, params, ctx, True, policy, sample_ids, options, outputs)

    def infer(self, graphs, feeds=None, params=None, ctx=None, policy=None, sample_ids=None,
              options: EngineOptions | None = None) -> Result:
        """Forward only, dropout off (``ctx`` defaults to ``RunContext(training=False)``): keeps no backward
        state (only values that cross engine phases). The arguments are :meth:`forward_backward`'s; the
        :class:`Result` has ``outputs``, ``pushes`` and ``loss``, no ``grads``. A model with a loss needs the
        loss's inputs (labels, targets) fed here too; :meth:`Task.inference_model` makes one without."""
        ctx = ctx or RunContext(training=False)
        return self.run(graphs, feeds, params, ctx, False, policy, sample_ids, options)


def _feed_on(device: Device, value):
    """A feed for a run on ``device``: float arrays copied over once (one host-to-device copy each); integer
    feeds (labels, word ids, indices) stay on the host, where their checks read them without a device read,
    and go over where a kernel reads them."""
    if on_device(value):
        return value
    host = np.asarray(value)
    return host if host.dtype.kind in "iub" or host.dtype.kind == "O" else device.to_device(host)
