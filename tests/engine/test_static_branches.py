"""A static graph's cond as a branch of its instruction program (engine/static_branches.py, engine/branches.py):
BRANCH on a pred the graph is given, IF on one the program computes, each side inline (the static program's step
lowering inside: a row function), the gradient's cond of several results a branch too. Every runner (reference,
C runner, the emulated CUDA issuing loop) equals the step runner (program.run_steps) to 1e-12 in float64, the
branch taken and not taken, with NaN in the untaken side reaching no value or gradient; gradients match float64
central finite differences; a corrupted BRANCH, IF or JUMP is refused by every runner naming the operand; an int
pred keeps the cond on the step runner, saying why; on the device a given pred is one read a pass, a computed one
one read per IF run."""
from __future__ import annotations

import re

import numpy as np
import pytest

from minicavs import ops
from minicavs.core.dtypes import float64 as F64
from minicavs.cuda import Cuda, standin
from minicavs.engine.explain import explain
from minicavs.engine.model import Model
from minicavs.ops import control as C
from minicavs.train.testing import check_model_grads

from .static_runners import (RUNNERS, _on_the_step_runner, _opcodes, _operand_set, _refused_when_corrupted,
                             _train)

H, V, ROWS = 3, 4, 5


def _cond_model(pred: str = "given", swapped: bool = False) -> Model:
    """h = cond(p, tanh(x·W), log(-1 - (x·W)²)) (its NaN side, everywhere; ``swapped``: the sides swapped), then a
    softmax cross-entropy of h·W_o against int labels. The pred: p as given ("given"), p·sum(x)² (a value the
    program computes: "computed"), or an int64 p ("int")."""
    W, Wo = ops.param_node("W", (H, H), F64), ops.param_node("Wo", (H, V), F64)
    p = ops.input((), "int64" if pred == "int" else "float64", name="p")
    x, y = ops.input((None, H), "float64", name="x"), ops.input((None,), "int64", name="y")
    sides = [lambda: ops.tanh(x @ W), lambda: ops.log(-1.0 - ops.square(x @ W))]
    h = C.cond(p * ops.square(ops.sum(x)) if pred == "computed" else p, *(sides[::-1] if swapped else sides))
    return Model([], loss=ops.sum(ops.softmax_cross_entropy(h @ Wo, y)), outputs={"h": h})


def _values(pred: float, dtype=np.float64) -> tuple[dict, dict]:
    rng = np.random.default_rng(6)
    return ({"W": rng.normal(size=(H, H)), "Wo": rng.normal(size=(H, V))},
            {"p": np.asarray(pred, dtype), "x": rng.normal(size=(ROWS, H)), "y": rng.integers(0, V, ROWS)})


@pytest.mark.parametrize("pred, opcode", [("given", "BRANCH"), ("computed", "IF")])
@pytest.mark.parametrize("taken", [True, False])
def test_a_static_cond_is_a_branch_on_every_runner_equal_to_the_step_runner(cuda_standin, pred, opcode, taken):
    """``taken``: p 1 and the then-side finite; else p 0 and the sides swapped (the finite side the else-side):
    the NaN side never taken, never computed. A pred the graph is given is BRANCH's, one it computes IF's."""
    params, feeds = _values(1.0 if taken else 0.0)
    want, _, _ = _on_the_step_runner(lambda: _train(_cond_model(pred, not taken), params, feeds))
    assert np.isfinite(want["loss"]) and all(np.isfinite(v).all() for v in want.values())
    model = _cond_model(pred, not taken)
    for runner, device, who in RUNNERS:
        got, (program,), static = _train(model, params, feeds, runner, Cuda(cuda_standin) if device else None,
                                         check=True)
        assert program.runner == who and program.declined is None and not static[0].left, (who, static[0].left)
        code = _opcodes(program)
        assert code.count(opcode) == 2 and code.count("JUMP") == 2 and "APPLY" not in code   # (forward, gradient)
        for k, b in want.items():
            assert np.abs(got[k] - b).max() <= 1e-12 * max(1.0, np.abs(b).max()), (who, k)
    check_model_grads(model, {}, feeds, params, directions=2)


def test_a_cond_on_an_int_pred_stays_on_the_step_runner_saying_why():
    params, feeds = _values(1, np.int64)
    model = _cond_model("int")
    got, _, static = _train(model, params, feeds)
    conds = [why for n, why in static[0].left.items() if n.op == "cond"]   # (the forward's, the gradient's)
    assert len(conds) == 2 and all("is not one float64 value" in why for why in conds), conds
    text = str(explain(model, {}, feeds, params))
    assert "step runner: cond: a cond whose pred" in text, text
    want, _, _ = _on_the_step_runner(lambda: _train(_cond_model("int"), params, feeds))
    assert all(np.abs(got[k] - b).max() <= 1e-12 * max(1.0, np.abs(b).max()) for k, b in want.items())


@pytest.mark.parametrize("pred, opcode, operand, value, name", [
    ("given", "BRANCH", 0, 10**6, "pred"), ("given", "BRANCH", 1, 10**6, "n"), ("given", "JUMP", 0, 10**6, "n"),
    ("computed", "IF", 1, 10**6, "pred"), ("computed", "IF", 0, 10**6, "n")])
def test_a_corrupted_branch_is_refused_by_every_runner_naming_it(cuda_standin, pred, opcode, operand, value, name):
    params, feeds = _values(1.0)
    _refused_when_corrupted(cuda_standin, _cond_model(pred), params, feeds, opcode, _operand_set(operand, value),
                            rf"(operand {name}|buffer|register)")


@pytest.mark.parametrize("pred", ["given", "computed"])
def test_a_training_pass_of_a_static_cond_on_the_device_reads_its_pred_once_or_once_per_branch(cuda_standin,
                                                                                              monkeypatch, pred):
    """The emulated device, whatever the rows: a pred the graph is given is read once for the pass (its host
    copy, which both BRANCHes read: the forward's and the gradient's); one the program computes once per IF
    (two), where the issuing loop runs; nothing else is read by the loop."""
    monkeypatch.setattr(standin, "TRACE", True)
    monkeypatch.setattr(standin, "TRACE_DEPTH", 2)
    model = _cond_model(pred)
    for rows in (2, ROWS):
        params, feeds = _values(1.0)
        feeds = dict(feeds, x=feeds["x"][:rows], y=feeds["y"][:rows])
        _train(model, params, feeds, "device", Cuda(cuda_standin))
        standin.reset()
        _train(model, params, feeds, "device", Cuda(cuda_standin))
        reads = {where: sum(n for (way, site), n in standin.sites.items() if way == "d2h" and where in site)
                 for where in ("issue.py:_read_preds", "issue.py:run")}
        assert reads == ({"issue.py:_read_preds": 1, "issue.py:run": 0} if pred == "given" else
                         {"issue.py:_read_preds": 0, "issue.py:run": 2}), (rows, dict(standin.sites))


def test_explain_shows_a_static_conds_branches():
    params, feeds = _values(1.0)
    for pred, line in [("given", r"branch on static\[p,0\] = 1\.0: then \d+ instructions, else \d+"),
                       ("computed", r"branch on r\d+\(.*\), computed in the program: then \d+ instructions, else \d+")]:
        text = str(explain(_cond_model(pred), {}, feeds, params))
        assert len(re.findall(r"      instruction \d+: " + line, text)) == 2, text   # (forward, gradient)
