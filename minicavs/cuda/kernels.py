"""Launchers for the generated CUDA kernels over CuPy (optional extra ``cuda``).

The kernels are the strings of :mod:`minicavs.engine.codegen.cuda`, handed to CuPy unchanged (``cupy.RawModule``,
compiled once per source, with ``codegen.cuda.OPTIONS``), with the C kernels' argument contract, so the engine
can call either backend the same way. Importing this package never needs CuPy; :func:`require` fails with a
clear message when CuPy or a GPU is missing.

A *launcher* is what runs a kernel: an object with ``xp`` (the array module) and ``launcher(source, name,
grid, block, args, stream)``. The default is :class:`CuPyLauncher` (:func:`default_launcher`);
``minicavs.cuda.emulation.Launcher`` runs the same source on the CPU over the device stand-in's arrays
(cuda/standin.py), so the argument packing below is tested without a GPU, against a CuPy that refuses host
arrays where CuPy does.

The engine reaches them through :class:`minicavs.cuda.Cuda` (``train.device: cuda``).

Status: the generated sources are compiled for sm_80/sm_90 with NVRTC in CI and executed on the CPU through the
emulation (tests/engine/codegen/test_cuda.py, tests/cuda/, tests/engine/test_backend.py). The one real-GPU run
so far (an H200, CuPy 14.2) failed on host/device crossings that the earlier numpy-array emulation could not see; those are
fixed against the stand-in and wait for the next GPU run (the tests marked ``gpu``, tools/gpu_check.py).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..core.arrays import on_device
from ..core.errors import FeedError, MinicavsError
from ..core.validate import check_dropout, check_rows, indices
from ..engine.codegen import cuda as gen
from ..engine.backend import FusedGroup


class CudaUnavailable(MinicavsError, RuntimeError):
    """No CuPy or no usable CUDA device (the CLI reports it in one line)."""


def _cupy():
    try:
        import cupy
    except ImportError:
        raise CudaUnavailable("device: cuda needs CuPy: pip install 'minicavs[cuda]' (CUDA 12 drivers) or "
                              "'minicavs[cuda13]' (CUDA 13)") from None
    return cupy


def available() -> bool:
    """Is there CuPy and at least one CUDA device?"""
    try:
        require()
        return True
    except CudaUnavailable:
        return False


def require():
    """CuPy, after checking a device exists; raises CudaUnavailable with what is missing."""
    cupy = _cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:   # CUDA driver missing or broken
        raise CudaUnavailable(f"device: cuda: no CUDA device usable by CuPy ({e})") from None
    if count == 0:
        raise CudaUnavailable("device: cuda: no CUDA device found")
    return cupy


@functools.lru_cache(maxsize=None)
def _module(source: str):
    return require().RawModule(code=source, options=gen.OPTIONS)


class CuPyLauncher:
    """Runs a kernel of a generated source on the current CUDA device; one RawModule per source."""

    def __init__(self):
        self.xp = require()

    def __call__(self, source: str, name: str, grid: int, block: int, args, stream=None) -> None:
        _module(source).get_function(name)((grid,), (block,), tuple(args), stream=stream)


def default_launcher():
    """What a ``Cuda()`` device launches with: CuPy on the current GPU. The test suite replaces this (and
    nothing else does) with the emulation on the device stand-in, so that ``train.device: cuda`` trains on
    the emulated device there."""
    return CuPyLauncher()


class _Launches:
    def __init__(self, launcher):
        self._launcher = launcher

    @property
    def launcher(self):
        if self._launcher is None:   # CuPy is needed from the first launch on, not to build the object
            self._launcher = default_launcher()
        return self._launcher


def _matrix(xp, a, dtype, rows: int, cols: int):
    """(``a`` as a (rows, cols) matrix with unit column stride, its row stride, whether that is a copy)."""
    m = a if a.dtype == dtype else a.astype(dtype)
    copied = m is not a
    if m.ndim != 2 or m.shape[1] > 1 and m.strides[1] != m.itemsize:
        c = xp.ascontiguousarray(m)
        copied = copied or c is not m
        m = c.reshape(rows, cols)
    return m, np.int64(m.strides[0] // m.itemsize if m.shape[0] > 1 else m.shape[1]), copied


class FusedKernel(_Launches):
    """A fused group on the GPU: ``kernel(arrays, out=None)`` as cpu/compiler.py's Kernel, on CuPy arrays.
    Inputs and ``out`` may be row-strided views (the ``h`` half of ``[h, c]``); a group with several outputs
    takes a list for ``out`` (None where to allocate) and returns the list of outputs."""

    def __init__(self, group: FusedGroup, launcher=None):
        super().__init__(launcher)
        self.group = group
        self.name, self.source = gen.render(group)    # raises for broadcasting a flat index cannot express
        self.kinds = list(group.broadcast)
        self.nout = len(group.outputs)
        self.dtype = np.dtype(group.output.dtype.np)
        self.full = next((i for i, k in enumerate(self.kinds) if k == "full"), None)

    def __call__(self, arrays, out=None, stream=None):
        run = self.launcher
        xp = run.xp
        arrays = [xp.asarray(a) for a in arrays]
        shape = arrays[self.full].shape if self.full is not None else \
            np.broadcast_shapes(*(a.shape for a in arrays))
        rows, cols = shape if len(shape) == 2 else (math.prod(shape[:-1]), shape[-1] if shape else 1)
        outs = out if isinstance(out, list) else [out] * self.nout
        ys = [xp.empty(shape, self.dtype) if o is None else o for o in outs]
        if rows * cols:
            args = [np.int64(rows), np.int64(cols)]
            for a, kind in zip(arrays, self.kinds):
                if kind in ("full", "col"):
                    args += _matrix(xp, a, self.dtype, rows, cols if kind == "full" else 1)[:2]
                else:
                    args += [xp.ascontiguousarray(a, dtype=self.dtype), np.int64(0)]
            mats = [_matrix(xp, y, self.dtype, rows, cols) for y in ys]
            for m, ld, _ in mats:
                args += [m, ld]
            run(self.source, self.name, gen.grid(rows * cols), gen.BLOCK, args, stream)
            for y, (m, _, copied) in zip(ys, mats):
                if copied:                        # the kernel wrote a copy: write the result back
                    y[...] = m.reshape(y.shape)
        return ys if self.nout > 1 else ys[0]


class RowKernels(_Launches):
    """Row movement for one dtype, all rows of a task in one launch, on 2-D CuPy arrays with unit column
    stride (row-strided views are fine): ``gather`` (out[r] = src[idx[r]]), ``scatter`` (dst[idx[r]] =
    src[r]), ``scatter_add`` (dst[idx[r]] += src[r], atomic: fast, not bit-reproducible) and ``segment_sum``
    (the same sum in a fixed order: bit-reproducible). Indices are int64."""

    def __init__(self, dtype, launcher=None):
        super().__init__(launcher)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"row kernels exist for float32 and float64, not {self.dtype}")
        self.module_name, self.source = gen.row_kernels(self.dtype)
        self.T = "float" if self.dtype == np.float32 else "double"

    def _rows(self, a, what: str) -> np.int64:
        if a.dtype != self.dtype or a.ndim != 2 or (a.shape[1] > 1 and a.strides[1] != a.itemsize):
            raise ValueError(f"{what}: expected a 2-D {self.dtype} array with unit column stride, got "
                             f"{a.dtype} {a.shape} with strides {a.strides}")
        return np.int64(a.strides[0] // a.itemsize if a.shape[0] > 1 else a.shape[1])

    def _launch(self, kernel: str, rows: int, cols: int, args, stream) -> None:
        if rows * cols:
            self.launcher(self.source, f"{kernel}_{self.T}", gen.grid(rows * cols), gen.BLOCK,
                          [np.int64(rows), np.int64(cols)] + list(args), stream)

    def _index(self, idx):
        """``idx`` as a contiguous int64 device array (a host array is copied over: one counted crossing)."""
        xp = self.launcher.xp
        return xp.ascontiguousarray(xp.asarray(idx, dtype=np.int64))

    def _check(self, src, dst, idx):
        if src.shape[1] != dst.shape[1] or len(idx) != src.shape[0]:
            raise ValueError(f"rows: src {src.shape}, dst {dst.shape} and {len(idx)} indices do not match")

    # The public methods check their indices (dtype, count, range: a reduction, and on a GPU a wait for
    # it); the ``*_checked`` ones trust them: the device calls those with a batch plan's indices, checked
    # on the host (the reference runner's ``checked`` on the host copy the binder made, the device's
    # scatter_add by check_rows), so a training step never waits for a check.

    def gather(self, src, idx, out=None, stream=None):
        """out[r] = src[idx[r]]; ``out`` (allocated when None) may be a row-strided view."""
        return self.gather_checked(src, check_rows("gather", idx, None, src.shape[0]), out, stream)

    def scatter(self, dst, idx, src, stream=None) -> None:
        """dst[idx[r]] = src[r] (pushes: distinct indices)."""
        self.scatter_checked(dst, check_rows("scatter", idx, src.shape[0], dst.shape[0]), src, stream)

    def scatter_add(self, dst, idx, src, stream=None) -> None:
        """dst[idx[r]] += src[r] with atomicAdd: repeated indices add up, in an order that varies from run to
        run (and so do the last bits)."""
        self.scatter_add_checked(dst, check_rows("scatter_add", idx, src.shape[0], dst.shape[0]), src, stream)

    def gather_checked(self, src, idx, out=None, stream=None):
        xp = self.launcher.xp
        idx = self._index(idx)
        out = xp.empty((len(idx), src.shape[1]), self.dtype) if out is None else out
        lds, ldo = self._rows(src, "gather src"), self._rows(out, "gather out")
        self._check(out, src, idx)
        self._launch("gather_rows", len(idx), src.shape[1], (src, lds, idx, out, ldo), stream)
        return out

    def scatter_checked(self, dst, idx, src, stream=None) -> None:
        idx = self._index(idx)
        lds, ldd = self._rows(src, "scatter src"), self._rows(dst, "scatter dst")
        self._check(src, dst, idx)
        self._launch("scatter_rows", len(idx), src.shape[1], (src, lds, idx, dst, ldd), stream)

    def scatter_add_checked(self, dst, idx, src, stream=None) -> None:
        idx = self._index(idx)
        lds, ldd = self._rows(src, "scatter_add src"), self._rows(dst, "scatter_add dst")
        self._check(src, dst, idx)
        self._launch("scatter_add_rows", len(idx), src.shape[1], (src, lds, idx, dst, ldd), stream)

    def dropout(self, x, keys, h: int, p: float, stream=None):
        """``x`` (rows, cols) times its dropout mask, made on the device from the row ``keys`` (uint64) and
        ``h`` = random.hash_words(seed, step, site): the C library's and numpy's mask, bit for bit."""
        xp = self.launcher.xp
        if x.ndim != 2 or x.dtype.kind != "f":
            raise FeedError(f"dropout: need a 2-D float array, got {x.dtype}{x.shape}")
        if x.dtype != self.dtype or (x.shape[1] > 1 and x.strides[1] != x.itemsize) or x.strides[0] < 0:
            x = xp.ascontiguousarray(x, dtype=self.dtype)
        keys, h, t, scale = check_dropout(x.shape[0], keys, h, p)
        keys = xp.ascontiguousarray(xp.asarray(keys, dtype=np.uint64))   # host keys: copied over
        y = xp.empty(x.shape, self.dtype)
        ldx, ldy = self._rows(x, "dropout x"), self._rows(y, "dropout y")
        t, scale = np.uint64(t), self.dtype.type(scale)
        self._launch("dropout_rows", x.shape[0], x.shape[1], (np.uint64(h), keys, t, scale, x, ldx, y, ldy), stream)
        return y

    def segment_sum(self, dst, idx, src, plan=None, stream=None) -> None:
        """dst[idx[r]] += src[r], deterministic: the rows of each destination are summed by one thread in row
        order, then added once. ``plan`` is ``codegen.cuda.segments(idx)`` (computed on the host when not
        given; the engine knows it once per batch)."""
        xp = self.launcher.xp
        lds, ldd = self._rows(src, "segment_sum src"), self._rows(dst, "segment_sum dst")
        if plan is None:   # the plan is made on the host: device indices are read back for it
            host = idx.get() if on_device(idx) else idx
            plan = gen.segments(check_rows("segment_sum", host, src.shape[0], dst.shape[0]))
        order, ptr, target = check_segments(plan, src.shape[0], dst.shape[0])
        order, ptr, target = (xp.asarray(a, dtype=np.int64) for a in (order, ptr, target))   # host to device
        self._launch("segment_sum_rows", len(target), src.shape[1], (src, lds, order, ptr, target, dst, ldd),
                     stream)


def check_segments(plan, n: int, size: int) -> tuple:
    """A segment-sum plan (order, ptr, target) that keeps the kernel inside its buffers: ``order`` holds
    ``n`` source rows, ``ptr`` runs from 0 to ``n`` without decreasing, one segment per ``target`` row in
    [0, ``size``)."""
    if len(plan) != 3:
        raise FeedError(f"segment_sum: a plan is (order, ptr, target), got {len(plan)} arrays")
    order, ptr, target = plan
    order = indices(order, "segment_sum: plan order entry", size=n, shape=(n,), of=f" ({n} source rows)")
    target = indices(target, "segment_sum: plan target", size=size, shape=(None,), of=f" ({size} destination rows)")
    ptr = indices(ptr, "segment_sum: plan ptr entry", size=n + 1, shape=(len(target) + 1,),
                  of=f" ({len(target)} segments)")
    if int(ptr[0]) != 0 or int(ptr[-1]) != n or bool((ptr[1:] < ptr[:-1]).any()):
        raise FeedError(f"segment_sum: plan ptr must run from 0 to {n} without decreasing")
    return order, ptr, target
