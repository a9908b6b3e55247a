"""Every op minicavs knows, as functions that build IR nodes. ``OPS`` is the registry behind them; what reads
it sits above the op modules here: autodiff (gradient rules), subgraph (bodies), control (cond, foreach,
while_loop as ops), serialize (op names checked against the registry). The IR below (``minicavs.ir``)
never imports ops: Python operators on a Node reach the op functions through ``ir.graph.OPERATORS``,
which this package fills in."""
from ..ir import graph as _graph
from .elementwise import (neg, exp, log, tanh, sigmoid, relu, square, sqrt, abs, step, sign, pow,  # noqa: F401
                          add, sub, mul, div, maximum, ge, accum, where)
from .linalg import matmul, linear  # noqa: F401
from .message import gather_node, pull_node, scatter_node, push_node  # noqa: F401
from .nn import (softmax, log_softmax, softmax_cross_entropy, mse, dropout, lookup, densify,  # noqa: F401
                 is_row_sparse)
from .reduce import sum, mean, sum_to, broadcast_like, mean_grad  # noqa: F401
from .registry import OPS, OpDef, register  # noqa: F401
from .registry import make_node, native_kernels  # noqa: F401
from .shape import reshape, transpose, concat, slice_, split  # noqa: F401
from .sources import input, param_node, constant, zeros_like, ones_like  # noqa: F401

_graph.OPERATORS.update(add=add, sub=sub, mul=mul, div=div, matmul=matmul, neg=neg, pow=pow)
