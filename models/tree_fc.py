"""Tree-FC, TensorFlow Fold's benchmark model: complete binary trees of fully connected layers.

Leaf:      h = tanh(x·W_l + b_l), x a random input vector of size H (pulled), x ~ N(0, 1)
Internal:  h = tanh([h_left; h_right]·W + b)
Root:      r = h·w_o + b_o, squared error to a random target in [-1, 1]
Loss = summed squared error divided by the number of trees. Inputs and targets are seeded.
"""
from __future__ import annotations

import numpy as np

from minicavs import ops
from minicavs.train.config import at_least
from minicavs.data.trees import complete_binary_tree
from minicavs.engine.model import Model, Structure, leaf_internal
from minicavs.nn import ParameterSet
from minicavs.train.task import Task
from minicavs.runtime.vertex import VertexFunction

NAME = "tree_fc"
DEFAULTS = {"hidden": 256, "leaves": 256}
DATA_DEFAULTS = {"train": "synthetic", "dev": "synthetic", "test": None,
                 "synthetic": {"train": 1000, "dev": 100, "test": 100, "seed": 3}}
TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "batch_size": 64}
RULES = {"hidden": at_least(1), "leaves": at_least(2)}   # leaves: a power of two (checked by the tree builder)
DATA_RULES = {"synthetic.train": at_least(1), "synthetic.dev": at_least(1), "synthetic.test": at_least(1),
              "synthetic.seed": at_least(0)}


def cells(p, H: int, dtype):
    leaf = VertexFunction("leaf", message=(H,), dtype=dtype)
    with leaf:
        h = ops.tanh(ops.linear(leaf.pull((H,)), p["W_l"].node, p["b_l"].node))
        leaf.scatter(h)
    internal = VertexFunction("internal", arity=2, message=(H,), dtype=dtype)
    with internal:
        h = ops.tanh(ops.linear(ops.concat([internal.gather(0), internal.gather(1)]), p["W"].node, p["b"].node))
        internal.scatter(h)
        internal.push(h)
    return {"leaf": leaf, "internal": internal}


def leaf_rows(xs: list) -> np.ndarray:
    """The samples' leaf inputs as one (trees x leaves, H) array: a read-only view of the data set's array
    when the samples are consecutive trees of it (a batch in order, as the PyTorch peer slices its tensor;
    33 MB copied per batch at hidden 512, batch 64), else a copy."""
    first, base = xs[0], xs[0].base   # (numpy's base: the array that owns the memory)
    if base is not None and base.flags.c_contiguous and base.dtype == first.dtype and first.ndim == 2:
        at = first.__array_interface__["data"][0]
        start = at - base.__array_interface__["data"][0]
        size = first.nbytes
        if all(x.base is base and x.shape == first.shape and x.dtype == first.dtype and x.flags.c_contiguous
               and x.__array_interface__["data"][0] == at + k * size for k, x in enumerate(xs)):
            lo = start // first.itemsize
            view = base.reshape(-1)[lo:lo + len(xs) * first.size].reshape(-1, first.shape[1])
            view.flags.writeable = False
            return view
    return np.concatenate(xs)


class TreeFC(Task):
    unit = "trees"
    key_metric = "loss"
    key_mode = "min"

    def __init__(self, cfg: dict):
        m, tc, d = cfg["model"], cfg["train"], cfg["data"]
        H, dtype, seed = m["hidden"], tc["dtype"], tc["seed"]
        self.dtype = np.dtype(dtype)
        self.tree = complete_binary_tree(m["leaves"])
        self.graph = self.tree.to_graph()
        self.n_leaves = m["leaves"]
        self.data = {}
        for split_id, split in enumerate(("train", "dev", "test")):
            if d[split] == "synthetic":
                rng = np.random.default_rng([d["synthetic"]["seed"], split_id])
                n = int(d["synthetic"][split])
                xs = rng.standard_normal((n, m["leaves"], H)).astype(self.dtype)
                ys = rng.uniform(-1, 1, n).astype(self.dtype)
                self.data[split] = list(zip(xs, ys))
            elif d[split] is not None:
                raise ValueError(f"tree_fc generates its data: data.{split} must be 'synthetic' or null")
        p = self.params = ParameterSet()
        p.new("W_l", (H, H), dtype=dtype, rng=seed)
        p.new("b_l", (H,), init="zeros", dtype=dtype, rng=seed)
        p.new("W", (2 * H, H), dtype=dtype, rng=seed)
        p.new("b", (H,), init="zeros", dtype=dtype, rng=seed)
        p.new("w_o", (H, 1), dtype=dtype, rng=seed)
        p.new("b_o", (1,), init="zeros", dtype=dtype, rng=seed)
        xs = ops.input((None, H), dtype, name="xs")
        s = Structure(cells(p, H, dtype), pulls={"x": xs}, kinds=leaf_internal, name="tree")
        self.roots = ops.input((None,), "int64", name="roots")     # row of each root in the push buffer
        target = ops.input((None,), dtype, name="target")
        r = ops.reshape(ops.linear(ops.lookup(s.pushed("h"), self.roots), p["w_o"].node, p["b_o"].node), (None,))
        sq = ops.sum(ops.square(r - target))
        inv = ops.input((), dtype, name="inv_trees")
        self.model = Model(s, loss=sq * inv, outputs={"sq": sq}, policy=tc["policy"])

    def batch(self, samples):
        internal = self.graph.num_vertices - self.n_leaves      # internal vertices push, in vertex order
        roots = (np.arange(len(samples)) + 1) * internal - 1    # the root is the last internal vertex
        feeds = {"xs": leaf_rows([x for x, _ in samples]), "target": np.array([y for _, y in samples]),
                 "roots": roots, "inv_trees": np.asarray(1.0 / len(samples), self.dtype)}
        return [self.graph] * len(samples), feeds

    def eval_sums(self, samples, batch_size: int) -> dict:
        total = 0.0
        for i in range(0, len(samples), batch_size):
            graphs, feeds = self.batch(samples[i:i + batch_size])
            total += float(self.model.infer(graphs, feeds, self.params).outputs["sq"])
        return {"sq": total, "samples": float(len(samples))}

    def eval_metrics(self, sums: dict, samples) -> dict:
        return {"loss": sums["sq"] / sums["samples"]}


def build(cfg: dict) -> TreeFC:
    return TreeFC(cfg)
