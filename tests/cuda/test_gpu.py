"""Real-GPU checks of the CUDA launchers (marked gpu): skipped without CuPy and a device, never mocked."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import cuda as mcuda
from minicavs import ops
from minicavs.graph import Graph
from minicavs.passes.fusion import fuse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not mcuda.available(), reason="no CuPy or no CUDA device")]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_kernel_on_gpu_equals_numpy(dtype):
    import cupy as cp
    x = ops.input((None, 33), dtype, name="x")
    b = ops.input((33,), dtype, name="b")
    h = ops.tanh(x + b)
    out = ops.sigmoid(h) * h
    (g,) = fuse(list(Graph([out, h]).nodes), [out, h])
    rng = np.random.default_rng(0)
    xs, bs = rng.standard_normal((1000, 33)).astype(dtype), rng.standard_normal(33).astype(dtype)
    got = mcuda.FusedKernel(g)([cp.asarray(xs) if i is x else cp.asarray(bs) for i in g.inputs])
    for o, want in zip(got, g.evaluate_all([xs if i is x else bs for i in g.inputs])):
        assert np.allclose(cp.asnumpy(o), want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-6)


def test_row_kernels_on_gpu():
    import cupy as cp
    rows = mcuda.RowKernels("float32")
    src = cp.asarray(np.random.default_rng(1).standard_normal((50, 16)).astype(np.float32))
    idx = np.random.default_rng(2).integers(0, 10, 50)
    assert np.array_equal(cp.asnumpy(rows.gather(src, idx)), cp.asnumpy(src)[idx])
    want = np.zeros((10, 16), np.float32)
    np.add.at(want, idx, cp.asnumpy(src))
    for op in (rows.scatter_add, rows.segment_sum):
        dst = cp.zeros((10, 16), cp.float32)
        op(dst, idx, src)
        assert np.allclose(cp.asnumpy(dst), want, rtol=1e-5, atol=1e-5)


def test_unavailable_message_names_what_is_missing():
    assert mcuda.available()   # this module only runs with a GPU; the message test below runs everywhere
