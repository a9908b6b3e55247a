"""The public API: the names ``minicavs`` exports at its top level. This list is the stability contract: a
refactor may move any module, but every name here stays importable from ``minicavs`` as the same object.
Changing the list is a decision to record here, not a side effect."""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import minicavs

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = {
    # declaring a model
    "ops": "minicavs.ops", "VertexFunction": "minicavs.runtime.vertex", "InputGraph": "minicavs.runtime.inputs",
    "Structure": "minicavs.engine.model", "Model": "minicavs.engine.model",
    "leaf_internal": "minicavs.engine.model", "by_child_count": "minicavs.engine.model",
    "Parameter": "minicavs.nn", "ParameterSet": "minicavs.nn",
    # running it
    "RunContext": "minicavs.engine.executor", "EngineOptions": "minicavs.engine.compile",
    "explain": "minicavs.engine.explain", "check": "minicavs.engine.explain",
    # training
    "Optimizer": "minicavs.train.optim", "SGD": "minicavs.train.optim", "Adagrad": "minicavs.train.optim",
    "Adam": "minicavs.train.optim", "Task": "minicavs.train.task", "Trainer": "minicavs.train.trainer",
    # static graphs and autodiff
    "Graph": "minicavs.ir.graph", "Node": "minicavs.ir.graph", "Executor": "minicavs.engine.executor",
    "run": "minicavs.engine.executor", "grad": "minicavs.ops.autodiff", "float32": "minicavs.core.dtypes",
    "float64": "minicavs.core.dtypes", "int32": "minicavs.core.dtypes", "int64": "minicavs.core.dtypes",
    # errors
    "MinicavsError": "minicavs.core.errors", "ShapeError": "minicavs.core.errors",
    "FeedError": "minicavs.core.errors", "NonFiniteError": "minicavs.core.errors",
    "CheckpointError": "minicavs.core.errors", "InputGraphError": "minicavs.core.errors",
    "DataError": "minicavs.core.errors", "RunDirError": "minicavs.core.errors",
    "ConfigError": "minicavs.train.config",
    # exported models (issue 49): the public way to run a .mcav file
    "load": "minicavs.train.artifact",
    "set_blas_threads": "minicavs.cpu.blas_threads",
"__version__": None,
}


def test_the_public_names_are_exactly_these():
    assert len(minicavs.__all__) == len(set(minicavs.__all__))
    assert sorted(minicavs.__all__) == sorted(PUBLIC)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_name_resolves_to_its_definition(name):
    value = getattr(minicavs, name)
    home = PUBLIC[name]
    if home is None:
        assert isinstance(value, str)
    elif name == "ops":
        assert value is importlib.import_module(home)
    else:
        assert value is getattr(importlib.import_module(home), name)
    assert name in dir(minicavs)


def test_star_import_gives_the_public_names():
    namespace: dict = {}
    exec("from minicavs import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(PUBLIC)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Trainr'"):
        minicavs.Trainr  # noqa: B018
    assert not hasattr(minicavs, "Trainr")


def test_import_stays_light():
    """The trainer, configs and YAML load on first use of a name that needs them, not with ``import
    minicavs`` (eager, they would add about 100 ms of the 150 ms an import takes)."""
    code = ("import sys, minicavs; heavy = [m for m in ('minicavs.train.trainer', 'minicavs.train.config', "
            "'minicavs.train.rundir', 'yaml') if m in sys.modules]; print(heavy); minicavs.Trainer; "
            "print('minicavs.train.trainer' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.split() == ["[]", "True"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module} | \
           {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}


def test_the_example_imports_minicavs_from_its_top_level_only():
    used = {m for m in _imports(ROOT / "examples" / "custom_tree_model.py") if m.startswith("minicavs")}
    assert used == {"minicavs"}
