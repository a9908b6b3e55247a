"""A static graph's while_loop as a loop of its instruction program (engine/static_loops.py, engine/loops.py):
the condition's instructions and WHILE at the top of LOOP ... ENDLOOP, the count of steps run written by STEPS
in the program's float type and handed out as the model's int64 value (seq2seq's greedy decoding, ``predict``);
the gradient's reverse loop over that count read where it runs (LOOPR). Every runner (reference, C runner, the
emulated CUDA issuing loop) equals the step runner (program.run_steps) to 1e-12 in float64, declining nothing;
gradients match float64 central finite differences for 0, 1, several and the most steps; a corrupted WHILE,
STEPS or LOOPR is refused by every runner naming the operand; on the device each condition is one counted read
per test and the count one write."""
from __future__ import annotations

import re

import numpy as np
import pytest

from minicavs import ops
from minicavs.core.dtypes import float64 as F64
from minicavs.cuda import Cuda, standin
from minicavs.engine.backend import to_host
from minicavs.engine.compile import EngineOptions
from minicavs.engine.model import Model
from minicavs.ops import control as C
from minicavs.train.testing import check_model_grads

from .static_runners import (RUNNERS, _on_the_step_runner, _opcodes, _operand_set, _refused_when_corrupted,
                             _train)
from .test_static_program import _model

H, ROWS, MOST = 3, 4, 5
# the limit on the step counter and the steps it runs: 0, 1, several, the most (the condition still true)
LIMITS = {0: -0.5, 1: 0.5, 3: 2.5, MOST: 9.0}
# greedy decoding's cases: the parameters (a seed, the scale of W_o, dec_Wh and E, b_o's <eos> entry moved) and
# the steps the step runner's decoding runs: every row stops at once, rows stop at different steps, none stops
GREEDY = {"at once": ((0, 1.0, 50.0), lambda n: n == 1), "rows apart": ((3, 3.0, 0.0), lambda n: 1 < n < MOST),
          "never": ((0, 1.0, -50.0), lambda n: n == MOST)}


def _decoder(tmp_path, case: str):
    """seq2seq's greedy decoder (float64, max_len 4: at most 5 steps) with ``case``'s parameters, its feeds."""
    t, _, _ = _model("seq2seq", tmp_path)
    (seed, scale, eos), _ = GREEDY[case]
    rng = np.random.default_rng(seed)
    for k, p in t.params.items():
        p.value[...] = rng.normal(size=p.value.shape) * (scale if k in ("W_o", "dec_Wh", "E") else 1.0)
    t.params["b_o"].value[10] += eos
    _, feeds = t.task.batch(t.task.data["train"][:6])
    return t, feeds


def _infer(t, feeds, runner: str, device=None):
    """The decoder's outputs on ``runner`` (``device``: the emulated CUDA device), on the host; its static runs."""
    model = t.task.model
    cpu, model.device = model.device, device or model.device
    params = {k: model.device.asarray(p.value) for k, p in t.params.items()}
    try:
        got = t.task.decoder.infer({}, feeds, params, options=EngineOptions(runner=runner, check=True))
    finally:
        model.device = cpu
    return {k: np.asarray(to_host(v)) for k, v in got.outputs.items()}, got.static


@pytest.mark.parametrize("case", sorted(GREEDY))
def test_greedy_decoding_runs_in_a_program_on_every_runner_equal_to_the_step_runner(cuda_standin, case, tmp_path):
    t, feeds = _decoder(tmp_path, case)
    want, _ = _on_the_step_runner(lambda: _infer(t, feeds, "device"))
    t.task._decoder = None   # (its programs made again, lowered)
    assert want["steps"].dtype == np.int64 and GREEDY[case][1](int(want["steps"])), want["steps"]
    for runner, device, who in RUNNERS:
        got, static = _infer(t, feeds, runner, Cuda(cuda_standin) if device else None)
        assert got["steps"].dtype == np.int64 and got["steps"].shape == () and got["steps"] == want["steps"], who
        assert np.abs(got["tokens"] - want["tokens"]).max() <= 1e-12, who
        (run,) = static
        assert run.program.runner == who and run.program.declined is None and run.program.lowered.c_refusal is None
        assert {"WHILE", "STEPS"} <= set(_opcodes(run.program)) and "APPLY" not in _opcodes(run.program)
        assert {n.op for n in run.left} <= {"lookup", "slice"}, run.left   # (the <go> and source lookups, before)


def _while_model(limit: float) -> Model:
    """A static graph of one while_loop: per step h = tanh(h·U + b) while a counter is below ``limit``, at most
    MOST steps; loss = the final state's squares summed plus the stacked states' weighted sum; outputs: the
    count of steps run and the stacked states."""
    U, b = ops.param_node("U", (H, H), F64), ops.param_node("b", (H,), F64)
    w = ops.param_node("w", (H,), F64)
    h0 = ops.input((None, H), "float64", name="h0")

    def body(v):
        h = ops.tanh(v[0] @ U + b)
        return [h * w], [h, v[1] + 1.0]
    (hs,), (h, _), n = C.while_loop(lambda v: ops.step(limit - v[1]), body, [h0, ops.constant(0.0, F64)], MOST,
                                    name="w")
    stacked = ops.reshape(hs, (None, MOST * H))
    return Model([], loss=ops.sum(h * h) + ops.sum(stacked), outputs={"n": n, "hs": hs})


def _while_values() -> tuple[dict, dict]:
    rng = np.random.default_rng(5)
    return ({"U": rng.normal(size=(H, H)) * 0.7, "b": rng.normal(size=H), "w": rng.normal(size=H)},
            {"h0": rng.normal(size=(ROWS, H))})


@pytest.mark.parametrize("steps", sorted(LIMITS))
def test_a_static_while_and_its_gradient_loop_run_in_the_program_equal_to_the_step_runner(cuda_standin, steps):
    params, feeds = _while_values()
    want, _, _ = _on_the_step_runner(lambda: _train(_while_model(LIMITS[steps]), params, feeds))
    assert int(want["n"]) == steps
    model = _while_model(LIMITS[steps])
    for runner, device, who in RUNNERS:
        got, (program,), static = _train(model, params, feeds, runner, Cuda(cuda_standin) if device else None,
                                         check=True)
        assert program.runner == who and program.declined is None and not static[0].left, (who, static[0].left)
        assert {"WHILE", "STEPS", "LOOPR"} <= set(_opcodes(program)), _opcodes(program)
        for k, b in want.items():
            assert got[k].dtype == b.dtype and np.abs(got[k] - b).max() <= 1e-12 * max(1.0, np.abs(b).max()), \
                (who, k)
    check_model_grads(model, {}, feeds, params, directions=2)


@pytest.mark.parametrize("opcode, operand, value, name", [
    ("WHILE", 1, 10**6, "cond"), ("STEPS", 0, 10**6, "dst"), ("STEPS", 1, 9, "depth"), ("LOOPR", 3, 10**6, "cond"),
    ("LOOPR", 2, 9, "depth")])
def test_a_corrupted_while_count_or_trip_count_is_refused_by_every_runner_naming_it(cuda_standin, opcode, operand,
                                                                                    value, name):
    params, feeds = _while_values()
    _refused_when_corrupted(cuda_standin, _while_model(LIMITS[3]), params, feeds, opcode, _operand_set(operand, value),
                            rf"(operand {name}|register|buffer)")


def test_a_trip_count_that_is_not_a_whole_count_is_refused_by_every_runner_naming_it(cuda_standin):
    """The gradient loop's LOOPR pointed at the register of the while's final state (tanh values, not the count
    STEPS wrote): refused before its body runs."""
    params, feeds = _while_values()

    def loop_state(program, row) -> tuple[int, int]:
        old, row[4] = int(row[4]), program.lowered.templates[0].reg_names.index("loop.1")
        return 4, old
    _refused_when_corrupted(cuda_standin, _while_model(LIMITS[3]), params, feeds, "LOOPR", loop_state, "operand cond")


@pytest.mark.parametrize("case", ["at once", "rows apart", "never"])
def test_greedy_decoding_on_the_device_reads_each_condition_once_and_writes_its_count_once(cuda_standin, case,
                                                                                           tmp_path, monkeypatch):
    """A predict pass on the emulated device: the issuing loop reads one value per WHILE run (the steps, and one
    more where the loop stopped before its most) and writes one (STEPS's count), as many for 2 rows as for 6;
    the int64 count is made on the device; the only other reads are the model's outputs (to the host)."""
    t, feeds = _decoder(tmp_path, case)
    monkeypatch.setattr(standin, "TRACE", True)
    model = t.task.model
    for rows in (2, 6):
        _, some = t.task.batch(t.task.data["train"][:rows])
        cpu, model.device = model.device, Cuda(cuda_standin)
        try:
            params = {k: model.device.asarray(p.value) for k, p in t.params.items()}
            standin.reset()
            got = t.task.decoder.infer({}, some, params)
        finally:
            model.device = cpu
        steps = int(got.outputs["steps"])
        loop = {way: n for (way, site), n in standin.sites.items() if site == "cuda/issue.py:run"}
        assert loop == {"d2h": steps + (steps < MOST), "h2d": 1}, (case, rows, dict(standin.sites))
        assert standin.crossings["d2h"] == loop["d2h"] + len(got.outputs), dict(standin.sites)
        assert GREEDY[case][1](steps) or rows == 2, (case, steps)


def test_explain_shows_greedy_decodings_while_loop_in_the_program(tmp_path):
    from minicavs.engine.explain import explain
    t, feeds = _decoder(tmp_path, "rows apart")
    text = str(explain(t.task.decoder, {}, feeds, t.params))
    assert re.search(rf"      instruction \d+: loop at depth 0: at most {MOST} steps, while r\d+\(.*\) is not 0 "
                     rf"\(WHILE at \d+\)", text), text
    assert "step runner: while_loop" not in text and "int64 result" not in text, text
