"""Dynamic tensors and the per-batch memory plan (§3.3, Alg. 2), laid out after the schedule.

Because the whole schedule is known before F runs, every vertex has a fixed row in every dynamic tensor:
its position among the vertices of its kind in task order. A task's view of any tensor is then the
contiguous slice ``[offset, offset + bs)``. The scattered symbol has one tensor per message shape, shared by
the kinds scattering that shape and indexed by the vertex's position in the whole task order, plus one
trailing all-zero row that stands for a missing child.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.errors import FeedError
from ..core.random import row_key
from ..ir.graph import fmt_shape
from .inputs import Batch
from .scheduler import Schedule


_allocated = [0]   # buffers DynamicTensors have allocated so far, in any workspace (see allocations)


def allocations() -> int:
    """How many buffers DynamicTensors have allocated so far (in any workspace; it only grows): while it is
    unchanged, every DynamicTensor still holds the buffer it held (the engine's binder keeps their operands
    without looking them up again)."""
    return _allocated[0]


class DynamicTensor:
    """Rows of one symbol for all vertices of a batch: (shape without batch, bs, offset, one buffer).

    The buffer grows (x1.5) and is reused across batches, so steady-state training allocates nothing."""

    __slots__ = ("name", "shape", "dtype", "buffer", "rows", "peak_bytes", "xp", "last")

    def __init__(self, name: str, shape: tuple, dtype, xp=np):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.xp = xp   # the array module of the device holding the buffer
        self.buffer = xp.empty((0,) + self.shape, self.dtype)
        _allocated[0] += 1
        self.rows = 0
        self.peak_bytes = 0
        self.last = None   # the view the last resize returned (see prefix)

    def resize(self, rows: int, zero: bool = False) -> np.ndarray:
        """Make room for ``rows`` rows and return the view of exactly those rows."""
        if rows > len(self.buffer):
            self.buffer = self.xp.empty((max(rows, int(len(self.buffer) * 1.5)),) + self.shape, self.dtype)
            _allocated[0] += 1
        self.rows = rows
        self.peak_bytes = max(self.peak_bytes, self.buffer.nbytes)
        view = self.last = self.buffer[:rows]
        if zero:
            view.fill(0)
        return view

    def prefix(self, view):
        """(buffer, elements) when ``view`` is what the last resize returned, i.e. the buffer's first rows at
        the buffer's own address; else ``view``. A runner then keeps the buffer's address from batch to batch
        while the buffer object is the same, and only updates the elements its rows cover."""
        return (self.buffer, view.size) if view is self.last else view

    @property
    def nbytes(self) -> int:
        return self.rows * int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Workspace:
    """The buffers one structure's runs reuse from batch to batch, owned by the model: the forward and
    backward dynamic tensors (keyed by (kind id, node)), the scatter tensors (one per message shape) and their
    gradients. A buffer grows when a batch needs more rows and is never shrunk, so steady-state training
    allocates none of them."""

    def __init__(self, xp=np):
        self.xp = xp
        self.forward: dict = {}
        self.backward: dict = {}
        self.scatters: dict = {}        # message shape -> DynamicTensor
        self.scatter_grads: dict = {}   # message shape -> DynamicTensor
        self.arenas: dict = {}          # name -> DynamicTensor (flat scratch of the C runner)
        self.programs: dict = {}        # the C runner's linked programs (instructions.link's cache)

    def tensors(self, pool: dict, kind_id: int, nodes, rows: int) -> dict:
        """{node: its dynamic tensor}, sized for ``rows`` rows (created on first use)."""
        out = {}
        for node in nodes:
            tensor = pool.get((kind_id, node))
            if tensor is None:
                tensor = pool[(kind_id, node)] = DynamicTensor(node.name or node.op, node.vshape, node.dtype.np,
                                                           self.xp)
            tensor.resize(rows)
            out[node] = tensor
        return out

    def scatter_rows(self, rows: int, message: tuple, dtype) -> np.ndarray:
        """The first ``rows`` rows of the scatter tensor of ``message`` (stale values: every row is written
        before it is read)."""
        message = tuple(message)
        tensor = self.scatters.get(message)
        if tensor is None or tensor.dtype != np.dtype(dtype):
            tensor = self.scatters[message] = DynamicTensor(f"scatter{fmt_shape(message)}", message, dtype,
                                                            self.xp)
        return tensor.resize(rows)

    def arena(self, key: str, elements: int, dtype) -> np.ndarray:
        """A flat buffer of at least ``elements`` elements (stale values), kept for the next batch: the native
        C runner's scratch arenas."""
        tensor = self.arenas.get(key)
        if tensor is None or tensor.dtype != np.dtype(dtype):
            tensor = self.arenas[key] = DynamicTensor(key, (), dtype, self.xp)
        return tensor.resize(max(1, elements))

    def arena_prefix(self, key: str, elements: int, dtype) -> tuple:
        """:meth:`arena` as (its buffer, the elements used): see :meth:`DynamicTensor.prefix`."""
        view = self.arena(key, elements, dtype)
        return self.arenas[key].prefix(view)

    def scatter_grad_rows(self, like) -> np.ndarray:
        """A buffer shaped like the scatter tensor ``like`` for its gradient (stale values)."""
        message = tuple(like.shape[1:])
        tensor = self.scatter_grads.get(message)
        if tensor is None or tensor.dtype != like.dtype:
            tensor = self.scatter_grads[message] = DynamicTensor(f"scatter grad{fmt_shape(message)}", message,
                                                                 like.dtype, self.xp)
        return tensor.resize(len(like))

    @property
    def peak_bytes(self) -> int:
        tensors = (list(self.forward.values()) + list(self.backward.values()) + list(self.scatters.values())
                   + list(self.scatter_grads.values()) + list(self.arenas.values()))
        return sum(t.peak_bytes for t in tensors)


@dataclass
class KindPlan:
    """Index arrays of one vertex kind; row i of every tensor of this kind is vertex ``vertices[i]``."""

    name: str
    kind_id: int
    vertices: np.ndarray                     # global vertex ids in task order
    child_rows: list = field(default_factory=list)    # per child slot j: scatter-buffer row (sentinel N)
    pull_rows: dict = field(default_factory=dict)     # pull name -> row in that pull buffer
    push_rows: dict = field(default_factory=dict)     # push name -> row in that push buffer
    row_keys: np.ndarray | None = None       # dropout row keys (sample << 32 | local vertex id)
    task_offsets: np.ndarray | None = None   # the kind offset of each of its tasks, in task order
    tasks: np.ndarray | None = None          # the indices of its tasks in the schedule
    view_table: np.ndarray | None = None     # per task, start and step of each child slot's view (step -1: none)
    _views: list | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return len(self.vertices)

    @property
    def strides(self) -> list:
        """Per child slot j: the (start, step) arrays of its tasks' views, columns 2j and 2j + 1 of
        :attr:`view_table` (read off it when asked: a batch of one plans in microseconds)."""
        table = self.view_table
        return [] if table is None else [(table[:, 2 * j], table[:, 2 * j + 1]) for j in range(table.shape[1] // 2)]

    @property
    def views(self) -> list:
        """Per child slot j: {kind offset of a task: (start, step)} for the tasks whose child rows are a view
        (a lookup by slot; the task table reads :attr:`strides` directly)."""
        if self._views is None:
            self._views = [{off: (a, b) for off, a, b in zip(self.task_offsets.tolist(), start.tolist(),
                                                             step.tolist()) if b >= 0}
                           for start, step in self.strides]
        return self._views


@dataclass
class MemoryPlan:
    schedule: Schedule
    num_vertices: int
    task_array: np.ndarray  # (T, 4) int64: (kind id, kind offset, bs, global offset) per task, in forward order
    kinds: list            # KindPlan per kind id (None for kinds absent from the batch)
    pull_rows: dict        # pull name -> number of rows of its buffer
    push_order: dict       # push name -> global vertex ids, buffer row order (global id order)
    forest: bool           # no vertex is a child twice: backward gather can use plain fancy-index adds
    # made by the native planner (planner.py), for gather elision and gather slots 0..arity - 1 of each kind:
    task_views: np.ndarray | None = None   # the native task table (program.task_table) of those kinds
    gather_copies: np.ndarray | None = None   # (kinds, max arity): rows of the tasks whose slot is no view
    view_arity: tuple | None = None        # the arity each kind's columns of ``task_views`` assume
    _scatter_rows: dict = field(default_factory=dict, repr=False)

    @property
    def tasks(self) -> list:
        """:attr:`task_array` as a list of tuples (made when asked: the runs read the array)."""
        return list(map(tuple, self.task_array.tolist()))

    def scatter_rows(self, kind_id: int) -> np.ndarray:
        """Kind ``kind_id``'s rows of the scatter tensor, in kind order (int64; found once per batch, for the
        blocks before and after the task loop, which run over all of them)."""
        rows = self._scatter_rows.get(kind_id)
        if rows is None:
            rows = self._scatter_rows[kind_id] = np.ascontiguousarray(self.schedule.row[self.kinds[kind_id].vertices],
                                                                  np.int64)
        return rows


def plan_memory(batch: Batch, schedule: Schedule, arity: dict, pulls: dict, pushes: dict,
                sample_ids=None) -> MemoryPlan:
    """Offsets and index arrays for one batch, all computed with vectorised numpy (a few calls per kind
    and per pull or push name: at batch size 1 their count, not the vertices, is the cost).

    ``arity``/``pulls``/``pushes`` map a kind name to its F's arity, pull names and push names. Pull and
    push buffers have one row per vertex of the kinds that use them, in global vertex id order."""
    n = batch.num_vertices
    sample_ids = np.arange(len(batch.graphs)) if sample_ids is None else np.asarray(sample_ids, np.int64)
    if sample_ids.shape != (len(batch.graphs),):
        raise FeedError(f"{len(sample_ids)} sample ids for {len(batch.graphs)} samples")
    order, row = schedule.order, schedule.row
    kind_of_task = schedule.task_kind
    sizes = schedule.task_ptr[1:] - schedule.task_ptr[:-1]
    scatter_offsets = schedule.task_ptr[:-1]
    order_kind = batch.kind[order]
    ptr, idx = batch.child_ptr, batch.child_idx
    nch = ptr[1:] - ptr[:-1]
    task_row = np.zeros(len(sizes), np.int64)
    keys = row_key(sample_ids[batch.sample], batch.local)   # every vertex's at once, then per kind
    kinds: list = [None] * len(batch.kind_names)
    for kind_id, kname in enumerate(batch.kind_names):
        verts = order[order_kind == kind_id]
        if len(verts) == 0:
            continue
        mine = (kind_of_task == kind_id).nonzero()[0]   # (methods: np.flatnonzero and np.cumsum cost 1-2 us more)
        kind_sizes = sizes[mine]
        offs = kind_sizes.cumsum() - kind_sizes
        task_row[mine] = offs
        kind_plan = KindPlan(kname, kind_id, verts, task_offsets=offs, tasks=mine)
        start, count = ptr[verts], nch[verts]
        k = arity.get(kname, 0)
        kind_plan.view_table = np.empty((len(mine), 2 * k), np.int64)
        for j in range(k):
            has = count > j
            rows = np.full(len(verts), n, np.int64)
            rows[has] = row[idx[start[has] + j]]
            kind_plan.child_rows.append(rows)
            _strided_arrays(rows, offs, kind_sizes, n, kind_plan.view_table[:, 2 * j:])
        kind_plan.row_keys = keys[verts]
        kinds[kind_id] = kind_plan
    pull_rows, push_order = {}, {}
    for names, store, out in ((pulls, "pull_rows", pull_rows), (pushes, "push_rows", push_order)):
        for name in sorted({x for k in names.values() for x in k}):
            users = [kind_id for kind_id, kn in enumerate(batch.kind_names) if name in names.get(kn, ())]
            uses = np.zeros(len(batch.kind_names), bool)
            uses[users] = True
            mask = uses[batch.kind]
            rank = mask.cumsum() - 1
            out[name] = (int(rank[-1]) + 1 if len(rank) else 0) if store == "pull_rows" else mask.nonzero()[0]
            for kind_id in users:
                if kinds[kind_id] is not None:
                    getattr(kinds[kind_id], store)[name] = rank[kinds[kind_id].vertices]
    task_array = np.empty((len(sizes), 4), np.int64)
    task_array[:, 0], task_array[:, 1] = kind_of_task, task_row
    task_array[:, 2], task_array[:, 3] = sizes, scatter_offsets
    forest = not len(idx) or bool(np.bincount(idx, minlength=n).max() <= 1)
    return MemoryPlan(schedule, n, task_array, kinds, pull_rows, push_order, forest)


def _strided_arrays(rows: np.ndarray, offs: np.ndarray, sizes: np.ndarray, sentinel: int, out=None) -> tuple:
    """Per task (kind offset ``offs``, ``sizes`` rows): whether its child rows are an evenly strided block of
    the scatter tensor, ``start + step * i`` (ED-Batch's insight: the cheapest gather is a view), as two
    arrays (start, step): step 0 marks a task where every row is the sentinel (no vertex has that child),
    step -1 a task whose rows are not a strided block (a gather copies them). ``out``: an int64 array whose
    first two columns receive start and step (what is returned are views of them)."""
    if out is None:
        out = np.empty((len(offs), 2), np.int64)
    start, step = out[:, 0], out[:, 1]
    start[:] = rows[offs]
    step[:] = start != sentinel     # a task of one row is a view: step 1, or 0 on the sentinel
    multi = (sizes > 1).nonzero()[0]
    if len(multi):
        d = rows[1:] - rows[:-1]
        bad = np.zeros(len(d), np.int64)     # prefix count of changes in the stride
        bad[1:] = (d[1:] != d[:-1]).cumsum()
        first, last = offs[multi], offs[multi] + sizes[multi] - 2
        d0 = d[first]
        uniform = bad[last] == bad[first]     # d[first + 1 .. last] all equal d[first]
        sentinel_task = start[multi] == sentinel
        ok = uniform & np.where(sentinel_task, d0 == 0, d0 >= 1)
        step[multi] = np.where(ok, d0, -1)
        start[multi] = np.where(ok, start[multi], -1)
    return start, step
