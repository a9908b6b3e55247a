"""The op registry: the single place where an op's shape rule, kernel, gradient and fusion template live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..core.errors import ShapeError
from ..ir.graph import Node


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

    What the compiler and the engine ask about an op (nothing outside ops/ branches on an op's name):
    fuse: an elementwise op a fused kernel computes (False: a source, such as a constant, it reads instead).
    literal(node) -> its value when a fused kernel inlines the node as a literal (a scalar constant), else None.
    source: its value is supplied or built from attributes, not computed from inputs by a kernel launch.
    bias_input, without_bias: an additive bias input that a fused consumer adds instead, and the impl of
        the op without it (linear: ``x·W``; the kernel of ``tanh(x·W + b)`` adds b).
    column_blocks(node) -> [(input, first column, end)] when the output is its inputs side by side along the
        last axis (concat), so the producers can write their column blocks in place; else None.
    identity: the output is its one input (scatter and push only mark F's outputs).
    sums: the output is the elementwise sum of its inputs, each of its shape (accum): a loop's carried sum
        over the steps may add its term in place.
    merge_gradients(grads) -> grads: several gradients made by this op and summed into one value, merged
        into fewer nodes (unslice: the parts of a split become one concat).
    rows: a message op's row movement and its adjoint (ops/message.py).
    product: (left, right) input indices when the output of 2-D operands is the matrix product left·right
        (plus the bias, if ``bias_input``): products sharing a left operand can be merged into one GEMM
        (passes/gemm.py).
    native(node) -> how the C runner (instructions.py) runs a non-elementwise node, or None where it
        cannot. A per-row value of any number of axes is a matrix of flat rows (its numbers row-major), so
        axis 1 of it is a run of column blocks: "gemm" (a 2-D product; a linear's bias added after it),
        "bmm" (a product per row of per-row values of three axes, or of one and a 2-D static), "cols" (a
        column block: a view at a column offset), "concat" (parts copied into column blocks), "transpose"
        (a 2-D value: a view with the transposed flag), "transpose_rows" (each row's matrix transposed into
        a new flat row), "alias" (a reshape keeping the flat rows), "sum_rows" (a sum over the row axis),
        "unslice" (zeros with a column block written), "zero" (zeros of its input's shape), "dropout" (a
        per-row value times the mask of its row keys). Identities alias their input; elementwise ops run as fused kernels.
    last_axis_block(node) -> (first, end) when the output is a block of its one input's last axis (a slice
        there: a view at a column offset), else None.
    tuple_valued(node) -> True when the node's value is a tuple (a control-flow op's several results, their
        cotangent): no matrix, so the lowering holds it in a register only its APPLYs read and write.
    row_lowering: how a static program (engine/static_program.py) computes the op with an instruction of its
        own (:class:`RowLowering`), where F's step lowering has none.
    row_groups(node) -> the groups of the node and its inputs whose row counts are one, where that is not all
        of them (a lookup's rows are its indices', not its table's); None: all of them.
    from_shape(xp, node) -> the node's value made from its shape and attributes alone (ones_like, constant):
        a static program is given it, made before it without reading the node's input.
    """

    name: str
    infer: Callable
    impl: Callable
    vjp: Optional[Callable]
    expr: Optional[Callable] = None
    needs_ctx: bool = False
    fuse: bool = True
    literal: Optional[Callable] = None
    source: bool = False
    bias_input: Optional[int] = None
    without_bias: Optional[Callable] = None
    column_blocks: Optional[Callable] = None
    identity: bool = False
    sums: bool = False
    merge_gradients: Optional[Callable] = None
    rows: Optional[object] = None
    product: Optional[tuple] = None
    native: Optional[Callable] = None
    last_axis_block: Optional[Callable] = None
    tuple_valued: Optional[Callable] = None
    row_lowering: Optional["RowLowering"] = None
    row_groups: Optional[Callable] = None
    from_shape: Optional[Callable] = None

    @property
    def elementwise(self) -> bool:
        return self.expr is not None

    @property
    def fusible(self) -> bool:
        return self.expr is not None and self.fuse


@dataclass(frozen=True)
class RowLowering:
    """How a static program lowers an op over the run's rows itself (engine/static_program.py).

    how: "rowop" (a row function: ROWOP's ``fn``, engine/codegen/opcodes.py), "take" (rows of a table at
        indices: TAKE; the table and indices are buffers), "sum_rows" (a column sum: SUMROWS of its input).
    takes(node) -> True where the program lowers the node so, False where the op is of a shape it does not
        take (one row axis), None where the op's other lowering (native, fused) decides.
    fn: ROWOP's row function (0 softmax, 1 the cross-entropy, 2 its gradient, 3 a row broadcast).
    source, gradient: the inputs ROWOP reads as its rows and as their gradient (None: none).
    labels: the last input is the rows' labels (a buffer checked on the host, not a register).
    output_cols: ROWOP's columns are the output's (a broadcast of one row), not its source's.
    """

    how: str
    takes: Callable
    fn: int = -1
    source: int = 0
    gradient: Optional[int] = None
    labels: bool = False
    output_cols: bool = False


OPS: dict[str, OpDef] = {}


def last_axis_block(node) -> tuple | None:
    """(first, end) of the input's last axis that ``node`` is a block of (OpDef.last_axis_block), else None."""
    block = OPS[node.op].last_axis_block
    return None if block is None else block(node)


def holds_tuple(node) -> bool:
    """Whether ``node``'s value is a tuple (a control-flow op's several results, their cotangent): no matrix,
    so only an APPLY writes or reads its register, which holds the tuple itself (control.py)."""
    tuple_valued = OPS[node.op].tuple_valued
    return tuple_valued is not None and tuple_valued(node)


def register(opdef: OpDef) -> OpDef:
    if opdef.name in OPS:
        raise ValueError(f"op {opdef.name!r} registered twice")
    OPS[opdef.name] = opdef
    return opdef


def make_node(op: str, inputs: Sequence[Node], attrs: dict | None = None, name: str | None = None) -> Node:
    """Create a node, inferring its shape and dtype now so mistakes surface at declaration."""
    attrs = dict(attrs or {})
    inputs = tuple(inputs)
    for i, x in enumerate(inputs):
        if not isinstance(x, Node):
            raise TypeError(f"{op}: input {i} is {type(x).__name__}, not a Node")
    try:
        opdef = OPS[op]
    except KeyError:
        raise ShapeError(f"unknown op {op!r}") from None
    try:
        shape, dtype = opdef.infer(*inputs, **attrs)
    except ShapeError as e:
        where = f"{op} '{name}'" if name else op
        raise ShapeError(f"{where}: {e}") from None
    return Node(op, inputs, attrs, tuple(shape), dtype, name)


# Hand-written kernels an op may call (softmax cross-entropy, dropout) and the optimizer's update rules, per
# array module: a backend package (minicavs/cpu, minicavs/cuda) provides them when it is imported; ops never
# import a backend. Where none is provided, ops run their numpy twins.
_NATIVE_KERNELS: dict[str, Callable] = {}


def provide_native_kernels(module_name: str, kernels_for_dtype: Callable) -> None:
    """Register ``kernels_for_dtype(dtype) -> kernels | None`` for arrays of the module ``module_name``."""
    _NATIVE_KERNELS[module_name] = kernels_for_dtype


def native_kernels(xp, dtype):
    """The native kernels for arrays of ``xp`` and ``dtype``, or None (then the numpy twin runs)."""
    kernels_for_dtype = _NATIVE_KERNELS.get(getattr(xp, "__name__", ""))
    return None if kernels_for_dtype is None else kernels_for_dtype(dtype)
