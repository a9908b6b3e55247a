"""The opcode table (minicavs/engine/codegen/machine.py's OPCODE_TABLE) is the one place an opcode's operands and
their checks are written: both C loops (the C runner's interpreter, the CUDA issuing loop) decode every opcode's
operands with the checks the table renders, have a case for every opcode but the one they decline (APPLY), and the
reference runner has a function per opcode taking the table's operands."""
from __future__ import annotations

import inspect
import re

import pytest

from minicavs.engine import reference
from minicavs.engine.codegen.issue_source import issue_source
from minicavs.engine.codegen.machine import OPCODE_TABLE, OPCODES, OPERAND_KINDS, decode, interpreter_source

# each loop's source, and the macro it checks a pointed register ("reg") with
LOOPS = {"C runner's interpreter": (lambda: interpreter_source("double"), "REGOK"),
         "CUDA issuing loop": (issue_source, "DSTOK")}
DECLINED = {"APPLY"}   # a step only Python runs: both C loops decline a program that has one
CHECK = re.compile(r"\b(REGOK|DSTOK|BUFOK)\(a\[(\d)\], (\d)\);")


def cases(source: str) -> dict:
    """{opcode: the checks on its operands that its case runs first} over every ``case`` label of a C switch
    (labels sharing one case share its checks; a case that checks nothing first maps to '')."""
    out = {}
    lines = source.splitlines()
    for i, line in enumerate(lines):
        names = re.findall(r"case ([A-Z_]+):", line)
        if not names or not all(n in OPCODE_TABLE or n == "NOPCODES" for n in names):
            continue
        rest = line.split(":")[-1].strip().lstrip("{").strip()
        first = rest if rest and rest != "{{" else lines[i + 1].strip()
        checks = " ".join(m.group(0) for m in CHECK.finditer(first)) if CHECK.match(first) else ""
        for name in names:
            out.setdefault(name, []).append(checks)
    return out


def test_every_operand_has_a_known_kind():
    for name, operands in OPCODE_TABLE.items():
        for operand, kind in operands:
            assert kind in OPERAND_KINDS, (name, operand, kind)
        assert OPCODES[name] == tuple(o for o, _ in operands)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_each_loop_decodes_every_opcode_as_the_table_says(loop):
    source, point_ok = LOOPS[loop]
    found = cases(source())
    assert set(found) == set(OPCODE_TABLE) - DECLINED, set(found) ^ (set(OPCODE_TABLE) - DECLINED)
    for name, checks in found.items():
        want = decode(name, point_ok)
        assert all(c == want for c in checks), (loop, name, checks, want)


def test_the_table_renders_the_checks_of_each_operand_kind():
    assert decode("BIND", "DSTOK") == "DSTOK(a[0], 0); BUFOK(a[1], 1);"
    assert decode("GEMM", "DSTOK") == "REGOK(a[0], 0); REGOK(a[1], 1); REGOK(a[2], 2);"   # (bias: where used)
    assert decode("SPUT", "REGOK") == "BUFOK(a[0], 0);"   # (idx and src: on the path that uses them)
    assert decode("NOP", "REGOK") == ""


def test_the_reference_runner_has_a_function_per_opcode_taking_its_operands():
    for name, operands in OPCODES.items():
        fn = reference.OPERATIONS[name]
        assert list(inspect.signature(fn).parameters)[1:] == list(operands), name


def test_the_register_cases_are_one_text_in_both_loops():
    """The instructions that only point a register are rendered once (register_cases) into both loops: each loop
    holds that text, differing only in the macro that checks a pointed register."""
    from minicavs.engine.codegen.machine import register_cases
    interpreter, loop = interpreter_source("double"), issue_source()
    assert register_cases("REGOK", 12) in interpreter
    assert register_cases("DSTOK", 8) in loop
    assert register_cases("REGOK", 0).replace("REGOK(a[0]", "DSTOK(a[0]") == register_cases("DSTOK", 0)
