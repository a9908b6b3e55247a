"""The seam between the engine and a backend: what every backend provides, and array helpers.

The engine, the model and the optimizer only touch arrays through ``backend.xp`` (numpy or CuPy: the ops'
kernels already take the array module as their first argument) and ask the backend for what a backend
must provide: a kernel per fused elementwise group, row-movement kernels, and its runner of a bound batch
program (``run``: it receives the :class:`BatchProgram <minicavs.engine.program.BatchProgram>`, every buffer
already resolved into :class:`Operand` entries; streaming, the runner runs the eager chunks on its second stream).
The seam names no runner: the engine runs the reference runner itself where a device's runner declines. Two
implementations: :data:`minicavs.cpu.CPU` (numpy, generated C kernels, a worker
thread as the second stream) and :class:`minicavs.cuda.Cuda` (CuPy, generated CUDA kernels, two CUDA streams;
``Cuda(launcher=minicavs.cuda.emulation.Launcher())`` runs the same CUDA sources on the CPU over the device
stand-in's arrays (cuda/standin.py), which refuse every host/device crossing CuPy refuses: how the whole CUDA
path of a training step is checked on machines without a GPU). This module knows neither.

Data crosses between host and device only here: :meth:`Backend.to_device` and :meth:`Backend.to_host` (and
the device's own ``asarray``/``get`` where a kernel launcher needs them); the stand-in counts each crossing.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Sequence

import numpy as np

from ..core.arrays import array_module, on_device  # noqa: F401  (the seam's view of arrays)
from .codegen.machine import OPS
from .passes.fusion import FusedGroup  # noqa: F401  (a plain data type the seam hands the backends)


class Operand:
    """One buffer of a bound pass, resolved once by the binder (program.bind) for every runner: its array as the
    runners address it (C-contiguous; a static read transposed is its contiguous transpose with ``transposed``
    set; a column block of a planned parameter buffer is the span of memory it covers, read at ``ld``), the elements the
    pass may touch, the row stride, and for index arrays and the dropout table their host copy (``array`` is
    then the device's). ``kind`` is the buffer key's first item (``static``, ``tensor``, ``child``, ...)."""

    __slots__ = ("kind", "array", "elements", "ld", "transposed", "host", "source", "__weakref__")

    def __init__(self, kind: str, array, elements: int, ld: int, transposed: int = 0, host=None, source=None):
        self.kind, self.array, self.elements, self.ld, self.transposed = kind, array, elements, ld, transposed
        self.host = host
        self.source = source   # the array the binder was given (a runner's policy may lay it out otherwise)

    def __repr__(self) -> str:
        shape = getattr(self.array, "shape", None)
        return (f"Operand({self.kind}, shape {shape}, {self.elements} elements, ld {self.ld}"
                + (", transposed" if self.transposed else "") + ")")


class Backend:
    """The protocol, with the parts both backends share. A backend has ``name``, ``xp`` (its array module),
    ``deterministic`` (same bits on every run) and the methods below."""

    name = "backend"
    deterministic = True
    xp = np
    runner_name = "reference runner"   # who runs a lowered program here (dump() says it)
    tf32_products = False   # whether float32 products may read TF32 inputs here (engine.tf32; CUDA's)
    # Rows of a product by a wide static that the runner may compute as a transposed product in scratch past the
    # pass's own (the C runner's twins): the binder reserves min(rows, this) x the widest static's columns
    spare_product_rows = 0

    def __repr__(self) -> str:
        return f"<device {self.description}>"

    @property
    def description(self) -> str:
        """The device in words, as run logs and results name it."""
        return self.name

    def asarray(self, a, dtype=None):
        """``a`` as an array of this backend (no copy if it already is one)."""
        return self.xp.asarray(a, dtype)

    def to_device(self, a):
        """A host array's values on this device: a host-to-device copy (none on the CPU)."""
        return self.xp.asarray(a)

    def to_host(self, a) -> np.ndarray:
        """A device array's values in host memory: a device-to-host copy (none on the CPU)."""
        return to_host(a)

    def fused(self, groups: Sequence[FusedGroup]) -> list:
        """One kernel per group (``kernel(arrays, outs)``), None where the group stays unfused."""
        raise NotImplementedError

    def rows(self, dtype):
        """Row kernels for ``dtype``: ``scatter_add(dst, idx, src)`` adds repeated indices in row order."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until every kernel issued so far has finished."""

    def keep_freed_memory(self) -> bool:
        """Tune this process's host allocator for training (the same large arrays freed and allocated at every
        step); True if settings were applied. By default nothing to tune."""
        return False

    @contextlib.contextmanager
    def opcode_clock(self):
        """Within the ``with``, this device's runner adds the nanoseconds each opcode took (and in all, last)
        into the yielded int64 array, one entry per opcode of ``codegen.machine.OPS``; a runner without a
        clock leaves it zero. Profiling (``minicavs bench``'s breakdown), not for training."""
        yield np.zeros(len(OPS) + 1, np.int64)

    def index(self, rows: np.ndarray):
        """A host index array (row numbers of a batch plan) as this device's array: the binder hands runners
        both. None is copied on the CPU."""
        return rows

    def second_stream(self, chunks: int):
        """The reference runner's eager stream on this device (``start(work)``, ``wait(t)``, ``join()``), or None:
        a host thread (reference.ThreadStream)."""
        return None

    def runner_missing(self, dtype) -> str | None:
        """Why this device's runner cannot run a program of ``dtype`` here (None: it can)."""
        return None

    def runner_declines(self, program) -> str | None:
        """Why this device's runner leaves the bound ``program`` to the reference runner on this device (None:
        it runs it; a runner may decline opcodes it does not implement)."""
        return self.runner_missing(program.dtype) or "no runner of its own"

    def run(self, program) -> None:
        """Run the bound ``program`` (a pass: its blocks and tasks, over its resolved operands) with this
        device's runner, adding into ``program.gradients`` (and, streaming, ``program.bound.eager_gradients``)."""
        raise NotImplementedError


_PLANNER: list = []   # [get() -> the compiled batch planner (engine/planner.py) | None], once a backend provided it


def provide_planner(get) -> None:
    """Register ``get()``, the compiled batch planner or None without a C compiler (the CPU backend does)."""
    _PLANNER[:] = [get]


def planner_library():
    """The provided planner library (see engine/planner.py), or None (no provider, or no C compiler)."""
    return _PLANNER[0]() if _PLANNER else None


def to_host(a) -> np.ndarray:
    """A numpy array of ``a``'s values, wherever it lives (a device-to-host copy only when it lives on a
    device: one of the crossings the stand-in counts)."""
    return a.get() if on_device(a) else np.asarray(a)


# The backends by name: the module that makes each, imported when first asked for (so the layers above the seam
# name a device without importing its code).
DEVICES = {"cpu": "minicavs.cpu", "cuda": "minicavs.cuda"}


def get_device(name: "str | Backend", deterministic: bool = False) -> Backend:
    """``cpu`` or ``cuda`` (or a backend, returned as is); ``cuda`` needs CuPy and a GPU (CudaUnavailable).
    ``deterministic``: CUDA sums a DAG child's gradient rows in a fixed order (see ``minicavs.cuda.Cuda``)."""
    if isinstance(name, Backend):
        return name
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    module = importlib.import_module(DEVICES[name])
    if name == "cpu":
        return module.CPU
    return module.Cuda(deterministic=deterministic)   # (CudaUnavailable from the launcher without CuPy or a GPU)


def emulated_cuda() -> Backend:
    """The CUDA backend without a GPU: its generated CUDA sources run on the CPU through the emulation, over the
    device stand-in's arrays (``Cuda(launcher=emulation.Launcher())``): what a benchmark checks the device's
    values with where no GPU is lent (a correctness check: it says nothing of a GPU's speed); needs g++."""
    module = importlib.import_module(DEVICES["cuda"])
    return module.Cuda(importlib.import_module(DEVICES["cuda"] + ".emulation").Launcher())


@functools.cache
def default_device() -> Backend:
    """The CPU: where a run goes when no device is named."""
    return get_device("cpu")
