"""The CUDA backend: CuPy arrays, fused groups and row movement as generated CUDA kernels (codegen/cuda.py)
launched by :mod:`.kernels`, a pass issued by one C call (:mod:`.issue`), the eager chunks on a second CUDA
stream with one event per chunk."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..core import arrays
from ..core.validate import check_rows
from ..engine.backend import Backend, FusedGroup
from . import issue, kernels as cuda_kernels


class Cuda(Backend):
    """CuPy arrays, fused groups and row movement as generated CUDA kernels (codegen/cuda.py), the eager
    chunks of a pass on a second CUDA stream with one event per chunk.

    ``deterministic``: a DAG child's gradient rows are summed by the sorted segment-sum kernel (fixed order,
    bit-reproducible) instead of atomicAdd (faster, last bits vary from run to run). In a forest every child
    has one parent, so no atomics are needed either way."""

    name = "cuda"
    runner_name = "cuda runner"

    def __init__(self, launcher=None, deterministic: bool = False, issue_from_c: bool = True,
                 tf32: bool = False):
        self.launcher = launcher if launcher is not None else cuda_kernels.default_launcher()
        self.xp = self.launcher.xp
        arrays.register(self.xp.ndarray, self.xp)
        self.deterministic = bool(deterministic)
        self.issue_from_c = bool(issue_from_c)   # a pass issued by one C call (issue.py), else op by op from Python
        self.tf32 = bool(tf32)   # float32 products with TF32 inputs (cuBLAS's; the stand-in rounds its inputs)
        self._rows: dict = {}
        self._index: dict = {}   # id(plan array) -> (plan array, its device copy)
        self._streams = None

    @property
    def emulated(self) -> bool:
        """True on the emulated device (the stand-in's arrays, kernels run on the CPU): what it computes is
        no GPU result, and everything that reports on a run says so."""
        return bool(getattr(self.launcher, "emulated", False))

    @property
    def description(self) -> str:
        return "cuda (emulated on the CPU: not a GPU result)" if self.emulated else "cuda"

    def fused(self, groups: Sequence[FusedGroup]) -> list:
        out = []
        for g in groups:
            try:
                out.append(cuda_kernels.FusedKernel(g, self.launcher))
            except ValueError:   # broadcasting a flat index cannot express: stays unfused
                out.append(None)
        return out

    def rows(self, dtype):
        dtype = np.dtype(dtype)
        if dtype not in self._rows:
            self._rows[dtype] = _CudaRows(cuda_kernels.RowKernels(dtype, self.launcher), self.deterministic, self)
        return self._rows[dtype]

    def index(self, rows: np.ndarray):
        """A host index array on the device. The engine's indices are slices of a batch plan's arrays: each
        plan array is copied once and sliced there, so a task costs no host-to-device copy (a synchronous
        one would stall the host that is issuing kernels ahead of the GPU)."""
        base = rows.base if isinstance(rows.base, np.ndarray) else rows
        if (base.ndim != 1 or rows.ndim != 1 or not base.flags.c_contiguous or rows.strides != base.strides
                or base.itemsize != rows.itemsize):
            return self.xp.asarray(rows)
        hit = self._index.get(id(base))
        if hit is None or hit[0] is not base:
            if len(self._index) > 256:   # plans of finished batches
                self._index.clear()
            hit = self._index[id(base)] = (base, self._plan_copy(base))
        start = (rows.ctypes.data - base.ctypes.data) // base.itemsize
        part = hit[1][start:start + len(rows)]
        return part if base.dtype == rows.dtype else part.view(rows.dtype)   # (uint64 row keys of int64 plans)

    def _plan_copy(self, base: np.ndarray):
        """A batch plan's index array on the device: its one host-to-device copy."""
        return self.xp.asarray(base)

    def synchronize(self) -> None:
        self.xp.cuda.Device().synchronize()

    tf32_products = True   # (engine.tf32: the products the C loop issues read TF32 inputs)

    def runner_declines(self, program) -> str | None:
        """Why the CUDA runner (the whole pass issued by one C call: :mod:`.issue`) leaves ``program`` to the
        reference runner on this device (its rows and fused groups by this device's kernels): an opcode the loop
        does not issue, a deterministic device's DAG adjoint, or ``issue_from_c`` off."""
        if not self.issue_from_c:
            return "issue_from_c is off"
        return issue.declines(program, self)

    def run(self, program) -> None:
        """The CUDA runner: the whole pass issued by one C call (every launch and product from C); ``eager``'s
        chunks on the device's eager stream. Float32 products read TF32 inputs when the program or the device
        asks (engine.tf32)."""
        issue.run(program, self, tf32=program.tf32 or self.tf32)

    def second_stream(self, chunks: int):
        """The reference runner's eager stream here: this device's second stream, one event per chunk."""
        return EventStream(self, chunks)

    def eager_stream(self):
        """The second CUDA stream (created once): eager work, ahead of the recurrent path."""
        if self._streams is None:
            self._streams = self.xp.cuda.Stream(non_blocking=True)
        return self._streams


class _CudaRows:
    """The engine's row-kernel calls on CUDA: scatter-add by atomics or, deterministic, by segment sums."""

    def __init__(self, kernels, deterministic: bool, device: Cuda):
        self.kernels = kernels
        self.deterministic = deterministic
        self.device = device

    def take(self, src, idx):
        """src's rows ``idx`` (a device index array, checked on the host), one launch."""
        return self.kernels.gather_checked(src, idx)

    def put(self, dst, idx, values) -> None:
        """dst's rows ``idx`` (distinct; a device index array, checked on the host) = values, one launch."""
        self.kernels.scatter_checked(dst, idx, self.kernels.launcher.xp.ascontiguousarray(values))

    def scatter_add(self, dst, idx, src) -> None:
        xp = self.kernels.launcher.xp
        src = xp.ascontiguousarray(src)
        idx = check_rows("scatter_add", idx, src.shape[0], dst.shape[0])   # host indices: no device wait
        if self.deterministic:
            self.kernels.segment_sum(dst, idx, src)
        else:
            self.kernels.scatter_add_checked(dst, self.device.index(idx), src)


class EventStream:
    """The reference runner's eager stream on CUDA: the device's second stream. The host issues every eager chunk's
    launches there first (after an event of the current stream: the inputs it wrote), recording an event
    after each; row t of the main table makes the current stream wait for chunk t's event on the device
    (cudaStreamWaitEvent), not on the host. Nothing crosses between host and device."""

    def __init__(self, device, chunks: int):
        self.device, self.chunks, self.events, self.waited = device, chunks, [], 0

    def start(self, work) -> None:
        cuda = self.device.xp.cuda
        eager = self.device.eager_stream()
        eager.wait_event(cuda.get_current_stream().record())
        with eager:
            work(lambda t: self.events.append(eager.record()))

    def wait(self, t: int) -> None:
        need = min(t + 1, self.chunks)
        if need > self.waited:
            self.device.xp.cuda.get_current_stream().wait_event(self.events[need - 1])
            self.waited = need

    def join(self) -> None:
        self.wait(self.chunks - 1)
