"""A foreach inside a vertex function as a loop of the instruction program (engine/loops.py: LOOP ... ENDLOOP
around the body lowered inline, STEPCOLS pointing at the counter's step block): no runner declines F or ∂F,
every runner (reference, C runner, the emulated CUDA issuing loop) equals F unrolled in Python and the APPLY
path (the loop run by its op's implementation), loss and gradients; gradients match float64 central finite
differences for 0, 1, several and the most steps; a loop whose trip count, target or step width is wrong is
refused by every loop's checks, naming the operand."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import ops
from minicavs.core.dtypes import float64 as F64
from minicavs.cuda import Cuda
from minicavs.engine import instructions
from minicavs.engine.lowered import OPCODES_BY_ID
from minicavs.engine.model import Model, Structure
from minicavs.ops import control as C
from minicavs.runtime.inputs import InputGraph
from minicavs.runtime.vertex import VertexFunction

from .test_backend import close
from .test_branches import _instructions, _ran_with, _refused_by_every_runner, _run

GRAPHS = [InputGraph.chain(n) for n in (3, 1, 2)]
D, H, MOST = 2, 3, 6


def _rnn(steps: int, how: str) -> Model:
    """F runs an RNN over each vertex's pulled (steps, D) sequence from its child's message, its per-step
    states stacked too (pushed, summed through Wo): as a foreach (``how`` "foreach") or unrolled in Python."""
    Wx, Wh, Wo = (ops.param_node("Wx", (D, H), F64), ops.param_node("Wh", (H, H), F64),
                  ops.param_node("Wo", (steps * H, H), F64))
    F = VertexFunction("seq", arity=1, message=(H,), dtype=F64)
    with F:
        xs, h = F.pull((steps, D)), F.gather(0)

        def body(x, s):
            s2 = ops.tanh(x @ Wx + s @ Wh)
            return [s2 * 0.5], s2
        if how == "foreach":
            (ys,), h = C.foreach(body, xs, h)
            ys = ops.reshape(ys, (steps * H,))
        else:
            parts = []
            for t in range(steps):
                (y,), h = body(ops.reshape(ops.slice_(xs, t, t + 1, axis=0), (D,)), h)
                parts.append(y)
            ys = ops.concat(parts, axis=0) if parts else ops.reshape(xs, (0,)) * 0.0
        F.scatter(h)
        F.push(h + ys @ Wo)
    st = Structure(F, pulls={"x": ops.input((None, steps, D), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def _values(steps: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(7)
    vals = {"Wx": rng.uniform(-0.5, 0.5, (D, H)), "Wh": rng.uniform(-0.5, 0.5, (H, H)),
            "Wo": rng.uniform(-0.5, 0.5, (steps * H, H))}
    return vals, {"xs": rng.standard_normal((6, steps, D))}


def _loops_on(result, runner: str) -> None:
    _ran_with(result, runner, "LOOP")


def _same(got, want, what: str) -> None:
    close(got.loss, want.loss, "float64", what)
    for k in want.grads:
        close(got.grads[k], want.grads[k], "float64", f"{what} d{k}")


@pytest.mark.parametrize("steps", [1, 4])
def test_a_foreach_in_f_is_a_loop_every_runner_runs_equal_to_python_and_the_apply_path(cuda_standin, monkeypatch,
                                                                                     steps):
    vals, feeds = _values(steps)
    python = _run(_rnn(steps, "python"), vals, feeds, "reference")
    model = _rnn(steps, "foreach")
    for runner, device, name in [("reference", None, "reference runner"), ("device", None, "C runner"),
                                 ("device", Cuda(cuda_standin), "cuda runner")]:
        got = _run(model, vals, feeds, runner, device, check=True)
        _loops_on(got, name)
        _same(got, python, name)
    monkeypatch.setattr(instructions, "loops", lambda t, step: False)   # (the loop an APPLY of its op)
    applied = _run(_rnn(steps, "foreach"), vals, feeds, "reference")
    assert "APPLY" in [OPCODES_BY_ID[op] for op in next(iter(applied.states.values())).program.lowered.code[:, 0]]
    _same(applied, python, "APPLY path")


@pytest.mark.parametrize("steps", [0, 1, 3, MOST])
def test_the_loops_gradients_match_central_finite_differences(steps):
    """float64 on the C runner (the default), each parameter along random directions (train.testing)."""
    from minicavs.train.testing import check_model_grads
    vals, feeds = _values(steps)
    model = _rnn(steps, "foreach")
    _loops_on(_run(model, vals, feeds, "device"), "C runner")
    check_model_grads(model, GRAPHS, feeds, vals, directions=2)


@pytest.mark.parametrize("opcode, operand, value, name, backward", [
    ("LOOP", 0, -1, "trips", False), ("LOOP", 1, 10**6, "n", False), ("LOOP", 1, -2, "n", False),
    ("ENDLOOP", 0, -3, "trips", True), ("ENDLOOP", 1, 10**6, "n", False), ("ENDLOOP", 1, 0, "n", True),
    ("STEPCOLS", 2, -1, "width", False), ("STEPCOLS", 2, 10**4, r"(pool \(args\): )?argument 0", False)])
def test_a_wrong_loop_is_refused_by_every_runners_checks(cuda_standin, opcode, operand, value, name, backward):
    """A negative trip count, a target outside the template (forward past its end, back before its start or
    not back at all), a step block outside its value (a width: named where the block is read: the fused
    kernel reading the step's x·Wx, made before the loop): each loop refuses the instruction, naming the operand,
    before moving pc or reading."""
    vals, feeds = _values(3)
    model = _rnn(3, "foreach")
    _refused_by_every_runner(model, vals, feeds, cuda_standin, opcode, operand, value, name, backward)


def _lstm(steps: int, how: str) -> Model:
    """F runs an LSTM (two states, a bias, gates split from one product) backwards over each vertex's pulled
    (steps, D) sequence, as a foreach (``how`` "foreach") or unrolled in Python."""
    Wx, Wh, b = (ops.param_node("Wx", (D, 4 * H), F64), ops.param_node("Wh", (H, 4 * H), F64),
                 ops.param_node("b", (4 * H,), F64))
    F = VertexFunction("lstm", arity=1, message=(H,), dtype=F64)
    with F:
        xs, h0 = F.pull((steps, D)), F.gather(0)

        def body(x, hc):
            h, c = hc
            i, f, o, u = ops.split(x @ Wx + h @ Wh + b, 4)
            c2 = ops.sigmoid(f) * c + ops.sigmoid(i) * ops.tanh(u)
            return [], [ops.sigmoid(o) * ops.tanh(c2), c2]
        state = [h0, h0 * 0.5]
        if how == "foreach":
            state = C.foreach(body, xs, state, reverse=True)[1]
        else:
            for t in reversed(range(steps)):
                state = body(ops.reshape(ops.slice_(xs, t, t + 1, axis=0), (D,)), state)[1]
        F.scatter(state[0])
        F.push(state[0] + state[1])
    st = Structure(F, pulls={"x": ops.input((None, steps, D), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def _lstm_values(steps: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(11)
    vals = {"Wx": rng.uniform(-0.5, 0.5, (D, 4 * H)), "Wh": rng.uniform(-0.5, 0.5, (H, 4 * H)),
            "b": rng.uniform(-0.5, 0.5, 4 * H)}
    return vals, {"xs": rng.standard_normal((6, steps, D))}


@pytest.mark.parametrize("steps", [1, 4])
def test_a_loops_input_product_runs_before_the_task_loop_and_its_gradient_loop_runs_the_body_once(steps):
    """F: the body's x_t·Wx is one product of every step in the block before the task loop (none inside
    the loop); ∂F: one LOOP in all its templates (no replay of F, no second loop over all rows for the
    parameters), whose body holds one product (the state's gradient, dgates·Whᵀ: no forward product
    recomputed), and the parameters' gradients are one product each after the task loop (over FLAT views of
    the stacked values: every row and step)."""
    vals, feeds = _lstm_values(steps)
    got = _run(_lstm(steps, "foreach"), vals, feeds, "device")
    state = next(iter(got.states.values()))
    forward, backward = state.program.lowered, state.backward_program.lowered
    (before,), (task,) = _instructions(forward, "before tasks"), _instructions(forward, "task template")
    assert "BMM" in before or "GEMM" in before
    loop = task[task.index("LOOP"):task.index("ENDLOOP")]
    assert loop.count("GEMM") + loop.count("BMM") == 1   # h·Wh alone
    every = [op for template in _instructions(backward, "") for op in template]
    assert every.count("LOOP") == 1
    (back_task,) = _instructions(backward, "task template")
    back_loop = back_task[back_task.index("LOOP"):back_task.index("ENDLOOP")]
    assert back_loop.count("GEMM") + back_loop.count("BMM") == 1
    (after,) = _instructions(backward, "after tasks")
    assert after.count("GEMM") == 2 and "FLAT" in after   # dWx, dWh: one product over every row and step


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_an_lstm_foreach_in_f_equals_python_and_finite_differences_on_every_runner(cuda_standin, steps):
    """Two states, a bias and gates split from one product, in reverse: every runner equals F unrolled in
    Python (loss and gradients, check mode), and the C runner's gradients match float64 central finite
    differences."""
    from minicavs.train.testing import check_model_grads
    vals, feeds = _lstm_values(steps)
    python = _run(_lstm(steps, "python"), vals, feeds, "device")
    model = _lstm(steps, "foreach")
    runners = [("reference", None, "reference runner"), ("device", None, "C runner"),
               ("device", Cuda(cuda_standin), "cuda runner")]
    # (0 steps: the reference runner refuses a stored value of no columns, a pull of (0, D), before this change too)
    for runner, device, name in runners if steps else runners[1:2]:
        got = _run(model, vals, feeds, runner, device, check=bool(steps))
        if steps:
            _loops_on(got, name)
        _same(got, python, name)
    check_model_grads(model, GRAPHS, feeds, vals, directions=2)
