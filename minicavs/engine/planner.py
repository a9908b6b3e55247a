"""A batch's preparation in one C call (codegen/planner_source.py): the :class:`~minicavs.runtime.inputs.Batch`, the
cavs :class:`~minicavs.runtime.scheduler.Schedule` and the :class:`~minicavs.runtime.memory.MemoryPlan` that the
reference path (make_batch, Structure.batch, CavsPolicy.schedule, plan_memory: ~70 numpy calls) builds, equal array
for array (tests/engine/test_planner.py), as views of one int64 buffer.

It covers the usual case: graphs without per-graph kinds, kinds from the only vertex function or the
leaf/internal rule (:func:`minicavs.engine.model.by_child_count`), gathers that read every kind. Anything else, no C
compiler, or an input that some check refuses gives None, and the caller runs the reference, which explains
the error (naming the sample and the vertex).

What it makes is host index arrays that a run on any device reads, so it is no backend's code: it stands beside
the seam, as reference.py does. Its C library is built by the host's C toolchain, which the CPU backend holds:
minicavs/cpu/planner_library.py compiles and loads it and provides it through the seam
(``backend.provide_planner``, when ``minicavs`` is imported), as the CPU's frontier kernel is provided to
:mod:`minicavs.runtime.frontier`."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.inputs import Batch, InputGraph
from ..runtime.memory import KindPlan, MemoryPlan
from ..runtime.scheduler import Schedule
from .backend import planner_library
from .codegen.planner_source import OUTPUTS, capacity


@dataclass(frozen=True)
class Spec:
    """What a structure tells the planner (fixed per structure): kind names, how kinds are assigned (mode 0:
    the only function; 1: ``leaf`` without children, ``internal`` with), each kind's arity, and the pull and
    push names with the kinds using each (one row of ``uses`` per name, pulls then pushes, each sorted)."""

    kind_names: tuple
    mode: int
    leaf: int
    internal: int
    arity: np.ndarray          # (n_kinds,) int64
    pulls: tuple
    pushes: tuple
    uses: np.ndarray           # (len(pulls) + len(pushes), n_kinds) uint8

    def __post_init__(self):
        n_kinds = len(self.kind_names)
        ints = np.array([self.mode, self.leaf, self.internal, n_kinds, int(self.arity.max()), len(self.uses),
                         *self.arity.tolist()], np.int64)
        object.__setattr__(self, "ints", ints)   # what the C call reads (kept alive with the spec)
        object.__setattr__(self, "layout", (n_kinds, int(self.arity.max()), len(self.uses), self.arity.tolist(),
                                            np.ascontiguousarray(self.uses.T).tolist()))


def library():
    """The planner library a backend provided (backend.provide_planner): (ffi, library, int64_t[], unsigned char[],
    uint64_t[]), or None (no provider, no C compiler: the reference path plans)."""
    return planner_library()


def _int64(a) -> bool:
    return type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1 and a.flags.c_contiguous


def prepare(graphs: list, spec: Spec, sample_ids: np.ndarray | None = None) -> tuple[Batch, MemoryPlan] | None:
    """The batch and memory plan of ``graphs`` (a cavs schedule), or None where the reference must run."""
    built = library()
    if built is None or not graphs:
        return None
    inputs = _inputs(graphs, sample_ids)
    if inputs is None:
        return None
    buf = _plan_in_c(built, graphs, spec, *inputs)
    if buf is None:
        return None
    n, K = len(inputs[0]) - len(graphs), len(graphs)
    bounds = buf[2 * K:2 * K + OUTPUTS + 1].tolist()
    return _unpack(graphs, spec, n, [buf[a:b] for a, b in zip(bounds, bounds[1:])])


def _inputs(graphs: list, sample_ids) -> tuple | None:
    """(child_ptr, child_idx, sample ids) of all graphs, as the C call reads them; None where it cannot."""
    for g in graphs:
        if type(g) is not InputGraph or g.kinds is not None:
            return None
    if len(graphs) == 1:
        ptr_all, idx_all = graphs[0].child_ptr, graphs[0].child_idx
    else:
        ptr_all = np.concatenate([g.child_ptr for g in graphs])
        idx_all = np.concatenate([g.child_idx for g in graphs])
    if not (_int64(ptr_all) and _int64(idx_all)) or len(ptr_all) - len(graphs) < 1:
        return None
    ids = None
    if sample_ids is not None:
        ids = np.ascontiguousarray(sample_ids).astype(np.uint64)
        if ids.shape != (len(graphs),):
            return None
    return ptr_all, idx_all, ids


def _plan_in_c(built: tuple, graphs: list, spec: Spec, ptr_all, idx_all, ids) -> np.ndarray | None:
    """The C call's buffer (the sizes, then the bounds of its parts, then the parts), or None where it refused."""
    ffi, lib, I64, U8, U64 = built
    K = len(graphs)
    n, E = len(ptr_all) - K, len(idx_all)
    n_kinds, maxa, nnames, _, _ = spec.layout
    buf = np.empty(capacity(K, n, E, n_kinds, maxa, nnames), np.int64)
    if K == 1:
        buf[0], buf[1] = n, E
    else:   # (sizes from the arrays' own lengths: what C is handed is what it checks)
        buf[:K] = [len(g.child_ptr) - 1 for g in graphs]
        buf[K:2 * K] = [len(g.child_idx) for g in graphs]
    rc = lib.mc_prepare(K, n, E, ffi.from_buffer(I64, ptr_all), ffi.from_buffer(I64, idx_all) if E else ffi.NULL,
                        ffi.from_buffer(I64, spec.ints), ffi.from_buffer(U8, spec.uses) if nnames else ffi.NULL,
                        ffi.NULL if ids is None else ffi.from_buffer(U64, ids), ffi.from_buffer(I64, buf), len(buf))
    return None if rc else buf


def _unpack(graphs: list, spec: Spec, n: int, parts: list) -> tuple[Batch, MemoryPlan]:
    """The batch and memory plan as views of the C call's parts (in its order: codegen/planner_source.py; unpacked
    into names, not read as a named tuple's fields: a batch of one is planned in microseconds)."""
    (offsets, sample, local, child_ptr, child_idx, pptr, pidx, height, kind, order, row, task_ptr, tasks, kind_n,
     kind_t, verts, task_of_kind, task_off, child_rows, views, keys, name_rows, name_order, name_count,
     scalars, ttable, gcopy) = parts
    n_kinds, maxa, _, arity, _ = spec.layout
    T, forest, _ = scalars.tolist()
    task_array = tasks[:4 * T].reshape(T, 4)
    batch = Batch(graphs, n, offsets, sample, local, child_ptr, child_idx, height, kind, spec.kind_names,
                  (pptr, pidx))
    schedule = Schedule(order, task_ptr[:T + 1], task_array[:, 0], row)
    name_count = name_count.tolist()
    npull = len(spec.pulls)
    pull_rows = {name: name_count[m] for m, name in enumerate(spec.pulls)}
    push_order = {name: name_order[(npull + m) * n:(npull + m) * n + name_count[npull + m]]
                  for m, name in enumerate(spec.pushes)}
    kinds = _kind_plans(spec, n, kind_n.tolist(), kind_t.tolist(),
                        (verts, task_of_kind, task_off, child_rows, views, keys, name_rows))
    plan = MemoryPlan(schedule, n, task_array, kinds, pull_rows, push_order, bool(forest),
                      ttable[:T * (5 + 2 * maxa)].reshape(T, 5 + 2 * maxa), gcopy.reshape(n_kinds, maxa),
                      tuple(arity))
    return batch, plan


def _kind_plans(spec: Spec, n: int, kind_n: list, kind_t: list, parts: tuple) -> list:
    """Each kind's plan (None for a kind without vertices): its vertices, tasks, views and rows."""
    verts, task_of_kind, task_off, child_rows, views, keys, name_rows = parts
    n_kinds, _, _, arity, uses_by_kind = spec.layout
    keys = keys.view(np.uint64)
    npull = len(spec.pulls)
    kinds: list = [None] * n_kinds
    v0 = t0 = c0 = w0 = 0
    for kind_id, nv, nt in zip(range(n_kinds), kind_n, kind_t):
        a = arity[kind_id]
        if nv:
            table = views[w0:w0 + 2 * a * nt].reshape(nt, 2 * a)
            kind_plan = KindPlan(spec.kind_names[kind_id], kind_id, verts[v0:v0 + nv], row_keys=keys[v0:v0 + nv],
                                 task_offsets=task_off[t0:t0 + nt], tasks=task_of_kind[t0:t0 + nt],
                                 view_table=table,
                                 child_rows=[child_rows[c0 + j * nv:c0 + (j + 1) * nv] for j in range(a)])
            for m, use in enumerate(uses_by_kind[kind_id]):
                if use:
                    rows = name_rows[m * n + v0:m * n + v0 + nv]
                    if m < npull:
                        kind_plan.pull_rows[spec.pulls[m]] = rows
                    else:
                        kind_plan.push_rows[spec.pushes[m - npull]] = rows
            kinds[kind_id] = kind_plan
        v0, t0, c0, w0 = v0 + nv, t0 + nt, c0 + a * nv, w0 + 2 * a * nt
    return kinds
