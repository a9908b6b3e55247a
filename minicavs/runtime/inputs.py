"""Input graphs G (trees, chains, DAGs) and batches of them flattened into one vertex numbering.

A graph stores its children as CSR arrays: child k of vertex v is ``child_idx[child_ptr[v] + k]``; the order
matters, since ``gather(k)`` reads child k. A batch concatenates K graphs, offsetting ids, and computes every
vertex's height (0 without children, else 1 + the largest child height) with one vectorised numpy step per
level, which also finds cycles. Everything here is pure: a failed validation leaves nothing half-built.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Mapping, Sequence

import numpy as np

from ..core.errors import InputGraphError
from ..core.validate import indices, is_integer, show
from ..ops.registry import native_kernels


_BIG = 1 << 63


class InputGraph:
    """One sample's graph. ``kinds`` optionally names each vertex's kind, i.e. which vertex function of the
    structure runs it (e.g. 'leaf', 'internal'); see :meth:`minicavs.engine.model.Structure.batch`.

    Both constructors validate the same way before anything is kept: integer child ids (not floats, bools
    or strings), CSR pointers that start at 0, never decrease and end at the number of child ids, one string
    kind per vertex. Ids out of range, self-loops and cycles are found by :func:`make_batch`, which names
    the sample. The arrays are kept read-only (copies), so a graph stays what was checked."""

    __slots__ = ("num_vertices", "child_ptr", "child_idx", "kinds")

    def __init__(self, children: Sequence[Sequence[int]], kinds: Sequence[str] | None = None):
        if isinstance(children, (str, bytes)) or not hasattr(children, "__len__"):
            raise InputGraphError(f"InputGraph: children must be a list with one list of child ids per vertex, "
                                  f"got {type(children).__name__}")
        csr = _lists_of_ints(children)
        if csr is not None:   # the common case, checked in bulk; anything else gets the per-id checks below
            self._keep(*csr, kinds)
            return
        n = len(children)
        counts = np.zeros(n, np.int64)
        flat: list = []
        for v, ch in enumerate(children):
            if isinstance(ch, (str, bytes)) or not hasattr(ch, "__iter__"):
                raise InputGraphError(f"vertex {v}: its children must be a list of child ids, got {ch!r}")
            ch = list(ch)
            for k, x in enumerate(ch):
                if not is_integer(x):
                    raise InputGraphError(f"vertex {v}: child {k} is {show(x)}, not an integer vertex id")
                if not -_BIG <= x < _BIG:   # cannot be stored, let alone be a vertex; range: make_batch
                    raise InputGraphError(f"vertex {v}: child {k} id {x} out of range for a graph of {n} vertices")
            counts[v] = len(ch)
            flat += ch
        self._set(np.concatenate(([0], np.cumsum(counts))), np.array(flat, np.int64), kinds)

    def _set(self, child_ptr, child_idx, kinds):
        ptr = indices(child_ptr, "InputGraph: child_ptr entry", shape=(None,), error=InputGraphError)
        idx = indices(child_idx, "InputGraph: child id", shape=(None,), dtype=None, error=InputGraphError)
        down = np.flatnonzero(ptr[1:] < ptr[:-1])
        if len(ptr) == 0 or ptr[0] != 0:
            raise InputGraphError(f"InputGraph: child_ptr must start at 0, got {ptr.tolist()[:1] or 'nothing'}")
        if len(down):
            v = int(down[0])
            raise InputGraphError(f"vertex {v}: child_ptr decreases from {int(ptr[v])} to {int(ptr[v + 1])} "
                                  f"(a negative number of children)")
        if ptr[-1] != len(idx):
            raise InputGraphError(f"InputGraph: child_ptr ends at {int(ptr[-1])}, but there are {len(idx)} child ids: "
                                  f"they must be equal (every id belongs to exactly one vertex)")
        n = len(ptr) - 1
        if idx.dtype.kind == "u" and len(idx) and int(idx.max()) >= _BIG:
            e = int(np.argmax(idx >= _BIG))
            v = int(np.searchsorted(ptr, e, "right")) - 1
            raise InputGraphError(f"vertex {v}: child {e - int(ptr[v])} id {int(idx[e])} out of range for a graph "
                                  f"of {n} vertices")
        self._keep(ptr, idx.astype(np.int64), kinds)  # ids in [0, n), self-loops: make_batch, naming the sample

    def _keep(self, ptr: np.ndarray, idx: np.ndarray, kinds):
        """Keep checked int64 CSR arrays (read-only) and the kinds, once these are checked."""
        n = len(ptr) - 1
        if kinds is not None:
            if isinstance(kinds, (str, bytes)) or not hasattr(kinds, "__len__"):
                raise InputGraphError(f"InputGraph: kinds must be a list of strings, one per vertex, got {kinds!r}")
            kinds = tuple(kinds)
            if len(kinds) != n:
                raise InputGraphError(f"{len(kinds)} kinds for {n} vertices")
            for v, k in enumerate(kinds):
                if not isinstance(k, str):
                    raise InputGraphError(f"vertex {v}: kind {show(k)} is not a string (a vertex function's kind name)")
        for a in (ptr, idx):
            a.setflags(write=False)
        self.child_ptr, self.child_idx, self.num_vertices, self.kinds = ptr, idx, n, kinds

    @classmethod
    def many(cls, children_of: Sequence[Sequence[Sequence[int]]],
             kinds_of: Sequence[Sequence[str] | None] | None = None) -> list["InputGraph"]:
        """One graph per entry of ``children_of`` (with ``kinds_of[i]`` if given), checked as the constructor
        checks, but the common case (lists of Python ints) in one bulk pass over all graphs: a data set's
        graphs at load time cost ~3 µs each instead of ~25. A graph the bulk pass cannot vouch for goes
        through the constructor, whose errors name its vertex and child."""
        kinds_of = [None] * len(children_of) if kinds_of is None else kinds_of
        if len(kinds_of) != len(children_of):
            raise InputGraphError(f"InputGraph.many: {len(kinds_of)} kind lists for {len(children_of)} graphs")
        vertex_lists = list(chain.from_iterable(children_of)) \
            if set(map(type, children_of)) <= _SEQUENCES else None
        csr = _lists_of_ints(vertex_lists) if vertex_lists is not None else None
        if csr is None:
            return [cls(children, kinds) for children, kinds in zip(children_of, kinds_of)]
        ptr, idx = csr
        graphs, first = [], 0
        for children, kinds in zip(children_of, kinds_of):
            last = first + len(children)
            g = cls.__new__(cls)
            g._keep(ptr[first:last + 1] - ptr[first], idx[ptr[first]:ptr[last]], kinds)
            graphs.append(g)
            first = last
        return graphs

    @classmethod
    def from_csr(cls, child_ptr, child_idx, kinds=None) -> "InputGraph":
        """Child k of vertex v is ``child_idx[child_ptr[v] + k]``; validated as the constructor validates."""
        g = cls.__new__(cls)
        g._set(np.array(child_ptr, copy=True) if isinstance(child_ptr, np.ndarray) else child_ptr,
               np.array(child_idx, copy=True) if isinstance(child_idx, np.ndarray) else child_idx, kinds)
        return g

    @classmethod
    def chain(cls, n: int, kinds=None) -> "InputGraph":
        """Vertex i's only child is i - 1 (a sentence read left to right)."""
        ptr = np.concatenate(([0], np.arange(n, dtype=np.int64)))
        return cls.from_csr(ptr, np.arange(n - 1, dtype=np.int64), kinds)

    @classmethod
    def complete_binary_tree(cls, leaves: int) -> "InputGraph":
        """Leaves 0..L-1 first, then each level's parents; vertex v's children are consecutive (siblings
        side by side); the root is last."""
        if leaves < 1 or leaves & (leaves - 1):
            raise InputGraphError(f"complete binary tree needs a power-of-two number of leaves, got {leaves}")
        n = 2 * leaves - 1
        ptr = np.concatenate((np.zeros(leaves + 1, np.int64), 2 * np.arange(1, leaves, dtype=np.int64)))
        return cls.from_csr(ptr, np.arange(n - 1, dtype=np.int64))

    @classmethod
    def from_nested(cls, tree) -> tuple["InputGraph", list]:
        """Nested tuples/lists, e.g. ``(("a", "b"), "c")``; anything else is a leaf payload. Returns the graph
        (children before parents, root last) and the payload of each vertex (None for internal vertices)."""
        children, payloads = [], []
        stack = [(tree, False)]
        done: list = []
        while stack:  # iterative post-order: deep trees must not hit the recursion limit
            node, expanded = stack.pop()
            if isinstance(node, (list, tuple)) and not expanded:
                if not node:
                    raise InputGraphError("from_nested: an empty subtree has no vertex")
                stack.append((node, True))
                stack.extend((c, False) for c in reversed(node))
            elif isinstance(node, (list, tuple)):
                ids = [done.pop() for _ in node][::-1]
                children.append(ids)
                payloads.append(None)
                done.append(len(children) - 1)
            else:
                children.append([])
                payloads.append(node)
                done.append(len(children) - 1)
        return cls(children), payloads

    def children(self, v: int) -> np.ndarray:
        return self.child_idx[self.child_ptr[v]:self.child_ptr[v + 1]]

    def num_children(self) -> np.ndarray:
        return np.diff(self.child_ptr)

    def roots(self) -> np.ndarray:
        """Vertices that are nobody's child."""
        has_parent = np.zeros(self.num_vertices, bool)
        has_parent[self.child_idx[(self.child_idx >= 0) & (self.child_idx < self.num_vertices)]] = True
        return np.flatnonzero(~has_parent)

    def __repr__(self) -> str:
        return f"<InputGraph {self.num_vertices} vertices, {len(self.child_idx)} edges>"


@dataclass
class Batch:
    """K graphs flattened: sample k's local vertex v has global id ``offsets[k] + v``."""

    graphs: list
    num_vertices: int
    offsets: np.ndarray
    sample: np.ndarray
    local: np.ndarray
    child_ptr: np.ndarray
    child_idx: np.ndarray
    height: np.ndarray
    kind: np.ndarray
    kind_names: tuple
    _parents: tuple | None = field(default=None, repr=False)

    def num_children(self) -> np.ndarray:
        return self.child_ptr[1:] - self.child_ptr[:-1]   # (np.diff is a Python function: slower)

    def parents_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The transpose of the child CSR: parents of v are ``parent_idx[parent_ptr[v]:parent_ptr[v+1]]``."""
        if self._parents is None:
            self._parents = transpose(self.child_ptr, self.child_idx, self.num_vertices)
        return self._parents

    def with_kinds(self, kind: np.ndarray, kind_names: Sequence[str]) -> "Batch":
        kind = indices(kind, "with_kinds: kind id", size=len(kind_names), shape=(self.num_vertices,), at="vertex",
                       of=f" ({len(kind_names)} kinds, {self.num_vertices} vertices)", error=InputGraphError)
        return replace(self, kind=kind, kind_names=tuple(kind_names))

    def where(self, v: int) -> str:
        return f"sample {int(self.sample[v])}, vertex {int(self.local[v])}"


_SEQUENCES = {list, tuple}


def _lists_of_ints(children) -> tuple[np.ndarray, np.ndarray] | None:
    """(child_ptr, child_idx) when every vertex's children are a list or tuple of Python ints that fit int64,
    found by a few C-level passes (a tree's InputGraph was ~200 µs of Python per tree, most of a first epoch's
    preparation); None when anything needs the per-id checks, which name the vertex and child at fault."""
    if not set(map(type, children)) <= _SEQUENCES:
        return None
    flat = list(chain.from_iterable(children))
    if not set(map(type, flat)) <= {int}:   # (bool and numpy integers are other types: the slow path)
        return None
    try:
        idx = np.array(flat, np.int64)
    except OverflowError:
        return None
    ptr = np.zeros(len(children) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, children), np.int64, len(children)), out=ptr[1:])
    return ptr, idx


def transpose(ptr: np.ndarray, idx: np.ndarray, n: int, owner: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The transposed CSR (the parents of each vertex), one entry per edge (duplicate edges kept).
    ``owner``: the vertex of each edge, if already computed."""
    if owner is None:
        owner = np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr))
    order = np.argsort(idx, kind="stable")
    pptr = np.zeros(n + 1, np.int64)
    pptr[1:] = np.bincount(idx, minlength=n).cumsum()
    return pptr, owner[order]


def _heights(ptr, idx, n, where, parents=None) -> np.ndarray:
    """Level by level from the vertices without children (one C call when the backend provides the kernel,
    else one numpy round per level); unreached vertices lie on or above a cycle. ``parents``: the transposed
    CSR, if already computed."""
    pptr, pidx = transpose(ptr, idx, n) if parents is None else parents
    kernels = native_kernels(np, np.float64)
    if kernels is not None and n:
        height = kernels.heights(ptr, pptr, pidx)
        frontier = ()
    else:
        pending = np.diff(ptr).copy()
        height = np.full(n, -1, np.int64)
        frontier = np.flatnonzero(pending == 0)
    level = 0
    while len(frontier):
        height[frontier] = level
        starts, ends = pptr[frontier], pptr[frontier + 1]
        lens = ends - starts
        if not lens.sum():
            break
        pos = np.repeat(ends - np.cumsum(lens), lens) + np.arange(lens.sum())
        parents = pidx[pos]
        np.subtract.at(pending, parents, 1)
        cand = np.unique(parents)
        frontier = cand[pending[cand] == 0]
        level += 1
    if height.min(initial=0) < 0:
        bad = np.flatnonzero(height < 0)
        # Walk children among the unreached vertices until one repeats: that vertex is on a cycle.
        v, seen = int(bad[0]), set()
        unreached = height < 0
        while v not in seen:
            seen.add(v)
            ch = idx[ptr[v]:ptr[v + 1]]
            v = int(ch[unreached[ch]][0])
        raise InputGraphError(f"{where(v)}: lies on a cycle")
    return height


def make_batch(graphs: Sequence[InputGraph], kind_names: Sequence[str] | None = None,
               max_arity: int | Mapping[str, int] | None = None, default_kind: str = "vertex") -> Batch:
    """Flatten and validate K graphs; errors name the sample and the vertex. (Its numpy calls, not the
    vertices, are the cost of a small batch: one graph takes the short way, without concatenations.)"""
    graphs = list(graphs)
    if not graphs:
        raise InputGraphError("empty batch: no input graphs")
    if len(graphs) == 1:
        g = graphs[0]
        n = g.num_vertices
        if n == 0:
            raise InputGraphError("sample 0: empty graph (no vertices)")
        sizes = np.array([n], np.int64)
        offsets = np.array([0, n], np.int64)
        sample = np.zeros(n, np.int64)
        local = np.arange(n, dtype=np.int64)
        child_ptr, local_idx = g.child_ptr, g.child_idx   # validated int64, read-only
        counts = child_ptr[1:] - child_ptr[:-1]
        owner = None
    else:
        sizes = np.fromiter((g.num_vertices for g in graphs), np.int64, len(graphs))
        for k in np.flatnonzero(sizes == 0):
            raise InputGraphError(f"sample {int(k)}: empty graph (no vertices)")
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        n = int(offsets[-1])
        sample = np.repeat(np.arange(len(graphs), dtype=np.int64), sizes)
        local = np.arange(n, dtype=np.int64) - offsets[sample]
        edges = np.fromiter((len(g.child_idx) for g in graphs), np.int64, len(graphs))
        local_idx = np.concatenate([g.child_idx for g in graphs])
        owner = np.repeat(np.arange(len(graphs), dtype=np.int64), edges)  # sample of each edge
        counts = np.concatenate([np.diff(g.child_ptr) for g in graphs])
        child_ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    parent = np.repeat(local, counts) if owner is None else np.repeat(np.arange(n, dtype=np.int64), counts)
    limit = sizes[0] if owner is None else sizes[owner]
    if len(local_idx) and (local_idx.min() < 0 or (local_idx >= limit).any()):
        bad = np.flatnonzero((local_idx < 0) | (local_idx >= limit))
        e = int(bad[0])
        s = 0 if owner is None else int(owner[e])
        raise InputGraphError(f"sample {s}, vertex {int(local[parent[e]])}: child index "
                              f"{int(local_idx[e])} out of range for a graph of {int(sizes[s])} vertices")
    child_idx = local_idx if owner is None else local_idx + offsets[owner]
    selfloop = child_idx == parent
    if selfloop.any():
        v = int(parent[np.flatnonzero(selfloop)[0]])
        raise InputGraphError(f"sample {int(sample[v])}, vertex {int(local[v])}: lists itself as a child "
                              "(a cycle)")

    def where(v):
        return f"sample {int(sample[v])}, vertex {int(local[v])}"

    parents = transpose(child_ptr, child_idx, n, owner=parent)
    height = _heights(child_ptr, child_idx, n, where, parents)
    kind, names = _kinds(graphs, sizes, kind_names, default_kind)
    batch = Batch(graphs, n, offsets, sample, local, child_ptr, child_idx, height, kind, names, parents)
    if max_arity is not None:
        check_arity(batch, max_arity)
    return batch


def _kinds(graphs, sizes, kind_names, default_kind):
    if all(g.kinds is None for g in graphs):
        names = tuple(kind_names) if kind_names else (default_kind,)
        if default_kind not in names:
            raise InputGraphError(f"default kind '{default_kind}' is not among the kinds {names}")
        return np.full(int(sizes.sum()), names.index(default_kind), np.int64), names
    labels = [g.kinds if g.kinds is not None else (default_kind,) * g.num_vertices for g in graphs]
    names = tuple(kind_names) if kind_names else tuple(sorted({x for lab in labels for x in lab}))
    lookup = {k: i for i, k in enumerate(names)}
    out = np.empty(int(sizes.sum()), np.int64)
    pos = 0
    for s, lab in enumerate(labels):
        for v, k in enumerate(lab):
            if k not in lookup:
                raise InputGraphError(f"sample {s}, vertex {v}: unknown kind {k!r} (known: {list(names)})")
        out[pos:pos + len(lab)] = [lookup[k] for k in lab]
        pos += len(lab)
    return out, names


def check_arity(batch: Batch, max_arity: int | Mapping[str, int]) -> None:
    """More children than a kind's vertex function can gather is an error naming the vertex."""
    nch = batch.num_children()
    if isinstance(max_arity, Mapping):
        limit = np.array([max_arity.get(k, np.iinfo(np.int64).max) for k in batch.kind_names], np.int64)
        limit = limit[batch.kind]
    else:
        limit = np.full(batch.num_vertices, int(max_arity), np.int64)
    over = np.flatnonzero(nch > limit)
    if len(over):
        v = int(over[0])
        raise InputGraphError(f"{batch.where(v)}: {int(nch[v])} children, more than the arity "
                              f"{int(limit[v])} of vertex function '{batch.kind_names[batch.kind[v]]}'")
