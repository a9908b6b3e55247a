"""The C runner of a lowered batch program (instructions.py): the buffer table the C runner reads
(codegen/machine.py's interpreter, compiled by :mod:`.interpreter`), kept from run to run, and the one C call that
runs a pass's blocks and tasks. The CPU backend's ``run``. Streaming, a second call runs the eager
stream's table (program.eager_rows) on the CPU's eager thread, and the main call's task t waits for its
chunk t (codegen/machine.py: an atomic counter).

Addresses come from cffi's ``from_buffer`` (numpy's ``ctypes.data`` costs microseconds a call); statics read
as transposed views are copied once per run when multi-row tasks read them enough, and wide statics get a
transposed twin for few-row products (the constants below say when and why).
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from ..core.errors import CheckError
from ..engine.codegen.machine import OPS as OPCODES_IDS
from ..engine.codegen.packed_gemm import PACKED_SMALL
from . import interpreter as c_interpreter
from .library import library


class CRunnerCheckError(CheckError):
    """The C runner's bounds check (debug mode, in its interpreter) caught an instruction addressing outside its
    buffer."""


def available(dtype) -> str | None:
    """Why the C runner cannot run ``dtype`` here (None: it can)."""
    if c_interpreter.interpreter(dtype) is None:
        return "no compiler or BLAS"
    return None


# the one opcode the C switch has no case for (its default case fails it): the runner declines a program with it
APPLY = OPCODES_IDS["APPLY"]
# the C runner's per-program state, kept here (not on the program), each keyed weakly by the lowered program:
_POINTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # its code, pool, ranges, kernels' addresses
_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()     # its BufferTable (taken during a run)


def declines(program) -> str | None:
    """Why the C runner leaves ``program`` to the reference runner (None: it runs it): no compiler or BLAS
    here, or an opcode or register count no C loop runs (Lowered.c_refusal)."""
    return available(program.dtype) or program.lowered.c_refusal


def _transposed(copier, span: np.ndarray, rows: int, cols: int, ld: int) -> np.ndarray:
    """The C-contiguous transpose (cols x rows) of the rows x cols matrix at ``span`` with row stride ``ld``,
    in the library's cache-sized tiles."""
    out = np.empty((cols, rows), copier.dtype)
    if out.size:
        copier._fn["transpose"](rows, cols, copier._p(span), ld, copier._p(out))
    return out


# rows of multi-row tasks from which a run copies its transposed statics (see run): Tree-LSTM h128 training
# (1 BLAS thread, medians of 9 alternating runs) lost ~10% to the copies at batch 1 (~19 such rows per step)
# and gained ~15% from them at batch 4 (~76)
CONTIGUOUS_STATICS_ROWS = 48
# A GEMM of at most this many rows by a static B at least twice as wide as deep (an LSTM's h·W_h, 4H x H) runs
# as C^T = B^T·A^T on the static's transposed copy: OpenBLAS (1 thread, CPU time, this machine) took 0.55-0.8x
# the time of C = A·B for 2-32 rows of 512 x 2048 and 256 x 1024, 0.9-0.98x at 1024 x 4096; at 64 rows about
# the same. Deeper-than-wide products (∂F's dgates·W_hᵀ) gained little or lost, so they keep the plain call.
SMALL_M_ROWS = 32
# Also a static at least twice as deep as wide and this large (∂F's W_hᵀ, 2048 x 512: 8-22% less time at 2-32
# rows; Fixed-LSTM h512 b16 step -1.8%); smaller ones (256 x 1024) lost. Near-square statics (a Tree-LSTM's U,
# 2H x 3H) get no twin: with one, Tree-LSTM h512 b64 steps took 2.8% longer.
TWIN_ELEMENTS = 1 << 20
# A read-only static (ParameterSet.read_only: a loaded model's parameters) keeps its transposed copies from run
# to run, so they cost nothing per batch: then a near-square one this large gets a twin too (a Tree-LSTM h512's
# U, 1024 x 1536: 0.45-0.6x the time at 2-32 rows, 1 BLAS thread, SkylakeX kernel), and few-row runs use them.
_KEPT: dict = {}   # id of a root array -> (a weak reference to it, {(what, where): its copy}); gone with the array


def _read_only_root(a: np.ndarray) -> np.ndarray | None:
    """The array owning ``a``'s memory when ``a`` and every array it views are read-only (nothing writes them
    without first making them writeable again: what ParameterSet.read_only promises), else None."""
    while a.flags.writeable is False:
        base = a.base
        if base is None:
            return a
        if not isinstance(base, np.ndarray):
            return None
        a = base
    return None


def _read_only(a) -> bool:
    return isinstance(a, np.ndarray) and _read_only_root(a) is not None


def _forget(ident: int, dead: weakref.ref) -> None:
    if _KEPT.get(ident, (None,))[0] is dead:
        del _KEPT[ident]


def _kept(a: np.ndarray, what: tuple, make) -> np.ndarray:
    """``make()``, a copy of ``a`` (``what`` says which), kept while ``a``'s memory lives when ``a`` is read-only."""
    root = _read_only_root(a)
    if root is None:
        return make()
    ref, copies = _KEPT.get(id(root), (None, None))
    if ref is None or ref() is not root:   # (ndarrays are not hashable: kept by id, checked by a weak reference)
        ident = id(root)
        ref, copies = weakref.ref(root, lambda dead: _forget(ident, dead)), {}
        _KEPT[ident] = (ref, copies)
    key = (*what, a.__array_interface__["data"][0], a.shape, a.strides)
    copy = copies.get(key)
    if copy is None:
        copy = copies[key] = make()
        copy.flags.writeable = False
    return copy
# rows of multi-row tasks from which a run packs the statics its products read (codegen/packed_gemm.py): Tree-LSTM
# h128 inference one tree at a time took 5% longer packing from 48 or 128 rows on, the same from 256 (4 processes
# each, CPU time a tree); batches of 16 trees took 13% less than without packing, of 4 and 8 trees 2-5% more than
# from 128 rows (within the noise); a batch of 64 SST trees has ~1,350 such rows
PACKED_STATICS_ROWS = 256

class BufferTable:
    """A program's buffer table (per buffer: base address, elements, row stride, transposed flag, twin's
    address; one int64 array the interpreter reads) kept from one run to the next, so that a batch re-addresses
    only the buffers that are new. An entry of a persistent buffer (PERSISTENT) is reused only for the very same
    array object, alive, with the same shape and strides; anything else (a parameter array replaced, a workspace
    buffer grown) is addressed again. A batch's own arrays (index arrays, pull and push buffers, gradients) are
    addressed every run and zeroed after it. Arrays are held weakly between runs (strongly, by the run, during
    one): a freed array is never mistaken for another at its address, and a program that has not run since a
    workspace buffer grew does not keep the outgrown buffer alive (with one table per linked program, each
    held a generation of them). A run takes the table off its program and puts it back only when
    the call returned cleanly, so a failed run, or a second thread running the same program, starts from an
    empty table."""

    __slots__ = ("ffi", "n", "info", "slots", "twin_slots", "row", "values", "held", "layouts", "last", "err",
                 "err_ptr", "persistent", "transient", "packs", "calls")

    def __init__(self, ffi, n: int, kinds: list):
        self.ffi, self.n = ffi, n
        # rows: address, elements, row stride, transposed flag, twin's address, packed copy's address, its k, n
        self.info = np.zeros((8, n), np.int64)
        self.slots = ffi.cast("void **", ffi.from_buffer(self.info))
        self.twin_slots = ffi.cast("void **", ffi.from_buffer(self.info[4]))
        self.row = ffi.cast("const int64_t *", self.slots)
        # info through a pointer: an entry's row r at values[r * n + i] (a numpy item or fancy assignment costs
        # microseconds from a cache the C call has just filled with its own data)
        self.values = ffi.cast("int64_t *", self.slots)
        self.held: list = [None] * n     # a weak reference to the array each persistent entry addresses
        self.layouts: list = [None] * n  # its (shape, strides) when addressed
        # a weak reference to the operand each entry was bound from, while nothing about the entry can have
        # changed since (the binder hands the very same operand again: a kept tensor, arena or static)
        self.last: list = [None] * n
        self.persistent = [kind in PERSISTENT for kind in kinds]
        self.transient = [i for i, kind in enumerate(kinds) if kind not in PERSISTENT]
        self.err = np.zeros(4, np.int64)   # where C reports a failed check (the table is dropped after one)
        self.err_ptr = ffi.from_buffer("int64_t[]", self.err)
        self.packs: dict = {}   # entry -> the array its static is packed into (kept: refilled every run)
        self.calls: dict = {}   # entry -> its packing call's arguments, kept with the array they read (_Entries.pack)

    def write(self, i: int, elements: int, ld: int, flag: int) -> None:
        """Entry ``i``'s elements, row stride and transposed flag (its address: through ``slots``)."""
        values, n = self.values, self.n
        values[n + i], values[2 * n + i], values[3 * n + i] = elements, ld, flag

    def clear(self, i: int) -> None:
        values, n = self.values, self.n
        values[i] = values[n + i] = values[2 * n + i] = values[3 * n + i] = values[4 * n + i] = 0
        values[5 * n + i] = values[6 * n + i] = values[7 * n + i] = 0
        self.held[i] = self.layouts[i] = self.last[i] = None

    def release(self, copied: list) -> None:
        """Forget the batch's own entries and the statics copied for one run (zero addresses: an entry is only
        ever read by C after a run bound it again)."""
        values, n = self.values, self.n
        for i in self.transient:
            values[i] = values[n + i] = values[2 * n + i] = values[3 * n + i] = 0
        for i in copied:
            self.clear(i)


# the task rows for which a static may get a transposed twin (SMALL_M_ROWS)
_FEW_ROWS = frozenset(range(2, SMALL_M_ROWS + 1))
# buffer keys whose arrays outlive a batch: the workspace's buffers, the statics (parameters, mostly)
PERSISTENT = ("tensor", "btensor", "scatter", "sgrad", "fixed", "scratch", "static")


def run(program, clock: np.ndarray | None = None) -> None:
    """Run the bound ``program``'s blocks and tasks in one C call, over its operands, adding into its
    accumulators. The buffer table keeps the addresses of arrays the last run saw (:class:`BufferTable`).
    Streaming, a second call runs the eager stream's table on the CPU's eager thread while this one runs the
    table, row t of which waits until eager chunk t is done (:func:`_eager_call`). ``clock``: an int64 array (one
    entry per opcode, and in all, last) the call adds each opcode's nanoseconds into (the device's
    ``opcode_clock``)."""
    lowered, table, eager = program.lowered, program.table, program.eager
    ex = c_interpreter.interpreter(program.dtype)
    ffi = ex.ffi
    n = len(program.operands)
    bound = _TABLES.pop(lowered, None)   # (taken: a run that fails leaves none behind)
    if bound is None or bound.ffi is not ffi:
        bound = BufferTable(ffi, n, program.bound.kinds)
    rows = table[:, 2].tolist()
    max_bs = max(rows, default=0)
    streaming = eager is not None and len(eager) > 0
    multi = _multi_rows(program, rows) * _product_repeats(lowered) if max_bs > 1 else 0
    lib = library(program.dtype) if max_bs > 1 else None
    entries = _bind_entries(program, bound, ex, lib if multi >= CONTIGUOUS_STATICS_ROWS else None,
                            multi >= PACKED_STATICS_ROWS, lib, not _FEW_ROWS.isdisjoint(rows))
    twin_cols = entries.twin_cols
    tmp_rows = _twin_rows(program, max_bs, twin_cols)
    scratch = program.bound.scratch
    clock_ptr = ffi.NULL if clock is None else ex.ptr(clock)
    p = ex.ptr
    pointers = _POINTERS.get(lowered)
    if pointers is None:   # the program's own arrays: fixed, so their addresses are taken once
        pointers = _POINTERS[lowered] = (p(lowered.code), p(lowered.pool), p(lowered.ranges), p(lowered.kernels))
    code, pool, ranges, kernels = pointers
    row = bound.row
    check = int(program.check)   # (the debug mode: every operand bounds-checked, a failure reported, not a crash)
    if streaming:
        sync = np.zeros(2, np.int64)   # chunks the eager call has finished; whether it failed
        done, eager_err = _eager_call(ex, program, bound, sync, twin_cols, check)
        stream = (p(sync), 1, len(eager))
    else:
        stream = (ffi.NULL, 0, 0)
    try:
        rc = ex.run(code, pool, ranges, len(lowered.ranges), p(table), len(table),
                    table.shape[1], row, row + n, row + 2 * n, row + 3 * n, n, n - 1, max_bs, lowered.nregs,
                    kernels, len(lowered.kernels), ex.gemm, ex.gemv, int(ex.ilp64), int(program.forest), check,
                    bound.err_ptr, clock_ptr, row + 4 * n, row + 5 * n, scratch, tmp_rows, twin_cols, *stream)
    finally:
        if streaming:
            done.wait()   # (the eager call's buffers stay alive, and its failure is reported, before we return)
    if streaming and eager_err[0]:
        _raise_check(lowered, eager_err, "eager stream ")
    if rc:
        _raise_check(lowered, bound.err)
    _release(bound, entries)
    _TABLES[lowered] = bound


def _bind_entries(program, bound: BufferTable, ex, copier, pack: bool = False, spare=None,
                  few_rows: bool = True) -> _Entries:
    """Every operand of the bound program into the buffer table (a static through its copies, when
    ``copier`` makes them, or ``spare`` for a read-only one's kept copies; packed when ``pack``); an entry no run
    of this program uses now holds no address. ``few_rows``: the run has tasks of 2 to SMALL_M_ROWS rows, the
    only products a transposed twin serves (without them none is made: a static program's 64 rows, 7 loop
    steps, made four twins a step that no product read)."""
    read_as_b = _product_statics(program.lowered)
    entries = _Entries(bound, ex, copier, read_as_b if pack and copier and ex.packed_nr else (), spare,
                       read_as_b if few_rows else frozenset())
    task_keys = program.lowered.task_keys
    last, persistent, slots, from_buffer = bound.last, bound.persistent, bound.slots, ex.ffi.from_buffer
    values, n = bound.values, bound.n
    n2, n3 = 2 * n, 3 * n
    for i, operand in enumerate(program.operands):
        if operand is None:   # (a block's own buffer, and no block runs: no address may stay)
            if bound.held[i] is not None:
                bound.clear(i)
        elif not persistent[i]:   # (a batch's own array: addressed every run, zeroed after it)
            slots[i] = from_buffer(operand.array)
            values[n + i], values[n2 + i], values[n3 + i] = operand.elements, operand.ld, operand.transposed
        elif last[i] is None or last[i]() is not operand or (operand.kind == "static" and entries.per_run(i, operand)
                                                             and (copier is not None or spare is not None
                                                                  and _read_only(operand.source))):
            # (else the entry as the last run left it: a static's copies, twins and packs are addressed per run)
            if operand.kind == "static":
                entries.static(i, operand, task_keys is None or i < task_keys)
            else:
                entries.bind(i, operand.array, operand.elements, operand.ld, operand.transposed)
            last[i] = weakref.ref(operand)
    return entries


def _twin_rows(program, max_bs: int, twin_cols: int) -> int:
    """Rows of the transposed-product buffer past the scratch (0: no twin read), checked to fit the arena."""
    tmp_rows = min(max_bs, SMALL_M_ROWS) if twin_cols else 0
    scratch, arena = program.bound.scratch, program.operands[-1].elements
    if tmp_rows * twin_cols and scratch + tmp_rows * twin_cols > arena:
        raise ValueError(f"C runner: {tmp_rows} x {twin_cols} transposed-product elements past a scratch of "
                         f"{scratch} in an arena of {arena}")
    return tmp_rows


def _release(bound: BufferTable, entries: _Entries) -> None:
    """Forget the addresses of this run's transient arrays and copies (they die with the batch)."""
    bound.release(entries.copied)
    if entries.twins:
        bound.info[4] = 0
    if entries.packed:
        bound.info[5:] = 0


def _multi_rows(program, rows: list) -> int:
    """The rows of the table's multi-row tasks (CONTIGUOUS_STATICS_ROWS, PACKED_STATICS_ROWS: what the copies and
    packs of the statics pay for; the blocks' few large products do not count; a loop's steps: _product_repeats)."""
    n_kinds = program.lowered.n_kinds
    task_rows = [r for tid, r in zip(program.table[:, 0].tolist(), rows) if tid < n_kinds] if program.bound.blocks \
        else rows
    return sum([r for r in task_rows if r > 1])


class _Entries:
    """One run's binding of the buffer table's entries: an entry is kept when it addresses the very array it
    addressed last run, laid out the same (then only its elements may change), else addressed anew. Statics may
    be copied (a transposed one read by multi-row tasks) or get a transposed twin (see the constants above)."""

    def __init__(self, bound: BufferTable, ex, copier, products=(), spare=None, read_as_b=frozenset()):
        self.bound, self.copier, self.from_buffer = bound, copier, ex.ffi.from_buffer
        self.ex, self.products = ex, products   # (the statics that products read as B: packed)
        self.read_as_b = read_as_b   # (only these may get a twin: a product's B is the one read through it)
        self.spare = spare   # (the copier for read-only statics when a run has too few rows for copies per run)
        self.twin_cols = 0
        self.twins, self.copied, self.alive, self.packed = [], [], [], []   # (kept alive for the call)

    def per_run(self, i: int, operand) -> bool:
        """May static ``i`` get a copy, a twin or a pack this run (else :meth:`static` only binds it: an entry the
        last run bound to the same operand stays as it is)?"""
        return bool(operand.transposed) or i in self.products or i in self.read_as_b

    def bind(self, i: int, a, elements: int, ld: int, flag: int) -> None:
        bound = self.bound
        ref = bound.held[i]
        if ref is not None and ref() is a and bound.layouts[i] == (a.shape, a.strides):
            bound.values[bound.n + i] = elements   # (only the elements the run may touch can change)
            return
        bound.slots[i] = self.from_buffer(a)   # writes the address into info[0, i]
        bound.write(i, elements, ld, flag)
        bound.held[i], bound.layouts[i] = weakref.ref(a), (a.shape, a.strides)
        self.alive.append(a)

    def twin(self, i: int, twin: np.ndarray, wide: int) -> None:
        self.twins.append(twin)
        self.bound.twin_slots[i] = self.from_buffer(twin)
        self.twin_cols = max(self.twin_cols, wide)

    def pack(self, i: int, operand, constant: bool = False) -> None:
        """A static that multi-row products read as B: bound as the binder laid it out (a transposed one read
        through its flag: no copy), and packed for the interpreter's packed product (codegen/packed_gemm.py):
        into a buffer refilled every run (its call's arguments kept while the static is the same array laid
        out the same: a run then only calls it), or once for a read-only static (_KEPT)."""
        bound = self.bound
        span = operand.array
        self.bind(i, span, operand.elements, operand.ld, operand.transposed)
        deep, wide = operand.source.shape
        if constant:
            address = self.from_buffer(_kept(span, ("packed", deep, wide, operand.ld, operand.transposed),
                                             lambda: self._refill(self._pack_call(span, operand))[4]))
        else:
            call = bound.calls.get(i)
            if call is None or call[0] is not span or call[1] != (operand.ld, operand.transposed, deep, wide):
                call = bound.calls[i] = self._pack_call(span, operand)
                bound.packs[i] = call[4]
            address = self._refill(call)[3]
        values, n = bound.values, bound.n
        bound.slots[5 * n + i] = address
        values[6 * n + i], values[7 * n + i] = deep, wide
        self.packed.append(i)

    def _pack_call(self, span: np.ndarray, operand) -> tuple:
        """(the static's array, its layout, mc_pack's arguments, the packed copy's address, the copy)."""
        ex = self.ex
        deep, wide = operand.source.shape
        packed = np.empty(-(-wide // ex.packed_nr) * ex.packed_nr * deep, span.dtype)
        to = self.from_buffer(packed)
        args = (deep, wide, ex.ffi.cast(ex.t_ptr, self.from_buffer(span)), operand.ld, operand.transposed,
                ex.ffi.cast(ex.t_ptr, to))
        return span, (operand.ld, operand.transposed, deep, wide), args, to, packed

    def _refill(self, call: tuple) -> tuple:
        self.ex.lib.mc_pack(*call[2])
        return call

    def static(self, i: int, operand, in_tasks: bool) -> None:
        """A static's entry: as bound, or (multi-row tasks) a transposed one copied, wide ones that a product
        reads as B twinned (a static read only as A, the static graph's per-vertex h, got a twin no product read:
        a 2,770 x 512 copy every Tree-LSTM h512 step)."""
        a, copier = operand.source, self.copier
        constant = _read_only(a)
        if copier is None and constant:
            copier = self.spare
        if copier is None or a.ndim != 2 or a.dtype != copier.dtype:
            self.bind(i, operand.array, operand.elements, operand.ld, operand.transposed)
            return
        if i in self.products and (in_tasks or a.size <= PACKED_SMALL) and a.size:   # (packed_gemm.py's rule)
            self.pack(i, operand, constant)
            return
        span = operand.array
        if span.ndim == 1:   # a block of a planned parameter buffer (operands.strided_span)
            if operand.transposed:   # its transpose: copied as a transposed parameter is (below)
                rows, cols = a.shape[1], a.shape[0]
                a = _kept(span, ("T", rows, cols, operand.ld),
                          lambda: _transposed(copier, span, rows, cols, operand.ld))
                self.copied.append(i)
            else:
                self.bind(i, span, operand.elements, operand.ld, 0)
                deep, wide = a.shape
                if in_tasks and i in self.read_as_b and span.size == deep * operand.ld and \
                        _twinned(deep, wide, a.size, constant):
                    self.twin(i, _kept(span, ("T", deep, wide, operand.ld),
                                       lambda: _transposed(copier, span, deep, wide, operand.ld)), wide)
                return
        twin = None
        if operand.transposed and a.ndim == 2 and not a.flags.c_contiguous:   # (a parameter's .T, say)
            twin, view = span, a
            a = _kept(view, ("C",), lambda: copier.contiguous(view))
            self.copied.append(i)
        elif not a.flags.c_contiguous:
            a = span   # (made contiguous by the binder)
        deep, wide = a.shape
        if a.size and in_tasks and i in self.read_as_b and _twinned(deep, wide, a.size, constant):
            whole = a
            self.twin(i, _kept(whole, ("C.T",), lambda: copier.contiguous(whole.T)) if twin is None else twin, wide)
        self.bind(i, a, a.size, wide, 0)


_PRODUCT_STATICS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _product_statics(lowered) -> frozenset:
    """The buffers (operand indices) that a GEMM of ``lowered`` reads as its B through a STATIC register: the
    statics worth packing or twinning (the interpreter checks again that B is all of the static, as packed or
    twinned)."""
    return _products(lowered)[0]


def _product_repeats(lowered) -> int:
    """The most times a task row is multiplied by a static B: the trip counts of the loops around such a GEMM,
    multiplied (1 without loops; a count read where it runs, LOOPN or LOOPR, at its most). A static program's
    task of 64 rows multiplies by W_h at each of 7 steps: 448 rows read the static, which PACKED_STATICS_ROWS
    counts."""
    return _products(lowered)[1]


def _products(lowered) -> tuple:
    found = _PRODUCT_STATICS.get(lowered)
    if found is None:
        static, gemm = OPCODES_IDS["STATIC"], OPCODES_IDS["GEMM"]
        loop, loopn, loopr = OPCODES_IDS["LOOP"], OPCODES_IDS["LOOPN"], OPCODES_IDS["LOOPR"]
        statics, held, repeats = set(), {}, 1
        for begin, end in lowered.ranges.tolist():
            held.clear()
            open_loops = []   # (the pc past the loop's body, its trips)
            for pc, (op, *a) in enumerate(lowered.code[begin:end, :4].tolist()):
                while open_loops and pc >= open_loops[-1][0]:
                    open_loops.pop()
                if op == static:
                    held[a[0]] = a[1]
                elif op == gemm and a[2] in held:
                    statics.add(held[a[2]])
                    repeats = max(repeats, math.prod(trips for _, trips in open_loops))
                elif op in (loop, loopn, loopr):   # (trips or the most, the body's length)
                    trips, body = (a[1], a[2]) if op == loopn else (a[0], a[1])
                    open_loops.append((pc + 1 + body, max(trips, 1)))
        found = _PRODUCT_STATICS[lowered] = (frozenset(statics), repeats)
    return found


def _twinned(deep: int, wide: int, size: int, constant: bool = False) -> bool:
    """Does a static of deep x wide get a transposed twin (SMALL_M_ROWS, TWIN_ELEMENTS; ``constant``: a read-only one, _KEPT)?"""
    return wide >= 2 * deep or (size >= TWIN_ELEMENTS and (deep >= 2 * wide or constant))


def _eager_call(ex, program, bound: BufferTable, sync: np.ndarray, twin_cols: int, check: int):
    """Start the interpreter over the eager stream's table on the CPU's eager thread (cffi releases the GIL for
    the call): the main call's buffer table but the eager stream's own operands (its scratch and fixed arenas,
    its accumulators for the parameter gradients that tasks add into too; registers are each call's own).
    Returns (the thread's event, its error row: nonzero when a check failed). After each chunk the call stores
    the count done into ``sync[0]``; a failure sets ``sync[1]``, which stops the main call's wait."""
    from .streams import get_stream
    lowered, eager = program.lowered, program.eager
    ffi, n = ex.ffi, len(program.operands)
    info = bound.info.copy()   # (addresses and sizes of the main call's entries, its twins)
    slots = ffi.cast("void **", ffi.from_buffer(info))
    held = []
    for i, operand in program.bound.eager_operands.items():
        held.append(operand.array)
        slots[i] = ffi.from_buffer(operand.array)
        info[1, i], info[2, i], info[3, i] = operand.elements, operand.ld, 0
    max_bs = max(eager[:, 2].tolist(), default=0)
    tmp_rows = min(max_bs, SMALL_M_ROWS) if twin_cols else 0
    err = np.zeros(4, np.int64)
    p = ex.ptr
    code, pool, ranges, kernels = _POINTERS[lowered]
    row = ffi.cast("const int64_t *", slots)

    def call():
        try:
            rc = ex.run(code, pool, ranges, len(lowered.ranges), p(eager), len(eager), eager.shape[1],
                        row, row + n, row + 2 * n, row + 3 * n, n, n - 1, max_bs, lowered.nregs, kernels,
                        len(lowered.kernels), ex.gemm, ex.gemv, int(ex.ilp64), int(program.forest), check, p(err),
                        ffi.NULL, row + 4 * n, row + 5 * n, program.bound.eager_scratch, tmp_rows, twin_cols,
                        p(sync), 2, 0)
        except BaseException:
            sync[1] = 1
            raise
        if rc:
            sync[1] = 1
        del alive[:]   # (the copied table and the arrays it addresses, alive until the call returned)
    alive = [info, held, eager]
    return get_stream("eager").submit(call), err


def _raise_check(lowered, err: np.ndarray, stream: str = "") -> None:
    """Raise the failed check a call's error row reports (operand -4: the main call stopped waiting for an
    eager stream that failed)."""
    _, task, pc, operand = err.tolist()
    if operand == -4:
        raise CRunnerCheckError(f"C runner {lowered.title}: task {task}: the eager stream failed")
    where = lowered.text(pc) if 0 <= pc < len(lowered.code) else f"instruction {pc}"
    raise CRunnerCheckError(f"C runner {lowered.title}: {stream}task {task}, instruction {pc} ({where}): operand "
                            f"{lowered.operand_name(pc, operand)} is out of bounds or invalid")
