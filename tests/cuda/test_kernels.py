"""The CUDA launchers (minicavs/cuda/kernels.py: FusedKernel, RowKernels) against numpy, written once and run on
two launchers: ``emulated`` (the generated source compiled as C++ and run on the CPU over the device stand-in's
arrays: always, with g++) and ``cupy`` (a real GPU, marked gpu: skipped without CuPy and a device, never mocked).
The emulated run checks the launchers' argument packing (shapes, row strides, copies, index plans); only the cupy
run checks CuPy's launch and the GPU itself."""
from __future__ import annotations


import numpy as np
import pytest

from minicavs import cuda as mcuda
from minicavs import ops
from minicavs.engine.codegen import cuda as gen
from minicavs.ir.graph import Graph
from minicavs.engine.passes.fusion import fuse

TOL = {"float32": 1e-5, "float64": 1e-12}


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def close(got, want, dtype):
    got = host(got).astype(np.float64)
    assert got.shape == np.shape(want)
    assert np.max(np.abs(got - want)) <= TOL[dtype] * max(1.0, float(np.max(np.abs(want))))


def group(dtype, cols=6):
    """Two outputs over every broadcast kind: full x, row b, col s, scalar k."""
    x = ops.input((None, cols), dtype, name="x")
    b = ops.input((cols,), dtype, name="b")
    s = ops.input((None, 1), dtype, name="s")
    k = ops.input((), dtype, name="k")
    h = ops.tanh(x * s + b)
    out = ops.sigmoid(h) * k - h
    (g,) = fuse(list(Graph([out, h]).nodes), [out, h])
    assert sorted(set(g.broadcast)) == ["col", "full", "row", "scalar"] and len(g.outputs) == 2
    return g, {x: (None, cols), b: (cols,), s: (None, 1), k: ()}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows", [1, 37])
def test_fused_kernel_equals_numpy(launcher, dtype, rows):
    g, shapes = group(dtype)
    rng = np.random.default_rng(rows)
    host_in = [rng.standard_normal(tuple(rows if d is None else d for d in shapes[i])).astype(dtype)
               for i in g.inputs]
    xp = launcher.xp
    fk = mcuda.FusedKernel(g, launcher)
    got = fk([xp.asarray(a) for a in host_in])
    for o, want in zip(got, g.evaluate_all(host_in)):
        close(o, np.broadcast_to(want, (rows, 6)), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_kernel_reads_and_writes_row_strided_views(launcher, dtype):
    """The engine's case: x is the h half of a gathered [h, c]; the outputs land in column blocks of a
    wider tensor (and one in a float64 buffer, through a copy); nothing else is touched."""
    g, shapes = group(dtype)
    rng = np.random.default_rng(5)
    xp = launcher.xp
    hc = rng.standard_normal((9, 12)).astype(dtype)
    vals = {i: hc[:, :6] if shapes[i] == (None, 6) else
            rng.standard_normal(tuple(9 if d is None else d for d in shapes[i])).astype(dtype) for i in g.inputs}
    wide = xp.asarray(np.full((9, 13), np.nan, dtype))
    other = xp.asarray(np.full((9, 6), np.nan, np.float64 if dtype == "float32" else np.float32))
    dev = {i: xp.asarray(hc)[:, :6] if shapes[i] == (None, 6) else xp.asarray(v) for i, v in vals.items()}
    ys = mcuda.FusedKernel(g, launcher)([dev[i] for i in g.inputs], [wide[:, 1:7], other])
    assert ys[0] is not None and ys[1] is other
    want = g.evaluate_all([vals[i] for i in g.inputs])
    close(host(wide)[:, 1:7], want[0], dtype)
    close(host(other), want[1], "float32")
    assert np.isnan(host(wide)[:, [0, 7, 8, 9, 10, 11, 12]]).all()


def test_fused_kernel_grid_stride_beyond_the_block_cap(launcher):
    """More elements than MAX_BLOCKS * BLOCK threads: the grid-stride loop covers the rest."""
    x = ops.input((None, 256), "float32", name="x")
    out = ops.exp(x) * 2.0
    (g,) = fuse(list(Graph([out]).nodes), [out])
    rows = gen.MAX_BLOCKS + 3
    xs = np.linspace(-1, 1, rows * 256, dtype=np.float32).reshape(rows, 256)
    got = mcuda.FusedKernel(g, launcher)([launcher.xp.asarray(xs)])
    close(got, g.evaluate([xs]), "float32")
    if hasattr(launcher, "launches"):
        assert launcher.launches[-1][1:] == (gen.MAX_BLOCKS, gen.BLOCK)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_kernels_equal_numpy(launcher, dtype):
    xp = launcher.xp
    rk = mcuda.RowKernels(dtype, launcher)
    rng = np.random.default_rng(2)
    src = rng.standard_normal((50, 16)).astype(dtype)
    idx = rng.integers(0, 10, 50)               # repeats: parents sharing a child
    d_src = xp.asarray(src)
    assert np.array_equal(host(rk.gather(d_src, idx)), src[idx])
    one = rk.gather(d_src, np.array([7]))        # a task of one row
    assert np.array_equal(host(one), src[[7]])
    block = xp.asarray(np.zeros((50, 20), dtype))
    rk.gather(d_src, idx, out=block[:, 2:18])   # into a column block of a wider tensor
    assert np.array_equal(host(block)[:, 2:18], src[idx]) and not host(block)[:, [0, 1, 18, 19]].any()
    dst = xp.asarray(np.zeros((60, 16), dtype))
    perm = rng.permutation(60)[:50]
    rk.scatter(dst, perm, d_src)
    want = np.zeros((60, 16), dtype)
    want[perm] = src
    assert np.array_equal(host(dst), want)
    summed = np.zeros((10, 16), dtype)
    np.add.at(summed, idx, src)
    atomic, seg = xp.asarray(np.zeros((10, 16), dtype)), xp.asarray(np.zeros((10, 16), dtype))
    rk.scatter_add(atomic, idx, d_src)
    rk.segment_sum(seg, idx, d_src)
    close(atomic, summed, dtype)
    close(seg, summed, dtype)
    again = xp.asarray(np.zeros((10, 16), dtype))
    rk.segment_sum(again, xp.asarray(idx), d_src, plan=gen.segments(idx))
    assert np.array_equal(host(again), host(seg))   # bit-reproducible, whatever the device's timing


def test_row_kernels_refuse_what_they_cannot_index(launcher):
    rk = mcuda.RowKernels("float32", launcher)
    xp = launcher.xp
    with pytest.raises(ValueError, match="float32"):
        rk.gather(xp.zeros((4, 3), np.float64), np.arange(2))
    with pytest.raises(ValueError, match="unit column stride"):
        rk.gather(xp.zeros((4, 6), np.float32)[:, ::2], np.arange(2))
    with pytest.raises(ValueError, match="do not match"):
        rk.scatter_add(xp.zeros((4, 3), np.float32), np.arange(3), xp.zeros((2, 3), np.float32))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("p", [0.25, 0.5])
def test_dropout_kernel_equals_the_host_mask(launcher, dtype, p):
    """x times the mask made on the device equals x times random.py's mask (numpy), bit for bit, also for a
    row-strided view of x."""
    from minicavs.core.random import hash_words, row_key, uniform
    xp = launcher.xp
    rk = mcuda.RowKernels(dtype, launcher)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 40)).astype(dtype)
    keys = row_key(np.arange(9) // 3, np.arange(9) * 7)
    u = uniform(3, 17, 2, keys[:, None], np.arange(30, dtype=np.uint64)[None, :])
    want = x[:, 5:35] * ((u >= p) * (1.0 / (1.0 - p))).astype(dtype)
    got = host(rk.dropout(xp.asarray(x)[:, 5:35], keys, int(hash_words(3, 17, 2)[0]), p))
    assert got.dtype == np.dtype(dtype) and np.array_equal(got, want)
    assert 0.3 < np.mean(got != 0) < 0.9


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_dropout_equals_the_cpu_op(launcher, dtype):
    """The dropout op's CUDA path (mask made by the kernel) equals its CPU path, for a 3-D value too."""
    from minicavs.engine.executor import RunContext
    from minicavs.ops.nn import _dropout_impl, kernel_dropout
    from minicavs.core.random import row_key
    x = np.random.default_rng(6).standard_normal((6, 5, 4)).astype(dtype)
    ctx = RunContext(seed=4, step=9, row_keys=row_key(np.arange(6), np.arange(6) + 100))
    want = _dropout_impl(np, x, 0.3, 7, ctx)
    got = kernel_dropout(launcher.xp, launcher.xp.asarray(x), 0.3, 7, ctx, mcuda.RowKernels(dtype, launcher))
    assert got.shape == x.shape and np.array_equal(host(got), want) and np.any(want == 0)
