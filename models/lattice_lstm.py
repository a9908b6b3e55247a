"""Lattice LSTM character tagger (Zhang & Yang 2018; ED-Batch's LatticeLSTM workload) on generated lattices.

Each sentence is a character chain plus one word cell per lexicon word in it (:mod:`minicavs.data.lattice`).
Three vertex kinds: a ``word`` cell gathers the char where its word starts; a ``char`` (no word ends here)
gathers the previous char (child 0; char 0 has none and reads zeros); a ``char_words`` cell gathers the
previous char and the word cells ending at it (children 1..W, shortest word first). Rows @ W convention,
σ = sigmoid, Zhang & Yang's equation numbers in brackets.

Word cell for word w over chars b..e, with word embedding x_w and char b's state (h_b, c_b):          [12-13]
    [i, f, u] = x_w·W_w + h_b·U_w + b_w;      c_w = σ(f) ⊙ c_b + σ(i) ⊙ tanh(u)      scatter c_w (H,)
Both char kinds, with char embedding x and the previous char's (h_p, c_p), share the char LSTM's gates:  [11]
    [i, f, o, u] = x·W_c + h_p·U_c + b_c
char (no word ends at e): the plain LSTM update
    c = σ(f) ⊙ c_p + σ(i) ⊙ tanh(u)
char_words (words k = 1..n end at e, with cells c_k): one extra gate per word, then every input to the
cell weighted by gates normalised against each other (element-wise, a softmax over {σ(i), g_1..g_n}):
    g_k = σ(x·W_g + c_k·U_g + b_g)                                                                      [14]
    a_0 = exp(σ(i)),  a_k = m_k · exp(g_k)                                                              [16]
    c = (a_0 ⊙ tanh(u) + Σ_k a_k ⊙ c_k) / (a_0 + Σ_k a_k)                                                [15]
    m_k = 1 if slot k holds a word, else 0: a pulled mask, so empty slots (which read c_k = 0) drop out
    of the normalisation; c_p does not enter c here (only through h_p in the gates), as in the paper.
both char kinds: h = σ(o) ⊙ tanh(c); scatter [h, c] (2H,); push h; softmax(h·W_o + b_o) tags every char
    (1: a word of the generating segmentation starts here).
The loss is the summed cross-entropy over chars divided by the number of sentences. (The authors' code
couples the plain cell's forget gate as f = 1 - σ(i); the paper's Eq. 11 has its own f, used here.)
"""
from __future__ import annotations

import numpy as np

from minicavs import ops
from minicavs.train.config import PROBABILITY, Choice, at_least
from minicavs.data.lattice import synthetic_lattices
from minicavs.engine.model import Model, Structure
from minicavs.nn import ParameterSet
from minicavs.nn.gates import CELLS, gate_values, split_gates
from minicavs.train.task import Task
from minicavs.runtime.vertex import VertexFunction

NAME = "lattice_lstm"
DEFAULTS = {"embed": 64, "hidden": 128, "dropout": 0.0, "embed_init": "uniform(0.1)", "max_word": 4,
            "cell": "fused"}
DATA_DEFAULTS = {"train": "synthetic", "dev": "synthetic", "test": "synthetic",
                 "synthetic": {"train": 2000, "dev": 200, "test": 200, "seed": 11, "lexicon": 400,
                               "alphabet": 60, "min_len": 8, "max_len": 48}}
TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 3e-3, "batch_size": 64}
RULES = {"embed": at_least(1), "hidden": at_least(1), "dropout": PROBABILITY, "max_word": at_least(2),
         "cell": Choice(CELLS)}
DATA_RULES = {f"synthetic.{k}": at_least(lo) for k, lo in (("train", 1), ("dev", 1), ("test", 1), ("seed", 0),
                                                            ("lexicon", 1), ("alphabet", 2), ("min_len", 1),
                                                            ("max_len", 1))}
CLASSES = 2


def cells(p, H: int, D: int, words_per_char: int, dropout: float, dtype, naive: bool = False) -> dict:
    """``naive``: one product per gate and operand, one bias per gate (``W_c.i``, ``U_c.i``, ``b_c.i``, ...)."""
    chars = ("char", "char_words")
    word = VertexFunction("word", arity=1, message=(H,), dtype=dtype)
    with word:
        h_b, c_b = ops.split(word.gather(0, kinds=chars, message=(2 * H,)), 2)
        x = word.pull((D,), "xw")
        if dropout:
            x = ops.dropout(x, dropout, site=1)
        i, f, u = gate_values(p, "ifu", [(x, "W_w"), (h_b, "U_w")], "b_w", naive)
        word.scatter(ops.sigmoid(f) * c_b + ops.sigmoid(i) * ops.tanh(u))

    def gates(fn: VertexFunction, site: int):
        """The char LSTM's gates, shared by both char kinds (inside ``fn``'s declaration)."""
        h_p, c_p = ops.split(fn.gather(0, kinds=chars), 2)
        x = fn.pull((D,), "x")
        if dropout:
            x = ops.dropout(x, dropout, site=site)
        return x, c_p, gate_values(p, "ifou", [(x, "W_c"), (h_p, "U_c")], "b_c", naive)

    def finish(fn: VertexFunction, o, c, site: int) -> None:
        h = ops.sigmoid(o) * ops.tanh(c)
        fn.scatter(ops.concat([h, c]))
        fn.push(ops.dropout(h, dropout, site=site) if dropout else h)

    char = VertexFunction("char", arity=1, message=(2 * H,), dtype=dtype)
    with char:
        _, c_p, (i, f, o, u) = gates(char, 2)
        finish(char, o, ops.sigmoid(f) * c_p + ops.sigmoid(i) * ops.tanh(u), 3)
    merge = VertexFunction("char_words", arity=1 + words_per_char, message=(2 * H,), dtype=dtype)
    with merge:
        x, _, (i, _, o, u) = gates(merge, 4)
        mask = ops.split(merge.pull((words_per_char,), "word_mask"), words_per_char)
        xg = ops.linear(x, p["W_g"].node, p["b_g"].node)
        a = ops.exp(ops.sigmoid(i))
        num, den = a * ops.tanh(u), a
        for k in range(1, 1 + words_per_char):
            c_k = merge.gather(k, kinds="word", message=(H,))
            a_k = ops.exp(ops.sigmoid(xg + c_k @ p["U_g"].node)) * mask[k - 1]
            num, den = num + a_k * c_k, den + a_k
        finish(merge, o, num / den, 5)
    return {"char": char, "char_words": merge, "word": word}


class LatticeLSTM(Task):
    unit = "sentences"
    key_metric = "char_acc"
    key_mode = "max"
    metrics = ("loss", "char_acc", "majority_acc")

    def __init__(self, cfg: dict):
        m, tc, d = cfg["model"], cfg["train"], cfg["data"]
        if m["max_word"] < 2:
            raise ValueError(f"model.max_word must be at least 2, got {m['max_word']}")
        syn = d["synthetic"]
        self.data = {}
        for split_id, split in enumerate(("train", "dev", "test")):
            if d[split] is None:
                continue
            if d[split] != "synthetic":
                raise ValueError(f"data.{split}: lattice_lstm reads only its generated lattices ('synthetic')")
            self.data[split], self.lexicon = synthetic_lattices(
                int(syn[split]), int(syn["seed"]), int(syn["lexicon"]), int(syn["alphabet"]),
                int(syn["min_len"]), int(syn["max_len"]), split=split_id)
        if "train" not in self.data:
            raise ValueError("data.train is required")
        if self.lexicon.max_len > m["max_word"]:
            raise ValueError(f"model.max_word {m['max_word']} is shorter than the lexicon's longest word")
        H, D, dtype, seed = m["hidden"], m["embed"], tc["dtype"], tc["seed"]
        p = self.params = ParameterSet()
        p.new("E_c", (self.lexicon.alphabet, D), init=m["embed_init"], dtype=dtype, rng=seed)
        p.new("E_w", (len(self.lexicon.words), D), init=m["embed_init"], dtype=dtype, rng=seed)
        self.make_params(p, m, dtype, seed)
        p.new("W_o", (H, CLASSES), dtype=dtype, rng=seed)
        p.new("b_o", (CLASSES,), init="zeros", dtype=dtype, rng=seed)
        self.chars = ops.input((None,), "int64", name="chars")
        self.words = ops.input((None,), "int64", name="words")
        self.labels = ops.input((None,), "int64", name="labels")
        self.inv_sentences = ops.input((), dtype, name="inv_sentences")
        self.slots = m["max_word"] - 1
        self.word_mask = ops.input((None, self.slots), dtype, name="word_mask")
        s = Structure(self.make_cells(p, m, dtype),
                      pulls={"x": ops.lookup(p["E_c"].node, self.chars),
                             "xw": ops.lookup(p["E_w"].node, self.words), "word_mask": self.word_mask},
                      name="lattice")
        logits = ops.linear(s.pushed("h"), p["W_o"].node, p["b_o"].node)
        loss = ops.sum(ops.softmax_cross_entropy(logits, self.labels)) * self.inv_sentences
        self.model = Model(s, loss=loss, outputs={"probs": ops.softmax(logits)}, policy=tc["policy"])
        self.dtype = np.dtype(dtype)
        self.prepared: dict = {}

    def make_params(self, p, m: dict, dtype, seed) -> None:
        """The cells' parameters (the embeddings and the classifier are the task's, shared by the lattice GRU)."""
        H, D = m["hidden"], m["embed"]
        for kind, gates in (("w", 3), ("c", 4)):
            p.new(f"W_{kind}", (D, gates * H), dtype=dtype, rng=seed)
            p.new(f"U_{kind}", (H, gates * H), dtype=dtype, rng=seed)
            p.new(f"b_{kind}", (gates * H,), init="zeros", dtype=dtype, rng=seed)
        p.new("W_g", (D, H), dtype=dtype, rng=seed)
        p.new("U_g", (H, H), dtype=dtype, rng=seed)
        p.new("b_g", (H,), init="zeros", dtype=dtype, rng=seed)
        if m["cell"] == "naive":   # the fused weights' gate blocks, one parameter each
            split_gates(p, "ifu", ("W_w", "U_w", "b_w"))
            split_gates(p, "ifou", ("W_c", "U_c", "b_c"))

    def make_cells(self, p, m: dict, dtype) -> dict:
        """The vertex functions by kind: ``char``, ``char_words`` and ``word``, each pushing ``h``."""
        return cells(p, m["hidden"], m["embed"], self.slots, m["dropout"], dtype, m["cell"] == "naive")

    def _prepared(self, lat):
        key = id(lat)
        cached = self.prepared.get(key)
        if cached is None or cached[0] is not lat:   # once per lattice; the cache keeps the lattice, since an
            _, word_id = lat.vertex_ids()              # id is reused after a lattice is freed
            order = np.argsort(np.asarray(word_id, np.int64))
            wids = np.array([lat.words[w][2] for w in order], np.int64)   # word ids in vertex order
            mask = lat.word_mask(self.slots).astype(self.dtype)
            self.prepared[key] = cached = (lat, lat.to_graph(), wids, mask)
        return cached[1:]

    def prepare(self, samples) -> None:
        for lat in samples:
            self._prepared(lat)

    def batch(self, samples):
        prep = [self._prepared(lat) for lat in samples]
        feeds = {"chars": np.concatenate([lat.chars for lat in samples]),
                 "words": np.concatenate([q[1] for q in prep]),
                 "word_mask": np.concatenate([q[2] for q in prep]),
                 "labels": np.concatenate([lat.labels for lat in samples]),
                 "inv_sentences": np.asarray(1.0 / len(samples), self.dtype)}
        return [q[0] for q in prep], feeds

    def units(self, samples) -> int:
        return len(samples)

    def eval_sums(self, samples, batch_size: int) -> dict:
        sums = {"loss": 0.0, "right": 0, "chars": 0, "ones": 0}
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            graphs, feeds = self.batch(chunk)
            res = self.model.infer(graphs, feeds, self.params)
            sums["loss"] += float(res.loss) * len(chunk)
            sums["right"] += int(np.sum(res.outputs["probs"].argmax(1) == feeds["labels"]))
            sums["chars"] += len(feeds["labels"])
            sums["ones"] += int(np.sum(feeds["labels"]))
        return sums

    def eval_metrics(self, sums: dict, samples) -> dict:
        majority = sums["ones"] / sums["chars"]
        return {"loss": sums["loss"] / len(samples), "char_acc": sums["right"] / sums["chars"],
                "majority_acc": float(max(majority, 1 - majority))}


def build(cfg: dict) -> LatticeLSTM:
    return LatticeLSTM(cfg)
