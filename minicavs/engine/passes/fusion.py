"""Fusion grouping (§3.4): directly linked elementwise nodes become one group, one generated kernel later.

Target-neutral: a :class:`FusedGroup` lists its external inputs (with how each broadcasts against the
group's shape), its nodes in topological order and its outputs (the members something outside the group
reads), and builds the scalar expression DAG from the ops' ``expr`` templates; codegen renders that DAG to C
or CUDA, and :meth:`FusedGroup.evaluate_all` runs it with numpy (the oracle for generated kernels).

Union-find over producer -> consumer edges between fusible nodes of one shape; a merge is refused when a
path would leave the group and come back (through a matmul, say), since the kernel must run as one step.
A member read outside (h, both scattered and pushed; a forward value ∂F reads) does not end its group: it
becomes one more output the kernel writes. A merge is also refused when the group would need more than
``MAX_ARGS`` kernel arguments (the C runner's limit): a sum of hundreds of gathers becomes a few
kernels of at most that many operands each.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ...core.limits import MAX_ARGS
from ...ir.graph import Node, consumers as consumers_of
from ...ops import scalar as S
from ...ops.registry import OPS


def fusible(n: Node) -> bool:
    return OPS[n.op].fusible and n.dtype.is_float


@dataclass(eq=False)  # identity: groups are dict keys
class FusedGroup:
    nodes: list            # topological order
    inputs: list           # external input nodes, in first-use order
    broadcast: list        # per input: "full", "row", "col", "scalar" or "other" (see broadcast_kind)
    outputs: list = field(default_factory=list)   # members read outside the group, topological order
    biased: dict = field(default_factory=dict)    # input -> bias input: the input arrives without its bias

    def __post_init__(self):
        if not self.outputs and self.nodes:
            self.outputs = [self.nodes[-1]]

    @property
    def output(self) -> Node:
        """The last output; its shape is every member's shape."""
        return self.outputs[-1]

    def exprs(self) -> list[S.Expr]:
        """Each output as a scalar expression over the inputs (``arg(i)`` = ``inputs[i]``), sharing
        common subexpressions."""
        env = {x: S.arg(i) for i, x in enumerate(self.inputs)}
        for x, b in self.biased.items():   # a linear layer's bias added here, not in its own pass
            env[x] = env[x] + env[b]
        for n in self.nodes:
            args = []
            for x in n.inputs:
                if x in env:
                    args.append(env[x])
                else:  # a scalar constant folded into the expression
                    args.append(S.lift(float(x.attrs["value"])))
            env[n] = OPS[n.op].expr(*args, **n.attrs)
        return [env[o] for o in self.outputs]

    def expr(self) -> S.Expr:
        return self.exprs()[-1]

    def evaluate_all(self, arrays: Sequence) -> list:
        """numpy evaluation of every output: what every generated kernel must reproduce."""
        return [S.evaluate(e, list(arrays), dtype=self.output.dtype.np) for e in self.exprs()]

    def evaluate(self, arrays: Sequence):
        return self.evaluate_all(arrays)[-1]


def broadcast_kind(x: Node, out: Node) -> str:
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
    literal = OPS[x.op].literal
    return literal is not None and literal(x) is not None


def _cyclic(group: set, consumers: dict) -> bool:
    """Does a path leave ``group`` and come back into it?"""
    frontier = [c for n in group for c in consumers[n] if c not in group]
    seen = set(frontier)
    while frontier:
        n = frontier.pop()
        for c in consumers[n]:
            if c in group:
                return True
            if c not in seen:
                seen.add(c)
                frontier.append(c)
    return False


def _arguments(group: set, consumers: dict, keep: set) -> int:
    """The kernel arguments ``group`` needs: its external inputs (folded constants aside) and its outputs,
    counting each member read outside it so far (later merges can only lower that count)."""
    inputs = {x for n in group for x in n.inputs if x not in group and not _foldable(x)}
    outputs = sum(1 for n in group if n in keep or not consumers[n] or any(c not in group for c in consumers[n]))
    return len(inputs) + outputs


def fuse(nodes: Sequence[Node], outputs: Sequence[Node] = ()) -> list[FusedGroup]:
    """Group the fusible nodes among ``nodes`` (topological order); ``outputs`` must stay materialised."""
    consumers = consumers_of(nodes)
    keep = set(outputs)
    group_of: dict = {}
    for n in nodes:
        if not fusible(n):
            continue
        g = {n}
        for x in n.inputs:
            other = group_of.get(x)
            if (other is not None and other is not g and x.shape == n.shape and not _cyclic(g | other, consumers)
                    and _arguments(g | other, consumers, keep) <= MAX_ARGS):
                g = g | other
        for m in g:
            group_of[m] = g
    groups = []
    for g in {id(g): g for g in group_of.values()}.values():
        ordered = sorted(g, key=lambda n: n.id)
        inputs = []
        for n in ordered:
            for x in n.inputs:
                if x not in g and x not in inputs and not _foldable(x):
                    inputs.append(x)
        outs = [n for n in ordered if n in keep or not consumers[n] or any(c not in g for c in consumers[n])]
        groups.append(FusedGroup(ordered, inputs, [broadcast_kind(x, ordered[-1]) for x in inputs], outs))
    groups.sort(key=lambda g: g.output.id)
    return groups
