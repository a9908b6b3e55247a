"""Plain-numpy reference semantics for every op in ``minicavs.ops.registry.OPS`` (JAX's lax_reference style).

Each function takes numpy arrays plus the op's attributes under the names the IR stores them (``axes``,
``keepdims``, ``perm``, ...), but the values may be written as a user would (negative axes allowed). Every
function is written from the op's documented meaning, independently of minicavs' kernels: this module never
imports minicavs, so a test comparing the two can fail.

``input``/``param`` (and the message leaves ``gather``/``pull``) have no reference: the executor supplies
their values. They are listed in :data:`LEAVES`.
"""
from __future__ import annotations

import numpy as np

LEAVES = frozenset({"input", "param", "gather", "pull"})
#: ops that never run: ``tuple_ct`` carries the cotangents of a control-flow node's results to that op's
#: gradient rule, which takes it apart when it builds the backward graph.
STRUCTURAL = frozenset({"tuple_ct"})


# --- sources -----------------------------------------------------------------------------------------

def constant(value, dtype):
    return np.array(value, dtype=dtype)


def zeros_like(x):
    return np.zeros(np.shape(x), dtype=np.asarray(x).dtype)


def ones_like(x):
    return np.ones(np.shape(x), dtype=np.asarray(x).dtype)


# --- elementwise unary -------------------------------------------------------------------------------

def neg(x):
    return 0.0 - x


def exp(x):
    return np.exp(x)


def log(x):
    return np.log(x)


def tanh(x):
    e2 = np.exp(-2.0 * np.abs(x))  # tanh(|x|) = (1 - e^{-2|x|}) / (1 + e^{-2|x|}), odd extension
    return np.sign(x) * (1.0 - e2) / (1.0 + e2)


def sigmoid(x):
    e = np.exp(-np.abs(x))  # 1/(1+e^{-x}) for x >= 0, e^{x}/(1+e^{x}) below: no overflow anywhere
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def relu(x):
    return np.where(x > 0, x, 0.0)


def square(x):
    return x * x


def sqrt(x):
    return np.power(x, 0.5)


def abs(x):  # noqa: A001  (the op's name)
    return np.where(x < 0, -x, x)


def step(x):
    return np.where(x > 0, 1.0, 0.0)


def sign(x):
    return np.where(x > 0, 1.0, np.where(x < 0, -1.0, 0.0))


def pow(x, p):  # noqa: A001
    return np.power(x, p)


# --- elementwise binary ------------------------------------------------------------------------------

def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b


def div(a, b):
    return a / b


def maximum(a, b):
    return np.where(a >= b, a, b)


def ge(a, b):
    return np.where(a >= b, 1.0, 0.0)


def where(p, a, b):
    return np.where(np.asarray(p, np.float64) != 0, np.asarray(a, np.float64), np.asarray(b, np.float64))


def accum(*xs):
    """n-ary sum; operands here are dense (a row-sparse operand is given as its dense equivalent)."""
    total = np.zeros(np.shape(xs[0]))
    for x in xs:
        total = total + x
    return total


# --- reductions and their adjoints -------------------------------------------------------------------

def _axes(ndim, axes):
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, int):
        axes = (axes,)
    return tuple(sorted(a % ndim for a in axes))


def sum(x, axes=None, keepdims=False):  # noqa: A001
    x = np.asarray(x, dtype=np.float64)
    axes = _axes(x.ndim, axes)
    out = x
    for a in reversed(axes):  # one axis at a time, from the last: indices of the others stay valid
        out = np.add.reduce(out, axis=a, keepdims=True)
    if not keepdims:
        out = out.reshape([d for i, d in enumerate(x.shape) if i not in axes])
    return out


def mean(x, axes=None, keepdims=False):
    x = np.asarray(x, dtype=np.float64)
    axes = _axes(x.ndim, axes)
    count = 1
    for a in axes:
        count *= x.shape[a]
    return sum(x, axes, keepdims) / count


def sum_to(x, shape):
    """Sum ``x`` down to ``shape`` (undo numpy broadcasting); None in ``shape`` keeps that axis."""
    x = np.asarray(x, dtype=np.float64)
    while x.ndim > len(shape):
        x = x.sum(axis=0)
    for i, d in enumerate(shape):
        if d == 1 and x.shape[i] != 1:
            x = x.sum(axis=i, keepdims=True)
    return x


def broadcast_like(g, x, axes, keepdims):
    """``g``, the result of reducing ``x`` over ``axes``, repeated back to ``x``'s shape."""
    g = np.asarray(g, dtype=np.float64)
    axes = _axes(np.ndim(x), axes)
    if not keepdims:
        for a in axes:
            g = np.expand_dims(g, a)
    return g * np.ones(np.shape(x))


def mean_grad(g, x, axes, keepdims):
    axes_ = _axes(np.ndim(x), axes)
    count = 1
    for a in axes_:
        count *= np.shape(x)[a]
    return broadcast_like(g, x, axes, keepdims) / count


# --- shape ops ---------------------------------------------------------------------------------------

def reshape(x, shape):
    shape = tuple(np.shape(x)[0] if d is None else d for d in shape)
    return np.reshape(x, shape)


def transpose(x, perm=None):
    x = np.asarray(x)
    if perm is None:
        perm = tuple(reversed(range(x.ndim)))
    out = np.empty(tuple(x.shape[p] for p in perm), dtype=x.dtype)
    for idx in np.ndindex(*x.shape):
        out[tuple(idx[p] for p in perm)] = x[idx]
    return out


def concat(*xs, axis):
    return np.concatenate(xs, axis=axis)


def slice(x, axis, start, stop):  # noqa: A001
    return np.take(x, np.arange(start, stop), axis=axis)


def unslice(g, x, axis, start, stop):
    """Zeros shaped like ``x`` with ``g`` written at positions [start, stop) of ``axis``."""
    out = np.zeros(np.shape(x))
    idx = [np.s_[:]] * np.ndim(x)
    idx[axis] = np.s_[start:stop]
    out[tuple(idx)] = g
    return out


# --- linear algebra ----------------------------------------------------------------------------------

def matmul(a, b):
    return np.einsum("...ij,...jk->...ik", np.asarray(a, np.float64), np.asarray(b, np.float64))


def steps_matmul(a, b):
    return np.einsum("rtm,rtn->mn", np.asarray(a, np.float64), np.asarray(b, np.float64))


def linear(x, w, b):
    return np.einsum("rk,kn->rn", np.asarray(x, np.float64), np.asarray(w, np.float64)) + b


# --- neural-network ops ------------------------------------------------------------------------------

def softmax(x, axis=-1):
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    return np.log(softmax(x, axis))


def _onehot(labels, classes):
    return np.eye(classes)[np.asarray(labels)]


def softmax_cross_entropy(logits, labels, weight=None):
    """``-log softmax(logits)[label]`` per row, times ``weight`` if given."""
    logp = log_softmax(np.asarray(logits, np.float64), -1)
    loss = -np.sum(logp * _onehot(labels, logp.shape[-1]), axis=-1)
    return loss if weight is None else loss * weight


def xent_grad(g, logits, labels):
    p = softmax(np.asarray(logits, np.float64), -1)
    return (p - _onehot(labels, p.shape[-1])) * np.asarray(g)[..., None]


def mse(a, b):
    d = np.asarray(a, np.float64) - b
    return np.sum(d * d) / d.size


def lookup(table, idx):
    return np.asarray(table)[np.asarray(idx)]


def lookup_grad(g, idx, table):
    """The dense equivalent of the row-sparse gradient of ``table``: repeated indices add up."""
    shape = np.shape(table)
    out = np.zeros(shape)
    g = np.asarray(g, np.float64).reshape((-1,) + tuple(shape[1:]))
    for i, row in zip(np.asarray(idx).reshape(-1), g):
        out[i] += row
    return out


def densify(x):
    return np.asarray(x)


def scatter(x):
    return x


def push(x):
    return x


# --- dropout: the counter hash of minicavs.core.random, re-implemented from its docstring -----------------

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix_int(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def hash_uniform_int(*words) -> float:
    """One uniform number from Python integers (the docstring's formula, exactly, without numpy)."""
    h = _GOLDEN
    for w in words:
        h = (_mix_int(h ^ (int(w) & _MASK64)) + _GOLDEN) & _MASK64
    return (h >> 40) / float(1 << 24)


def _mix_u64(z):
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_uniform(seed, step, site, row_key, column):
    """Vectorised twin of :func:`hash_uniform_int` (uint64 arrays wrap modulo 2**64 without warnings)."""
    words = np.broadcast_arrays(*(np.asarray(w, dtype=np.uint64) for w in (seed, step, site, row_key, column)))
    h = np.full(words[0].shape, _GOLDEN, dtype=np.uint64).reshape(-1)
    for w in words:
        h = _mix_u64(h ^ w.reshape(-1)) + np.uint64(_GOLDEN)
    return ((h >> np.uint64(40)).astype(np.float64) / float(1 << 24)).reshape(words[0].shape)


def dropout_keep(shape, p, site, seed=0, step=0, row_keys=None):
    """Boolean keep-mask: element (r, c) (row r = leading index, c = flat index of the rest) is kept iff
    ``hash(seed, step, site, row_key[r], c) >= p``. A 0-d array is one row of one column."""
    shape = tuple(shape)
    rows = shape[0] if shape else 1
    cols = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    keys = np.arange(rows) if row_keys is None else np.asarray(row_keys)
    u = hash_uniform(seed, step, site, keys.reshape(-1, 1), np.arange(cols).reshape(1, -1))
    return (u >= p).reshape(shape)


def dropout(x, p, site, seed=0, step=0, row_keys=None, training=True):
    """Inverted dropout: kept elements are scaled by 1/(1-p); identity when not training or p == 0."""
    x = np.asarray(x, np.float64)
    if not training or p == 0:
        return x
    return np.where(dropout_keep(x.shape, p, site, seed, step, row_keys), x / (1.0 - p), 0.0)


# --- control flow: Python loops over numpy, bodies given as numpy functions -------------------------

def foreach(body, xs, states, rows=False, reverse=False):
    """``outs_t, states = body(xs_t, states)`` over axis 0 (axis 1 with ``rows``); returns the stacked
    outputs then the final states."""
    steps = xs[0].shape[1 if rows else 0]
    outs = None
    per_step = {}
    for t in (reversed(range(steps)) if reverse else range(steps)):
        o, states = body([x[:, t] if rows else x[t] for x in xs], states)
        per_step[t] = o
        outs = o
    stacked = [np.stack([per_step[t][k] for t in range(steps)], axis=1 if rows else 0)
               for k in range(len(outs))]
    return stacked + list(states)


def while_loop(cond, body, loop_vars, max_iterations):
    """Outputs stacked to ``max_iterations`` steps (zero after the last step run), final vars, the count."""
    outs = []
    while len(outs) < max_iterations and cond(loop_vars) != 0:
        o, loop_vars = body(loop_vars)
        outs.append(o)
    like = body(loop_vars)[0]
    stacked = [np.stack([o[k] for o in outs] + [np.zeros_like(like[k])] * (max_iterations - len(outs)))
               for k in range(len(like))]
    return stacked + list(loop_vars) + [np.int64(len(outs))]


def cond(pred, then, else_, *operands):
    return (then if np.asarray(pred).reshape(-1)[0] != 0 else else_)(*operands)


def item(values, index):
    return values[index]


#: op name -> reference function (every op of the registry except the leaves).
REFERENCE = {
    "constant": constant, "zeros_like": zeros_like, "ones_like": ones_like,
    "neg": neg, "exp": exp, "log": log, "tanh": tanh, "sigmoid": sigmoid, "relu": relu, "square": square,
    "sqrt": sqrt, "abs": abs, "step": step, "sign": sign, "pow": pow,
    "add": add, "sub": sub, "mul": mul, "div": div, "maximum": maximum, "ge": ge, "where": where, "accum": accum,
    "sum": sum, "mean": mean, "sum_to": sum_to, "broadcast_like": broadcast_like, "mean_grad": mean_grad,
    "reshape": reshape, "transpose": transpose, "concat": concat, "slice": slice, "unslice": unslice,
    "matmul": matmul, "steps_matmul": steps_matmul, "linear": linear,
    "softmax": softmax, "log_softmax": log_softmax, "softmax_cross_entropy": softmax_cross_entropy,
    "xent_grad": xent_grad, "mse": mse, "dropout": dropout, "lookup": lookup, "lookup_grad": lookup_grad,
    "densify": densify, "scatter": scatter, "push": push,
    "cond": cond, "foreach": foreach, "while_loop": while_loop, "item": item,
}
