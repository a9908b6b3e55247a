"""The fused optimizer step's CUDA source (codegen/cuda_optim.py) without a GPU: every source compiles with
NVRTC for sm_80 and sm_90 (as CuPy compiles it), and the same text run through the CPU emulation walks its
segment table right: the norm's three kernels over segments of any size (empty ones included), with grids
smaller than the work, give numpy's sum of squares, and the update kernel writes a lazy segment's rows only."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from minicavs.engine.codegen import cuda_optim as opt
from minicavs.engine.codegen.library_source import RULES
from minicavs.cuda.nvrtc import compile_source, compilers_available
from minicavs.cuda.emulation import Emulator, kernels_in
from minicavs.cuda.optim_kernels import segment_table

needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                               reason="CUDA emulation needs g++")


def test_every_rule_has_an_update_kernel_and_the_reductions():
    sources = opt.optimizer_sources()
    names = {n for _, source in sources for n, _ in kernels_in(source)}
    for T in ("float", "double"):
        assert {f"optim_{rule}_{T}" for rule in RULES} | {f"optim_sumsq_{T}", f"optim_partials_{T}",
                                                           f"optim_finish_{T}"} <= names
    for rule in RULES:   # the kernel's scalar arguments: clip, the rule's hyperparameters, the weight decay
        (_, params), = kernels_in(opt.update_kernel(rule, "float32")[1])
        assert [p.split()[-1] for p in params] == ["total", "K", "table", "report", "clip",
                                                   *opt.rule_hyper(rule), "weight_decay", "apply"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_optimizer_kernel_compiles_with_nvrtc(arch):
    if "nvrtc" not in compilers_available():
        if os.environ.get("CI") == "true":
            pytest.fail("CI must compile the CUDA kernels: pip install '.[cudacheck]' (NVRTC from PyPI)")
        pytest.skip("no NVRTC: pip install 'minicavs[cudacheck]'")
    for name, source in opt.optimizer_sources():
        assert compile_source(source, arch, name, compiler="nvrtc"), name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_every_optimizer_kernel_compiles_with_nvcc_in_one_unit():
    assert compile_source("\n".join(s for _, s in opt.optimizer_sources()), "sm_80", "optim", compiler="nvcc")


def table(segments: list, slots: int) -> np.ndarray:
    """The device's table over numpy arrays (their host addresses): the emulation runs on them."""
    return segment_table(segments, slots, lambda a: a.ctypes.data)


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sizes", [[0], [1], [5, 0, 300, 0, 0, 7], [1000, 1, 0, 2049]])
@pytest.mark.parametrize("grid, block", [(1, 1), (3, 7), (64, 256)])
def test_the_norm_kernels_sum_every_segment(dtype, sizes, grid, block, emulation_dir):
    name, source = opt.reduce_kernels(dtype)
    emu = Emulator([source], emulation_dir)
    T = "float" if dtype == "float32" else "double"
    rng = np.random.default_rng(len(sizes) + grid)
    grads = [rng.standard_normal(n).astype(dtype) for n in sizes]
    segments = [(g, g, (), None, 0, False) for g in grads]
    tab = table(segments, 0)
    total = int(tab[len(sizes)])
    partial = np.full(grid * block, np.nan)
    sums = np.full(opt.PARTIALS, np.nan)
    emu.launch(f"optim_sumsq_{T}", grid, block, total, len(sizes), opt.table_width(0), tab, partial)
    emu.launch(f"optim_partials_{T}", 1, opt.PARTIALS, grid * block, partial, sums)
    report = np.full(2 + 2 * len(sizes), np.nan)
    loss = np.array([2.5], dtype)
    emu.launch(f"optim_finish_{T}", 1, 1, opt.PARTIALS, sums, 2 * len(sizes), 1, loss, sums, 0.0, report)
    want = sum(float(np.dot(g.astype(np.float64), g.astype(np.float64))) for g in grads)
    assert abs(report[1] - want) <= 1e-12 * max(1.0, want)
    assert report[0] == 2.5 and not report[2:].any()   # the device's loss; every flag cleared


@needs_cxx
@pytest.mark.parametrize("lazy", [False, True], ids=["dense-semantics", "lazy"])
@pytest.mark.parametrize("grid, block", [(1, 1), (2, 5)])
def test_row_segments_update_as_their_mode_says(grid, block, lazy, emulation_dir):
    """SGD with momentum over a dense segment and a row-sparse one (rows 1 and 4 of a 6-row table): the check
    pass writes nothing; the apply pass writes the rule's values at those rows and, lazily, nothing else, or
    with dense semantics the rule with a zero gradient on the other rows (momentum and weight decay reach
    them); the norm kernels sum the rows' squares."""
    name, source = opt.update_kernel("momentum", "float64")
    emu = Emulator([source], emulation_dir)
    rng = np.random.default_rng(4)
    table_value, table_u = rng.standard_normal((6, 3)), rng.standard_normal((6, 3))
    w, w_u, w_g = rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal(5)
    rows, idx = rng.standard_normal((2, 3)), np.array([1, 4], np.int64)
    tab = table([(w, w_g, (w_u,), None, True, lazy), (table_value, rows, (table_u,), idx, True, lazy)], 1)
    total = int(tab[2])
    assert total == 5 + (6 if lazy else 18)
    before = [a.copy() for a in (w, w_u, table_value, table_u)]
    report = np.zeros(2 + 4)
    lr, mu, wd = 0.1, 0.9, 0.01
    emu.launch(name, grid, block, total, 2, tab, report, 0.0, lr, mu, wd, 0)
    assert all(np.array_equal(a, b) for a, b in zip((w, w_u, table_value, table_u), before))
    assert not report.any()
    emu.launch(name, grid, block, total, 2, tab, report, 0.0, lr, mu, wd, 1)
    dense = np.zeros((6, 3))
    dense[idx] = rows
    for got_value, got_u, value, u, g, where in ((w, w_u, before[0], before[1], w_g, slice(None)),
                                                 (table_value, table_u, before[2], before[3], dense,
                                                  idx if lazy else slice(None))):
        want_u, want_value = u.copy(), value.copy()
        want_u[where] = mu * u[where] + (g[where] + wd * value[where])
        want_value[where] = value[where] - lr * want_u[where]
        np.testing.assert_allclose(got_u, want_u, rtol=1e-15)
        np.testing.assert_allclose(got_value, want_value, rtol=1e-15)
    assert lazy == np.array_equal(table_value[[0, 2, 3, 5]], before[2][[0, 2, 3, 5]])
    emu = Emulator([opt.reduce_kernels("float64")[1]], emulation_dir)
    partial = np.zeros(grid * block)
    emu.launch("optim_sumsq_double", grid, block, total, 2, opt.table_width(1), tab, partial)
    assert abs(partial.sum() - (w_g @ w_g + (rows * rows).sum())) <= 1e-12 * partial.sum()
