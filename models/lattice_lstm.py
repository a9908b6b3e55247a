"""Lattice LSTM character tagger (Zhang & Yang 2018; ED-Batch's LatticeLSTM workload) on generated lattices.

Each sentence is a character chain plus one word cell per lexicon word in it (:mod:`minicavs.data.lattice`):
char e gathers char e-1 (child 0) and the word cells ending at e (children 1..W, shortest word first; a
missing child reads zeros); a word cell gathers the char where it starts. Rows @ W convention, σ = sigmoid.

Word cell for word w over chars b..e, with word embedding x_w and char b's state (h_b, c_b):
    [i, f, u] = x_w·W_w + h_b·U_w + b_w;      c_w = σ(f) ⊙ c_b + σ(i) ⊙ tanh(u)      scatter c_w (H,)
Char cell for char e, with char embedding x, the previous char's (h_p, c_p) and word cells c_k ending at e:
    [i, f, o, u] = x·W_c + h_p·U_c + b_c
    g_k = σ(x·W_g + c_k·U_g + b_g)               one gate per incoming word (Zhang & Yang's additional gate)
    c = σ(f) ⊙ c_p + σ(i) ⊙ tanh(u) + Σ_k g_k ⊙ c_k,   h = σ(o) ⊙ tanh(c)     scatter [h, c] (2H,)
The two kinds scatter different messages: the char cell's gather(0) reads a 'char' (2H), its gathers 1..W
read 'word' cells (H), the word cell's gather reads a 'char'. A missing word reads c_k = 0 and adds
g_k ⊙ 0 = 0 (Zhang & Yang normalise the gates over the words present instead; the sum keeps F free of
per-vertex counts). The char cell pushes h; softmax(h·W_o + b_o) tags every char (1: a word of the
generating segmentation starts here). The loss is the summed cross-entropy over chars divided by the number
of sentences.
"""
from __future__ import annotations

import numpy as np

from minicavs import ops
from minicavs.config import PROBABILITY, at_least
from minicavs.data.lattice import synthetic_lattices
from minicavs.model import Model, Structure
from minicavs.nn import ParameterSet
from minicavs.task import Task
from minicavs.vertex import VertexFunction

NAME = "lattice_lstm"
DEFAULTS = {"embed": 64, "hidden": 128, "dropout": 0.0, "embed_init": "uniform(0.1)", "max_word": 4}
DATA_DEFAULTS = {"train": "synthetic", "dev": "synthetic", "test": "synthetic",
                 "synthetic": {"train": 2000, "dev": 200, "test": 200, "seed": 11, "lexicon": 400,
                               "alphabet": 60, "min_len": 8, "max_len": 48}}
TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 3e-3, "batch_size": 64}
RULES = {"embed": at_least(1), "hidden": at_least(1), "dropout": PROBABILITY, "max_word": at_least(2)}
DATA_RULES = {f"synthetic.{k}": at_least(lo) for k, lo in (("train", 1), ("dev", 1), ("test", 1), ("seed", 0),
                                                            ("lexicon", 1), ("alphabet", 2), ("min_len", 1),
                                                            ("max_len", 1))}
CLASSES = 2


def cells(p, H: int, D: int, words_per_char: int, dropout: float, dtype) -> dict:
    word = VertexFunction("word", arity=1, message=(H,), dtype=dtype)
    with word:
        h_b, c_b = ops.split(word.gather(0, kinds="char", message=(2 * H,)), 2)
        x = word.pull((D,), "xw")
        if dropout:
            x = ops.dropout(x, dropout, site=1)
        i, f, u = ops.split(ops.linear(x, p["W_w"].node, p["b_w"].node) + h_b @ p["U_w"].node, 3)
        word.scatter(ops.sigmoid(f) * c_b + ops.sigmoid(i) * ops.tanh(u))
    char = VertexFunction("char", arity=1 + words_per_char, message=(2 * H,), dtype=dtype)
    with char:
        h_p, c_p = ops.split(char.gather(0, kinds="char"), 2)
        x = char.pull((D,), "x")
        if dropout:
            x = ops.dropout(x, dropout, site=2)
        i, f, o, u = ops.split(ops.linear(x, p["W_c"].node, p["b_c"].node) + h_p @ p["U_c"].node, 4)
        c = ops.sigmoid(f) * c_p + ops.sigmoid(i) * ops.tanh(u)
        xg = ops.linear(x, p["W_g"].node, p["b_g"].node)
        for k in range(1, 1 + words_per_char):
            c_k = char.gather(k, kinds="word", message=(H,))
            c = c + ops.sigmoid(xg + c_k @ p["U_g"].node) * c_k
        h = ops.sigmoid(o) * ops.tanh(c)
        char.scatter(ops.concat([h, c]))
        char.push(ops.dropout(h, dropout, site=3) if dropout else h)
    return {"char": char, "word": word}


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
        for kind, gates in (("w", 3), ("c", 4)):
            p.new(f"W_{kind}", (D, gates * H), dtype=dtype, rng=seed)
            p.new(f"U_{kind}", (H, gates * H), dtype=dtype, rng=seed)
            p.new(f"b_{kind}", (gates * H,), init="zeros", dtype=dtype, rng=seed)
        p.new("W_g", (D, H), dtype=dtype, rng=seed)
        p.new("U_g", (H, H), dtype=dtype, rng=seed)
        p.new("b_g", (H,), init="zeros", dtype=dtype, rng=seed)
        p.new("W_o", (H, CLASSES), dtype=dtype, rng=seed)
        p.new("b_o", (CLASSES,), init="zeros", dtype=dtype, rng=seed)
        self.chars = ops.input((None,), "int64", name="chars")
        self.words = ops.input((None,), "int64", name="words")
        self.labels = ops.input((None,), "int64", name="labels")
        self.inv_sentences = ops.input((), dtype, name="inv_sentences")
        s = Structure(cells(p, H, D, m["max_word"] - 1, m["dropout"], dtype),
                      pulls={"x": ops.lookup(p["E_c"].node, self.chars),
                             "xw": ops.lookup(p["E_w"].node, self.words)}, name="lattice")
        logits = ops.linear(s.pushed("h"), p["W_o"].node, p["b_o"].node)
        loss = ops.sum(ops.softmax_cross_entropy(logits, self.labels)) * self.inv_sentences
        self.model = Model(s, loss=loss, outputs={"probs": ops.softmax(logits)}, policy=tc["policy"])
        self.dtype = np.dtype(dtype)
        self.prepared: dict = {}

    def _prepared(self, lat):
        key = id(lat)
        cached = self.prepared.get(key)
        if cached is None or cached[0] is not lat:   # once per lattice; the cache keeps the lattice, since an
            _, word_id = lat.vertex_ids()              # id is reused after a lattice is freed
            order = np.argsort(np.asarray(word_id, np.int64))
            wids = np.array([lat.words[w][2] for w in order], np.int64)   # word ids in vertex order
            self.prepared[key] = cached = (lat, lat.to_graph(), wids)
        return cached[1:]

    def batch(self, samples):
        prep = [self._prepared(lat) for lat in samples]
        feeds = {"chars": np.concatenate([lat.chars for lat in samples]),
                 "words": np.concatenate([q[1] for q in prep]),
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
