"""Tree-LSTM sentiment classifier (the binary Tree-LSTM of DyNet's benchmark; child-sum as a variant).

Rows @ W convention, σ = sigmoid. Leaf vertex with word embedding x:
    [i, o, u] = x·W + b_l,                 c = σ(i) ⊙ tanh(u)
Internal vertex with children (h1, c1), (h2, c2), binary variant:
    [i, o, u] = [h1; h2]·U + b_i,          f_k = σ(h_k·U_fk + b_f)
    c = σ(i) ⊙ tanh(u) + f_1 ⊙ c_1 + f_2 ⊙ c_2
child-sum variant (Tai et al. 2015; the paper's Fig. 4 with W^(u) for u): h~ = h1 + h2,
    [i, o, u] = h~·U + b_i,                f_k = σ(h_k·U_f + b_f),   c likewise
Every vertex: h = σ(o) ⊙ tanh(c); scatter [h, c]; push h. A classifier softmax(h·W_o + b_o) over the 5
labels runs at every vertex; the loss is the sum over vertices divided by the number of trees in the batch.
Dropout (on the embeddings and on h before the classifier) is inside F, so masks follow (sample, vertex).
"""
from __future__ import annotations

import operator
from itertools import chain, repeat

import numpy as np

from minicavs import ops
from minicavs.train.config import PRETRAINED_RULES, Choice, Nullable, PROBABILITY, at_least
from minicavs.data import vectors
from minicavs.train.datasets import require_file
from minicavs.data.sst import read_sst
from minicavs.data.synthetic import synthetic_treebank
from minicavs.core.errors import DataError
from minicavs.runtime.inputs import InputGraph
from minicavs.engine.model import Model, Structure, leaf_internal
from minicavs.nn import ParameterSet
from minicavs.nn.gates import CELLS, gate_values, split_gates
from minicavs.train import behaviour
from minicavs.train.artifact import ArtifactError
from minicavs.train.task import Task
from minicavs.runtime.vertex import VertexFunction

NAME = "tree_lstm"
DEFAULTS = {"embed": 300, "hidden": 150, "classes": 5, "variant": "binary", "dropout": 0.5,
            "embed_init": "uniform(0.1)", "cell": "fused", **vectors.KEYS}   # pretrained, pretrained_format, freeze_embeddings
DATA_DEFAULTS = {"train": "synthetic", "dev": "synthetic", "test": "synthetic", "limit": 0,
                 "synthetic": {"train": 3000, "dev": 500, "test": 500, "seed": 7, "vocab": 1000}}
TRAIN_DEFAULTS = {"optimizer": "adagrad", "lr": 0.05, "weight_decay": 1e-4, "batch_size": 25}
RULES = {"embed": Nullable(at_least(1), "the dimension of model.pretrained's vectors"), "hidden": at_least(1),
         "classes": at_least(2), "variant": Choice(("binary", "child_sum")), "dropout": PROBABILITY, "cell": Choice(CELLS),
         **PRETRAINED_RULES}
DATA_RULES = {"limit": at_least(0), "synthetic.train": at_least(1), "synthetic.dev": at_least(1),
              "synthetic.test": at_least(1), "synthetic.seed": at_least(0), "synthetic.vocab": at_least(3)}
UNK = "<unk>"


def leaf_cell(p, H: int, D: int, dropout: float, dtype, naive: bool = False) -> VertexFunction:
    """``naive``: one product and one bias per gate (``W.i``, ``b_l.i``, ...: :mod:`minicavs.nn.gates`)."""
    leaf = VertexFunction("leaf", arity=0, message=(2 * H,), dtype=dtype)
    with leaf:
        x = leaf.pull((D,), "x")
        if dropout:
            x = ops.dropout(x, dropout, site=1)
        i, o, u = gate_values(p, "iou", [(x, "W")], "b_l", naive)
        c = ops.sigmoid(i) * ops.tanh(u)
        h = ops.sigmoid(o) * ops.tanh(c)
        leaf.scatter(ops.concat([h, c]))
        leaf.push(ops.dropout(h, dropout, site=2) if dropout else h)
    return leaf


def internal_cell(p, H: int, variant: str, dropout: float, dtype, name: str = "internal",
                  prefix: str = "", naive: bool = False) -> VertexFunction:
    """An internal vertex function whose parameters are named ``prefix + U`` etc.; ``naive``: one product
    and one bias per gate (``U.i``, ``b_i.i``, ...), the forget gates' per child as in the fused cell."""
    def w(key):
        return p[prefix + key].node
    internal = VertexFunction(name, arity=2, message=(2 * H,), dtype=dtype)
    with internal:
        h1, c1 = ops.split(internal.gather(0), 2)
        h2, c2 = ops.split(internal.gather(1), 2)
        if variant == "binary":
            i, o, u = gate_values(p, "iou", [(ops.concat([h1, h2]), prefix + "U")], prefix + "b_i", naive)
            f1 = ops.sigmoid(ops.linear(h1, w("U_f1"), w("b_f")))
            f2 = ops.sigmoid(ops.linear(h2, w("U_f2"), w("b_f")))
        else:
            i, o, u = gate_values(p, "iou", [(h1 + h2, prefix + "U")], prefix + "b_i", naive)
            f1 = ops.sigmoid(ops.linear(h1, w("U_f"), w("b_f")))
            f2 = ops.sigmoid(ops.linear(h2, w("U_f"), w("b_f")))
        c = ops.sigmoid(i) * ops.tanh(u) + f1 * c1 + f2 * c2
        h = ops.sigmoid(o) * ops.tanh(c)
        internal.scatter(ops.concat([h, c]))
        internal.push(ops.dropout(h, dropout, site=3) if dropout else h)
    return internal


def internal_params(p, H: int, variant: str, dtype, seed, prefix: str = "") -> None:
    p.new(prefix + "U", ((2 if variant == "binary" else 1) * H, 3 * H), dtype=dtype, rng=seed)
    p.new(prefix + "b_i", (3 * H,), init="zeros", dtype=dtype, rng=seed)
    for name in (("U_f1", "U_f2") if variant == "binary" else ("U_f",)):
        p.new(prefix + name, (H, H), dtype=dtype, rng=seed)
    p.new(prefix + "b_f", (H,), init="constant(1.0)", dtype=dtype, rng=seed)


def cells(p, H: int, D: int, variant: str, dropout: float, dtype, naive: bool = False):
    """The leaf and internal vertex functions (a few lines each)."""
    return {"leaf": leaf_cell(p, H, D, dropout, dtype, naive),
            "internal": internal_cell(p, H, variant, dropout, dtype, naive=naive)}


class TreeLSTM(Task):
    unit = "trees"
    key_metric = "root_acc"
    key_mode = "max"
    metrics = ("loss", "root_acc", "all_acc", "root_bin_acc", "all_bin_acc", "root_majority_acc")
    predicts = ("the tree with the predicted sentiment label (0-4, 0 = very negative) at every node; input: "
                "one bracketed tree per line, SST-labelled or unlabelled: ((the movie) (was great))")

    def __init__(self, cfg: dict):
        m, tc = cfg["model"], cfg["train"]
        if m["variant"] not in ("binary", "child_sum"):
            raise ValueError(f"model.variant must be 'binary' or 'child_sum', got {m['variant']!r}")
        self.data = load_data(cfg["data"])
        self.vocab = build_vocab(self.data["train"])
        root_labels = np.array([t.labels[t.root] for t in self.data["train"]])
        self.majority = int(np.bincount(root_labels).argmax())  # the baseline accuracy is reported
        self.samples = {}
        H, C, dtype, seed = m["hidden"], m["classes"], tc["dtype"], tc["seed"]
        p = self.params = ParameterSet()
        self.make_embedding(p, cfg)
        m = {**m, "embed": p["E"].shape[1]}   # (model.embed: null takes the vectors' dimension)
        self.make_params(p, m, dtype, seed)
        p.new("W_o", (H, C), dtype=dtype, rng=seed)
        p.new("b_o", (C,), init="zeros", dtype=dtype, rng=seed)
        self.words = ops.input((None,), "int64", name="words")
        self.labels = ops.input((None,), "int64", name="labels")
        self.inv_trees = ops.input((), dtype, name="inv_trees")
        fns = self.make_cells(p, m, dtype)
        s = Structure(fns, pulls={"x": ops.lookup(p["E"].node, self.words)}, kinds=leaf_internal, name="tree")
        logits = ops.linear(s.pushed("h"), p["W_o"].node, p["b_o"].node)
        loss = ops.sum(ops.softmax_cross_entropy(logits, self.labels)) * self.inv_trees
        self.model = Model(s, loss=loss, outputs={"probs": ops.softmax(logits)}, policy=tc["policy"])
        self.dtype = np.dtype(dtype)
        self.classes = range(C)

    @property
    def vocabulary(self) -> list:
        return list(self.vocab)

    def unknown_words(self, split: str) -> tuple[int, int]:
        words = [w for t in self.data.get(split, ()) for w, ch in zip(t.words, t.children) if not ch]
        return sum(w not in self.vocab for w in words), len(words)

    def make_embedding(self, p: ParameterSet, cfg: dict) -> None:
        """The embedding table E, from model.pretrained's vectors where the file has the word."""
        vectors.embedding_table(p, "E", list(self.vocab), cfg, init=cfg["model"]["embed_init"],
                                dim=cfg["model"]["embed"])

    def make_params(self, p: ParameterSet, m: dict, dtype, seed) -> None:
        """The vertex functions' parameters (subclasses with other cells override this and make_cells)."""
        H, D = m["hidden"], m["embed"]
        p.new("W", (D, 3 * H), dtype=dtype, rng=seed)
        p.new("b_l", (3 * H,), init="zeros", dtype=dtype, rng=seed)
        internal_params(p, H, m["variant"], dtype, seed)
        if m.get("cell") == "naive":   # the fused weights' gate blocks, one parameter each
            split_gates(p, "iou", ("W", "b_l", "U", "b_i"))

    def make_cells(self, p: ParameterSet, m: dict, dtype) -> dict:
        return cells(p, m["hidden"], m["embed"], m["variant"], m["dropout"], dtype, m.get("cell") == "naive")

    def graphs_of(self, trees) -> list:
        """The input graphs of trees (a subclass may give their vertices kinds)."""
        return InputGraph.many([t.children for t in trees])

    def prepare(self, samples) -> None:
        """Graphs, leaf word ids and labels of the trees not yet prepared, all at once (see Task.prepare):
        per tree they were ~30 µs of Python, a fifth of a first epoch at hidden 64."""
        todo = [t for t in samples if self.samples.get(id(t), (None,))[0] is not t]
        if not todo:
            return
        words = list(chain.from_iterable(t.words for t in todo))
        is_leaf = np.fromiter(map(operator.not_, chain.from_iterable(t.children for t in todo)), bool, len(words))
        ids = np.fromiter(map(self.vocab.get, words, repeat(self.vocab[UNK])), np.int64, len(words))[is_leaf]
        leaves_before = np.zeros(len(words) + 1, np.int64)
        np.cumsum(is_leaf, out=leaves_before[1:])
        first_leaf = leaves_before[np.cumsum([0] + [t.num_vertices for t in todo])]
        for i, (tree, graph) in enumerate(zip(todo, self.graphs_of(todo))):
            # keyed by id: an id is reused after a tree is freed, so the entry keeps the tree itself
            self.samples[id(tree)] = (tree, graph, ids[first_leaf[i]:first_leaf[i + 1]],
                                      np.asarray(tree.labels, np.int64))

    def _prepared(self, tree):
        cached = self.samples.get(id(tree))
        if cached is None or cached[0] is not tree:
            self.prepare([tree])
            cached = self.samples[id(tree)]
        return cached[1:]

    def batch(self, samples):
        prep = [self._prepared(t) for t in samples]
        feeds = {"words": np.concatenate([q[1] for q in prep]), "labels": np.concatenate([q[2] for q in prep]),
                 "inv_trees": np.asarray(1.0 / len(samples), self.dtype)}
        return [q[0] for q in prep], feeds

    def eval_sums(self, samples, batch_size: int) -> dict:
        sums = dict.fromkeys(("loss", "roots", "vertices", "root_ok", "vertex_ok", "root_bin_ok", "polar_roots",
                              "vertex_bin_ok", "polar_vertices"), 0.0)
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            graphs, feeds = self.batch(chunk)
            res = self.model.infer(graphs, feeds, self.params)
            probs = res.outputs["probs"]
            labels = feeds["labels"]
            roots = np.cumsum([g.num_vertices for g in graphs]) - 1
            pred = probs.argmax(1)
            pos = probs[:, 3:].sum(1) > probs[:, :2].sum(1)
            polar = labels != 2
            ok_bin = pos == (labels > 2)
            for k, v in (("loss", res.loss * len(chunk)), ("roots", len(chunk)), ("vertices", len(labels)),
                         ("root_ok", np.sum(pred[roots] == labels[roots])), ("vertex_ok", np.sum(pred == labels)),
                         ("root_bin_ok", np.sum(ok_bin[roots] & polar[roots])), ("polar_roots", np.sum(polar[roots])),
                         ("vertex_bin_ok", np.sum(ok_bin & polar)), ("polar_vertices", np.sum(polar))):
                sums[k] += float(v)
        return sums

    def eval_metrics(self, sums: dict, samples) -> dict:
        majority = np.mean([t.labels[t.root] == self.majority for t in samples])
        return {"loss": sums["loss"] / sums["roots"], "root_acc": sums["root_ok"] / sums["roots"],
                "all_acc": sums["vertex_ok"] / sums["vertices"],
                "root_bin_acc": sums["root_bin_ok"] / max(sums["polar_roots"], 1),
                "all_bin_acc": sums["vertex_bin_ok"] / max(sums["polar_vertices"], 1),
                "root_majority_acc": float(majority)}

    def parse_input(self, line: str, where: str):
        return behaviour.read_tree(line, where, num_labels=len(self.classes), max_children=2)

    def predict(self, samples, batch_size: int) -> list[dict]:
        predictor = self.inference_model({"probs": self.model.outputs["probs"]})   # no labels needed
        out = []
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            words = behaviour.leaf_word_ids(chunk, self.vocab, UNK)
            res = predictor.infer(self.graphs_of(chunk), {"words": words}, self.params)
            out += behaviour.tree_labels(chunk, res.outputs, self.vocabulary, output="probs")
        return out

    def graphs_spec(self, owner: type | None = None) -> dict:
        """How :meth:`graphs_of` makes input graphs, as a named behaviour. ``owner``: the class whose
        graphs_of this describes; a subclass that gives vertices kinds of its own in graphs_of and does not
        describe them here has them in Python only: refused."""
        if type(self).graphs_of is not (owner or TreeLSTM).graphs_of:
            raise ArtifactError(f"cannot export model {type(self).__name__}: its vertex kinds come from "
                                f"{type(self).__name__}.graphs_of, which exists only as Python code")
        return {"name": "trees"}

    def export_spec(self) -> dict:
        """The classifier's probabilities, and predict's reading, feeding and rendering as named behaviours."""
        return {"outputs": {"probs": self.model.outputs["probs"]},
                "behaviour": {"predicts": self.predicts,
                              "reader": {"name": "tree", "settings": {"num_labels": len(self.classes),
                                                                       "max_children": 2}},
                              "graphs": self.graphs_spec(),
                              "feeds": {"words": {"name": "leaf_word_ids", "settings": {"unknown": UNK}}},
                              "render": {"name": "tree_labels", "settings": {"output": "probs"}}}}

def load_data(d: dict) -> dict:
    """SST bracket files by path, or the synthetic treebank ('synthetic') generated from d['synthetic']."""
    out = {}
    syn = d["synthetic"]
    for split_id, split in enumerate(("train", "dev", "test")):
        src = d[split]
        if src is None:
            continue
        if src == "synthetic":
            out[split] = synthetic_treebank(int(syn[split]), seed=int(syn["seed"]), vocab_size=int(syn["vocab"]),
                                            split=split_id)
        else:
            out[split] = read_sst(require_file(src, f"data.{split}"))
            if not out[split]:
                raise DataError(f"data.{split}: {src} holds no trees")
        if d["limit"]:
            out[split] = out[split][:d["limit"]]   # the first trees only (benchmarks)
    if "train" not in out:
        raise ValueError("data.train is required")
    return out


def build_vocab(trees) -> dict:
    words = sorted({w for t in trees for w in t.words if w is not None})
    return {w: i for i, w in enumerate([UNK] + words)}


def build(cfg: dict) -> TreeLSTM:
    return TreeLSTM(cfg)
