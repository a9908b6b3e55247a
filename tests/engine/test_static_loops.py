"""Static graphs holding loops as instruction programs (engine/static_loops.py, engine/row_trips.py): seq2seq's
training pass (a foreach encoder and decoder over int target ids, their reverse gradient loops) and the foreach
Var-LSTM's (a loop with a trip count per row) run on every runner (reference, C runner, the emulated CUDA issuing
loop) without declining, equal to the step runner (program.run_steps) to 1e-12 in float64; a small language model
loop lowered as a program matches float64 central finite differences for 0, 1, several and the most steps, and
for trip counts per row including 0; a corrupted loop operand is refused by every runner naming it; a bad trip
count or label is a FeedError naming it."""
from __future__ import annotations

import re

import numpy as np
import pytest

from minicavs import ops
from minicavs.core.dtypes import float64 as F64
from minicavs.core.errors import CheckError, FeedError
from minicavs.cuda import Cuda, issue
from minicavs.engine import static_program
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.lowered import OPCODES_BY_ID
from minicavs.engine.model import Model
from minicavs.ops import control as C
from minicavs.train.testing import check_model_grads

from .test_static_program import FOREACH, _equal, _model, _programs, _run, _steps_only

T, D, H, V, ROWS = 5, 3, 4, 6, 4
# what stays on the step runner: the lookups of (rows, steps) ids before the program, the table's row-sparse
# gradients after it, a parameter's transpose (a view made before it, read as a static: packed for its products)
LEFT = {"lookup", "lookup_grad", "accum"}


def _opcodes(program) -> set:
    return {OPCODES_BY_ID[op] for op in program.lowered.code[:, 0]}


@pytest.mark.parametrize("name", sorted(FOREACH))
def test_the_loops_run_in_the_program_on_every_runner_equal_to_the_step_runner(cuda_standin, name, tmp_path):
    t, graphs, feeds = _model(name, tmp_path)
    want = _steps_only(t, graphs, feeds)
    for runner, device, who in [("reference", None, "reference runner"), ("device", None, "C runner"),
                                ("device", Cuda(cuda_standin), "cuda runner")]:
        got = _run(t, graphs, feeds, runner, device, check=True)
        _equal(got, want, who)
        (program,) = _programs(got)
        assert program.runner == who and program.declined is None and program.lowered.c_refusal is None
        assert {"ENDLOOP", "STEPCOLS", "ROWOP"} <= _opcodes(program) and "APPLY" not in _opcodes(program)
        left = {n.op for run in got.static for n in (run.left or {})}
        assert left <= LEFT, left


def _lm(per_row: bool, fixed: bool = False) -> Model:
    """A static graph of one loop: per step tanh(x_t·W + h·U + b), its cross-entropy against the step's int
    label y_t; steps= one count (LOOPN) or one per row (masks), or (``fixed``) all T steps; loss = the summed
    cross-entropies."""
    W, U, b = ops.param_node("W", (D, H), F64), ops.param_node("U", (H, H), F64), ops.param_node("b", (H,), F64)
    Wo = ops.param_node("Wo", (H, V), F64)
    x, y = ops.input((None, T, D), "float64", name="x"), ops.input((None, T), "int64", name="y")
    h0 = ops.input((None, H), "float64", name="h0")
    steps = ops.input((None,) if per_row else (), "int64", name="steps")

    def body(inputs, states):
        h = ops.tanh(ops.linear(inputs[0], W, b) + states[0] @ U)
        return [ops.softmax_cross_entropy(h @ Wo, inputs[1])], [h]
    (nll,), _ = C.foreach(body, [x, y], [h0], steps=None if fixed else steps, name="lm")
    return Model([], loss=ops.sum(nll), outputs={"nll": ops.sum(nll)})


def _values(steps) -> tuple[dict, dict]:
    rng = np.random.default_rng(4)
    params = {"W": rng.normal(size=(D, H)), "U": rng.normal(size=(H, H)) * 0.5, "b": rng.normal(size=H),
              "Wo": rng.normal(size=(H, V))}
    feeds = {"x": rng.normal(size=(ROWS, T, D)), "y": rng.integers(0, V, (ROWS, T)),
             "h0": rng.normal(size=(ROWS, H)), "steps": np.asarray(steps, np.int64)}
    return params, feeds


def _ran_in_a_program(model, params, feeds, opcode: str):
    got = model.forward_backward({}, feeds, params, RunContext())
    (program,) = _programs(got)
    assert program.runner == "C runner" and program.declined is None and opcode in _opcodes(program)
    return got


@pytest.mark.parametrize("steps", [0, 1, 3, T])
def test_a_loop_with_a_run_time_trip_count_matches_finite_differences(steps):
    model = _lm(per_row=False)
    params, feeds = _values(steps)
    got = _ran_in_a_program(model, params, feeds, "LOOPN")
    assert (float(got.loss) == 0.0) == (steps == 0)
    check_model_grads(model, {}, feeds, params, directions=2)


@pytest.mark.parametrize("lengths", [[T, 3, 0, 1], [0, 0, 0, 0], [2, 2, 2, 2], [T, T, T, T]])
def test_a_loop_with_a_trip_count_per_row_matches_finite_differences_and_the_step_runner(cuda_standin, lengths):
    model = _lm(per_row=True)
    params, feeds = _values(lengths)
    _ran_in_a_program(model, params, feeds, "LOOPN")
    check_model_grads(model, {}, feeds, params, directions=2)
    want = _on_the_step_runner(_lm(per_row=True), params, feeds)
    for device in (None, Cuda(cuda_standin)):
        got = _on(model, params, feeds, device)
        assert abs(float(got.loss) - float(want.loss)) <= 1e-12 * max(1.0, abs(float(want.loss)))
        for k in params:
            assert np.abs(np.asarray(got.grads[k]) - want.grads[k]).max() <= 1e-12 * max(1.0, np.abs(want.grads[k]).max())


def _on_the_step_runner(model, params, feeds):
    """The training pass with the static graph on the step runner (nothing lowered: what ran before)."""
    keep = static_program.refusal
    static_program.refusal = lambda node: "the step runner's run, for comparison"
    try:
        got = model.forward_backward({}, feeds, params, RunContext())
    finally:
        static_program.refusal = keep
    assert not _programs(got)
    return got


def _on(model, params, feeds, device, **switches):
    """A training pass on the C runner, or on ``device`` (the emulated CUDA device), its values there."""
    if device is None:
        return model.forward_backward({}, feeds, params, RunContext(), options=EngineOptions(**switches))
    cpu, model.device = model.device, device
    try:
        got = model.forward_backward({}, feeds, {k: device.asarray(v) for k, v in params.items()}, RunContext(),
                                     options=EngineOptions(**switches))
    finally:
        model.device = cpu
    got.grads = {k: np.asarray(device.to_host(v)) for k, v in got.grads.items()}
    got.loss = np.asarray(device.to_host(got.loss))
    return got


def test_a_bad_trip_count_or_label_is_a_feed_error_naming_it_on_every_device(cuda_standin):
    for per_row, key, bad, match in [(True, "steps", [T + 1, 0, 0, 0], r"steps.*\[0\] = 6"),
                                     (True, "steps", [1, 2], r"'steps' has 2 rows"),
                                     (False, "steps", T + 1, r"LOOPN .*operand count"),   # (read where it runs)
                                     (True, "y", (1, 2), r"'y'\[1, 2\] = 6: a label of a loop's step must be a "
                                                         r"class in \[0, 6\)")]:
        model = _lm(per_row)
        params, feeds = _values([T, T, T, T] if per_row else T)
        feeds[key] = np.asarray(bad, np.int64) if key == "steps" else feeds[key].copy()
        if key == "y":
            feeds[key][bad] = V
        for device in (None, Cuda(cuda_standin)):
            with pytest.raises(FeedError if per_row else (CheckError, issue.IssueCheckError), match=match):
                _on(model, params, feeds, device)


@pytest.mark.parametrize("opcode, operand, value, name", [
    ("ROWOP", 4, 10**6, "labels"), ("ROWOP", 4, -1, "labels"), ("STEPCOLS", 1, 10**6, "src"),
    ("LOOPN", 0, -1, "count"), ("ENDLOOP", 2, 9, "depth")])
def test_a_corrupted_loop_operand_is_refused_by_every_runner_naming_it(cuda_standin, opcode, operand, value,
                                                                        name):
    model = _lm(per_row=True)
    params, feeds = _values([T, 3, 0, 1])
    expected = [("reference", None, CheckError, rf"reference static graph: task 0, instruction \d+ \({opcode} "
                                                rf".*\): (operand {name}|register|buffer)"),
                ("device", None, CheckError, rf"C runner static graph: task 0, instruction \d+ \({opcode} .*\): "
                                             rf"operand {name}"),
                ("device", Cuda(cuda_standin), issue.IssueCheckError,
                 rf"cuda static graph: task 0, instruction \d+ \({opcode} .*\): operand {name}")]
    for runner, device, error, message in expected:
        got = _on(model, params, feeds, device, runner=runner, check=True)
        code = next(p for p in _programs(got) if opcode in _opcodes(p)).lowered.code
        pc = int(np.flatnonzero([OPCODES_BY_ID[op] == opcode for op in code[:, 0]])[0])
        old = int(code[pc][1 + operand])
        code[pc][1 + operand] = value
        try:
            with pytest.raises(error, match=message):
                _on(model, params, feeds, device, runner=runner, check=True)
        finally:
            code[pc][1 + operand] = old


def test_a_loop_over_all_its_steps_equals_the_step_runner_on_every_runner(cuda_standin):
    """All T steps (no trip count): its parameters' gradients one product over FLAT views; every runner equals
    the step runner to 1e-12 (float64)."""
    params, feeds = _values([T] * ROWS)
    feeds.pop("steps")
    want = _on_the_step_runner(_lm(per_row=False, fixed=True), params, feeds)
    model = _lm(per_row=False, fixed=True)
    for runner, device in [("reference", None), ("device", None), ("device", Cuda(cuda_standin))]:
        got = _on(model, params, feeds, device, runner=runner)
        assert "FLAT" in _opcodes(_programs(got)[0])
        assert abs(float(got.loss) - float(want.loss)) <= 1e-12 * max(1.0, abs(float(want.loss)))
        for k in params:
            got_k = np.asarray(got.grads[k])
            assert np.abs(got_k - want.grads[k]).max() <= 1e-12 * max(1.0, np.abs(want.grads[k]).max()), k


@pytest.mark.parametrize("operand, value, name", [
    ("k", 10**6, "src"), ("k", -1, "k"), ("cols", 10**6, "src"), ("k", T - 1, "k"), ("gemm k", -10**6, "a")])
def test_a_corrupted_flat_view_is_refused_by_every_runner_naming_it(cuda_standin, operand, value, name):
    """FLAT (a stacked value's steps read as rows) and the product over it: a view past its memory (the rows
    x k x cols it spans, the GEMM's -k x rows), a negative k, or rows not k blocks of cols apart, refused."""
    model = _lm(per_row=False, fixed=True)
    params, feeds = _values([T] * ROWS)
    feeds.pop("steps")
    opcode, at = ("GEMM", 5) if operand == "gemm k" else ("FLAT", {"cols": 2, "k": 3}[operand])
    for runner, device, error, who in [("reference", None, CheckError, "reference"),
                                       ("device", None, CheckError, "C runner"),
                                       ("device", Cuda(cuda_standin), issue.IssueCheckError, "cuda")]:
        got = _on(model, params, feeds, device, runner=runner, check=True)
        code = _programs(got)[0].lowered.code
        pc = next(i for i, row in enumerate(code) if OPCODES_BY_ID[row[0]] == opcode and (
            opcode == "FLAT" or row[1 + at] < -1))   # (the product over a FLAT view: its k -T)
        old = int(code[pc][1 + at])
        code[pc][1 + at] = value
        try:
            with pytest.raises(error, match=rf"{who} static graph: task 0, instruction {pc} \({opcode} .*\): "
                                            rf"operand {name}"):
                _on(model, params, feeds, device, runner=runner, check=True)
        finally:
            code[pc][1 + at] = old


@pytest.mark.parametrize("name", sorted(FOREACH))
def test_a_training_step_of_a_loop_program_reads_the_device_once(cuda_standin, monkeypatch, name, tmp_path):
    """On the emulated device a static graph's loops add no crossing per step or row: one device-to-host read a
    training step (the optimizer's), and a loop with a trip count per row one more (its LOOPN's count, the
    longest row's, read where the issuing loop runs: once a pass, for the forward and the gradient loop); copies
    to the device from the known sites, as many for 2 rows as for 16."""
    from minicavs.cuda import standin
    from minicavs.train.trainer import Trainer
    from ..cuda.test_crossings import WHY_H2D
    from ..models.test_models import MODELS
    monkeypatch.setattr(standin, "TRACE", True)
    config, overrides = FOREACH[name]
    overrides = [o for o in overrides if not o.startswith("data.synthetic.train")]
    t = Trainer(MODELS / f"{config}.yaml", overrides + ["data.synthetic.train=24", "train.device=cuda"],
                run_dir=tmp_path / name)
    t.train_step([0, 1])
    sites = []
    for samples in ([2, 3], list(range(4, 20))):
        standin.reset()
        t.train_step(samples)
        reads = 1 + (name == "var_lstm_foreach")
        assert standin.crossings.get("d2h", 0) == reads, (name, dict(standin.crossings), dict(standin.sites))
        sites.append({site: n for (way, site), n in standin.sites.items() if way == "h2d"})
    assert set(sites[0]) | set(sites[1]) <= set(WHY_H2D) | set(LOOP_H2D) and sites[0] == sites[1], sites


# the copies a loop program adds, once per batch each
LOOP_H2D = {"engine/static_program.py:_as_float": "an int value a loop iterates over, in the program's float type",
            "engine/static_program.py:__getitem__": "a per-row loop's running mask and longest trip count"}


def test_explain_lists_a_static_programs_loops_and_that_nothing_stays_on_the_step_runner(tmp_path):
    from minicavs.engine.explain import explain
    for name, loop in [("seq2seq", r"loop at depth 0: 4 steps"),
                       ("var_lstm_foreach", r"loop at depth 0: \d+ steps of at most \d+, the trip count read where it "
                                            r"runs from longest.*each step over the rows still running, sorted "
                                            r"longest first \(ROWS\): \d+ row-steps of \d+")]:
        t, graphs, feeds = _model(name, tmp_path)
        text = str(explain(t.model, graphs, feeds, t.params))
        assert len(re.findall(r"      instruction \d+: " + loop, text)) == 2, text   # (forward, gradient)
        assert "no node left to the step runner" in text and "step runner:" not in text, text
        assert "foreach" not in text.split("largest")[0], text


def test_nan_in_a_finished_rows_padding_reaches_no_value_and_no_gradient(cuda_standin):
    """Each row's inputs past its length NaN: the program's loss and gradients (the forward's selects, the
    gradient loop reading zeros for a finished row) are finite and the step runner's, which never reads them."""
    lengths = [T, 3, 0, 1]
    params, feeds = _values(lengths)
    feeds["x"] = feeds["x"].copy()
    for r, n in enumerate(lengths):
        feeds["x"][r, n:] = np.nan
    want = _on_the_step_runner(_lm(per_row=True), params, feeds)
    model = _lm(per_row=True)
    for device in (None, Cuda(cuda_standin)):
        got = _on(model, params, feeds, device)
        assert [p.declined for p in _programs(got)] == [None]   # (the loop ran in the program)
        assert np.isfinite(float(got.loss)) and abs(float(got.loss) - float(want.loss)) <= 1e-12 * abs(float(want.loss))
        for k in params:
            assert np.isfinite(got.grads[k]).all(), k
            assert np.abs(np.asarray(got.grads[k]) - want.grads[k]).max() <= 1e-12 * max(1.0, np.abs(want.grads[k]).max())
