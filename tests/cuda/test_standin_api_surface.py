"""The package's CuPy API surface against CuPy 14's (tests/cuda/cupy_surface.py, read from CuPy's source): an AST
walk lists every ``cupy.`` / ``xp.`` chain the package uses, and each is in the table; the device stand-in
(cuda/standin.py) and the fake runtime objects (tests/cuda/gpu_stubs.py) have every entry they stand in for, of
its kind, none of the absent ones, and nothing public the table lacks."""
from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

import minicavs
from minicavs.cuda import standin

from .cupy_surface import SURFACE
from .gpu_stubs import fake_cupy
from .test_issue_gpu_path import stubs  # noqa: F401  (the session's stub libraries)

PACKAGE = Path(minicavs.__file__).parent
ROOTS = {"cupy", "xp", "cp"}   # names the package gives the array module
MAKERS = {"require": "cupy", "_cupy": "cupy", "_module": "cupy.RawModule()"}   # (cuda/kernels.py)
# the stand-in's own tools, never reached through ``xp`` (the walk would find them: they are not in the table)
STANDIN_ONLY = {"IMPLICIT", "PARAMETER_DTYPES", "TRACE", "TRACE_DEPTH", "check_scalar", "crossings", "reset",
                "scalar_dtype", "sites", "Any", "annotations"}
# entries the stand-in leaves to others: kernels to the emulation's launcher, cuBLAS to the GPU path's fakes
NOT_STANDIN = ("cupy.RawModule", "cupy.cuda.cublas", "cupy.cuda.device")
ARRAY_DUNDERS = ("__array_function__", "__array_priority__", "__array_ufunc__", "__cuda_array_interface__",
                 "__dlpack__")
KERNEL = 'extern "C" __global__ void k(long n, double *y) { if (n > 0) y[0] = 1; }\n'


def _chain(node, aliases: dict) -> str | None:
    """The dotted chain an expression names from the array module ('cupy.x.()' for a call), or None."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            if node.attr == "xp":
                return ".".join(["cupy"] + parts[::-1])
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            parts.append("()")
            node = node.func
        elif isinstance(node, ast.Name):
            if node.id in MAKERS and parts and parts[-1] == "()":
                return ".".join([MAKERS[node.id]] + parts[::-1][1:])
            root = aliases.get(node.id, "cupy" if node.id in ROOTS else None)
            return None if root is None else ".".join([root] + parts[::-1])
        else:
            return None


def _chains_of(tree: ast.AST, where: str) -> dict[str, str]:
    used = {}
    for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        aliases = {}   # (a name bound to the module or a submodule: ``cuda = self.device.xp.cuda``)
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                chain = _chain(node.value, aliases)
                if chain is not None and "()" not in chain and node.targets[0].id not in ROOTS:
                    aliases[node.targets[0].id] = chain
        for node in ast.walk(scope):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cupy":
                for alias in node.names:
                    used.setdefault(f"{node.module}.{alias.name}", f"{where}:{node.lineno}")
            elif isinstance(node, (ast.Attribute, ast.Call)):
                chain = _chain(node, aliases)
                if chain is not None and chain != "cupy":
                    used.setdefault(chain, f"{where}:{node.lineno}")
    return used


def used_chains(package: Path = PACKAGE) -> dict[str, str]:
    """Every chain from the array module the package's source names, with where it first does."""
    used = {}
    for path in sorted(package.rglob("*.py")):
        for chain, where in _chains_of(ast.parse(path.read_text()), str(path.relative_to(package))).items():
            used.setdefault(chain, where)
    return used


def entry(chain: str) -> str:
    """The table entry a used chain reaches: a call's result is a runtime object (``X()`` in the table) or,
    from an array function or method, an array (``cupy.ndarray``); an array member's own members, a dtype's,
    a ufunc's methods belong to the entry before them."""
    parts = chain.split(".")
    while parts[-1] == "()":
        parts.pop()
    out = parts[:1]
    for part in parts[1:]:
        head = ".".join(out)
        kind = SURFACE.get(head, ("",))[0]
        if part == "()":
            if head + "()" in SURFACE:
                out[-1] += "()"
                continue
            if kind in ("function", "ufunc") or head.startswith("cupy.ndarray."):
                out = ["cupy", "ndarray"]   # (an array)
                continue
            return head
        if head == "cupy.ndarray.T":
            out = ["cupy", "ndarray"]
        elif kind in ("ufunc", "value") or (head.startswith("cupy.ndarray.") and head in SURFACE):
            return head
        out.append(part)
    return ".".join(out)


def test_every_cupy_chain_the_package_uses_is_in_cupy_14():
    used = used_chains()
    assert "cupy.RawModule().get_function().kernel.ptr" in {entry(c) for c in used}   # (the walk sees the loop)
    unknown = {entry(c): where for c, where in used.items() if SURFACE.get(entry(c), ("absent",))[0] == "absent"}
    assert not unknown, f"chains CuPy 14 lacks (or the table does not list yet): {unknown}"


def test_the_walk_finds_what_cupy_lacks():
    """The walk and the table catch a RawKernel's ``ptr`` (the issuing loop's first fault on a GPU) and a stand-in-only name."""
    source = ("def f(device, source):\n    xp = device.xp\n    xp.check_scalar('k', 'long n', 1)\n"
              "    return _module(source).get_function('k').ptr\n")
    found = {entry(c) for c in _chains_of(ast.parse(source), "f")}
    assert {"cupy.check_scalar", "cupy.RawModule().get_function().ptr"} <= found
    assert SURFACE["cupy.RawModule().get_function().ptr"][0] == "absent" and "cupy.check_scalar" not in SURFACE


def _resolve(root, chain: str):
    obj = root
    for part in chain.split(".")[1:]:
        name = part[:-2] if part.endswith("()") else part
        obj = getattr(obj, name)
        if part.endswith("()"):
            obj = obj(code=KERNEL) if name == "RawModule" else obj("k") if name == "get_function" else obj()
    return obj


def _holds(root, chain: str, kind: str) -> str | None:
    """Why ``root`` does not hold entry ``chain`` of ``kind`` (None: it does)."""
    try:
        obj = _resolve(root, chain)
    except AttributeError:
        return None if kind == "absent" else "missing"
    checks = {"module": lambda: isinstance(obj, (types.ModuleType, types.SimpleNamespace)),
              "class": lambda: isinstance(obj, type), "function": lambda: callable(obj),
              "ufunc": lambda: callable(obj) and all(hasattr(obj, m) for m in ("at", "reduce", "reduceat")),
              "absent": lambda: False}
    return None if checks.get(kind, lambda: True)() else f"not a {kind}"


def test_the_stand_in_has_every_entry_it_stands_in_for():
    wrong = {chain: why for chain, (kind, _) in SURFACE.items() if not chain.startswith(NOT_STANDIN)
             and (why := _holds(standin, chain, kind)) is not None}
    assert not wrong, wrong


def test_the_gpu_paths_fakes_have_the_runtime_entries(stubs, emulation_dir):  # noqa: F811
    fake = fake_cupy(stubs, "cupy", emulation_dir)["cupy"]
    wrong = {chain: why for chain, (kind, _) in SURFACE.items()
             if chain.startswith(("cupy.cuda.", "cupy.RawModule")) and (why := _holds(fake, chain, kind)) is not None}
    assert not wrong, wrong


def _public(obj, dunders=()) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_") or n in dunders}


@pytest.mark.parametrize("where, obj, names", [
    ("cupy", standin, {n for n, v in vars(standin).items() if not n.startswith("_")
                       and not isinstance(v, types.ModuleType)} - STANDIN_ONLY),
    ("cupy.ndarray", standin.ndarray, _public(standin.ndarray, ARRAY_DUNDERS)),
    ("cupy.cuda", standin.cuda, _public(standin.cuda)),
    ("cupy.cuda.Stream()", standin.cuda.Stream(), _public(standin.cuda.Stream())),
    ("cupy.cuda.Event()", standin.cuda.Event(), _public(standin.cuda.Event())),
    ("cupy.cuda.Device()", standin.cuda.Device(), _public(standin.cuda.Device())),
])
def test_the_stand_in_has_nothing_cupy_lacks(where, obj, names):
    extra = {f"{where}.{n}" for n in names if SURFACE.get(f"{where}.{n}", ("absent",))[0] == "absent"}
    assert not extra, f"the stand-in has what CuPy 14 lacks (or the table does not list): {sorted(extra)}"
