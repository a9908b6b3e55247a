"""The op test table: one :class:`OpSpec` per registered op (leaves excepted), shared by tests/ops/test_*.py.

A spec lists cases; a case declares its arguments (shape, with ``None`` for the run-time row axis, and a
domain-aware generator), how to build the node(s) with minicavs, and which reference to compare with. Every
case is checked forward against :mod:`tests.reference` in float32 and float64, and (unless the spec or case
says why not) its gradient against central finite differences with :func:`minicavs.train.testing.check_grads`.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

import minicavs.ops as ops
from minicavs.engine.executor import Executor, RunContext
from minicavs.ir.graph import rows_implicit
from minicavs.ops import make_node
from minicavs.core.sparse import RowSparse
from minicavs.train.testing import check_grads

from .. import reference as R

ROWS = 3  # run-time length of a None axis in gradient checks (forward checks also use 1)

TOL = {"float32": 1e-5, "float64": 1e-10}  # DESIGN.md: max|a - b| <= tol * max(1, max|ref|)


# --- input generators: gen(rng, shape) -> float64 or integer array -----------------------------------

def normal(rng, shape):
    return rng.standard_normal(shape)


def small(lo=-2.0, hi=2.0):
    """Inputs where exp and friends stay moderate."""
    def gen(rng, shape):
        return rng.uniform(lo, hi, shape)
    return gen


def positive(lo=0.3, hi=3.0):
    """For log, sqrt, fractional powers."""
    def gen(rng, shape):
        return rng.uniform(lo, hi, shape)
    return gen


def away(lo=0.1, hi=2.0):
    """Magnitude in [lo, hi], random sign: away from the kink at 0 of relu, abs, step, sign."""
    def gen(rng, shape):
        return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(lo, hi, shape)
    return gen


def grid(parity):
    """2k + parity + noise in (-0.3, 0.3): an even-grid and an odd-grid operand never tie (|a - b| > 0.4)."""
    def gen(rng, shape):
        return 2.0 * rng.integers(-2, 3, shape) + parity + rng.uniform(-0.3, 0.3, shape)
    return gen


def wide(scale):
    def gen(rng, shape):
        return scale * rng.standard_normal(shape)
    return gen


def ints(hi):
    """Integers in [0, hi): labels, row indices; ``hi=None``: below the run-time row count."""
    def gen(rng, shape, rows):
        return rng.integers(0, rows if hi is None else hi, shape)
    gen.uses_rows = True
    return gen


# --- the records -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Arg:
    shape: tuple
    gen: Callable = normal
    dtype: Optional[str] = None  # None: the float dtype under test; else "int64" / "int32"
    param: Optional[str] = None  # declare as a parameter of this name instead of an input

    @property
    def is_float(self) -> bool:
        return self.dtype is None


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple
    build: Callable                      # build(*nodes) -> Node | list[Node]; with no args build(dtype)
    kwargs: dict = field(default_factory=dict)  # attributes passed to the reference
    ref: Optional[Callable] = None       # replaces partial(REFERENCE[op], **kwargs)
    ctx: Optional[Callable] = None       # rows -> RunContext fields (also passed to the reference)
    grad: bool = True
    why: str = ""                        # why grad is False


@dataclass(frozen=True)
class OpSpec:
    name: str
    family: str                          # the test module: tests/ops/test_<family>.py
    cases: tuple
    nondiff: str = ""                    # why no gradient flows through the op (vjp=None or raising)
    raises: bool = False                 # the vjp raises: the op is itself a gradient (second order only)


def A(*shape, gen=normal, dtype=None, param=None) -> Arg:
    return Arg(tuple(shape), gen, dtype, param)


def I(*shape, hi, dtype="int64") -> Arg:  # noqa: E743
    return Arg(tuple(shape), ints(hi), dtype)


SPECS: dict[str, OpSpec] = {}


def spec(name, family, *cases, nondiff="", raises=False):
    assert name not in SPECS, name
    SPECS[name] = OpSpec(name, family, tuple(cases), nondiff, raises)


# --- sources -----------------------------------------------------------------------------------------

_CM = [[1.5, -2.0, 0.25], [3.0, 0.0, -0.125]]
spec("constant", "sources",
     Case("matrix", (), lambda dt: ops.constant(_CM, dt), kwargs={"value": _CM, "dtype": np.float64}),
     Case("scalar", (), lambda dt: ops.constant(0.5, dt), kwargs={"value": 0.5, "dtype": np.float64}),
     nondiff="a leaf holding a value baked into the graph: nothing to differentiate")
for _name, _fn in (("zeros_like", ops.zeros_like), ("ones_like", ops.ones_like)):
    spec(_name, "sources",
         Case("rows", (A(None, 3),), _fn),
         Case("scalar", (A(),), _fn),
         Case("3d", (A(2, 1, 3),), _fn),
         nondiff="the value ignores the input's values (only its shape and dtype matter): gradient 0")


# --- elementwise -------------------------------------------------------------------------------------

UNARY_SHAPES = [(), (1,), (None, 3), (2, 1, 3), (None, 1)]


def _sid(shape):
    return "x".join("N" if d is None else str(d) for d in shape) or "scalar"


def _unary_cases(build, gen=normal, **kw):
    return tuple(Case(_sid(s), (Arg(s, gen),), build, **kw) for s in UNARY_SHAPES)


spec("neg", "elementwise", *_unary_cases(ops.neg))
spec("exp", "elementwise", *_unary_cases(ops.exp, small()))
spec("log", "elementwise", *_unary_cases(ops.log, positive()))
spec("tanh", "elementwise", *_unary_cases(ops.tanh),
     Case("wide", (A(None, 4, gen=wide(8.0)),), ops.tanh))
spec("sigmoid", "elementwise", *_unary_cases(ops.sigmoid),
     Case("wide", (A(None, 4, gen=wide(8.0)),), ops.sigmoid),
     Case("huge", (A(None, 4, gen=wide(300.0)),), ops.sigmoid, grad=False,
          why="forward only: checks that very negative inputs neither overflow nor warn"))
spec("relu", "elementwise", *_unary_cases(ops.relu, away()))
spec("square", "elementwise", *_unary_cases(ops.square))
spec("sqrt", "elementwise", *_unary_cases(ops.sqrt, positive()))
spec("abs", "elementwise", *_unary_cases(ops.abs, away()))
spec("step", "elementwise", *_unary_cases(ops.step, away()),
     nondiff="piecewise constant (0 for x <= 0, 1 above): derivative 0 almost everywhere")
spec("sign", "elementwise", *_unary_cases(ops.sign, away()),
     nondiff="piecewise constant: derivative 0 almost everywhere")


def _pow(p, gen):
    return Case(f"p={p}", (A(None, 3, gen=gen),), lambda x: ops.pow(x, p), kwargs={"p": p})


spec("pow", "elementwise",
     _pow(2.0, normal), _pow(3.0, normal), _pow(1.0, normal), _pow(0.5, positive()), _pow(-1.5, positive()),
     _pow(1.7, positive()),
     Case("scalar-shape", (A(gen=positive()),), lambda x: ops.pow(x, 2.5), kwargs={"p": 2.5}),
     Case("operator", (A(2, 1, 3),), lambda x: x ** 2, kwargs={"p": 2.0}))

BINARY_SHAPES = [((), ()), ((None, 3), (3,)), ((3,), (None, 3)), ((None, 3), (None, 1)), ((2, 1, 3), (4, 1)),
                 ((None, 3), ()), ((1,), (None, 1)), ((None, 1, 3), (2, 1))]


def _binary_cases(build, pyop, gen_a=normal, gen_b=normal):
    cases = [Case(f"{_sid(a)}-{_sid(b)}", (Arg(a, gen_a), Arg(b, gen_b)), build) for a, b in BINARY_SHAPES]
    # a Python number on either side becomes a constant of the other operand's dtype
    c_a = 2.5 if gen_a is normal else gen_a(np.random.default_rng(1), ()).item()
    c_b = -1.25 if gen_b is normal else gen_b(np.random.default_rng(2), ()).item()
    cases.append(Case("node-number", (Arg((None, 3), gen_a),), lambda a: build(a, c_b),
                      ref=lambda a: pyop(a, c_b)))
    cases.append(Case("number-node", (Arg((None, 3), gen_b),), lambda b: build(c_a, b),
                      ref=lambda b: pyop(c_a, b)))
    return tuple(cases)


spec("add", "elementwise", *_binary_cases(ops.add, R.add))
spec("sub", "elementwise", *_binary_cases(ops.sub, R.sub))
spec("mul", "elementwise", *_binary_cases(ops.mul, R.mul))
spec("div", "elementwise", *_binary_cases(ops.div, R.div, normal, away(0.5, 2.0)))
spec("maximum", "elementwise", *_binary_cases(ops.maximum, R.maximum, grid(0), grid(1)))
spec("ge", "elementwise", *_binary_cases(ops.ge, R.ge, grid(0), grid(1)),
     nondiff="a comparison: piecewise constant, derivative 0 almost everywhere")

WHERE_SHAPES = [((), (), ()), ((None, 3), (None, 3), (None, 3)), ((None, 1), (None, 3), (3,)),
                ((None, 3), (), (None, 3)), ((2, 1, 3), (4, 1), (3,)), ((), (None, 3), (None, 1))]
spec("where", "elementwise",
     *(Case(f"{_sid(p)}-{_sid(a)}-{_sid(b)}", (Arg(p, away()), Arg(a), Arg(b)), ops.where)
       for p, a, b in WHERE_SHAPES),
     Case("number-a", (A(None, 3, gen=away()), A(None, 3)), lambda p, b: ops.where(p, 1.5, b),
          ref=lambda p, b: R.where(p, 1.5, b)),
     Case("number-b", (A(None, 3, gen=away()), A(None, 3)), lambda p, a: ops.where(p, a, -0.5),
          ref=lambda p, a: R.where(p, a, -0.5)))


def _sparse(g, idx, table):
    """lookup_grad(g, idx, table): the row-sparse table gradient (``table`` gives only the dense shape)."""
    return make_node("lookup_grad", (g, idx, table))


_NOT_SECOND = "a row-sparse operand comes from lookup_grad, whose own gradient is not defined"


spec("accum", "elementwise",
     Case("three", (A(None, 3), A(None, 3), A(None, 3)), ops.accum),
     Case("scalar", (A(), A()), ops.accum),
     Case("3d", (A(2, 1, 3), A(2, 1, 3)), ops.accum),
     Case("sparse+dense", (A(None, 3), I(None, hi=5), A(5, 3)),
          lambda g, idx, d: make_node("accum", (_sparse(g, idx, d), d)),
          ref=lambda g, idx, d: R.lookup_grad(g, idx, d) + d, grad=False, why=_NOT_SECOND),
     Case("dense+sparse+sparse", (A(None, 3), I(None, hi=5), A(2, 3), I(2, hi=5), A(5, 3)),
          lambda g, i, h, j, t: make_node("accum", (t, _sparse(g, i, t), _sparse(h, j, t))),
          ref=lambda g, i, h, j, t: t + R.lookup_grad(g, i, t) + R.lookup_grad(h, j, t), grad=False,
          why=_NOT_SECOND),
     Case("sparse+sparse", (A(None, 3), I(None, hi=5), A(2, 3), I(2, hi=5), A(5, 3)),
          lambda g, i, h, j, t: make_node("accum", (_sparse(g, i, t), _sparse(h, j, t))),
          ref=lambda g, i, h, j, t: R.lookup_grad(g, i, t) + R.lookup_grad(h, j, t), grad=False,
          why=_NOT_SECOND))


# --- reductions --------------------------------------------------------------------------------------

REDUCE_CASES = [((), None, False), ((None, 3), None, False), ((None, 3), 0, False), ((None, 3), -1, False),
                ((2, 3, 4), (0, 2), False), ((2, 3, 4), 1, True), ((None, 1, 3), (-1, -2), True),
                ((None, 3), None, True), ((2, 3, 4), (), False)]


def _reduce_cases(fn):
    return tuple(Case(f"{_sid(s)}-axis{ax}-keep{int(k)}", (Arg(s),),
                      lambda x, ax=ax, k=k: fn(x, axis=ax, keepdims=k), kwargs={"axes": ax, "keepdims": k})
                 for s, ax, k in REDUCE_CASES)


spec("sum", "reduce", *_reduce_cases(ops.sum))
spec("mean", "reduce", *_reduce_cases(ops.mean))
spec("sum_to", "reduce", *(
    Case(f"{_sid(s)}-to-{_sid(t)}", (Arg(s),), lambda x, t=t: ops.sum_to(x, t), kwargs={"shape": t})
    for s, t in [((None, 3), (3,)), ((None, 3), (1, 3)), ((2, 3, 4), (3, 1)), ((None, 3), (None, 1)),
                 ((4,), ()), ((None, 2, 3), (2, 1)), ((2, 1, 3), (1, 1, 3))]))

BCAST_CASES = [((3,), (None, 3), (0,), False), ((None, 1), (None, 4), (1,), True), ((), (2, 3), (0, 1), False),
               ((2, 4), (2, 3, 4), (1,), False), ((), (), (), False), ((None,), (None, 3, 2), (1, 2), False)]


def _bcast_cases(fn):
    return tuple(Case(f"{_sid(g)}-to-{_sid(x)}-keep{int(k)}", (Arg(g), Arg(x)),
                      lambda g, x, axes=axes, k=k: fn(g, x, axes, k), kwargs={"axes": axes, "keepdims": k})
                 for g, x, axes, k in BCAST_CASES)


spec("broadcast_like", "reduce", *_bcast_cases(ops.broadcast_like))
spec("mean_grad", "reduce", *_bcast_cases(ops.mean_grad))


# --- shape ops ---------------------------------------------------------------------------------------

def _implicit(fn):
    """Build inside a vertex-function scope: shape/axis arguments exclude the row axis."""
    def build(*xs):
        with rows_implicit():
            return fn(*xs)
    return build


spec("reshape", "shape",
     Case("rows-split", (A(None, 6),), lambda x: ops.reshape(x, (None, 2, 3)), kwargs={"shape": (None, 2, 3)}),
     Case("flatten", (A(2, 3),), lambda x: ops.reshape(x, (6,)), kwargs={"shape": (6,)}),
     Case("rows-minus1", (A(None, 2, 3),), lambda x: ops.reshape(x, (None, -1)), kwargs={"shape": (None, 6)}),
     Case("scalar-up", (A(),), lambda x: ops.reshape(x, (1, 1)), kwargs={"shape": (1, 1)}),
     Case("to-scalar", (A(1,),), lambda x: ops.reshape(x, ()), kwargs={"shape": ()}),
     Case("implicit-rows", (A(None, 6),), _implicit(lambda x: ops.reshape(x, (3, 2))),
          kwargs={"shape": (None, 3, 2)}))
spec("transpose", "shape",
     Case("3d", (A(2, 3, 4),), lambda x: ops.transpose(x, (2, 0, 1)), kwargs={"perm": (2, 0, 1)}),
     Case("rows", (A(None, 3, 2),), lambda x: ops.transpose(x, (0, 2, 1)), kwargs={"perm": (0, 2, 1)}),
     Case("default", (A(2, 3),), ops.transpose, kwargs={"perm": (1, 0)}),
     Case("size1", (A(1, 3, 1),), lambda x: ops.transpose(x, (2, 1, 0)), kwargs={"perm": (2, 1, 0)}),
     Case("implicit-rows", (A(None, 3, 2),), _implicit(ops.transpose), kwargs={"perm": (0, 2, 1)}))
spec("concat", "shape",
     Case("rows-last", (A(None, 2), A(None, 3)), lambda a, b: ops.concat([a, b]), kwargs={"axis": -1}),
     Case("axis0", (A(2, 3), A(1, 3), A(4, 3)), lambda *xs: ops.concat(xs, axis=0), kwargs={"axis": 0}),
     Case("middle", (A(2, 1, 2), A(2, 3, 2)), lambda a, b: ops.concat([a, b], axis=1), kwargs={"axis": 1}),
     Case("implicit-rows", (A(None, 1), A(None, 2)), _implicit(lambda a, b: ops.concat([a, b], axis=0)),
          kwargs={"axis": 1}))
spec("slice", "shape",
     Case("rows", (A(None, 5),), lambda x: ops.slice_(x, 1, 4), kwargs={"axis": -1, "start": 1, "stop": 4}),
     Case("axis0", (A(4, 3),), lambda x: ops.slice_(x, 0, 1, axis=0), kwargs={"axis": 0, "start": 0, "stop": 1}),
     Case("middle", (A(2, 3, 4),), lambda x: ops.slice_(x, 1, 3, axis=1),
          kwargs={"axis": 1, "start": 1, "stop": 3}),
     Case("split-sizes", (A(None, 5),), lambda x: ops.split(x, [2, 3]),
          ref=lambda x: [R.slice(x, -1, 0, 2), R.slice(x, -1, 2, 5)]),
     Case("split-equal", (A(None, 6),), lambda x: ops.split(x, 3),
          ref=lambda x: [R.slice(x, 1, 0, 2), R.slice(x, 1, 2, 4), R.slice(x, 1, 4, 6)]),
     Case("implicit-rows", (A(None, 4, 2),), _implicit(lambda x: ops.slice_(x, 1, 3, axis=0)),
          kwargs={"axis": 1, "start": 1, "stop": 3}))
spec("unslice", "shape",
     Case("rows", (A(None, 2), A(None, 5)), lambda g, x: make_node(
         "unslice", (g, x), {"axis": 1, "start": 1, "stop": 3}), kwargs={"axis": 1, "start": 1, "stop": 3}),
     Case("axis0", (A(1, 3), A(4, 3)), lambda g, x: make_node(
         "unslice", (g, x), {"axis": 0, "start": 2, "stop": 3}), kwargs={"axis": 0, "start": 2, "stop": 3}))


# --- linear algebra ----------------------------------------------------------------------------------

spec("matmul", "linalg", *(
    Case(f"{_sid(a)}@{_sid(b)}", (Arg(a), Arg(b)), ops.matmul)
    for a, b in [((2, 3), (3, 4)), ((None, 3), (3, 4)), ((2, 1, 3, 4), (5, 4, 2)), ((1, 3), (3, 1)),
                 ((None, 2, 3), (3, 4)), ((3, 4), (None, 4, 2))]),
     Case("operator", (A(None, 3), A(3, 2)), lambda a, b: a @ b))
spec("steps_matmul", "linalg",
     Case("steps", (A(None, 4, 3), A(None, 4, 2)), ops.linalg.steps_matmul),
     Case("one_step", (A(None, 1, 1), A(None, 1, 5)), ops.linalg.steps_matmul))
spec("linear", "linalg",
     Case("params", (A(None, 3), A(3, 4, param="W"), A(4, param="b")), ops.linear),
     Case("inputs", (A(2, 3), A(3, 4), A(4)), ops.linear),
     Case("size1", (A(None, 1), A(1, 1, param="W"), A(1, param="b")), ops.linear))


# --- control flow (minicavs/ops/control.py) --------------------------------------------------------------

def _control():
    from minicavs import control
    return control


def _rnn(W):
    def body(x, h):
        h2 = ops.tanh(ops.matmul(x, W) + h)
        return [h2 * 2.0], h2
    return body


def _rnn_ref(W):
    def body(xs, states):
        h2 = np.tanh(xs[0] @ W + states[0])
        return [h2 * 2.0], [h2]
    return body


def _foreach(xs, h, W, reverse=False):
    (y,), hT = _control().foreach(_rnn(W), xs, h, reverse=reverse)
    return [y, hT]


def _while(x, a):
    outs, xT, count = _control().while_loop(lambda v: ops.step(3.0 - ops.sum(ops.abs(v))),
                                            lambda v: ([v * a], v * a + 0.5), x, 4)
    return [outs[0], xT]


def _while_ref(x, a):
    return R.while_loop(lambda vs: R.step(3.0 - np.abs(vs[0]).sum()), lambda vs: ([vs[0] * a], [vs[0] * a + 0.5]),
                        [x], 4)[:2]


spec("foreach", "control",
     Case("steps", (A(4, 2, 3), A(2, 3), A(3, 3, param="W")), _foreach,
          ref=lambda xs, h, W: R.foreach(_rnn_ref(W), [xs], [h])),
     Case("rows", (A(None, 4, 3), A(None, 3), A(3, 3, param="W")), _foreach,
          ref=lambda xs, h, W: R.foreach(_rnn_ref(W), [xs], [h], rows=True)),
     Case("reverse", (A(4, 2, 3), A(2, 3), A(3, 3, param="W")), lambda *a: _foreach(*a, reverse=True),
          ref=lambda xs, h, W: R.foreach(_rnn_ref(W), [xs], [h], reverse=True)),
     Case("one-step", (A(1, 2, 3), A(2, 3), A(3, 3, param="W")), _foreach,
          ref=lambda xs, h, W: R.foreach(_rnn_ref(W), [xs], [h])))
spec("while_loop", "control",
     Case("vector", (A(3, gen=small(-0.5, 0.5)), A(3, gen=small(0.5, 1.5), param="a")), _while, ref=_while_ref))
spec("cond", "control",
     *(Case(f"{side}-{_sid(s)}", (A(gen=small(lo, hi)), Arg(s), A(3, param="w")),
            lambda p, x, w: _control().cond(ops.step(p), lambda v: ops.tanh(v * w), lambda v: ops.exp(v) - w, x),
            ref=lambda p, x, w: R.cond(R.step(p), lambda v: np.tanh(v * w), lambda v: np.exp(v) - w, x))
       for side, lo, hi in (("then", 0.5, 2.0), ("else", -2.0, -0.5)) for s in ((3,), (None, 3))))
spec("item", "control",
     Case("final-state", (A(4, 2, 3), A(2, 3), A(3, 3, param="W")), lambda *a: _foreach(*a)[1],
          ref=lambda xs, h, W: R.item(R.foreach(_rnn_ref(W), [xs], [h]), 1)))


# --- neural-network ops ------------------------------------------------------------------------------

def _softmax_cases(fn):
    return (Case("rows", (A(None, 4),), fn, kwargs={"axis": -1}),
            Case("axis0", (A(3, 2),), lambda x: fn(x, axis=0), kwargs={"axis": 0}),
            Case("vector", (A(4),), fn, kwargs={"axis": -1}),
            Case("middle", (A(2, 3, 4),), lambda x: fn(x, axis=1), kwargs={"axis": 1}),
            Case("one-class", (A(None, 1),), fn, kwargs={"axis": -1}),
            Case("wide", (A(None, 5, gen=wide(10.0)),), fn, kwargs={"axis": -1}),
            Case("implicit-rows", (A(None, 3, 2),), _implicit(lambda x: fn(x, axis=0)), kwargs={"axis": 1}))


spec("softmax", "nn", *_softmax_cases(ops.softmax))
spec("log_softmax", "nn", *_softmax_cases(ops.log_softmax))
spec("softmax_cross_entropy", "nn",
     Case("rows", (A(None, 4), I(None, hi=4)), ops.softmax_cross_entropy),
     Case("weighted", (A(None, 4), I(None, hi=4), A(None)), ops.softmax_cross_entropy),
     Case("single", (A(4), I(hi=4)), ops.softmax_cross_entropy),
     Case("3d-int32", (A(2, 3, 5), I(2, 3, hi=5, dtype="int32")), ops.softmax_cross_entropy),
     Case("wide", (A(None, 5, gen=wide(10.0)), I(None, hi=5)), ops.softmax_cross_entropy))
spec("xent_grad", "nn",
     Case("rows", (A(None), A(None, 4), I(None, hi=4)), lambda g, x, y: make_node("xent_grad", (g, x, y))),
     Case("3d", (A(2, 3), A(2, 3, 5), I(2, 3, hi=5)), lambda g, x, y: make_node("xent_grad", (g, x, y))),
     nondiff="the gradient of softmax_cross_entropy: second-order derivatives are not supported",
     raises=True)
spec("mse", "nn",
     Case("same", (A(None, 3), A(None, 3)), ops.mse),
     Case("broadcast", (A(None, 3), A(3)), ops.mse),
     Case("scalar", (A(), A()), ops.mse),
     Case("number", (A(2, 2),), lambda a: ops.mse(a, 0.5), ref=lambda a: R.mse(a, 0.5)))


def _dropout(cid, shape, p, site, ctx=None, **kw):
    return Case(cid, (Arg(shape),), lambda x: ops.dropout(x, p, site=site), kwargs={"p": p, "site": site},
                ctx=ctx, **kw)


spec("dropout", "nn",
     _dropout("rows", (None, 4), 0.3, 5, lambda rows: {"seed": 3, "step": 2}),
     _dropout("3d", (2, 3, 2), 0.5, 1, lambda rows: {"seed": 11, "step": 0}),
     _dropout("scalar", (), 0.25, 2),
     _dropout("vector", (6,), 0.4, 9, lambda rows: {"seed": 1, "step": 7}),
     _dropout("row-keys", (None, 3), 0.5, 4,
              lambda rows: {"seed": 5, "step": 1, "row_keys": np.arange(rows, dtype=np.uint64) * 7 + 100}),
     _dropout("eval", (None, 4), 0.5, 6, lambda rows: {"training": False}),
     _dropout("p0", (None, 4), 0.0, 8))
spec("lookup", "nn",
     Case("param", (A(5, 3, param="table"), I(None, hi=5)), ops.lookup),
     Case("2d-idx", (A(4, 2), I(2, 3, hi=4)), ops.lookup),
     Case("1d-table", (A(6), I(None, hi=6)), ops.lookup),
     Case("scalar-idx", (A(5, 3), I(hi=5, dtype="int32")), ops.lookup),
     Case("rows-table", (A(None, 3), I(4, hi=None)), ops.lookup))
spec("lookup_grad", "nn",
     Case("rows", (A(None, 3), I(None, hi=5), A(5, 3)), _sparse),
     Case("2d-idx", (A(2, 2, 3), I(2, 2, hi=5), A(5, 3)), _sparse),
     Case("1d-table", (A(None), I(None, hi=4), A(4)), _sparse),
     Case("rows-table", (A(2, 3), I(2, hi=None), A(None, 3)), _sparse),
     nondiff="the (row-sparse) gradient of lookup: second-order derivatives are not supported", raises=True)
spec("densify", "nn",
     Case("dense", (A(None, 3),), lambda x: make_node("densify", (x,))),
     Case("sparse", (A(None, 3), I(None, hi=5), A(5, 3)), lambda g, idx, t: ops.densify(_sparse(g, idx, t)),
          ref=lambda g, idx, t: R.densify(R.lookup_grad(g, idx, t)), grad=False, why=_NOT_SECOND))


# --- message ops (identities marking a vertex function's outputs) ------------------------------------

if hasattr(ops, "scatter_node"):  # (if ops/message.py is missing, the completeness test says so)
    spec("scatter", "message", Case("rows", (A(None, 3),), lambda x: ops.scatter_node(x)))
    spec("push", "message", Case("rows", (A(None, 3),), lambda x: ops.push_node(x, "h")))


# --- the checks --------------------------------------------------------------------------------------

def params_for(family: str, gradient: bool = False) -> list:
    """pytest params (spec, case) of one family; for gradients only the differentiable cases."""
    out = []
    for s in SPECS.values():
        if s.family != family:
            continue
        for c in s.cases:
            if gradient and (s.raises or not c.grad or not any(a.is_float for a in c.args)):
                continue
            out.append(_param(s, c))
    return out


def _param(s, c):
    import pytest
    return pytest.param(s, c, id=f"{s.name}-{c.id}")


def _run_shape(shape, rows):
    return tuple(rows if d is None else d for d in shape)


def build(case: Case, dtype: str, rows: int, seed: int):
    """Nodes, outputs, feeds, params and raw values for one case."""
    rng = np.random.default_rng(seed)
    nodes, values, feeds, params = [], [], {}, {}
    for i, a in enumerate(case.args):
        dt = a.dtype or dtype
        node = ops.param_node(a.param, a.shape, dt) if a.param else ops.input(a.shape, dt, name=f"x{i}")
        shape = _run_shape(a.shape, rows)
        value = a.gen(rng, shape, rows) if getattr(a.gen, "uses_rows", False) else a.gen(rng, shape)
        value = np.asarray(value).astype(dt)
        nodes.append(node)
        values.append(value)
        if a.param:
            params[a.param] = value
        else:
            feeds[node] = value
    outs = case.build(*nodes) if case.args else case.build(dtype)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return nodes, outs, feeds, params, values


def case_seed(spec_: OpSpec, case: Case) -> int:
    return zlib.crc32(f"{spec_.name}/{case.id}".encode())


def dense_of(value):
    """The dense array a run-time value stands for (RowSparse re-densified here, independently)."""
    if isinstance(value, RowSparse):
        out = np.zeros(value.shape, dtype=value.rows.dtype)
        np.add.at(out, np.asarray(value.indices), np.asarray(value.rows))
        return out
    return np.asarray(value)


def assert_matches(actual, expected, dtype: str, what: str):
    actual = np.asarray(actual)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs reference {expected.shape}"
    if not actual.size:
        return
    scale = max(1.0, float(np.max(np.abs(expected))))
    err = float(np.max(np.abs(actual.astype(np.float64) - expected)))
    assert err <= TOL[dtype] * scale, f"{what}: max|diff| {err:.3e} > {TOL[dtype]:g} * {scale:.3g}"


def check_forward(spec_: OpSpec, case: Case, dtype: str, rows: int):
    nodes, outs, feeds, params, values = build(case, dtype, rows, case_seed(spec_, case))
    for o in outs:
        # (a result of a control-flow op with several is an item of the op's node)
        made = o.inputs[0].op if o.op == "item" and spec_.name != "item" else o.op
        assert made == spec_.name, f"built {made}, expected {spec_.name}"
    ctx_fields = case.ctx(rows) if case.ctx else {}
    before = [v.copy() for v in values]
    got = Executor(outs).run(feeds, params, RunContext(**ctx_fields))
    for v, b in zip(values, before):
        np.testing.assert_array_equal(v, b, err_msg="an op modified its input in place")
    args64 = [v.astype(np.float64) if a.is_float else v for a, v in zip(case.args, values)]
    ref = case.ref or R.REFERENCE[spec_.name]
    kwargs = {} if case.ref else dict(case.kwargs)
    expected = ref(*args64, **kwargs, **ctx_fields)
    expected = list(expected) if isinstance(expected, list) else [expected]
    assert len(expected) == len(outs)
    for k, (o, g, e) in enumerate(zip(outs, got, expected)):
        what = f"{spec_.name}[{case.id}] {dtype} rows={rows} output {k}"
        if ops.is_row_sparse(o):
            assert isinstance(g, RowSparse), f"{what}: expected a RowSparse value, got {type(g).__name__}"
        else:
            assert not isinstance(g, RowSparse), f"{what}: a dense op returned a RowSparse value"
        d = dense_of(g)
        assert d.dtype == o.dtype.np, f"{what}: dtype {d.dtype}, node declares {o.dtype.name}"
        assert d.shape == _run_shape(o.shape, rows), f"{what}: shape {d.shape}, node declares {o.shape}"
        assert_matches(d, e, dtype, what)


def check_gradient(spec_: OpSpec, case: Case, rows: int = ROWS):
    nodes, outs, feeds, params, values = build(case, "float64", rows, case_seed(spec_, case))
    wrt = [n for n, a in zip(nodes, case.args) if a.is_float]
    ctx = RunContext(**case.ctx(rows)) if case.ctx else None
    check_grads(outs, wrt, feeds, params, eps=1e-6, rtol=1e-6, atol=1e-8, ctx=ctx)


def check_backward_types(spec_: OpSpec, case: Case, dtype: str, rows: int):
    """Every node of the backward graph (vjp rules, sum_to, accum, ...) yields at run time exactly the dtype
    and shape it declares: no silent float64 promotion inside a float32 gradient, no stray broadcasting."""
    from minicavs.ops.autodiff import grad
    from minicavs.ir.graph import Graph
    nodes, outs, feeds, params, values = build(case, dtype, rows, case_seed(spec_, case))
    wrt = [n for n, a in zip(nodes, case.args) if a.is_float]
    cots = [ops.input(o.shape, o.dtype, name=f"cot{k}") for k, o in enumerate(outs)]
    rng = np.random.default_rng(0)
    for c in cots:
        feeds[c] = rng.standard_normal(_run_shape(c.shape, rows)).astype(c.dtype.np)
    graph = Graph(grad(outs, wrt, cots))
    ctx = RunContext(**case.ctx(rows)) if case.ctx else RunContext()
    for n, v in zip(graph.nodes, Executor(graph.nodes).run(feeds, params, ctx)):
        if "_types" in n.attrs:   # a control-flow node's tuple: its items are checked
            assert isinstance(v, tuple) and len(v) == len(n.attrs["_types"]), n.label()
            continue
        d = dense_of(v)
        assert d.dtype == n.dtype.np, f"{n.label()}: dtype {d.dtype}, declared {n.dtype.name}"
        assert d.shape == _run_shape(n.shape, rows), f"{n.label()}: shape {d.shape}, declared {n.shape}"


def expr_params(family: str) -> list:
    """(spec, case) pairs of the family's elementwise ops (those with a fusion ``expr``)."""
    from minicavs.ops.registry import OPS
    return [_param(s, c) for s in SPECS.values() if s.family == family and OPS[s.name].expr is not None
            for c in s.cases]


def check_expr(spec_: OpSpec, case: Case, dtype: str, rows: int):
    """The op's scalar ``expr`` (what fusion renders to C/CUDA), evaluated by the numpy oracle of
    minicavs.ops.scalar on the node's input values, agrees with the reference like the kernel does."""
    from minicavs.ops import scalar as S
    from minicavs.ops.registry import OPS
    nodes, outs, feeds, params, values = build(case, dtype, rows, case_seed(spec_, case))
    (out,) = outs
    if any(ops.is_row_sparse(x) for x in out.inputs):
        return  # a row-sparse accum is not elementwise: fusion never sees it
    args = Executor(list(out.inputs)).run(feeds, params) if out.inputs else []
    e = OPS[out.op].expr(*(S.arg(k) for k in range(len(args))), **out.attrs)
    if e is None:
        return  # declared not fusable (a constant array)
    got = S.evaluate(S.lift(e), [np.asarray(a) for a in args], dtype=np.dtype(dtype))
    got = np.broadcast_to(np.asarray(got), _run_shape(out.shape, rows))
    assert got.dtype == np.dtype(dtype), f"expr of {out.op} evaluates to {got.dtype}"
    args64 = [v.astype(np.float64) if a.is_float else v for a, v in zip(case.args, values)]
    ref = case.ref or R.REFERENCE[spec_.name]
    expected = ref(*args64, **({} if case.ref else case.kwargs))
    assert_matches(got, expected, dtype, f"expr of {spec_.name}[{case.id}] {dtype}")
