"""The fused optimizer step on the device (codegen/cuda_optim.py's kernels): every parameter's update in a
constant number of launches, the loss, the global norm and the finite flags in one report read back at once.

:class:`DeviceKernels` is what the CUDA package provides per dtype to the ops and the optimizer (through
``ops.registry.native_kernels``): the row kernels (dropout) and :meth:`DeviceKernels.fused_step`.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..engine.codegen import cuda as gen
from ..engine.codegen import cuda_optim as opt
from .kernels import RowKernels


def address(a) -> int:
    """The device address of an array's first element (CuPy's and the stand-in's arrays alike)."""
    return int(a.__cuda_array_interface__["data"][0])


def segment_table(segments: Sequence[tuple], slots: int, address_of=address) -> np.ndarray:
    """The int64 table of codegen/cuda_optim.py over ``segments`` (see :meth:`DeviceKernels.table`):
    running element offsets, then a row of addresses, layout and flags per segment."""
    width = opt.table_width(slots)
    host = np.zeros(len(segments) + 1 + width * len(segments), np.int64)
    table = host[len(segments) + 1:].reshape(len(segments), width)
    for k, (value, grad, slot_arrays, rows, decay, lazy) in enumerate(segments):
        mode = opt.DENSE if rows is None else opt.LAZY if lazy else opt.ROWS
        host[k + 1] = host[k] + (grad.size if mode == opt.LAZY else value.size)
        table[k, opt.VALUE], table[k, opt.GRAD] = address_of(value), address_of(grad)
        table[k, opt.INDEX] = 0 if rows is None else address_of(rows)
        table[k, opt.COLUMNS] = max(1, math.prod(value.shape[1:]))
        table[k, opt.DECAY], table[k, opt.MODE] = bool(decay), mode
        table[k, opt.COUNT] = 0 if rows is None else len(rows)
        for j, a in enumerate(slot_arrays):
            table[k, opt.SLOT0 + j] = address_of(a)
    return host


class FusedUpdate:
    """One optimizer step over a segment table, checked and not yet applied: :attr:`report` (float64 on the
    device: ``[loss, squared global norm, (gradient not finite, update not finite) per segment]``) is for the
    caller to read in its one device-to-host copy; :meth:`apply` then writes every update in place (one
    launch). Nothing is written before :meth:`apply`."""

    def __init__(self, kernels: "DeviceKernels", rule: str, args: list, total: int):
        self.kernels, self.rule, self.args, self.total = kernels, rule, args, total
        self.report = args[3]

    def apply(self) -> None:
        """Write the checked update (the same arithmetic as the check pass) into every parameter and slot."""
        self.kernels.update(self.rule, self.args[:-1] + [np.int64(1)], self.total)


class DeviceKernels(RowKernels):
    """The native kernels of one float dtype on the device: :class:`RowKernels` and the fused optimizer step."""

    def __init__(self, dtype, launcher=None):
        super().__init__(dtype, launcher)
        self._partial = None   # (stage-one partial sums, stage-two sums), allocated once

    def _sums(self):
        """The norm's partial sums (stage one, stage two): device buffers of a fixed size, made once."""
        if self._partial is None:
            xp = self.launcher.xp
            self._partial = (xp.empty(opt.REDUCE_BLOCKS * gen.BLOCK, np.float64), xp.empty(opt.PARTIALS, np.float64))
        return self._partial

    def table(self, segments: Sequence[tuple], slots: int):
        """The segment table on the device (one host-to-device copy) and its element count. ``segments``:
        (value, gradient, slots, row indices or None, weight decay?, lazy?) per parameter, every array
        C-contiguous of this dtype; a row-sparse gradient is its coalesced rows with their sorted unique int64
        indices, updated lazily or with dense semantics (codegen/cuda_optim.py)."""
        host = segment_table(segments, slots, address)
        return self._copy_table(host), int(host[len(segments)])

    def _copy_table(self, host: np.ndarray):
        """The table's one host-to-device copy a step (addresses of this step's gradients)."""
        return self.launcher.xp.asarray(host)

    def _loss(self, loss, sums) -> list:
        """optim_finish's loss arguments (kind, element-type pointer, float64 pointer, host value): a device
        loss of this dtype or float64 is read where it is (other dtypes as float64), a host one passed by
        value. ``sums`` stands in for the pointers not read."""
        unused = sums.view(self.dtype)[:1]
        if loss is None or isinstance(loss, (int, float, np.generic, np.ndarray)):
            return [np.int64(0), unused, sums, float("nan") if loss is None else float(loss)]
        if loss.dtype == self.dtype:
            return [np.int64(1), loss.reshape(1), sums, 0.0]
        return [np.int64(2), unused, loss.astype(np.float64).reshape(1), 0.0]

    def update(self, rule: str, args: list, total: int) -> None:
        """One launch of ``rule``'s update kernel over ``total`` elements (none for none): the check pass or,
        with ``apply`` (the last argument) set, the writing one."""
        if total:
            name, source = opt.update_kernel(rule, self.dtype)
            self.launcher(source, name, gen.grid(total), gen.BLOCK, args)

    def fused_step(self, rule: str, hyper: Sequence[float], weight_decay: float, clip_norm: float | None,
                   segments: Sequence[tuple], loss) -> FusedUpdate:
        """Check one update of every segment on the device (launches: with clipping the norm's two, then the
        report's one, which finishes the norm, and the check pass's one): returns the :class:`FusedUpdate` whose
        report the caller reads. ``loss``: a device array (read into the report), a float or None."""
        xp, T = self.launcher.xp, self.dtype.type
        slots = len(opt.rule_slots(rule))
        table, total = self.table(segments, slots)
        K = np.int64(len(segments))
        report = xp.empty(2 + 2 * len(segments), np.float64)
        partial, sums = self._sums()
        _, reduce_source = opt.reduce_kernels(self.dtype)
        n_sums = 0
        if clip_norm is not None:
            blocks = min(opt.REDUCE_BLOCKS, gen.grid(total))
            self.launcher(reduce_source, f"optim_sumsq_{self.T}", blocks, gen.BLOCK,
                          [np.int64(total), K, np.int64(opt.table_width(slots)), table, partial])
            self.launcher(reduce_source, f"optim_partials_{self.T}", 1, opt.PARTIALS,
                          [np.int64(blocks * gen.BLOCK), partial, sums])
            n_sums = opt.PARTIALS
        self.launcher(reduce_source, f"optim_finish_{self.T}", 1, 1,
                      [np.int64(n_sums), sums, np.int64(2 * len(segments)), *self._loss(loss, sums), report])
        args = [np.int64(total), K, table, report, float(clip_norm or 0.0), *(T(h) for h in hyper),
                T(weight_decay), np.int64(0)]
        self.update(rule, args, total)
        return FusedUpdate(self, rule, args, total)
