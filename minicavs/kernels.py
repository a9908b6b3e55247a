"""Lowering a phase's program to steps: each fused elementwise group (passes/fusion.py) becomes one generated
kernel (C by codegen/c.py, CUDA by minicavs/cuda) that reads strided views and can write straight into a
dynamic tensor's rows.

A program is a list of steps ``(node, impl, inputs, attrs, needs_ctx)`` run in order by the engine; a fused
step has the tuple of the group's outputs as node, its external inputs as inputs and ``FUSED`` as attrs.
Groups a kernel cannot index, and every group when there is no C compiler, stay as their unfused nodes.
"""
from __future__ import annotations

import heapq
from typing import Callable, Sequence

from .graph import consumers
from .ops.registry import OPS
from .passes.fusion import FusedGroup, broadcast_kind, fuse


FUSED: dict = {}   # the attrs of a fused step: the engine tests ``attrs is FUSED``


class FusedStep:
    """The impl of a fused step: ``step(arrays, outs)`` with one entry of ``outs`` per output (an array to
    write into, or None) returns the list of outputs."""

    __slots__ = ("kernel", "group")

    def __init__(self, kernel, group: FusedGroup):
        self.kernel = kernel
        self.group = group

    def __call__(self, arrays, outs: list) -> list:
        ys = self.kernel(arrays, outs)
        return ys if isinstance(ys, list) else [ys]

    def __repr__(self) -> str:
        return f"<fused {' '.join(n.op for n in self.group.nodes)}>"


def plan(program: list, keep: set) -> list[FusedGroup]:
    """The groups of a program (unfused steps) worth a kernel. Target-neutral: the C path compiles them
    here, the CUDA path renders the same groups (codegen/cuda.py).

    An op with a bias input (``OpDef.bias_input``: linear) feeding only one group hands its bias add to the
    group (``FusedGroup.biased``): the linear step then only multiplies, and ``tanh(x·W + b)`` is one matmul and one kernel. A group is worth a
    kernel if it has more than one node or absorbs a bias."""
    nodes = [step[0] for step in program]
    member = set(nodes)
    users = consumers(nodes)
    out = []
    for g in fuse(nodes, [n for n in nodes if n in keep]):
        inside = set(g.nodes)
        for x in list(g.inputs):
            bias = OPS[x.op].bias_input
            if (bias is not None and x in member and x not in keep and x.shape == g.output.shape
                    and users[x] and all(u in inside for u in users[x])):
                b = x.inputs[bias]
                g.biased[x] = b
                if b not in g.inputs:
                    g.inputs.append(b)
                    g.broadcast.append(broadcast_kind(b, g.output))
        if len(g.nodes) > 1 or g.biased:
            out.append(g)
    return out


def lower(programs: Sequence[list], keep: set, build: Callable) -> tuple[list[list], list[list]]:
    """Replace the multi-node fusible groups of every program by fused steps, ``(outputs, FusedStep,
    inputs, FUSED, False)``; ``keep`` are nodes read outside their program (group outputs). ``build`` makes
    the kernels of a list of groups (None where a group stays unfused): a backend's ``fused``, one run for all
    programs. Returns the new programs and, per program, the groups that
    became kernels."""
    grouped = [plan(prog, keep) for prog in programs]
    flat = [g for gs in grouped for g in gs]
    kernels = build(flat) if flat else []
    kernel_of = {id(g): k for g, k in zip(flat, kernels)}
    out_programs, out_groups = [], []
    for prog, groups in zip(programs, grouped):
        live = [g for g in groups if kernel_of[id(g)] is not None]
        absorbed = {n: g for g in live for n in g.nodes}
        unbiased = {x for g in live for x in g.biased}
        steps, seen = [], set()
        for st in prog:
            g = absorbed.get(st[0])
            if st[0] in unbiased:   # its group adds the bias
                node = st[0]
                rest = [x for i, x in enumerate(node.inputs) if i != OPS[node.op].bias_input]
                steps.append((node, OPS[node.op].without_bias, rest, {}, False))
            elif g is None:
                steps.append(st)
            elif id(g) not in seen:
                seen.add(id(g))
                steps.append((tuple(g.outputs), FusedStep(kernel_of[id(g)], g), list(g.inputs), FUSED, False))
        out_programs.append(_toposort(steps))
        out_groups.append(live)
    return out_programs, out_groups


def _toposort(steps: list) -> list:
    """Order steps so each runs after the steps computing its inputs, staying close to the given order
    (a fused group must run after all its members' inputs and before any reader of its outputs)."""
    producer = {}
    for i, st in enumerate(steps):
        for n in (st[0] if st[3] is FUSED else (st[0],)):
            producer[n] = i
    deps = [{producer[x] for x in st[2] if x in producer and producer[x] != i} for i, st in enumerate(steps)]
    users: list = [[] for _ in steps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    waiting = [len(d) for d in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(steps[i])
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, u)
    assert len(order) == len(steps), "fused groups formed a cycle"
    return order
