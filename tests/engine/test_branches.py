"""A cond inside a vertex function as a branch of the instruction program (engine/branches.py: BRANCH skips the
then-branch when the pred is 0, JUMP skips the else-branch): no runner declines it, every runner (reference, C
runner, the emulated CUDA issuing loop) equals F written with Python control flow, forward and backward, only the
taken branch runs (NaN in the other is never computed), gradients match finite differences, and a branch whose
target or pred is wrong is refused by every loop's checks."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.core.errors import CheckError
from minicavs.cpu import CPU
from minicavs.cuda import Cuda, issue, standin
from minicavs.engine.backend import to_host
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.lowered import OPCODES_BY_ID
from minicavs.runtime.inputs import InputGraph

from ..ops.test_control import _cond_chain
from .test_backend import close
from .test_instructions import SWITCHES

GRAPHS = [InputGraph.chain(n) for n in (3, 1, 2)]


def _values(sign: float) -> tuple[dict, dict]:
    rng = np.random.default_rng(13)
    return {"Wx": rng.uniform(-0.5, 0.5, (2, 4)), "s": np.float64(sign)}, {"xs": rng.standard_normal((6, 2))}


def _run(model, vals: dict, feeds: dict, runner: str, device=None, graphs=GRAPHS, **switches):
    """forward_backward on ``runner`` (``device``: the emulated CUDA device, its parameters copied there)."""
    options = EngineOptions(runner=runner, **switches)
    if device is None:
        return model.forward_backward(graphs, feeds, vals, RunContext(), options=options)
    model.device = device
    try:
        return model.forward_backward(graphs, feeds, {k: device.asarray(v) for k, v in vals.items()}, RunContext(),
                                      options=options)
    finally:
        model.device = CPU


def _ran_with(result, runner: str, opcode: str) -> None:
    """Both passes ran on ``runner`` with ``opcode`` in their program and no instruction it declines."""
    for state in result.states.values():
        for program in (state.program, state.backward_program):
            assert program.lowered.c_refusal is None, program.lowered.c_refusal
            assert program.declined is None and program.runner == runner, (program.runner, program.declined)
            assert opcode in [OPCODES_BY_ID[op] for op in program.lowered.code[:, 0]]


def _branches_on(result, runner: str) -> None:
    _ran_with(result, runner, "BRANCH")


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_cond_in_f_is_a_branch_every_runner_runs_equal_to_python_control_flow(cuda_standin, sign):
    """(The _cond_chain of tests/ops/test_control.py: two results, a node per result in F.)"""
    vals, feeds = _values(sign)
    want = _cond_chain(sign > 0).forward_backward(GRAPHS, feeds, vals)
    model = _cond_chain(None)
    for runner, device, name in [("reference", None, "reference runner"), ("device", None, "C runner"),
                                 ("device", Cuda(cuda_standin), "cuda runner")]:
        got = _run(model, vals, feeds, runner, device)
        _branches_on(got, name)
        close(got.loss, want.loss, "float64", name)
        for k in want.grads:
            close(got.grads[k], want.grads[k], "float64", f"{name} d{k}")


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_every_engine_switch_runs_the_branch_on_the_c_runner_equal_to_the_reference(sign):
    vals, feeds = _values(sign)
    model = _cond_chain(None)
    for options in SWITCHES[::3]:
        switches = {k: getattr(options, k) for k in ("lazy_batching", "eager_batching", "fusion", "gather_elision")}
        want = _run(model, vals, feeds, "reference", **switches)
        got = _run(model, vals, feeds, "device", **switches)
        _branches_on(got, "C runner")
        close(got.loss, want.loss, "float64", str(options))
        for k in want.grads:
            close(got.grads[k], want.grads[k], "float64", f"{options} d{k}")


def _nan_chain(choice):
    """F whose else-branch is NaN (log of a negative number) and inf (1 / 0) for every row: with a cond on the
    sign of ``s`` (``choice`` None), or the then-branch in Python (True)."""
    from minicavs import ops
    from minicavs.core.dtypes import float64 as F64
    from minicavs.engine.model import Model, Structure
    from minicavs.ops import control as C
    from minicavs.runtime.vertex import VertexFunction
    Wx, b, s = ops.param_node("Wx", (2, 4), F64), ops.param_node("b", (4,), F64), ops.param_node("s", (), F64)
    F = VertexFunction("v", arity=1, message=(4,), dtype=F64)
    with F:
        h0, x = F.gather(0), F.pull((2,))

        def cell():
            return ops.tanh(x @ Wx + h0 + b)

        def broken():
            return ops.log(-1.0 - ops.square(h0)) + 1.0 / (h0 * 0.0) + b
        h = C.cond(ops.step(s), cell, broken) if choice is None else cell()
        F.scatter(h)
        F.push(h)
    st = Structure(F, pulls={"x": ops.input((None, 2), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def test_nan_and_inf_in_the_untaken_branch_never_reach_a_value_or_gradient(cuda_standin):
    vals, feeds = _values(1.0)
    vals["b"] = np.linspace(-0.3, 0.3, 4)
    want = _nan_chain(True).forward_backward(GRAPHS, feeds, vals)
    model = _nan_chain(None)
    for runner, device, name in [("reference", None, "reference runner"), ("device", None, "C runner"),
                                 ("device", Cuda(cuda_standin), "cuda runner")]:
        got = _run(model, vals, feeds, runner, device)
        _branches_on(got, name)
        assert np.isfinite(to_host(got.loss)).all(), name
        close(got.loss, want.loss, "float64", name)
        for k in want.grads:
            assert np.isfinite(to_host(got.grads[k])).all(), (name, k)
            close(got.grads[k], want.grads[k], "float64", f"{name} d{k}")


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_branchs_gradients_match_central_finite_differences(sign):
    """float64, on the C runner, every entry of Wx and b: |fd - g| <= 1e-6 * max(|fd|, |g|) + 1e-8."""
    vals, feeds = _values(sign)
    vals["b"] = np.linspace(-0.3, 0.3, 4)
    model = _nan_chain(None) if sign > 0 else _cond_chain(None)
    got = _run(model, vals, feeds, "device")
    _branches_on(got, "C runner")
    eps = 1e-6
    for name in ("Wx", "b") if sign > 0 else ("Wx",):
        for i in np.ndindex(vals[name].shape):
            up, down = dict(vals), dict(vals)
            up[name], down[name] = vals[name].copy(), vals[name].copy()
            up[name][i] += eps
            down[name][i] -= eps
            fd = (float(_run(model, up, feeds, "device").loss) - float(_run(model, down, feeds, "device").loss)) / (
                2 * eps)
            g = float(np.asarray(got.grads[name])[i])
            assert abs(fd - g) <= 1e-6 * max(abs(fd), abs(g)) + 1e-8, (name, i, fd, g)


def _corrupted(model, vals, feeds, runner: str, device, opcode: str, operand: int, value: int,
               backward: bool = False):
    """Run, set ``operand`` of the first ``opcode`` of the forward (or backward) program to ``value``, run again
    (check mode)."""
    got = _run(model, vals, feeds, runner, device, check=True)
    state = got.states[next(iter(got.states))]
    code = (state.backward_program if backward else state.program).lowered.code
    pc = int(np.flatnonzero([OPCODES_BY_ID[op] == opcode for op in code[:, 0]])[0])
    old = int(code[pc][1 + operand])
    code[pc][1 + operand] = value
    try:
        _run(model, vals, feeds, runner, device, check=True)
    finally:
        code[pc][1 + operand] = old


@pytest.mark.parametrize("opcode, operand, value, name", [
    ("BRANCH", 1, 10**6, "n"), ("BRANCH", 1, -3, "n"), ("JUMP", 0, 10**6, "n"), ("JUMP", 0, -2, "n"),
    ("BRANCH", 0, 10**6, "pred"), ("BRANCH", 0, -1, "pred")])
def test_a_wrong_branch_is_refused_by_every_runners_checks(cuda_standin, opcode, operand, value, name):
    """A target outside the template, a pred that is no buffer: each loop refuses the instruction, naming the
    operand, before moving pc or reading anything."""
    vals, feeds = _values(1.0)
    model = _cond_chain(None)
    expected = [("reference", None, CheckError, rf"reference F: task \d+, instruction \d+ \({opcode} .*\): operand "
                                                rf"{name}"),
                ("device", None, CheckError, rf"C runner F: task \d+, instruction \d+ \({opcode} .*\): operand {name} "
                                             "is out of bounds"),
                ("device", Cuda(cuda_standin), issue.IssueCheckError,
                 rf"cuda F: task \d+, instruction \d+ \({opcode} .*\): operand {name} is out of bounds")]
    for runner, device, error, message in expected:
        with pytest.raises(error, match=message):
            _corrupted(model, vals, feeds, runner, device, opcode, operand, value)


def _refused_by_every_runner(model, vals, feeds, cuda_standin, opcode: str, operand: int, value: int, name: str,
                             backward: bool) -> None:
    """The reference runner, the C runner and the emulated CUDA loop each refuse the corrupted instruction,
    naming operand ``name`` (the loop tests' shared check)."""
    title = "∂F" if backward else "F"
    expected = [("reference", None, CheckError, rf"reference {title}: task \d+, instruction \d+ \(\w+ .*\): "
                                                rf"operand {name}"),
                ("device", None, CheckError, rf"C runner {title}: task \d+, instruction \d+ \(\w+ .*\): operand "
                                             rf"{name}"),
                ("device", Cuda(cuda_standin), issue.IssueCheckError,
                 rf"cuda {title}: task \d+, instruction \d+ \(\w+ .*\): operand {name}")]
    for runner, device, error, message in expected:
        with pytest.raises(error, match=message):
            _corrupted(model, vals, feeds, runner, device, opcode, operand, value, backward)


def test_a_pred_that_is_not_one_value_is_refused(cuda_standin):
    """BRANCH's pred pointed at the static Wx (8 values): refused by every loop, naming ``pred``."""
    vals, feeds = _values(1.0)
    model = _cond_chain(None)
    got = _run(model, vals, feeds, "device")
    lowered = got.states[next(iter(got.states))].program.lowered
    wx = next(i for i, key in enumerate(lowered.keys) if key[0] == "static" and getattr(key[1], "name", "") == "Wx")
    for runner, device in [("reference", None), ("device", None), ("device", Cuda(cuda_standin))]:
        with pytest.raises(CheckError, match=r"\(BRANCH .*\): operand pred"):
            _corrupted(model, vals, feeds, runner, device, "BRANCH", 0, wx)


def test_each_pred_is_read_once_a_pass_on_the_device(cuda_standin):
    """On the device a pred is a device value: the issuing loop reads its host copy, made by one counted
    device-to-host read per pred and pass (forward and backward: 2 more than F with the branch chosen in
    Python), never per task (3 tasks or 9: the same); so does the reference runner over the device's arrays."""
    vals, feeds = _values(1.0)
    long = [InputGraph.chain(9), InputGraph.chain(3)]
    long_feeds = {"xs": np.random.default_rng(2).standard_normal((12, 2))}
    for device in (Cuda(cuda_standin), Cuda(cuda_standin, issue_from_c=False)):
        reads = []
        for model, graphs, feed in [(_cond_chain(True), GRAPHS, feeds), (_cond_chain(None), GRAPHS, feeds),
                                    (_cond_chain(None), long, long_feeds)]:
            _run(model, vals, feed, "device", device, graphs)   # (compiled and warm: only the runs are counted)
            standin.reset()
            _run(model, vals, feed, "device", device, graphs)
            reads.append(standin.crossings["d2h"])
        assert reads[1] == reads[0] + 2 and reads[2] == reads[1], (device.issue_from_c, reads)


def test_a_value_both_results_of_a_cond_read_is_computed_once_a_branch():
    """A cond of two results is a node per result in F, each a branch over its own body; x·W, which both read
    on both sides, is computed once, before the branches (ops/hoist.py: one product of the cond's values, made
    once for every body reading it): one product in the task template, not four (two before the products
    were made before the branch: once on each side); the values equal F written with Python control flow."""
    from minicavs import ops
    from minicavs.core.dtypes import float64 as F64
    from minicavs.engine.model import Model, Structure
    from minicavs.ops import control as C
    from minicavs.runtime.vertex import VertexFunction

    def build(choice):
        Wx, s = ops.param_node("Wx", (2, 4), F64), ops.param_node("s", (), F64)
        F = VertexFunction("v", arity=1, message=(4,), dtype=F64)
        with F:
            h0, x = F.gather(0), F.pull((2,))

            def then():
                return [ops.tanh(x @ Wx + h0), ops.sigmoid(x @ Wx)]

            def other():
                return [ops.tanh(x @ Wx - h0), ops.exp(x @ Wx)]
            h, extra = C.cond(ops.step(s), then, other) if choice is None else (then() if choice else other())
            F.scatter(h * extra)   # (both on the gather-scatter path: both conds in the task template)
            F.push(h)
        st = Structure(F, pulls={"x": ops.input((None, 2), F64, name="xs")})
        return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))
    for sign in (1.0, -1.0):
        vals, feeds = _values(sign)
        want = build(sign > 0).forward_backward(GRAPHS, feeds, vals)
        got = _run(build(None), vals, feeds, "device", eager_batching=False)
        _branches_on(got, "C runner")
        close(got.loss, want.loss, "float64")
        close(got.grads["Wx"], want.grads["Wx"], "float64")
        lowered = next(iter(got.states.values())).program.lowered
        begin, end = lowered.ranges[lowered.template_ids[0]]
        assert [OPCODES_BY_ID[op] for op in lowered.code[begin:end, 0]].count("GEMM") == 1, "\n".join(lowered.lines())


def _nested_chain(choice):
    """F with a cond inside a cond's then-branch, on two parameters' signs (``choice``: the pair of branches
    taken, written in Python instead)."""
    from minicavs import ops
    from minicavs.core.dtypes import float64 as F64
    from minicavs.engine.model import Model, Structure
    from minicavs.ops import control as C
    from minicavs.runtime.vertex import VertexFunction
    Wx, s, r = (ops.param_node("Wx", (2, 4), F64), ops.param_node("s", (), F64), ops.param_node("r", (), F64))
    F = VertexFunction("v", arity=1, message=(4,), dtype=F64)
    with F:
        h0, x, inner = F.gather(0), F.pull((2,)), ops.step(r)
        a, b = (lambda: ops.tanh(x @ Wx + h0)), (lambda: ops.sigmoid(x @ Wx) * h0)
        c = lambda: ops.tanh(h0) - x @ Wx   # noqa: E731
        if choice is None:   # (the inner pred a static read inside the outer branch: a placeholder there)
            h = C.cond(ops.step(s), lambda: C.cond(inner, a, b), c)
        else:
            h = (a() if choice[1] else b()) if choice[0] else c()
        F.scatter(h)
        F.push(h)
    st = Structure(F, pulls={"x": ops.input((None, 2), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


@pytest.mark.parametrize("signs", [(1.0, 1.0), (1.0, -1.0), (-1.0, 1.0)])
def test_a_cond_inside_a_branch_is_a_branch_inside_a_branch(signs):
    vals, feeds = _values(signs[0])
    vals["r"] = np.float64(signs[1])
    want = _nested_chain((signs[0] > 0, signs[1] > 0)).forward_backward(GRAPHS, feeds, vals)
    model = _nested_chain(None)
    for runner in ("reference", "device"):
        got = _run(model, vals, feeds, runner)
        _branches_on(got, {"reference": "reference runner", "device": "C runner"}[runner])
        close(got.loss, want.loss, "float64", runner)
        close(got.grads["Wx"], want.grads["Wx"], "float64", runner)


def _instructions(lowered, title: str) -> list:
    """Per template of ``lowered`` whose dump title holds ``title``: its opcodes, in order."""
    out, current = [], None
    for line in lowered.lines():
        if not line.startswith("  "):
            current = [] if title in line else None
            if current is not None:
                out.append(current)
        elif current is not None:
            current.append(line.split(":", 1)[1].split()[0])
    return out


def _lstm_cond(choice):
    """An LSTM cell on the gathered [h; c] and the pulled x, or (else) a cell on h alone, by the sign of ``s``
    (``choice`` None: a cond; True or False: that branch in Python)."""
    from minicavs import ops
    from minicavs.core.dtypes import float64 as F64
    from minicavs.engine.model import Model, Structure
    from minicavs.ops import control as C
    from minicavs.runtime.vertex import VertexFunction
    H = 3
    Wx, Wh, b = ops.param_node("Wx", (2, 4 * H), F64), ops.param_node("Wh", (H, 4 * H), F64), \
        ops.param_node("b", (4 * H,), F64)
    Wr, s = ops.param_node("Wr", (H, H), F64), ops.param_node("s", (), F64)
    F = VertexFunction("lstm", arity=1, message=(2 * H,), dtype=F64)
    with F:
        state, x = F.gather(0), F.pull((2,))

        def cell():
            h0, c0 = ops.split(state, 2)
            i, f, o, u = ops.split(x @ Wx + h0 @ Wh + b, 4)
            c = ops.sigmoid(f) * c0 + ops.sigmoid(i) * ops.tanh(u)
            return ops.concat([ops.sigmoid(o) * ops.tanh(c), c])

        def other():
            h0, c0 = ops.split(state, 2)
            return ops.concat([ops.tanh(h0 @ Wr), c0 * 0.5])
        m = C.cond(ops.step(s), cell, other) if choice is None else (cell() if choice else other())
        F.scatter(m)
        F.push(ops.split(m, 2)[0], name="h")
    st = Structure(F, pulls={"x": ops.input((None, 2), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def _lstm_values(sign: float) -> dict:
    rng = np.random.default_rng(5)
    return {"Wx": rng.uniform(-0.5, 0.5, (2, 12)), "Wh": rng.uniform(-0.5, 0.5, (3, 12)),
            "b": rng.uniform(-0.5, 0.5, 12), "Wr": rng.uniform(-0.5, 0.5, (3, 3)), "s": np.float64(sign)}


def _side_products(lowered) -> list:
    """Per BRANCH of ``lowered``'s task template: the products (GEMM, BMM) in its then-branch and in its
    else-branch."""
    ops = [OPCODES_BY_ID[op] for op in lowered.code[:, 0]]
    begin, end = lowered.ranges[lowered.template_ids[0]]
    found = []
    for pc in range(begin, end):
        if ops[pc] == "BRANCH":
            jump = pc + int(lowered.code[pc][2])
            stop = jump + int(lowered.code[jump][1]) + 1
            found.append(tuple(sum(op in ("GEMM", "BMM") for op in ops[a:b]) for a, b in ((pc + 1, jump),
                                                                                          (jump + 1, stop))))
    return found


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_conds_eager_product_runs_before_the_task_loop_and_each_branch_its_own_products(cuda_standin, sign):
    """F: the cond's x·Wx (it reads no gathered value) is a product of the block before the task loop; h·Wh and
    h·Wr stay in their branches, so only the taken side's runs (one product each side, forward, and one each
    in ∂F's task branch: its gradient through the product, nothing of the forward recomputed: ops/cond_grad.py);
    every runner equals the branch chosen in Python, and the gradients match float64 central finite
    differences."""
    from minicavs.train.testing import check_model_grads
    vals = _lstm_values(sign)
    feeds = {"xs": np.random.default_rng(6).standard_normal((6, 2))}
    want = _run(_lstm_cond(sign > 0), vals, feeds, "device")
    model = _lstm_cond(None)
    got = _run(model, vals, feeds, "device")
    state = next(iter(got.states.values()))
    (before,) = _instructions(state.program.lowered, "before tasks")
    assert before.count("GEMM") + before.count("BMM") >= 1
    for lowered in (state.program.lowered, state.backward_program.lowered):
        assert _side_products(lowered) == [(1, 1)], "\n".join(lowered.lines())
    for runner, device, name in [("reference", None, "reference runner"), ("device", None, "C runner"),
                                 ("device", Cuda(cuda_standin), "cuda runner")]:
        got = _run(model, vals, feeds, runner, device, check=True)
        _branches_on(got, name)
        close(got.loss, want.loss, "float64", name)
        for k in want.grads:
            close(got.grads[k], want.grads[k], "float64", f"{name} d{k}")
    check_model_grads(model, GRAPHS, feeds, {k: v for k, v in vals.items()}, directions=2)
