"""Functions of the engine and the backends are short and say one thing each: a function over ``MAX_FUNCTION``
lines does several jobs and is split by meaning (not by squeezing lines). The exceptions are named below with the
reason each is one piece (a table, a generated-source template). Modules there also keep clear of the module
limit of tests/test_layering.py, so that the next change does not press a module against it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_layering import MAX_LINES

PACKAGE = Path(__file__).resolve().parents[1] / "minicavs"
CHECKED = ("engine", "cpu", "cuda")   # the runtime's layers: the runners and what they read
MAX_FUNCTION = 60
MODULE_MARGIN = 20   # a checked module stays this many lines under MAX_LINES
# "module.path:Qualified.name" -> why it is one piece. Keep it short: each entry is a function nobody could split.
ALLOWED: dict[str, str] = {}


def functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines from its first decorator to its last line) of every function in ``path``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((prefix + child.name, child.end_lineno - first + 1))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def checked_modules() -> list[Path]:
    return sorted(p for folder in CHECKED for p in (PACKAGE / folder).rglob("*.py"))


def key(path: Path, name: str) -> str:
    return f"{path.relative_to(PACKAGE.parent).with_suffix('').as_posix().replace('/', '.')}:{name}"


def long_functions() -> dict[str, int]:
    return {key(path, name): n for path in checked_modules() for name, n in functions(path) if n > MAX_FUNCTION}


def test_no_function_is_longer_than_the_limit():
    long = {k: n for k, n in long_functions().items() if k not in ALLOWED}
    assert not long, (f"functions over {MAX_FUNCTION} lines (split each by meaning, or name it in ALLOWED with "
                      "its reason):\n" + "\n".join(f"{k}: {n} lines" for k, n in sorted(long.items())))


def test_every_allowed_function_is_still_long():
    """An entry whose function was split or removed goes: the allow-list names only live exceptions."""
    stale = sorted(set(ALLOWED) - set(long_functions()))
    assert not stale, f"ALLOWED names functions not over {MAX_FUNCTION} lines (remove them): {stale}"


def test_no_checked_module_presses_against_the_module_limit():
    limit = MAX_LINES - MODULE_MARGIN
    full = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path in checked_modules()
            if (n := len(path.read_text().splitlines())) > limit]
    assert not full, f"modules over {limit} lines (split each where the design splits):\n" + "\n".join(full)


def test_the_check_names_a_long_method_and_counts_its_decorators(tmp_path, monkeypatch):
    """A method one line over the limit, counted from its decorator, is named with its class; one at the limit
    is not; and a module over the margin is named."""
    (tmp_path / "engine").mkdir()
    body = "".join("        x = 1\n" for _ in range(MAX_FUNCTION - 2))
    (tmp_path / "engine" / "runner.py").write_text(
        "class Runner:\n    @property\n    def run(self):\n" + body + "        return x\n"
        "    def fits(self):\n" + body + "        return x\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path)
    assert long_functions() == {f"{tmp_path.name}.engine.runner:Runner.run": MAX_FUNCTION + 1}
    with pytest.raises(AssertionError, match=r"engine\.runner:Runner\.run: 61 lines"):
        test_no_function_is_longer_than_the_limit()
    (tmp_path / "engine" / "full.py").write_text("\n" * (MAX_LINES - MODULE_MARGIN + 1))
    with pytest.raises(AssertionError, match="full.py: 781 lines"):
        test_no_checked_module_presses_against_the_module_limit()
