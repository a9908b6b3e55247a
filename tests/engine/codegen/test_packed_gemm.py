"""The packed product (codegen/packed_gemm.py). ``mc_pack``, through the C runner's interpreter: every panel holds
the static's columns as numpy lays them out, zeros past its width, for a static stored as is or transposed, at
widths and row strides that are not multiples of a panel's or a vector's. ``mc_gemm_packed``, compiled alone: numpy's
product at row counts around its register block and row block, depths around its k chunk, widths around a panel,
with row strides past the rows' ends, and nothing written outside C's rows."""
import functools

import cffi
import numpy as np
import pytest

from minicavs.cpu import c_runner, compiler
from minicavs.engine.codegen.packed_gemm import PACKED_DECLS, packed_source


def _interpreter():
    interp = c_runner.c_interpreter.interpreter(np.float32)
    if interp is None or not interp.packed_nr:
        pytest.skip("no packed product here (float32 with AVX-512 only)")
    return interp


def _panels(b: np.ndarray, nr: int) -> np.ndarray:
    """numpy's packing of the k x n matrix ``b``: panels of ``nr`` columns, each k rows of nr, zero past n."""
    k, n = b.shape
    wide = -(-n // nr) * nr
    padded = np.zeros((k, wide), b.dtype)
    padded[:, :n] = b
    return padded.reshape(k, wide // nr, nr).transpose(1, 0, 2).ravel()


def _packed(interp, k: int, n: int, storage: np.ndarray, transposed: bool) -> np.ndarray:
    """``mc_pack`` of the k x n matrix that ``storage``'s rows begin with (its transpose when ``transposed``;
    row stride: all of a storage row), into a buffer with a guard past its end (which must keep its value)."""
    nr = interp.packed_nr
    size = -(-n // nr) * nr * k
    out = np.full(size + 64, np.float32(7.0))
    ffi = interp.ffi
    interp.lib.mc_pack(k, n, ffi.cast(interp.t_ptr, ffi.from_buffer(storage)), storage.shape[1], int(transposed),
                       ffi.cast(interp.t_ptr, ffi.from_buffer(out)))
    assert (out[size:] == 7.0).all(), "mc_pack wrote past the packed buffer"
    return out[:size]


@pytest.mark.parametrize("k, n, pad", [(1, 1, 0), (7, 33, 2), (45, 45, 5), (64, 16, 0), (30, 17, 3),
                                       (129, 96, 0), (300, 200, 11)])
@pytest.mark.parametrize("transposed", [False, True])
def test_packed_panels_equal_numpys_layout(k, n, pad, transposed):
    interp = _interpreter()
    rng = np.random.default_rng(k * 1000 + n)
    b = rng.standard_normal((k, n)).astype(np.float32)
    rows, cols = (n, k) if transposed else (k, n)
    storage = np.zeros((rows, cols + pad), np.float32)   # (rows padded: a row stride past the row's end)
    storage[:, :cols] = b.T if transposed else b
    got = _packed(interp, k, n, storage, transposed)
    np.testing.assert_array_equal(got, _panels(b, interp.packed_nr))


# mc_gemm_packed is static in the interpreter's source: a wrapper gives this test its own entry
_GEMM_ENTRY = """
void mc_test_gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *bp, float *c,
                  int64_t ldc, const float *bias) { mc_gemm_packed(m, n, k, a, lda, bp, c, ldc, bias); }
"""


@functools.lru_cache(maxsize=None)
def _gemm_library():
    cc = compiler.compiler()
    if cc is None:
        return None
    ffi = cffi.FFI()
    ffi.cdef(PACKED_DECLS["float"] + " void mc_test_gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda,"
             " const float *bp, float *c, int64_t ldc, const float *bias);")
    source = "#include <stdint.h>\n" + packed_source("float") + _GEMM_ENTRY
    lib = ffi.dlopen(str(compiler.compiled(source, cc, "packed-test")))
    return (ffi, lib) if lib.mc_packed_nr() else None


# (m, k, n): rows 1, a register block (14) and one past, tails split in two (15-21), two blocks less one, a row
# block (196) and past it; depths within one k chunk (256), exactly one, one past, several; widths below, at and
# past a panel (32)
@pytest.mark.parametrize("m, k, n", [(1, 5, 1), (13, 256, 33), (14, 257, 32), (15, 64, 70), (16, 40, 9),
                                     (21, 300, 40), (27, 600, 31), (28, 255, 64), (196, 300, 45), (211, 513, 96),
                                     (400, 130, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_numpys(m, k, n, bias):
    found = _gemm_library()
    if found is None:
        pytest.skip("no packed product here (float32 with AVX-512 only)")
    ffi, lib = found
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    lda, ldc = k + 3, n + 5
    a = rng.standard_normal((m, lda)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias_row = rng.standard_normal(n).astype(np.float32)
    nr = lib.mc_packed_nr()
    bp = np.empty(-(-n // nr) * nr * k, np.float32)

    def ptr(x):
        return ffi.cast("float *", ffi.from_buffer(x))
    lib.mc_pack(k, n, ptr(b), n, 0, ptr(bp))
    c = np.full(m * ldc + 64, np.float32(7.0))   # (row gaps and a tail past C's last row: must keep their 7s)
    lib.mc_test_gemm(m, n, k, ptr(a), lda, ptr(bp), ptr(c), ldc, ptr(bias_row) if bias else ffi.NULL)
    ref = a[:, :k].astype(np.float64) @ b.astype(np.float64) + (bias_row if bias else 0.0)
    rows = c[:m * ldc].reshape(m, ldc)
    assert np.abs(rows[:, :n] - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    assert (rows[:, n:] == 7.0).all() and (c[m * ldc:] == 7.0).all(), "mc_gemm_packed wrote outside C's rows"
