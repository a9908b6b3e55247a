"""A static graph's foreach keeps what its gradient reads (ops/loop_grad.py): its gradient loop in the lowered
program applies the body's gradient alone to the saved states and residuals, never the body's forward ops."""
from __future__ import annotations

import pytest

from minicavs.engine.codegen.machine import OPCODES
from minicavs.engine.executor import RunContext
from minicavs.engine.lowered import OPCODES_BY_ID

from ..engine.test_static_loops import T, _lm, _programs, _values


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


@pytest.fixture(scope="module")
def lm_loops() -> list:
    """The language-model loop's program (x_t·W + h·U + b, tanh, h·Wo, its cross-entropy; a trip count per
    row): its forward loop's and its gradient loop's instructions."""
    params, feeds = _values([T, 3, 0, 1])
    got = _lm(per_row=True).forward_backward({}, feeds, params, RunContext())
    (program,) = _programs(got)
    return _loops(program.lowered.code)


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
    """W, U, b and Wo: each step's term (a product, a column sum) added in place (ADD) into its sum's memory,
    and no sum over the steps copied (COPY) there."""
    _, backward = lm_loops
    sums = [f["dst"] for op, f in backward if op == "ADD"]
    assert len(set(sums)) == 4, backward
    assert [f for op, f in backward if op == "COPY" and f["dst"] in sums] == []
