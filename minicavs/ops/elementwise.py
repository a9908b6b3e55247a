"""Elementwise ops with numpy broadcasting. Each carries a scalar ``expr`` for the fusion pass."""
from __future__ import annotations

import itertools

from ..core.errors import ShapeError
from ..ir.graph import Node, fmt_shape
from . import scalar as S
from .reduce import sum_to
from .registry import OpDef, make_node, register
from .sources import as_node, constant


def broadcast_shapes(a: tuple, b: tuple) -> tuple:
    """numpy's rule, with None (rows known at run time) matching any length."""
    out = []
    for da, db in itertools.zip_longest(reversed(a), reversed(b), fillvalue=1):
        if da == db or db == 1:
            out.append(da)
        elif da == 1:
            out.append(db)
        elif da is None or db is None:
            out.append(db if da is None else da)
        else:
            raise ShapeError(f"shapes {fmt_shape(a)} and {fmt_shape(b)} do not broadcast")
    return tuple(reversed(out))


def _unary_infer(x, **attrs):
    if not x.dtype.is_float:
        raise ShapeError(f"needs a float input, got {x.dtype.name}")
    return x.shape, x.dtype


def _binary_infer(a, b):
    if a.dtype != b.dtype:
        raise ShapeError(f"dtypes {a.dtype.name} and {b.dtype.name} differ (shapes {fmt_shape(a.shape)} "
                         f"and {fmt_shape(b.shape)})")
    return broadcast_shapes(a.shape, b.shape), a.dtype


def _float_binary_infer(a, b):
    """For ops whose numpy kernel returns floats even for integers (true division): float operands only."""
    shape, dtype = _binary_infer(a, b)
    if not dtype.is_float:
        raise ShapeError(f"needs float operands, got {a.dtype.name}{fmt_shape(a.shape)} and "
                         f"{b.dtype.name}{fmt_shape(b.shape)}")
    return shape, dtype


def unbroadcast(g: Node, x: Node):
    """The part of gradient ``g`` that belongs to operand ``x`` of a broadcasting op."""
    return g if g.shape == x.shape else sum_to(g, x.shape)


def _unary(name, impl, vjp, expr):
    register(OpDef(name, infer=_unary_infer, impl=impl, vjp=vjp, expr=expr))

    def build(x: Node) -> Node:
        return make_node(name, (x,))
    build.__name__ = name
    return build


def _binary(name, impl, vjp, expr, infer=_binary_infer):
    register(OpDef(name, infer=infer, impl=impl, vjp=vjp, expr=expr))

    def build(a, b) -> Node:
        if not isinstance(a, Node) and not isinstance(b, Node):
            raise TypeError(f"{name}: at least one operand must be a Node")
        a = as_node(a, b) if not isinstance(a, Node) else a
        b = as_node(b, a)
        return make_node(name, (a, b))
    build.__name__ = name
    return build


neg = _unary("neg", lambda xp, x: -x, lambda g, y, x: (neg(g),), lambda x: -x)
exp = _unary("exp", lambda xp, x: xp.exp(x), lambda g, y, x: (mul(g, y),), S.exp)
log = _unary("log", lambda xp, x: xp.log(x), lambda g, y, x: (div(g, x),), S.log)
tanh = _unary("tanh", lambda xp, x: xp.tanh(x),
              lambda g, y, x: (mul(g, sub(1.0, mul(y, y))),), S.tanh)
# sigmoid in chainer's overflow-free form: no exp(-x) that overflows for large negative x
sigmoid = _unary("sigmoid", lambda xp, x: x.dtype.type(0.5) * xp.tanh(x.dtype.type(0.5) * x) + x.dtype.type(0.5),
                 lambda g, y, x: (mul(g, mul(y, sub(1.0, y))),),
                 lambda x: 0.5 * S.tanh(0.5 * x) + 0.5)
relu = _unary("relu", lambda xp, x: xp.maximum(x, x.dtype.type(0)),
              lambda g, y, x: (mul(g, step(x)),), lambda x: S.fmax(x, 0.0))
square = _unary("square", lambda xp, x: x * x,
                lambda g, y, x: (mul(g, mul(x, 2.0)),), lambda x: x * x)
sqrt = _unary("sqrt", lambda xp, x: xp.sqrt(x), lambda g, y, x: (div(mul(g, 0.5), y),), S.sqrt)
abs = _unary("abs", lambda xp, x: xp.abs(x), lambda g, y, x: (mul(g, sign(x)),), S.fabs)
step = _unary("step", lambda xp, x: (x > 0).astype(x.dtype), None, S.step)
sign = _unary("sign", lambda xp, x: xp.sign(x), None, S.sign)

register(OpDef("pow", infer=_unary_infer,
               impl=lambda xp, x, p: xp.power(x, x.dtype.type(p)),
               vjp=lambda g, y, x, p: (mul(g, mul(pow(x, p - 1.0), float(p))),),
               expr=lambda x, p: S.pow_(x, p)))


def pow(x: Node, p: float) -> Node:
    """x ** p for a constant exponent p."""
    if isinstance(p, Node):
        raise TypeError("pow: the exponent must be a Python number (pow by a constant)")
    return make_node("pow", (x,), {"p": float(p)})


add = _binary("add", lambda xp, a, b: a + b,
              lambda g, y, a, b: (unbroadcast(g, a), unbroadcast(g, b)), lambda a, b: a + b)
sub = _binary("sub", lambda xp, a, b: a - b,
              lambda g, y, a, b: (unbroadcast(g, a), unbroadcast(neg(g), b)), lambda a, b: a - b)
mul = _binary("mul", lambda xp, a, b: a * b,
              lambda g, y, a, b: (unbroadcast(mul(g, b), a), unbroadcast(mul(g, a), b)), lambda a, b: a * b)
div = _binary("div", lambda xp, a, b: a / b,
              lambda g, y, a, b: (unbroadcast(div(g, b), a), unbroadcast(neg(div(mul(g, y), b)), b)),
              lambda a, b: a / b, infer=_float_binary_infer)
ge = _binary("ge", lambda xp, a, b: (a >= b).astype(xp.result_type(a, b)), None, S.ge)


def _maximum_vjp(g, y, a, b):
    mask = ge(a, b)  # ties go to a, as in numpy's subgradient convention for maximum
    return unbroadcast(mul(g, mask), a), unbroadcast(mul(g, sub(1.0, mask)), b)


maximum = _binary("maximum", lambda xp, a, b: xp.maximum(a, b), _maximum_vjp, S.fmax)


def _accum_infer(*xs):
    shape = xs[0].shape
    for x in xs[1:]:
        if x.shape != shape or x.dtype != xs[0].dtype:
            raise ShapeError(f"accum operands differ: {fmt_shape(shape)} and {fmt_shape(x.shape)}")
    return shape, xs[0].dtype


def _accum_impl(xp, *xs):
    from ..core.sparse import add_all
    return add_all(xp, xs)


# accum: the n-ary sum autodiff uses for fan-out; the only op that accepts row-sparse operands.
register(OpDef("accum", infer=_accum_infer, impl=_accum_impl,
               vjp=lambda g, y, *xs: (g,) * len(xs),
               expr=lambda *xs: _sum_exprs(xs), sums=True))


def _sum_exprs(xs):
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


ACCUM_OPERANDS = 32   # operands of one accum node; more are summed by a tree of them (see accum)


def accum(*xs: Node) -> Node:
    """The sum of ``xs`` (dense or row-sparse). More than ``ACCUM_OPERANDS`` are added in chunks of that
    many and the partial sums added up in turn: an elementwise node becomes one generated kernel, whose
    operands the C runner passes at most 64 of (codegen/machine.py MAX_ARGS)."""
    while len(xs) > ACCUM_OPERANDS:
        xs = tuple(xs[i] if len(xs) - i == 1 else make_node("accum", xs[i:i + ACCUM_OPERANDS])
                   for i in range(0, len(xs), ACCUM_OPERANDS))
    return xs[0] if len(xs) == 1 else make_node("accum", xs)


def _where_infer(pred, a, b):
    shape, dtype = _binary_infer(a, b)
    if pred.dtype != dtype:
        raise ShapeError(f"the predicate is {pred.dtype.name}{fmt_shape(pred.shape)} but the operands are "
                         f"{dtype.name}: give a mask of the operands' dtype (nonzero where a is chosen), "
                         "such as ge(x, y) or step(x)")
    return broadcast_shapes(pred.shape, shape), dtype


def _where_vjp(g, y, pred, a, b):
    zero = constant(0.0, g.dtype)   # a literal in the fused kernel, not an array
    return None, unbroadcast(where(pred, g, zero), a), unbroadcast(where(pred, zero, g), b)


register(OpDef("where", infer=_where_infer, impl=lambda xp, p, a, b: xp.where(p != 0, a, b),
               vjp=_where_vjp, expr=S.select))


def where(pred, a, b) -> Node:
    """Elementwise choice: ``a`` where ``pred`` is nonzero, else ``b`` (numpy broadcasting over all three).

    ``pred`` is a mask of the operands' dtype, true where nonzero (NaN included: numpy's ``where``, C's
    ``static_cast<bool>``), such as ``ge(x, y)`` or ``step(x)``; ``x`` itself chooses ``a`` wherever x is
    nonzero, negative values included (before 2026-12 only positive values did); for a per-row choice in
    a static graph it has the row axis. Both operands are computed everywhere; the choice is made per
    element. What it guarantees for gradients: the cotangent reaches ``a`` only where ``pred`` is nonzero
    and ``b`` only where not, the other side getting exactly 0 (not ``0 * g``: a NaN or inf
    cotangent on the unselected side stays out). No gradient flows into ``pred``.

    What it cannot guarantee: an operand whose own derivative is infinite where it is not chosen (``sqrt``
    at 0, ``log`` at 0, ``1/x`` at 0) still poisons the gradient there (its value is merely not chosen),
    since its own backward multiplies that 0 by an infinite derivative (0 * inf = NaN). The safe pattern
    chooses the *input* first, so the unselected side only ever sees a harmless value::

        ok = ge(x, eps)                  # where sqrt is defined and smooth
        safe_x = where(ok, x, 1.0)       # 1 where it is not: sqrt(1) and its slope are finite
        y = where(ok, sqrt(safe_x), 0.0)

    (``cond`` of minicavs.ops.control runs only the taken branch, so it has no such caveat, but it chooses once
    for the whole value, not per element.)
    """
    nodes = [x for x in (pred, a, b) if isinstance(x, Node)]
    if not nodes:
        raise TypeError("where: at least one operand must be a Node")
    like = next((x for x in (a, b) if isinstance(x, Node)), nodes[0])
    pred, a, b = (as_node(x, like) for x in (pred, a, b))
    return make_node("where", (pred, a, b))
