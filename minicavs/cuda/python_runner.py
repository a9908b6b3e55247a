"""The CUDA runner issued from Python, for the programs the C issuing loop (issue.py) declines (a step only
Python runs, a deterministic device's DAG adjoint) or with ``Cuda(issue_from_c=False)``: the reference
runner's opcodes (minicavs/engine/reference.py) over CuPy arrays, so every view, product and row move stays
on the device, with a fused group run by its generated CUDA kernel (the device's kernel object linked into the
program) instead of the expression evaluated op by op, and rows moved by index by the device's row kernels
(gather_rows, scatter_rows, scatter_add or segment sums).

The task table and the instructions stay on the host (they decide which launches are issued); the buffers,
index arrays included, are the device's: a pass copies nothing between host and device per task."""
from __future__ import annotations

import numpy as np

from ..engine import reference
from ..engine.codegen.machine import OPCODES


class DeviceMachine(reference.Machine):
    """The reference machine, rows moved by the device's row kernels (gather_rows, scatter_rows: one launch
    per instruction and task)."""

    def take_rows(self, buf: int, width: int, index_buf: int, col: int, cols: int):
        src = self.rows_of(buf, width)
        host = self.index(index_buf, host=True)
        if not src.shape[0] or not host.size or host.min() < 0 or col < 0 or col + cols > width:
            return super().take_rows(buf, width, index_buf, col, cols)   # (zero rows, errors: the reference's)
        idx = self.checked(index_buf, src.shape[0])
        return self.device.rows(src.dtype).kernels.gather_checked(src[:, col:col + cols], idx)

    def put_rows(self, buf: int, width: int, index_buf: int, col: int, cols: int, values) -> None:
        rows = self.rows_of(buf, width)
        idx = self.checked(index_buf, rows.shape[0])
        if not idx.size or not cols:
            return
        if col < 0 or col + cols > width:
            self.fail(f"columns {col}:{col + cols} of rows of {width}")
        xp = self.xp
        values = xp.ascontiguousarray(values)
        self.device.rows(rows.dtype).kernels.scatter_checked(rows[:, col:col + cols], idx, values)


def op_fused(m: reference.Machine, kernel, nargs, rows, cols, pool) -> None:
    """A fused elementwise group: its generated kernel over the instruction's views (one launch)."""
    fused, ins, outs = reference.fused_operands(m, kernel, nargs, rows, cols, pool)
    if outs:
        fused(ins, list(outs))


def op_adj(m: reference.Machine, buf, width, idx, slot, elide, src, cols) -> None:
    """Gather's adjoint: in a DAG, by index, the device's scatter-add kernel (atomics, or the sorted segment
    sum when the device is deterministic: a vertex with several parents gets its rows summed in a fixed
    order); otherwise as the reference's."""
    start, step = m.view_of_slot(slot)
    if m.forest or (elide and step >= 0):
        reference.op_adj(m, buf, width, idx, slot, elide, src, cols)
        return
    rows = m.rows_of(buf, width)
    m.checked(idx, rows.shape[0])
    m.device.rows(rows.dtype).scatter_add(rows[:, :cols], m.index(idx, host=True), m.matrix(src, m.bs, cols))


# per opcode id: what runs it here (the reference's, except where a device kernel does the work)
OWN = {"FUSED": op_fused, "ADJ": op_adj}
OPERATIONS = [OWN.get(name, reference.OPERATIONS[name]) for name in OPCODES]


class EventStream:
    """The CUDA runner's eager stream: the device's second stream. The host issues every eager chunk's
    launches there first (after an event of the current stream: the inputs it wrote), recording an event
    after each; row t of the main table makes the current stream wait for chunk t's event on the device
    (cudaStreamWaitEvent), not on the host. Nothing crosses between host and device."""

    def __init__(self, device, chunks: int):
        self.device, self.chunks, self.events, self.waited = device, chunks, [], 0

    def start(self, work) -> None:
        cuda = self.device.xp.cuda
        eager = self.device.eager_stream()
        eager.wait_event(cuda.get_current_stream().record())
        with eager:
            work(lambda t: self.events.append(eager.record()))

    def wait(self, t: int) -> None:
        need = min(t + 1, self.chunks)
        if need > self.waited:
            self.device.xp.cuda.get_current_stream().wait_event(self.events[need - 1])
            self.waited = need

    def join(self) -> None:
        self.wait(self.chunks - 1)


def run(lowered, table: np.ndarray, buffers, dtype, forest: bool, device, eager: np.ndarray | None = None,
        check: bool = False) -> dict:
    """Run ``lowered`` over ``table`` on ``device`` (see reference.run; ``eager``'s chunks on the device's
    second stream: :class:`EventStream`)."""
    return reference.run(lowered, table, buffers, dtype, forest, device=device, check=check, operations=OPERATIONS,
                         machine=DeviceMachine, eager=eager, stream=EventStream)
