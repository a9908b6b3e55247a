"""The CPU backend: numpy arrays, fused groups as generated C kernels (compiled by :mod:`.compiler`), the
hand-written C library (:mod:`.library`) and a worker thread as the eager stream (:mod:`.streams`)."""
from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np

from ..engine.backend import OPS, Backend, FusedGroup, provide_planner
from ..ops.registry import provide_native_kernels
from ..runtime.frontier import provide_native_schedule
from . import c_runner as runner, compiler, planner_library as planner
from .frontier_kernel import frontier_kernel
from .heap import keep_freed_memory
from .library import library


class CpuBackend(Backend):
    """numpy arrays, fused groups as generated C kernels, eager work on a worker thread."""

    name = "cpu"
    deterministic = True
    runner_name = "C runner"
    spare_product_rows = runner.SMALL_M_ROWS   # (the C runner's transposed products by a static's twin)

    def __init__(self):
        self.xp = np
        self.clock: np.ndarray | None = None   # the C runner adds ns per opcode into it (opcode_clock)

    def fused(self, groups: Sequence[FusedGroup]) -> list:
        """One kernel per group (``kernel(arrays, outs)``), None where the group stays unfused."""
        return compiler.build(list(groups)) if groups else []

    def rows(self, dtype):
        """Row kernels for ``dtype``: ``scatter_add(dst, idx, src)`` adds repeated indices in row order."""
        return compiler.row_kernels(dtype)

    def runner_missing(self, dtype) -> str | None:
        """Why the C runner cannot run here (no compiler or BLAS), None when it can."""
        return runner.available(dtype)

    def runner_declines(self, program) -> str | None:
        """Why the C runner leaves ``program`` to the reference runner (None: it runs it)."""
        return runner.declines(program)

    def run(self, program) -> None:
        """The C runner (:mod:`.c_runner`): one C call runs the pass (streaming: a second one, on the eager
        thread, runs the eager stream's table ahead of the tasks)."""
        runner.run(program, self.clock)

    def synchronize(self) -> None:
        """Wait until every kernel issued so far has finished (nothing to wait for on the CPU)."""

    def keep_freed_memory(self) -> bool:
        """glibc's malloc settings that keep a step's freed pages for the next step (:mod:`.heap`)."""
        return keep_freed_memory()

    @contextlib.contextmanager
    def opcode_clock(self):
        """The C runner's clock: its calls add each opcode's nanoseconds (and in all, last) while the block
        runs."""
        clock = np.zeros(len(OPS) + 1, np.int64)
        before, self.clock = self.clock, clock
        try:
            yield clock
        finally:
            self.clock = before


CPU = CpuBackend()

provide_native_kernels("numpy", library)
provide_native_schedule(frontier_kernel)
provide_planner(planner.planner)
