"""Tree-GRU sentiment classifier (ED-Batch's TreeGRU workload): a binary tree of GRU-style cells.

Rows @ W convention, σ = sigmoid. Leaf vertex with word embedding x:
    h = tanh(x·W + b_l)
Internal vertex with children h1, h2:
    [z, r1, r2] = σ([h1; h2]·U_g + b_g)           update gate z, reset gates r1, r2
    u = tanh([r1 ⊙ h1; r2 ⊙ h2]·U_u + b_u)          candidate
    h = z ⊙ (h1 + h2) / 2 + (1 - z) ⊙ u
Every vertex: scatter h; push h; softmax(h·W_o + b_o) over the 5 labels at every vertex; the loss is the sum
over vertices divided by the number of trees. Dropout on the embeddings and on h before the classifier.
Data, vocabulary and metrics as in ``tree_lstm.py``.
"""
from __future__ import annotations

from pathlib import Path

from minicavs import ops
from minicavs.train.config import load_model_module
from minicavs.runtime.vertex import VertexFunction

tree_lstm = load_model_module("tree_lstm", Path(__file__).resolve().parent)

NAME = "tree_gru"
DEFAULTS = {k: v for k, v in tree_lstm.DEFAULTS.items() if k != "variant"}
DATA_DEFAULTS = tree_lstm.DATA_DEFAULTS
TRAIN_DEFAULTS = tree_lstm.TRAIN_DEFAULTS
RULES = {k: v for k, v in tree_lstm.RULES.items() if k != "variant"}
DATA_RULES = tree_lstm.DATA_RULES


def cells(p, H: int, D: int, dropout: float, dtype) -> dict:
    leaf = VertexFunction("leaf", arity=0, message=(H,), dtype=dtype)
    with leaf:
        x = leaf.pull((D,), "x")
        if dropout:
            x = ops.dropout(x, dropout, site=1)
        h = ops.tanh(ops.linear(x, p["W"].node, p["b_l"].node))
        leaf.scatter(h)
        leaf.push(ops.dropout(h, dropout, site=2) if dropout else h)
    internal = VertexFunction("internal", arity=2, message=(H,), dtype=dtype)
    with internal:
        h1, h2 = internal.gather(0), internal.gather(1)
        z, r1, r2 = ops.split(ops.sigmoid(ops.linear(ops.concat([h1, h2]), p["U_g"].node, p["b_g"].node)), 3)
        u = ops.tanh(ops.linear(ops.concat([r1 * h1, r2 * h2]), p["U_u"].node, p["b_u"].node))
        h = z * ((h1 + h2) * 0.5) + (1.0 - z) * u
        internal.scatter(h)
        internal.push(ops.dropout(h, dropout, site=3) if dropout else h)
    return {"leaf": leaf, "internal": internal}


class TreeGRU(tree_lstm.TreeLSTM):
    def __init__(self, cfg: dict):
        super().__init__({**cfg, "model": {**cfg["model"], "variant": "binary"}})

    def make_params(self, p, m, dtype, seed) -> None:
        H, D = m["hidden"], m["embed"]
        p.new("W", (D, H), dtype=dtype, rng=seed)
        p.new("b_l", (H,), init="zeros", dtype=dtype, rng=seed)
        p.new("U_g", (2 * H, 3 * H), dtype=dtype, rng=seed)
        p.new("b_g", (3 * H,), init="zeros", dtype=dtype, rng=seed)
        p.new("U_u", (2 * H, H), dtype=dtype, rng=seed)
        p.new("b_u", (H,), init="zeros", dtype=dtype, rng=seed)

    def make_cells(self, p, m, dtype) -> dict:
        return cells(p, m["hidden"], m["embed"], m["dropout"], dtype)


def build(cfg: dict) -> TreeGRU:
    return TreeGRU(cfg)
