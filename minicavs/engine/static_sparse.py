"""What a static program leaves to the host without evaluating an op: a row-sparse gradient assembled from the
rows the program hands out and the ids it was fed, and a pull stage's gathers of embedding rows.

A table's gradient is row-sparse (core/sparse.RowSparse: the optimizer updates the looked-up rows alone): the
gradient of a lookup is its upstream gradient's rows at the lookup's ids, and a sum of such gradients (``accum``)
is their rows stacked with their ids concatenated. The rows are program values (handed out; a sum's stacked by
the program, each operand's rows copied into its column block of one output) or values the graph is given; the
ids are integer feeds, known before the run. So the host only pairs them: a reshape and, for a sum, one
concatenation of ids.

A pull stage whose program would only move rows (a lookup of each vertex's embedding) is not bound as a program:
one gather per lookup on the host (the ids checked), for less than binding a program costs.
"""
from __future__ import annotations

import numpy as np

from ..core.sparse import RowSparse, add_all
from ..ir.graph import Node
from ..ops.nn import row_sparse_parts
from ..ops.registry import OPS

ASSEMBLED = "a row-sparse gradient: the program's rows (or the given ones) paired with the fed ids on the host"
GATHERED = ("a host gather (one take, the ids checked): the program would only move rows, for more than the "
            "gather costs to bind")


def gradient_rows(n: Node) -> list:
    """The nodes whose values are the rows of row-sparse ``n`` (each lookup gradient's upstream gradient)."""
    return [leaf.inputs[0] for leaf in row_sparse_parts(n)]


def assemble(n: Node, env: dict, xp, stacked=None) -> RowSparse:
    """Row-sparse ``n`` from ``env``: its ids and rows (``stacked``: a sum's rows, the program's one output of
    every operand's rows side by side per row)."""
    parts = row_sparse_parts(n)
    dense = tuple(env[parts[0].inputs[2]].shape)
    if stacked is not None:
        rows = stacked.shape[0]
        ids = np.concatenate([np.asarray(env[leaf.inputs[1]]).reshape(rows, -1) for leaf in parts], axis=1)
        return RowSparse(ids.reshape(-1), stacked.reshape((-1,) + dense[1:]), dense)
    pairs = [RowSparse(env[leaf.inputs[1]].reshape(-1), env[leaf.inputs[0]].reshape((-1,) + dense[1:]), dense)
             for leaf in parts]
    return pairs[0] if len(pairs) == 1 else add_all(xp, pairs)


def gather(n: Node, env: dict, xp):
    """Lookup ``n``'s rows (its table's rows at its ids, checked) made on the host's side of the program."""
    return OPS[n.op].impl(xp, *(env[x] for x in n.inputs))


def gathers_only(nodes: list) -> bool:
    """Are ``nodes`` lookups alone (a pull stage: rows of tables at ids; the registry's "take" ops)?"""
    return bool(nodes) and all(OPS[n.op].row_lowering is not None and OPS[n.op].row_lowering.how == "take"
                               for n in nodes)
