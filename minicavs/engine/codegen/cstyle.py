"""One renderer for C-family targets: a fused group's scalar expression DAG -> SSA lines.

Names are assigned in topological order and constants are typed by the group's dtype (``0.5f`` for
float32), so the same group always renders the same text (cache keys stay stable) and float32 kernels never
silently promote to double. Function names are the C99 ``<math.h>`` spellings, which CUDA shares.
"""
from __future__ import annotations

from ...core.dtypes import DType
from ...ops.scalar import Expr

BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
FUNCS = {"exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "fabs": "fabs", "fmax": "fmax",
         "pow": "pow"}


def literal(value: float, dtype: DType) -> str:
    text = repr(float(value))
    if "e" not in text and "." not in text and "inf" not in text and "nan" not in text:
        text += ".0"
    return text + dtype.c_suffix


def render_body(expr: Expr | list[Expr], args: list[str], dtype: DType, out: str | list[str],
                funcs: dict | None = None) -> list[str]:
    """Statements computing ``expr`` into ``out`` (or each of several expressions into its out, sharing
    subexpressions); ``args[i]`` is how argument i is read. ``funcs`` overrides the spelling of a math
    function (the C target's own vectorizable ``exp``/``tanh``)."""
    T = dtype.c_type
    fsuf = "f" if dtype.name == "float32" else ""
    funcs = funcs or {}
    names: dict[int, str] = {}
    lines: list[str] = []

    def rhs_of(e: Expr, a: list[str]) -> str:
        if e.op in BINARY:
            return f"{a[0]} {BINARY[e.op]} {a[1]}"
        if e.op == "neg":
            return f"-{a[0]}"
        if e.op == "step":
            return f"({a[0]} > 0 ? {literal(1, dtype)} : {literal(0, dtype)})"
        if e.op == "ge":
            return f"({a[0]} >= {a[1]} ? {literal(1, dtype)} : {literal(0, dtype)})"
        if e.op == "select":
            return f"({a[0]} != 0 ? {a[1]} : {a[2]})"
        if e.op == "sign":
            return f"(({a[0]} > 0) - ({a[0]} < 0))"
        return f"{funcs.get(e.op) or FUNCS[e.op] + fsuf}({', '.join(a)})"

    def leaf(e: Expr) -> str | None:
        if e.op == "arg":
            return args[e.value]
        if e.op == "const":
            return literal(e.value, dtype)
        return names.get(id(e))

    def emit(root: Expr) -> str:
        """Name ``root``, emitting the statements of its operands first. Iterative (an explicit stack, in
        post-order): a sum of hundreds of gathers is an expression as deep as its terms."""
        stack = [root]
        while stack:
            e = stack[-1]
            if leaf(e) is not None:
                stack.pop()
                continue
            pending = [x for x in e.args if leaf(x) is None]
            if pending:
                stack.extend(reversed(pending))
                continue
            stack.pop()
            name = f"t{len(names)}"
            lines.append(f"{T} {name} = ({T})({rhs_of(e, [leaf(x) for x in e.args])});")
            names[id(e)] = name
        return leaf(root)

    exprs, outs = (expr, out) if isinstance(expr, list) else ([expr], [out])
    results = [emit(e) for e in exprs]
    lines += [f"{o} = {r};" for o, r in zip(outs, results)]
    return lines
