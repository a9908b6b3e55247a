"""Subgraphs and the values of several results that control-flow operators are made of.

A body is built by calling a Python function once on fresh symbols (:func:`trace`): the nodes it makes become
a closed :class:`Subgraph`; every value it reads from outside (a parameter, a node of the enclosing graph, a
node of an enclosing body) becomes an explicit input of the node that holds it, and inside the body a
placeholder stands for it.

The node of an op with more than one result holds a tuple, and each result is an ``item`` node of it; the
gradients of several items reach the tuple node as one ``tuple_ct`` node (merged by the registry's
``merge_gradients``), which only the op's gradient rule reads.
"""
from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Callable, Sequence

from ..core.errors import ShapeError
from ..ir.graph import Graph, Node, type_str
from .registry import OPS, OpDef, make_node, register
from .sources import constant, input as placeholder


# how many bodies are being traced around the code running now (0: the enclosing graph's own level)
_body_depth: contextvars.ContextVar[int] = contextvars.ContextVar("body_depth", default=0)


def in_body() -> bool:
    """Is a control-flow body being traced (the nodes made now belong to a body, not to the graph)?"""
    return _body_depth.get() > 0


# --- subgraphs -----------------------------------------------------------------------------------------

class Subgraph(Graph):
    """A closed graph: ``args`` (placeholders: the explicit operands, then the captured values) ->
    ``outputs``. ``nodes`` (topological order) holds the args it reads too, as ``input`` nodes."""

    def __init__(self, args: Sequence[Node], outputs: Sequence[Node], name: str):
        super().__init__(outputs)
        self.args = tuple(args)
        self.name = name
        arg_set = set(self.args)
        self.computed = tuple(n for n in self.nodes if n not in arg_set)
        self.nodes = self.args + self.computed   # every arg, read or not, in order (what dump shows)

    def run(self, xp, values: Sequence) -> list:
        """Evaluate with ``values`` bound to ``args`` (the registry's impls, one node at a time)."""
        env = dict(zip(self.args, values))
        for n in self.computed:
            env[n] = OPS[n.op].impl(xp, *[env[x] for x in n.inputs], **n.attrs)
        return [env[o] for o in self.outputs]

    def inline(self, values: Sequence[Node]) -> list[Node]:
        """The outputs as nodes of the graph being built, with ``values`` in place of ``args`` (a copy of
        the body's nodes: how a gradient rule re-applies a body symbolically)."""
        mapping = dict(zip(self.args, values))
        for n in self.computed:
            mapping[n] = Node(n.op, tuple(mapping[x] for x in n.inputs), n.attrs, n.shape, n.dtype, n.name)
        return [mapping[o] for o in self.outputs]

    def signature(self) -> str:
        return f"{self.name}(" + ", ".join(type_str(a) for a in self.args) + ")"


@dataclass
class Traced:
    """A traced body: the subgraph, the values it captured from outside (in the order of its extra args)."""

    graph: Subgraph
    captured: list


def _as_list(value, what: str) -> tuple[list, bool]:
    """``value`` (one node, or a list/tuple of nodes) as a list, and whether it was a single node."""
    if isinstance(value, Node):
        return [value], True
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if not isinstance(v, Node):
                raise TypeError(f"{what}: entry {i} is {type(v).__name__}, not a Node")
        return list(value), False
    raise TypeError(f"{what}: expected a Node or a list of Nodes, got {type(value).__name__}")


def trace(fn: Callable, types: Sequence[tuple], name: str, unpack: Callable | None = None):
    """Call ``fn`` once on fresh symbols of ``types`` ((shape, dtype) each) and close over what it reads.

    ``unpack(result) -> list of nodes`` turns the function's return value into its outputs (default: one node
    or a list of nodes). Returns (Traced, the raw result as ``unpack`` saw it)."""
    marker = constant(0.0)   # every node made from here on belongs to the body
    start = marker.id
    formals = [placeholder(shape, dtype, name=f"{name}.{i}") for i, (shape, dtype) in enumerate(types)]
    token = _body_depth.set(_body_depth.get() + 1)
    try:
        result = fn(*formals)
    finally:
        _body_depth.reset(token)
    outputs = unpack(result) if unpack else _as_list(result, f"{name} returned")[0]
    formal_set = set(formals)
    captured: list[Node] = []
    mapping: dict[Node, Node] = {f: f for f in formals}
    inner: dict[int, Node] = {}
    stack = list(outputs)
    seen: set = set()
    while stack:   # the nodes the outputs read, stopping at formals and at values from outside
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in formal_set:
            continue
        if n.id < start or n.op in ("input", "param"):
            captured.append(n)
            continue
        if OPS[n.op].needs_ctx:
            raise ShapeError(f"{name}: {n.label()} needs the run context (dropout's random stream), which a "
                             "control-flow body does not have; apply it outside the body")
        inner[n.id] = n
        stack.extend(n.inputs)
    captured.sort(key=lambda n: n.id)
    holders = []
    for c in captured:
        holder = placeholder(c.shape, c.dtype, name=f"{name}.captured:{c.name or c.label()}")
        mapping[c] = holder
        holders.append(holder)
    for i in sorted(inner):
        n = inner[i]
        mapping[n] = Node(n.op, tuple(mapping[x] for x in n.inputs), n.attrs, n.shape, n.dtype, n.name)
    sub = Subgraph(formals + holders, [mapping[o] for o in outputs], name)
    return Traced(sub, captured), result


def _extend_captures(traced: Traced, captured: list) -> Subgraph:
    """``traced``'s subgraph taking placeholders for all of ``captured`` (a superset of its own captures,
    in that order): two branches of a ``cond`` share one list of extra inputs."""
    own = dict(zip(traced.captured, traced.graph.args[len(traced.graph.args) - len(traced.captured):]))
    n_formal = len(traced.graph.args) - len(traced.captured)
    args = list(traced.graph.args[:n_formal])
    for c in captured:
        args.append(own[c] if c in own else placeholder(c.shape, c.dtype, name=f"{traced.graph.name}.unused"))
    sub = Subgraph(args, traced.graph.outputs, traced.graph.name)
    return sub


def _merged_captures(*traced: Traced) -> list:
    out: list = []
    for t in traced:
        out += [c for c in t.captured if c not in out]
    return out


# --- values with several results: tuple nodes, their items and their cotangents ------------------------

def _tuple_node(op: str, inputs: Sequence[Node], attrs: dict, types: Sequence[tuple]) -> Node:
    """The node of a control-flow op with several results: its value is a tuple; :func:`item` reads one.
    Its declared shape is ``(None,)`` when a result has the row axis (so a vertex function's compiler sees
    a per-vertex value), else ``()``."""
    rows = any(shape and shape[0] is None for shape, _ in types)
    attrs = dict(attrs, _types=tuple(types), shape=(None,) if rows else ())
    return make_node(op, inputs, attrs)


def _is_tuple_node(node: Node) -> bool:
    return "_types" in node.attrs


def item(t: Node, index: int) -> Node:
    shape, dtype = t.attrs["_types"][index]
    return make_node("item", (t,), {"index": index, "shape": shape, "dtype": dtype})


def item_index(node: Node) -> int | None:
    """Which result of its tuple node ``node`` is, when it is an ``item`` (None: any other node)."""
    return node.attrs["index"] if node.op == "item" else None


def _item_vjp(g, y, t, index, shape, dtype):
    return (make_node("tuple_ct", (g,), {"index": (index,), "shape": t.shape, "dtype": t.dtype}),)


def _merge_tuple_cts(gs: list) -> list:
    """Cotangents of several items of one tuple node, as one ``tuple_ct`` node (its inputs and indices)."""
    parts, index = [], []
    for g in gs:
        parts += g.inputs
        index += g.attrs["index"]
    return [make_node("tuple_ct", parts, {"index": tuple(index), "shape": gs[0].shape, "dtype": gs[0].dtype})]


register(OpDef("item", infer=lambda t, index, shape, dtype: (shape, dtype),
               impl=lambda xp, t, index, shape, dtype: t[index], vjp=_item_vjp, fuse=False))
# A tuple node's cotangent, read only by the op's gradient rule (which takes its inputs apart, never runs
# it); as a value it is the tuple of its parts.
register(OpDef("tuple_ct", infer=lambda *parts, index, shape, dtype: (shape, dtype),
               impl=lambda xp, *parts, index, shape, dtype: tuple(parts), vjp=None, fuse=False,
               merge_gradients=_merge_tuple_cts, tuple_valued=lambda node: True))


def _cotangents(g: Node, node: Node) -> dict:
    """Output index -> cotangent node, from what autodiff gave a control-flow node (one node for a
    single-result node, a ``tuple_ct`` for a tuple node); several for one index are summed."""
    if "_types" not in node.attrs:
        return {0: g}
    out: dict = {}
    for i, part in zip(g.attrs["index"], g.inputs):
        out[i] = part if i not in out else out[i] + part
    return out


def _results(node: Node, count: int) -> list:
    return [item(node, i) for i in range(count)] if "_types" in node.attrs else [node]
