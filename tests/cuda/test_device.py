"""The CUDA backend package without a GPU: importing it never fails, using it fails early and clearly."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import cuda as mcuda
from minicavs import ops
from minicavs.engine.codegen import cuda as gen
from minicavs.ir.graph import Graph
from minicavs.engine.passes.fusion import fuse


def test_require_fails_clearly_without_cupy_or_device():
    if mcuda.available():
        pytest.skip("a GPU is present: the gpu-marked tests cover this machine")
    with pytest.raises(mcuda.CudaUnavailable, match=r"device: cuda (needs CuPy: pip install 'minicavs\[cuda\]'"
                                                    r"|: no CUDA device)"):
        mcuda.require()


def test_kernels_are_built_from_the_generated_strings():
    rows = mcuda.RowKernels("float64")
    assert rows.source == gen.row_kernels("float64")[1] and rows.T == "double"
    x = ops.input((None, 4), "float32", name="x")
    out = ops.tanh(x) + 1.0
    (g,) = fuse(list(Graph([out]).nodes), [out])
    assert (mcuda.FusedKernel(g).name, mcuda.FusedKernel(g).source) == gen.render(g)


def test_using_a_kernel_without_a_gpu_raises_the_clear_error():
    if mcuda.available():
        pytest.skip("a GPU is present")
    with pytest.raises(mcuda.CudaUnavailable):
        mcuda.RowKernels("float32").gather(np.zeros((2, 3), np.float32), np.arange(2))
