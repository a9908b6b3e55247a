"""Scalar expressions: what an elementwise op computes per element, written once for every target.

An op's ``expr`` builds a small DAG of :class:`Expr` with Python operators and the functions below; the fusion
pass strings these together and codegen renders them to C or CUDA. :func:`evaluate` runs the same DAG with
numpy ufuncs: the oracle for generated kernels and the fallback when no compiler exists.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class Expr:
    __slots__ = ("op", "args", "value")

    def __init__(self, op: str, args: tuple = (), value: Any = None):
        self.op = op
        self.args = args
        self.value = value  # argument index for "arg", number for "const"

    def __add__(self, o): return Expr("add", (self, lift(o)))
    def __radd__(self, o): return Expr("add", (lift(o), self))
    def __sub__(self, o): return Expr("sub", (self, lift(o)))
    def __rsub__(self, o): return Expr("sub", (lift(o), self))
    def __mul__(self, o): return Expr("mul", (self, lift(o)))
    def __rmul__(self, o): return Expr("mul", (lift(o), self))
    def __truediv__(self, o): return Expr("div", (self, lift(o)))
    def __rtruediv__(self, o): return Expr("div", (lift(o), self))
    def __neg__(self): return Expr("neg", (self,))

    def __repr__(self) -> str:
        if self.op == "arg":
            return f"x{self.value}"
        if self.op == "const":
            return repr(self.value)
        return f"{self.op}({', '.join(map(repr, self.args))})"


def lift(x) -> Expr:
    return x if isinstance(x, Expr) else Expr("const", (), float(x))


def arg(i: int) -> Expr:
    return Expr("arg", (), i)


def _fn(name: str, n: int):
    def build(*args):
        assert len(args) == n, name
        return Expr(name, tuple(lift(a) for a in args))
    build.__name__ = name
    return build


exp, log, tanh, sqrt, fabs = (_fn(n, 1) for n in ("exp", "log", "tanh", "sqrt", "fabs"))
sign, step = _fn("sign", 1), _fn("step", 1)          # step(x) = 1 if x > 0 else 0
fmax, pow_, ge = _fn("fmax", 2), _fn("pow", 2), _fn("ge", 2)  # ge(a, b) = 1 if a >= b else 0
select = _fn("select", 3)   # select(p, a, b) = a if p != 0 else b (NaN is true; only the chosen one is read)

NUMPY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "neg": np.negative,
    "exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt, "fabs": np.abs, "sign": np.sign,
    "fmax": np.maximum, "pow": np.power,
    "step": lambda x: (x > 0).astype(x.dtype), "ge": lambda a, b: (a >= b).astype(np.result_type(a, b)),
    "select": lambda p, a, b: np.where(p != 0, a, b),
}


def evaluate(e: Expr, args: list, dtype=np.float64):
    """Evaluate an expression DAG with numpy; shared subexpressions are computed once. Iterative (an explicit
    stack, in post-order): a sum of hundreds of terms is an expression as deep as its terms."""
    memo: dict[int, Any] = {}
    stack = [e]
    while stack:
        x = stack[-1]
        k = id(x)
        if k in memo:
            stack.pop()
        elif x.op == "arg":
            memo[k] = args[x.value]
        elif x.op == "const":
            memo[k] = np.dtype(dtype).type(x.value)   # (a scalar: any array module's arrays take it)
        else:
            pending = [a for a in x.args if id(a) not in memo]
            if pending:
                stack.extend(reversed(pending))
            else:
                memo[k] = NUMPY[x.op](*(memo[id(a)] for a in x.args))
    return memo[id(e)]
