"""The numpy interpreter for graphs: the reference every faster path is checked against."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import FeedError
from .graph import Graph, Node, fmt_shape
from .ops.registry import OPS
from .validate import indices


@dataclass
class RunContext:
    """What an op may read besides its inputs: the dropout hash words and the train/eval switch."""

    seed: int = 0
    step: int = 0
    training: bool = True
    row_keys: Any = None  # per-row keys of the rows being computed (None: the row index)


def check_value(node: Node, value, what: str):
    """Return ``value`` as an array of the node's dtype, or raise naming the node and both shapes. Arrays
    of another array module (a device's) are checked and kept there."""
    want = node.dtype.np
    if (hasattr(value, "__array_namespace__") or isinstance(value, np.ndarray)) and value.dtype.kind != "O":
        arr = value
    elif want.kind in "iu":   # a list: numpy would turn [1, True] into ints and [2**63, 1] into floats
        arr = indices(value, f"{what} {node.label()}: value", dtype=None)
    else:
        arr = np.asarray(value)
    if arr.dtype != want:
        if arr.dtype.kind != want.kind and not (arr.dtype.kind in "iu" and want.kind in "iu"):
            raise FeedError(f"{what} {node.label()}: got dtype {arr.dtype}, declared {node.dtype.name}")
        if want.kind in "iu" and arr.size and not np.can_cast(arr.dtype, want):   # would values wrap?
            info = np.iinfo(want)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise FeedError(f"{what} {node.label()}: value {lo if lo < info.min else hi} does not fit "
                                f"its declared dtype {node.dtype.name}")
        arr = arr.astype(want)
    if arr.ndim != node.ndim or any(d is not None and d != a for d, a in zip(node.shape, arr.shape)):
        raise FeedError(f"{what} {node.label()}: got shape {arr.shape}, declared {fmt_shape(node.shape)}")
    return arr


def leaf_value(n: Node, feeds: Mapping, params: Mapping):
    """The value of an ``input`` (from feeds, by node or name) or ``param`` (by name) node, checked."""
    if n.op == "input":
        if n in feeds:
            value = feeds[n]
        elif n.name is not None and n.name in feeds:
            value = feeds[n.name]
        else:
            raise FeedError(f"missing feed for input {n.label()} {fmt_shape(n.shape)}")
        return check_value(n, value, "feed for input")
    if n.name not in params:
        raise FeedError(f"missing value for parameter '{n.name}' {fmt_shape(n.shape)}")
    value = params[n.name]
    return check_value(n, getattr(value, "value", value), "parameter")


def _located(e: FeedError, n: Node) -> FeedError:
    """``e`` with the node it came from and that node's inputs, so a message about an op's operand
    ('labels of shape (2,)') also names the input the user fed ('input#3 'labels'')."""
    return FeedError(f"{e} [at {n.label()} of {', '.join(x.label() for x in n.inputs)}]")


def eval_nodes(nodes: Sequence[Node], env: dict, feeds: Mapping, params: Mapping, ctx: RunContext,
               skip=("gather", "pull"), xp=np) -> None:
    """Evaluate ``nodes`` (in topological order) into ``env``, keeping every value (for a backward pass).

    Nodes already in ``env`` are not recomputed; ``skip`` ops are leaves someone else supplies. Feeds and
    parameters must already be arrays of ``xp``'s device."""
    for n in nodes:
        if n in env or n.op in skip:
            continue
        if n.op in ("input", "param"):
            env[n] = leaf_value(n, feeds, params)
        else:
            opdef = OPS[n.op]
            args = [env[x] for x in n.inputs]
            try:
                env[n] = opdef.impl(xp, *args, ctx=ctx, **n.attrs) if opdef.needs_ctx \
                    else opdef.impl(xp, *args, **n.attrs)
            except FeedError as e:
                raise _located(e, n) from None


class Executor:
    """A graph compiled once into a flat instruction list; ``run`` only interprets it."""

    def __init__(self, graph: Graph | Sequence[Node]):
        self.graph = graph if isinstance(graph, Graph) else Graph(graph)
        nodes = self.graph.nodes
        index = {n: i for i, n in enumerate(nodes)}
        self.index = index
        self.out_idx = [index[o] for o in self.graph.outputs]
        last_use = {i: len(nodes) for i in self.out_idx}  # outputs live to the end
        for i, n in enumerate(nodes):
            for x in n.inputs:
                last_use[index[x]] = max(last_use.get(index[x], -1), i)
        self.program = []
        for i, n in enumerate(nodes):
            free = tuple(sorted({index[x] for x in n.inputs if last_use[index[x]] == i}))
            self.program.append((i, n, OPS[n.op], tuple(index[x] for x in n.inputs), free))

    def run(self, feeds: Mapping | None = None, params: Mapping[str, Any] | None = None,
            ctx: RunContext | None = None, xp=np) -> list:
        """Evaluate the graph. ``feeds`` maps input nodes (or their names) to arrays; ``params`` maps
        parameter names to arrays (or objects with a ``.value``)."""
        feeds = feeds or {}
        params = params or {}
        ctx = ctx or RunContext()
        env: list = [None] * len(self.program)
        for i, n, opdef, args, free in self.program:
            if n.op in ("input", "param"):
                env[i] = leaf_value(n, feeds, params)
            else:
                xs = [env[a] for a in args]
                try:
                    if opdef.needs_ctx:
                        env[i] = opdef.impl(xp, *xs, ctx=ctx, **n.attrs)
                    else:
                        env[i] = opdef.impl(xp, *xs, **n.attrs)
                except FeedError as e:
                    raise _located(e, n) from None
                for a in free:
                    env[a] = None
        return [env[i] for i in self.out_idx]


def run(outputs: Node | Sequence[Node], feeds: Mapping | None = None, params: Mapping | None = None,
        ctx: RunContext | None = None):
    """One-shot evaluation; returns one array for one output node, else a list."""
    single = isinstance(outputs, Node)
    result = Executor([outputs] if single else list(outputs)).run(feeds, params, ctx)
    return result[0] if single else result
