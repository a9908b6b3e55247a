"""A static graph's foreach keeps what its gradient reads (ops/loop_grad.py): its gradient loop in the lowered
program applies the body's gradient alone to the saved states and residuals, never the body's forward ops."""
from __future__ import annotations

import pytest

from minicavs.engine.codegen.machine import OPCODES
from minicavs.engine.executor import RunContext
from minicavs.engine.lowered import OPCODES_BY_ID

from minicavs import ops
from minicavs.core.dtypes import float64 as F64
from minicavs.engine.model import Model
from minicavs.ops import control as C
from minicavs.train.testing import check_model_grads

from ..engine.test_static_loops import D, H, T, V, _lm, _programs, _values


def _loops(code) -> list:
    """Each outermost loop's instructions (LOOP/LOOPN ... ENDLOOP) as (opcode, {field: value}) pairs."""
    loops, current = [], None
    for row in code:
        name = OPCODES_BY_ID[int(row[0])]
        fields = dict(zip(OPCODES[name], row[1:].tolist()))
        if name.startswith("LOOP"):
            current = []
        elif name == "ENDLOOP":
            loops.append(current)
            current = None
        elif current is not None:
            current.append((name, fields))
    return loops


def _rows(code) -> list:
    """Each instruction as (opcode, {field: value})."""
    return [(OPCODES_BY_ID[int(row[0])], dict(zip(OPCODES[OPCODES_BY_ID[int(row[0])]], row[1:].tolist())))
            for row in code]


def _last_endloop(code) -> int:
    return max(i for i, (op, _) in enumerate(_rows(code)) if op == "ENDLOOP")


@pytest.fixture(scope="module")
def lm_program():
    """The language-model loop's program (x_t·W + h·U + b, tanh, h·Wo, its cross-entropy; a trip count per
    row): its instructions."""
    params, feeds = _values([T, 3, 0, 1])
    got = _lm(per_row=True).forward_backward({}, feeds, params, RunContext())
    (program,) = _programs(got)
    return program.lowered.code


@pytest.fixture(scope="module")
def lm_loops(lm_program) -> list:
    """Its forward loop's and its gradient loop's instructions."""
    return _loops(lm_program)


def test_a_static_graphs_foreach_gradient_runs_none_of_its_bodys_forward_ops(lm_loops):
    """The forward loop's products by W, U and Wo and its cross-entropy row function occur zero times in the
    gradient loop, which reads the forward's saved logits (the cross-entropy's gradient alone) and transposed
    weights."""
    forward, backward = lm_loops
    weights = {f["b"] for op, f in forward if op == "GEMM"}
    row_functions = {f["fn"] for op, f in forward if op == "ROWOP"}
    assert len(weights) == 3 and row_functions, forward
    assert [f for op, f in backward if op == "GEMM" and f["b"] in weights] == []
    assert [f for op, f in backward if op == "ROWOP" and f["fn"] in row_functions] == []
    assert any(op == "ROWOP" for op, _ in backward)   # (the cross-entropy's gradient, from the saved logits)


def test_the_gradient_loop_adds_each_parameters_term_into_its_sum(lm_loops):
    """A trip count per row: W, U and Wo: each step's product adds itself into its sum's memory (GEMM's bias
    -2: no product written aside and added), b's column sum is added in place (ADD), and no sum over the steps
    is copied (COPY) there."""
    _, backward = lm_loops
    products = [f["c"] for op, f in backward if op == "GEMM" and f["bias"] == -2]
    sums = [f["dst"] for op, f in backward if op == "ADD"]
    assert len(set(products)) == 3 and len(set(sums)) == 1 and not set(sums) & set(products), backward
    assert [f for op, f in backward if op == "COPY" and f["dst"] in sums + products] == []


def _fixed_lm():
    """The language model's loop over all T steps (no trip count): x_t·W hoisted before it."""
    W, U, b = ops.param_node("W", (D, H), F64), ops.param_node("U", (H, H), F64), ops.param_node("b", (H,), F64)
    Wo = ops.param_node("Wo", (H, V), F64)
    x, y = ops.input((None, T, D), "float64", name="x"), ops.input((None, T), "int64", name="y")
    h0 = ops.input((None, H), "float64", name="h0")

    def body(inputs, states):
        h = ops.tanh(ops.linear(inputs[0], W, b) + states[0] @ U)
        return [ops.softmax_cross_entropy(h @ Wo, inputs[1])], [h]
    (nll,), _ = C.foreach(body, [x, y], [h0], name="lm")
    return Model([], loss=ops.sum(nll), outputs={"nll": ops.sum(nll)})


def test_each_parameters_gradient_is_one_product_over_every_row_and_step():
    """A foreach over all its steps: W, U and Wo's gradients each ONE GEMM after the gradient loop, over FLAT
    views of the stacked terms (its inner dimension -T: T times the task's rows), b's one SUMROWS over T times
    the rows; the gradient loop makes no parameter-shaped product (rows not the task's) and adds no term into a
    sum (ADD); the gradients equal float64 finite differences."""
    params, feeds = _values([T] * 4)
    feeds.pop("steps")
    model = _fixed_lm()
    (program,) = _programs(model.forward_backward({}, feeds, params, RunContext()))
    code = program.lowered.code
    _, backward = _loops(code)
    assert [f for op, f in backward if op == "ADD" or (op == "GEMM" and f["rows"] != -1)] == [], backward
    after = _rows(code)[_last_endloop(code) + 1:]
    flat = {f["dst"]: f for op, f in after if op == "FLAT"}
    flat.update((f["dst"], flat[f["src"]]) for op, f in after if op == "TRANSPOSE" and f["src"] in flat)
    products = [f for op, f in after if op == "GEMM"]
    assert len(products) == 3 and all(f["k"] == -T and f["a"] in flat and f["b"] in flat for f in products)
    assert sorted((f["rows"], f["n"]) for f in products) == sorted([(D, H), (H, H), (H, V)])
    assert all(flat[f[x]]["k"] == T for f in products for x in "ab")
    sums = [f for op, f in after if op == "SUMROWS" and f["rows"] == -T]
    assert len(sums) == 1 and sums[0]["cols"] == H and sums[0]["src"] in flat
    check_model_grads(model, {}, feeds, params, directions=2)
