"""The import graph of the package follows DESIGN.md's layer list: a module imports only modules on its own
line or on lines above it, and no import cycle exists. Every import is read from the source, those inside
functions included, so a lazy import cannot hide an upward edge."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minicavs"

# DESIGN.md's layer list, top to bottom, with the modules it does not name placed on the line of the layer
# they belong to (frontier.py and fsm.py are the batching policies' simulation of Alg. 1 and their learned
# state machine, beside scheduler.py; executor.py, engine.py and explain.py run and read programs; atomic.py
# (atomic file writes) is a base utility that fsm.py, checkpoint.py and data/ use, wording.py (advice in
# Python or CLI words) one beside errors.py, onetime.py (announcing and timing one-time work: compiling kernels,
# learning an FSM) one that cpu/compiler.py and scheduler.py use, arrays.py (which device an array lives on) and
# limits.py (the generated code's sizes) too; progress.py, task.py, demo.py, testing.py, bench/, rundir.py (the
# run-dir commit protocol), runrecord.py (what the trainer's checkpoints record, checked on resume and eval),
# predict.py, plot.py and show.py are product code around the engine; reference.py (the reference runner of a
# lowered program, over the device's array module) stands beside the seam, so that every backend's runner can
# hand it an opcode it does not implement, and planner.py (a batch's schedule and memory plan in one C call, the
# host index arrays every device's run reads; the CPU backend provides its compiled library) stands there too
# (data/datasets.py too: PLACED below); ``minicavs`` itself is the package's public face).
LAYERS = [
    ["dtypes", "errors", "random", "sparse", "validate", "atomic", "arrays", "wording", "limits", "onetime"],
    ["graph"],
    ["ops"],
    ["autodiff"],
    ["control"],
    ["vertex"],
    ["inputs"],
    ["scheduler", "frontier", "fsm"],
    ["memory"],
    ["passes"],
    ["codegen"],
    ["backend", "reference", "planner"],
    ["cpu", "cuda"],
    ["compile"],
    ["program", "executor", "engine", "explain", "instructions"],
    ["model"],
    ["nn", "optim"],
    ["data"],
    ["checkpoint", "config", "training", "runrecord", "rundir", "distributed", "cli", "progress", "task",
     "predict", "plot", "show", "demo", "testing", "bench", "prefetch", "__main__", ""],
]
# Modules placed apart from their package: data/datasets.py is `minicavs prepare` (checksums, atomic copies into
# data/, reading the configs), product code that lives beside the readers it checks data with.
PLACED = {"data.datasets": "checkpoint"}
# Device-specific code stays behind the backend seam: these never import codegen/ or cuda/.
NO_DEVICE_CODE = ("ops", "optim", "training", "runrecord", "atomic", "rundir", "checkpoint", "distributed",
                  "validate", "predict", "plot", "show", "data")
# The concrete backends, and the modules above the seam that reach them only through it
# (minicavs.backend.get_device / default_device name a device without importing its code).
BACKENDS = ("cpu", "cuda")
THROUGH_THE_SEAM = ("compile", "instructions", "model", "engine")
MAX_LINES = 800   # a module longer than this holds more than one job: split it along them


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def imports_of(name: str, path: Path, is_package: bool, known) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "minicavs" and module not in known:
                found.add(f"missing module {module}")
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "minicavs":
                continue
            if not any(target == k or target.startswith(k + ".") for k in known):
                found.add(f"missing module {target}")
                continue
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, is_package, known) for name, (path, is_package) in known.items()}


def layer_of(module: str) -> int:
    """The line of the layer list a module stands on (by its top-level name below ``minicavs``)."""
    top = module.split(".")[1] if "." in module else ""
    top = PLACED.get(module.split(".", 1)[1] if "." in module else "", top)
    for i, line in enumerate(LAYERS):
        if top in line:
            return i
    raise AssertionError(f"{module} is on no line of the layer list: place it in tests/test_layering.py")


def test_every_module_has_a_layer():
    assert len(modules()) > 50, PACKAGE
    for name in modules():
        layer_of(name)


def test_every_import_names_a_module_of_the_package():
    missing = [f"{m}: {t}" for m, targets in import_graph().items() for t in sorted(targets)
               if t.startswith("missing module")]
    assert not missing, "\n".join(missing)


def test_imports_only_point_up_the_layer_list():
    upward = [f"{m} (line {layer_of(m)}) imports {t} (line {layer_of(t)})"
              for m, targets in import_graph().items() for t in sorted(targets)
              if not t.startswith("missing module") and layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = {m: {t for t in targets if not t.startswith("missing module")} for m, targets in import_graph().items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            target = next(stack[-1], None)
            if target is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            elif target not in state:
                state[target] = 1
                path.append(target)
                stack.append(iter(sorted(graph[target])))


def test_ops_optimizer_and_trainer_never_import_device_code():
    bad = [f"{m} imports {t}" for m, targets in import_graph().items()
           if m.split(".")[1:2] and m.split(".")[1] in NO_DEVICE_CODE
           for t in targets if t.split(".")[1:2] and t.split(".")[1] in ("codegen", "cuda")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", THROUGH_THE_SEAM)
def test_compiler_engine_and_model_import_no_concrete_backend(module):
    bad = sorted(t for t in import_graph()[f"minicavs.{module}"]
                 if t.split(".")[1:2] and t.split(".")[1] in BACKENDS)
    assert not bad, (f"minicavs/{module}.py imports {', '.join(bad)}: look the device up through the seam "
                     "(minicavs.backend.get_device / default_device)")


def test_no_module_is_longer_than_the_limit():
    long = [f"{path.relative_to(PACKAGE.parent)}: {n} lines" for path in sorted(PACKAGE.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split each along its jobs):\n" + "\n".join(long)


def test_no_two_modules_share_a_file_name():
    """A module's file name says what it holds, once in the package (a package's ``__init__`` aside)."""
    names: dict = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, f"modules sharing a file name: {shared}"


def test_the_seam_and_length_checks_fail_on_a_backend_import_and_a_long_module(tmp_path):
    """A lazy import of a backend module is found, and a module one line over the limit is named."""
    pkg = tmp_path / "minicavs"
    (pkg / "cpu").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cpu" / "__init__.py").write_text("")
    (pkg / "cpu" / "planner_library.py").write_text("")
    (pkg / "model.py").write_text("def f():\n    from .cpu import planner_library as planner\n" + "\n" * (MAX_LINES - 1))
    real, globals()["PACKAGE"] = PACKAGE, pkg
    try:
        with pytest.raises(AssertionError, match="minicavs/model.py imports minicavs.cpu.planner_library"):
            test_compiler_engine_and_model_import_no_concrete_backend("model")
        with pytest.raises(AssertionError, match=f"minicavs/model.py: {MAX_LINES + 1} lines"):
            test_no_module_is_longer_than_the_limit()
        (pkg / "model.py").write_text("from . import backend\n" + "\n" * (MAX_LINES - 1))
        (pkg / "backend.py").write_text("")
        test_compiler_engine_and_model_import_no_concrete_backend("model")
        test_no_module_is_longer_than_the_limit()
    finally:
        globals()["PACKAGE"] = real


def test_the_checks_see_lazy_imports_and_cycles(tmp_path):
    """The reader finds an import inside a function, and the cycle check fails on a cycle."""
    pkg = tmp_path / "minicavs"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "graph.py").write_text("def f():\n    from .ops import thing\n")
    (pkg / "ops" / "__init__.py").write_text("from ..graph import f\n")
    real, globals()["PACKAGE"] = PACKAGE, pkg
    try:
        graph = import_graph()
        assert graph["minicavs.graph"] == {"minicavs.ops"}
        with pytest.raises(AssertionError, match="imports minicavs.ops"):
            test_imports_only_point_up_the_layer_list()
        with pytest.raises(pytest.fail.Exception, match="import cycle: minicavs.graph -> minicavs.ops"):
            test_no_import_cycle()
    finally:
        globals()["PACKAGE"] = real
