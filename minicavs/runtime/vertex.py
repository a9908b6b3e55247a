"""The vertex function F (§3.1): declared once with symbolic ops and gather / scatter / pull / push.

    F = VertexFunction("internal", arity=2, message=(2 * H,))
    with F:
        h1c1, h2c2 = F.gather(0), F.gather(1)
        ...
        F.scatter(ops.concat([h, c]))
        F.push(h)

Inside ``with F:`` every symbol is per-vertex: shapes and ``axis`` arguments exclude the vertex (batch) axis,
which the IR keeps as a leading ``None`` (see :mod:`minicavs.ir.graph`).
"""
from __future__ import annotations

from typing import Sequence

from ..core.dtypes import as_dtype, float32
from ..core.errors import ShapeError
from ..core.limits import MAX_REGISTERS
from ..ir.graph import Graph, Node, fmt_shape, rows_implicit
from ..ops.message import gather_node, pull_node, push_node, scatter_node


# The most children a vertex function may gather. Each gather is a value of its own (a register) in the
# template the C runner runs a kind by, which holds at most MAX_REGISTERS (512); this leaves 32 for
# the function's other values, so a function of the largest arity with a small body (a sum of its gathers,
# an accum of them, a product and a nonlinearity) still runs natively.
MAX_ARITY = MAX_REGISTERS - 32


class VertexFunction:
    """A static dataflow graph evaluated at every vertex of one kind.

    ``arity``: the most children a vertex of this kind has (gathers 0 .. arity-1), at most ``MAX_ARITY``
    (480): every gather takes one of the C runner's 512 registers of a kind's template, and 32 are
    left for the function's other values. A function of that arity whose other values need more registers
    (a large body) runs on the reference runner instead (the C runner declines it): the same numbers,
    slower; the batch program's ``dump()`` says why. Declaring a larger arity is an error."""

    def __init__(self, name: str = "F", arity: int = 0, message: Sequence[int] | None = None,
                 dtype=float32):
        if arity < 0:
            raise ValueError(f"vertex function '{name}': arity must be >= 0, got {arity}")
        if arity > MAX_ARITY:
            raise ShapeError(f"vertex function '{name}': arity {arity} is more than {MAX_ARITY}, the largest "
                             f"supported (each gather takes one of the C runner's {MAX_REGISTERS} "
                             "registers of a kind's template); give vertices with more children an intermediate "
                             "level of vertices")
        if arity and message is None:
            raise ShapeError(f"vertex function '{name}': gathering children needs the message shape")
        self.name = name
        self.arity = int(arity)
        self.message = None if message is None else tuple(int(d) for d in message)
        self.dtype = as_dtype(dtype)
        self.gathers: dict[int, Node] = {}
        self.gather_kinds: dict[int, tuple | None] = {}   # gather k -> the kinds child k may be (None: any)
        self.pulls: dict[str, Node] = {}
        self.pushes: dict[str, Node] = {}
        self.scattered: Node | None = None
        self._scope = None
        self._graph: Graph | None = None

    # --- declaration -----------------------------------------------------------------------------------

    def __enter__(self) -> "VertexFunction":
        if self._graph is not None:
            raise RuntimeError(f"vertex function '{self.name}' is already declared")
        self._scope = rows_implicit()
        self._scope.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._scope.__exit__(*exc)
        self._scope = None
        if exc[0] is None:
            self.graph  # validate now: an F with no outputs is a declaration error

    def _check_open(self, what: str) -> None:
        if self._graph is not None:
            raise RuntimeError(f"vertex function '{self.name}': {what} after the declaration was closed")

    def gather(self, k: int, kinds: str | Sequence[str] | None = None,
               message: Sequence[int] | None = None) -> Node:
        """What child k scattered; a zero row when the vertex has no child k.

        ``kinds`` names the vertex kinds child k may be (default: any); ``message`` is the shape they
        scatter (default: this function's own message). The structure checks both when it is declared: every
        named kind must scatter exactly ``message`` (a lattice's character cell gathers a word cell's
        message, which differs from its own), and every batch that child k is of a named kind."""
        self._check_open("gather")
        if not 0 <= k < self.arity:
            raise ShapeError(f"vertex function '{self.name}': gather({k}) beyond the declared arity {self.arity}")
        kinds = (kinds,) if isinstance(kinds, str) else None if kinds is None else tuple(kinds)
        shape = self.message if message is None else tuple(int(d) for d in message)
        if k not in self.gathers:
            self.gathers[k] = gather_node(k, shape, self.dtype)
            self.gather_kinds[k] = kinds
        elif self.gathers[k].vshape != shape or self.gather_kinds[k] != kinds:
            raise ShapeError(f"vertex function '{self.name}': gather({k}) declared twice, as "
                             f"{fmt_shape(self.gathers[k].vshape)} of kinds {self.gather_kinds[k]} and "
                             f"{fmt_shape(shape)} of kinds {kinds}")
        return self.gathers[k]

    def scatter(self, x: Node) -> None:
        """Set what parents gather from this vertex (once per F)."""
        self._check_open("scatter")
        if self.scattered is not None:
            raise ShapeError(f"vertex function '{self.name}': scatter called twice")
        if self.message is None:
            self.message = x.vshape
        elif x.vshape != self.message:
            raise ShapeError(f"vertex function '{self.name}': scatter of shape {fmt_shape(x.vshape)} but "
                             f"gather returns the message shape {fmt_shape(self.message)}")
        if x.dtype != self.dtype:
            raise ShapeError(f"vertex function '{self.name}': scatter of dtype {x.dtype.name}, "
                             f"the function's dtype is {self.dtype.name}")
        if not x.has_rows:
            raise ShapeError(f"vertex function '{self.name}': scatter of a value that does not depend on "
                             "the vertex (a parameter or constant); scatter a per-vertex value")
        self.scattered = scatter_node(x)

    def pull(self, shape: Sequence[int] | None = None, name: str = "x", dtype=None) -> Node:
        """This vertex's row of the external input ``name`` (per-vertex shape ``shape``)."""
        self._check_open("pull")
        if name in self.pulls:
            node = self.pulls[name]
            if shape is not None and tuple(shape) != node.vshape:
                raise ShapeError(f"vertex function '{self.name}': pull '{name}' declared with shape "
                                 f"{fmt_shape(node.vshape)} and {fmt_shape(tuple(shape))}")
            return node
        if shape is None:
            raise ShapeError(f"vertex function '{self.name}': pull '{name}' needs its per-vertex shape")
        node = pull_node(name, tuple(shape), as_dtype(dtype or self.dtype))
        self.pulls[name] = node
        return node

    def push(self, x: Node, name: str = "h") -> None:
        """Set this vertex's row of the external output ``name``."""
        self._check_open("push")
        if name in self.pushes:
            raise ShapeError(f"vertex function '{self.name}': push '{name}' called twice")
        if not x.has_rows:
            raise ShapeError(f"vertex function '{self.name}': push '{name}' of a value that does not depend "
                             "on the vertex")
        self.pushes[name] = push_node(x, name)

    # --- the declared graph ----------------------------------------------------------------------------

    @property
    def outputs(self) -> tuple[Node, ...]:
        return ((self.scattered,) if self.scattered is not None else ()) + tuple(self.pushes.values())

    @property
    def graph(self) -> Graph:
        if self._graph is None:
            if self._scope is not None:
                raise RuntimeError(f"vertex function '{self.name}' is still being declared")
            if not self.outputs:
                raise ShapeError(f"vertex function '{self.name}' neither scatters nor pushes anything")
            self._graph = Graph(self.outputs)
        return self._graph

    def rewritten(self, scattered: Node | None, pushes: dict[str, Node]) -> "VertexFunction":
        """This function computing its outputs by other nodes (a compile pass's rewrite of its graph): the same
        name, gathers, pulls and parameters; ``scattered`` and ``pushes`` replace the output nodes."""
        if self._graph is None and self._scope is not None:
            raise RuntimeError(f"vertex function '{self.name}' is still being declared")
        if set(pushes) != set(self.pushes) or (scattered is None) != (self.scattered is None):
            raise ValueError(f"vertex function '{self.name}': a rewrite must keep the outputs it replaces")
        out = VertexFunction(self.name, self.arity, self.message, self.dtype)
        out.gathers, out.gather_kinds, out.pulls = dict(self.gathers), dict(self.gather_kinds), dict(self.pulls)
        out.scattered, out.pushes = scattered, dict(pushes)
        out.graph  # validates: outputs exist
        return out

    @property
    def params(self) -> tuple[Node, ...]:
        return self.graph.params

    def dump(self) -> str:
        return f"vertex function '{self.name}' (arity {self.arity})\n" + self.graph.dump()

    def __repr__(self) -> str:
        return (f"<VertexFunction '{self.name}' arity={self.arity} message={self.message} "
                f"pulls={list(self.pulls)} pushes={list(self.pushes)}>")
