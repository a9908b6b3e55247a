"""What the tests of a static graph's control flow as a program share (test_static_loops_while.py,
test_static_branches.py): the three runners, a training pass on one of them, the step runner's pass to compare
with, and one instruction corrupted and refused by every runner."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from minicavs.core.errors import CheckError
from minicavs.cuda import Cuda, issue
from minicavs.engine import static_program
from minicavs.engine.backend import to_host
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.lowered import OPCODES_BY_ID

from .test_static_program import _programs

RUNNERS = [("reference", None, "reference runner"), ("device", None, "C runner"), ("device", "cuda", "cuda runner")]


def _opcodes(program) -> list:
    return [OPCODES_BY_ID[op] for op in program.lowered.code[:, 0]]


def _on_the_step_runner(run):
    """``run()`` with every static graph on the step runner (nothing lowered: what ran before)."""
    keep = static_program.refusal
    static_program.refusal = lambda node: "the step runner's run, for comparison"
    try:
        return run()
    finally:
        static_program.refusal = keep


def _train(model, params, feeds, runner: str = "device", device=None, **switches):
    """A training pass (``device``: the emulated CUDA device), its loss, gradients and outputs on the host."""
    cpu, model.device = model.device, device or model.device
    try:
        got = model.forward_backward({}, feeds, {k: model.device.asarray(v) for k, v in params.items()},
                                     RunContext(), options=EngineOptions(runner=runner, **switches))
    finally:
        model.device = cpu
    host = {k: np.asarray(to_host(v)) for k, v in [("loss", got.loss), *got.grads.items(), *got.outputs.items()]}
    return host, _programs(got), got.static


def _refused_when_corrupted(cuda_standin, model, params, feeds, opcode: str, corrupt: Callable, match: str) -> None:
    """On every runner: the first ``opcode`` instruction of the pass's program changed by ``corrupt(program,
    row)`` (the instruction's row of the code; it changes one operand in place and returns (index, old value)),
    the pass refused with ``match`` after ``instruction <pc> (<opcode> ...): ``; the operand put back after."""
    for runner, device, who in RUNNERS:
        error = issue.IssueCheckError if device else CheckError
        cuda = Cuda(cuda_standin) if device else None
        _, (program,), _ = _train(model, params, feeds, runner, cuda, check=True)
        code = program.lowered.code
        pc = _opcodes(program).index(opcode)
        index, old = corrupt(program, code[pc])
        try:
            with pytest.raises(error, match=rf"static graph: task 0, instruction {pc} \({opcode} .*\): {match}"):
                _train(model, params, feeds, runner, cuda, check=True)
        finally:
            code[pc][index] = old


def _operand_set(operand: int, value: int) -> Callable:
    """A ``corrupt`` for :func:`_refused_when_corrupted`: operand ``operand`` of the instruction set to ``value``."""
    def corrupt(program, row) -> tuple[int, int]:
        old, row[1 + operand] = int(row[1 + operand]), value
        return 1 + operand, old
    return corrupt
