"""The hand-written C kernels (minicavs/engine/codegen/library_source.py) equal their numpy twins: softmax cross-
entropy rows and optimizer rules."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from minicavs.cpu.compiler import compiler
from minicavs.cpu.library import library
from minicavs.nn import Parameter
from minicavs.train.optim import SGD, Adagrad, Adam
from minicavs.core.sparse import RowSparse

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on this machine")
TOL = {"float32": 1e-5, "float64": 1e-12}


def close(a, b, dtype):
    assert a.dtype == np.dtype(dtype) and a.shape == b.shape
    assert np.max(np.abs(a - b)) <= TOL[dtype] * max(1.0, float(np.max(np.abs(b))))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("classes", [1, 5, 37, 600, 1000])   # 256-column blocks: 600 and 1000 end partly
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


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_xent_of_extreme_logits_equals_numpy(dtype):
    """Rows whose exps underflow (gaps past -104, float32 exp's zero), huge magnitudes and -inf entries, in
    rows long enough for the vector loops and their 256-column blocks: loss and gradient as numpy's float64."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 300)) * 3).astype(dtype)
    x[0, ::7] -= 150.0                              # part of the row's exps underflow to 0
    x[1] += 1e4                                     # large, close together
    x[2, 5], x[2, 290] = 1e30, -1e30                # one dominant entry
    x[3, 17] = -np.inf                              # never chosen
    x[4, :] = -1e3                                  # all equal: uniform
    labels = np.array([7, 3, 5, 1, 299, 290])
    x64 = x.astype(np.float64)
    m = x64.max(1, keepdims=True)
    lse = (m + np.log(np.exp(x64 - m).sum(1, keepdims=True)))[:, 0]
    want_loss = lse - x64[np.arange(6), labels]
    g = rng.standard_normal(6).astype(dtype)
    want = np.exp(x64 - lse[:, None])
    want[np.arange(6), labels] -= 1
    want *= g[:, None]
    lib = library(dtype)
    loss, grad = lib.xent(x, labels), lib.xent_grad(g, x, labels)
    scale = np.maximum(1.0, np.abs(want_loss))
    assert np.all(np.abs(loss - want_loss) <= TOL[dtype] * scale), (loss, want_loss)
    close(grad, want.astype(dtype), dtype)
    assert grad[3, 17] == 0
    if dtype == "float32":   # e^-158: float32's 0, not the smallest denormal
        assert grad[0, 14] == 0 and x64[0, 14] - m[0, 0] < -104


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
    ref_bad, ref_apply = opt._prepare_numpy(ref, g, ref_slots, 3, wd)     # the numpy rule
    ref_apply()
    assert not ref_bad
    close(value, ref, dtype)
    for k in opt.slots:
        close(mine[k], ref_slots[k], dtype)
    g[2, 3] = np.inf
    assert opt._prepare(p.value, g, slots, 3, wd)[0] is True
    assert opt._prepare_numpy(p.value, g, slots, 3, wd)[0] is True   # reported, not a numpy warning


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
    from minicavs.core.random import hash_words, row_key, uniform
    keys = row_key(np.array([0, 3, 3, 1 << 20]), np.array([0, 5, 6, (1 << 32) - 1]))
    wide = np.random.default_rng(cols).standard_normal((4, cols + 3)).astype(dtype)
    u = uniform(11, 4, 2, keys[:, None], np.arange(cols, dtype=np.uint64)[None, :])
    mask = ((u >= p) * (1.0 / (1.0 - p))).astype(dtype)
    for x in (np.ascontiguousarray(wide[:, 1:cols + 1]), wide[:, 1:cols + 1]):
        got = library(dtype).dropout(x, keys, int(hash_words(11, 4, 2)[0]), p)
        assert got.dtype == np.dtype(dtype) and np.array_equal(got, x * mask)
    assert 0 < np.count_nonzero(got) < got.size or cols == 1


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_coalesce_equals_row_sparse_coalesce_bit_for_bit(dtype):
    """add.reduceat's order (first row, then numpy's pairwise sum of the rest) in C: runs of 1 to 700 equal
    indices (the 8-accumulator and the recursive halves), widths across the 64-column blocks, -0 rows; indices
    sorted as 8-bit, 16-bit (to 65535) and 64-bit keys."""
    lib = library(dtype)
    rng = np.random.default_rng(7)
    for n, vocab, width in [(1, 3, 1), (9, 1, 3), (130, 1, 65), (700, 2, 5), (1500, 40, 128), (400, 900, 7),
                            (500, 1 << 16, 2), (300, 70000, 3)]:
        idx = rng.integers(0, vocab, n).astype(np.int64)
        rows = (rng.standard_normal((n, width)) * 10.0 ** rng.integers(-4, 5, (n, 1))).astype(dtype)
        want = RowSparse(idx, rows, (vocab, width)).coalesce()
        got_idx, got_rows = lib.coalesce(idx, rows)
        assert np.array_equal(got_idx, want.indices) and np.array_equal(got_rows, want.rows)
    zeros = np.full((3, 2), -0.0, dtype)
    got_idx, got_rows = lib.coalesce(np.array([4, 4, 4]), zeros)
    assert list(got_idx) == [4] and np.all(np.signbit(got_rows)) and got_rows.shape == (1, 2)
    got_idx, got_rows = lib.coalesce(np.zeros(0, np.int64), np.zeros((0, 3), dtype))
    assert got_idx.shape == (0,) and got_rows.shape == (0, 3)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("wd", [0.0, 1e-3])
def test_sgd_kernels_equal_the_numpy_rule_exactly(dtype, momentum, wd):
    """SGD's kernels are its numpy rule operation for operation (float32 hyperparameters, no FMA), so the
    optimizer may use either: equal bit for bit, dense and row-sparse."""
    rng = np.random.default_rng(1)
    p = Parameter("w", (7, 5), init=rng.standard_normal((7, 5)), dtype=dtype)
    opt = SGD([p], lr=0.03, momentum=momentum)
    slots = {s: rng.standard_normal((7, 5)).astype(dtype) for s in opt.slots}
    for g in (rng.standard_normal((7, 5)).astype(dtype),
              RowSparse(np.array([1, 4]), rng.standard_normal((2, 5)).astype(dtype), (7, 5))):
        results = []
        for prepare in (opt._prepare, opt._prepare_numpy):
            value, mine = p.value.copy(), {k: a.copy() for k, a in slots.items()}
            bad, apply = prepare(value, g, mine, 3, wd)
            assert bad is False
            apply()
            results.append((value, mine))
        (v1, s1), (v2, s2) = results
        assert np.array_equal(v1, v2) and all(np.array_equal(s1[k], s2[k]) for k in opt.slots)
        assert not np.array_equal(v1, p.value)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rule, nslots, hyper", [("sgd", 0, (0.1, 1e-3)), ("momentum", 1, (0.1, 0.9, 1e-3)),
                                                 ("adagrad", 1, (0.1, 1e-10, 1e-3)),
                                                 ("adam", 2, (0.1, 0.9, 0.999, 1e-8, 1e-3))])
def test_many_and_lazy_kernels_equal_the_per_parameter_kernel(dtype, rule, nslots, hyper):
    """update_many over a table of parameters = update on each; update_lazy on rows = update on the gathered
    rows scattered back; checking writes nothing; a non-finite result is counted."""
    lib = library(dtype)
    rng = np.random.default_rng(2)
    shapes = [(7, 5), (3,), (0, 4), (11, 2)]
    def state(shape):
        return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype),
                tuple(np.abs(rng.standard_normal(shape)).astype(dtype) for _ in range(nslots)))
    params = [state(s) for s in shapes]
    hypers = [hyper[:-1] + (wd,) for wd in (0.0, 1e-3, 0.5, 0.0)]
    copies = [(p.copy(), g, tuple(a.copy() for a in s)) for p, g, s in params]
    run = lib.update_many(rule, copies, hypers)
    assert run(False) == 0 and all(np.array_equal(c[0], p[0]) for c, p in zip(copies, params))
    run(True)
    for (p, g, slots), (cp, _, cslots), h in zip(params, copies, hypers):
        assert lib.update(rule, p, g, slots, h, True) == 0
        assert np.array_equal(p, cp) and all(np.array_equal(a, b) for a, b in zip(slots, cslots))
    table, g, slots = state((9, 3))
    idx = np.array([0, 2, 3, 8])
    rows = rng.standard_normal((4, 3)).astype(dtype)
    gathered, gslots = table[idx], tuple(a[idx] for a in slots)
    lib.update(rule, gathered, rows, gslots, hyper, True)
    before = table.copy()
    lazy = lib.update_lazy(rule, table, idx, rows, slots, hyper)
    assert lazy(False) == 0 and np.array_equal(table, before)
    lazy(True)
    assert np.array_equal(table[idx], gathered) and all(np.array_equal(a[idx], b) for a, b in zip(slots, gslots))
    rest = np.setdiff1d(np.arange(9), idx)
    assert np.array_equal(table[rest], before[rest])
    rows[1, 2] = np.nan
    assert lib.update_lazy(rule, table, idx, rows, slots, hyper)(False) > 0
    params[1][1][0] = np.inf
    assert lib.update_many(rule, params, hypers)(False) > 0


# Per rule: (hyperparameters, slot values) and, per result that must stay finite, a (gradient, parameter, slots)
# element that makes that result not finite (slots None: the usual values).
NON_FINITE = {
    "sgd": ((1e30, 0.0), (), {"gi": (np.inf, 1.0, None), "pi": (1e30, 1.0, None)}),
    "momentum": ((1.0, 0.5, 0.0), (1e38,), {"gi": (np.nan, 1.0, None), "ui": (3e38, 1.0, None),
                                             "pi": (1e38, -3e38, None)}),
    "adagrad": ((1e30, 1e-10, 0.0), (1.0,), {"gi": (-np.inf, 1.0, None), "ai": (1e20, 1.0, None),
                                              "pi": (-1e9, 1.0, None)}),
    "adam": ((1.0, 0.5, 0.5, 1e-8, 0.0), (1.0, 1.0),
             {"gi": (np.nan, 1.0, None), "mi": (1.0, 1.0, (np.inf, 1.0)), "vi": (1e20, 1.0, None),
              "pi": (0.0, np.inf, None)}),
}


@pytest.mark.parametrize("rule", sorted(NON_FINITE))
def test_check_pass_finds_each_non_finite_result_at_every_position(rule):
    """The check pass (one float sum of x - x over the results, vectorized) flags a single non-finite result,
    whichever result it is and wherever it lies: in a vector's body or its remainder, in the first, a middle
    or the last parameter of a table; every finite case passes, and nothing is written."""
    lib = library("float32")
    hyper, slot_values, cases = NON_FINITE[rule]
    for n in (1, 15, 16, 17, 40, 1000):
        for what, (g_bad, p_bad, slots_bad) in cases.items():
            for pos in sorted({0, n // 2, n - 1}):
                for which in range(3):   # the bad element in parameter 0, 1 or 2 of a table
                    entries = []
                    for k in range(3):
                        p, g = np.full(n, 0.5, np.float32), np.full(n, 0.25, np.float32)
                        slots = tuple(np.full(n, v, np.float32) for v in slot_values)
                        if k == which:
                            g[pos], p[pos] = g_bad, p_bad
                            for a, v in zip(slots, slots_bad or slot_values):
                                a[pos] = v
                        entries.append((p, g, slots))
                    before = [(p.copy(), tuple(a.copy() for a in s)) for p, _, s in entries]
                    assert lib.update_many(rule, entries, [hyper] * 3)(False) != 0, (rule, what, n, pos, which)
                    one = entries[which]
                    assert lib.update(rule, one[0], one[1], one[2], hyper, False) != 0
                    for (p, _, slots), (p0, s0) in zip(entries, before):
                        assert np.array_equal(p, p0, equal_nan=True)
                        assert all(np.array_equal(a, b) for a, b in zip(slots, s0))
        fine = [(np.full(n, 0.5, np.float32), np.full(n, 0.25, np.float32),
                 tuple(np.full(n, 1.0, np.float32) for _ in slot_values))] * 3
        assert lib.update_many(rule, fine, [(1e-3,) + hyper[1:]] * 3)(False) == 0


def test_update_table_does_not_outlive_its_owner():
    """An optimizer's kernel table (checked arrays and addresses) lives with the optimizer: a discarded
    model's parameter and slot arrays are freed, not kept by the library."""
    import gc
    import weakref
    ps = [Parameter("W", (30, 20), init=np.ones((30, 20)), dtype="float32"),
          Parameter("b", (20,), init=np.zeros(20), dtype="float32")]
    opt = Adam(ps, lr=0.01)
    grads = {"W": np.ones((30, 20), np.float32), "b": np.ones(20, np.float32)}
    assert opt._native(grads, None) is not None
    opt.step(grads)
    opt.step(grads)
    refs = [weakref.ref(ps[0].value), weakref.ref(opt.state["b"]["m"])]
    del opt, ps, grads
    gc.collect()
    assert all(r() is None for r in refs)


def test_many_lazy_and_coalesce_refuse_what_would_leave_their_buffers():
    from minicavs.core.errors import FeedError
    lib = library("float32")
    p, g, s = np.ones((4, 3), np.float32), np.ones((4, 3), np.float32), np.ones((4, 3), np.float32)
    h = (0.1, 1e-10, 0.0)
    for bad in [(p, np.ones((3, 3), np.float32), (s,)), (p, g.astype(np.float64), (s,)), (p, g[:, ::2], (s,)),
                (p, g, (np.ones((4, 2), np.float32),)), (p[:, ::2], g[:, ::2].copy(), (s[:, ::2],))]:
        with pytest.raises(FeedError, match="update adagrad"):
            lib.update_many("adagrad", [bad], [h])
    with pytest.raises(ValueError, match="slots"):
        lib.update_many("adagrad", [(p, g, ())], [h])
    rows = np.ones((2, 3), np.float32)
    for idx in ([0, 4], [-1, 2], [2, 1], [1, 1]):
        with pytest.raises(FeedError, match="sorted, unique and in"):
            lib.update_lazy("adagrad", p, np.array(idx), rows, (s,), h)
    for idx, r in ((np.array([0, 1], np.int32), rows), (np.array([0, 1]), np.ones((3, 3), np.float32)),
                   (np.array([0, 1]), np.ones((2, 2), np.float32))):
        with pytest.raises(FeedError, match="update adagrad"):
            lib.update_lazy("adagrad", p, idx, r, (s,), h)
    for idx, r in ((np.array([0, 1], np.int32), rows), (np.array([0, 1]), np.ones((3, 3), np.float32)),
                   (np.array([[0, 1]]), rows), (np.array([0, 1]), rows.astype(np.float64))):
        with pytest.raises(FeedError, match="coalesce"):
            lib.coalesce(idx, r)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(0, 3), (1, 1), (1, 9), (9, 1), (8, 8), (13, 37), (33, 17), (64, 256)])
def test_contiguous_copy_of_a_transposed_view_equals_numpy(dtype, shape):
    lib = library(dtype)
    a = np.random.default_rng(shape[0]).standard_normal(shape).astype(dtype)
    got = lib.contiguous(a.T)
    assert got.flags.c_contiguous and got.dtype == np.dtype(dtype) and np.array_equal(got, a.T)
    assert lib.contiguous(a) is a                                # already contiguous: no copy
    strided = a[:, ::2]
    assert np.array_equal(lib.contiguous(strided), strided) and lib.contiguous(strided).flags.c_contiguous
    with pytest.raises(Exception, match="contiguous: need a 2-D"):
        lib.contiguous(a.ravel())


@pytest.mark.parametrize("threads", [2, 3, 64])
def test_xent_rows_split_over_threads_equal_one_call(threads, monkeypatch):
    """Large arrays split their rows over the BLAS's threads (cpu/library.over_rows): each row is computed as
    in one call, so the results are the same bits, also with more threads than rows and a leading batch axis."""
    cl = importlib.import_module("minicavs.cpu.library")   # the package exports the function of that name
    lib = library("float32")
    rng = np.random.default_rng(threads)
    x = (rng.standard_normal((2, 5, 37)) * 4).astype(np.float32)
    labels = rng.integers(0, 37, (2, 5))
    g = rng.standard_normal((2, 5)).astype(np.float32)
    one = lib.xent(x, labels), lib.xent_grad(g, x, labels)
    calls = []
    monkeypatch.setattr(cl, "blas_threads", lambda: threads)
    monkeypatch.setattr(cl, "PARALLEL_ELEMENTS", 1)
    real = cl.over_rows
    monkeypatch.setattr(cl, "over_rows", lambda rows, cols, run: real(rows, cols, lambda lo, hi: (
        calls.append((lo, hi)), run(lo, hi))))
    split = lib.xent(x, labels), lib.xent_grad(g, x, labels)
    assert np.array_equal(one[0], split[0]) and np.array_equal(one[1], split[1])
    k = min(threads, 10)
    assert sorted(calls) == sorted(2 * [(10 * i // k, 10 * (i + 1) // k) for i in range(k)])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 7, 5), (9, 1, 3), (13, 37, 600), (300, 64, 260)])
def test_linear_with_the_bias_in_the_gemm_equals_numpy(dtype, shape, monkeypatch):
    """x·w + b with b in the GEMM's C operand (beta = 1), for C-contiguous and transposed operands; None (numpy
    then runs) for what one BLAS call cannot read: a strided operand, another dtype, shapes that do not fit."""
    monkeypatch.setattr(importlib.import_module("minicavs.cpu.library"), "LINEAR_ELEMENTS", 1)
    lib = library(dtype)
    rng = np.random.default_rng(sum(shape))
    rows, k, n = shape
    x, w, b = (rng.standard_normal(s).astype(dtype) for s in ((rows, k), (k, n), (n,)))
    want = x.astype(np.float64) @ w.astype(np.float64) + b
    for xv in (x, np.ascontiguousarray(x.T).T):
        for wv in (w, np.ascontiguousarray(w.T).T):
            got = lib.linear(xv, wv, b)
            close(got, want.astype(dtype), dtype)
            assert got.flags.c_contiguous
    wide, two_b = rng.standard_normal((rows + 1, 2 * k + 2)).astype(dtype), np.stack([b, b], 1)
    for args in ((wide[:rows, :2 * k:2], w, b) if rows > 1 and k > 1 else (x, w, two_b),
                 (x.astype(np.float16), w, b), (x, w, b[1:]), (x, w, two_b[:, 0] if n > 1 else b[:0])):
        assert lib.linear(*args) is None
    assert lib.linear(x[:0], w, b) is None                        # nothing to multiply: numpy's empty result


def test_small_products_are_left_to_numpy():
    """Below LINEAR_ELEMENTS output elements Library.linear answers None (numpy's call costs less than the
    cffi set-up), whatever its operands: a batch of one's classifier head takes that path."""
    lib = library("float32")
    x, w, b = np.ones((37, 128), np.float32), np.ones((128, 5), np.float32), np.ones(5, np.float32)
    assert lib.linear(x, w, b) is None
    assert lib.linear(x, w, b[:2]) is None and lib.linear(x.ravel(), w, b) is None
    big = np.ones((20000, 128), np.float32)
    np.testing.assert_array_equal(lib.linear(big, w, b), np.full((20000, 5), 129, np.float32))
