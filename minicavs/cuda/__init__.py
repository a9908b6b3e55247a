"""CUDA backend over CuPy (optional extra ``cuda``): launchers for the generated kernels.

The kernels are the strings of :mod:`minicavs.codegen.cuda`, handed to CuPy unchanged (``cupy.RawModule``),
with the C kernels' argument contract, so the engine can call either backend the same way. Importing this
package never needs CuPy; :func:`require` fails at start with a clear message when CuPy or a GPU is missing.

Status: these launchers have not run on a real GPU (none is available where minicavs is developed); the
generated sources are compiled for sm_80/sm_90 with NVRTC in CI and executed on the CPU through an emulation
shim (tests/codegen/test_cuda.py). The engine does not dispatch to this backend yet: ``train.device: cuda``
fails at start (training.check_device); the tests marked ``gpu`` are the checks to run first on a GPU.
"""
from __future__ import annotations

import functools

import numpy as np

from ..codegen import cuda as gen
from ..passes.fusion import FusedGroup


class CudaUnavailable(RuntimeError):
    pass


def _cupy():
    try:
        import cupy
    except ImportError:
        raise CudaUnavailable("the CUDA backend needs CuPy: pip install 'minicavs[cuda]' "
                              "(or the cupy-cudaXXx wheel matching your CUDA driver)") from None
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
        raise CudaUnavailable(f"no CUDA device usable by CuPy: {e}") from None
    if count == 0:
        raise CudaUnavailable("no CUDA device found")
    return cupy


@functools.lru_cache(maxsize=None)
def _module(source: str):
    return require().RawModule(code=source, options=("-std=c++14",))


def _ld(a) -> int:
    if a.ndim != 2 or (a.shape[1] > 1 and a.strides[1] != a.itemsize):
        raise ValueError(f"kernel operands must be 2-D with unit column stride, got strides {a.strides}")
    return a.strides[0] // a.itemsize if a.shape[0] > 1 else a.shape[1]


class FusedKernel:
    """A fused group on the GPU: ``kernel(arrays, outs=None)`` like codegen.c.Kernel, on CuPy arrays."""

    def __init__(self, group: FusedGroup):
        self.group = group
        self.name, self.source = gen.render(group)
        self.kinds = list(group.broadcast)
        self.dtype = group.output.dtype.np

    def __call__(self, arrays, outs=None, stream=None):
        cp = require()
        shape = next((a.shape for a, k in zip(arrays, self.kinds) if k == "full"), None) or \
            np.broadcast_shapes(*(a.shape for a in arrays))
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[-1] if shape else 1)
        outs = outs or [None] * len(self.group.outputs)
        ys = [cp.empty(shape, self.dtype) if o is None else o for o in outs]
        args = [np.int64(rows), np.int64(cols)]
        for a, kind in zip(arrays, self.kinds):
            a = cp.asarray(a, self.dtype)
            args += [a, np.int64(_ld(a.reshape(rows, -1)) if kind in ("full", "col") else 0)]
        for y in ys:
            args += [y, np.int64(_ld(y.reshape(rows, cols)))]
        fn = _module(self.source).get_function(self.name)
        fn((gen.grid(rows * cols),), (gen.BLOCK,), tuple(args), stream=stream)
        return ys if len(ys) > 1 else ys[0]


class RowKernels:
    """gather / scatter / scatter_add (atomic) / segment_sum (deterministic) for one dtype on CuPy arrays."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.module_name, self.source = gen.row_kernels(self.dtype)
        self.T = "float" if self.dtype == np.float32 else "double"

    def _launch(self, kernel, n, args, stream=None):
        fn = _module(self.source).get_function(f"{kernel}_{self.T}")
        fn((gen.grid(n),), (gen.BLOCK,), tuple(args), stream=stream)

    def gather(self, src, idx, stream=None):
        cp = require()
        out = cp.empty((len(idx), src.shape[1]), self.dtype)
        self._launch("gather_rows", out.size, (np.int64(len(idx)), np.int64(src.shape[1]), src, np.int64(_ld(src)),
                                               cp.asarray(idx, cp.int64), out, np.int64(src.shape[1])), stream)
        return out

    def scatter(self, dst, idx, src, stream=None):
        self._launch("scatter_rows", src.size, (np.int64(len(idx)), np.int64(src.shape[1]), src, np.int64(_ld(src)),
                                                require().asarray(idx, "int64"), dst, np.int64(_ld(dst))), stream)

    def scatter_add(self, dst, idx, src, stream=None):
        """Atomic: fast, but the order of additions (and so the last bits) varies from run to run."""
        self._launch("scatter_add_rows", src.size, (np.int64(len(idx)), np.int64(src.shape[1]), src,
                                                    np.int64(_ld(src)), require().asarray(idx, "int64"), dst,
                                                    np.int64(_ld(dst))), stream)

    def segment_sum(self, dst, idx, src, stream=None):
        """Deterministic scatter-add: rows grouped by destination, each group summed in a fixed order."""
        cp = require()
        order, ptr, target = (cp.asarray(a) for a in gen.segments(cp.asnumpy(cp.asarray(idx))))
        self._launch("segment_sum_rows", len(target) * src.shape[1],
                     (np.int64(len(target)), np.int64(src.shape[1]), src, np.int64(_ld(src)), order, ptr, target,
                      dst, np.int64(_ld(dst))), stream)
