"""Where arrays live and kernels run: the one seam between the engine and a backend.

The engine, the model and the optimizer only touch arrays through ``device.xp`` (numpy or CuPy: the ops'
kernels already take the array module as their first argument) and ask the device for the three things a
backend must generate: a kernel per fused elementwise group, row-movement kernels, and a way to run the
eager nodes on a second stream. :data:`CPU` is numpy with generated C kernels and a worker thread as the
second stream; :class:`Cuda` is CuPy with generated CUDA kernels (minicavs/cuda) and two CUDA streams.
``Cuda(launcher=codegen.cuda_emulation.Launcher())`` runs the same CUDA sources on the CPU with numpy
arrays: it is how the whole CUDA path of a training step is checked on machines without a GPU.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from .codegen import c as cgen
from .passes.fusion import FusedGroup
from .streams import Event, get_stream
from .validate import check_rows


class Device:
    """numpy arrays, fused groups as generated C kernels, eager work on a worker thread."""

    name = "cpu"
    deterministic = True

    def __init__(self):
        self.xp = np

    def __repr__(self) -> str:
        return f"<device {self.name}>"

    def asarray(self, a, dtype=None):
        """``a`` as an array of this device (no copy if it already is one)."""
        return self.xp.asarray(a, dtype)

    def to_host(self, a) -> np.ndarray:
        return to_host(a)

    def fused(self, groups: Sequence[FusedGroup]) -> list:
        """One kernel per group (``kernel(arrays, outs)``), None where the group stays unfused."""
        return cgen.build(list(groups)) if groups else []

    def rows(self, dtype):
        """Row kernels for ``dtype``: ``scatter_add(dst, idx, src)`` adds repeated indices in row order."""
        return cgen.row_kernels(dtype)

    def take(self, buf, rows: np.ndarray):
        """``buf[rows]`` (a gather or pull: all rows of a task at once); ``rows`` is a host index array."""
        return np.take(buf, rows, axis=0)

    def put(self, dst, rows: np.ndarray, src) -> None:
        """``dst[rows] = src`` for distinct ``rows`` (a push, a child's gradient in a forest)."""
        dst[rows] = src

    def eager(self, tasks: list, work: Callable, ctx) -> tuple[list, dict]:
        """Run ``work(i, *task, ctx, copies)`` for every task, in order, on the eager stream; returns one
        event per task (``wait()`` before reading task i's results on the recurrent path) and the worker's
        copy counters (read them after the last event). The worker has its own run context, since dropout
        row keys change per call."""
        events = [Event() for _ in tasks]
        wctx = replace(ctx)
        wcopies = {"gather": 0, "gathered": 0, "pull": 0, "push": 0}

        def produce():
            i = 0
            try:
                for i, task in enumerate(tasks):
                    work(i, *task, wctx, wcopies)
                    events[i].set()
            except BaseException as e:
                for ev in events[i:]:
                    ev.set(e)
        get_stream("eager").submit(produce)
        return events, wcopies

    def synchronize(self) -> None:
        """Wait until every kernel issued so far has finished (nothing to wait for on the CPU)."""


CPU = Device()


class Cuda(Device):
    """CuPy arrays, fused groups and row movement as generated CUDA kernels (codegen/cuda.py), eager nodes
    on a second CUDA stream with one event per task.

    ``deterministic``: a DAG child's gradient rows are summed by the sorted segment-sum kernel (fixed order,
    bit-reproducible) instead of atomicAdd (faster, last bits vary from run to run). In a forest every child
    has one parent, so no atomics are needed either way."""

    name = "cuda"

    def __init__(self, launcher=None, deterministic: bool = False):
        from . import cuda
        self.launcher = launcher if launcher is not None else cuda.CuPyLauncher()
        self.xp = self.launcher.xp
        self.deterministic = bool(deterministic)
        self._cuda = cuda
        self._rows: dict = {}
        self._index: dict = {}   # id(plan array) -> (plan array, its device copy)
        self._streams = None

    @property
    def emulated(self) -> bool:
        """True when the kernels run on the CPU (numpy arrays): no CUDA streams then."""
        return self.xp is np

    def fused(self, groups: Sequence[FusedGroup]) -> list:
        out = []
        for g in groups:
            try:
                out.append(self._cuda.FusedKernel(g, self.launcher))
            except ValueError:   # broadcasting a flat index cannot express: stays unfused
                out.append(None)
        return out

    def rows(self, dtype):
        dtype = np.dtype(dtype)
        if dtype not in self._rows:
            self._rows[dtype] = _CudaRows(self._cuda.RowKernels(dtype, self.launcher), self.deterministic, self)
        return self._rows[dtype]

    def index(self, rows: np.ndarray):
        """A host index array on the device. The engine's indices are slices of a batch plan's arrays: each
        plan array is copied once and sliced there, so a task costs no host-to-device copy (a synchronous
        one would stall the host that is issuing kernels ahead of the GPU)."""
        base = rows.base if isinstance(rows.base, np.ndarray) else rows
        if base.ndim != 1 or rows.ndim != 1 or not base.flags.c_contiguous or rows.strides != base.strides:
            return self.xp.asarray(rows)
        hit = self._index.get(id(base))
        if hit is None or hit[0] is not base:
            if len(self._index) > 256:   # plans of finished batches
                self._index.clear()
            hit = self._index[id(base)] = (base, self.xp.asarray(base))
        start = (rows.ctypes.data - base.ctypes.data) // base.itemsize
        return hit[1][start:start + len(rows)]

    def take(self, buf, rows: np.ndarray):
        rows = check_rows("gather", rows, None, buf.shape[0])   # on the host: no wait for the device
        if _row_matrix(buf):   # the generated gather kernel: one launch for the task
            return self.rows(buf.dtype).kernels.gather_checked(buf, self.index(rows))
        return self.xp.take(buf, self.index(rows), axis=0)

    def put(self, dst, rows: np.ndarray, src) -> None:
        xp = self.xp
        rows = check_rows("scatter", rows, None, dst.shape[0])
        if _row_matrix(dst):   # the generated scatter kernel
            src = xp.ascontiguousarray(xp.broadcast_to(xp.asarray(src, dst.dtype), (len(rows),) + dst.shape[1:]))
            self.rows(dst.dtype).kernels.scatter_checked(dst, self.index(rows), src)
        else:
            dst[self.index(rows)] = src

    def eager(self, tasks: list, work: Callable, ctx) -> tuple[list, dict]:
        """The host issues every eager task's kernels on the eager stream, recording an event after each;
        the recurrent path (the caller's stream) waits for that event on the device, not on the host. On
        the emulated device kernels run as they are issued, so the tasks simply run first."""
        wcopies = {"gather": 0, "gathered": 0, "pull": 0, "push": 0}
        wctx = replace(ctx)
        if self.emulated:
            for i, task in enumerate(tasks):
                work(i, *task, wctx, wcopies)
            return [_Done()] * len(tasks), wcopies
        cupy = self.xp
        if self._streams is None:
            self._streams = cupy.cuda.Stream(non_blocking=True)
        events = []
        self._streams.wait_event(cupy.cuda.get_current_stream().record())   # inputs the main stream wrote
        with self._streams:
            for i, task in enumerate(tasks):
                work(i, *task, wctx, wcopies)
                events.append(_StreamEvent(cupy, self._streams.record()))
        return events, wcopies

    def synchronize(self) -> None:
        if not self.emulated:
            self.xp.cuda.Device().synchronize()


def _row_matrix(a) -> bool:
    """Can the generated row kernels move rows of ``a`` (2-D float, unit column stride)?"""
    return (a.ndim == 2 and a.dtype in (np.float32, np.float64)
            and (a.shape[1] <= 1 or a.strides[1] == a.itemsize))


class _CudaRows:
    """The engine's row-kernel calls on CUDA: scatter-add by atomics or, deterministic, by segment sums."""

    def __init__(self, kernels, deterministic: bool, device: Cuda):
        self.kernels = kernels
        self.deterministic = deterministic
        self.device = device

    def scatter_add(self, dst, idx, src) -> None:
        xp = self.kernels.launcher.xp
        src = xp.ascontiguousarray(src)
        idx = check_rows("scatter_add", idx, src.shape[0], dst.shape[0])   # host indices: no device wait
        if self.deterministic:
            self.kernels.segment_sum(dst, idx, src)
        else:
            self.kernels.scatter_add_checked(dst, self.device.index(idx), src)


class _Done:
    def wait(self) -> None:
        pass


class _StreamEvent:
    """A CUDA event: ``wait`` makes the current stream wait for it on the device (cudaStreamWaitEvent)."""

    def __init__(self, cupy, event):
        self.cupy, self.event = cupy, event

    def wait(self) -> None:
        self.cupy.cuda.get_current_stream().wait_event(self.event)


def array_module(a):
    """numpy, or the module of a device array (CuPy's ``cupy``)."""
    return np if isinstance(a, np.ndarray) or not hasattr(a, "__array_namespace__") else a.__array_namespace__()


def to_host(a) -> np.ndarray:
    """A numpy array of ``a``'s values, wherever it lives (a copy only when it lives elsewhere)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def get_device(name: str | Device) -> Device:
    """``cpu`` or ``cuda`` (or a Device, returned as is); ``cuda`` needs CuPy and a GPU (CudaUnavailable)."""
    if isinstance(name, Device):
        return name
    if name == "cpu":
        return CPU
    if name == "cuda":
        from . import cuda
        cuda.require()
        return Cuda()
    raise ValueError(f"unknown device {name!r}; known: cpu, cuda")
