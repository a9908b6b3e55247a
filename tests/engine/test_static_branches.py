"""A static graph's cond as a branch of its instruction program (engine/static_branches.py, engine/branches.py):
BRANCH on the pred the graph is given, each side inline (the static program's step lowering inside: a row
function), the gradient's cond of several results a branch too. Every runner (reference, C runner, the emulated
CUDA issuing loop) equals the step runner (program.run_steps) to 1e-12 in float64, the branch taken and not
taken, with NaN in the untaken side reaching no value or gradient; gradients match float64 central finite
differences; a corrupted BRANCH or JUMP is refused by every runner naming the operand; a pred the graph computes
keeps the cond on the step runner, saying why; on the device the pred is one read a pass."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import ops
from minicavs.core.dtypes import float64 as F64
from minicavs.core.errors import CheckError
from minicavs.cuda import Cuda, issue, standin
from minicavs.engine.explain import explain
from minicavs.engine.model import Model
from minicavs.ops import control as C
from minicavs.train.testing import check_model_grads

from .test_static_loops_while import RUNNERS, _on_the_step_runner, _opcodes, _train

H, V, ROWS = 3, 4, 5


def _cond_model(computed: bool = False) -> Model:
    """h = cond(p, tanh(x·W), log(-1 - (x·W)²)) (its else-side NaN everywhere; ``computed``: the pred is
    p·sum(x)², a value the graph computes), then a softmax cross-entropy of h·W_o against int labels."""
    W, Wo = ops.param_node("W", (H, H), F64), ops.param_node("Wo", (H, V), F64)
    p, x = ops.input((), "float64", name="p"), ops.input((None, H), "float64", name="x")
    y = ops.input((None,), "int64", name="y")
    pred = p * ops.square(ops.sum(x)) if computed else p

    def fine():
        return ops.tanh(x @ W)

    def nan():
        return ops.log(-1.0 - ops.square(x @ W))
    h = C.cond(pred, fine, nan)
    return Model([], loss=ops.sum(ops.softmax_cross_entropy(h @ Wo, y)), outputs={"h": h})


def _values(pred: float) -> tuple[dict, dict]:
    rng = np.random.default_rng(6)
    return ({"W": rng.normal(size=(H, H)), "Wo": rng.normal(size=(H, V))},
            {"p": np.asarray(pred), "x": rng.normal(size=(ROWS, H)), "y": rng.integers(0, V, ROWS)})


def _swapped() -> Model:
    """The same graph with the sides swapped: the NaN side taken when p is nonzero."""
    W, Wo = ops.param_node("W", (H, H), F64), ops.param_node("Wo", (H, V), F64)
    p, x = ops.input((), "float64", name="p"), ops.input((None, H), "float64", name="x")
    y = ops.input((None,), "int64", name="y")
    h = C.cond(p, lambda: ops.log(-1.0 - ops.square(x @ W)), lambda: ops.tanh(x @ W))
    return Model([], loss=ops.sum(ops.softmax_cross_entropy(h @ Wo, y)), outputs={"h": h})


@pytest.mark.parametrize("taken", [True, False])
def test_a_static_cond_is_a_branch_on_every_runner_equal_to_the_step_runner(cuda_standin, taken):
    """``taken``: the pred 1 and the then-side finite; else the pred 0 and the sides swapped (the finite side
    the else-side): the NaN side never taken, never computed."""
    make = _cond_model if taken else _swapped
    params, feeds = _values(1.0 if taken else 0.0)
    want, _, _ = _on_the_step_runner(lambda: _train(make(), params, feeds))
    assert np.isfinite(want["loss"]) and all(np.isfinite(v).all() for v in want.values())
    model = make()
    for runner, device, who in RUNNERS:
        got, (program,), static = _train(model, params, feeds, runner, Cuda(cuda_standin) if device else None,
                                         check=True)
        assert program.runner == who and program.declined is None and not static[0].left, (who, static[0].left)
        code = _opcodes(program)
        assert code.count("BRANCH") == 2 and code.count("JUMP") == 2 and "APPLY" not in code   # (forward, gradient)
        for k, b in want.items():
            assert np.abs(got[k] - b).max() <= 1e-12 * max(1.0, np.abs(b).max()), (who, k)
    check_model_grads(model, {}, feeds, params, directions=2)


def test_a_cond_on_a_pred_the_graph_computes_stays_on_the_step_runner_saying_why():
    params, feeds = _values(1.0)
    model = _cond_model(computed=True)
    got, _, static = _train(model, params, feeds)
    conds = [why for n, why in static[0].left.items() if n.op == "cond"]   # (the forward's, the gradient's)
    assert len(conds) == 2 and all("is not a float64 value the graph is given" in why for why in conds), conds
    text = str(explain(model, {}, feeds, params))
    assert "step runner: cond: a cond whose pred" in text, text
    want, _, _ = _on_the_step_runner(lambda: _train(_cond_model(computed=True), params, feeds))
    assert all(np.abs(got[k] - b).max() <= 1e-12 * max(1.0, np.abs(b).max()) for k, b in want.items())


@pytest.mark.parametrize("opcode, operand, value, name", [("BRANCH", 0, 10**6, "pred"), ("BRANCH", 1, 10**6, "n"),
                                                          ("JUMP", 0, 10**6, "n")])
def test_a_corrupted_branch_is_refused_by_every_runner_naming_it(cuda_standin, opcode, operand, value, name):
    params, feeds = _values(1.0)
    model = _cond_model()
    for runner, device, who in RUNNERS:
        error = issue.IssueCheckError if device else CheckError
        cuda = Cuda(cuda_standin) if device else None
        _, (program,), _ = _train(model, params, feeds, runner, cuda, check=True)
        code = program.lowered.code
        pc = _opcodes(program).index(opcode)
        old, code[pc][1 + operand] = int(code[pc][1 + operand]), value
        try:
            with pytest.raises(error, match=rf"static graph: task 0, instruction {pc} \({opcode} .*\): "
                                            rf"(operand {name}|buffer)"):
                _train(model, params, feeds, runner, cuda, check=True)
        finally:
            code[pc][1 + operand] = old


def test_a_training_pass_of_a_static_cond_on_the_device_reads_its_pred_once(cuda_standin, monkeypatch):
    """The emulated device: the pred's one value is read once for the pass (its host copy, which both BRANCHes
    read: the forward's and the gradient's), whatever the rows; the issuing loop reads nothing else."""
    monkeypatch.setattr(standin, "TRACE", True)
    monkeypatch.setattr(standin, "TRACE_DEPTH", 2)
    model = _cond_model()
    for rows in (2, ROWS):
        params, feeds = _values(1.0)
        feeds = dict(feeds, x=feeds["x"][:rows], y=feeds["y"][:rows])
        _train(model, params, feeds, "device", Cuda(cuda_standin))
        standin.reset()
        _train(model, params, feeds, "device", Cuda(cuda_standin))
        preds = sum(n for (way, site), n in standin.sites.items() if way == "d2h" and "issue.py:_read_preds" in site)
        loop = sum(n for (way, site), n in standin.sites.items() if "issue.py:run" in site)
        assert preds == 1 and loop == 0, (rows, dict(standin.sites))
