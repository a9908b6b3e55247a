"""The hand-written C kernels equal their numpy twins: softmax cross-entropy rows and optimizer rules."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.cpu.compiler import compiler
from minicavs.cpu.library import library
from minicavs.nn import Parameter
from minicavs.optim import Adagrad, Adam, Optimizer
from minicavs.sparse import RowSparse

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")
TOL = {"float32": 1e-5, "float64": 1e-12}


def close(a, b, dtype):
    assert a.dtype == np.dtype(dtype) and a.shape == b.shape
    assert np.max(np.abs(a - b)) <= TOL[dtype] * max(1.0, float(np.max(np.abs(b))))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("classes", [1, 5, 37, 600])
def test_xent_rows_equal_numpy(dtype, classes):
    rng = np.random.default_rng(classes)
    x = (rng.standard_normal((13, classes)) * 4).astype(dtype)
    labels = rng.integers(0, classes, 13)
    x64 = x.astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1)
    lib = library(dtype)
    close(lib.xent(x, labels), (lse - x64[np.arange(13), labels]).astype(dtype), dtype)
    g = rng.standard_normal(13).astype(dtype)
    want = np.exp(x64 - lse[:, None])
    want[np.arange(13), labels] -= 1
    close(lib.xent_grad(g, x, labels), (want * g[:, None]).astype(dtype), dtype)


def test_xent_propagates_non_finite_logits():
    x = np.zeros((3, 4), np.float32)
    x[1, 2] = np.nan
    x[2, 0] = np.inf
    loss = library("float32").xent(x, np.array([0, 1, 3]))
    assert np.isfinite(loss[0]) and np.isnan(loss[1]) and not np.isfinite(loss[2])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("cls, kwargs", [(Adam, {"lr": 0.01}), (Adagrad, {"lr": 0.05})])
@pytest.mark.parametrize("wd", [0.0, 1e-3])
def test_optimizer_kernels_equal_numpy_rules(dtype, cls, kwargs, wd):
    rng = np.random.default_rng(0)
    p = Parameter("w", (7, 5), init=rng.standard_normal((7, 5)), dtype=dtype)
    opt = cls([p], **kwargs)
    slots = {s: np.abs(rng.standard_normal((7, 5))).astype(dtype) for s in opt.slots}
    g = rng.standard_normal((7, 5)).astype(dtype)
    value, mine = p.value.copy(), {k: a.copy() for k, a in slots.items()}
    bad, apply = opt._prepare(value, g, mine, 3, wd)                        # the compiled kernel
    assert bad is False and np.array_equal(value, p.value)                  # checking changes nothing
    apply()
    ref, ref_slots = p.value.copy(), {k: a.copy() for k, a in slots.items()}
    ref_bad, ref_apply = Optimizer._prepare(opt, ref, g, ref_slots, 3, wd)  # the numpy rule
    ref_apply()
    assert not ref_bad
    close(value, ref, dtype)
    for k in opt.slots:
        close(mine[k], ref_slots[k], dtype)
    g[2, 3] = np.inf
    assert opt._prepare(p.value, g, slots, 3, wd)[0] is True


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("cls, kwargs", [(Adam, {"lr": 0.01}), (Adagrad, {"lr": 0.05})])
@pytest.mark.parametrize("rows", [[], [0], [2, 3, 6], [0, 1, 2, 3, 4, 5, 6]])
def test_row_sparse_kernels_equal_the_dense_kernels(dtype, cls, kwargs, rows):
    """A coalesced row-sparse gradient updates every row exactly as its dense twin does (weight decay and
    slot decay on the rows it does not hold), bit for bit, and non-finite results are caught in either."""
    rng = np.random.default_rng(len(rows))
    p = Parameter("E", (7, 5), init=rng.standard_normal((7, 5)), dtype=dtype)
    opt = cls([p], **kwargs)
    slots = {s: np.abs(rng.standard_normal((7, 5))).astype(dtype) for s in opt.slots}
    idx = np.array(rows, np.int64)
    g = RowSparse(idx, rng.standard_normal((len(rows), 5)).astype(dtype), (7, 5))
    results = []
    for grad in (g, g.to_dense()):
        value, mine = p.value.copy(), {k: a.copy() for k, a in slots.items()}
        bad, apply = opt._prepare(value, grad, mine, 3, 1e-3)
        assert bad is False and np.array_equal(value, p.value)
        apply()
        results.append((value, mine))
    (v1, s1), (v2, s2) = results
    assert np.array_equal(v1, v2) and all(np.array_equal(s1[k], s2[k]) for k in opt.slots)
    assert np.all(v1 != p.value)  # every row moved, looked up or not
    if rows:
        g.rows[-1, 2] = np.inf
        assert opt._prepare(p.value, g, slots, 3, 1e-3)[0] is True
    huge = p.value.copy()
    huge[1, 0] = np.finfo(dtype).max  # (wd * p)^2 overflows the slot on a row without a gradient row
    assert opt._prepare(huge, RowSparse(idx[idx != 1], np.ones((int(np.sum(idx != 1)), 5), dtype), (7, 5)),
                        slots, 3, 1e3)[0] is True


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("cols", [1, 7, 300])
def test_dropout_kernel_equals_x_times_the_numpy_mask(dtype, p, cols):
    """x times random.py's mask (keep where uniform(seed, step, site, key, column) >= p), bit for bit, for a
    contiguous x and a row-strided view."""
    from minicavs.random import hash_words, row_key, uniform
    keys = row_key(np.array([0, 3, 3, 1 << 20]), np.array([0, 5, 6, (1 << 32) - 1]))
    wide = np.random.default_rng(cols).standard_normal((4, cols + 3)).astype(dtype)
    u = uniform(11, 4, 2, keys[:, None], np.arange(cols, dtype=np.uint64)[None, :])
    mask = ((u >= p) * (1.0 / (1.0 - p))).astype(dtype)
    for x in (np.ascontiguousarray(wide[:, 1:cols + 1]), wide[:, 1:cols + 1]):
        got = library(dtype).dropout(x, keys, int(hash_words(11, 4, 2)[0]), p)
        assert got.dtype == np.dtype(dtype) and np.array_equal(got, x * mask)
    assert 0 < np.count_nonzero(got) < got.size or cols == 1
