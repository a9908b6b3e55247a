"""The CPU backend: numpy arrays, fused groups as generated C kernels (compiled by :mod:`.compiler`), the
hand-written C library (:mod:`.library`) and a worker thread as the eager stream (:mod:`.streams`)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..backend import Backend
from ..frontier import provide_native_schedule
from ..ops.registry import provide_native_kernels
from ..passes.fusion import FusedGroup
from ..planner import provide_library
from . import c_runner as runner, compiler, planner_library as planner
from .frontier_kernel import frontier_kernel
from .library import library


class CpuBackend(Backend):
    """numpy arrays, fused groups as generated C kernels, eager work on a worker thread."""

    name = "cpu"
    deterministic = True
    runner_name = "C runner"

    def __init__(self):
        self.xp = np

    def fused(self, groups: Sequence[FusedGroup]) -> list:
        """One kernel per group (``kernel(arrays, outs)``), None where the group stays unfused."""
        return compiler.build(list(groups)) if groups else []

    def rows(self, dtype):
        """Row kernels for ``dtype``: ``scatter_add(dst, idx, src)`` adds repeated indices in row order."""
        return compiler.row_kernels(dtype)

    def take(self, buf, rows: np.ndarray):
        """``buf[rows]`` (a gather or pull: all rows of a task at once); ``rows`` is a host index array."""
        return np.take(buf, rows, axis=0)

    def runner_missing(self, dtype) -> str | None:
        """Why the C runner cannot run here (no compiler or BLAS), None when it can."""
        return runner.available(dtype)

    def runner_declines(self, lowered, dtype) -> str | None:
        """Why the C runner leaves ``lowered`` to the reference runner (None: it runs it)."""
        return runner.declines(lowered, dtype)

    def run_program(self, lowered, table: np.ndarray, buffers, dtype, forest: bool, workspace=None,
                    eager: np.ndarray | None = None, check: bool = False) -> dict:
        """The C runner (:mod:`.c_runner`): one C call runs the pass (``eager``: a second one, on the eager
        thread, runs the eager stream's table ahead of the tasks)."""
        return runner.run(lowered, table, buffers, dtype, forest, workspace, eager, check)

    def put(self, dst, rows: np.ndarray, src) -> None:
        """``dst[rows] = src`` for distinct ``rows`` (a push, a child's gradient in a forest)."""
        dst[rows] = src

    def synchronize(self) -> None:
        """Wait until every kernel issued so far has finished (nothing to wait for on the CPU)."""


CPU = CpuBackend()

provide_native_kernels("numpy", library)
provide_native_schedule(frontier_kernel)
provide_library(planner.planner)
