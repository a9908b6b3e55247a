"""One renderer for C-family targets: a fused group's scalar expression DAG -> SSA lines.

Names are assigned in topological order and constants are typed by the group's dtype (``0.5f`` for
float32), so the same group always renders the same text (cache keys stay stable) and float32 kernels never
silently promote to double. Function names are the C99 ``<math.h>`` spellings, which CUDA shares.
"""
from __future__ import annotations

from ..dtypes import DType
from ..ops.scalar import Expr

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

    def emit(e: Expr) -> str:
        k = id(e)
        if k in names:
            return names[k]
        if e.op == "arg":
            return args[e.value]
        if e.op == "const":
            return literal(e.value, dtype)
        a = [emit(x) for x in e.args]
        if e.op in BINARY:
            rhs = f"{a[0]} {BINARY[e.op]} {a[1]}"
        elif e.op == "neg":
            rhs = f"-{a[0]}"
        elif e.op == "step":
            rhs = f"({a[0]} > 0 ? {literal(1, dtype)} : {literal(0, dtype)})"
        elif e.op == "ge":
            rhs = f"({a[0]} >= {a[1]} ? {literal(1, dtype)} : {literal(0, dtype)})"
        elif e.op == "sign":
            rhs = f"(({a[0]} > 0) - ({a[0]} < 0))"
        else:
            rhs = f"{funcs.get(e.op) or FUNCS[e.op] + fsuf}({', '.join(a)})"
        name = f"t{len(names)}"
        names[k] = name
        lines.append(f"{T} {name} = ({T})({rhs});")
        return name

    exprs, outs = (expr, out) if isinstance(expr, list) else ([expr], [out])
    results = [emit(e) for e in exprs]
    lines += [f"{o} = {r};" for o, r in zip(outs, results)]
    return lines
