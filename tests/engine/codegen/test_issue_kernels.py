"""The CUDA issuing loop's kernels (minicavs/engine/codegen/issue_kernels.py): they compile for the GPUs
(NVRTC, as CuPy's RawModule gets them; nvcc where there is one) and run on the CPU emulation with cuLaunchKernel's
argument passing (a struct by value included). (The loop itself: tests/cuda/test_issue.py.)"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from minicavs.engine.codegen.issue_kernels import ISSUE_KERNEL_NAMES, MOVES, issue_kernels
from minicavs.cuda.nvrtc import compile_source, compilers_available


@pytest.mark.parametrize("c_type", ["float", "double"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_loop_kernels_compile_with_nvrtc(c_type, arch):
    if "nvrtc" not in compilers_available():
        if os.environ.get("CI") == "true":
            pytest.fail("CI must compile the CUDA kernels: pip install '.[cudacheck]' (NVRTC from PyPI)")
        pytest.skip("no NVRTC: pip install 'minicavs[cudacheck]'")
    assert compile_source(issue_kernels(c_type), arch, f"issue_{c_type}", compiler="nvrtc")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_the_loop_kernels_compile_with_nvcc():
    assert compile_source(issue_kernels("float") + issue_kernels("double"), "sm_90", "issue", compiler="nvcc")


@pytest.mark.parametrize("c_type", ["float", "double"])
def test_moves_by_index_and_strides_on_the_emulation(c_type, emulation_dir):
    """One ``moves`` launch through the emulation's call_ wrapper (params as cuLaunchKernel passes them): a
    gather with a missing row, a strided copy, a scatter, an atomic scatter-add with a repeated row, each as
    numpy computes it."""
    import cffi
    from minicavs.cuda.emulation import Emulator
    dtype = np.float32 if c_type == "float" else np.float64
    emu = Emulator([issue_kernels(c_type)], emulation_dir)
    ffi = cffi.FFI()
    ffi.cdef(f"typedef struct {{ int64_t n, start[{MOVES + 1}], cols[{MOVES}], add[{MOVES}]; void *src[{MOVES}];"
             f" int64_t lsr[{MOVES}], lsc[{MOVES}]; void *dst[{MOVES}]; int64_t ldr[{MOVES}], ldc[{MOVES}];"
             f" void *sidx[{MOVES}], *didx[{MOVES}]; }} moves;")
    rng = np.random.default_rng(0)
    src = rng.standard_normal((6, 5)).astype(dtype)
    gathered, copied = np.zeros((3, 5), dtype), np.zeros((4, 3), dtype)
    scattered, added = np.zeros((6, 5), dtype), np.ones((6, 5), dtype)
    take, put, add_rows = np.array([4, -1, 0]), np.array([5, 1, 3]), np.array([2, 2, 0])
    m = ffi.new("moves *")
    entries = [  # (src, lsr, lsc, sidx, dst, ldr, ldc, didx, rows, cols, add)
        (src, 5, 1, take, gathered, 5, 1, None, 3, 5, 0),
        (src[1:], 5, 1, None, copied, 3, 1, None, 4, 3, 0),     # (a column block: every row's first 3)
        (src, 5, 1, None, scattered, 5, 1, put, 3, 5, 0),
        (src, 5, 1, None, added, 5, 1, add_rows, 3, 5, 1)]
    keep = []
    m.n, m.start[0] = len(entries), 0
    for e, (s, lsr, lsc, sidx, d, ldr, ldc, didx, rows, cols, add) in enumerate(entries):
        s = np.ascontiguousarray(s)
        keep += [s, sidx, didx]
        m.src[e], m.dst[e] = ffi.cast("void *", s.ctypes.data), ffi.cast("void *", d.ctypes.data)
        m.sidx[e] = ffi.cast("void *", sidx.ctypes.data) if sidx is not None else ffi.NULL
        m.didx[e] = ffi.cast("void *", didx.ctypes.data) if didx is not None else ffi.NULL
        m.lsr[e], m.lsc[e], m.ldr[e], m.ldc[e], m.cols[e], m.add[e] = lsr, lsc, ldr, ldc, cols, add
        m.start[e + 1] = m.start[e] + rows * cols
    params = ffi.new("void *[1]", [ffi.cast("void *", m)])
    call = emu.ffi.cast("void (*)(unsigned, unsigned, void **)", emu.handle(f"moves_{c_type}"))
    call(2, 7, emu.ffi.cast("void **", int(ffi.cast("uintptr_t", params))))
    want_gathered = src[np.maximum(take, 0)] * (take >= 0)[:, None]
    want_scattered = np.zeros((6, 5), dtype)
    want_scattered[put] = src[:3]
    want_added = np.ones((6, 5), dtype)
    np.add.at(want_added, add_rows, src[:3])
    np.testing.assert_array_equal(gathered, want_gathered)
    np.testing.assert_array_equal(copied, src[1:5, :3])
    np.testing.assert_array_equal(scattered, want_scattered)
    np.testing.assert_allclose(added, want_added, rtol=1e-6)


def test_the_loop_launches_every_kernel_it_names():
    for c_type in ("float", "double"):
        source = issue_kernels(c_type)
        for name in ISSUE_KERNEL_NAMES:
            assert f"void {name}_{c_type}(" in source, name


# --- ROWOP's kernel: one block per row ------------------------------------------------------------------------

def _rowop_threads(cols: int) -> int:
    """The issuing loop's threads per block of a ROWOP launch (codegen/issue_source.py's mc_rowop_threads)."""
    from minicavs.cuda import issue
    return int(issue.library()[1].mc_rowop_threads(cols))


def test_rowop_blocks_grow_with_the_row_from_a_warp():
    """A warp for a short row; doubling while a thread would hold more than ROWOP_PER_THREAD columns; never
    above ROWOP_THREADS (a power of two, within CUDA's 1024)."""
    from minicavs.engine.codegen.issue_kernels import ROWOP_PER_THREAD, ROWOP_THREADS
    assert ROWOP_THREADS <= 1024 and ROWOP_THREADS & (ROWOP_THREADS - 1) == 0
    for cols in (0, 1, 31, 32, 33, 255, 256, 257, 1000, 4097, 10000, 10 ** 6):
        threads = _rowop_threads(cols)
        assert 32 <= threads <= ROWOP_THREADS and threads & (threads - 1) == 0, (cols, threads)
        assert threads * ROWOP_PER_THREAD >= cols or threads == ROWOP_THREADS, (cols, threads)
        assert (threads // 2) * ROWOP_PER_THREAD < cols or threads == 32, (cols, threads)


def _rowop_want(fn: int, x: np.ndarray, g: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """numpy's row functions in float64: softmax, the cross-entropy of each row's label, its gradient x g
    (NaN for a label that is no class)."""
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) + x.max(1, keepdims=True)
    valid = (labels >= 0) & (labels < x.shape[1]) & (labels == np.floor(labels))
    y = np.where(valid, labels, 0).astype(np.int64)
    rows = np.arange(len(x))
    if fn == 0:
        return np.exp(x - lse)
    if fn == 1:
        return np.where(valid, lse[:, 0] - x[rows, y], np.nan)[:, None]
    grad = np.exp(x - lse)
    grad[rows, y] -= 1
    return np.where(valid[:, None], grad * g[:, None], np.nan)


def _rowop(emu, c_type: str, fn: int, grid: int, x, g, lab, labf, cols: int, out_cols: int) -> np.ndarray:
    """One emulated ROWOP launch over x's rows, each at its stride (x, g, labf and the output wider than read)."""
    rows = len(x)
    dst = np.full((rows, out_cols + 3), 7.0, x.dtype)   # (columns past the row's: never written)
    ld = lambda a: a.strides[0] // a.itemsize
    emu.launch(f"rowop_{c_type}", grid, _rowop_threads(cols), fn, rows, cols, x, ld(x), g, ld(g), lab,
               labf if labf is not None else x, 0 if labf is None else ld(labf), dst, ld(dst))
    assert (dst[:, out_cols:] == 7.0).all()
    return dst[:, :out_cols]


@pytest.mark.parametrize("c_type", ["float", "double"])
@pytest.mark.parametrize("cols", [1, 31, 32, 33, 1000, 9973])
def test_rowop_on_the_emulation_equals_numpy(c_type, cols, emulation_dir):
    """Softmax, the cross-entropy (labels as int64 rows and as whole numbers of the float type, NaN for one
    that is no class) and its gradient x g, and the row copy, at strided rows, one block per row and fewer
    blocks than rows (the same bits: the trees' order does not depend on the grid), each equal to numpy."""
    from minicavs.cuda.emulation import Emulator
    dtype = np.float32 if c_type == "float" else np.float64
    tol = 1e-5 if c_type == "float" else 1e-10
    emu = Emulator([issue_kernels(c_type)], emulation_dir)
    rng = np.random.default_rng(cols)
    rows = 5
    x = (3 * rng.standard_normal((rows, cols + 4))).astype(dtype)
    g = rng.standard_normal((rows, 3)).astype(dtype)
    labels = rng.integers(0, cols, rows)
    labf = np.zeros((rows, 2), dtype)
    labf[:, 1] = labels
    labf[1, 1], labf[3, 1] = cols, 0.5 if cols > 1 else -1   # (no class: out of range, not whole)
    x64, g64 = x[:, :cols].astype(np.float64), g[:, 0].astype(np.float64)
    for fn, out_cols in ((0, cols), (1, 1), (2, cols)):
        for lab, labf_view, wanted in ((labels, None, labels), (None, labf[:, 1:], labf[:, 1])):
            got = _rowop(emu, c_type, fn, rows, x, g, lab, labf_view, cols, out_cols)
            want = _rowop_want(fn, x64, g64, wanted.astype(np.float64))
            assert np.array_equal(np.isnan(got), np.isnan(want)), (fn, lab is None)
            err = np.abs(np.nan_to_num(got - want)).max()
            assert err <= tol * max(1.0, np.abs(np.nan_to_num(want)).max()), (fn, lab is None, err)
            again = _rowop(emu, c_type, fn, 2, x, g, lab, labf_view, cols, out_cols)
            assert np.array_equal(got, again, equal_nan=True), fn
    np.testing.assert_array_equal(_rowop(emu, c_type, 3, 2, x, g, None, None, cols, cols), x[:, :cols])
