"""TreeLSTM-2Type (ED-Batch's workload): the binary Tree-LSTM with two internal cell types.

Each internal vertex is a ``cell_a`` or a ``cell_b`` vertex at random (50% each, seeded per tree:
:func:`minicavs.data.trees.two_type_kinds`); the two types have the same equations as ``tree_lstm.py``'s
internal vertex but their own parameters (``a.U``, ``a.b_i``, ``a.U_f1``, ``a.U_f2``, ``a.b_f`` and the same
with ``b.``). Leaves as in ``tree_lstm.py``:
    leaf:    [i, o, u] = x·W + b_l;  c = σ(i) ⊙ tanh(u)
    type t:  [i, o, u] = [h1; h2]·U^t + b_i^t;   f_k = σ(h_k·U_fk^t + b_f^t)
             c = σ(i) ⊙ tanh(u) + f_1 ⊙ c_1 + f_2 ⊙ c_2
    every vertex: h = σ(o) ⊙ tanh(c); scatter [h, c]; push h; softmax(h·W_o + b_o) at every vertex.
With three kinds the order in which kinds run decides how many tasks a batch needs: the workload on which
ED-Batch's learned policy beats depth and agenda batching.
"""
from __future__ import annotations

from pathlib import Path

from minicavs.train.config import Choice, at_least, load_model_module
from minicavs.data.trees import two_type_kinds
from minicavs.runtime.inputs import InputGraph
from minicavs.nn.gates import split_gates

tree_lstm = load_model_module("tree_lstm", Path(__file__).resolve().parent)

NAME = "tree_lstm_2type"
DEFAULTS = {**tree_lstm.DEFAULTS, "type_seed": 0}
DATA_DEFAULTS = tree_lstm.DATA_DEFAULTS
TRAIN_DEFAULTS = tree_lstm.TRAIN_DEFAULTS
RULES = {**tree_lstm.RULES, "variant": Choice(("binary",)), "type_seed": at_least(0)}
DATA_RULES = tree_lstm.DATA_RULES
TYPES = ("cell_a", "cell_b")
UNSEEN = (3, 0)   # (split, index) of a tree in no data split: its kinds' draw


class TreeLSTM2Type(tree_lstm.TreeLSTM):
    def __init__(self, cfg: dict):
        if cfg["model"]["variant"] != "binary":
            raise ValueError("tree_lstm_2type: only model.variant=binary")
        self.type_seed = int(cfg["model"]["type_seed"])
        super().__init__(cfg)
        self.index = {id(t): (s, i) for s, split in enumerate(("train", "dev", "test"))
                      for i, t in enumerate(self.data.get(split) or [])}

    def make_params(self, p, m, dtype, seed) -> None:
        H, D = m["hidden"], m["embed"]
        p.new("W", (D, 3 * H), dtype=dtype, rng=seed)
        p.new("b_l", (3 * H,), init="zeros", dtype=dtype, rng=seed)
        for t in TYPES:
            tree_lstm.internal_params(p, H, "binary", dtype, seed, prefix=t[-1] + ".")
        if m.get("cell") == "naive":   # the fused weights' gate blocks, one parameter each (as tree_lstm's)
            split_gates(p, "iou", ["W", "b_l"] + [t[-1] + "." + k for t in TYPES for k in ("U", "b_i")])

    def make_cells(self, p, m, dtype) -> dict:
        H, naive = m["hidden"], m.get("cell") == "naive"
        fns = {"leaf": tree_lstm.leaf_cell(p, H, m["embed"], m["dropout"], dtype, naive)}
        for t in TYPES:
            fns[t] = tree_lstm.internal_cell(p, H, "binary", m["dropout"], dtype, name=t, prefix=t[-1] + ".",
                                             naive=naive)
        return fns

    def graphs_of(self, trees) -> list:
        """A tree of the data keeps its kinds across epochs (its split and index pick the draw); any other
        tree (predict's input) draws from one stream, UNSEEN."""
        kinds = []
        for tree in trees:
            split, i = self.index.get(id(tree), UNSEEN)
            kinds.append(two_type_kinds(tree, self.type_seed, split * 10 ** 7 + i, TYPES))
        return InputGraph.many([t.children for t in trees], kinds)

    def graphs_spec(self, owner: type | None = None) -> dict:
        """The kinds of predict's trees as data (behaviour.two_type_trees: graphs_of's draw for a tree outside
        the data)."""
        super().graphs_spec(owner or TreeLSTM2Type)
        stream = UNSEEN[0] * 10 ** 7 + UNSEEN[1]
        return {"name": "two_type_trees", "settings": {"seed": self.type_seed, "stream": stream, "types": list(TYPES)}}


def build(cfg: dict) -> TreeLSTM2Type:
    return TreeLSTM2Type(cfg)
