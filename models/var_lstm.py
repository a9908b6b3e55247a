"""LSTM language model over variable-length sentences: each sentence is a chain graph (the paper's Var-LSTM).

A sentence w_1..w_n becomes a chain of n + 1 vertices; vertex t's only child is vertex t - 1. Vertex t pulls
the embedding of its input word (<eos> as the start symbol, then w_1..w_n) and predicts the next word
(w_1..w_n, then <eos>), so perplexity counts n + 1 predictions per sentence. Standard LSTM cell, rows @ W:
    [i, f, o, u] = x·W_x + h_prev·W_h + b;   c = σ(f) ⊙ c_prev + σ(i) ⊙ tanh(u);   h = σ(o) ⊙ tanh(c)
scatter [h, c]; push h; softmax(h·W_o + b_o) over the vocabulary at every vertex. Loss = summed cross-entropy
divided by the number of sentences. Dropout on the embedding and on h before the softmax, inside F.

``model.graph: foreach`` writes the same model as one static graph instead, the baseline a static-graph
framework would run: sentences padded to the longest of the data, a ``foreach`` (minicavs/ops/control.py) over
the positions with each sentence's length as its row's trip count (``steps=lengths``: step t runs on the
sentences longer than t alone, so padding costs no cell or softmax; a finished sentence's state stays as it
was), the LSTM cell and the per-word cross-entropy in its body. A batch's rows are its sentences longest first
(the active rows are then a leading slice). With ``train.order: bucket`` the batches hold sentences of similar
length, so few steps run on few rows. Same parameters, same loss and gradients (without dropout, which a loop
body does not take: dropout must be 0).
"""
from __future__ import annotations

import math

import numpy as np

from minicavs import control, ops
from minicavs.train.config import PRETRAINED_RULES, PROBABILITY, Choice, ConfigError, Nullable, Range, at_least
from minicavs.data import vectors
from minicavs.core.errors import DataError
from minicavs.train.datasets import require_file
from minicavs.data.text import EOS, UNK, Vocab, read_sentences, synthetic_corpus, unigram_perplexity
from minicavs.runtime.inputs import InputGraph
from minicavs.engine.model import Model, Structure
from minicavs.nn import ParameterSet
from minicavs.nn.gates import CELLS, gate_values, split_gates
from minicavs.train import behaviour
from minicavs.train.artifact import ArtifactError
from minicavs.train.task import Task
from minicavs.runtime.vertex import VertexFunction

NAME = "var_lstm"
DEFAULTS = {"embed": 128, "hidden": 256, "dropout": 0.5, "max_vocab": 0, "embed_init": "uniform(0.1)",
            "forget_bias": 0.0, "graph": "chain", "cell": "fused", **vectors.KEYS}   # pretrained, pretrained_format, freeze_embeddings
DATA_DEFAULTS = {"train": "synthetic", "dev": "synthetic", "test": "synthetic", "dev_fraction": 0.0, "limit": 0,
                 "synthetic": {"train": 2000, "dev": 200, "test": 200, "seed": 5, "vocab": 200}}
TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 1e-3, "batch_size": 64}
RULES = {"embed": Nullable(at_least(1), "the dimension of model.pretrained's vectors"), "hidden": at_least(1),
         "dropout": PROBABILITY, "max_vocab": at_least(0), "forget_bias": Range(), "graph": Choice(("chain", "foreach")),
         "cell": Choice(CELLS), **PRETRAINED_RULES}
DATA_RULES = {"dev_fraction": PROBABILITY, "limit": at_least(0), "synthetic.train": at_least(1),
              "synthetic.dev": at_least(1), "synthetic.test": at_least(1), "synthetic.seed": at_least(0),
              "synthetic.vocab": at_least(1)}


def lstm_cell(p, H: int, D: int, dropout: float, dtype, naive: bool = False) -> VertexFunction:
    """``naive``: one product per gate and operand, one bias per gate (``W_x.i``, ``W_h.i``, ``b.i``, ...)."""
    F = VertexFunction("lstm", arity=1, message=(2 * H,), dtype=dtype)
    with F:
        h0, c0 = ops.split(F.gather(0), 2)
        x = F.pull((D,), "x")
        if dropout:
            x = ops.dropout(x, dropout, site=1)
        i, f, o, u = gate_values(p, "ifou", [(x, "W_x"), (h0, "W_h")], "b", naive)
        c = ops.sigmoid(f) * c0 + ops.sigmoid(i) * ops.tanh(u)
        h = ops.sigmoid(o) * ops.tanh(c)
        F.scatter(ops.concat([h, c]))
        F.push(ops.dropout(h, dropout, site=2) if dropout else h)
    return F


class LanguageModel(Task):
    unit = "words"
    key_metric = "perplexity"
    key_mode = "min"
    metrics = ("loss", "nll_per_word", "perplexity", "unigram_perplexity")

    @property
    def vocabulary(self) -> list:
        return list(self.vocab.words)
    predicts = ("per line (a sentence, tokens separated by spaces): its perplexity and log-likelihood under "
                "the model (each word and the closing <eos>, natural log), then the 3 likeliest next words")

    def __init__(self, cfg: dict, data: dict | None = None):
        m, tc = cfg["model"], cfg["train"]
        sentences = data or load_sentences(cfg["data"])
        self.vocab = Vocab.build(sentences["train"], max_size=m["max_vocab"] or None)
        self.data = {k: self.make_samples(v) for k, v in sentences.items()}
        self.unknown = {k: (sum(w not in self.vocab.index for s in v for w in s), sum(map(len, v)))
                        for k, v in sentences.items()}   # (ids lose it: <unk> is also a word of the text)
        V, H, dtype, seed = len(self.vocab), m["hidden"], tc["dtype"], tc["seed"]
        p = self.params = ParameterSet()
        D = vectors.embedding_table(p, "E", self.vocab.words, cfg, init=m["embed_init"], dim=m["embed"]).shape[1]
        p.new("W_x", (D, 4 * H), dtype=dtype, rng=seed)
        p.new("W_h", (H, 4 * H), init="orthogonal", dtype=dtype, rng=seed)
        gates = np.zeros(4 * H)
        gates[H:2 * H] = m["forget_bias"]          # gate order i, f, o, u
        p.new("b", (4 * H,), init=gates, dtype=dtype, rng=seed)
        p.new("W_o", (H, V), dtype=dtype, rng=seed)
        p.new("b_o", (V,), init="zeros", dtype=dtype, rng=seed)
        self.graph = m["graph"]
        self.dtype = np.dtype(dtype)
        self._predict_outputs = None
        self._chains: dict = {}
        if self.graph == "foreach":
            if m["dropout"]:
                raise ConfigError(f"model.graph=foreach: a loop body takes no dropout; set model.dropout=0 "
                                  f"(it is {m['dropout']})")
            self.length = max(len(x) for split in self.data.values() for x, _ in split)
            if m["cell"] != "fused":
                raise ConfigError(f"model.graph=foreach writes the fused cell; model.cell is {m['cell']!r}")
            self._build_foreach(p, H, dtype, tc["policy"])
            return
        naive = m["cell"] == "naive"
        if naive:   # the fused weights' gate blocks, one parameter each
            split_gates(p, "ifou", ("W_x", "W_h", "b"))
        self.inputs = ops.input((None,), "int64", name="inputs")
        self.targets = ops.input((None,), "int64", name="targets")
        self.inv_sentences = ops.input((), dtype, name="inv_sentences")
        s = Structure(lstm_cell(p, H, D, m["dropout"], dtype, naive), pulls={"x": ops.lookup(p["E"].node, self.inputs)},
                      name="chain")
        logits = ops.linear(s.pushed("h"), p["W_o"].node, p["b_o"].node)
        nll = ops.sum(ops.softmax_cross_entropy(logits, self.targets))
        self.model = Model(s, loss=nll * self.inv_sentences, outputs={"nll": nll}, policy=tc["policy"])
        self.logits = logits

    def _build_foreach(self, p, H: int, dtype, policy) -> None:
        """The static-graph model: a foreach over padded positions (see the module's docstring)."""
        T = self.length
        self.inputs = ops.input((None, T), "int64", name="inputs")
        self.targets = ops.input((None, T), "int64", name="targets")
        self.lengths = ops.input((None,), "int64", name="lengths")
        self.state0 = ops.input((None, H), dtype, name="state0")
        self.inv_sentences = ops.input((), dtype, name="inv_sentences")
        W_x, W_h, b, W_o, b_o = (p[k].node for k in ("W_x", "W_h", "b", "W_o", "b_o"))

        def body(inputs, states):
            x, y = inputs
            h0, c0 = states
            i, f, o, u = ops.split(ops.linear(x, W_x, b) + h0 @ W_h, 4)
            c = ops.sigmoid(f) * c0 + ops.sigmoid(i) * ops.tanh(u)
            h = ops.sigmoid(o) * ops.tanh(c)
            return [ops.softmax_cross_entropy(ops.linear(h, W_o, b_o), y)], [h, c]
        (nll,), _ = control.foreach(body, [ops.lookup(p["E"].node, self.inputs), self.targets],
                                    [self.state0, self.state0], steps=self.lengths, name="lstm")
        nll = ops.sum(nll)
        self.model = Model([], loss=nll * self.inv_sentences, outputs={"nll": nll}, policy=policy)

    def _padded(self, samples) -> tuple[dict, dict]:
        """The foreach graph's feeds: ids and targets padded to the longest sentence of the data, each row's
        length, the rows longest first (the loss is a sum over them: their order changes nothing)."""
        n, T = len(samples), self.length
        lengths = self.sample_lengths(samples)
        rows = np.argsort(-lengths, kind="stable")
        inputs, targets = np.zeros((n, T), np.int64), np.zeros((n, T), np.int64)
        for r, i in enumerate(rows):
            x, y = samples[i]
            inputs[r, :len(x)], targets[r, :len(y)] = x, y
        feeds = {"inputs": inputs, "targets": targets, "lengths": lengths[rows],
                 "state0": np.zeros((n, self.params["W_h"].value.shape[0]), self.dtype),
                 "inv_sentences": np.asarray(1.0 / n, self.dtype)}
        return {}, feeds

    def unknown_words(self, split: str) -> tuple[int, int] | None:
        return self.unknown.get(split)

    def _chain(self, n: int) -> InputGraph:
        """The chain of ``n`` words, made once per length (a graph is read-only; making one is ~13 µs of
        checks, ~1 ms per batch of 64 sentences)."""
        graph = self._chains.get(n)
        if graph is None:
            graph = self._chains[n] = InputGraph.chain(n)
        return graph

    def make_samples(self, sentences):
        """(inputs, targets) id arrays per sentence: <eos> w_1..w_n -> w_1..w_n <eos>."""
        eos = self.vocab.index[EOS]
        out = []
        for s in sentences:
            ids = self.vocab.encode(s)
            out.append((np.concatenate(([eos], ids)), np.concatenate((ids, [eos]))))
        return out

    def batch(self, samples):
        if self.graph == "foreach":
            return self._padded(samples)
        graphs = [self._chain(len(x)) for x, _ in samples]
        feeds = {"inputs": np.concatenate([x for x, _ in samples]),
                 "targets": np.concatenate([y for _, y in samples]),
                 "inv_sentences": np.asarray(1.0 / len(samples), self.dtype)}
        return graphs, feeds

    def units(self, samples) -> int:
        return sum(len(y) for _, y in samples)

    def sample_lengths(self, samples) -> np.ndarray:
        """Each sentence's steps (its words and <eos>): what ``train.order: bucket`` groups batches by."""
        return np.array([len(x) for x, _ in samples], np.int64)

    def eval_sums(self, samples, batch_size: int) -> dict:
        nll, n = 0.0, 0
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            graphs, feeds = self.batch(chunk)
            nll += float(self.model.infer(graphs, feeds, self.params).outputs["nll"])
            n += self.units(chunk)
        return {"nll": nll, "words": float(n), "sentences": float(len(samples))}

    def eval_metrics(self, sums: dict, samples) -> dict:
        nll, n = sums["nll"], sums["words"]
        unigram = unigram_perplexity([y for _, y in self.data["train"]], [y for _, y in samples], len(self.vocab))
        return {"loss": nll / sums["sentences"], "nll_per_word": nll / n, "perplexity": math.exp(nll / n),
                "unigram_perplexity": unigram}  # the baseline: add-one unigram counts of the training targets

    def parse_input(self, line: str, where: str):
        return behaviour.read_tokens(line, where)

    def _prediction_outputs(self) -> dict:
        """Per-word losses and the distribution after each sentence's last word (made on first use)."""
        if self._predict_outputs is None:
            last = ops.input((None,), "int64", name="last")
            self._predict_outputs = {"token_nll": ops.softmax_cross_entropy(self.logits, self.targets),
                                     "next": ops.log_softmax(ops.lookup(self.logits, last))}
        return self._predict_outputs

    def predict(self, samples, batch_size: int, top: int = 3) -> list[dict]:
        if self.graph == "foreach":
            raise NotImplementedError("predict runs the chain graph: train with model.graph=chain")
        predictor = self.inference_model(self._prediction_outputs())
        index = self.vocab.index
        out = []
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            feeds = {"inputs": behaviour.eos_then_ids(chunk, index, EOS, UNK),
                     "targets": behaviour.ids_then_eos(chunk, index, EOS, UNK),
                     "last": behaviour.last_positions(chunk, index)}
            res = predictor.infer([self._chain(len(s) + 1) for s in chunk], feeds, self.params)
            out += behaviour.perplexity(chunk, res.outputs, self.vocab.words, "token_nll", "next", top)
        return out

    def export_spec(self) -> dict:
        """The per-word losses and next-word distribution, and predict's reading, feeding and rendering."""
        if self.graph == "foreach":
            raise ArtifactError("cannot export model.graph=foreach: it does not predict (train with "
                                "model.graph=chain)")
        words = {"eos": EOS, "unknown": UNK}
        return {"outputs": dict(self._prediction_outputs()),
                "behaviour": {"predicts": self.predicts, "reader": {"name": "tokens"},
                              "graphs": {"name": "eos_chains"},
                              "feeds": {"inputs": {"name": "eos_then_ids", "settings": words},
                                        "targets": {"name": "ids_then_eos", "settings": words},
                                        "last": {"name": "last_positions"}},
                              "render": {"name": "perplexity", "settings": {"token_nll": "token_nll",
                                                                            "next": "next", "top": 3}}}}

def load_sentences(d: dict) -> dict:
    """Token lists per split: files by path, or the synthetic corpus ('synthetic')."""
    out = {}
    syn = d["synthetic"]
    for split_id, split in enumerate(("train", "dev", "test")):
        src = d[split]
        if src == "synthetic":
            out[split] = synthetic_corpus(int(syn[split]), int(syn["seed"]), int(syn["vocab"]), split_id)
        elif src is not None:
            out[split] = read_sentences(require_file(src, f"data.{split}"))
            if not out[split]:
                raise DataError(f"data.{split}: {src} holds no sentences")
        if d["limit"] and split in out:
            out[split] = out[split][:d["limit"]]   # the first sentences only (benchmarks, quick checks)
    if "train" not in out:
        raise ValueError("data.train is required")
    if d["dev_fraction"] and "dev" not in out:  # hold out the tail of the training text for model selection
        k = max(1, int(len(out["train"]) * d["dev_fraction"]))
        out["train"], out["dev"] = out["train"][:-k], out["train"][-k:]
    return out


def build(cfg: dict) -> LanguageModel:
    return LanguageModel(cfg)
