"""The CUDA runner (minicavs/cuda/runner.py) on the emulated device: the one lowered program of every bundled
model runs there (no pass left to the Python binder, no silent fallback) and equals the C runner on the CPU,
forward values, inference and gradients, float64 and float32, under the engine switches; so does the reference
runner over the device's arrays; a DAG's gradient rows are added by the device's scatter-add kernels; neither
runner copies anything between host and device per task."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from minicavs.cpu import CPU
from minicavs.cuda import Cuda, standin
from minicavs.engine import EngineOptions
from minicavs.executor import RunContext
from minicavs.inputs import InputGraph

from .. import cells
from ..test_device import close, on
from ..test_engine import CASES
from ..test_instructions import PYTHON_ONLY, SWITCHES
from ..models.test_models import TINY, trainer

RUNNERS = {"native": "cuda runner", "reference": "reference runner"}


def assert_device_runs_the_program(result, executor: str, python_only: str | None = None) -> None:
    for state in result.states.values():
        for program in (state.program, state.backward_program):
            if python_only is not None:
                assert program.native is None and python_only in program.native_why
                continue
            assert program.native is not None and program.native_table is not None, program.native_why
            assert not program.tasks and not program.before and not program.after
            assert program.runner == RUNNERS[executor] and f"({RUNNERS[executor]})" in program.dump()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name, dropout", [(name, "0.0") for name in sorted(TINY)] + [
    (name, "0.3") for name in sorted(TINY) if "model.dropout=0.0" in TINY[name] and name not in PYTHON_ONLY])
def test_bundled_models_on_the_device_equal_the_c_runner(cuda_standin, name, dtype, dropout, tmp_path):
    """(Dropout on, where the model has it: the device's DROPOUT draws the C runner's masks.)"""
    t = trainer(name, tmp_path, f"train.dtype={dtype}", *([f"model.dropout={dropout}"] if dropout != "0.0" else []))
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    device = Cuda(cuda_standin)
    params = on(device, t)
    switches = SWITCHES[:1] + SWITCHES[-1:] if dtype == "float32" else SWITCHES[::5]
    for options in switches:
        want = t.model.forward_backward(graphs, feeds, t.params, RunContext(seed=5, step=2), options=options)
        inferred = t.model.infer(graphs, feeds, t.params, options=options)
        for executor in RUNNERS:
            opts = replace(options, executor=executor)
            t.model.device = device
            try:
                got = t.model.forward_backward(graphs, feeds, params, RunContext(seed=5, step=2), options=opts)
                inference = t.model.infer(graphs, feeds, params, options=opts)
            finally:
                t.model.device = CPU
            assert_device_runs_the_program(got, executor, PYTHON_ONLY.get(name))
            what = f"{executor} {options}"
            close(got.loss, want.loss, dtype, f"{what} loss")
            close(inference.loss, inferred.loss, dtype, f"{what} inference loss")
            for s in want.pushes:
                for push in want.pushes[s]:
                    close(inference.pushes[s][push], inferred.pushes[s][push], dtype, f"{what} {push}")
            assert set(got.grads) == set(want.grads)
            for k in want.grads:
                close(got.grads[k], want.grads[k], dtype, f"{what} d{k}")


@pytest.mark.parametrize("H", [1, 4])
def test_per_row_matrices_on_the_device_equal_the_c_runner(cuda_standin, H):
    """Per-row values of three axes (cells.per_row_matrices): both device runners run BMM (static operands on
    either side, per-row ones on both), TRANSROWS and kernels over flat rows, as the C runner does."""
    rng = np.random.default_rng(11)
    case = cells.per_row_matrices(rng, H)
    graphs = [InputGraph.chain(n) for n in (2, 5)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    want = case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                       options=EngineOptions(executor="native"))
    device = Cuda(cuda_standin)
    params = {k: device.asarray(v) for k, v in case.params.items()}
    for executor in RUNNERS:
        case.model.device = device
        try:
            got = case.model.forward_backward(graphs, feeds, params, RunContext(),
                                              options=EngineOptions(executor=executor))
        finally:
            case.model.device = CPU
        assert_device_runs_the_program(got, executor)
        close(got.loss, want.loss, "float64", executor)
        for k in want.grads:
            close(got.grads[k], want.grads[k], "float64", f"{executor} d{k}")


@pytest.mark.parametrize("deterministic", [False, True])
def test_dag_gradient_rows_are_added_by_the_device_kernels(cuda_standin, deterministic):
    """A DAG vertex with several parents: the CUDA runner's gather adjoint adds its rows with the device's
    scatter-add (atomics) or, deterministic, the sorted segment sum; equal to the CPU."""
    build, make_graph = CASES["child_sum_dag"]
    rng = np.random.default_rng(7)
    case = build(rng)
    graphs = [make_graph(rng, 6) for _ in range(3)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    options = EngineOptions(gather_elision=False)
    want = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    device = Cuda(cuda_standin, deterministic=deterministic)
    case.model.device = device
    try:
        got = case.model.forward_backward(graphs, feeds, {k: device.asarray(v) for k, v in case.params.items()},
                                          RunContext(), options=options)
    finally:
        case.model.device = CPU
    assert_device_runs_the_program(got, "native")
    close(got.loss, want.loss, "float64")
    for k in want.grads:
        close(got.grads[k], want.grads[k], "float64", k)
    names = {name for name, _, _ in cuda_standin.launches}
    assert ("segment_sum_rows_double" if deterministic else "scatter_add_rows_double") in names


@pytest.mark.parametrize("executor", sorted(RUNNERS))
def test_no_crossing_per_task(cuda_standin, executor):
    """A forward and backward pass of chains of 3 and of 12 vertices (3 and 12 tasks): the same host/device
    crossings (each index array copied once per batch, nothing read back per task)."""
    build, make_graph = CASES["chain_lstm"]
    rng = np.random.default_rng(3)
    case = build(rng)
    device = Cuda(cuda_standin)
    params = {k: device.asarray(v) for k, v in case.params.items()}
    options = EngineOptions(executor=executor)
    case.model.device = device
    counts, tasks = [], []
    try:
        for n in (3, 12):
            graphs = [make_graph(rng, n) for _ in range(2)]
            feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
            case.model.forward_backward(graphs, feeds, params, RunContext(), options=options)   # (compiles)
            standin.reset()
            result = case.model.forward_backward(graphs, feeds, params, RunContext(), options=options)
            counts.append(dict(standin.crossings))
            assert_device_runs_the_program(result, executor)
            tasks.append(len(result.states["G"].program.task_table))
    finally:
        case.model.device = CPU
    assert tasks[0] < tasks[1] and counts[0] == counts[1], (tasks, counts)
