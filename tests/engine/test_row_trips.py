"""A loop with a trip count per row in a static program (engine/row_trips.py): its rows put longest first
(ROWPERM), each step run over the rows still running alone (ROWS), its per-row results put back in the rows' order;
equal to the step runner (ops/row_steps.py) on every runner, per row, for unsorted rows and lengths 0, 1 and the
most; a corrupted active-row table is refused by every runner naming it."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import ops
from minicavs.core.dtypes import float64 as F64
from minicavs.core.errors import CheckError
from minicavs.cuda import Cuda, issue
from minicavs.engine import reference, row_trips
from minicavs.engine.executor import RunContext
from minicavs.engine.model import Model
from minicavs.ops import control as C
from minicavs.train.testing import check_model_grads

from .test_static_loops import D, H, T, V, _on, _on_the_step_runner, _opcodes, _programs, _values

UNSORTED = [1, T, 0, 3]   # (rows out of length order: the longest second, a row of no step)


def _lm_rows() -> Model:
    """The language-model loop of test_static_loops with per-row outputs: each row's cross-entropies per step
    and its final state, so that a row handed back in another row's place shows."""
    W, U, b = ops.param_node("W", (D, H), F64), ops.param_node("U", (H, H), F64), ops.param_node("b", (H,), F64)
    Wo = ops.param_node("Wo", (H, V), F64)
    x, y = ops.input((None, T, D), "float64", name="x"), ops.input((None, T), "int64", name="y")
    h0, steps = ops.input((None, H), "float64", name="h0"), ops.input((None,), "int64", name="steps")

    def body(inputs, states):
        h = ops.tanh(ops.linear(inputs[0], W, b) + states[0] @ U)
        return [ops.softmax_cross_entropy(h @ Wo, inputs[1])], [h]
    (nll,), (h,) = C.foreach(body, [x, y], [h0], steps=steps, name="lm")
    return Model([], loss=ops.sum(nll) + ops.sum(h * h), outputs={"nll": nll, "h": h})


def _close(got, want, what: str) -> None:
    """Loss, gradients and per-row outputs equal to 1e-12 (DESIGN.md's rule for float64 runs)."""
    pairs = [("loss", got.loss, want.loss)] + [(k, got.grads[k], want.grads[k]) for k in want.grads]
    pairs += [(k, got.outputs[k], want.outputs[k]) for k in want.outputs]
    for name, a, b in pairs:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape and np.abs(a - b).max(initial=0) <= 1e-12 * max(1.0, np.abs(b).max(initial=0)), \
            (what, name, np.abs(a - b).max(initial=0))


@pytest.mark.parametrize("lengths", [UNSORTED, [0, 0, 0, 0], [1, 1, 1, 1], [T, T, T, T], [T, 3, 0, 1]])
def test_a_per_row_loop_runs_its_active_rows_and_equals_the_step_runner_per_row(cuda_standin, lengths):
    """The program sorts the rows (ROWPERM) and runs each step over the active ones (ROWS); per row, its outputs
    equal the step runner's (the numpy path: ops/row_steps.py) on the reference, C and emulated CUDA runners, and
    its gradients match float64 central finite differences."""
    model = _lm_rows()
    params, feeds = _values(lengths)
    want = _on_the_step_runner(_lm_rows(), params, feeds)
    for runner, device in [("reference", None), ("device", None), ("device", Cuda(cuda_standin))]:
        got = _on(model, params, feeds, device, runner=runner, check=True)
        if device is not None:
            got.outputs = {k: np.asarray(device.to_host(v)) for k, v in got.outputs.items()}
        (program,) = _programs(got)
        assert {"ROWS", "ROWPERM"} <= _opcodes(program), program.runner
        _close(got, want, program.runner)
    check_model_grads(model, {}, feeds, params, directions=2)


def test_a_step_runs_fewer_rows_as_rows_finish():
    """The reference runner's record of the loop's input product (x_t . W: k = D) per step: the rows still
    running at that step (lengths 1, T, 0, 3: 3, 2, 2, 1, 1), not every row at every step."""
    gemm = reference.NAMES.index("GEMM")
    seen, run = [], reference.BY_ID[gemm]

    def recorded(m, c, a, b, rows, n, k, bias):
        if rows < 0 and k == D:
            seen.append(m.dim(rows))
        return run(m, c, a, b, rows, n, k, bias)
    params, feeds = _values(UNSORTED)
    reference.BY_ID[gemm] = recorded
    try:
        _on(_lm_rows(), params, feeds, None, runner="reference")
    finally:
        reference.BY_ID[gemm] = run
    assert seen == [int(np.sum(np.asarray(UNSORTED) > t)) for t in range(T)] == [3, 2, 2, 1, 1]


@pytest.mark.parametrize("corrupt, what", [(lambda a: a[:2], "shorter than the trip count"),
                                           (lambda a: np.r_[a[:2], a[1] + 1, a[3:]], "not non-increasing"),
                                           (lambda a: np.r_[len(UNSORTED) + 1, a[1:]], "above the rows"),
                                           (lambda a: np.r_[a[:-1], -1], "negative")])
def test_a_corrupted_active_row_table_is_refused_by_every_runner_naming_it(cuda_standin, monkeypatch, corrupt,
                                                                           what):
    """A table of active rows that is too short, rises, exceeds the rows or is negative: every runner refuses
    the ROWS instruction naming its operand ``table`` (checked at the loop's first step, before any row moves)."""
    bound = row_trips.bound

    def corrupted(value, key, rows):
        made = bound(value, key, rows)
        return np.ascontiguousarray(corrupt(made), np.int64) if key[0] == row_trips.ACTIVE else made
    monkeypatch.setattr(row_trips, "bound", corrupted)
    params, feeds = _values(UNSORTED)
    expected = [("reference", None, CheckError, r"reference static graph: .*\(ROWS .*\): operand table"),
                ("device", None, CheckError, r"C runner static graph: .*\(ROWS .*\): operand table"),
                ("device", Cuda(cuda_standin), issue.IssueCheckError, r"cuda static graph: .*\(ROWS .*\): operand "
                                                                      r"table")]
    for runner, device, error, message in expected:
        with pytest.raises(error, match=message):
            _on(_lm_rows(), params, feeds, device, runner=runner)


def test_a_row_order_out_of_range_is_refused_in_check_mode_by_every_runner(cuda_standin, monkeypatch):
    """ROWPERM's index names a row of the task (its ``idx`` checked, as every index buffer, in check mode)."""
    bound = row_trips.bound

    def corrupted(value, key, rows):
        made = bound(value, key, rows)
        return np.r_[made[:-1], rows] if key[0] == row_trips.ORDER else made
    monkeypatch.setattr(row_trips, "bound", corrupted)
    params, feeds = _values(UNSORTED)
    for runner, device, error in [("reference", None, CheckError), ("device", None, CheckError),
                                  ("device", Cuda(cuda_standin), issue.IssueCheckError)]:
        with pytest.raises(error, match=r"\(ROWPERM .*\): operand idx"):
            _on(_lm_rows(), params, feeds, device, runner=runner, check=True)


def _summing() -> Model:
    """A per-row loop that also sums over its rows (a carried value without the row axis: each step adds the
    column sums of the running rows' states), which is no loop's gradient."""
    W, U = ops.param_node("W", (D, H), F64), ops.param_node("U", (H, H), F64)
    x, h0 = ops.input((None, T, D), "float64", name="x"), ops.input((None, H), "float64", name="h0")
    steps, total = ops.input((None,), "int64", name="steps"), ops.input((H,), "float64", name="total")

    def body(inputs, states):
        h = ops.tanh(inputs[0] @ W + states[0] @ U)
        return [h], [h, states[1] + ops.sum(h, axis=0)]
    _, (h, summed) = C.foreach(body, [x], [h0, total], steps=steps, name="summing")
    return Model([], loss=ops.sum(h * summed) + ops.sum(h * h), outputs={"summed": summed, "h": h})


def test_a_per_row_loop_summing_over_its_rows_runs_in_the_program(cuda_standin):
    """Its finished rows add nothing to the sum (they do not run), so the program takes it: equal to the step
    runner on every runner and to finite differences (it was declined while finished rows were masked)."""
    model = _summing()
    params, feeds = _values(UNSORTED)
    params, feeds = {k: params[k] for k in ("W", "U")}, {k: feeds[k] for k in ("x", "h0", "steps")}
    feeds["total"] = np.linspace(-1.0, 1.0, H)
    want = _on_the_step_runner(_summing(), params, feeds)
    for runner, device in [("reference", None), ("device", None), ("device", Cuda(cuda_standin))]:
        got = _on(model, params, feeds, device, runner=runner, check=True)
        if device is not None:
            got.outputs = {k: np.asarray(device.to_host(v)) for k, v in got.outputs.items()}
        (program,) = _programs(got)
        assert "ROWS" in _opcodes(program) and not any(run.left for run in got.static), program.runner
        _close(got, want, program.runner)
    check_model_grads(model, {}, feeds, params, directions=2)
