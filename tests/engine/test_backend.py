"""The CUDA device path of the engine against the CPU path, written once and run on two launchers:
``emulated`` (every generated CUDA kernel compiled as C++ and run on the CPU with numpy arrays: always, with g++)
and ``cupy`` (a real GPU, marked gpu: skipped without CuPy and a device, never mocked).

The emulated run executes the whole forward and backward pass of every bundled model through the CUDA
device: its fused kernels, row kernels (scatter-add by atomics and by sorted segment sums on DAGs) and the
eager-stream protocol, with the CPU path (C kernels, numpy) as the reference. Only the cupy run checks CuPy's
array API, transfers and real streams."""
from __future__ import annotations


import json

import numpy as np
import pytest

from minicavs import cuda as mcuda
from minicavs.train.config import REPO_ROOT
from minicavs.engine.backend import array_module, to_host
from minicavs.cpu import CPU
from minicavs.cuda import Cuda
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.train.trainer import Trainer

from .. import cells
from ..models.test_models import TINY as _TINY
from .codegen.test_cuda import MODELS, SMALL, TREES

# and the model whose kinds scatter two message shapes (two scatter tensors on the device)
MODELS = {**MODELS, "lattice_lstm": ("lattice_lstm", SMALL + TREES + ["data.synthetic.max_len=10",
                                                                       "train.policy=cavs"])}
# and every other bundled model (their tiny configurations), so that each runs its step on the device
MODELS.update({name: (name.replace("_child_sum", ""), overrides) for name, overrides in _TINY.items()
               if name not in MODELS})
from .test_alg1 import CASES, dense

TOL = {"float32": 2e-5, "float64": 1e-10}
SWITCHES = {"default": EngineOptions(), "streaming": EngineOptions(streaming=True),
            "unfused": EngineOptions(fusion=False),
            "all off": EngineOptions(False, False, False, False, False, False)}


def close(got, want, dtype, what=""):
    got, want = to_host(dense(got)).astype(np.float64), to_host(dense(want)).astype(np.float64)
    assert got.shape == want.shape, what
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert err <= TOL[dtype] * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0), (what, err)


def trainer(model: str, dtype: str, tmp_path) -> Trainer:
    module, overrides = MODELS[model]
    return Trainer(REPO_ROOT / "models" / f"{module}.yaml", overrides + [f"train.dtype={dtype}"],
                   run_dir=tmp_path / model)


def on(device, t: Trainer) -> dict:
    """The trainer's parameters as arrays of ``device`` (values equal to the CPU trainer's)."""
    return {name: device.asarray(p.value) for name, p in t.params.items()}


def fused_launches(launcher) -> int:
    return sum(name.startswith("fused_") for name, _, _ in getattr(launcher, "launches", []))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_bundled_model_step_on_cuda_equals_cpu(launcher, model, dtype, tmp_path):
    t = trainer(model, dtype, tmp_path)
    samples = t.task.data["train"][:4]
    graphs, feeds = t.task.batch(samples)
    device = Cuda(launcher)
    params = on(device, t)
    for label, opts in SWITCHES.items():
        ctx = RunContext(seed=3, step=1)   # dropout on, where the model has it
        want = t.model.forward_backward(graphs, feeds, t.params, ctx, options=opts)
        t.model.device = device
        try:
            got = t.model.forward_backward(graphs, feeds, params, RunContext(seed=3, step=1), options=opts)
        finally:
            t.model.device = CPU
        close(got.loss, want.loss, dtype, f"{label} loss")
        assert set(got.grads) == set(want.grads)
        for name in want.grads:
            close(got.grads[name], want.grads[name], dtype, f"{label} d{name}")
            g = got.grads[name]
            assert array_module(getattr(g, "rows", g)) is device.xp, f"{label} d{name} left the device"
    if hasattr(launcher, "launches"):   # the CUDA kernels ran, not a CPU fallback
        names = {name.rsplit("_", 1)[0] for name, _, _ in launcher.launches}
        # (rows moved by index: the issuing loop's batched moves, or the Python runner's row kernels)
        assert fused_launches(launcher) > 0 and ("moves" in names or "scatter_rows" in names)
        if model.startswith("tree"):
            assert "moves" in names or "gather_rows" in names


@pytest.mark.parametrize("deterministic", [False, True])
def test_dag_gradients_add_up_on_cuda(launcher, deterministic):
    """Vertices with several parents: their gradient rows are summed by atomicAdd or by the sorted
    segment-sum kernel; both equal the CPU's scatter-add."""
    build, make_graph = CASES["child_sum_dag"]
    rng = np.random.default_rng(7)
    case = build(rng)
    graphs = [make_graph(rng, 6) for _ in range(3)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    want = case.model.forward_backward(graphs, feeds, case.params, RunContext())
    device = Cuda(launcher, deterministic=deterministic)
    case.model.device = device
    got = case.model.forward_backward(graphs, feeds, {k: device.asarray(v) for k, v in case.params.items()},
                                      RunContext())
    close(got.loss, want.loss, "float64")
    for name in want.grads:
        close(got.grads[name], want.grads[name], "float64", name)
    if hasattr(launcher, "launches"):   # (atomic adds: the C loop's moves by index, or the Python runner's)
        names = {name for name, _, _ in launcher.launches}
        assert "segment_sum_rows_double" in names if deterministic else \
            {"scatter_add_rows_double", "moves_double"} & names


def test_training_on_the_emulated_device_equals_cpu(cuda_standin, tmp_path):
    """Three optimizer steps (Adam, parameters updated in place) with ``train.device=cuda`` on the emulated
    device: parameters and optimizer slots live there."""
    a = trainer("tree_lstm", "float64", tmp_path / "a")
    module, overrides = MODELS["tree_lstm"]
    b = Trainer(REPO_ROOT / "models" / f"{module}.yaml", overrides + ["train.dtype=float64", "train.device=cuda"],
                run_dir=tmp_path / "b")
    assert all(array_module(p.value) is b.device.xp for p in b.params.values())
    batches = [a.task.data["train"][i:i + 2] for i in (0, 2, 0)]
    for samples in batches:
        for t in (a, b):
            res = t.loss_and_grads(samples)
            t.optimizer.step(res.grads, loss=res.loss)
    for name in a.params:
        close(b.params[name].value, a.params[name].value, "float64", name)


@pytest.mark.gpu
@pytest.mark.skipif(not mcuda.available(), reason="no CuPy or no CUDA device")
def test_training_on_a_gpu_equals_cpu(tmp_path):
    """``train.device: cuda``: parameters and optimizer state on the GPU, a few steps equal the CPU's."""
    a = trainer("tree_lstm", "float32", tmp_path / "a")
    module, overrides = MODELS["tree_lstm"]
    b = Trainer(REPO_ROOT / "models" / f"{module}.yaml", overrides + ["train.device=cuda"], run_dir=tmp_path / "b")
    assert array_module(b.params["W"].value) is not np
    for i in range(3):
        samples = a.task.data["train"][i:i + 2]
        for t in (a, b):
            res = t.loss_and_grads(samples)
            t.optimizer.step(res.grads, loss=res.loss)
    for name in a.params:
        close(b.params[name].value, a.params[name].value, "float32", name)


@pytest.mark.gpu
@pytest.mark.skipif(not mcuda.available(), reason="no CuPy or no CUDA device")
def test_two_streams_give_the_same_numbers_every_time(tmp_path):
    """Eager nodes on the second stream, events where the recurrent path reads them: repeated runs equal the
    single-stream run (a missing wait would show up as differences, run to run)."""
    t = trainer("tree_lstm", "float32", tmp_path)
    device = Cuda(deterministic=True)
    t.model.device = device
    params = on(device, t)
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    want = t.model.forward_backward(graphs, feeds, params, RunContext())
    for _ in range(5):
        got = t.model.forward_backward(graphs, feeds, params, RunContext(), options=EngineOptions(streaming=True))
        close(got.loss, want.loss, "float32")
        for name in want.grads:
            close(got.grads[name], want.grads[name], "float32", name)


def test_plan_indices_are_copied_to_the_device_once(emulation_dir):
    """Task index arrays are slices of a plan array: the device copies the plan array once and slices it."""
    from minicavs.cuda.emulation import Launcher
    device = Cuda(Launcher(emulation_dir))
    plan = np.arange(100, dtype=np.int64) * 3
    a, b = device.index(plan[10:20]), device.index(plan[50:53])
    assert a.tolist() == plan[10:20].tolist() and b.tolist() == plan[50:53].tolist()
    assert len(device._index) == 1 and a.base is b.base      # one copy, two views of it
    assert device.index(plan[::2]).tolist() == plan[::2].tolist()   # strided: copied as is
    other = np.array([5, 1, 4])
    assert device.index(other).tolist() == [5, 1, 4]


# --- the CLI on the emulated device: every bundled model, equal to the CPU ---------------------------------

from minicavs.train import checkpoint, cli  # noqa: E402

from ..models.test_models import TINY  # noqa: E402


def _cli_train(run_dir, name: str, dtype: str, device: str, *extra: str) -> None:
    config = REPO_ROOT / "models" / f"{name.replace('_child_sum', '')}.yaml"
    sets = [o for o in TINY[name] if not o.startswith("data.synthetic.train")] + [
        "data.synthetic.train=12", "train.epochs=1", f"train.dtype={dtype}", f"train.device={device}", *extra]
    assert cli.main(["train", str(config), "--run-dir", str(run_dir), "--no-progress",
                     *[a for s in sets for a in ("--set", s)]]) == 0


def _params(path) -> dict:
    return checkpoint.read(path).params


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", sorted(TINY))
def test_cli_training_on_the_emulated_device_equals_cpu(cuda_standin, name, dtype, tmp_path, capsys):
    """``minicavs train CONFIG --set train.device=cuda``, one epoch: every parameter of the checkpoint equals
    the CPU run's; the run says it was emulated, in its log and in results.json."""
    _cli_train(tmp_path / "cpu", name, dtype, "cpu")
    capsys.readouterr()
    _cli_train(tmp_path / "cuda", name, dtype, "cuda")
    out = capsys.readouterr().out
    assert "device cuda (emulated on the CPU: not a GPU result)" in out.splitlines()[0]
    want, got = _params(tmp_path / "cpu" / "last.npz"), _params(tmp_path / "cuda" / "last.npz")
    assert set(got) == set(want)
    for key in want:
        close(got[key], want[key], dtype, key)
    results = json.loads((tmp_path / "cuda" / "results.json").read_text())
    assert results["device"].startswith("cuda (emulated") and json.loads(
        (tmp_path / "cpu" / "results.json").read_text())["device"] == "cpu"


@pytest.mark.parametrize("streaming", [False, True])
def test_a_device_run_resumes_evaluates_and_predicts_as_the_cpu_run(cuda_standin, streaming, tmp_path, capsys):
    """A device run's checkpoint: ``--resume`` continues it on the device (two streams on and off) equal to
    the CPU run resumed the same way; ``eval`` and ``predict`` of it give the CPU's metrics and labels."""
    runs = {}
    for device in ("cpu", "cuda"):
        run = runs[device] = tmp_path / device
        _cli_train(run, "tree_lstm", "float64", device, f"train.engine.streaming={str(streaming).lower()}")
        assert cli.main(["train", str(run), "--resume", "--no-progress", "--set", "train.epochs=2"]) == 0
    for key, want in _params(runs["cpu"] / "last.npz").items():
        close(_params(runs["cuda"] / "last.npz")[key], want, "float64", key)
    capsys.readouterr()
    evals, predictions = {}, {}
    source = tmp_path / "trees.txt"
    source.write_text("(3 (2 w1) (3 (2 w2) (4 w3)))\n(1 (1 w4) (2 w5))\n")
    for device, run in runs.items():
        assert cli.main(["eval", str(run)]) == 0
        evals[device] = capsys.readouterr().out
        assert cli.main(["predict", str(run), str(source)]) == 0
        captured = capsys.readouterr()
        predictions[device] = captured.out
        assert ("emulated" in captured.err) == (device == "cuda")
    assert predictions["cuda"] == predictions["cpu"] and predictions["cpu"].count("\n") == 2
    assert evals["cuda"].split("  (")[0].replace(str(runs["cuda"]), "") == \
        evals["cpu"].split("  (")[0].replace(str(runs["cpu"]), "")
    assert "emulated" in evals["cuda"] and "emulated" not in evals["cpu"]
