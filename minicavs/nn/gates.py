"""Gate pre-activations of an LSTM-style cell, written fused (one product per operand for all gates) or
naive (one product per gate and operand, one bias per gate): ``model.cell: naive`` on the bundled models.

The naive cell's parameters are the fused cell's weight blocks (:meth:`ParameterSet.split`: ``W.i`` is
``W``'s first gate block, same initial value), so both compute the same numbers. The naive cell runs as the
fused one only through the compiler: the GEMM-merging pass (passes/gemm.py) merges its per-gate products,
and the layout pass (passes/layout.py) makes their merged weights views of one buffer, the fused weight,
once :meth:`Model.plan_buffers <minicavs.engine.model.Model.plan_buffers>` has laid the parameters out (a
Trainer does when built; with a model of your own, call it before taking arrays from the parameters).
"""
from __future__ import annotations

from typing import Sequence

from .. import ops
from ..ir.graph import Node

CELLS = ("fused", "naive")


def gate_values(p, gates: str, terms: Sequence[tuple], bias: str | None, naive: bool) -> list[Node]:
    """The gates' pre-activations ``sum_k x_k·W_k + b``, one per letter of ``gates``: ``terms`` are
    (x_k, the name of W_k); fused, one product per term split into the gates; naive, one product per gate
    and term over the parameters ``W_k.<gate>`` and ``bias.<gate>`` (made by :func:`split_gates`)."""
    if not naive:
        (x, W), rest = terms[0], terms[1:]
        total = ops.linear(x, p[W].node, p[bias].node) if bias is not None else x @ p[W].node
        for x, W in rest:
            total = total + x @ p[W].node
        return list(ops.split(total, len(gates)))
    out = []
    for g in gates:
        (x, W), rest = terms[0], terms[1:]
        total = ops.linear(x, p[f"{W}.{g}"].node, p[f"{bias}.{g}"].node) if bias is not None \
            else x @ p[f"{W}.{g}"].node
        for x, W in rest:
            total = total + x @ p[f"{W}.{g}"].node
        out.append(total)
    return out


def split_gates(p, gates: str, names: Sequence[str]) -> None:
    """Replace each parameter of ``names`` by its per-gate blocks ``name.<gate>`` (the naive cell's)."""
    for name in names:
        p.split(name, list(gates))
