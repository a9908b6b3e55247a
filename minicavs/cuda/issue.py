"""The CUDA runner's C issuing loop, Python side: one C call issues a whole pass (codegen/issue_source.py's loop).

Per pass the host builds the buffer table once (per buffer: its device address, its host copy where the loop
reads one, elements, row stride, transposed flag; index arrays are copied to the device once per batch plan by
``Cuda.index``), then one call into C walks the instruction stream over the task table (and, streaming, the
eager table on the second stream) and issues every kernel launch and product through function pointers. The
Python work is per buffer and per kernel, never per task or per instruction.

The function pointers come from the device's launcher:

- CuPy on a GPU (:class:`_Gpu`): ``cuLaunchKernel``, ``cuEventRecord``, ``cuStreamWaitEvent`` from the libcuda
  CuPy loaded, ``cublasGemmEx`` / ``cublasGemmStridedBatchedEx`` from its libcublas (found in this process's
  memory map, opened with ``RTLD_NOLOAD``: never a second copy) on the loop's own handles, one per stream, made
  by that library's ``cublasCreate_v2``; the kernels' function handles from CuPy's modules. Not yet run on a
  GPU: in CI, stub libraries under the real sonames run these lookups and calls on the emulation
  (tests/cuda/test_issue_gpu_path.py).
- the device stand-in (:class:`_Standin`): the emulated kernels (cuda/emulation.py's ``call_`` wrappers) and the
  CPU's cblas product (TF32 inputs rounded to 10 mantissa bits when asked), so CI runs the loop;
- a launcher with ``no_work`` set (:class:`_NoWork`): launches and products that do nothing, to time what
  issuing costs the host (tools/bench_issue.py).

A program the loop cannot issue goes to the reference runner on the device (engine/reference.py, its rows and fused
groups by the device's kernels): a step only Python runs (APPLY), a DAG's scatter-add on a deterministic device
(segment sums need a plan per task), no C compiler.
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings
import weakref
from pathlib import Path

import numpy as np

from ..core.errors import CheckError
from ..engine.backend import to_host
from ..engine.codegen.issue_kernels import ISSUE_KERNEL_NAMES, issue_kernels
from ..engine.codegen.issue_source import issue_decls, issue_source
from ..engine.codegen.machine import OPS as OPCODE_IDS
from .emulation import FAULTS


class IssueCheckError(CheckError):
    """The issuing loop refused an instruction (an address outside its buffer, a bad operand) before issuing
    it, or the driver refused a launch."""


@functools.lru_cache(maxsize=None)
def library():
    """(ffi, lib) of the compiled loop, or None without a C compiler."""
    import cffi
    from ..cpu.compiler import compiled, compiler
    cc = compiler()
    if cc is None:
        return None
    ffi = cffi.FFI()
    ffi.cdef(issue_decls())
    return ffi, ffi.dlopen(str(compiled(issue_source(), cc, "issue")))


def _address(name: str) -> int:
    ffi, lib = library()
    return int(ffi.cast("uintptr_t", getattr(lib, name)))


C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
DEV = ("launch", "gemm", "gemm_ctx", "record", "wait", "stream", "eager_stream", "start_event", "chunk_event", "read",
       "sync", "write")


class _Functions:
    """What the loop issues through on one device for one dtype: the ``dev`` array (codegen/issue_source.py: launch,
    gemm, its context, record, wait, streams, events), the row kernels' handles, and fused kernels' handles."""

    def __init__(self, device, c_type: str, tf32: bool):
        self.device, self.c_type, self.tf32 = device, c_type, tf32
        ffi, _ = library()
        self.ctx = ffi.new("mc_gemm_ctx *")
        self.ctx.tf32 = int(tf32)
        self.dev = np.zeros(len(DEV), np.int64)
        self.dev[DEV.index("gemm_ctx")] = int(ffi.cast("uintptr_t", self.ctx))
        self.rk = np.zeros(len(ISSUE_KERNEL_NAMES), np.int64)

    def fused(self, kernel) -> int:
        """The function handle of a fused group's generated kernel (0: none)."""
        raise NotImplementedError

    def streams(self) -> None:
        """Point ``dev`` at the current and the eager stream (before each call)."""

    def log(self) -> None:
        """After a call: hand a launcher that records its launches what the call launched."""

    def read(self, reads: int, writes: int) -> None:
        """After a call: the values the loop read from the device (a while_loop's conditions, a count in a
        loop's body) and wrote to it (such a count)."""


class _Standin(_Functions):
    def __init__(self, device, c_type: str, tf32: bool):
        super().__init__(device, c_type, tf32)
        from ..cpu import interpreter as c_interpreter
        blas = c_interpreter.blas(c_type)
        if blas is None:
            raise RuntimeError("the device stand-in's products need a CPU BLAS")
        self.ctx.blas, self.ctx.ilp64 = blas[0], int(blas[1])
        self.dev[:5] = [_address("mc_standin_launch"), _address(f"mc_cpu_gemm_{c_type}"), self.dev[2],
                        _address("mc_noop_record"), _address("mc_noop_wait")]
        emu = device.launcher.emulator(issue_kernels(c_type))
        self.rk[:] = [emu.handle(f"{name}_{c_type}") for name in ISSUE_KERNEL_NAMES]
        self.dev[9:12] = [_address("mc_standin_read"), _address("mc_noop_sync"), _address("mc_standin_read")]

    def fused(self, kernel) -> int:
        return self.device.launcher.emulator(kernel.source).handle(kernel.name)

    def read(self, reads: int, writes: int) -> None:
        from . import standin
        for direction, count in (("d2h", reads), ("h2d", writes)):   # (the stand-in counts its crossings: one
            for _ in range(count):                                    # per value the loop read or wrote)
                standin._count(direction)

    def log(self) -> None:
        launches = getattr(self.device.launcher, "launches", None)
        for emu in self.device.launcher.emulators.values():   # (in order per emulated library)
            logged = emu.take_log()
            if launches is not None:
                launches.extend(logged)


class _NoWork(_Functions):
    def __init__(self, device, c_type: str, tf32: bool):
        super().__init__(device, c_type, tf32)
        self.dev[:5] = [_address("mc_noop_launch"), _address("mc_noop_gemm"), self.dev[2], _address("mc_noop_record"),
                        _address("mc_noop_wait")]
        self.dev[9:12] = [_address("mc_noop_read"), _address("mc_noop_sync"), _address("mc_noop_write")]
        self.rk[:] = 1

    def fused(self, kernel) -> int:
        return 1


def _loaded(fragment: str) -> str | None:
    """The path of a loaded library whose file name contains ``fragment`` (this process's memory map)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if fragment in os.path.basename(path):
                return path
    except OSError:
        pass
    return None


def _entry(lib, name: str) -> int:
    """The address of ``name`` in a library opened by ctypes."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class _CublasHandles:
    """The loop's own cuBLAS handles, one per stream, made by ``cublasCreate_v2`` of the library whose
    ``cublasGemmEx`` the loop calls (never CuPy's handle: with two libcublas mapped it may be the other's),
    each bound to its stream and to host pointer mode once: a handle's stream never switches, so no two
    streams' products share its workspace (``cublasSetStream`` resets it)."""

    def __init__(self, blas):
        self.blas = blas
        for name, args in (("cublasCreate_v2", [ctypes.POINTER(ctypes.c_void_p)]),
                           ("cublasSetStream_v2", [ctypes.c_void_p, ctypes.c_void_p]),
                           ("cublasSetPointerMode_v2", [ctypes.c_void_p, ctypes.c_int]),
                           ("cublasDestroy_v2", [ctypes.c_void_p])):
            getattr(blas, name).argtypes, getattr(blas, name).restype = args, ctypes.c_int
        self.by_stream: dict[int, int] = {}

    @classmethod
    def of_device(cls, device, blas) -> "_CublasHandles":
        """The device's handles (made once, destroyed with the device, not at exit: the driver may be gone)."""
        handles = device.__dict__.get("_issue_cublas")
        if handles is None:
            handles = device.__dict__["_issue_cublas"] = cls(blas)
            weakref.finalize(device, _destroy, blas, handles.by_stream).atexit = False
        return handles

    def _call(self, name: str, *args) -> None:
        status = getattr(self.blas, name)(*args)
        if status:
            raise RuntimeError(f"the CUDA issuing loop: {name} returned cuBLAS status {status}")

    def of(self, stream: int) -> int:
        """The handle of ``stream`` (a stream pointer), made on first use."""
        if stream not in self.by_stream:
            handle = ctypes.c_void_p()
            self._call("cublasCreate_v2", ctypes.byref(handle))
            self.by_stream[stream] = handle.value
            self._call("cublasSetStream_v2", handle, ctypes.c_void_p(stream))
            self._call("cublasSetPointerMode_v2", handle, 0)   # (CUBLAS_POINTER_MODE_HOST: alpha, beta on the host)
        return self.by_stream[stream]


def _destroy(blas, by_stream: dict) -> None:
    for handle in by_stream.values():
        blas.cublasDestroy_v2(handle)
    by_stream.clear()


class _Gpu(_Functions):
    """The driver's and cuBLAS's entry points, from the libraries CuPy loaded; the kernels' ``CUfunction``
    handles from CuPy's modules (``RawModule.get_function`` is a ``RawKernel``: its ``kernel`` is the
    ``cupy.cuda.function.Function`` whose ``ptr`` is the handle)."""

    def __init__(self, device, c_type: str, tf32: bool):
        super().__init__(device, c_type, tf32)
        cupy = device.xp
        from cupy.cuda import cublas   # noqa: F401  (loads libcublas)
        cuda = ctypes.CDLL(_loaded("libcuda.so") or "libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        path = _loaded("libcublas.so")
        if path is None:
            raise RuntimeError("the CUDA issuing loop: CuPy has not loaded libcublas")
        blas = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        self.cublas = _CublasHandles.of_device(device, blas)
        if self.cublas.blas._name != blas._name:
            raise RuntimeError(f"the CUDA issuing loop: libcublas was {self.cublas.blas._name}, now {path}")
        self.ctx.gemm_ex = _entry(blas, "cublasGemmEx")
        self.ctx.gemm_batched = _entry(blas, "cublasGemmStridedBatchedEx")
        self.dev[:5] = [_entry(cuda, "cuLaunchKernel"), _address(f"mc_cublas_gemm_{c_type}"), self.dev[2],
                        _entry(cuda, "cuEventRecord"), _entry(cuda, "cuStreamWaitEvent")]
        self.events = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
        self.dev[7:9] = [e.ptr for e in self.events]
        self.dev[9:12] = [_optional(cuda, "cuMemcpyDtoHAsync_v2"), _optional(cuda, "cuStreamSynchronize"),
                          _optional(cuda, "cuMemcpyHtoDAsync_v2")]
        source = issue_kernels(c_type)
        self.rk[:] = [_function(source, f"{name}_{c_type}") for name in ISSUE_KERNEL_NAMES]

    def fused(self, kernel) -> int:
        return _function(kernel.source, kernel.name)

    def streams(self) -> None:
        main, eager = self.device.xp.cuda.get_current_stream().ptr, self.device.eager_stream().ptr
        self.dev[5], self.dev[6] = main, eager
        for i, stream in enumerate((main, eager)):
            self.ctx.stream[i], self.ctx.handle[i] = _ffi_pointer(stream), _ffi_pointer(self.cublas.of(stream))


def _optional(lib, name: str) -> int:
    """The address of ``name`` in ``lib``, 0 where it has none (the loop then refuses what needs it)."""
    try:
        return _entry(lib, name) or 0
    except AttributeError:
        return 0


def _function(source: str, name: str) -> int:
    """The ``CUfunction`` of kernel ``name`` in CuPy's module of ``source`` (refused when CuPy has none)."""
    from .kernels import _module
    ptr = _module(source).get_function(name).kernel.ptr
    if not ptr:
        raise RuntimeError(f"the CUDA issuing loop: CuPy has no function handle for kernel {name}")
    return int(ptr)


def _ffi_pointer(value: int):
    ffi, _ = library()
    return ffi.cast("void *", value)


def functions(device, dtype, tf32: bool = False) -> _Functions:
    """The device's function pointers for ``dtype`` (made once per device, dtype and TF32 mode)."""
    cache = device.__dict__.setdefault("_issue_functions", {})
    key = (np.dtype(dtype), bool(tf32))
    if key not in cache:
        launcher = device.launcher
        kind = _NoWork if getattr(launcher, "no_work", False) else \
            _Standin if getattr(launcher, "emulated", False) else _Gpu
        cache[key] = kind(device, C_TYPES[np.dtype(dtype)], bool(tf32))
    return cache[key]


# the issuing loop's per-program state, kept here (not on the program): lowered program -> why it declines it;
# lowered program -> {id(handles): (handles, the fused kernels' CUfunction handles)}
_DECLINED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_FUSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def declines(program, device) -> str | None:
    """Why the loop leaves ``program`` to the reference runner on the device (None: it issues it)."""
    lowered, dtype = program.lowered, program.dtype
    if np.dtype(dtype) not in C_TYPES:
        return f"dtype {np.dtype(dtype).name}"
    if library() is None:
        return "no C compiler"
    unreachable = _unreachable(device, dtype)
    if unreachable is not None:
        return unreachable
    if lowered not in _DECLINED:
        why = lowered.c_refusal
        if why is None and (lowered.code[:, 0] == OPCODE_IDS["FUSED"]).any() \
                and any(not hasattr(k, "source") for k in lowered.fused):
            why = "a fused group without a generated kernel"
        _DECLINED[lowered] = why
    why = _DECLINED[lowered]
    if why is None and device.deterministic and not program.forest \
            and (lowered.code[:, 0] == OPCODE_IDS["ADJ"]).any():
        return "a DAG's gradient rows summed in a fixed order (segment sums, planned per task)"
    return why


def _unreachable(device, dtype) -> str | None:
    """Why the device's function pointers cannot be had (None: they are), warned once per device: a GPU
    whose driver or cuBLAS the loop cannot reach runs the reference runner on the device instead of failing."""
    cache = device.__dict__.setdefault("_issue_unreachable", {})
    key = np.dtype(dtype)
    if key not in cache:
        try:
            functions(device, dtype)
            cache[key] = None
        except Exception as e:   # (a driver, a cuBLAS or a CuPy this code has not met)
            cache[key] = f"the issuing loop cannot reach the device's entry points ({type(e).__name__}: {e})"
            warnings.warn(f"cuda: {cache[key]}; passes run on the reference runner (issued from Python)", RuntimeWarning, stacklevel=4)
    return cache[key]


# the device's counters (launches, products, events) since it was made, added to by every call
STATS = ("launches", "products", "events", "reads", "writes")


def stats(device) -> np.ndarray:
    """The device's issue counters: launches, products, events, reads, writes (:data:`STATS`)."""
    return device.__dict__.setdefault("_issue_stats", np.zeros(len(STATS), np.int64))


def launch_counts(device) -> dict:
    """The device's issued launches per kernel name, since it was made."""
    return device.__dict__.setdefault("_issue_launches", {})


def _pointer(a) -> int:
    """The device address of an array (CuPy's, or the stand-in's host memory)."""
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else a.__cuda_array_interface__["data"][0]


def _bind(info: np.ndarray, i: int, operand) -> None:
    """Entry ``i`` of the buffer table for a bound operand: the device address, elements, row stride and
    transposed flag the binder resolved; an index array's or the dropout table's host copy beside it (row 1)."""
    a = operand.array
    if operand.kind == "dropout":   # (the entries' table: read on the host)
        info[1, i], info[2, i] = (a.ctypes.data if a.size else 0), a.size
        return
    if operand.host is not None:   # (the host copy checks row numbers; the device's is a plan's, copied once)
        info[1, i] = operand.host.ctypes.data if operand.host.size else 0
    info[0, i] = _pointer(a) if a.size else 0
    info[2, i] = operand.elements
    info[3, i], info[4, i] = operand.ld, operand.transposed


def _table(operands: list) -> np.ndarray:
    info = np.zeros((5, len(operands)), np.int64)
    for i, operand in enumerate(operands):
        if operand is not None:   # (a block's own buffer, and no block runs: nothing to address)
            _bind(info, i, operand)
    return info


def _read_preds(lowered, operands: list, tables: list) -> list:
    """The host copies of the conds' preds (BRANCH's one-value statics) and the loops' run-time trip counts
    (LOOPN's), beside their device addresses in each buffer table: one counted device-to-host read per such
    static and pass (the loop reads it where it issues, on the host; a static is the same for every task).
    Returns the copies, to keep them alive through the call."""
    code = lowered.code
    preds = np.unique(np.concatenate([code[code[:, 0] == OPCODE_IDS[op], 1] for op in ("BRANCH", "LOOPN")])) \
        if len(code) else ()
    copies = []
    for b in preds.tolist():
        operand = operands[b] if 0 <= b < len(operands) else None
        if operand is None:   # (the loop's check refuses the instruction: no host copy)
            continue
        host = np.ascontiguousarray(to_host(operand.array.reshape(-1)[:1]))
        copies.append(host)
        for info in tables:
            info[1, b] = host.ctypes.data
    return copies


def _fused_handles(lowered, handles: _Functions) -> np.ndarray:
    cache = _FUSED.setdefault(lowered, {})
    if id(handles) not in cache:
        cache[id(handles)] = (handles, np.array([handles.fused(k) if k is not None else 0
                                                 for k in lowered.fused] or [0], np.int64))
    return cache[id(handles)][1]


def run(program, device, tf32: bool = False) -> None:
    """Issue the bound ``program`` on ``device`` with one C call, over its operands (the eager stream's own
    beside them), adding into its accumulators. ``program.check``: also check every row number of the index
    arrays on their host copies (the runners' debug mode, ``EngineOptions.check``; every register is checked
    against its buffer either way).

    Every device array whose address the loop holds is kept alive by the program until the C call returns; by
    then the main stream has joined the eager one (it waits for every chunk), so memory freed afterwards and
    reused on the main stream (CuPy's pool, or the stream-ordered allocator) is ordered after the pass."""
    ffi, lib = library()
    lowered, table, eager = program.lowered, program.table, program.eager
    handles = functions(device, program.dtype, tf32)
    n = len(lowered.keys)
    streaming = eager is not None and len(eager) > 0
    info = _table(program.operands)
    einfo = info
    if streaming:
        einfo = info.copy()
        for i, operand in program.bound.eager_operands.items():
            _bind(einfo, i, operand)
    preds = _read_preds(lowered, program.operands, [info] if einfo is info else [info, einfo])
    fk = _fused_handles(lowered, handles)
    handles.streams()
    err = np.zeros(6, np.int64)
    counters = np.zeros(len(STATS), np.int64)
    counts = np.zeros(len(ISSUE_KERNEL_NAMES) + len(fk), np.int64)
    p = functools.partial(ffi.from_buffer, "int64_t[]")
    none = eager if streaming else table
    rc = getattr(lib, f"issue_{handles.c_type}")(
        p(lowered.code), p(lowered.pool), p(lowered.ranges), len(lowered.ranges), p(table), len(table),
        p(none), len(eager) if streaming else 0, table.shape[1], p(info), p(einfo), n, n - 1, lowered.nregs,
        p(handles.dev), p(handles.rk), p(fk), len(lowered.fused), int(program.forest), int(program.check), p(err),
        p(counters), p(counts))
    del preds   # (the preds' host copies, read by the call)
    stats(device)[:] += counters
    handles.read(int(counters[STATS.index("reads")]), int(counters[STATS.index("writes")]))
    names = [f"{k}_{handles.c_type}" for k in ISSUE_KERNEL_NAMES] + [getattr(k, "name", "") for k in lowered.fused]
    per_kernel = launch_counts(device)
    for i in np.flatnonzero(counts).tolist():
        per_kernel[names[i]] = per_kernel.get(names[i], 0) + int(counts[i])
    handles.log()
    if rc:
        _raise(lowered, err)


# the loop's own refusals of a launch or product (codegen/issue_source.py's MC_NO_KERNEL, ...)
REFUSALS = {-7: "a launch of a kernel without a function handle (0)",
            -8: "a product on a stream without a cuBLAS handle",
            -9: "a product whose size or leading dimension exceeds 2^31-1 (cuBLAS's int)",
            -10: "a read or write of a device value (a while_loop's condition or count) on a device without "
                 "cuMemcpyDtoHAsync or cuMemcpyHtoDAsync",
            **{code: f"the emulated device's fault: {why}" for code, why in FAULTS.items()}}


def _raise(lowered, err: np.ndarray) -> None:
    _, task, pc, operand, result, stream = err.tolist()
    where = lowered.text(pc) if 0 <= pc < len(lowered.code) else f"instruction {pc}"
    what = ("eager stream " if stream else "") + f"task {task}, instruction {pc} ({where})"
    if operand == -5:
        raise IssueCheckError(f"cuda {lowered.title}: {what}: a copy whose source and destination partly overlap")
    if operand == -6:
        refused = REFUSALS.get(result, f"the device refused a launch or product (result {result})")
        raise IssueCheckError(f"cuda {lowered.title}: {what}: {refused}")
    raise IssueCheckError(f"cuda {lowered.title}: {what}: operand {lowered.operand_name(pc, operand)} is out of "
                          "bounds or invalid")
