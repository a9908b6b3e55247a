"""The IR: plain-data nodes (op, inputs, attrs, shape, dtype) and graphs of them in topological order.

Shapes are static tuples; ``None`` marks the leading row axis whose length is known only at run time.
Static graphs declare it explicitly (``(None, H)``). Per-vertex symbols of a vertex function are declared
without it (``(H,)``, the paper's "shape excluding the batch dimension", §3.3): inside a
:func:`rows_implicit` scope the IR stores them as ``(None, H)`` all the same, so that autodiff reduces
parameter gradients over vertices exactly as it reduces over rows of a static graph, while every ``axis``
and ``shape`` argument a user writes there indexes the batch-less shape.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
from typing import Any, Iterable, Sequence

import numpy as np

from ..core.dtypes import SHORT, DType
from ..core.errors import ShapeError

Shape = tuple  # tuple[int | None, ...]

_ids = itertools.count()
_rows_implicit: contextvars.ContextVar[bool] = contextvars.ContextVar("rows_implicit", default=False)


class Node:
    """One op application. Immutable by convention; compared and hashed by identity."""

    __slots__ = ("op", "inputs", "attrs", "shape", "dtype", "id", "name", "__weakref__")

    def __init__(self, op: str, inputs: tuple, attrs: dict, shape: Shape, dtype: DType,
                 name: str | None = None):
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.shape = shape
        self.dtype = dtype
        self.id = next(_ids)  # creation order: inputs always have smaller ids (a valid topo order)
        self.name = name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def has_rows(self) -> bool:
        """True if the leading axis is the run-time row (vertex) axis."""
        return bool(self.shape) and self.shape[0] is None

    @property
    def vshape(self) -> Shape:
        """The shape without the row axis: what a vertex function author declares."""
        return self.shape[1:] if self.has_rows else self.shape

    def label(self) -> str:
        return f"{self.op}#{self.id}" + (f" '{self.name}'" if self.name else "")

    def __repr__(self) -> str:
        return f"<Node {self.label()} {type_str(self)}>"

    # Python operators build nodes through the op functions the ops package installs here (OPERATORS):
    # the IR imports nothing above it. numpy must not broadcast over a Node as an object: ``array + node``
    # defers to ``node.__radd__``.
    __array_ufunc__ = None

    def __add__(self, other): return OPERATORS["add"](self, other)
    def __radd__(self, other): return OPERATORS["add"](other, self)
    def __sub__(self, other): return OPERATORS["sub"](self, other)
    def __rsub__(self, other): return OPERATORS["sub"](other, self)
    def __mul__(self, other): return OPERATORS["mul"](self, other)
    def __rmul__(self, other): return OPERATORS["mul"](other, self)
    def __truediv__(self, other): return OPERATORS["div"](self, other)
    def __rtruediv__(self, other): return OPERATORS["div"](other, self)
    def __matmul__(self, other): return OPERATORS["matmul"](self, other)
    def __rmatmul__(self, other): return OPERATORS["matmul"](other, self)
    def __neg__(self): return OPERATORS["neg"](self)
    def __pow__(self, p): return OPERATORS["pow"](self, p)

    def __bool__(self):
        raise TypeError("a symbolic Node has no truth value; run the graph to get numbers")


# op name -> the function building that op's node; filled by minicavs.ops when it is imported.
OPERATORS: dict = {}


# --- axes and shapes as users write them -------------------------------------------------------------

@contextlib.contextmanager
def rows_implicit():
    """Scope in which ``axis``/``shape`` arguments exclude the row axis (used by vertex functions)."""
    token = _rows_implicit.set(True)
    try:
        yield
    finally:
        _rows_implicit.reset(token)


def row_lead(x: Node) -> int:
    """1 if ``x`` has a row axis that the current scope hides from users, else 0."""
    return 1 if _rows_implicit.get() and x.has_rows else 0


def user_axis(x: Node, axis: int, what: str = "axis") -> int:
    """Normalise a user's axis (negative allowed) to an index into ``x.shape``."""
    lead = row_lead(x)
    nd = x.ndim - lead
    if not isinstance(axis, (int, np.integer)) or not -nd <= axis < nd:
        shown = x.vshape if lead else x.shape
        raise ShapeError(f"{what} {axis!r} out of range for shape {fmt_shape(shown)}")
    return int(axis) % nd + lead


def user_axes(x: Node, axis) -> tuple[int, ...]:
    """Normalise None (all axes a user can see), an int or a tuple of ints."""
    if axis is None:
        return tuple(range(row_lead(x), x.ndim))
    if isinstance(axis, (int, np.integer)):
        axis = (axis,)
    out = tuple(sorted({user_axis(x, a) for a in axis}))
    if len(out) != len(axis):
        raise ShapeError(f"repeated axis in {axis!r}")
    return out


def user_shape(x: Node, shape: Sequence) -> Shape:
    """A user's target shape, with the row axis put back in front inside a vertex function."""
    shape = tuple(shape)
    return ((None,) + shape) if row_lead(x) else shape


# --- formatting --------------------------------------------------------------------------------------

def fmt_shape(shape: Shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _type_of(shape: Shape, dtype: DType) -> str:
    return f"{SHORT[dtype.name]}[{','.join('?' if d is None else str(d) for d in shape)}]"


def type_str(n: Node) -> str:
    """``f32[?,4]``; a node holding several results (a control-flow op's, attribute ``_types``): the tuple."""
    types = n.attrs.get("_types")
    if types is not None:
        return "(" + ", ".join(_type_of(shape, dtype) for shape, dtype in types) + ")"
    return _type_of(n.shape, n.dtype)


def _fmt_attr(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return repr(v.item()) if v.size == 1 else f"array{v.shape}"
    if isinstance(v, float):
        return f"{v:g}"
    return repr(v)


def _own_type(n: Node, key: str, value: Any) -> bool:
    """Is attribute ``key`` the node's declared shape or dtype, which its type says already (a leaf's, a
    tuple node's and its items', a control-flow node's)?"""
    if key not in ("shape", "dtype"):
        return False
    holds_tuple = "_types" in n.attrs or (len(n.inputs) == 1 and "_types" in n.inputs[0].attrs)
    holds_graphs = any(isinstance(v, Graph) for v in n.attrs.values())
    return n.op in ("input", "param") or holds_tuple or holds_graphs


def consumers(nodes: Sequence[Node]) -> dict:
    """For each of ``nodes``, the nodes among them that read it (in order): the one use-def map the passes
    need."""
    member = set(nodes)
    out: dict = {n: [] for n in nodes}
    for n in nodes:
        for x in n.inputs:
            if x in member:
                out[x].append(n)
    return out


class Graph:
    """The nodes reachable from ``outputs``, in topological order (creation order)."""

    def __init__(self, outputs: Iterable[Node]):
        self.outputs = tuple(outputs)
        seen: dict[int, Node] = {}
        stack = list(self.outputs)
        while stack:  # iterative: deep graphs must not hit the recursion limit
            n = stack.pop()
            if n.id not in seen:
                seen[n.id] = n
                stack.extend(n.inputs)
        self.nodes: tuple[Node, ...] = tuple(seen[i] for i in sorted(seen))

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def inputs(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.op == "input")

    @property
    def params(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.op == "param")

    def consumers(self) -> dict[Node, list[Node]]:
        out: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for x in n.inputs:
                out[x].append(n)
        return out

    def dump(self, labels: dict[Node, str] | None = None, indent: str = "") -> str:
        """One line per node, jaxpr-like: ``%3:f32[?,4] = tanh %2  # label``. A node whose attributes hold
        graphs (a control-flow op's bodies) is followed by each of them, dumped the same way and indented;
        attributes whose names start with ``_`` (bookkeeping) and a ``shape``/``dtype`` its type already
        says are left out."""
        idx = {n: i for i, n in enumerate(self.nodes)}
        lines = []
        for n in self.nodes:
            args = " ".join(f"%{idx[x]}" for x in n.inputs)
            bodies = [(k, v) for k, v in n.attrs.items() if isinstance(v, Graph)]
            attrs = " ".join(f"{k}={_fmt_attr(v)}" for k, v in n.attrs.items()
                             if not (k.startswith("_") or isinstance(v, Graph) or _own_type(n, k, v)))
            rhs = " ".join(s for s in (n.op, args, attrs) if s)
            note = []
            if n.name:
                note.append(repr(n.name))
            if labels and n in labels:
                note.append(labels[n])
            lines.append(f"{indent}  %{idx[n]}:{type_str(n)} = {rhs}" + (f"  # {' '.join(note)}" if note else ""))
            for k, body in bodies:
                text = body.dump(indent=indent + "    ")
                lines.append(f"{indent}    {k} = {text[len(indent) + 4:]}")
        outs = ", ".join(f"%{idx[o]}" for o in self.outputs)
        return f"{indent}{{\n" + "\n".join(lines) + f"\n{indent}  return {outs}\n{indent}}}"

    def to_dot(self, labels: dict[Node, str] | None = None) -> str:
        """Graphviz source; ``dot -Tsvg`` renders it."""
        idx = {n: i for i, n in enumerate(self.nodes)}
        outs = set(self.outputs)
        lines = ["digraph G {", "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
        for n in self.nodes:
            text = f"%{idx[n]} {n.op}" + (f" '{n.name}'" if n.name else "") + f"\\n{type_str(n)}"
            if labels and n in labels:
                text += f"\\n[{labels[n]}]"
            style = ', style=filled, fillcolor="#dde8f8"' if n.op in ("input", "param") else ""
            if n in outs:
                style += ", peripheries=2"
            lines.append(f'  n{idx[n]} [label="{text}"{style}];')
            for x in n.inputs:
                lines.append(f"  n{idx[x]} -> n{idx[n]};")
        lines.append("}")
        return "\n".join(lines)
