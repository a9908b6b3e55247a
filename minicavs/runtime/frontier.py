"""A typed DAG run type by type (ED-Batch's Alg. 1), and the statistics batching policies read off it.

Everything here is pure numpy over plain arrays: CSR children (``child_ptr``, ``child_idx``: child k of v is
``child_idx[child_ptr[v] + k]``) and one type id per vertex (``kind``, in ``[0, num_types)``). A *step* runs
every ready vertex (all children run) of one chosen type as one batch; a policy is the rule choosing the
type. Running all ready vertices of the type never costs a batch (ED-Batch A.1), so a policy is fully
described by its sequence of types.

- :class:`Frontier`: the run state. Per step it touches only the executed batch's parent edges and the ready
  set, so a whole schedule costs O(vertices + edges + steps x ready set) in a few numpy calls per step.
- :func:`typewise_children`: ED-Batch's G[t]: each type-t vertex linked to its nearest type-t descendants
  (through vertices of other types). A type-t vertex is on G[t]'s frontier when none of those is left; the
  reward of Eq. 1 and the greedy policy compare the ready type-t vertices with that frontier.
- :func:`lower_bound`: ED-Batch A.3, the sum over types of the most type-t vertices on one path.

The policies' runs (:func:`run_agenda`, :func:`run_greedy`, :meth:`minicavs.runtime.fsm.Fsm.schedule`) take a
backend's native schedule when one is provided (:func:`provide_native_schedule`; the CPU backend's is one C
call, minicavs/cpu/frontier_kernel.py): the same schedule, vertex for vertex, at a few us per step instead of the
60-75 us of :class:`Frontier`'s numpy calls. ``native=False`` runs the numpy reference.
"""
from __future__ import annotations

import numpy as np

from .inputs import transpose


def segments(ptr: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The CSR entries of ``rows`` concatenated, and the row (position in ``rows``) each came from."""
    starts, ends = ptr[rows], ptr[rows + 1]
    lens = ends - starts
    total = int(lens.sum())
    if total == 0:
        return idx[:0], np.zeros(0, np.int64)
    pos = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(total)
    return idx[pos], np.repeat(np.arange(len(rows)), lens)


def levels(height: np.ndarray) -> list[np.ndarray]:
    """Vertices grouped by height (0: no children), lowest first."""
    order = np.argsort(height, kind="stable")
    cuts = np.searchsorted(height[order], np.arange(1, int(height.max()) + 1 if len(height) else 0))
    return np.split(order, cuts)


def lower_bound(ptr: np.ndarray, idx: np.ndarray, kind: np.ndarray, num_types: int,
                height: np.ndarray) -> int:
    """ED-Batch A.3: sum over types t of max over v of d_t(v), d_t(v) = [kind(v) = t] + max over v's
    children of d_t. Type-t vertices on one path need distinct batches, and a batch has one type."""
    n = len(kind)
    if n == 0:
        return 0
    depth = np.zeros((n, num_types), np.int64)
    depth[np.arange(n), kind] = 1
    for level in levels(height)[1:]:
        children, owner = segments(ptr, idx, level)
        below = np.zeros((len(level), num_types), np.int64)
        np.maximum.at(below, owner, depth[children])
        depth[level] += below
    return int(depth.max(axis=0).sum())


def typewise_children(ptr: np.ndarray, idx: np.ndarray, kind: np.ndarray,
                      height: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """G[t]'s edges for every type at once, as CSR: the nearest descendants of v of v's own type.

    Bottom-up by height: ``near(u)`` = {u} plus the members of the children's ``near`` sets whose type
    differs from u's (u hides every descendant of its own type). v's typewise children are the members of
    its children's ``near`` sets of v's type. Sets are (vertex, member) pairs, deduplicated for DAGs."""
    n = len(kind)
    near_start = np.zeros(n, np.int64)
    near_len = np.zeros(n, np.int64)
    buf = np.zeros(max(16, 2 * n), np.int64)
    used = 0
    tw_owner, tw_member = [], []
    for level in levels(height):
        children, owner = segments(ptr, idx, level)
        lens = near_len[children]
        total = int(lens.sum())
        pos = np.repeat(near_start[children] - np.cumsum(lens) + lens, lens) + np.arange(total)
        members = buf[pos]
        u = level[np.repeat(owner, lens)]
        same = kind[members] == kind[u]
        codes_tw = np.unique(u[same] * n + members[same])
        tw_owner.append(codes_tw // n)
        tw_member.append(codes_tw % n)
        codes = np.unique(np.concatenate((level * n + level, u[~same] * n + members[~same])))
        if used + len(codes) > len(buf):
            buf = np.concatenate((buf, np.zeros(max(len(buf), len(codes)), np.int64)))
        # codes are sorted by owner and ``level`` is sorted by id, so owner groups come in level order
        counts = np.bincount(np.searchsorted(level, codes // n), minlength=len(level))
        near_start[level] = used + np.cumsum(counts) - counts
        near_len[level] = counts
        buf[used:used + len(codes)] = codes % n
        used += len(codes)
    owner = np.concatenate(tw_owner) if tw_owner else np.zeros(0, np.int64)
    member = np.concatenate(tw_member) if tw_member else np.zeros(0, np.int64)
    order = np.lexsort((member, owner))
    counts = np.bincount(owner, minlength=n)
    return np.concatenate(([0], np.cumsum(counts))).astype(np.int64), member[order]


# A backend may provide the whole schedule of a batch as one native call (``get() -> kernel or None``, the
# kernel's ``schedule(rule, child_ptr, child_idx, kind, num_types, ...)`` returning (task of every vertex, type
# of every task)); this module never imports a backend, as ops never do (ops/registry.py).
_NATIVE: list = []


def provide_native_schedule(get) -> None:
    """Register ``get() -> kernel | None``, the native schedule (minicavs/cpu/__init__.py does)."""
    _NATIVE[:] = [get]


def native_schedule():
    """The registered native schedule kernel, or None (then the numpy :class:`Frontier` runs)."""
    return _NATIVE[0]() if _NATIVE else None


class TypedGraph:
    """A typed DAG (one batch): CSR children, type per vertex, heights; parents and G[t] made on demand."""

    def __init__(self, child_ptr: np.ndarray, child_idx: np.ndarray, kind: np.ndarray, num_types: int,
                 height: np.ndarray):
        self.child_ptr, self.child_idx = child_ptr, child_idx
        self.kind, self.num_types, self.height = kind, int(num_types), height
        self._parents = self._typewise = None

    @classmethod
    def of(cls, batch) -> "TypedGraph":
        """The typed graph of an :class:`minicavs.runtime.inputs.Batch` (its kinds are the types)."""
        graph = cls(batch.child_ptr, batch.child_idx, batch.kind, len(batch.kind_names), batch.height)
        graph._parents = batch.parents_csr()     # cached on the batch
        return graph

    @property
    def num_vertices(self) -> int:
        return len(self.kind)

    def parents(self) -> tuple[np.ndarray, np.ndarray]:
        if self._parents is None:
            self._parents = transpose(self.child_ptr, self.child_idx, self.num_vertices)
        return self._parents

    def typewise(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(number of typewise children, typewise parents CSR ptr, idx) of every vertex."""
        if self._typewise is None:
            tw_ptr, tw_idx = typewise_children(self.child_ptr, self.child_idx, self.kind, self.height)
            self._typewise = (np.diff(tw_ptr), *transpose(tw_ptr, tw_idx, self.num_vertices))
        return self._typewise

    def lower_bound(self) -> int:
        return lower_bound(self.child_ptr, self.child_idx, self.kind, self.num_types, self.height)


class Frontier:
    """The run state of Alg. 1: which vertices are left, which are ready (kept per type), how many per type.

    A step costs a handful of numpy calls on the executed batch and its parents only (no pass over the
    whole ready set): the ready vertices are kept as one list of arrays per type, and the parents' pending
    child counts drop by ``np.subtract.at``. With ``track_typewise`` it also keeps, per type t, how many
    vertices are on G[t]'s frontier (the denominator of Eq. 1's ratio)."""

    def __init__(self, graph: TypedGraph, track_typewise: bool = False):
        kind, T = graph.kind, graph.num_types
        self.kind = kind
        self.num_types = T
        self.parent_ptr, self.parent_idx = graph.parents()
        self.pending = np.diff(graph.child_ptr).astype(np.int64)
        ready = np.flatnonzero(self.pending == 0)
        self.by_type = [[ready[kind[ready] == t]] for t in range(T)]
        self.counts = np.bincount(kind[ready], minlength=T)
        self.left = graph.num_vertices
        self.tw = None
        if track_typewise:
            tw_count, *self.tw = graph.typewise()
            self.tw_pending = tw_count.astype(np.int64)        # a copy: the run changes it
            self.tw_front = np.bincount(kind[self.tw_pending == 0], minlength=T)

    @property
    def ready(self) -> np.ndarray:
        """Every ready vertex (by type, then in the order they became ready)."""
        return np.concatenate([a for chunks in self.by_type for a in chunks])

    def ratios(self) -> np.ndarray:
        """Eq. 1's ratio per type: ready vertices / vertices on G[t]'s frontier (0 where none is ready)."""
        return self.counts / np.maximum(self.tw_front, 1)

    def run(self, t: int) -> np.ndarray:
        """Execute every ready vertex of type ``t`` as one batch; returns the batch's vertex ids."""
        chunks = self.by_type[t]
        batch = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        self.by_type[t] = []
        self.counts[t] = 0
        parents = parents_of(self.parent_ptr, self.parent_idx, batch)
        if len(parents):
            np.subtract.at(self.pending, parents, 1)
            newly = parents[self.pending[parents] == 0]
            if len(newly) > 1:
                newly = np.unique(newly)      # a parent of several vertices of the batch appears once each
            if len(newly):
                kinds = self.kind[newly]
                self.counts += np.bincount(kinds, minlength=self.num_types)
                for k in np.unique(kinds).tolist():
                    self.by_type[k].append(newly[kinds == k])
        if self.tw is not None:
            self.tw_front[t] -= len(batch)
            tw_parents = parents_of(self.tw[0], self.tw[1], batch)
            if len(tw_parents):
                np.subtract.at(self.tw_pending, tw_parents, 1)
                hit = tw_parents[self.tw_pending[tw_parents] == 0]
                self.tw_front[t] += len(np.unique(hit)) if len(hit) > 1 else len(hit)
        self.left -= len(batch)
        return batch


def parents_of(ptr: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The CSR entries of ``rows`` concatenated (:func:`segments` without the owners)."""
    starts = ptr[rows]
    lens = ptr[rows + 1] - starts
    offsets = np.cumsum(lens)
    total = int(offsets[-1]) if len(offsets) else 0
    if total == 0:
        return idx[:0]
    return idx[np.repeat(starts - offsets + lens, lens) + np.arange(total)]


def run_policy(frontier: Frontier, choose) -> tuple[np.ndarray, np.ndarray]:
    """Step until every vertex ran; ``choose(frontier)`` names the next type (one with ready vertices).
    Returns (task index of every vertex, type of every task)."""
    task = np.empty(len(frontier.kind), np.int64)
    kinds = []
    while frontier.left:
        t = int(choose(frontier))
        if frontier.counts[t] == 0:
            raise RuntimeError(f"batching policy chose type {t}, which has no ready vertex")
        task[frontier.run(t)] = len(kinds)
        kinds.append(t)
    return task, np.asarray(kinds, np.int64)


def run_agenda(graph: TypedGraph, native: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """DyNet's agenda rule: run the ready type whose unexecuted vertices (all of them, not only the ready
    ones) have the lowest average depth (height from the leaves); ties go to the lower type id."""
    kernel = native_schedule() if native else None
    if kernel is not None:
        return kernel.schedule("agenda", graph.child_ptr, graph.child_idx, graph.kind, graph.num_types,
                               height=graph.height)
    frontier = Frontier(graph)
    kind, T, height = graph.kind, graph.num_types, graph.height
    depth_sum = np.bincount(kind, weights=height, minlength=T).astype(np.float64)
    left = np.bincount(kind, minlength=T).astype(np.float64)
    task = np.empty(len(kind), np.int64)
    kinds = []
    while frontier.left:
        avg = np.where(frontier.counts > 0, depth_sum / np.maximum(left, 1), np.inf)
        t = int(np.argmin(avg))
        batch = frontier.run(t)
        depth_sum[t] -= height[batch].sum()
        left[t] -= len(batch)
        task[batch] = len(kinds)
        kinds.append(t)
    return task, np.asarray(kinds, np.int64)


def run_greedy(graph: TypedGraph, native: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The greedy policy's run (:func:`greedy_choice` every step); G[t] is built first either way."""
    kernel = native_schedule() if native else None
    if kernel is not None:
        typewise = graph._typewise or kernel.typewise(graph.child_ptr, graph.child_idx, graph.kind, graph.num_types)
        return kernel.schedule("greedy", graph.child_ptr, graph.child_idx, graph.kind, graph.num_types,
                               typewise=typewise)
    return run_policy(Frontier(graph, track_typewise=True), greedy_choice)


def greedy_choice(frontier: Frontier) -> int:
    """The sufficient-condition heuristic (Eq. 1's second term, Lemma 1): the type with the largest ratio
    of ready vertices to vertices on G[t]'s frontier; ties go to the lower type id."""
    return int(np.argmax(frontier.ratios()))
