"""The op registry is the one place of an op's knowledge: outside ``minicavs/ops`` no code branches on a node's
op name, other than telling inputs and parameters apart (what a graph is fed with). Questions such as "is it
fusible", "does it absorb a bias", "is it a concat whose parts can be written in place" are answered by the
op's ``OpDef``. The check reads the source: any comparison or lookup keyed by ``<something>.op`` fails, unless
it compares with the names ``input`` / ``param`` or indexes the registry itself (``OPS[n.op]``)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minicavs"
ALLOWED_NAMES = {"input", "param"}
# codegen/cstyle.py renders scalar expressions (ops/scalar.py's Expr: ``e.op`` is a C operator of a fused
# kernel's body), never nodes.
EXEMPT = {"engine/codegen/cstyle.py"}


def _is_op_attribute(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "op"


def _literal_names(node):
    """The strings of a literal string / tuple / list / set of strings, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return {e.value for e in node.elts}
    return None


def branches_on_op_names(source: str, filename: str = "<source>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_op_attribute(x) for x in operands):
                others = [x for x in operands if not _is_op_attribute(x)]
                names = [_literal_names(x) for x in others]
                if not others or any(n is None or not n <= ALLOWED_NAMES for n in names):
                    found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Subscript) and _is_op_attribute(node.slice):
            if not (isinstance(node.value, ast.Name) and node.value.id == "OPS"):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and _is_op_attribute(node.args[0])):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_ops_branches_on_an_op_name():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "ops"]
    assert len(files) > 40
    found = []
    for path in files:
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in EXEMPT:
            found += branches_on_op_names(path.read_text(), rel)
    assert not found, "branch on an op name outside ops/ (ask the registry):\n" + "\n".join(found)


def test_the_check_finds_branches():
    assert branches_on_op_names('if n.op == "concat":\n    pass\n')
    assert branches_on_op_names('x = n.op in ("input", "gather")\n')
    assert branches_on_op_names("x = n.op in skip\n")
    assert branches_on_op_names("f = KERNELS[n.op]\n")
    assert branches_on_op_names("f = table.get(n.op)\n")
    assert not branches_on_op_names('x = n.op in ("input", "param")\ny = n.op != "input"\nz = OPS[n.op]\n')
