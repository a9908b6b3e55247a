"""minicavs: a from-scratch implementation of Cavs, the vertex-centric runtime for dynamic neural networks.

The names in :data:`__all__` are the public API: what a model, a training script or a notebook imports, all
from ``minicavs`` itself (``from minicavs import VertexFunction, Structure, Model, ops``).
``tests/test_public_api.py`` holds this exact list, so a refactor that moves a module keeps every name here.
The names whose modules cost time to import (the trainer reads YAML, configs and run directories) are loaded
on first use, so ``import minicavs`` stays as fast as its core; everything else under ``minicavs.*`` is
internal and may move.
"""
from __future__ import annotations

import importlib

from . import ops  # noqa: F401  (registers every op)
from . import cpu  # noqa: F401  (the default backend: provides the C kernels the ops and optimizers use)
from .core.dtypes import float32, float64, int32, int64  # noqa: F401
from .core.errors import (CheckpointError, DataError, FeedError, InputGraphError, MinicavsError,  # noqa: F401
                          NonFiniteError, RunDirError, ShapeError)
from .engine.executor import Executor, RunContext, run  # noqa: F401
from .engine.explain import check, explain  # noqa: F401  (eager: the function, not the module, is minicavs.explain)
from .ir.graph import Graph, Node  # noqa: F401
from .ops import control  # noqa: F401  (cond, foreach, while_loop: registers their ops)
from .ops.autodiff import grad  # noqa: F401

__version__ = "0.1.0"

# name -> the module that defines it, imported on first access (PEP 562)
_LAZY = {
    "VertexFunction": "runtime.vertex",
    "InputGraph": "runtime.inputs",
    "Structure": "engine.model", "Model": "engine.model", "leaf_internal": "engine.model",
    "by_child_count": "engine.model",
    "EngineOptions": "engine.compile",
    "Parameter": "nn", "ParameterSet": "nn",
    "Optimizer": "train.optim", "SGD": "train.optim", "Adagrad": "train.optim", "Adam": "train.optim",
    "Task": "train.task",
    "Trainer": "train.trainer",
    "ConfigError": "train.config",
    "load": "train.artifact",
    "set_blas_threads": "cpu.blas_threads",
}

__all__ = [
    # declaring a model: vertex functions (F), input graphs (G), structures and the model around them
    "ops", "VertexFunction", "InputGraph", "Structure", "Model", "leaf_internal", "by_child_count",
    "Parameter", "ParameterSet",
    # running it: one batch, its options, what the batching did
    "RunContext", "EngineOptions", "explain", "check",
    # training: optimizers, the trainer and the model interface it drives
    "Optimizer", "SGD", "Adagrad", "Adam", "Task", "Trainer",
    # static graphs and autodiff
    "Graph", "Node", "Executor", "run", "grad", "float32", "float64", "int32", "int64",
    # errors (every user error is a MinicavsError)
    "MinicavsError", "ShapeError", "FeedError", "NonFiniteError", "CheckpointError", "InputGraphError",
    "DataError", "RunDirError", "ConfigError",
    # exported models (.mcav): load one and predict, without the model's Python module
    "load",
    # how many threads numpy's BLAS (the CPU's products) computes with, set in a running process
    "set_blas_threads",
    "__version__",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'minicavs' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value   # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
