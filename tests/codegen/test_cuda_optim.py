"""The fused optimizer step's CUDA source (codegen/cuda_optim.py) without a GPU: every source compiles with
NVRTC for sm_80 and sm_90 (as CuPy compiles it), and the same text run through the CPU emulation walks its
segment table right: the norm's three kernels over segments of any size (empty ones included), with grids
smaller than the work, give numpy's sum of squares, and the update kernel writes a lazy segment's rows only."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from minicavs.codegen import cuda_optim as opt
from minicavs.codegen.library import RULES
from minicavs.cuda.compiler import compile_source, compilers_available
from minicavs.cuda.emulation import Emulator, kernels_in

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
    """The table the device builds (cuda/optim_kernels.py), over numpy arrays: the emulation runs on them."""
    width = opt.table_width(slots)
    out = np.zeros(len(segments) + 1 + width * len(segments), np.int64)
    seg = out[len(segments) + 1:].reshape(len(segments), width)
    for k, (value, grad, slot_arrays, rows, decay) in enumerate(segments):
        out[k + 1] = out[k] + grad.size
        seg[k, opt.VALUE], seg[k, opt.GRAD] = value.ctypes.data, grad.ctypes.data
        seg[k, opt.INDEX] = 0 if rows is None else rows.ctypes.data
        seg[k, opt.COLUMNS] = value.shape[1] if rows is not None else 1
        seg[k, opt.DECAY] = decay
        for j, a in enumerate(slot_arrays):
            seg[k, opt.SLOT0 + j] = a.ctypes.data
    return out


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
    segments = [(g, g, (), None, 0) for g in grads]
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
@pytest.mark.parametrize("grid, block", [(1, 1), (2, 5)])
def test_a_lazy_segment_updates_its_rows_only(grid, block, emulation_dir):
    """SGD with momentum over a dense segment and a lazy one (rows 4 and 1 of a 6-row table): the check pass
    writes nothing, the apply pass writes the rule's values at those rows and leaves the others."""
    name, source = opt.update_kernel("momentum", "float64")
    emu = Emulator([source], emulation_dir)
    rng = np.random.default_rng(4)
    table_value, table_u = rng.standard_normal((6, 3)), rng.standard_normal((6, 3))
    w, w_u, w_g = rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal(5)
    rows, idx = rng.standard_normal((2, 3)), np.array([4, 1], np.int64)
    tab = table([(w, w_g, (w_u,), None, 1), (table_value, rows, (table_u,), idx, 0)], 1)
    before = [a.copy() for a in (w, w_u, table_value, table_u)]
    report = np.zeros(2 + 4)
    lr, mu, wd = 0.1, 0.9, 0.01
    emu.launch(name, grid, block, 11, 2, tab, report, 0.0, lr, mu, wd, 0)
    assert all(np.array_equal(a, b) for a, b in zip((w, w_u, table_value, table_u), before))
    assert not report.any()
    emu.launch(name, grid, block, 11, 2, tab, report, 0.0, lr, mu, wd, 1)
    g = w_g + wd * before[0]
    u = mu * before[1] + g
    np.testing.assert_allclose(w_u, u, rtol=1e-15)
    np.testing.assert_allclose(w, before[0] - lr * u, rtol=1e-15)
    want_u, want_value = before[3].copy(), before[2].copy()
    want_u[idx] = mu * before[3][idx] + rows
    want_value[idx] = before[2][idx] - lr * want_u[idx]
    np.testing.assert_allclose(table_u, want_u, rtol=1e-15)
    np.testing.assert_allclose(table_value, want_value, rtol=1e-15)
    assert np.array_equal(table_value[[0, 2, 3, 5]], before[2][[0, 2, 3, 5]])
