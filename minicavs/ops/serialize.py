"""Nodes, graphs and control-flow bodies as plain JSON plus named arrays: what a model artifact holds.

A node table lists every node reachable from the roots (through inputs and through the graphs held in
attributes: a ``while_loop``'s body, a ``cond``'s branches), in creation order, which is a valid order for
rebuilding: a node's inputs and the bodies in its attributes exist before it is made. Each entry is
``[op, [input indices], {attr: encoded}, shape, dtype, name]``. Attribute values are encoded by type, one
tagged JSON form each; a value of any other type (a Python function, an object) is refused naming the node and
the attribute, since it exists only as code. Arrays (constants) go into ``arrays`` under ``attr/<i>``.
Decoding checks every op name against the registry and every index, so a damaged table is a clear error.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from ..core.dtypes import DTYPES, DType
from ..core.errors import MinicavsError
from ..ir.graph import Graph, Node
from .registry import OPS
from .subgraph import Subgraph


class SerializeError(MinicavsError, ValueError):
    """A graph that cannot be written as data, or a table that does not decode (damaged, or not ours)."""


def _reachable(roots: Iterable[Node]) -> list[Node]:
    """Every node the roots read, through inputs and attribute graphs, in creation order."""
    seen: dict[int, Node] = {}
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.id in seen:
            continue
        seen[n.id] = n
        stack.extend(n.inputs)
        for value in n.attrs.values():
            stack.extend(_graph_nodes(value))
    return [seen[i] for i in sorted(seen)]


def _graph_nodes(value: Any) -> list[Node]:
    if isinstance(value, Graph):
        return list(value.nodes) + list(value.outputs)
    if isinstance(value, (tuple, list)):
        return [n for v in value for n in _graph_nodes(v)]
    return []


class Encoder:
    """Collects nodes into one table; :meth:`ref` gives a node's index in it."""

    def __init__(self, roots: Iterable[Node]):
        self.nodes = _reachable(roots)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.arrays: dict[str, np.ndarray] = {}
        self.table = [self._node(n) for n in self.nodes]

    def ref(self, node: Node) -> int:
        return self.index[node]

    def _node(self, n: Node) -> list:
        attrs = {}
        for key, value in n.attrs.items():
            if not isinstance(key, str):
                raise SerializeError(f"{n.label()}: attribute key {key!r} is not a string")
            attrs[key] = self._value(value, f"{n.label()} attribute '{key}'")
        shape = [d if d is None else int(d) for d in n.shape]
        return [n.op, [self.index[x] for x in n.inputs], attrs, shape, n.dtype.name, n.name]

    def _value(self, v: Any, where: str) -> Any:
        """One attribute value as tagged JSON (see the module docstring); anything else is refused."""
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return {"int": str(v)} if abs(v) >= 2 ** 53 else v
        if isinstance(v, float):
            return {"float": v.hex()}
        if isinstance(v, DType):
            return {"dtype": v.name}
        if isinstance(v, (np.ndarray, np.generic)):
            return self._array(v, where)
        if isinstance(v, Subgraph):
            return {"subgraph": {"args": [self.index[a] for a in v.args], "name": v.name,
                                 "outputs": [self.index[o] for o in v.outputs]}}
        if isinstance(v, Graph):
            return {"graph": [self.index[o] for o in v.outputs]}
        if isinstance(v, Node):
            return {"node": self.index[v]}
        if isinstance(v, tuple):
            return {"tuple": [self._value(x, where) for x in v]}
        if isinstance(v, list):
            return {"list": [self._value(x, where) for x in v]}
        if isinstance(v, dict):
            return {"dict": [[self._value(k, where), self._value(x, where)] for k, x in v.items()]}
        raise SerializeError(f"{where} is a {type(v).__name__} ({v!r:.60}), which exists only as Python "
                             "code: it cannot be exported as data")

    def _array(self, v, where: str) -> dict:
        if v.dtype.hasobject or v.dtype.kind not in "biuf":
            raise SerializeError(f"{where} is an array of {v.dtype}, which cannot be exported (numbers only)")
        key = f"attr/{len(self.arrays)}"
        self.arrays[key] = np.asarray(v)
        return {"scalar" if isinstance(v, np.generic) else "array": key}


class Decoder:
    """Rebuilds the nodes of a table (new Node objects, same ops, attributes, shapes, dtypes and names), in table
    order and as far as asked: a node that its owner must make (a structure's push buffer, which the engine
    registers) is :meth:`give`-n in its place before any entry that reads it is decoded. :meth:`check_all`
    decodes the rest, so that a damaged entry anywhere is an error."""

    def __init__(self, table: list, arrays: Mapping[str, np.ndarray]):
        self.arrays = arrays
        self.nodes: list[Node] = []
        if not isinstance(table, list):
            raise SerializeError("the node table is not a list")
        self.table = [self._entry(i, entry) for i, entry in enumerate(table)]   # (checked before any is made)

    def node(self, index: Any) -> Node:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.table):
            raise SerializeError(f"node reference {index!r} is outside the table of {len(self.table)} nodes")
        while len(self.nodes) <= index:
            self.nodes.append(self._node(len(self.nodes), self.table[len(self.nodes)]))
        return self.nodes[index]

    def give(self, index: Any, node: Node) -> None:
        """Use ``node`` for entry ``index`` (the entries after it that read it get it); the entry must describe
        it (op, shape, dtype) and not be decoded yet."""
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self.table):
            raise SerializeError(f"node reference {index!r} is outside the table of {len(self.table)} nodes")
        if index:
            self.node(index - 1)
        if len(self.nodes) != index:
            raise SerializeError(f"node {index!r}: given after an entry reading it was decoded")
        made = self._node(index, self.table[index])
        if (made.op, made.shape, made.dtype) != (node.op, node.shape, node.dtype):
            raise SerializeError(f"node {index}: the table has {made.op} {made.shape} {made.dtype.name} where "
                                 f"{node.label()} goes")
        self.nodes.append(node)

    def check_all(self) -> None:
        if self.table:
            self.node(len(self.table) - 1)

    @staticmethod
    def _entry(i: int, entry: Any) -> tuple:
        """Entry ``i`` unpacked, its op and dtype known, its inputs earlier entries; else a SerializeError."""
        try:
            op, inputs, attrs, shape, dtype, name = entry
        except (TypeError, ValueError):
            raise SerializeError(f"node {i}: not an entry [op, inputs, attrs, shape, dtype, name]") from None
        if op not in OPS:
            raise SerializeError(f"node {i}: op {op!r} is not in this minicavs's registry (written by another "
                                 "version, or damaged)")
        if dtype not in DTYPES:
            raise SerializeError(f"node {i} ({op}): unknown dtype {dtype!r}")
        if not isinstance(attrs, dict) or not isinstance(shape, list) or not isinstance(inputs, list):
            raise SerializeError(f"node {i} ({op}): malformed entry")
        for x in inputs:
            if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < i:
                raise SerializeError(f"node {i} ({op}): input reference {x!r} is outside the table before it")
        return op, inputs, attrs, shape, dtype, name

    def _node(self, i: int, entry: tuple) -> Node:
        op, inputs, attrs, shape, dtype, name = entry
        where = f"node {i} ({op})"
        decoded = {k: self._value(v, where) for k, v in attrs.items()}
        return Node(op, tuple(self.node(x) for x in inputs), decoded,
                    tuple(None if d is None else int(d) for d in shape), DTYPES[dtype], name)

    def _value(self, v: Any, where: str) -> Any:
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if not isinstance(v, dict) or len(v) != 1:
            raise SerializeError(f"{where}: malformed attribute value {v!r:.60}")
        (tag, x), = v.items()
        try:
            return self._tagged(tag, x, where)
        except (TypeError, ValueError, KeyError) as e:
            raise SerializeError(f"{where}: malformed {tag!r} attribute value ({e})") from None

    def _tagged(self, tag: str, x: Any, where: str) -> Any:
        if tag == "int":
            return int(x)
        if tag == "float":
            return float.fromhex(x)
        if tag == "dtype":
            return DTYPES[x]
        if tag in ("array", "scalar"):
            value = np.array(self.arrays[x])
            return value[()] if tag == "scalar" else value
        if tag == "subgraph":
            return Subgraph([self.node(a) for a in x["args"]], [self.node(o) for o in x["outputs"]], x["name"])
        if tag == "graph":
            return Graph([self.node(o) for o in x])
        if tag == "node":
            return self.node(x)
        if tag == "tuple":
            return tuple(self._value(y, where) for y in x)
        if tag == "list":
            return [self._value(y, where) for y in x]
        if tag == "dict":
            return {self._value(k, where): self._value(y, where) for k, y in x}
        raise SerializeError(f"{where}: unknown attribute tag {tag!r}")
