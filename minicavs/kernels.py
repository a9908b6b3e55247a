"""Lowering a phase's program to steps: each fused elementwise group (passes/fusion.py) becomes one generated
C kernel (codegen/c.py) that reads strided views and can write straight into a dynamic tensor's rows.

A program is a list of steps ``(node, impl, inputs, attrs, needs_ctx)`` run in order by the engine; a fused
step has the group's output as node and its external inputs as inputs, so the engine runs it like any op.
Groups a kernel cannot index, and every group when there is no C compiler, stay as their unfused nodes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .codegen import c as cgen
from .passes.fusion import FusedGroup, fuse


class FusedStep:
    """The impl of a fused step: ``step(xp, *arrays, out=None)`` like an op's impl, plus ``out``."""

    __slots__ = ("kernel", "group")

    def __init__(self, kernel: cgen.Kernel, group: FusedGroup):
        self.kernel = kernel
        self.group = group

    def __call__(self, xp, *arrays, out: np.ndarray | None = None) -> np.ndarray:
        return self.kernel(arrays, out)

    def __repr__(self) -> str:
        return f"<fused {' '.join(n.op for n in self.group.nodes)}>"


def lower(programs: Sequence[list], keep: set) -> tuple[list[list], list[list[FusedGroup]]]:
    """Replace the multi-node fusible groups of every program by fused steps; ``keep`` are nodes read
    outside their program (they end a group). One compiler run for all programs. Returns the new programs
    and, per program, the groups that became kernels."""
    grouped = []
    for prog in programs:
        nodes = [step[0] for step in prog]
        grouped.append([g for g in fuse(nodes, [n for n in nodes if n in keep]) if len(g.nodes) > 1])
    flat = [g for gs in grouped for g in gs]
    kernels = cgen.build(flat) if flat else []
    kernel_of = {id(g): k for g, k in zip(flat, kernels)}
    out_programs, out_groups = [], []
    for prog, groups in zip(programs, grouped):
        live = [g for g in groups if kernel_of[id(g)] is not None]
        absorbed = {n for g in live for n in g.nodes[:-1]}
        step_of = {g.output: (g.output, FusedStep(kernel_of[id(g)], g), list(g.inputs), {}, False) for g in live}
        out_programs.append([step_of.get(s[0], s) for s in prog if s[0] not in absorbed])
        out_groups.append(live)
    return out_programs, out_groups
