"""The frontier policies' schedule in one C call (codegen/frontier_source.py's source, compiled and cached like the
other kernels): the inputs checked here, so that nothing out of range reaches C; None without a C
compiler (then minicavs/runtime/frontier.py's numpy run is used, which also stays the reference the tests compare
with)."""
from __future__ import annotations

import functools
import os

import numpy as np

from ..engine.codegen.frontier_source import (DECLS, ERR_CHOICE, ERR_STUCK, HASH_MULTIPLIER, RULES, SOURCE,
                                              scratch_size, state_key)
from . import compiler as cgen

MAX_FSM_TYPES = 14     # an FSM state's key, sum_i (s_i + 1) (T + 1)^i over up to T + 1 entries, fits 63 bits
MASK64 = (1 << 64) - 1


class FsmTable:
    """An FSM's state -> type table as C reads it: open addressing over the states' keys."""

    def __init__(self, best: dict, num_types: int):
        if not 1 <= num_types <= MAX_FSM_TYPES:
            raise ValueError(f"an FSM table in C holds 1 to {MAX_FSM_TYPES} types, not {num_types}")
        bits = max(1, (2 * len(best)).bit_length())      # at least twice the states: an empty slot is left
        self.bits, self.num_types = bits, num_types
        self.keys = np.zeros(1 << bits, np.uint64)
        self.best = np.full(1 << bits, -1, np.int64)
        for state, t in best.items():
            if not state or not all(0 <= s < num_types for s in state) or len(state) > num_types + 1 \
                    or not 0 <= t < num_types:
                raise ValueError(f"FSM state {state} -> type {t}: not a state of {num_types} types")
            key = state_key(state, num_types)
            i = ((key * HASH_MULTIPLIER) & MASK64) >> (64 - bits)
            while self.keys[i] and self.keys[i] != key:
                i = (i + 1) & ((1 << bits) - 1)
            self.keys[i], self.best[i] = key, t


class FrontierKernel:
    """``schedule(...)``: (task of every vertex, type of every task) under one rule, in one C call."""

    max_fsm_types = MAX_FSM_TYPES

    def __init__(self, lib, ffi):
        self.lib, self.ffi = lib, ffi

    @staticmethod
    def table(best: dict, num_types: int) -> "FsmTable":
        """An FSM's state -> type dict in the form :meth:`schedule` reads."""
        return FsmTable(best, num_types)

    def _p(self, a: np.ndarray):
        return self.ffi.from_buffer("unsigned long long[]" if a.dtype == np.uint64 else "long[]", a)

    def schedule(self, rule: str, child_ptr: np.ndarray, child_idx: np.ndarray, kind: np.ndarray,
                 num_types: int, height: np.ndarray | None = None, table: FsmTable | None = None,
                 typewise: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``rule``: ``S1``/``S2``/``S3`` (with ``table``), ``agenda`` (with ``height``) or ``greedy`` (with
        ``typewise`` = (count, parents ptr, parents idx) of G[t]). Raises ValueError on inconsistent input
        and RuntimeError on a cycle (vertices left, none ready)."""
        if rule not in RULES:
            raise ValueError(f"unknown frontier rule {rule!r}; known: {sorted(RULES)}")
        n = len(kind)
        kind = _index_array(kind, "kind", n, 0, num_types)
        child_ptr, child_idx = _csr(child_ptr, child_idx, n, "children")
        none = self.ffi.NULL
        args_height = args_table = args_tw = (none,)
        if rule == "agenda":
            if height is None:
                raise ValueError("the agenda rule needs the vertices' heights")
            height = _index_array(height, "height", n, 0, n)
            args_height = (self._p(height),) if n else (none,)
        if rule in ("S1", "S2", "S3"):
            if not isinstance(table, FsmTable) or table.num_types != num_types:
                raise ValueError(f"an FSM rule needs an FsmTable of {num_types} types")
            args_table = (table.bits, self._p(table.keys), self._p(table.best))
        else:
            args_table = (1, none, none)
        if rule == "greedy":
            if typewise is None:
                raise ValueError("the greedy rule needs the typewise counts and parents")
            count, pptr, pidx = typewise
            count = _index_array(count, "typewise child count", n, 0, max(n, 1))
            pptr, pidx = _csr(pptr, pidx, n, "typewise parents")
            args_tw = tuple(self._p(a) if len(a) else none for a in (count, pptr, pidx))
        else:
            args_tw = (none, none, none)
        scratch = np.empty(scratch_size(n, len(child_idx), num_types), np.int64)
        task = np.empty(max(n, 1), np.int64)
        task_kind = np.empty(max(n, 1), np.int64)
        got = self.lib.frontier_schedule(
            n, num_types, RULES[rule], self._p(child_ptr), self._p(child_idx) if len(child_idx) else none,
            self._p(kind) if n else none, *args_height, *args_table, *args_tw, self._p(scratch),
            self._p(task), self._p(task_kind))
        if got == ERR_STUCK:
            raise RuntimeError("frontier schedule: vertices are left but none is ready (the graph has a cycle)")
        if got == ERR_CHOICE:
            raise RuntimeError("frontier schedule: the FSM table chose a type with no ready vertex")
        if got < 0:
            raise RuntimeError(f"frontier schedule failed (code {got})")
        return task[:n], task_kind[:got].copy()


    def typewise(self, child_ptr: np.ndarray, child_idx: np.ndarray, kind: np.ndarray,
                 num_types: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ED-Batch's G[t] for every type: (typewise child count, typewise parents ptr, idx) of every vertex,
        as :meth:`minicavs.runtime.frontier.TypedGraph.typewise` (parents in another order)."""
        n = len(kind)
        kind = _index_array(kind, "kind", n, 0, num_types)
        child_ptr, child_idx = _csr(child_ptr, child_idx, n, "children")
        none = self.ffi.NULL
        count, ptr = np.empty(max(n, 1), np.int64), np.empty(n + 1, np.int64)
        cap = max(2 * n, 16)
        while True:
            idx = np.empty(cap, np.int64)
            got = self.lib.frontier_typewise(n, self._p(child_ptr), self._p(child_idx) if len(child_idx) else none,
                                             self._p(kind) if n else none, cap, self._p(count), self._p(ptr),
                                             self._p(idx))
            if got == ERR_STUCK:
                raise RuntimeError("typewise graph: vertices are left but none is ready (the graph has a cycle)")
            if got < 0:
                raise MemoryError(f"typewise graph of {n} vertices: out of memory")
            if got <= cap:
                return count[:n], ptr, idx[:got]
            cap = got


def _index_array(a, what: str, n: int, lo: int, hi: int) -> np.ndarray:
    """``a`` as C-contiguous int64 of length ``n`` with every value in [lo, hi)."""
    a = np.ascontiguousarray(a, np.int64) if getattr(a, "dtype", None) != np.int64 or not a.flags.c_contiguous \
        else a
    if a.ndim != 1 or len(a) != n:
        raise ValueError(f"frontier schedule: {what} must be ({n},), got {a.shape}")
    if n and (int(a.min()) < lo or int(a.max()) >= hi):
        raise ValueError(f"frontier schedule: {what} values must lie in [{lo}, {hi})")
    return a


def _csr(ptr, idx, n: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """A CSR of ``n`` rows over ``n`` vertices, checked: ptr starts at 0, never decreases and ends at len(idx);
    every entry in [0, n)."""
    ptr = np.ascontiguousarray(ptr, np.int64)
    if ptr.ndim != 1 or len(ptr) != n + 1 or ptr[0] != 0:
        raise ValueError(f"frontier schedule: {what} ptr must be ({n + 1},) starting at 0")
    idx = _index_array(idx, f"{what} idx", int(ptr[-1]) if int(ptr[-1]) >= 0 else -1, 0, n)
    if n and bool((ptr[1:] < ptr[:-1]).any()):
        raise ValueError(f"frontier schedule: {what} ptr must never decrease")
    return ptr, idx


def frontier_kernel() -> FrontierKernel | None:
    """The compiled schedule, or None without a C compiler (cached per ``CC`` setting, as library.py's)."""
    return _frontier_kernel(os.environ.get("CC"))


@functools.lru_cache(maxsize=None)
def _frontier_kernel(cc_setting: str | None) -> FrontierKernel | None:
    import cffi
    cc = cgen.compiler()
    if cc is None:
        return None
    ffi = cffi.FFI()
    ffi.cdef(DECLS)
    return FrontierKernel(ffi.dlopen(str(cgen.compiled(SOURCE, cc, "frontier"))), ffi)
