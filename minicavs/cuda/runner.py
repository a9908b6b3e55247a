"""The CUDA runner of a lowered batch program: the reference runner's opcodes (minicavs/reference.py) over
CuPy arrays, so every view, product and row move stays on the device, with a fused group run by its generated
CUDA kernel (the device's kernel object linked into the program) instead of the expression evaluated op by op.

The task table and the instructions stay on the host (they decide which launches are issued); the buffers,
index arrays included, are the device's: a pass copies nothing between host and device per task."""
from __future__ import annotations

import numpy as np

from .. import reference
from ..codegen.native import OPCODES


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


def run(lowered, table: np.ndarray, resolve, dtype, forest: bool, device) -> dict:
    """Run ``lowered`` over ``table`` on ``device`` (see reference.run)."""
    return reference.run(lowered, table, resolve, dtype, forest, device=device, operations=OPERATIONS)
