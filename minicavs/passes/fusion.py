"""Fusion grouping (§3.4): directly linked elementwise nodes become one group, one generated kernel later.

Target-neutral: a :class:`FusedGroup` lists its external inputs (with how each broadcasts against the
output), its nodes in topological order and its output, and builds the scalar expression DAG from the ops'
``expr`` templates; codegen renders that DAG to C or CUDA, and :meth:`FusedGroup.evaluate` runs it with numpy
(the oracle for generated kernels).

The rule keeps groups acyclic without a search: an elementwise producer joins its consumer's group only if
every consumer of the producer is in that group and it has the group's output shape. Groups are therefore
in-trees with one output; a value needed outside (e.g. h, read by both scatter and push) ends its group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..graph import Node
from ..ops import scalar as S
from ..ops.registry import OPS


def fusible(n: Node) -> bool:
    return OPS[n.op].elementwise and n.op not in ("constant", "zeros_like", "ones_like") and n.dtype.is_float


@dataclass(eq=False)  # identity: groups are dict keys
class FusedGroup:
    nodes: list            # topological order; the last is the output
    inputs: list           # external input nodes, in first-use order
    broadcast: list        # per input: "full", "row", "col", "scalar" or "other" (see _kind)

    @property
    def output(self) -> Node:
        return self.nodes[-1]

    def expr(self) -> S.Expr:
        """The output as one scalar expression over the inputs (``arg(i)`` = ``inputs[i]``)."""
        env = {x: S.arg(i) for i, x in enumerate(self.inputs)}
        for n in self.nodes:
            args = []
            for x in n.inputs:
                if x in env:
                    args.append(env[x])
                else:  # a scalar constant folded into the expression
                    args.append(S.lift(float(x.attrs["value"])))
            env[n] = OPS[n.op].expr(*args, **n.attrs)
        return env[self.output]

    def evaluate(self, arrays: Sequence):
        """numpy evaluation of the fused expression: what every generated kernel must reproduce."""
        return S.evaluate(self.expr(), list(arrays), dtype=self.output.dtype.np)


def _kind(x: Node, out: Node) -> str:
    """How input ``x`` is indexed by the flat output index: full, row (a trailing block such as a bias:
    ``i % cols``), col (one value per row: ``i / cols``), scalar, or other (a kernel cannot index it)."""
    if x.shape == out.shape:
        return "full"
    if all(d == 1 for d in x.shape):
        return "scalar"
    tail = list(x.shape)
    while tail and tail[0] == 1:
        tail.pop(0)
    if len(tail) == 1 and out.shape and tail[0] == out.shape[-1]:
        return "row"
    if x.ndim == out.ndim and x.shape[-1] == 1 and x.shape[:-1] == out.shape[:-1]:
        return "col"
    return "other"


def _foldable(x: Node) -> bool:
    return x.op == "constant" and x.attrs["value"].size == 1


def fuse(nodes: Sequence[Node], outputs: Sequence[Node] = ()) -> list[FusedGroup]:
    """Group the fusible nodes among ``nodes`` (topological order); ``outputs`` must stay materialised."""
    member = set(nodes)
    consumers: dict = {n: [] for n in nodes}
    for n in nodes:
        for x in n.inputs:
            if x in member:
                consumers[x].append(n)
    keep = set(outputs)
    group_of: dict = {}
    for n in reversed(nodes):  # consumers first: a producer joins the group of its consumers
        if not fusible(n):
            continue
        cs = consumers[n]
        gs = {group_of.get(c) for c in cs}
        if (n not in keep and cs and len(gs) == 1 and None not in gs
                and n.shape == next(iter(gs)).output.shape):
            g = next(iter(gs))
            g.nodes.insert(0, n)
        else:
            g = FusedGroup([n], [], [])
        group_of[n] = g
    groups = []
    for g in dict.fromkeys(group_of.values()):
        g.nodes.sort(key=lambda n: n.id)
        inside = set(g.nodes)
        for n in g.nodes:
            for x in n.inputs:
                if x not in inside and x not in g.inputs and not _foldable(x):
                    g.inputs.append(x)
        g.broadcast = [_kind(x, g.output) for x in g.inputs]
        groups.append(g)
    groups.sort(key=lambda g: g.output.id)
    return groups


def count_kernels(nodes: Sequence[Node], outputs: Sequence[Node] = ()) -> int:
    """Fused elementwise kernels plus every other non-leaf node: what one evaluation launches."""
    leaves = ("input", "param", "constant", "gather", "pull")
    others = sum(1 for n in nodes if not fusible(n) and n.op not in leaves)
    return len(fuse(nodes, outputs)) + others
