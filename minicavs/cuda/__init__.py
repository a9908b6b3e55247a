"""The CUDA backend (optional extra ``cuda``): :class:`Cuda` (backend.py), the CuPy launchers of the
generated kernels (kernels.py), compiling without a GPU (compiler.py) and running CUDA source on the CPU
(emulation.py). Importing this package never needs CuPy; :func:`require` fails with a clear message when CuPy
or a GPU is missing."""
from __future__ import annotations

import functools

import numpy as np

from ..ops.registry import provide_native_kernels
from .backend import Cuda  # noqa: F401
from .kernels import CudaUnavailable, CuPyLauncher, FusedKernel, RowKernels, available, require  # noqa: F401


@functools.lru_cache(maxsize=None)
def _row_kernels(dtype):
    """The dropout row kernel for CuPy arrays of a float dtype (the ops' native kernels), else None."""
    dtype = np.dtype(dtype)
    return RowKernels(dtype) if dtype in (np.float32, np.float64) else None


provide_native_kernels("cupy", _row_kernels)
