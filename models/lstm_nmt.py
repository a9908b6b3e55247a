"""LSTM encoder-decoder as vertex functions over chains (ED-Batch's LSTM-NMT) on ``seq2seq.py``'s task.

The task, parameters and metrics of ``seq2seq.py`` (reverse a string of 1..max_len digits; baseline: copying
the source), written as one input graph per sample instead of padded ``foreach`` loops: n ``enc`` vertices
(vertex t gathers t - 1 and pulls digit t), then n + 1 ``dec`` vertices whose chain hangs off the encoder's
last vertex (the first gathers vertex n - 1, each later one its predecessor; decoder vertex t pulls the
previous target token, <go> first). So the batching policies batch encoders and decoders of different
samples in the same tasks. Both kinds pull their token's row of the one embedding E. Rows @ W, σ = sigmoid:
    [i, f, o, u] = x·W_x + h_p·W_h + b;   c = σ(f) ⊙ c_p + σ(i) ⊙ tanh(u);   h = σ(o) ⊙ tanh(c)
with ``enc_Wx``, ``enc_Wh``, ``enc_b`` on ``enc`` and ``dec_*`` on ``dec``; both scatter [h, c]; ``dec``
pushes h; softmax(h·W_o + b_o) predicts the reversed digits, then <eos>. Loss: summed cross-entropy over
the target tokens divided by the number of sequences, the same number as ``seq2seq.py``'s for the same
parameters. Greedy decoding runs the graph again with one more decoder vertex per step (its own choice fed
back), for the samples not yet at <eos>, up to max_len + 1 steps.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minicavs import Model, Structure, VertexFunction, ops
from minicavs.core.errors import DataError
from minicavs.train import behaviour
from minicavs.train.behaviour import encoder_decoder
from minicavs.train.config import load_model_module

seq2seq = load_model_module("seq2seq", Path(__file__).resolve().parent)

NAME = "lstm_nmt"
DEFAULTS = seq2seq.DEFAULTS
DATA_DEFAULTS = seq2seq.DATA_DEFAULTS
TRAIN_DEFAULTS = seq2seq.TRAIN_DEFAULTS
RULES = seq2seq.RULES
DATA_RULES = seq2seq.DATA_RULES
EOS, GO = seq2seq.EOS, seq2seq.GO


def lstm_cell(p, kind: str, H: int, D: int, dtype) -> VertexFunction:
    F = VertexFunction(kind, arity=1, message=(2 * H,), dtype=dtype)
    with F:
        h_p, c_p = ops.split(F.gather(0), 2)
        x = F.pull((D,), "x")
        i, f, o, u = ops.split(ops.linear(x, p[f"{kind}_Wx"].node, p[f"{kind}_b"].node)
                               + h_p @ p[f"{kind}_Wh"].node, 4)
        c = ops.sigmoid(f) * c_p + ops.sigmoid(i) * ops.tanh(u)
        h = ops.sigmoid(o) * ops.tanh(c)
        F.scatter(ops.concat([h, c]))
        if kind == "dec":
            F.push(h)
    return F


class LstmNmt(seq2seq.Reverse):
    eos, go = EOS, GO     # the token ids (the DyNet peer's spec)

    def __init__(self, cfg: dict):
        m, tc, d = cfg["model"], cfg["train"], cfg["data"]
        if m["min_len"] > m["max_len"]:
            raise DataError(f"model.min_len {m['min_len']} is above model.max_len {m['max_len']}")
        self.max_len, self.min_len = m["max_len"], m["min_len"]
        syn = d["synthetic"]
        self.data = {split: seq2seq.generate(int(syn[split]), int(syn["seed"]), k, self.min_len, self.max_len)
                     for k, split in enumerate(("train", "dev", "test")) if d[split] is not None}
        H, D, dtype, seed = m["hidden"], m["embed"], tc["dtype"], tc["seed"]
        self.dtype, self.hidden = np.dtype(dtype), H
        p = self.params = seq2seq.encoder_decoder_params(H, D, m["forget_bias"], dtype, seed)
        tokens = ops.input((None,), "int64", name="tokens")      # per sample: its digits, then decoder inputs
        self.targets = ops.input((None,), "int64", name="targets")
        self.last = ops.input((None,), "int64", name="last")        # per sample: its last decoder row
        self.inv_count = ops.input((), dtype, name="inv_count")
        s = Structure({"enc": lstm_cell(p, "enc", H, D, dtype), "dec": lstm_cell(p, "dec", H, D, dtype)},
                      pulls={"x": ops.lookup(p["E"].node, tokens)}, name="nmt")
        self.logits = ops.linear(s.pushed("h"), p["W_o"].node, p["b_o"].node)
        self.nll = ops.sum(ops.softmax_cross_entropy(self.logits, self.targets))
        self.model = Model(s, loss=self.nll * self.inv_count, outputs={"nll": self.nll}, policy=tc["policy"])
        self._decoder = None

    @property
    def decoder(self) -> Model:
        """The logits of each sample's last decoder vertex, without a loss (greedy decoding's model)."""
        m = self.model
        if self._decoder is None or self._decoder.device is not m.device or self._decoder.options != m.options:
            self._decoder = self.inference_model({"next": ops.lookup(self.logits, self.last)})
        return self._decoder

    def _graphs(self, samples, prefixes) -> tuple[list, dict]:
        """Graphs and feeds for sources ``samples`` with decoder inputs ``prefixes`` (<go> first)."""
        for s in samples:
            if not 1 <= len(s) <= self.max_len:
                raise DataError(f"a source of {len(s)} digits: this model reads 1 to {self.max_len} "
                                "(model.max_len)")
        graphs = [encoder_decoder(len(s), len(q)) for s, q in zip(samples, prefixes)]
        tokens = np.concatenate([np.concatenate((s, q)) for s, q in zip(samples, prefixes)]).astype(np.int64)
        return graphs, {"tokens": tokens, "last": np.cumsum([len(q) for q in prefixes]) - 1}

    def batch(self, samples):
        graphs, feeds = self._graphs(samples, [np.concatenate(([GO], s[::-1])) for s in samples])
        feeds["targets"] = np.concatenate([np.concatenate((s[::-1], [EOS])) for s in samples]).astype(np.int64)
        feeds["inv_count"] = np.asarray(1.0 / len(samples), self.dtype)
        del feeds["last"]
        return graphs, feeds

    def decode(self, samples, batch_size: int) -> list:
        """The greedy decoding of each sample: its digits up to the first <eos> (at most max_len + 1 steps)."""
        for s in samples:
            if not 1 <= len(s) <= self.max_len:
                raise DataError(f"a source of {len(s)} digits: this model reads 1 to {self.max_len} "
                                "(model.max_len)")
        out = []
        for i in range(0, len(samples), batch_size):
            decoded = behaviour.greedy_chains(self._infer, samples[i:i + batch_size], **self._greedy())["decoded"]
            out += [np.array(row["digits"], np.int64) for row in
                    behaviour.ids_until(decoded, {"decoded": decoded}, None, "decoded", EOS)]
        return out

    def _infer(self, graphs: list, feeds: dict) -> dict:
        return self.decoder.infer(graphs, feeds, self.params).outputs

    def _greedy(self) -> dict:
        return {"max_len": self.max_len, "go": GO, "eos": EOS, "output": "next"}

    def export_spec(self) -> dict:
        """The decoder's next-token logits, with greedy decoding's loop, reading and rendering by name."""
        return {"outputs": {"next": self.decoder.outputs["next"]},
                "behaviour": {"predicts": self.predicts,
                              "reader": {"name": "digits", "settings": {"max_len": self.max_len}},
                              "decoder": {"name": "greedy_chains", "settings": self._greedy()},
                              "render": {"name": "ids_until", "settings": {"output": "decoded", "eos": EOS}}}}

    def eval_sums(self, samples, batch_size: int) -> dict:
        nll = 0.0
        for i in range(0, len(samples), batch_size):
            graphs, feeds = self.batch(samples[i:i + batch_size])
            nll += float(self.model.infer(graphs, feeds, self.params).outputs["nll"])
        sums = {"nll": nll, "sequences": float(len(samples))}
        for name, guess in (("", self.decode(samples, batch_size)), ("copy_", list(samples))):
            seq, tok, positions = seq2seq._scores(samples, guess)
            sums.update({f"{name}seq_right": seq, f"{name}tokens_right": tok})
        sums["positions"] = float(positions)
        return sums


def build(cfg: dict) -> LstmNmt:
    return LstmNmt(cfg)
