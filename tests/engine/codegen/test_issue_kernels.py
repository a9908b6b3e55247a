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
