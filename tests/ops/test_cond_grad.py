"""A cond inside a vertex function whose gradient reads what its taken branch saved (minicavs/ops/cond_grad.py):
∂F's conds hold the bodies' gradients alone (no forward op recomputed), the forward keeps each side's values in
results of its own, and the gradients equal F written with Python control flow and central finite differences in
float64, on every runner, for either side."""
from __future__ import annotations

import numpy as np
import pytest

import minicavs.ops as ops
from minicavs import control as C
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.ops.flow import flow, is_cond
from minicavs.runtime.inputs import InputGraph
from minicavs.train.testing import check_model_grads

F64 = "float64"
GRAPHS = [InputGraph.chain(n) for n in (3, 1, 2)]
FORWARD_ONLY = {"sigmoid", "tanh", "exp"}   # ops the cells compute that no gradient of theirs re-applies


def _cell_model(choice):
    """An LSTM-like cell on the gathered [h; c] or (else) a cell on h alone, by the sign of ``s`` (``choice``
    None: a cond of two results; True or False: that branch in Python)."""
    from minicavs.engine.model import Model, Structure
    from minicavs.runtime.vertex import VertexFunction
    H = 3
    Wx, Wh = ops.param_node("Wx", (2, 3 * H), F64), ops.param_node("Wh", (H, 3 * H), F64)
    b, Wr, s = ops.param_node("b", (3 * H,), F64), ops.param_node("Wr", (H, H), F64), ops.param_node("s", (), F64)
    F = VertexFunction("cell", arity=1, message=(2 * H,), dtype=F64)
    with F:
        state, x = F.gather(0), F.pull((2,))

        def cell():
            h0, c0 = ops.split(state, 2)
            f, o, u = ops.split(x @ Wx + h0 @ Wh + b, 3)
            c = ops.sigmoid(f) * c0 + ops.tanh(u)
            return [ops.concat([ops.sigmoid(o) * ops.tanh(c), c]), ops.exp(c)]

        def other():
            h0, c0 = ops.split(state, 2)
            return [ops.concat([ops.tanh(h0 @ Wr), c0 * 0.5]), ops.sigmoid(h0)]
        m, extra = C.cond(ops.step(s), cell, other) if choice is None else (cell() if choice else other())
        F.scatter(m)
        F.push(ops.split(m, 2)[0] * extra, name="h")
    st = Structure(F, pulls={"x": ops.input((None, 2), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def _values(sign: float) -> tuple[dict, dict]:
    rng = np.random.default_rng(21)
    vals = {"Wx": rng.uniform(-0.5, 0.5, (2, 9)), "Wh": rng.uniform(-0.5, 0.5, (3, 9)),
            "b": rng.uniform(-0.5, 0.5, 9), "Wr": rng.uniform(-0.5, 0.5, (3, 3)), "s": np.float64(sign)}
    return vals, {"xs": rng.standard_normal((6, 2))}


def _body_ops(node, seen: set) -> set:
    """The ops of every body ``node`` holds (nested bodies too)."""
    found = set()
    for _, body in flow(node).bodies:
        for n in body.computed:
            found.add(n.op)
            if is_cond(n) and n not in seen:
                seen.add(n)
                found |= _body_ops(n, seen)
    return found


def test_the_backward_conds_recompute_no_forward_op():
    """∂F's conds (the per-vertex one and each parameter's) hold no sigmoid, tanh or exp: the gradients read
    the values the forward's taken branch saved, never re-apply its body."""
    model = _cell_model(None)
    fn = model.structures[0].compiled["cell"]
    conds = [n for n in list(fn.row_bwd) + list(fn.static_bwd) if is_cond(n)]
    assert conds
    for node in conds:
        assert not _body_ops(node, set()) & FORWARD_ONLY, (node.label(), _body_ops(node, set()))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_saved_values_gradient_equals_python_control_flow_on_every_runner(cuda_standin, sign):
    from minicavs.cpu import CPU
    from minicavs.cuda import Cuda
    """(F's cond is one node keeping either side's saved values, its two results items of it.)"""
    vals, feeds = _values(sign)
    want = _cell_model(sign > 0).forward_backward(GRAPHS, feeds, vals)
    model = _cell_model(None)
    (node,) = [n for n in model.structures[0].compiled["cell"].row_fwd if is_cond(n)]
    assert flow(node).saves
    for runner, device in [("reference", None), ("device", None), ("device", Cuda(cuda_standin))]:
        model.device = device or CPU
        try:
            given = {k: model.device.asarray(v) for k, v in vals.items()} if device else vals
            got = model.forward_backward(GRAPHS, feeds, given, RunContext(), options=EngineOptions(runner=runner))
        finally:
            model.device = CPU
        for program in (p for st in got.states.values() for p in (st.program, st.backward_program)):
            assert program.declined is None, program.declined
        _close(got.loss, want.loss, runner)
        for k in want.grads:
            _close(got.grads[k], want.grads[k], f"{runner} d{k}")
    check_model_grads(model, GRAPHS, feeds, vals, directions=3)


def _close(a, b, what: str) -> None:
    from minicavs.engine.backend import to_host
    a, b = np.asarray(to_host(a), np.float64), np.asarray(to_host(b), np.float64)
    assert np.max(np.abs(a - b), initial=0.0) <= 1e-10 * max(1.0, float(np.max(np.abs(b), initial=0.0))), what
