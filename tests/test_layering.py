"""The package's folders are its layers (DESIGN.md's list, bottom to top): the base types, the IR, the vertex
runtime, the engine, the backends, the training product. A module imports only modules of its own layer or of
layers below it (within a layer, only from its own line of the list or lines below: ``ir`` below ``ops``, so the
IR never reaches up into the ops that build its nodes; ``data`` below ``train``), nothing imports a backend but
the seam, and no import cycle exists. Every import is read from the source, those inside functions included,
so a lazy import cannot hide an upward edge."""
from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minicavs"

# The layers bottom to top: each names its folders, then its lines bottom to top, each line the modules (a path
# below minicavs/: a folder stands for all its modules) that may import one another and anything on a line or in
# a layer below. ``""`` is the package's own __init__ (its public face), on top.
LAYERS = [
    ("base", ["core"], [
        ["core/dtypes", "core/errors", "core/random", "core/atomic", "core/arrays", "core/wording", "core/limits",
         "core/onetime"],
        ["core/validate"],
        ["core/sparse"]]),
    ("IR", ["ir", "ops"], [             # one layer, one direction: ops build nodes, ir never imports ops
        ["ir"],                          # Node and Graph as plain data
        ["ops"],                         # the op registry: per op its shapes, kernels, gradient, fusion
        ["ops/autodiff", "ops/subgraph"],   # gradients; closed bodies and the items of several results
        ["ops/control", "ops/cond", "ops/row_steps", "ops/flow", "ops/loop_grad", "ops/hoist", "ops/cond_grad"],
        # cond, foreach, while_loop as operators (they differentiate their bodies); a per-row trip count's steps;
        # what such a node holds, for its readers; a loop's and a cond's gradient from saved values
        ["ops/serialize"]]),             # nodes, graphs and bodies as data (model artifacts)
    ("vertex runtime", ["runtime"], [
        ["runtime/vertex", "runtime/inputs"],
        ["runtime/frontier", "runtime/fsm", "runtime/scheduler"],   # batching policies and their simulation
        ["runtime/memory"]]),
    ("engine", ["engine"], [
        ["engine/passes"],               # classification, fusion grouping, aliasing, GEMM merging, layout
        ["engine/codegen"],              # strings only: C and CUDA sources
        ["engine/backend", "engine/reference", "engine/reference_flow", "engine/planner", "engine/operands"],
        # the seam; the reference runner beside it (its control-flow opcodes apart); the binder of a pass's
        # buffers into the seam's Operands
        ["engine/compile"],
        ["engine/lowered"],              # templates and the linked program: the data the runners read
        ["engine/branches", "engine/row_trips"],   # a cond in F lowered as a branch (by instructions' step
        # lowering); a static graph's loop with a trip count per row lowered as masks
        ["engine/loops"],                # a foreach in F lowered as a loop (its body inlined as a branch's)
        ["engine/instructions", "engine/program", "engine/executor", "engine/alg1", "engine/explain"],
        ["engine/static_branches"],      # a static graph's cond as a branch of its program
        ["engine/static_loops"],         # a static graph's loops and their int inputs in its program
        ["engine/static_sparse"],        # what the host pairs or gathers for a static program (no op evaluated)
        ["engine/static_program"],       # a static graph lowered as a program (by instructions' step lowering)
        ["engine/linked_head"],          # the static graph on top of a structure linked into F's program
        ["engine/model"]]),
    ("backends", ["cpu", "cuda"], [
        ["cpu"],
        ["cuda"]]),                      # the CUDA issuing loop is C, compiled by the CPU backend's compiler
    ("training product", ["nn", "data", "train", "bench"], [
        ["nn"],
        ["data"],
        ["train", "__main__", ""],
        ["bench"]]),
]
# Device-specific code stays behind the seam: these never import generated sources or the CUDA backend.
NO_DEVICE_CODE = ("ops", "train", "core", "data")
# The backends, reached from above only through the seam (``minicavs.engine.backend.get_device`` /
# ``default_device`` import a device's package by name); the package's __init__ imports the CPU backend so that
# its C kernels are registered with the op registry before anything runs.
BACKENDS = ("cpu", "cuda")
MAY_IMPORT_A_BACKEND = ("minicavs",)
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


def position(module: str) -> tuple[int, int]:
    """(layer, line) of a module: the most specific path of the list that holds it."""
    path = "/".join(module.split(".")[1:])
    best = None
    for layer, (_, folders, lines) in enumerate(LAYERS):
        if path in folders:
            best = (0, layer, 0)   # a folder's __init__ not listed itself: the layer's bottom line
        for line, units in enumerate(lines):
            for unit in units:
                if path == unit or path.startswith(unit + "/") or (unit == "" and path == ""):
                    if best is None or len(unit) > best[0]:
                        best = (len(unit), layer, line)
    if best is None:
        raise AssertionError(f"{module} is in no layer: place it in tests/test_layering.py")
    return best[1], best[2]


def layer_of(module: str) -> int:
    return position(module)[0]


def test_every_module_has_a_layer():
    assert len(modules()) > 50, PACKAGE
    for name in modules():
        layer_of(name)


def test_every_import_names_a_module_of_the_package():
    missing = [f"{m}: {t}" for m, targets in import_graph().items() for t in sorted(targets)
               if t.startswith("missing module")]
    assert not missing, "\n".join(missing)


def test_every_layer_is_its_folders():
    """Each layer's lines name only modules inside its folders, and every folder of the package is a layer's."""
    for name, folders, lines in LAYERS:
        for unit in (u for line in lines for u in line if u not in ("", "__main__")):
            assert unit.split("/")[0] in folders, f"{unit} is listed in the {name} layer but not in its folders"
    layered = {f for _, folders, _ in LAYERS for f in folders}
    on_disk = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"models"}
    assert on_disk <= layered, f"folders in no layer: {sorted(on_disk - layered)}"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules outside the layers' folders: {loose}"


def test_imports_only_point_up_the_layer_list():
    upward = [f"{m} {position(m)} imports {t} {position(t)}"
              for m, targets in import_graph().items() for t in sorted(targets)
              if not t.startswith("missing module") and position(t) > position(m)]
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
           for t in targets if t.startswith(("minicavs.engine.codegen", "minicavs.cuda"))]
    assert not bad, "\n".join(bad)


def test_nothing_above_the_backends_imports_them():
    bad = sorted(f"{m} imports {t}" for m, targets in import_graph().items()
                 if m not in MAY_IMPORT_A_BACKEND and m.split(".")[1:2] and m.split(".")[1] not in BACKENDS
                 for t in targets if t.split(".")[1:2] and t.split(".")[1] in BACKENDS)
    assert not bad, ("\n".join(bad) + "\nlook the device up through the seam "
                     "(minicavs.engine.backend.get_device / default_device)")


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


@contextlib.contextmanager
def _checking(tmp_path, *folders: str):
    """The checks of this file pointed at a throwaway ``minicavs`` package with ``folders`` (empty packages)."""
    pkg = tmp_path / "minicavs"
    for folder in folders:
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    real, globals()["PACKAGE"] = PACKAGE, pkg
    try:
        yield pkg
    finally:
        globals()["PACKAGE"] = real


def test_the_seam_and_length_checks_fail_on_a_backend_import_and_a_long_module(tmp_path):
    """A lazy import of a backend module is found, and a module one line over the limit is named."""
    with _checking(tmp_path, "cpu", "engine") as pkg:
        (pkg / "__init__.py").write_text("from . import cpu\n")
        (pkg / "cpu" / "planner_library.py").write_text("")
        (pkg / "engine" / "model.py").write_text("def f():\n    from ..cpu import planner_library as planner\n"
                                                 + "\n" * (MAX_LINES - 1))
        with pytest.raises(AssertionError, match="minicavs.engine.model imports minicavs.cpu.planner_library"):
            test_nothing_above_the_backends_imports_them()
        with pytest.raises(AssertionError, match=f"minicavs/engine/model.py: {MAX_LINES + 1} lines"):
            test_no_module_is_longer_than_the_limit()
        (pkg / "engine" / "model.py").write_text("from . import backend\n" + "\n" * (MAX_LINES - 1))
        (pkg / "engine" / "backend.py").write_text("")
        test_nothing_above_the_backends_imports_them()
        test_no_module_is_longer_than_the_limit()


def test_the_checks_see_lazy_imports_cycles_and_loose_modules(tmp_path):
    """The reader finds an import inside a function, the cycle check fails on a cycle, and a module outside
    the layers' folders is named."""
    with _checking(tmp_path, "ops", "ir") as pkg:
        (pkg / "ir" / "graph.py").write_text("def f():\n    from ..ops import thing\n")
        (pkg / "ops" / "__init__.py").write_text("from ..ir.graph import f\n")
        graph = import_graph()
        assert graph["minicavs.ir.graph"] == {"minicavs.ops"}
        with pytest.raises(AssertionError, match="imports minicavs.ops"):
            test_imports_only_point_up_the_layer_list()
        with pytest.raises(pytest.fail.Exception, match="import cycle: minicavs.ir.graph -> minicavs.ops"):
            test_no_import_cycle()
        test_every_layer_is_its_folders()
        (pkg / "graph.py").write_text("")
        with pytest.raises(AssertionError, match="modules outside the layers' folders: .'graph.py'."):
            test_every_layer_is_its_folders()


# What the backends may import of the engine (DESIGN.md: "the backends know the seam's protocol and the plain data
# types it hands them, never the engine's modules"): the seam (its protocol, Operand, FusedGroup, the opcode
# numbering, the planner's hook), and the generated sources they compile (codegen: strings only, the rendering of
# the opcode table).
BACKEND_MAY_IMPORT_OF_THE_ENGINE = ("minicavs.engine.backend", "minicavs.engine.codegen")


def test_backends_import_of_the_engine_only_the_seam_and_the_sources():
    bad = sorted(f"{m} imports {t}" for m, targets in import_graph().items()
                 if m.split(".")[1:2] and m.split(".")[1] in BACKENDS
                 for t in targets if t.startswith("minicavs.engine")
                 and not any(t == a or t.startswith(a + ".") for a in BACKEND_MAY_IMPORT_OF_THE_ENGINE))
    assert not bad, "\n".join(bad) + "\na backend receives the bound program through Backend.run"


def test_the_seam_names_no_runner():
    """engine/backend.py imports no runner (the reference runner is the engine's to call where a device's
    runner declines) and nothing of the engine but the passes' plain data and the sources' opcode table."""
    seam = import_graph()["minicavs.engine.backend"]
    assert "minicavs.engine.reference" not in seam
    assert {t for t in seam if t.startswith("minicavs.engine")} <= {
        "minicavs.engine.codegen.machine", "minicavs.engine.passes.fusion"}, seam


def test_the_order_fails_on_the_ir_importing_ops_and_data_importing_train(tmp_path):
    """The two one-way rules within a layer: any ir module importing ops (even lazily) and any data module
    importing train are upward imports; the reverse directions are not."""
    with _checking(tmp_path, "ir", "ops", "data", "train") as pkg:
        (pkg / "ops" / "control.py").write_text("from ..ir.graph import Node\n")
        (pkg / "ir" / "graph.py").write_text("")
        (pkg / "train" / "config.py").write_text("from ..data import text\n")
        (pkg / "data" / "text.py").write_text("")
        test_imports_only_point_up_the_layer_list()
        (pkg / "ir" / "autodiff.py").write_text("def grad():\n    from ..ops.registry import OPS\n")
        (pkg / "ops" / "registry.py").write_text("")
        with pytest.raises(AssertionError, match="minicavs.ir.autodiff .* imports minicavs.ops.registry"):
            test_imports_only_point_up_the_layer_list()
        (pkg / "ir" / "autodiff.py").unlink()
        (pkg / "data" / "datasets.py").write_text("from ..train.config import data_root\n")
        with pytest.raises(AssertionError, match="minicavs.data.datasets .* imports minicavs.train.config"):
            test_imports_only_point_up_the_layer_list()
