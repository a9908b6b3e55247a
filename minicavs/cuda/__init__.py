"""The CUDA backend (optional extra ``cuda``): :class:`Cuda` (backend.py), the CuPy launchers of the
generated kernels (kernels.py) and of the fused optimizer step (optim_kernels.py), compiling without a GPU
(compiler.py) and running CUDA source on the CPU (emulation.py, on the arrays of the device stand-in,
standin.py). Importing this package never needs CuPy; :func:`require` fails with a clear message when CuPy
or a GPU is missing."""
from __future__ import annotations

import functools

import numpy as np

from ..ops.registry import provide_native_kernels
from .device import Cuda  # noqa: F401
from .kernels import CudaUnavailable, CuPyLauncher, FusedKernel, RowKernels, available, require  # noqa: F401
from .optim_kernels import DeviceKernels


@functools.lru_cache(maxsize=None)
def _row_kernels(dtype):
    """The native kernels for CuPy arrays of a float dtype (the dropout row kernel, the fused optimizer step),
    else None."""
    dtype = np.dtype(dtype)
    return DeviceKernels(dtype) if dtype in (np.float32, np.float64) else None


@functools.lru_cache(maxsize=None)
def _emulated_row_kernels(dtype):
    """The same kernels for the device stand-in's arrays, run through the emulation."""
    dtype = np.dtype(dtype)
    return DeviceKernels(dtype, _emulation_launcher()) if dtype in (np.float32, np.float64) else None


@functools.lru_cache(maxsize=None)
def _emulation_launcher():
    from .emulation import Launcher
    return Launcher()


provide_native_kernels("cupy", _row_kernels)
provide_native_kernels("minicavs.cuda.standin", _emulated_row_kernels)
