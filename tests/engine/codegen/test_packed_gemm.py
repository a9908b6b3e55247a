"""The packed product's packing (codegen/packed_gemm.py's ``mc_pack``, through the C runner's interpreter): every
panel holds the static's columns as numpy lays them out, zeros past its width, for a static stored as is or
transposed, at widths and row strides that are not multiples of a panel's or a vector's."""
import numpy as np
import pytest

from minicavs.cpu import c_runner


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
