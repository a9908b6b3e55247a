"""The op registry: the single place where an op's shape rule, kernel, gradient and fusion template live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class OpDef:
    """Everything minicavs knows about one op.

    infer(*input_nodes, **attrs) -> (shape, dtype); raises ShapeError with a message naming both operands.
    impl(xp, *arrays, **attrs) -> array; written once against numpy's API so cupy can run it too.
    vjp(g, out, *input_nodes, **attrs) -> one Node or None per input; gradients are IR nodes, so a
        backward graph is an ordinary graph. ``vjp=None`` means no gradient flows through the op: its
        output is integer-valued or piecewise constant (step, sign, comparisons, shape-only inputs).
    expr(*arg_exprs, **attrs) -> Expr; elementwise ops only: the scalar body fusion renders to C/CUDA.
    needs_ctx: impl also takes ``ctx`` (the run context: seed, step, row keys, training flag).
    """

    name: str
    infer: Callable
    impl: Callable
    vjp: Optional[Callable]
    expr: Optional[Callable] = None
    needs_ctx: bool = False

    @property
    def elementwise(self) -> bool:
        return self.expr is not None


OPS: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.name in OPS:
        raise ValueError(f"op {opdef.name!r} registered twice")
    OPS[opdef.name] = opdef
    return opdef
