"""MV-RNN sentiment classifier (Socher et al. 2012; ED-Batch's MV-RNN workload): every vertex of a binary tree
carries a vector and a matrix.

Rows @ W convention, H = model.hidden. A word's embedding row holds its vector and matrix, [a; vec(M)]
(H + H² numbers, so model.embed is set from hidden), and its matrix is A = I + M (near the identity at first,
as in the paper). Matrix-vector products are the paper's column convention (B·a: B applied to a).
Leaf (word w):
    (a, A) = (E[w][:H], I + reshape(E[w][H:], (H, H)))
Internal vertex, children (a, A) left and (b, B) right:
    p = tanh([B·a; A·b]·W + b_W)          W (2H, H): each child's vector transformed by its sibling's matrix
    P = W_M·[A; B]                        W_M (H, 2H), [A; B] the two matrices stacked (2H, H)
Every vertex: scatter [p; vec(P)] (H + H²,); push p (dropout before the classifier); softmax(p·W_o + b_o) over
the 5 labels at every vertex; the loss is the sum over vertices divided by the number of trees. Data,
vocabulary and metrics as in ``tree_lstm.py``. Pretrained word vectors (``model.pretrained``, of model.hidden
values, as the paper's 50-d ones) fill each word's a; its M stays at the initializer, and since M is trained
with the model the table cannot be frozen.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minicavs import ops
from minicavs.train.config import load_model_module
from minicavs.data import vectors
from minicavs.runtime.vertex import VertexFunction

tree_lstm = load_model_module("tree_lstm", Path(__file__).resolve().parent)

NAME = "mv_rnn"
DEFAULTS = {k: v for k, v in tree_lstm.DEFAULTS.items() if k not in ("variant", "embed")}
DATA_DEFAULTS = tree_lstm.DATA_DEFAULTS
TRAIN_DEFAULTS = tree_lstm.TRAIN_DEFAULTS
RULES = {k: v for k, v in tree_lstm.RULES.items() if k not in ("variant", "embed")}
DATA_RULES = tree_lstm.DATA_RULES


def cells(p, H: int, dropout: float, dtype) -> dict:
    size = H + H * H
    identity = ops.constant(np.concatenate((np.zeros(H), np.eye(H).ravel())).astype(dtype))

    def vector_matrix(g):
        return ops.slice_(g, 0, H), ops.reshape(ops.slice_(g, H, size), (H, H))

    def apply(matrix, vector):
        return ops.reshape(ops.matmul(matrix, ops.reshape(vector, (H, 1))), (H,))

    leaf = VertexFunction("leaf", arity=0, message=(size,), dtype=dtype)
    with leaf:
        x = leaf.pull((size,), "x") + identity
        leaf.scatter(x)
        a = ops.slice_(x, 0, H)
        leaf.push(ops.dropout(a, dropout, site=1) if dropout else a)
    internal = VertexFunction("internal", arity=2, message=(size,), dtype=dtype)
    with internal:
        (a, A), (b, B) = vector_matrix(internal.gather(0)), vector_matrix(internal.gather(1))
        h = ops.tanh(ops.linear(ops.concat([apply(B, a), apply(A, b)]), p["W"].node, p["b_W"].node))
        P = ops.matmul(p["W_M"].node, ops.concat([A, B], axis=0))
        internal.scatter(ops.concat([h, ops.reshape(P, (H * H,))]))
        internal.push(ops.dropout(h, dropout, site=2) if dropout else h)
    return {"leaf": leaf, "internal": internal}


class MVRNN(tree_lstm.TreeLSTM):
    def __init__(self, cfg: dict):
        H = cfg["model"]["hidden"]
        super().__init__({**cfg, "model": {**cfg["model"], "variant": "binary", "embed": H + H * H}})

    def make_embedding(self, p, cfg: dict) -> None:
        """E's rows are [a; vec(M)]: pretrained vectors (of model.hidden values) fill a, M stays random."""
        H = cfg["model"]["hidden"]
        vectors.embedding_table(p, "E", list(self.vocab), cfg, init=cfg["model"]["embed_init"], dim=H,
                                dim_key="model.hidden", extra_columns=H * H)

    def make_params(self, p, m, dtype, seed) -> None:
        H = m["hidden"]
        p.new("W", (2 * H, H), dtype=dtype, rng=seed)
        p.new("b_W", (H,), init="zeros", dtype=dtype, rng=seed)
        p.new("W_M", (H, 2 * H), dtype=dtype, rng=seed)

    def make_cells(self, p, m, dtype) -> dict:
        return cells(p, m["hidden"], m["dropout"], dtype)


def build(cfg: dict) -> MVRNN:
    return MVRNN(cfg)
