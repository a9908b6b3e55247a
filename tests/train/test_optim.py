"""Optimizers: training progress, updates against hand-written numpy, weight decay, clipping, the
validate-before-touch rule, row-sparse gradients (dense semantics and lazy updates), state round trips."""
import numpy as np
import pytest

import minicavs as mc
from minicavs import NonFiniteError, ops
from minicavs.nn import Parameter, ParameterSet
from minicavs.train.optim import SGD, Adagrad, Adam, make_optimizer
from minicavs.core.sparse import RowSparse

# --- a small MLP on a fixed regression task ---------------------------------------------------------


def regression_task():
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (64, 3))
    y = np.sin(2 * x[:, :1]) + x[:, 1:2] * x[:, 2:3]
    return x.astype(np.float32), y.astype(np.float32)


def mlp(seed=0):
    ps = ParameterSet()
    w1 = ps.new("W1", (3, 16), rng=seed)
    b1 = ps.new("b1", (16,), init="zeros", weight_decay=False)
    w2 = ps.new("W2", (16, 1), rng=seed)
    b2 = ps.new("b2", (1,), init="zeros", weight_decay=False)
    x = ops.input((None, 3), name="x")
    y = ops.input((None, 1), name="y")
    loss = ops.mse(ops.linear(ops.tanh(ops.linear(x, w1.node, b1.node)), w2.node, b2.node), y)
    return ps, mc.Executor([loss] + mc.grad(loss, ps.nodes))


BOUND = 0.05  # the untrained loss is ~0.89; y has variance ~0.72

OPTIMIZERS = {
    "sgd": lambda ps: SGD(ps, lr=0.3),
    "momentum": lambda ps: SGD(ps, lr=0.1, momentum=0.9),
    "adagrad": lambda ps: Adagrad(ps, lr=0.1),
    "adam": lambda ps: Adam(ps, lr=0.02),
    "adam_wd_clip": lambda ps: Adam(ps, lr=0.02, weight_decay=1e-4, clip_norm=1.0),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_trains_a_small_mlp(kind):
    x, y = regression_task()
    ps, ex = mlp()
    opt = OPTIMIZERS[kind](ps)
    first = None
    for _ in range(200):
        loss, *grads = ex.run({"x": x, "y": y}, ps)
        first = float(loss) if first is None else first
        opt.step(dict(zip(ps, grads)), loss=loss)
    final = float(ex.run({"x": x, "y": y}, ps)[0])
    assert first > BOUND
    assert final < BOUND
    assert opt.steps == 200


# --- updates against a hand-written numpy reference -------------------------------------------------


def two_params(seed=0):
    rng = np.random.default_rng(seed)
    a = Parameter("a", (3, 2), init=rng.standard_normal((3, 2)), dtype="float64")
    b = Parameter("b", (4,), init=rng.standard_normal(4), dtype="float64", weight_decay=False)
    return ParameterSet([a, b])


def random_grads(ps, rng):
    return {name: rng.standard_normal(p.shape) for name, p in ps.items()}


def reference_run(kind, values, grads_seq, lr, wd, decays, **h):
    """Plain numpy versions of the update rules, written out independently of minicavs.train.optim."""
    p = {k: v.copy() for k, v in values.items()}
    s1 = {k: np.zeros_like(v) for k, v in values.items()}
    s2 = {k: np.zeros_like(v) for k, v in values.items()}
    for t, grads in enumerate(grads_seq, start=1):
        for k, g in grads.items():
            g = g + (wd * p[k] if decays[k] else 0.0)
            if kind == "sgd":
                s1[k] = h.get("momentum", 0.0) * s1[k] + g
                p[k] = p[k] - lr * s1[k]
            elif kind == "adagrad":
                s1[k] = s1[k] + g ** 2
                p[k] = p[k] - lr * g / (np.sqrt(s1[k]) + h["eps"])
            else:
                b1, b2 = h["beta1"], h["beta2"]
                s1[k] = b1 * s1[k] + (1 - b1) * g
                s2[k] = b2 * s2[k] + (1 - b2) * g ** 2
                mhat, vhat = s1[k] / (1 - b1 ** t), s2[k] / (1 - b2 ** t)
                p[k] = p[k] - lr * mhat / (np.sqrt(vhat) + h["eps"])
    return p, s1, s2


CASES = [
    ("sgd", SGD, dict(lr=0.1), dict()),
    ("sgd", SGD, dict(lr=0.1, momentum=0.8, weight_decay=0.01), dict(momentum=0.8)),
    ("adagrad", Adagrad, dict(lr=0.5, eps=1e-6, weight_decay=0.1), dict(eps=1e-6)),
    ("adam", Adam, dict(lr=0.01, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.05),
     dict(beta1=0.8, beta2=0.95, eps=1e-7)),
]


@pytest.mark.parametrize("kind, cls, kwargs, h", CASES)
def test_update_matches_numpy(kind, cls, kwargs, h):
    ps = two_params()
    start = {k: p.value.copy() for k, p in ps.items()}
    rng = np.random.default_rng(1)
    seq = [random_grads(ps, rng) for _ in range(3)]
    opt = cls(ps, **kwargs)
    for g in seq:
        opt.step(g)
    want, s1, s2 = reference_run(kind, start, seq, kwargs["lr"], kwargs.get("weight_decay", 0.0),
                                 {"a": True, "b": False}, **h)
    for k, p in ps.items():
        np.testing.assert_allclose(p.value, want[k], rtol=1e-12, atol=1e-14)
        assert not np.array_equal(p.value, start[k])
    if kind == "adam":
        np.testing.assert_allclose(opt.state["a"]["m"], s1["a"], rtol=1e-12)
        np.testing.assert_allclose(opt.state["a"]["v"], s2["a"], rtol=1e-12)
    elif kind == "adagrad":
        np.testing.assert_allclose(opt.state["b"]["sum_sq"], s1["b"], rtol=1e-12)
    assert opt.steps == 3


def test_adam_first_step_moves_each_element_by_lr():
    ps = two_params()
    before = ps["a"].value.copy()
    g = np.random.default_rng(2).standard_normal((3, 2))
    Adam(ps, lr=0.01, eps=0.0).step({"a": g})  # bias correction: m_hat/sqrt(v_hat) = sign(g)
    np.testing.assert_allclose(ps["a"].value - before, -0.01 * np.sign(g), rtol=1e-12)


def test_float32_parameters_stay_float32():
    p = Parameter("w", (3,), init=np.ones(3))
    opt = Adam([p], lr=0.1)
    opt.step({"w": np.ones(3)})  # float64 gradient into a float32 parameter
    assert p.value.dtype == np.float32 and opt.state["w"]["m"].dtype == np.float32
    np.testing.assert_allclose(p.value, 0.9, rtol=1e-6)


# --- weight decay and its opt-out -------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda ps: SGD(ps, lr=0.5, weight_decay=0.1),
                                  lambda ps: SGD(ps, lr=0.5, momentum=0.9, weight_decay=0.1),
                                  lambda ps: Adagrad(ps, lr=0.01, weight_decay=0.1),
                                  lambda ps: Adam(ps, lr=0.01, weight_decay=0.1)])
def test_weight_decay_and_opt_out(make):
    ps = two_params()
    a0, b0 = ps["a"].value.copy(), ps["b"].value.copy()
    opt = make(ps)
    opt.step({"a": np.zeros((3, 2)), "b": np.zeros(4)})
    assert np.all(np.abs(ps["a"].value) < np.abs(a0))  # pulled towards zero by the L2 term alone
    np.testing.assert_array_equal(ps["b"].value, b0)    # opted out: a zero gradient changes nothing


def test_weight_decay_is_added_to_the_gradient():
    ps = two_params()
    a0 = ps["a"].value.copy()
    g = np.full((3, 2), 0.3)
    SGD(ps, lr=0.5, weight_decay=0.1).step({"a": g})
    np.testing.assert_allclose(ps["a"].value, a0 - 0.5 * (g + 0.1 * a0), rtol=1e-15)


# --- global-norm clipping ---------------------------------------------------------------------------


def test_clipping_scales_to_the_norm():
    ps = two_params()
    before = {k: p.value.copy() for k, p in ps.items()}
    g = {"a": np.full((3, 2), 2.0), "b": np.full(4, -4.0)}  # norm sqrt(6*4 + 4*16) = sqrt(88)
    norm = SGD(ps, lr=1.0, clip_norm=2.0).step(g)
    assert norm == pytest.approx(np.sqrt(88.0), rel=1e-15)
    deltas = {k: before[k] - ps[k].value for k in ps}
    total = np.sqrt(sum(np.sum(d ** 2) for d in deltas.values()))
    assert total == pytest.approx(2.0, rel=1e-12)
    for k in ps:  # direction kept
        np.testing.assert_allclose(deltas[k], g[k] * 2.0 / np.sqrt(88.0), rtol=1e-12)


def test_clipping_leaves_small_gradients_and_excludes_weight_decay():
    ps = two_params()
    a0 = ps["a"].value.copy()
    g = np.full((3, 2), 0.1)  # norm ~0.245 < 1, but the decay term is much larger
    norm = SGD(ps, lr=1.0, clip_norm=1.0, weight_decay=10.0).step({"a": g})
    assert norm == pytest.approx(np.sqrt(6 * 0.01))
    np.testing.assert_allclose(ps["a"].value, a0 - (g + 10.0 * a0), rtol=1e-14)


def test_clipping_counts_row_sparse_rows():
    table = Parameter("E", (5, 2), init="zeros", dtype="float64")
    g = RowSparse(np.array([1, 1, 3]), np.array([[3.0, 0.0], [0.0, 0.0], [0.0, 4.0]]), (5, 2))
    for lazy in (False, True):
        table.value[...] = 0
        norm = SGD([table], lr=1.0, clip_norm=1.0, sparse_updates=lazy).step({"E": g})
        assert norm == pytest.approx(5.0)
        np.testing.assert_allclose(table.value[[1, 3]], [[-0.6, 0.0], [0.0, -0.8]])


def test_no_norm_without_clipping():
    assert SGD(two_params(), lr=0.1).step({"b": np.ones(4)}) is None


# --- validation happens before anything changes -----------------------------------------------------


def snapshot(ps, opt):
    return ({k: p.value.copy() for k, p in ps.items()},
            {k: {s: a.copy() for s, a in d.items()} for k, d in opt.state.items()}, opt.steps)


def assert_unchanged(ps, opt, snap):
    values, state, steps = snap
    for k, p in ps.items():
        np.testing.assert_array_equal(p.value, values[k])
    for k, d in opt.state.items():
        for s, a in d.items():
            np.testing.assert_array_equal(a, state[k][s])
    assert opt.steps == steps


def table_params():
    rng = np.random.default_rng(3)
    return ParameterSet([Parameter("E", (6, 2), init=rng.standard_normal((6, 2)), dtype="float64"),
                         Parameter("W", (2, 2), init=rng.standard_normal((2, 2)), dtype="float64")])


def good_grads():
    return {"E": RowSparse(np.array([0, 4]), np.ones((2, 2)), (6, 2)), "W": np.ones((2, 2))}


BAD = [
    ("nan loss", dict(loss=np.float32("nan")), {}, NonFiniteError, "loss is nan"),
    ("inf loss", dict(loss=float("inf")), {}, NonFiniteError, "loss is inf"),
    ("nan dense", {}, {"W": np.array([[1.0, np.nan], [0, 0]])}, NonFiniteError, "'W'"),
    ("inf sparse", {}, {"E": RowSparse(np.array([1]), np.array([[np.inf, 0.0]]), (6, 2))},
     NonFiniteError, "'E'"),
    ("dense shape", {}, {"W": np.ones((2, 3))}, ValueError, r"'W' has shape \(2, 3\)"),
    ("sparse shape", {}, {"E": RowSparse(np.array([1]), np.ones((1, 2)), (7, 2))}, ValueError, "'E'"),
    ("sparse rows", {}, {"E": RowSparse(np.array([1]), np.ones((1, 3)), (6, 2))}, ValueError, "'E'"),
    ("sparse index", {}, {"E": RowSparse(np.array([6]), np.ones((1, 2)), (6, 2))}, ValueError,
     "'E': index out of range"),
    ("negative sparse index", {}, {"E": RowSparse(np.array([2, -1, 3]), np.ones((3, 2)), (6, 2))}, ValueError,
     r"'E': index out of range \[0, 6\): -1 at position 1"),
    ("float indices", {}, {"E": RowSparse(np.array([1.0]), np.ones((1, 2)), (6, 2))}, ValueError, "'E'"),
    ("unknown", {}, {"V": np.ones(2)}, ValueError, "unknown parameter 'V'"),
    ("int grad", {}, {"W": np.ones((2, 2), dtype=np.int64)}, ValueError, "'W' has dtype int64"),
]


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("make", [lambda ps, lazy: SGD(ps, lr=0.1, momentum=0.9, sparse_updates=lazy),
                                  lambda ps, lazy: Adagrad(ps, lr=0.1, sparse_updates=lazy),
                                  lambda ps, lazy: Adam(ps, lr=0.1, clip_norm=1.0, weight_decay=0.1,
                                                        sparse_updates=lazy)])
@pytest.mark.parametrize("what, kwargs, override, exc, match", BAD, ids=[b[0] for b in BAD])
def test_bad_step_raises_and_changes_nothing(make, lazy, what, kwargs, override, exc, match):
    ps = table_params()
    opt = make(ps, lazy)
    opt.step(good_grads(), loss=1.0)  # non-zero state to protect
    snap = snapshot(ps, opt)
    grads = good_grads()  # valid gradients come first, so a careless optimizer would apply them
    grads.update(override)
    with pytest.raises(exc, match=match):
        opt.step(grads, **kwargs)
    assert_unchanged(ps, opt, snap)
    opt.step(good_grads())  # still usable
    assert opt.steps == 2


def test_overflowing_update_raises_and_changes_nothing():
    ps = ParameterSet([Parameter("a", (2,), init=np.ones(2)), Parameter("b", (2,), init=np.ones(2))])
    opt = SGD(ps, lr=1e30, momentum=0.5)
    snap = snapshot(ps, opt)
    with pytest.raises(NonFiniteError, match="'b'"):
        opt.step({"a": np.full(2, 1e-40), "b": np.full(2, 1e10, np.float32)})  # float32 overflow in b
    assert_unchanged(ps, opt, snap)


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1, clip_norm=1.0), lambda ps: Adam(ps, lr=0.1, clip_norm=1.0, sparse_updates=True)])
@pytest.mark.parametrize("big", [{"W": np.full((2, 2), 1e200)},
                                 {"E": RowSparse(np.array([1, 2]), np.full((2, 2), 1e160), (6, 2))}])
def test_overflowing_norm_raises_and_changes_nothing(make, big):
    """Finite gradients whose squared norm overflows float64: NonFiniteError (not numpy's overflow warning,
    an error under ``-W error``), nothing changed."""
    ps = table_params()
    opt = make(ps)
    opt.step(good_grads())
    snap = snapshot(ps, opt)
    with pytest.raises(NonFiniteError, match="global gradient norm overflows"):
        opt.step({**good_grads(), **big})
    assert_unchanged(ps, opt, snap)


def test_missing_gradient_skips_the_parameter():
    ps = two_params()
    opt = Adam(ps, lr=0.1)
    opt.step({"a": np.ones((3, 2)), "b": np.ones(4)})
    snap_b = (ps["b"].value.copy(), opt.state["b"]["m"].copy())
    opt.step({"a": np.ones((3, 2)), "b": None})
    np.testing.assert_array_equal(ps["b"].value, snap_b[0])
    np.testing.assert_array_equal(opt.state["b"]["m"], snap_b[1])


# --- row-sparse gradients ---------------------------------------------------------------------------


def sparse_grads(rng, steps):
    out = []
    for _ in range(steps):
        idx = rng.integers(0, 6, size=5)  # repeats likely
        out.append({"E": RowSparse(idx, rng.standard_normal((5, 2)), (6, 2)),
                    "W": rng.standard_normal((2, 2))})
    return out


MAKERS = [lambda ps, **k: SGD(ps, lr=0.1, **k), lambda ps, **k: SGD(ps, lr=0.1, momentum=0.9, **k),
          lambda ps, **k: Adagrad(ps, lr=0.1, **k), lambda ps, **k: Adam(ps, lr=0.1, **k)]


@pytest.mark.parametrize("extra", [{}, dict(weight_decay=0.1, clip_norm=1.5)])
@pytest.mark.parametrize("make", MAKERS)
def test_default_sparse_equals_dense(make, extra):
    ps_s, ps_d = table_params(), table_params()
    opt_s, opt_d = make(ps_s, **extra), make(ps_d, **extra)
    for grads in sparse_grads(np.random.default_rng(4), 3):
        opt_s.step(grads)
        opt_d.step({"E": grads["E"].to_dense(), "W": grads["W"]})
    for k in ps_s:
        np.testing.assert_array_equal(ps_s[k].value, ps_d[k].value)
        for s in opt_s.state[k]:
            np.testing.assert_array_equal(opt_s.state[k][s], opt_d.state[k][s])


@pytest.mark.parametrize("make", MAKERS)
def test_lazy_touches_only_looked_up_rows(make):
    ps = table_params()
    opt = make(ps, sparse_updates=True, weight_decay=0.1)
    opt.step({"E": np.random.default_rng(5).standard_normal((6, 2))})  # dense step: all slots non-zero
    snap = snapshot(ps, opt)
    g = RowSparse(np.array([4, 1, 4]), np.random.default_rng(6).standard_normal((3, 2)), (6, 2))
    opt.step({"E": g})
    untouched = [0, 2, 3, 5]
    np.testing.assert_array_equal(ps["E"].value[untouched], snap[0]["E"][untouched])
    for s, a in opt.state["E"].items():
        np.testing.assert_array_equal(a[untouched], snap[1]["E"][s][untouched])
    assert not np.array_equal(ps["E"].value[[1, 4]], snap[0]["E"][[1, 4]])


def test_lazy_adam_rows_follow_the_rule_with_global_step():
    ps = table_params()
    opt = Adam(ps, lr=0.1, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, sparse_updates=True)
    rng = np.random.default_rng(7)
    opt.step({"E": rng.standard_normal((6, 2))})
    opt.step({"E": rng.standard_normal((6, 2))})
    p0, m0, v0 = ps["E"].value.copy(), opt.state["E"]["m"].copy(), opt.state["E"]["v"].copy()
    rows = rng.standard_normal((3, 2))
    opt.step({"E": RowSparse(np.array([4, 1, 4]), rows, (6, 2))})
    t = 3
    for r, g in ((1, rows[1]), (4, rows[0] + rows[2])):  # duplicates are summed
        g = g + 0.1 * p0[r]
        m = 0.8 * m0[r] + 0.2 * g
        v = 0.9 * v0[r] + 0.1 * g * g
        want = p0[r] - 0.1 * (m / (1 - 0.8 ** t)) / (np.sqrt(v / (1 - 0.9 ** t)) + 1e-8)
        np.testing.assert_allclose(ps["E"].value[r], want, rtol=1e-13)
        np.testing.assert_allclose(opt.state["E"]["m"][r], m, rtol=1e-13)


def test_lazy_momentum_is_not_decayed_on_untouched_rows():
    e = Parameter("E", (3, 1), init="zeros", dtype="float64")
    opt = SGD([e], lr=1.0, momentum=0.5, sparse_updates=True)
    opt.step({"E": RowSparse(np.array([0, 1]), np.ones((2, 1)), (3, 1))})
    opt.step({"E": RowSparse(np.array([1]), np.ones((1, 1)), (3, 1))})
    np.testing.assert_array_equal(opt.state["E"]["momentum"][:, 0], [1.0, 1.5, 0.0])
    np.testing.assert_array_equal(e.value[:, 0], [-1.0, -2.5, 0.0])
    dense = Parameter("E", (3, 1), init="zeros", dtype="float64")  # dense semantics keep moving row 0
    opt = SGD([dense], lr=1.0, momentum=0.5)
    opt.step({"E": RowSparse(np.array([0, 1]), np.ones((2, 1)), (3, 1))})
    opt.step({"E": RowSparse(np.array([1]), np.ones((1, 1)), (3, 1))})
    np.testing.assert_array_equal(dense.value[:, 0], [-1.5, -2.5, 0.0])


def test_lazy_adagrad_without_decay_equals_dense():
    ps_l, ps_d = table_params(), table_params()
    opt_l, opt_d = Adagrad(ps_l, lr=0.1, sparse_updates=True), Adagrad(ps_d, lr=0.1)
    for grads in sparse_grads(np.random.default_rng(8), 4):
        opt_l.step(grads)
        opt_d.step(grads)
    for k in ps_l:
        np.testing.assert_array_equal(ps_l[k].value, ps_d[k].value)
        np.testing.assert_array_equal(opt_l.state[k]["sum_sq"], opt_d.state[k]["sum_sq"])


def test_embedding_gradient_from_autodiff():
    """The RowSparse a lookup's gradient produces goes straight into the optimizer."""
    table = Parameter("E", (5, 3), dtype="float64", rng=1)
    idx = ops.input((None,), dtype="int64", name="idx")
    loss = ops.sum(ops.lookup(table.node, idx))
    g, = mc.Executor(mc.grad(loss, [table.node])).run({"idx": np.array([2, 2, 0])}, {"E": table})
    assert isinstance(g, RowSparse)
    before = table.value.copy()
    SGD([table], lr=0.5, sparse_updates=True).step({"E": g})
    np.testing.assert_allclose(before - table.value, [[.5] * 3, [0] * 3, [1.] * 3, [0] * 3, [0] * 3])


# --- state ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", MAKERS)
def test_state_dict_round_trip_resumes_exactly(make):
    rng = np.random.default_rng(9)
    seq = sparse_grads(rng, 5)
    ps_a = table_params()
    opt_a = make(ps_a)
    for g in seq[:3]:
        opt_a.step(g)
    state = opt_a.state_dict()
    ps_b = ParameterSet([Parameter(k, p.shape, init=p.value, dtype="float64") for k, p in ps_a.items()])
    opt_b = make(ps_b)
    opt_b.load_state_dict(state)
    assert opt_b.steps == 3
    for g in seq[3:]:
        opt_a.step(g)
        opt_b.step(g)
    for k in ps_a:
        np.testing.assert_array_equal(ps_a[k].value, ps_b[k].value)


def test_state_dict_is_a_snapshot():
    ps = two_params()
    opt = Adam(ps, lr=0.1)
    opt.step({"a": np.ones((3, 2))})
    state = opt.state_dict()
    assert state["type"] == "Adam" and state["steps"] == 1 and state["hyper"]["lr"] == 0.1
    assert set(state["slots"]) == {"a", "b"} and set(state["slots"]["a"]) == {"m", "v"}
    state["slots"]["a"]["m"][...] = 7
    assert not (opt.state["a"]["m"] == 7).any()


def bad_states():
    good = Adam(two_params(), lr=0.1).state_dict()
    out = []
    s = dict(good, type="SGD")
    out.append(("type", s, "'SGD'"))
    s = dict(good, slots={k: v for k, v in good["slots"].items() if k != "b"})
    out.append(("missing", s, "missing parameter 'b'"))
    s = dict(good, slots={**good["slots"], "c": {"m": np.zeros(1), "v": np.zeros(1)}})
    out.append(("extra", s, "unexpected parameter 'c'"))
    s = dict(good, slots={**good["slots"], "b": {"m": np.zeros(4)}})
    out.append(("slots", s, "parameter 'b' has slots"))
    s = dict(good, slots={**good["slots"], "b": {"m": np.zeros(5), "v": np.zeros(4)}})
    out.append(("shape", s, "slot 'm' of parameter 'b'"))
    s = dict(good, slots={**good["slots"], "b": {"m": np.zeros(4, np.float32), "v": np.zeros(4)}})
    out.append(("dtype", s, "slot 'm' of parameter 'b'"))
    out.append(("steps", dict(good, steps=-1), "step count"))
    return out


@pytest.mark.parametrize("what, state, match", bad_states(), ids=[b[0] for b in bad_states()])
def test_load_state_dict_checks_first(what, state, match):
    ps = two_params()
    opt = Adam(ps, lr=0.1)
    opt.step({"a": np.ones((3, 2)), "b": np.ones(4)})
    snap = snapshot(ps, opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(state)
    assert_unchanged(ps, opt, snap)


# --- construction -----------------------------------------------------------------------------------


def test_make_optimizer_and_bad_hyperparameters():
    ps = two_params()
    assert isinstance(make_optimizer("Adam", ps, lr=0.1), Adam)
    assert make_optimizer("sgd", ps, momentum=0.5).slots == ("momentum",)
    assert SGD(ps).slots == () and Adagrad(list(ps.values())).params.keys() == ps.keys()
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer("rmsprop", ps)
    for bad in (dict(lr=0.0), dict(lr=0.1, weight_decay=-1), dict(lr=0.1, clip_norm=0)):
        with pytest.raises(ValueError):
            Adam(ps, **bad)
    with pytest.raises(ValueError, match="momentum"):
        SGD(ps, momentum=1.0)
    with pytest.raises(ValueError, match="given twice"):
        SGD([ps["a"], ps["a"]])


# --- the one-call step (C kernels over all parameters) against the per-parameter step ----------------------

NATIVE = {
    "sgd": lambda ps, **kw: SGD(ps, lr=0.05, **kw),
    "momentum": lambda ps, **kw: SGD(ps, lr=0.05, momentum=0.9, **kw),
    "adagrad": lambda ps, **kw: Adagrad(ps, lr=0.05, **kw),
    "adam": lambda ps, **kw: Adam(ps, lr=0.01, **kw),
}


def embedding_params(dtype):
    rng = np.random.default_rng(5)
    return ParameterSet([Parameter("E", (40, 3), init=rng.standard_normal((40, 3)), dtype=dtype),
                         Parameter("W", (3, 4), init=rng.standard_normal((3, 4)), dtype=dtype),
                         Parameter("b", (4,), init=np.zeros(4), dtype=dtype, weight_decay=False)])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("extra", [{}, {"weight_decay": 0.01, "clip_norm": 0.5}])
@pytest.mark.parametrize("kind", sorted(NATIVE))
def test_native_step_equals_the_per_parameter_step(kind, extra, lazy, dtype):
    """step() runs as a few C calls (the kernels over a table of parameters, C coalescing, lazy rows in
    place) with the per-parameter path's values bit for bit: parameters, slots, norm, over several steps
    with repeated embedding rows and a parameter without a gradient."""
    pytest.importorskip("cffi")
    from minicavs.cpu.compiler import compiler
    if compiler() is None:
        pytest.skip("no C compiler on this machine")
    fast_ps, ref_ps = embedding_params(dtype), embedding_params(dtype)
    fast = NATIVE[kind](fast_ps, sparse_updates=lazy, **extra)
    ref = NATIVE[kind](ref_ps, sparse_updates=lazy, **extra)
    rng = np.random.default_rng(11)
    for step in range(4):
        idx = rng.integers(0, 40, 30)
        grads = {"E": RowSparse(idx, (rng.standard_normal((30, 3)) * 3).astype(dtype), (40, 3)),
                 "W": (rng.standard_normal((3, 4)) * 3).astype(dtype),
                 "b": None if step == 2 else rng.standard_normal(4).astype(dtype)}
        assert fast._native(grads, 1.0) is not None   # the fast path applies here
        norm = fast.step(grads, loss=1.0)
        assert norm == ref._step(grads, loss=1.0)
    assert fast.steps == ref.steps == 4
    for name in fast_ps:
        assert np.array_equal(fast_ps[name].value, ref_ps[name].value), name
        for s in fast.slots:
            assert np.array_equal(fast.state[name][s], ref.state[name][s]), (name, s)


@pytest.mark.parametrize("kind", sorted(NATIVE))
def test_native_step_updates_planned_views_in_place(kind):
    """Parameters laid out as column blocks of one buffer (ParameterSet.plan_buffer: strided views) take the
    C step too (a contiguous stage, copied back when the step applies), with the per-parameter step's values,
    and stay views of their buffer; a step that is not finite changes neither."""
    from minicavs.cpu.compiler import compiler
    if compiler() is None:
        pytest.skip("no C compiler on this machine")
    rng = np.random.default_rng(3)
    inits = {"Wi": rng.standard_normal((3, 4)), "Wf": rng.standard_normal((3, 2)), "b": rng.standard_normal(4)}

    def params():
        return ParameterSet([Parameter(n, v.shape, init=v.copy(), dtype="float64") for n, v in inits.items()])
    fast_ps, ref_ps = params(), params()
    buffer = fast_ps.plan_buffer(["Wi", "Wf"])
    assert not fast_ps["Wi"].value.flags.c_contiguous
    fast, ref = NATIVE[kind](fast_ps, weight_decay=0.01), NATIVE[kind](ref_ps, weight_decay=0.01)
    for step in range(3):
        grads = {n: rng.standard_normal(v.shape) for n, v in inits.items()}
        assert fast._native(grads, 1.0) is not None   # (the C step, not the per-parameter numpy step)
        fast.step(grads, loss=1.0)
        ref._step(grads, loss=1.0)
    for name in inits:
        assert np.array_equal(fast_ps[name].value, ref_ps[name].value), name
    assert np.shares_memory(fast_ps["Wi"].value, buffer) and np.array_equal(buffer[:, :4], fast_ps["Wi"].value)
    before = buffer.copy()
    with pytest.raises(NonFiniteError):
        fast.step({"Wi": np.full((3, 4), np.inf), "Wf": np.zeros((3, 2)), "b": np.zeros(4)}, loss=1.0)
    assert np.array_equal(buffer, before)


def _block_gradients(rng, shapes: dict, order: list) -> dict:
    """Gradients of the parameters ``order`` (matrices of one row count) as column blocks of one new buffer, in
    that order: what the engine hands over for a merged product's ∂W' (passes/layout.gradient_blocks)."""
    whole = rng.standard_normal(shapes[order[0]][:-1] + (sum(shapes[n][-1] for n in order),))
    out, at = {}, 0
    for n in order:
        out[n] = whole[..., at:at + shapes[n][-1]]
        at += shapes[n][-1]
    return out


@pytest.mark.parametrize("grads_as", ["blocks", "blocks in another order", "separate arrays", "one missing",
                                      "clipped"])
@pytest.mark.parametrize("kind", sorted(NATIVE))
def test_native_step_updates_a_planned_buffer_whole(kind, grads_as):
    """The parameters of one planned buffer, all with a gradient, are updated as one array: no stage copied
    in and out, the slots laid out as the parameters (each still its parameter's slot), the per-parameter
    step's values bit for bit. Their gradients are read in place where they are the column blocks of one
    buffer laid out alike (the engine's ∂W' of a merged product), else copied into one; clipping scales the
    joined gradient. A parameter of the buffer without a gradient sends the others through stages, same
    values."""
    from minicavs.cpu.compiler import compiler
    if compiler() is None:
        pytest.skip("no C compiler on this machine")
    rng = np.random.default_rng(7)
    shapes = {"Wi": (3, 4), "Wf": (3, 2), "Wo": (3, 5), "b": (4,), "bi": (4,), "bf": (2,)}
    inits = {n: rng.standard_normal(shape) for n, shape in shapes.items()}

    def params():
        return ParameterSet([Parameter(n, v.shape, init=v.copy(), dtype="float64") for n, v in inits.items()])
    fast_ps, ref_ps = params(), params()
    buffer = fast_ps.plan_buffer(["Wi", "Wf", "Wo"])
    biases = fast_ps.plan_buffer(["bi", "bf"])
    extra = {"clip_norm": 0.5} if grads_as == "clipped" else {}
    fast = NATIVE[kind](fast_ps, weight_decay=0.01, **extra)
    ref = NATIVE[kind](ref_ps, weight_decay=0.01, **extra)
    for step in range(3):
        order = ["Wo", "Wi", "Wf"] if grads_as == "blocks in another order" else ["Wi", "Wf", "Wo"]
        grads = _block_gradients(rng, shapes, order)
        if grads_as == "separate arrays":
            grads = {n: g.copy() for n, g in grads.items()}
        if grads_as == "one missing":
            grads["Wf"] = None
        grads["b"] = rng.standard_normal(4)
        grads.update(_block_gradients(rng, shapes, ["bi", "bf"]))
        assert fast._native(grads, 1.0) is not None   # (the C step, not the per-parameter numpy step)
        assert fast.step(grads, loss=1.0) == ref._step(grads, loss=1.0)
    whole = grads_as != "one missing"
    assert (not fast.__dict__.get("_stages")) == whole                 # no stage where the buffer is one unit
    assert any(p is buffer for p in fast._table[1].params) == whole    # the buffer itself in the kernels' table
    if grads_as == "blocks":                                            # read in place: the engine's buffer
        assert fast._whole_buffer([(n, grads[n]) for n in ("Wi", "Wf", "Wo")])[1] is grads["Wi"].base
    for name in inits:
        assert np.array_equal(fast_ps[name].value, ref_ps[name].value), name
        for s in fast.slots:
            assert np.array_equal(fast.state[name][s], ref.state[name][s]), (name, s)
    assert all(fast_ps[n].value.base is buffer for n in ("Wi", "Wf", "Wo"))
    assert any(p is biases for p in fast._table[1].params)             # (vectors: the biases' buffer likewise)
    if whole and fast.slots:                                            # each slot: a view of one buffer
        for s in fast.slots:
            slot = fast.state["Wi"][s].base
            assert slot is not None and slot.shape == buffer.shape
            assert all(fast.state[n][s].base is slot for n in ("Wi", "Wf", "Wo"))
    state = fast.state_dict()                                           # per parameter, as before
    assert all(a.flags.c_contiguous for got in state["slots"].values() for a in got.values())
    again = NATIVE[kind](params(), weight_decay=0.01, **extra)
    again.load_state_dict(state)
    for name in inits:
        for s in fast.slots:
            assert np.array_equal(again.state[name][s], fast.state[name][s])


def test_native_step_converts_unusual_gradients_as_the_per_parameter_step_does():
    """Another dtype, a non-contiguous gradient, int32 indices: both paths check and convert them with the
    same code (_validate), so the C step takes them and gives the per-parameter step's values."""
    ps, ref_ps = embedding_params("float32"), embedding_params("float32")
    opt, ref = Adam(ps, lr=0.01, sparse_updates=True), Adam(ref_ps, lr=0.01, sparse_updates=True)
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3))
    grads = {"E": RowSparse(np.array([3, 1, 3], np.int32), rng.standard_normal((3, 3)).astype(np.float32), (40, 3)),
             "W": w.T, "b": np.ones(4)}   # float64, not C-contiguous
    assert opt._native(grads, None) is not None
    opt.step(grads)
    ref._step(grads, None)
    for name in ps:
        assert np.array_equal(ps[name].value, ref_ps[name].value)
