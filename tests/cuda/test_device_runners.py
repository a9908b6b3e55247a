"""The device's runners on the emulated device: the CUDA runner (the pass issued by one C call:
minicavs/cuda/issue.py) and the reference runner over the device's arrays (minicavs/engine/reference.py, its rows
and fused groups by the device's kernels: what runs a pass the loop declines, or with ``issue_from_c`` off). The one
lowered program of every bundled model runs there (no silent fallback to another runner) and equals the C runner
on the CPU, forward values, inference and gradients, float64 and float32, under the engine switches; a DAG's
gradient rows are added by the device's scatter-add kernels; neither runner copies anything between host and
device per task."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from minicavs.cpu import CPU
from minicavs.cuda import Cuda, standin
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.runtime.inputs import InputGraph

from .. import cells
from ..engine.test_alg1 import CASES
from ..engine.test_backend import close, on
from ..engine.test_instructions import SWITCHES, assert_streamed
from ..models.test_models import TINY, trainer

RUNNERS = {"device": "cuda runner", "reference": "reference runner"}
# the ways a pass runs on the device: (runner, whether the CUDA runner issues it from C: off, the device's runner
# declines every pass and the reference runner runs it over the device's arrays)
WAYS = {"issued from C": ("device", True), "issued from Python": ("device", False), "reference": ("reference", True)}


def assert_device_runs_the_program(result, runner: str, from_c: bool = True) -> None:
    """Both passes ran on the runner asked for (the CUDA runner declines no opcode of these programs);
    ``from_c`` off: the device's runner declined them for that reason alone, and the reference runner ran them."""
    for state in result.states.values():
        for program in (state.program, state.backward_program):
            if runner == "device" and not from_c:
                assert program.runner == RUNNERS["reference"] and program.declined == "issue_from_c is off"
                continue
            assert program.runner == RUNNERS[runner] and program.declined is None, program.declined
            assert RUNNERS[runner] in program.dump().splitlines()[0]


def ways(launcher) -> list:
    """(name, runner, device, from_c) of every way a pass runs on the emulated device."""
    devices = {True: Cuda(launcher), False: Cuda(launcher, issue_from_c=False)}
    return [(name, runner, devices[from_c], from_c) for name, (runner, from_c) in WAYS.items()]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name, dropout", [(name, "0.0") for name in sorted(TINY)] + [
    (name, "0.3") for name in sorted(TINY) if "model.dropout=0.0" in TINY[name]])
def test_bundled_models_on_the_device_equal_the_c_runner(cuda_standin, name, dtype, dropout, tmp_path):
    """(Dropout on, where the model has it: the device's DROPOUT draws the C runner's masks.)"""
    t = trainer(name, tmp_path, f"train.dtype={dtype}", *([f"model.dropout={dropout}"] if dropout != "0.0" else []))
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    params = on(Cuda(cuda_standin), t)
    switches = SWITCHES[:1] + SWITCHES[-1:] if dtype == "float32" else SWITCHES[::5]
    for options in switches:
        want = t.model.forward_backward(graphs, feeds, t.params, RunContext(seed=5, step=2), options=options)
        inferred = t.model.infer(graphs, feeds, t.params, options=options)
        for way, runner, device, from_c in ways(cuda_standin):
            opts = replace(options, runner=runner)
            t.model.device = device
            try:
                got = t.model.forward_backward(graphs, feeds, params, RunContext(seed=5, step=2), options=opts)
                inference = t.model.infer(graphs, feeds, params, options=opts)
            finally:
                t.model.device = CPU
            assert_device_runs_the_program(got, runner, from_c)
            what = f"{way} {options}"
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
                                       options=EngineOptions(runner="device"))
    params = {k: Cuda(cuda_standin).asarray(v) for k, v in case.params.items()}
    for way, runner, device, from_c in ways(cuda_standin):
        case.model.device = device
        try:
            got = case.model.forward_backward(graphs, feeds, params, RunContext(),
                                              options=EngineOptions(runner=runner))
        finally:
            case.model.device = CPU
        assert_device_runs_the_program(got, runner, from_c)
        close(got.loss, want.loss, "float64", way)
        for k in want.grads:
            close(got.grads[k], want.grads[k], "float64", f"{way} d{k}")


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
    for state in got.states.values():   # (a fixed order: the segment sums, planned per task from Python)
        assert state.program.runner == "cuda runner" and state.program.declined is None
        why = state.backward_program.declined
        assert (why is not None and "fixed order" in why) if deterministic else why is None, why
        assert state.backward_program.runner == ("reference runner" if deterministic else "cuda runner")
    close(got.loss, want.loss, "float64")
    for k in want.grads:
        close(got.grads[k], want.grads[k], "float64", k)
    names = {name for name, _, _ in cuda_standin.launches}
    # (deterministic: the sorted segment sums; else atomic adds by index, which the C issuing loop batches
    # into its ``moves`` launches)
    assert "segment_sum_rows_double" in names if deterministic else "moves_double" in names, names


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("way", sorted(WAYS))
def test_no_crossing_per_task(cuda_standin, way, streaming):
    """A forward and backward pass of chains of 3 and of 12 vertices (3 and 12 tasks): the same host/device
    crossings (each index array copied once per batch, nothing read back per task)."""
    build, make_graph = CASES["chain_lstm"]
    rng = np.random.default_rng(3)
    case = build(rng)
    runner, from_c = WAYS[way]
    device = Cuda(cuda_standin, issue_from_c=from_c)
    params = {k: device.asarray(v) for k, v in case.params.items()}
    options = EngineOptions(runner=runner, streaming=streaming)
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
            assert_device_runs_the_program(result, runner, from_c)
            tasks.append(len(result.states["G"].program.task_table))
    finally:
        case.model.device = CPU
    assert tasks[0] < tasks[1] and counts[0] == counts[1], (tasks, counts)


@pytest.mark.parametrize("name", sorted(TINY))
def test_bundled_models_streaming_on_the_device_equal_the_c_runner(cuda_standin, name, tmp_path):
    """Streaming on the device: the CUDA runner's eager chunks on the second stream (the reference runner's on
    its thread) give the C runner's numbers on one stream."""
    t = trainer(name, tmp_path, "train.dtype=float64")
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    params = on(Cuda(cuda_standin), t)
    for options in SWITCHES[:1] + SWITCHES[-1:]:
        want = t.model.forward_backward(graphs, feeds, t.params, RunContext(seed=5, step=2), options=options)
        for way, runner, device, from_c in ways(cuda_standin):
            opts = replace(options, runner=runner, streaming=True)
            t.model.device = device
            try:
                got = t.model.forward_backward(graphs, feeds, params, RunContext(seed=5, step=2), options=opts)
            finally:
                t.model.device = CPU
            assert_device_runs_the_program(got, runner, from_c)
            assert_streamed(got)
            what = f"{way} streaming {options}"
            close(got.loss, want.loss, "float64", f"{what} loss")
            assert set(got.grads) == set(want.grads)
            for k in want.grads:
                close(got.grads[k], want.grads[k], "float64", f"{what} d{k}")


def test_eager_chunks_run_on_the_second_stream(cuda_standin, monkeypatch):
    """(The reference runner on the device; tests/cuda/test_issue.py checks the C loop's streams.) Every eager
    instruction runs while the device's eager stream is current, every main one on the caller's
    stream; the eager stream first waits for the caller's stream, records an event per chunk, and the caller's
    stream waits for chunk t's event before task t (on the device: no host wait, no crossing)."""
    from minicavs.engine import reference
    log, recorded, waited = [], [], []
    wrapped = []
    for fn in reference.BY_ID:
        def logged(m, *operands, _fn=fn):
            log.append((m.stream, m.task_index, standin.cuda.get_current_stream(), id(m.lowered)))
            return _fn(m, *operands)
        wrapped.append(logged)
    monkeypatch.setattr(reference, "BY_ID", wrapped)
    real_record, real_wait = standin._Stream.record, standin._Stream.wait_event

    def record(stream, event=None):
        event = real_record(stream, event)
        recorded.append((stream, event))
        return event

    def wait_event(stream, event):
        waited.append((stream, event, len(log)))
        return real_wait(stream, event)
    monkeypatch.setattr(standin._Stream, "record", record)
    monkeypatch.setattr(standin._Stream, "wait_event", wait_event)
    build, make_graph = CASES["binary_tree_lstm"]
    rng = np.random.default_rng(6)
    case = build(rng)
    graphs = [make_graph(rng, 5) for _ in range(3)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    device = Cuda(cuda_standin, issue_from_c=False)
    case.model.device = device
    try:
        result = case.model.forward_backward(graphs, feeds, {k: device.asarray(v) for k, v in case.params.items()},
                                             RunContext(), options=EngineOptions(streaming=True))
    finally:
        case.model.device = CPU
    assert_streamed(result)
    eager_stream, main_stream = device.eager_stream(), standin.cuda.get_current_stream()
    assert eager_stream is not main_stream
    for program in (result.states["G"].program, result.states["G"].backward_program):
        mine = [(i, entry) for i, entry in enumerate(log) if entry[3] == id(program.lowered)]
        assert {entry[2] for _, entry in mine if entry[0] == "eager"} == {eager_stream}
        assert {entry[2] for _, entry in mine if entry[0] == "main"} == {main_stream}
        chunk_events = [(i, event) for i, (stream, event) in enumerate(recorded) if stream is eager_stream]
        first_main = min(i for i, entry in mine if entry[0] == "main")
        # the caller's stream waited for chunk events (recorded on the eager stream), the first before any task
        waits = [(event, at) for stream, event, at in waited if stream is main_stream
                 and any(event is e for _, e in chunk_events)]
        assert waits and min(at for _, at in waits) <= first_main
    assert any(stream is eager_stream and event is not None for stream, event, _ in waited)   # (the inputs)
