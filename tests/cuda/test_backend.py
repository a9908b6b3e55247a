"""The CUDA backend package without a GPU: importing it never fails, using it fails early and clearly."""
from __future__ import annotations

import pytest

from minicavs import cuda as mcuda


def test_require_fails_clearly_without_cupy_or_device():
    if mcuda.available():
        pytest.skip("a GPU is present: the gpu-marked tests cover this machine")
    with pytest.raises(mcuda.CudaUnavailable, match="CuPy|CUDA device"):
        mcuda.require()


def test_kernels_are_built_from_the_generated_strings():
    from minicavs.codegen import cuda as gen
    rows = mcuda.RowKernels("float64")
    assert rows.source == gen.row_kernels("float64")[1] and rows.T == "double"
