"""BiLSTM tagger (Huang et al. 2015; ED-Batch's BiLSTM-Tagger) on a generated tagging language.

A sentence of n words is two chains in one input graph: vertices 0..n-1 are the ``fwd`` chain (vertex t
gathers t - 1 and pulls word t), vertices n..2n-1 the ``bwd`` chain (vertex n + j reads word n-1-j and
gathers n + j - 1). Each chain's first vertex reads a zero state. Two LSTMs, rows @ W, σ = sigmoid, for
d in {f, b} with the direction's previous state (h_p, c_p) and word embedding x:
    [i, f, o, u] = x·W_d + h_p·U_d + b_d;   c = σ(f) ⊙ c_p + σ(i) ⊙ tanh(u);   h = σ(o) ⊙ tanh(c)
scatter [h, c]; ``fwd`` pushes ``hf``, ``bwd`` pushes ``hb``. Word t's tag scores are
    softmax(hf_t·W_of + hb_t·W_ob + b_o)        (hb_t: the bwd vertex that read word t, a row ``lookup``)
and the loss is the summed cross-entropy over words divided by the number of sentences.

The generated language (no download): words w0..w{V-1}, sentence lengths uniform in [min_len, max_len],
words uniform. A word of the second half of the vocabulary has a fixed tag, its id mod 3 (tags 0-2); a word
of the first half is ambiguous: its tag is 3 + p(left) + 2·p(right), with p(w) = w's id mod 2 and p = 0
past either end of the sentence (tags 3-6). So a tag depends on context both sides: a forward LSTM alone
knows half of it. Baseline (``baseline_acc``, beside ``acc``): each word's most frequent tag in the training
set (the most frequent tag overall for a word the training set lacks).
"""
from __future__ import annotations

import numpy as np

from minicavs import InputGraph, Model, ParameterSet, Structure, Task, VertexFunction, ops
from minicavs.train import behaviour
from minicavs.train.behaviour import two_chains
from minicavs.train.config import PROBABILITY, at_least

NAME = "bilstm_tagger"
TAGS = 7
DEFAULTS = {"embed": 32, "hidden": 64, "dropout": 0.0, "embed_init": "uniform(0.1)", "vocab": 40}
RULES = {"embed": at_least(1), "hidden": at_least(1), "dropout": PROBABILITY, "vocab": at_least(2)}
DATA_DEFAULTS = {"train": "synthetic", "dev": "synthetic", "test": "synthetic",
                 "synthetic": {"train": 2000, "dev": 200, "test": 200, "seed": 13, "min_len": 3, "max_len": 20}}
DATA_RULES = {f"synthetic.{k}": at_least(lo) for k, lo in (("train", 1), ("dev", 1), ("test", 1), ("seed", 0),
                                                            ("min_len", 1), ("max_len", 1))}
TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 1e-2, "batch_size": 32}


def tags_of(words: np.ndarray, vocab: int) -> np.ndarray:
    """The language's hidden rule (module docstring): fixed tags for the second half of the vocabulary,
    context tags for the first."""
    parity = np.concatenate(([0], words % 2, [0]))
    context = 3 + parity[:-2] + 2 * parity[2:]
    return np.where(words < vocab // 2, context, words % 3).astype(np.int64)


def generate(count: int, seed: int, split_id: int, vocab: int, lo: int, hi: int) -> list:
    """``count`` (words, tags) sentences, the split's own stream of the seed."""
    if lo > hi:
        raise ValueError(f"data.synthetic.min_len {lo} is above data.synthetic.max_len {hi}")
    rng = np.random.default_rng([seed, split_id])
    out = []
    for n in rng.integers(lo, hi + 1, count):
        words = rng.integers(0, vocab, n)
        out.append((words, tags_of(words, vocab)))
    return out


def lstm_cell(p, kind: str, d: str, H: int, D: int, dropout: float, dtype) -> VertexFunction:
    """One direction's LSTM (parameters ``W_<d>``, ``U_<d>``, ``b_<d>``), pushing ``h<d>``."""
    F = VertexFunction(kind, arity=1, message=(2 * H,), dtype=dtype)
    with F:
        h_p, c_p = ops.split(F.gather(0, kinds=kind), 2)
        x = F.pull((D,), "x")
        if dropout:
            x = ops.dropout(x, dropout, site=1)
        i, f, o, u = ops.split(ops.linear(x, p[f"W_{d}"].node, p[f"b_{d}"].node) + h_p @ p[f"U_{d}"].node, 4)
        c = ops.sigmoid(f) * c_p + ops.sigmoid(i) * ops.tanh(u)
        h = ops.sigmoid(o) * ops.tanh(c)
        F.scatter(ops.concat([h, c]))
        F.push(ops.dropout(h, dropout, site=2) if dropout else h, name=f"h{d}")
    return F


class BiLSTM(Task):
    unit = "words"
    key_metric, key_mode = "acc", "max"
    metrics = ("loss", "acc", "baseline_acc")
    predicts = "per line (words w0, w1, ... separated by spaces): each word with its tag, word/tag"

    def __init__(self, cfg: dict):
        m, tc, d = cfg["model"], cfg["train"], cfg["data"]
        syn, self.vocab = d["synthetic"], m["vocab"]
        self.data = {}
        for split_id, split in enumerate(("train", "dev", "test")):
            if d[split] is not None and d[split] != "synthetic":
                raise ValueError(f"data.{split}: bilstm_tagger reads only its generated language ('synthetic')")
            if d[split] is not None:
                self.data[split] = generate(int(syn[split]), int(syn["seed"]), split_id, self.vocab,
                                            int(syn["min_len"]), int(syn["max_len"]))
        if "train" not in self.data:
            raise ValueError("data.train is required")
        self.baseline = most_frequent_tags(self.data["train"], self.vocab)
        H, D, dtype, seed = m["hidden"], m["embed"], tc["dtype"], tc["seed"]
        p = self.params = ParameterSet()
        p.new("E", (self.vocab, D), init=m["embed_init"], dtype=dtype, rng=seed)
        for d in "fb":
            p.new(f"W_{d}", (D, 4 * H), dtype=dtype, rng=seed)
            p.new(f"U_{d}", (H, 4 * H), init="orthogonal", dtype=dtype, rng=seed)
            p.new(f"b_{d}", (4 * H,), init="zeros", dtype=dtype, rng=seed)
            p.new(f"W_o{d}", (H, TAGS), dtype=dtype, rng=seed)
        p.new("b_o", (TAGS,), init="zeros", dtype=dtype, rng=seed)
        self.dtype = np.dtype(dtype)
        self._graphs: dict = {}
        self._build(m["dropout"], dtype, tc["policy"])

    def _build(self, dropout: float, dtype, policy) -> None:
        p, H, D = self.params, self.params["U_f"].shape[0], self.params["E"].shape[1]
        words = ops.input((None,), "int64", name="words")     # per sentence: its words, then reversed
        back = ops.input((None,), "int64", name="back")       # per word: the bwd row that read it
        self.tags = ops.input((None,), "int64", name="tags")
        self.inv_sentences = ops.input((), dtype, name="inv_sentences")
        s = Structure({"fwd": lstm_cell(p, "fwd", "f", H, D, dropout, dtype),
                       "bwd": lstm_cell(p, "bwd", "b", H, D, dropout, dtype)},
                      pulls={"x": ops.lookup(p["E"].node, words)}, name="chains")
        logits = ops.linear(s.pushed("hf"), p["W_of"].node, p["b_o"].node) + \
            ops.lookup(s.pushed("hb"), back) @ p["W_ob"].node
        loss = ops.sum(ops.softmax_cross_entropy(logits, self.tags)) * self.inv_sentences
        self.probs = ops.softmax(logits)
        self.model = Model(s, loss=loss, outputs={"probs": self.probs}, policy=policy)

    @property
    def vocabulary(self) -> list:
        return [f"w{k}" for k in range(self.vocab)]

    def _graph(self, n: int) -> InputGraph:
        if n not in self._graphs:
            self._graphs[n] = two_chains(n)
        return self._graphs[n]

    def batch(self, samples):
        feeds = {"words": behaviour.words_then_reversed(samples, {}), "back": behaviour.backward_rows(samples, {}),
                 "tags": np.concatenate([t for _, t in samples]),
                 "inv_sentences": np.asarray(1.0 / len(samples), self.dtype)}
        return [self._graph(len(w)) for w, _ in samples], feeds

    def units(self, samples) -> int:
        return sum(len(w) for w, _ in samples)

    def eval_sums(self, samples, batch_size: int) -> dict:
        sums = {"loss": 0.0, "right": 0.0, "baseline_right": 0.0, "words": 0.0}
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            graphs, feeds = self.batch(chunk)
            res = self.model.infer(graphs, feeds, self.params)
            sums["loss"] += float(res.loss) * len(chunk)
            sums["right"] += float(np.sum(res.outputs["probs"].argmax(1) == feeds["tags"]))
            words = np.concatenate([w for w, _ in chunk])
            sums["baseline_right"] += float(np.sum(self.baseline[words] == feeds["tags"]))
            sums["words"] += len(words)
        return sums

    def eval_metrics(self, sums: dict, samples) -> dict:
        return {"loss": sums["loss"] / len(samples), "acc": sums["right"] / sums["words"],
                "baseline_acc": sums["baseline_right"] / sums["words"]}

    def parse_input(self, line: str, where: str):
        return behaviour.read_numbered_words(line, where, "w", self.vocab)   # (tags zero: predict ignores them)

    def predict(self, samples, batch_size: int) -> list[dict]:
        model = self.inference_model({"probs": self.probs})
        rows = []
        for i in range(0, len(samples), batch_size):
            graphs, feeds = self.batch(samples[i:i + batch_size])
            res = model.infer(graphs, feeds, self.params)
            rows += behaviour.word_tags(samples[i:i + batch_size], res.outputs, self.vocabulary, output="probs")
        return rows

    def export_spec(self) -> dict:
        """The tag probabilities, and predict's reading, feeding and rendering as named behaviours."""
        return {"outputs": {"probs": self.probs},
                "behaviour": {"predicts": self.predicts,
                              "reader": {"name": "numbered_words", "settings": {"prefix": "w", "size": self.vocab}},
                              "graphs": {"name": "chain_pairs"},
                              "feeds": {"words": {"name": "words_then_reversed"}, "back": {"name": "backward_rows"}},
                              "render": {"name": "word_tags", "settings": {"output": "probs"}}}}


def most_frequent_tags(train: list, vocab: int) -> np.ndarray:
    """Per word id, its most frequent tag in ``train`` (ties: the smaller tag); unseen words get the most
    frequent tag overall."""
    counts = np.zeros((vocab, TAGS), np.int64)
    for words, tags in train:
        np.add.at(counts, (words, tags), 1)
    best = counts.argmax(1)
    best[counts.sum(1) == 0] = counts.sum(0).argmax()
    return best


def build(cfg: dict) -> BiLSTM:
    return BiLSTM(cfg)
