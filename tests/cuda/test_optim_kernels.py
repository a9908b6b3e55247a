"""The fused optimizer step on the emulated CUDA device (cuda/optim_kernels.py, codegen/cuda_optim.py): its
values against the CPU's per-parameter step and the device's per-parameter step for every rule and option,
a non-finite loss, gradient, norm or update refused with the CPU's error before anything changes, and a
step's launches, array operations and device reads that do not grow with the number of parameters."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from minicavs import NonFiniteError
from minicavs.cuda import standin
from minicavs.nn import Parameter, ParameterSet
from minicavs.ops.registry import native_kernels
from minicavs.train.optim import SGD, Adagrad, Adam
from minicavs.core.sparse import RowSparse

TOL = {"float32": 1e-5, "float64": 1e-10}

RULES = {
    "sgd": lambda ps, **kw: SGD(ps, lr=0.05, **kw),
    "momentum": lambda ps, **kw: SGD(ps, lr=0.05, momentum=0.9, **kw),
    "adagrad": lambda ps, **kw: Adagrad(ps, lr=0.05, **kw),
    "adam": lambda ps, **kw: Adam(ps, lr=0.01, **kw),
}
OPTIONS = {"plain": {}, "decay": {"weight_decay": 0.01}, "clip": {"clip_norm": 2.0},
           "decay+clip": {"weight_decay": 0.01, "clip_norm": 2.0}}


def host_params(dtype: str, extra: int = 0) -> ParameterSet:
    """An embedding table, a matrix, a bias without weight decay and ``extra`` more matrices."""
    rng = np.random.default_rng(5)
    ps = [Parameter("E", (40, 3), init=rng.standard_normal((40, 3)), dtype=dtype),
          Parameter("W", (3, 4), init=rng.standard_normal((3, 4)), dtype=dtype),
          Parameter("b", (4,), init=np.zeros(4), dtype=dtype, weight_decay=False)]
    ps += [Parameter(f"V{k}", (2, k + 1), init=rng.standard_normal((2, k + 1)), dtype=dtype) for k in range(extra)]
    return ParameterSet(ps)


def device_params(dtype: str, extra: int = 0) -> ParameterSet:
    ps = host_params(dtype, extra)
    for p in ps.values():
        p.value = standin.asarray(p.value)
    return ps


def on_device(grads: dict) -> dict:
    """Dense gradients on the device; a row-sparse one keeps its indices on the host (as the engine's)."""
    return {k: None if g is None else RowSparse(g.indices, standin.asarray(g.rows), g.shape)
            if isinstance(g, RowSparse) else standin.asarray(g) for k, g in grads.items()}


def random_grads(rng, dtype: str, step: int, extra: int = 0) -> dict:
    """Repeated embedding rows, a missing gradient on step 2, and norms above and below the clip (2.0)."""
    size = 3.0 if step % 2 == 0 else 0.05
    idx = rng.integers(0, 40, 30)
    grads = {"E": RowSparse(idx, (rng.standard_normal((30, 3)) * size).astype(dtype), (40, 3)),
             "W": (rng.standard_normal((3, 4)) * size).astype(dtype),
             "b": None if step == 2 else (rng.standard_normal(4) * size).astype(dtype)}
    grads.update({f"V{k}": (rng.standard_normal((2, k + 1)) * size).astype(dtype) for k in range(extra)})
    return grads


def host(a) -> np.ndarray:
    return a.get() if isinstance(a, standin.ndarray) else np.asarray(a)


def close(got, want, dtype: str, what) -> None:
    got, want = host(got).astype(np.float64), host(want).astype(np.float64)
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= TOL[dtype] * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0), (what, err)


def launches(dtype) -> list:
    """Every launch of the launcher the device stand-in's optimizer kernels run on."""
    return native_kernels(standin, np.dtype(dtype)).launcher.launches


# Stand-in array operations that are each a CuPy kernel on a GPU (views, metadata and allocations are not);
# indexing with an index array (a gather) is counted too (device_ops).
KERNEL_OPS = {
    standin._Ufunc: ("__call__", "reduce", "reduceat", "at"),
    standin.ndarray: ("astype", "__setitem__", "copy", "fill", "take", *standin._REDUCTIONS),
    standin: ("stack", "concatenate", "take", "zeros", "ones", "full", "zeros_like", "ones_like", "where",
              "argsort", "flatnonzero", "nonzero", "put_along_axis", *standin._REDUCTIONS),
}


@pytest.fixture
def device_ops(monkeypatch) -> collections.Counter:
    """Counts the stand-in's kernel-like array operations (KERNEL_OPS) by name."""
    counts = collections.Counter()

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call
    for owner, names in KERNEL_OPS.items():
        for name in names:
            monkeypatch.setattr(owner, name, counting(name, getattr(owner, name)))
    getitem = standin.ndarray.__getitem__

    def gather(self, key):   # an index array is a gather kernel; a slice is a view
        parts = key if isinstance(key, tuple) else (key,)
        counts["gather"] += any(isinstance(k, (standin.ndarray, np.ndarray, list)) for k in parts)
        return getitem(self, key)
    monkeypatch.setattr(standin.ndarray, "__getitem__", gather)
    return counts


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lazy", [False, True], ids=["dense-sparse", "lazy"])
@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_fused_step_equals_the_per_parameter_steps(cuda_standin, monkeypatch, rule, options, lazy, dtype):
    """Four steps of the fused device step against the CPU's per-parameter step (numpy: the reference) and
    the device's per-parameter step: parameters, slots, the returned norm and the loss read back."""
    kw = dict(OPTIONS[options], sparse_updates=lazy)
    ref_ps, fused_ps, each_ps = host_params(dtype), device_params(dtype), device_params(dtype)
    ref, fused, each = (RULES[rule](ps, **kw) for ps in (ref_ps, fused_ps, each_ps))
    per_parameter = []
    monkeypatch.setattr(type(fused), "_device_step_per_parameter",
                        lambda self, *a, _f=type(fused)._device_step_per_parameter: per_parameter.append(self)
                        or _f(self, *a))
    rng = np.random.default_rng(11)
    for step in range(4):
        grads = random_grads(rng, dtype, step)
        loss = standin.asarray(np.asarray(0.5 + step, dtype))
        want = ref._step(grads, None)
        got = fused.step(on_device(grads), loss=loss)
        other = each._device_step_per_parameter(each._validate(on_device(grads), None, device=True), loss)
        assert fused.last_loss == 0.5 + step
        if "clip_norm" in kw:
            assert abs(got - want) <= TOL[dtype] * want and abs(other - want) <= TOL[dtype] * want
        else:
            assert got is None and want is None
    assert per_parameter == [each] * 4   # the fused optimizer never took the per-parameter way
    assert fused.steps == ref.steps == 4
    for name in ref_ps:
        close(fused_ps[name].value, ref_ps[name].value, dtype, name)
        close(each_ps[name].value, ref_ps[name].value, dtype, name)
        for s in ref.slots:
            close(fused.state[name][s], ref.state[name][s], dtype, (name, s))
            close(each.state[name][s], ref.state[name][s], dtype, (name, s))


def snapshot(ps, opt) -> tuple:
    return ({k: host(p.value).copy() for k, p in ps.items()},
            {k: {s: host(a).copy() for s, a in d.items()} for k, d in opt.state.items()}, opt.steps)


def good_grads(dtype) -> dict:
    return {"E": RowSparse(np.array([0, 4, 0]), np.ones((3, 3), dtype), (40, 3)),
            "W": np.ones((3, 4), dtype), "b": np.ones(4, dtype)}


BAD = {   # what changes in a good step: (gradient overrides, loss, optimizer options)
    "nan loss on the device": ({}, "device nan", {}),
    "inf loss on the host": ({}, float("inf"), {}),
    "nan dense gradient": ({"W": np.array([[1.0, np.nan, 0, 0]] * 3)}, 1.0, {}),
    "inf row-sparse gradient": ({"E": RowSparse(np.array([1]), np.array([[np.inf, 0.0, 0.0]]), (40, 3))}, 1.0, {}),
    "nan gradient, clipped": ({"b": np.array([1.0, 2.0, np.nan, 0])}, 1.0, {"clip_norm": 1.0}),
    "overflowing update": ({"b": np.full(4, 1e30)}, 1.0, {"lr": 1e30}),
    "overflowing norm": ({"W": np.full((3, 4), 1e200)}, 1.0, {"clip_norm": 1.0}),
}


@pytest.mark.parametrize("lazy", [False, True], ids=["dense-sparse", "lazy"])
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("what", sorted(BAD))
def test_a_non_finite_step_raises_the_cpus_error_and_changes_nothing(cuda_standin, what, rule, lazy):
    """The CPU and the device refuse the same step with the same message; on the device nothing changed
    (parameters, slots, step count), the step read the device once, and the next good step still works."""
    override, loss, options = BAD[what]
    dtype = "float64" if what == "overflowing norm" else "float32"
    kw = dict(options, sparse_updates=lazy)
    lr = kw.pop("lr", None)
    make = (lambda ps: RULES[rule](ps, **kw)) if lr is None else \
        (lambda ps: SGD(ps, lr=lr, momentum=0.5, **kw))
    cpu_ps, ps = host_params(dtype), device_params(dtype)
    cpu, opt = make(cpu_ps), make(ps)
    cpu.step(good_grads(dtype), loss=1.0)
    opt.step(on_device(good_grads(dtype)), loss=1.0)   # non-zero slots to protect
    grads = {k: RowSparse(g.indices, g.rows.astype(dtype), g.shape) if isinstance(g, RowSparse) else g.astype(dtype)
             for k, g in {**good_grads(dtype), **override}.items()}
    with pytest.raises(NonFiniteError) as cpu_error:
        cpu.step(grads, loss=np.float32("nan") if loss == "device nan" else loss)
    before = snapshot(ps, opt)
    standin.reset()
    device_loss = standin.asarray(np.asarray(np.nan, dtype)) if loss == "device nan" else loss
    with pytest.raises(NonFiniteError) as error:
        opt.step(on_device(grads), loss=device_loss)
    assert str(error.value) == str(cpu_error.value)
    assert standin.crossings["d2h"] == 1
    after = snapshot(ps, opt)
    for name in before[0]:
        assert np.array_equal(after[0][name], before[0][name]), name
        for s in before[1][name]:
            assert np.array_equal(after[1][name][s], before[1][name][s]), (name, s)
    assert after[2] == before[2] == 1
    opt.step(on_device(good_grads(dtype)), loss=1.0)
    assert opt.steps == 2


@pytest.mark.parametrize("lazy", [False, True], ids=["dense-sparse", "lazy"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_step_launches_a_constant_number_of_kernels(cuda_standin, device_ops, rule, clip, lazy):
    """3 parameters or 33: the same launches (3 without clipping: report, check, apply; 5 with: the norm's
    two before them), the same array operations (none for dense gradients; a row-sparse gradient's own
    coalescing, densified or not), one device read and one host-to-device copy (the segment table, and a
    lazy update's row indices)."""
    seen = {}
    for extra in (0, 30):
        ps = device_params("float32", extra)
        opt = RULES[rule](ps, clip_norm=clip, sparse_updates=lazy)
        rng = np.random.default_rng(2)
        for step in range(2):
            grads = on_device(random_grads(rng, "float32", 0, extra))
            dense = {k: g for k, g in grads.items() if not isinstance(g, RowSparse)}
            for name, g in (("all", grads), ("dense", dense)):
                loss = standin.asarray(np.float32(1.0))
                start = len(launches("float32"))
                device_ops.clear()
                standin.reset()
                opt.step(g, loss=loss)
                got = (tuple(n for n, _, _ in launches("float32")[start:]), sum(device_ops.values()),
                       dict(standin.crossings))
                assert seen.setdefault((name, step), got) == got, (extra, name, got, seen[(name, step)])
    kinds = ("optim_sumsq_float", "optim_partials_float") if clip else ()
    kinds += ("optim_finish_float", f"optim_{rule}_float", f"optim_{rule}_float")   # check, then apply
    assert seen[("dense", 1)][0] == kinds
    assert seen[("dense", 1)][1] == 0
    assert seen[("dense", 1)][2] == {"d2h": 1, "h2d": 1}
    assert seen[("all", 1)][2]["d2h"] == 1


def test_the_fused_step_needs_contiguous_parameters_of_one_dtype(cuda_standin):
    """Parameters of two dtypes: the per-parameter device step (the same values), not the fused one."""
    ps = device_params("float32")
    ps["b"].value = standin.asarray(np.zeros(4))   # float64
    opt = Adam(ps, lr=0.01)
    assert opt._fused_segments(opt._validate(on_device({"W": np.ones((3, 4), np.float32),
                                                        "b": np.ones(4)}), None, device=True)) is None
    start = len(launches("float32"))
    opt.step(on_device({"W": np.ones((3, 4), np.float32), "b": np.ones(4)}), loss=1.0)
    assert len(launches("float32")) == start and opt.steps == 1
