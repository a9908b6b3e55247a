"""The opcode table (minicavs/engine/codegen/opcodes.py: OPCODE_TABLE and SPANS) is the one place an opcode's
operands and the memory it touches are written: both C loops (the C runner's interpreter, the CUDA issuing loop)
open every opcode's case with the checks the table renders (its operands, then its spans) and check nothing
else of that kind in the case's body; each has a case for every opcode but the one they decline (APPLY); the
reference runner has a function per opcode taking the table's operands and checks the table's spans in check
mode."""
from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from minicavs.engine import reference
from minicavs.engine.codegen.issue_source import issue_source
from minicavs.engine.codegen.machine import VIEWS, interpreter_source, register_cases
from minicavs.engine.codegen.opcodes import (OPCODE_TABLE, OPCODES, OPERAND_KINDS, SPAN_KINDS, SPANS, Span, checks,
                                             decode)

# each loop's source, and the macro it checks a pointed register ("reg") with
LOOPS = {"C runner's interpreter": (lambda: interpreter_source("double"), "REGOK"),
         "CUDA issuing loop": (issue_source, "DSTOK")}
DECLINED = {"APPLY"}   # a step only Python runs: both C loops decline a program that has one
# what only the rendered checks may do in a case: test a register's or buffer's span, an index buffer's rows
SPAN_TESTS = re.compile(r"\b(CHECKR|out_of\w*|span_out|index_out|rows_ok\w*|SPAN|ROWSPAN|ELEMENTS|FIRST|INDEX|KEYS|"
                        r"SCRATCHSPAN|COLUMNS|NONNEG|NOTRANS|DENSE|KERNELOK|SCALAR|TARGET|BACK)\("
                        r"|nkernels|[<>]=? *(M->)?size\[|\bsize\[[^]]*\] *[<>]|"
                        r"ld < need_\w+ &&")


def cases(source: str) -> dict:
    """{opcode: its case's text, from after its label to the next label} over the C switch's ``case`` labels
    (labels sharing one case map to the same text)."""
    labels = list(re.finditer(r"^ *case ([A-Z_]+):(?: case ([A-Z_]+):)?", source, flags=re.M))
    out = {}
    for label, after in zip(labels, labels[1:] + [None]):
        end = after.start() if after else source.index("default:", label.end())
        body = source[label.end():end]
        for name in filter(None, label.groups()):
            if name in OPCODE_TABLE:
                out[name] = body
    return out


def squeeze(text: str) -> str:
    return " ".join(text.split())


def test_every_operand_and_span_has_a_known_kind():
    assert set(SPANS) == set(OPCODE_TABLE)
    for name, operands in OPCODE_TABLE.items():
        for operand, kind in operands:
            assert kind in OPERAND_KINDS, (name, operand, kind)
        assert OPCODES[name] == tuple(o for o, _ in operands)
        for span in SPANS[name]:
            assert span.kind in SPAN_KINDS and len(span.args) == SPAN_KINDS[span.kind], (name, span)
            assert span.operand in OPCODES[name] and (span.report or span.operand) in OPCODES[name], (name, span)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_each_loop_opens_every_case_with_the_tables_checks_and_has_no_others(loop):
    source, point_ok = LOOPS[loop]
    found = cases(source())
    assert set(found) == set(OPCODE_TABLE) - DECLINED, set(found) ^ (set(OPCODE_TABLE) - DECLINED)
    for name, body in found.items():
        want = squeeze(checks(name, point_ok))
        text = squeeze(body).removeprefix("{").strip()
        assert text.startswith(want), (loop, name, text[:300], want)
        rest = text[len(want):]
        assert not SPAN_TESTS.search(rest), (loop, name, SPAN_TESTS.search(rest).group(0), rest[:400])


def test_the_table_renders_the_checks_of_each_operand_and_span_kind():
    assert decode("BIND", "DSTOK") == "DSTOK(a[0], 0); BUFOK(a[1], 1);"
    assert decode("GEMM", "DSTOK") == "REGOK(a[0], 0); REGOK(a[1], 1); REGOK(a[2], 2);"   # (bias: where used)
    assert decode("SPUT", "REGOK") == "BUFOK(a[0], 0);"   # (idx and src: on the path that uses them)
    assert decode("NOP", "REGOK") == "" and checks("NOP", "REGOK") == ""
    gemm = checks("GEMM", "REGOK")
    assert gemm.startswith("if (CHECKING) {")
    assert "ROWSPAN(a[0], DIM(a[3]), DIM(a[4]), 0);" in gemm and "SPAN(a[1], DIM(a[3]), DIM(a[5]), 1);" in gemm
    assert "if (a[6] >= 0) { REGOK(a[6], 6); SPAN(a[6], 1, DIM(a[4]), 6); }" in gemm
    assert ("if (!(a[5] && STEP(a[4]) >= 1)) { INDEX(a[3], a[1], a[2], 0, a[2], 0, 3); }"
            in checks("GATHER", "REGOK"))
    assert "if (scatter_row < 0) { BUFOK(a[3], 3); INDEX(a[3], a[0], a[2], a[1], a[5], 0, 3); }" in checks("SPUT", "X")


def test_the_reference_runner_has_a_function_per_opcode_taking_its_operands():
    for name, operands in OPCODES.items():
        fn = reference.OPERATIONS[name]
        assert list(inspect.signature(fn).parameters)[1:] == list(operands), name
    assert set(reference.SPAN_CHECKS) == set(SPAN_KINDS)


def test_the_reference_runner_checks_the_tables_spans_in_check_mode(monkeypatch):
    """A span added to the table (GEMM's result as columns 0:1 of rows of 0: never true) fails the reference
    runner in check mode, naming the span's operand, and is not looked at without it."""
    from minicavs.engine.compile import EngineOptions
    from minicavs.engine.executor import RunContext
    from tests import cells
    from tests.engine.test_alg1 import CASES
    rng = np.random.default_rng(4)
    case = cells.child_sum_tree_lstm(rng)
    graphs = [CASES["child_sum"][1](rng, 4) for _ in range(2)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    monkeypatch.setitem(SPANS, "GEMM", SPANS["GEMM"] + (Span("columns", "c", ("0", "1", "0")),))
    run = lambda check: case.model.forward_backward(graphs, feeds, case.params, RunContext(),  # noqa: E731
                                                    options=EngineOptions(runner="reference", check=check))
    run(False)
    with pytest.raises(reference.CheckError, match=r"\(GEMM .*\): operand c \(columns\): columns 0:1 of rows of 0"):
        run(True)


def test_what_only_points_a_register_is_one_text_in_both_loops():
    """The instructions that only point a register are rendered once (register_cases) into both loops: each loop
    holds that text, differing only in the macro that checks a pointed register; so are the view paths of
    GATHER and SROWS (VIEWS), inside their cases."""
    interpreter, loop = interpreter_source("double"), issue_source()
    assert register_cases("REGOK", 12) in interpreter
    assert register_cases("DSTOK", 8) in loop
    assert register_cases("REGOK", 0).replace("REGOK(a[0]", "DSTOK(a[0]") == register_cases("DSTOK", 0)
    for source in (interpreter, loop):
        found = cases(source)
        for name, text in VIEWS.items():
            assert squeeze(text) in squeeze(found[name]), name
