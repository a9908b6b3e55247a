"""Matrix products: matmul (numpy semantics over the last two axes) and linear (rows @ W + b)."""
from __future__ import annotations

from ..core.errors import ShapeError
from ..ir.graph import Node, fmt_shape
from .elementwise import broadcast_shapes, unbroadcast
from .reduce import sum
from .registry import OpDef, make_node, native_kernels, register
from .shape import swap_last
from .sources import as_node


def _dims_match(a, b):
    return a == b or a is None or b is None


def _matmul_infer(a, b):
    if a.dtype != b.dtype:
        raise ShapeError(f"dtypes {a.dtype.name} and {b.dtype.name} differ")
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError(f"needs operands with at least 2 axes, got {fmt_shape(a.shape)} and {fmt_shape(b.shape)}")
    if not _dims_match(a.shape[-1], b.shape[-2]):
        raise ShapeError(f"shapes {fmt_shape(a.shape)} and {fmt_shape(b.shape)}: inner dimensions "
                         f"{a.shape[-1]} and {b.shape[-2]} differ")
    try:
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ShapeError:
        raise ShapeError(f"batch axes of {fmt_shape(a.shape)} and {fmt_shape(b.shape)} do not broadcast") from None
    return batch + (a.shape[-2], b.shape[-1]), a.dtype


def _matmul_vjp(g, y, a, b):
    if _stacked_by_static(a, b):
        return matmul(g, swap_last(b)), _summed_over_steps(a, g)
    return (unbroadcast(matmul(g, swap_last(b)), a), unbroadcast(matmul(swap_last(a), g), b))


STEPS_SUMMED = 64   # the most steps whose weight gradient is a sum of one product per step


def _stacked_by_static(a: Node, b: Node) -> bool:
    """Is ``a · b`` per-row stacked steps (rows, T, D) by one matrix (D, H) (a loop's inputs by a weight)?"""
    return a.has_rows and a.ndim == 3 and not b.has_rows and b.ndim == 2 and 0 < a.shape[1] <= STEPS_SUMMED


def _summed_over_steps(a: Node, g: Node) -> Node:
    """The weight's gradient Σ_rows Σ_t a[:, t]ᵀ · g[:, t]: one product over every row and step
    (:func:`steps_matmul`), rather than a product per row and a sum over the rows of (D, H) matrices."""
    return steps_matmul(a, g)


def _native_gemm(n: Node):
    """2-D operands: one GEMM. A per-row product of three axes, (None, m, n), whose operands are each a
    per-row value of three axes or a 2-D static: a product per row ("bmm")."""
    if n.ndim == 2 and all(x.ndim == 2 for x in n.inputs[:2]):
        return "gemm"
    if n.op == "matmul" and n.has_rows and n.ndim == 3 and any(x.has_rows for x in n.inputs) and all(
            (x.ndim == 3 if x.has_rows else x.ndim == 2) for x in n.inputs):
        return "bmm"
    return None


register(OpDef("matmul", infer=_matmul_infer, impl=lambda xp, a, b: xp.matmul(a, b), vjp=_matmul_vjp,
               product=(0, 1), native=_native_gemm))


def matmul(a: Node, b: Node) -> Node:
    return make_node("matmul", (a, b))


def _steps_matmul_infer(a, b):
    if a.dtype != b.dtype:
        raise ShapeError(f"dtypes {a.dtype.name} and {b.dtype.name} differ")
    if not (a.has_rows and b.has_rows and a.ndim == 3 and b.ndim == 3 and a.shape[1] == b.shape[1]):
        raise ShapeError(f"needs two per-row values stacked over the same steps, (rows, T, m) and (rows, T, n), "
                         f"got {fmt_shape(a.shape)} and {fmt_shape(b.shape)}")
    return (a.shape[2], b.shape[2]), a.dtype


def steps_matmul(a: Node, b: Node) -> Node:
    """y = Σ_rows Σ_t a[:, t]ᵀ · b[:, t] of two per-row values stacked over T steps ((rows, T, m), (rows, T, n)):
    the weight gradient of a loop's per-step product as ONE product over rows x T (FLAT views of both), not a
    product per step and a sum."""
    return make_node("steps_matmul", (a, b))


def _steps_matmul_impl(xp, a, b):
    """The rows and steps read as rows of one product (what FLAT views give the runners)."""
    return xp.matmul(a.reshape(-1, a.shape[2]).T, b.reshape(-1, b.shape[2]))


register(OpDef("steps_matmul", infer=_steps_matmul_infer, impl=_steps_matmul_impl,
               vjp=lambda g, y, a, b: (matmul(b, swap_last(g)), matmul(a, g)),
               native=lambda n: "steps_gemm"))


def _linear_infer(x, w, b):
    if not (x.dtype == w.dtype == b.dtype):
        raise ShapeError(f"dtypes {x.dtype.name}, {w.dtype.name} and {b.dtype.name} differ")
    if x.ndim != 2 or w.ndim != 2 or b.ndim != 1:
        raise ShapeError(f"needs rows (R, K), W (K, N), b (N,); got {fmt_shape(x.shape)}, "
                         f"{fmt_shape(w.shape)} and {fmt_shape(b.shape)}")
    if not _dims_match(x.shape[1], w.shape[0]) or not _dims_match(w.shape[1], b.shape[0]):
        raise ShapeError(f"shapes {fmt_shape(x.shape)} @ {fmt_shape(w.shape)} + {fmt_shape(b.shape)} do not fit")
    return (x.shape[0], w.shape[1]), x.dtype


def _linear_impl(xp, x, w, b):
    kernels = native_kernels(xp, x.dtype)
    if kernels is not None and hasattr(kernels, "linear"):   # the bias in the GEMM's C operand: no pass of its own
        y = kernels.linear(x, w, b)
        if y is not None:
            return y
    y = xp.matmul(x, w)
    y += b
    return y


def _matmul_impl(xp, x, w):
    return xp.matmul(x, w)


# A fused group reading linear's output can add the bias itself (bias_input): linear then only multiplies.
register(OpDef("linear", infer=_linear_infer, impl=_linear_impl,
               vjp=lambda g, y, x, w, b: (matmul(g, swap_last(w)), matmul(swap_last(x), g),
                                          make_node("sum", (g,), {"axes": (0,), "keepdims": False})),
               bias_input=2, without_bias=_matmul_impl, product=(0, 1), native=_native_gemm))


def linear(x: Node, w: Node, b: Node) -> Node:
    """rows @ W + b: x (R, K) or, in a vertex function, a per-vertex (K,); W (K, N); b (N,)."""
    return make_node("linear", (x, w, as_node(b, x)))


__all__ = ["matmul", "steps_matmul", "linear", "sum"]
