"""What a runner's dispatch alone costs: a program of NOPs over a few tasks (the per-instruction overhead of a
runner's loop, which the fast path's instruction counts multiply)."""
from __future__ import annotations

import time

import numpy as np

from ..engine import instructions
from ..engine.program import BatchProgram


def nop_program(count: int) -> instructions.Lowered:
    """A one-kind program of ``count`` NOPs: what the C interpreter's dispatch alone costs."""
    t = instructions.Template("nop")
    for _ in range(count):
        t.emit("NOP")
    code = np.zeros((count, instructions.WIDTH), np.int64)
    return instructions.Lowered("nop", [0], [t], code, np.zeros(1, np.int64), np.array([[0, count]], np.int64), [("scratch",)],
                   np.zeros(1, np.int64), 1, 0)


class _Arenas:
    """The buffers of a NOP program: its scratch and fixed arenas."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __getitem__(self, key: tuple):
        return np.empty(max(1, key[2]), self.dtype)


def dispatch_ns(device, count: int = 100_000, tasks: int = 10, repeats: int = 5, dtype=np.float32) -> float:
    """Nanoseconds per instruction of ``device``'s runner's dispatch loop (the best of ``repeats`` runs of
    ``tasks`` tasks over a program of ``count`` NOPs)."""
    program = nop_program(count)
    table = np.full((tasks, instructions.TASK_COLUMNS), -1, np.int64)
    table[:, 0], table[:, 1], table[:, 2], table[:, 3] = 0, 0, 1, 0
    bound = BatchProgram.of(program, table, _Arenas(dtype), dtype, device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        device.run(bound)
        best = min(best, time.perf_counter() - t0)
    return best / (count * tasks) * 1e9
