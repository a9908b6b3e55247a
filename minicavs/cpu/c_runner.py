"""The C runner of a lowered batch program (instructions.py): the buffer table the C runner reads
(codegen/machine.py's interpreter, compiled by :mod:`.interpreter`), kept from run to run, and the one C call that
runs a pass's blocks and tasks. The CPU backend's ``run_program``. Streaming, a second call runs the eager
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

from ..engine.codegen.machine import MAX_REGISTERS, OPS as OPCODES_IDS
from ..engine.reference import CheckError, add_accumulators, operand_name
from ..runtime.memory import allocations
from . import interpreter as cpu_native
from .library import library


class NativeCheckError(CheckError):
    """The interpreter's bounds check caught an instruction addressing outside its buffer."""


def available(dtype) -> str | None:
    """Why the C runner cannot run ``dtype`` here (None: it can)."""
    if cpu_native.interpreter(dtype) is None:
        return "no compiler or BLAS"
    return None


# the one opcode the C switch has no case for (its default case fails it): the runner declines a program with it
APPLY = OPCODES_IDS["APPLY"]


def declines(lowered, dtype) -> str | None:
    """Why the C runner leaves ``lowered`` to the reference runner (None: it runs it): no compiler or BLAS
    here, an opcode it declines (a step only Python runs), more registers than its register file."""
    why = available(dtype)
    if why is not None:
        return why
    if "_declined" not in lowered.__dict__:
        ops = lowered.code[:, 0] if len(lowered.code) else lowered.code
        if (ops == APPLY).any():
            pc = int(np.flatnonzero(ops == APPLY)[0])
            why = f"instruction {pc} ({lowered.text(pc)}) runs an op only Python runs"
        elif lowered.nregs > MAX_REGISTERS:
            why = f"{lowered.nregs} registers in a template (the C runner has {MAX_REGISTERS})"
        lowered.__dict__["_declined"] = why
    return lowered.__dict__["_declined"]


def _matrix_info(a: np.ndarray, static: bool = True) -> tuple[np.ndarray, int, int]:
    """(array kept alive, row stride, transposed flag) of a buffer the interpreter reads whole. Only a static
    (``STATIC``: a product's operand) is read through the transposed flag; every other instruction takes a
    buffer as rows of its row stride, so a transposed view of anything else would be misread."""
    if static and a.ndim == 2 and not a.flags.c_contiguous and a.T.flags.c_contiguous:
        return a, a.shape[0], 1
    if not a.flags.c_contiguous:   # a copy would take the interpreter's writes and lose them
        raise ValueError(f"C runner: a buffer of shape {a.shape} and strides {a.strides} is not "
                         "C-contiguous" + (" nor a transposed contiguous matrix" if static else ""))
    return a, (a.shape[-1] if a.ndim >= 1 else 1) if a.ndim <= 2 else int(math.prod(a.shape[1:])), 0


def strided_span(a: np.ndarray) -> tuple | None:
    """(the contiguous run of memory a matrix view spans, row stride, transposed flag) of a 2-D static whose
    rows (or, transposed, columns) are contiguous at a stride wider than they are: a column block of a
    planned parameter buffer (passes/layout.py) or its transpose, which BLAS reads in place through the
    stride; None for anything else."""
    if not isinstance(a, np.ndarray) or a.ndim != 2 or not a.size:
        return None
    rows, cols = a.shape
    item = a.itemsize
    if a.strides[1] == item and a.strides[0] % item == 0 and a.strides[0] >= cols * item:
        ld, lines, width, flag = a.strides[0] // item, rows, cols, 0
    elif a.strides[0] == item and a.strides[1] % item == 0 and a.strides[1] >= rows * item:
        ld, lines, width, flag = a.strides[1] // item, cols, rows, 1
    else:
        return None
    length = (lines - 1) * ld + width
    base = a.base
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, np.ndarray) and base.flags.c_contiguous:   # whole rows where the buffer has them:
        start = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]   # size / ld is then
        if 0 <= start and start + lines * ld * item <= base.nbytes:                    # the rows (a twin's)
            length = lines * ld
    span = np.lib.stride_tricks.as_strided(a, (length,), (item,), writeable=False)
    return span, ld, flag


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

class BufferTable:
    """A program's buffer table (per buffer: base address, elements, row stride, transposed flag, twin's
    address; one int64 array the interpreter reads) kept from one run to the next, so that a batch re-addresses
    only the buffers that are new. An entry is reused only for the very same array object, alive, with the
    same shape and strides; anything else (a parameter array replaced, a workspace buffer grown, a new batch's
    index arrays) is addressed again. Arrays are held weakly between runs (strongly, by the run, during one):
    a freed array is never mistaken for another at its address, and a program that has not run since a
    workspace buffer grew does not keep the outgrown buffer alive (with one table per linked program, each
    held a generation of them). A run takes the table off its program and puts it back only when
    the call returned cleanly, so a failed run, or a second thread running the same program, starts from an
    empty table."""

    __slots__ = ("ffi", "info", "slots", "twin_slots", "row", "held", "layouts", "stamp", "columns", "err",
                 "err_ptr", "transient", "transient_at")

    def __init__(self, ffi, n: int, keys: list):
        self.ffi = ffi
        self.info = np.zeros((5, n), np.int64)
        self.slots = ffi.cast("void **", ffi.from_buffer(self.info))
        self.twin_slots = ffi.cast("void **", ffi.from_buffer(self.info[4]))
        self.row = ffi.cast("const int64_t *", self.slots)
        self.held: list = [None] * n     # a weak reference to the array each entry addresses
        self.layouts: list = [None] * n  # its (shape, strides) when addressed
        # entries of a batch's own arrays (index arrays, pull and push buffers, gradients): let go after each
        # run, so that the table keeps nothing alive that the run's caller does not
        self.transient = [i for i, key in enumerate(keys) if key[0] not in PERSISTENT]
        self.transient_at = np.array(self.transient, np.intp)
        self.stamp = None                # (workspace, memory.allocations()) when the last run ended
        self.columns = [[0] * n for _ in range(3)]   # info's rows 1-3 as lists (written to info when changed)
        self.err = np.zeros(4, np.int64)   # where C reports a failed check (the table is dropped after one)
        self.err_ptr = ffi.from_buffer("int64_t[]", self.err)

    def clear(self, i: int) -> None:
        self.info[:, i] = 0
        for column in self.columns:
            column[i] = 0
        self.held[i] = self.layouts[i] = None

    def release(self, entries: list, at: np.ndarray) -> None:
        """Forget ``entries`` (``at``: the same as an array; zero addresses: an entry is only ever read by C
        after a run bound it again)."""
        if entries:
            self.info[:, at] = 0
            held, layouts, (sizes, strides, flags) = self.held, self.layouts, self.columns
            for i in entries:
                held[i] = layouts[i] = None
                sizes[i] = strides[i] = flags[i] = 0


# buffer keys whose arrays outlive a batch: the workspace's buffers, the statics (parameters, mostly)
PERSISTENT = ("tensor", "btensor", "scatter", "sgrad", "fixed", "scratch", "static")


# buffer keys that name a workspace's dynamic tensor whole (its ``buffer``): while no DynamicTensor has
# allocated a buffer since the last run in the same workspace, their entries are kept without resolving them
WORKSPACE_TENSORS = ("tensor", "btensor")


def run(lowered, table: np.ndarray, buffers, dtype, forest: bool, workspace=None,
        eager: np.ndarray | None = None, check: bool = False, clock: np.ndarray | None = None) -> dict:
    """Run the task loop natively: ``buffers[key]`` gives each buffer's array, or (array, elements) for the
    first ``elements`` of an array kept from batch to batch (a workspace buffer: memory.DynamicTensor.prefix).
    ``workspace``: the one whose dynamic tensors the WORKSPACE_TENSORS keys resolve to (their buffers are
    looked up again only when some buffer was allocated since this program's last run there).
    Returns the parameter-gradient accumulators ({name: array}) the program added into. (Addresses come from
    cffi's ``from_buffer``: numpy's ``ctypes.data`` costs microseconds a call; the buffer table keeps those
    of arrays seen by the last run: :class:`BufferTable`.) ``eager``: the eager stream's table
    (program.eager_rows), run by a second call of the interpreter on the CPU's eager thread while this one runs
    ``table``, row t of which waits until eager chunk t is done (:func:`_eager_call`). ``clock``: an int64 array
    (one entry per opcode, and in all, last) the call adds each opcode's nanoseconds into (the device's
    ``opcode_clock``)."""
    ex = cpu_native.interpreter(dtype)
    ffi = ex.ffi
    n = len(lowered.keys)
    bound = lowered.__dict__.pop("_table", None)   # (taken: a run that fails leaves none behind)
    if bound is None or bound.ffi is not ffi:
        bound = BufferTable(ffi, n, lowered.keys)
    info, held, layouts = bound.info, bound.held, bound.layouts
    kept = workspace is not None and bound.stamp is not None and bound.stamp[0] is workspace \
        and bound.stamp[1] == allocations()
    grads = {}
    n_kinds = len(lowered.ranges) // 3
    # the table's template ids and rows as lists: a batch of one has a dozen rows, where a numpy reduction costs
    # more than a pass over the list
    template_ids, rows = table[:, 0].tolist(), table[:, 2].tolist()
    max_bs = max(rows, default=0)
    streaming = eager is not None and len(eager) > 0
    blocks = bool(lowered.blocks) and (max(template_ids, default=-1) >= n_kinds or streaming)
    # (the copies below pay for the tasks' products, not for the blocks' few large ones)
    task_rows = [r for tid, r in zip(template_ids, rows) if tid < n_kinds] if blocks else rows
    # A static read as a transposed view (∂F's W^T) is copied once per run when multi-row tasks read it enough:
    # OpenBLAS packs a transposed B from strided reads, 25-40% slower per product at 16-64 rows, while the copy
    # costs a few such products (cpu/library.py contiguous). Same values; BLAS may round differently.
    # A static at least twice as wide as deep (an LSTM's W_h, H x 4H) that some task reads also gets its
    # transpose (the original array, or a copy): the interpreter multiplies few rows by it as C^T = B^T A^T
    # (SMALL_M_ROWS). One only the blocks read (a Tree-LSTM's leaf W) gets none: the copy, a pass over all of it
    # each run (~15 us at 128 x 384, more from a cold cache), would serve one product.
    copier = library(dtype) if max_bs > 1 and sum([r for r in task_rows if r > 1]) >= CONTIGUOUS_STATICS_ROWS \
        else None
    twin_cols, scratch_at = 0, None
    twin_slots = bound.twin_slots
    twins, copied = [], []   # (kept alive for the call; their entries are let go after it)
    alive = []   # the arrays bound by this run (the table holds them weakly)

    from_buffer = ffi.from_buffer
    slots = bound.slots
    sizes, strides, flags = bound.columns
    changed = False

    def bind(i, a, static=False):
        """Entry i for ``a`` (an array, or (array, elements the program may touch)): kept when it is the array
        it addresses already, laid out the same (then only its elements may change); else addressed anew."""
        nonlocal changed
        used = None
        if type(a) is tuple:
            a, used = a
            if not 0 <= used <= a.size:
                raise ValueError(f"C runner: {used} elements of a buffer of {a.size}")
        ref = held[i]
        if ref is not None and ref() is a and layouts[i] == (a.shape, a.strides):
            if used is not None and sizes[i] != used:
                sizes[i], changed = used, True
            return
        if a.flags.c_contiguous and a.ndim <= 2:   # (the common case, without _matrix_info's call)
            stride, flag = (a.shape[-1] if a.ndim else 1), 0
        else:
            a, stride, flag = _matrix_info(a, static)
        slots[i] = from_buffer(a.T if flag else a)   # writes the address into info[0, i]
        sizes[i], strides[i], flags[i] = a.size if used is None else used, stride, flag
        held[i], layouts[i], changed = weakref.ref(a), (a.shape, a.strides), True
        alive.append(a)

    def bind_span(i, span, stride, flag):
        """Entry i for a matrix read in place through its row stride (:func:`strided_span`)."""
        nonlocal changed
        slots[i] = from_buffer(span)
        sizes[i], strides[i], flags[i] = span.size, stride, flag
        held[i], layouts[i], changed = weakref.ref(span), None, True
        alive.append(span)

    # (elements: a task's scratch is its template's columns x its rows; the blocks' rows are all a kind's, so
    # the tasks' arena is sized by the tasks' rows, each block's by its own)
    scratch = lowered.scratch_cols * max(task_rows, default=0)
    if blocks:
        cols = lowered.block_scratch
        scratch = max([scratch] + [cols.get(tid, 0) * n_rows for tid, n_rows in zip(template_ids, rows)
                                   if tid >= n_kinds])
    task_keys = n if lowered.task_keys is None else lowered.task_keys   # (the keys after them: the blocks' own)
    used = n if blocks else task_keys   # (the blocks' own: left unbound)
    for i, key in enumerate(lowered.keys):
        what = key[0]
        if what == "scratch":
            scratch_at = i
            continue
        if i >= used:
            if held[i] is not None:   # (bound by a run whose blocks were native: no address may stay)
                bound.clear(i)
            continue
        if kept and what in WORKSPACE_TENSORS and held[i] is not None:
            continue
        if what == "fixed":
            a = buffers[("arena", "fixed", lowered.fixed_size)]
        elif what == "pgrad":
            a = buffers[key]
            add_accumulators(grads, key, a)
        else:
            a = buffers[key]
            if what == "static" and not a.flags.c_contiguous and not (a.ndim == 2 and a.T.flags.c_contiguous):
                span = strided_span(a)
                if span is None:
                    a = np.ascontiguousarray(a)   # (a strided view, a parameter's slice, say: statics are only read)
                elif copier is None or a.dtype != copier.dtype:   # a block of a planned buffer: read in place
                    bind_span(i, *span)
                    continue
                elif span[2]:   # its transpose: copied as a transposed parameter is (see below)
                    a = _transposed(copier, span[0], a.shape[1], a.shape[0], span[1])
                    copied.append(i)
                else:
                    bind_span(i, *span)
                    deep, wide = a.shape
                    if i < task_keys and span[0].size == deep * span[1] \
                            and (wide >= 2 * deep or (deep >= 2 * wide and a.size >= TWIN_ELEMENTS)):
                        twin = _transposed(copier, span[0], deep, wide, span[1])
                        twins.append(twin)
                        twin_slots[i] = from_buffer(twin)
                        twin_cols = max(twin_cols, wide)
                    continue
            if what == "static" and copier is not None and a.ndim == 2 and a.dtype == copier.dtype:
                twin = None
                if not a.flags.c_contiguous:
                    twin = a.T if a.T.flags.c_contiguous else None
                    a = copier.contiguous(a)
                    copied.append(i)
                deep, wide = a.shape
                if a.size and i < task_keys and (wide >= 2 * deep or (deep >= 2 * wide and a.size >= TWIN_ELEMENTS)):
                    twin = copier.contiguous(a.T) if twin is None else twin
                    twins.append(twin)
                    twin_slots[i] = from_buffer(twin)
                    twin_cols = max(twin_cols, a.shape[1])
        bind(i, a, what == "static")
    tmp_rows = min(max_bs, SMALL_M_ROWS) if twin_cols and scratch_at is not None else 0
    if scratch_at is not None:
        bind(scratch_at, buffers[("arena", "scratch", scratch + tmp_rows * twin_cols)])
    if changed:
        info[1], info[2], info[3] = sizes, strides, flags
    check = int(check)   # (the debug mode: every operand bounds-checked, a failure reported, not a crash)
    clock_ptr = ffi.NULL if clock is None else ex.ptr(clock)
    p = ex.ptr
    if lowered.pointers is None:   # the program's own arrays: fixed, so their addresses are taken once
        lowered.pointers = (p(lowered.code), p(lowered.pool), p(lowered.ranges), p(lowered.kernels))
    code, pool, ranges, kernels = lowered.pointers
    row = bound.row
    if streaming:
        sync = np.zeros(2, np.int64)   # chunks the eager call has finished; whether it failed
        done, eager_err, eager_grads = _eager_call(ex, lowered, eager, bound, buffers, grads, sync, twin_cols,
                                                   forest, check)
        stream = (p(sync), 1, len(eager))
    else:
        stream = (ffi.NULL, 0, 0)
    try:
        rc = ex.run(code, pool, ranges, len(lowered.ranges), p(table), len(table),
                    table.shape[1], row, row + n, row + 2 * n, row + 3 * n, n, n - 1, max_bs, lowered.nregs,
                    kernels, len(lowered.kernels), ex.gemm, ex.gemv, int(ex.ilp64), int(forest), check,
                    bound.err_ptr, clock_ptr, row + 4 * n, scratch, tmp_rows, twin_cols, *stream)
    finally:
        if streaming:
            done.wait()   # (the eager call's buffers stay alive, and its failure is reported, before we return)
    if streaming and eager_err[0]:
        _raise_check(lowered, eager_err, "eager stream ")
    if rc:
        _raise_check(lowered, bound.err)
    if streaming:
        for name, acc in eager_grads.items():
            grads[name] += acc
    if copied:
        bound.release(bound.transient + copied, np.array(bound.transient + copied, np.intp))
    else:
        bound.release(bound.transient, bound.transient_at)
    if twins:
        info[4] = 0
    bound.stamp = None if workspace is None else (workspace, allocations())   # (after the arenas' growth)
    lowered.__dict__["_table"] = bound
    return grads


def _eager_call(ex, lowered, eager: np.ndarray, bound: BufferTable, buffers, grads: dict, sync: np.ndarray,
                twin_cols: int, forest: bool, check: int):
    """Start the interpreter over the eager stream's table on the CPU's eager thread (cffi releases the GIL for
    the call): the main call's buffer table but its own scratch and fixed arenas (registers are each call's
    own) and its own accumulators for the parameter gradients that tasks add into too
    (instructions.Lowered.eager_accumulators). Returns (the thread's event, its error row: nonzero when a check failed,
    {name: its accumulator}). After each chunk the call stores the count done into ``sync[0]``; a failure
    sets ``sync[1]``, which stops the main call's wait."""
    from .streams import get_stream
    ffi, n = ex.ffi, len(lowered.keys)
    info = bound.info.copy()   # (addresses and sizes of the main call's entries, its twins)
    slots = ffi.cast("void **", ffi.from_buffer(info))
    held = []

    def rebind(i, a, elements=None):
        if type(a) is tuple:
            a, elements = a
        a, stride, _ = _matrix_info(a, static=False)
        held.append(a)
        slots[i] = ffi.from_buffer(a)
        info[1, i], info[2, i], info[3, i] = a.size if elements is None else elements, stride, 0
    template_ids, rows = eager[:, 0].tolist(), eager[:, 2].tolist()
    cols = lowered.block_scratch
    max_bs = max(rows, default=0)
    scratch = max([cols.get(tid, 0) * r for tid, r in zip(template_ids, rows)], default=0)
    tmp_rows = min(max_bs, SMALL_M_ROWS) if twin_cols else 0
    rebind(n - 1, buffers[("arena", "eager scratch", scratch + tmp_rows * twin_cols)])
    if ("fixed",) in lowered.keys:
        rebind(lowered.keys.index(("fixed",)), buffers[("arena", "eager fixed", lowered.fixed_size)])
    own = {}
    for i in lowered.eager_accumulators:
        name = lowered.keys[i][1]
        own[name] = np.zeros_like(grads[name])
        rebind(i, own[name])
    err = np.zeros(4, np.int64)
    p = ex.ptr
    code, pool, ranges, kernels = lowered.pointers
    row = ffi.cast("const int64_t *", slots)

    def call():
        try:
            rc = ex.run(code, pool, ranges, len(lowered.ranges), p(eager), len(eager), eager.shape[1],
                        row, row + n, row + 2 * n, row + 3 * n, n, n - 1, max_bs, lowered.nregs, kernels,
                        len(lowered.kernels), ex.gemm, ex.gemv, int(ex.ilp64), int(forest), check, p(err),
                        ffi.NULL, row + 4 * n, scratch, tmp_rows, twin_cols, p(sync), 2, 0)
        except BaseException:
            sync[1] = 1
            raise
        if rc:
            sync[1] = 1
        del alive[:]   # (the copied table and the arrays it addresses, alive until the call returned)
    alive = [info, held, own, eager]
    return get_stream("eager").submit(call), err, own


def _raise_check(lowered, err: np.ndarray, stream: str = "") -> None:
    """Raise the failed check a call's error row reports (operand -4: the main call stopped waiting for an
    eager stream that failed)."""
    _, task, pc, operand = err.tolist()
    if operand == -4:
        raise NativeCheckError(f"native {lowered.title}: task {task}: the eager stream failed")
    where = lowered.text(pc) if 0 <= pc < len(lowered.code) else f"instruction {pc}"
    raise NativeCheckError(f"native {lowered.title}: {stream}task {task}, instruction {pc} ({where}): operand "
                           f"{operand_name(lowered, pc, operand)} is out of bounds or invalid")
