"""Sequence to sequence with control flow as operators: reverse a string of digits.

A generated task (no download): a source of n digits (n uniform in [min_len, max_len]) and its target, the
digits reversed then <eos>. One static graph, no vertex functions:

Encoder: ``foreach`` over the source positions (padded to max_len, a mask per row and position) of an LSTM
cell; a padded position leaves the state as it was (``where`` on the mask), so each row's final state is the
state after its own last digit.
    [i, f, o, u] = x·W_x + h·W_h + b;   c' = σ(f) ⊙ c + σ(i) ⊙ tanh(u);   h' = σ(o) ⊙ tanh(c')
Decoder, training (teacher forcing): ``foreach`` over the target positions of a second LSTM cell (U_x, U_h,
b_d) started from the encoder's state; input at step t is the embedding of the previous target token (<go>
first); per step the cross-entropy of softmax(h·W_o + b_o) against the target token, masked past the end.
Loss = summed cross-entropy divided by the number of sequences.
Decoder, greedy decoding (evaluation, ``predict``): a ``while_loop`` that feeds back its own choice (the
one-hot of the arg-max, times the embedding table) until every row has produced <eos> or max_len + 1 steps
ran; the steps a row takes after its <eos> are ignored.

Metrics: sequence accuracy (the decoded string equals the target exactly), token accuracy (per target
position, <eos> included). Baseline, on the same samples: copying the source (right for palindromes only).
"""
from __future__ import annotations

import numpy as np

from minicavs import control, ops
from minicavs.engine.backend import to_host
from minicavs.train.config import Range, at_least
from minicavs.core.errors import DataError
from minicavs.engine.model import Model
from minicavs.nn import ParameterSet
from minicavs.train import behaviour
from minicavs.train.task import Task

NAME = "seq2seq"
DIGITS = 10
EOS, GO = 10, 11
VOCAB = 12
DEFAULTS = {"embed": 16, "hidden": 64, "min_len": 1, "max_len": 6, "forget_bias": 1.0}
DATA_DEFAULTS = {"train": "synthetic", "dev": "synthetic", "test": "synthetic",
                 "synthetic": {"train": 4000, "dev": 300, "test": 300, "seed": 7}}
TRAIN_DEFAULTS = {"optimizer": "adam", "lr": 1e-2, "batch_size": 64}
RULES = {"embed": at_least(1), "hidden": at_least(1), "min_len": at_least(1), "max_len": at_least(1),
         "forget_bias": Range()}
DATA_RULES = {"synthetic.train": at_least(1), "synthetic.dev": at_least(1), "synthetic.test": at_least(1),
              "synthetic.seed": at_least(0)}


def lstm_step(x, h, c, Wx, Wh, b):
    i, f, o, u = ops.split(ops.linear(x, Wx, b) + h @ Wh, 4)
    c2 = ops.sigmoid(f) * c + ops.sigmoid(i) * ops.tanh(u)
    return ops.sigmoid(o) * ops.tanh(c2), c2


def column(x, k: int):
    """Column ``k`` of a (rows, n) value as (rows, 1)."""
    return ops.slice_(x, k, k + 1)


def argmax_one_hot(logits, n: int):
    """1 at the row's largest logit, 0 elsewhere (ties, of measure zero, give several ones)."""
    best = column(logits, 0)
    for k in range(1, n):
        best = ops.maximum(best, column(logits, k))
    return ops.ge(logits, best)


def generate(count: int, seed: int, split_id: int, lo: int, hi: int) -> list:
    """``count`` digit strings with lengths uniform in [lo, hi] (the split's own stream of the seed)."""
    rng = np.random.default_rng([seed, split_id])
    lengths = rng.integers(lo, hi + 1, count)
    return [rng.integers(0, DIGITS, n) for n in lengths]



def encoder_decoder_params(H: int, D: int, forget_bias: float, dtype, seed: int) -> ParameterSet:
    """The embeddings, the encoder's and the decoder's LSTM weights and the output layer (shared with
    models/lstm_nmt.py, which writes the same network as vertex functions over chains)."""
    p = ParameterSet()
    p.new("E", (VOCAB, D), init="uniform(0.1)", dtype=dtype, rng=seed)
    gates = np.zeros(4 * H)
    gates[H:2 * H] = forget_bias          # gate order i, f, o, u
    for pre in ("enc", "dec"):
        p.new(f"{pre}_Wx", (D, 4 * H), dtype=dtype, rng=seed)
        p.new(f"{pre}_Wh", (H, 4 * H), init="orthogonal", dtype=dtype, rng=seed)
        p.new(f"{pre}_b", (4 * H,), init=gates, dtype=dtype, rng=seed)
    p.new("W_o", (H, VOCAB), dtype=dtype, rng=seed)
    p.new("b_o", (VOCAB,), init="zeros", dtype=dtype, rng=seed)
    return p


class Reverse(Task):
    unit = "sequences"
    key_metric = "seq_acc"
    key_mode = "max"
    metrics = ("loss", "seq_acc", "token_acc", "copy_seq_acc", "copy_token_acc")
    predicts = "per line (digits, separated by spaces or not): the model's greedy decoding (its reversal)"

    def __init__(self, cfg: dict):
        m, tc, d = cfg["model"], cfg["train"], cfg["data"]
        if m["min_len"] > m["max_len"]:
            raise DataError(f"model.min_len {m['min_len']} is above model.max_len {m['max_len']}")
        self.max_len = L = m["max_len"]
        self.min_len = m["min_len"]
        syn = d["synthetic"]
        self.data = {split: generate(int(syn[split]), int(syn["seed"]), k, self.min_len, L)
                     for k, split in enumerate(("train", "dev", "test")) if d[split] is not None}
        H, D, dtype, seed = m["hidden"], m["embed"], tc["dtype"], tc["seed"]
        self.dtype = np.dtype(dtype)
        self.hidden = H
        self.params = encoder_decoder_params(H, D, m["forget_bias"], dtype, seed)
        self._build(dtype)

    def _param(self, name: str):
        return self.params[name].node

    def _cell(self, pre: str):
        return self._param(f"{pre}_Wx"), self._param(f"{pre}_Wh"), self._param(f"{pre}_b")

    def _build(self, dtype) -> None:
        L, H = self.max_len, self.hidden
        E = self._param("E")
        self.src = ops.input((None, L), "int64", name="src")
        self.src_mask = ops.input((None, L), dtype, name="src_mask")
        self.dec_in = ops.input((None, L + 1), "int64", name="dec_in")
        self.tgt = ops.input((None, L + 1), "int64", name="tgt")
        self.tgt_mask = ops.input((None, L + 1), dtype, name="tgt_mask")
        self.state0 = ops.input((None, H), dtype, name="state0")
        self.inv_count = ops.input((), dtype, name="inv_count")
        enc = self._cell("enc")

        def encode(inputs, states):
            x, m = inputs
            h, c = states
            keep = ops.reshape(m, (None, 1))
            h2, c2 = lstm_step(x, h, c, *enc)
            return [], [ops.where(keep, h2, h), ops.where(keep, c2, c)]
        _, (h, c) = control.foreach(encode, [ops.lookup(E, self.src), self.src_mask], [self.state0, self.state0],
                                    name="encoder")
        dec = self._cell("dec")
        W_o, b_o = self._param("W_o"), self._param("b_o")

        def teacher(inputs, states):
            x, y, m = inputs
            h2, c2 = lstm_step(x, states[0], states[1], *dec)
            nll = ops.softmax_cross_entropy(ops.linear(h2, W_o, b_o), y) * m
            return [nll], [h2, c2]
        (nll,), _ = control.foreach(teacher, [ops.lookup(E, self.dec_in), self.tgt, self.tgt_mask], [h, c],
                                    name="decoder")
        self.nll = ops.sum(nll)
        self.model = Model([], loss=self.nll * self.inv_count, outputs={"nll": self.nll})

        go = ops.lookup(E, ops.slice_(self.dec_in, 0, 1))           # (rows, 1, D): <go>
        go = ops.reshape(go, (None, go.shape[-1]))
        done0 = ops.zeros_like(column(self.src_mask, 0))

        def not_done(vs):
            return ops.sum(1.0 - vs[3])

        def greedy(vs):
            h, c, x, done = vs
            h2, c2 = lstm_step(x, h, c, *dec)
            choice = argmax_one_hot(ops.linear(h2, W_o, b_o), VOCAB)
            return [choice], [h2, c2, choice @ E, ops.maximum(done, column(choice, EOS))]
        (tokens,), _, steps = control.while_loop(not_done, greedy, [h, c, go, done0], L + 1, name="greedy")
        self._decoding = {"tokens": tokens, "steps": steps}
        self._decoder = None

    @property
    def decoder(self) -> Model:
        """The greedy decoder, on the device and with the switches of the trained model (made on first use:
        the trainer may move the model to its device after building the task)."""
        m = self.model
        if self._decoder is None or self._decoder.device is not m.device or self._decoder.options != m.options:
            self._decoder = self.inference_model(self._decoding)
        return self._decoder

    # --- batches -------------------------------------------------------------------------------------

    def batch(self, samples):
        """The training feeds: predict's (the named behaviours :meth:`_feeds` lists, which export writes) and
        the targets (the decoder's input shifted left, <eos> last), all numpy passes over the batch."""
        L = self.max_len
        lengths = np.fromiter(map(len, samples), np.int64, len(samples))
        bad = np.flatnonzero((lengths < 1) | (lengths > L))
        if bad.size:
            raise DataError(f"a source of {lengths[bad[0]]} digits: this model reads 1 to {L} (model.max_len)")
        feeds = {k: behaviour.FEEDS[name](samples, {}, **settings) for k, (name, settings) in self._feeds().items()}
        tgt = np.full((len(samples), L + 1), EOS, np.int64)
        tgt[:, :L] = feeds["dec_in"][:, 1:]
        tgt_mask = (np.arange(L + 1) <= lengths[:, None]).astype(self.dtype)
        feeds.update(tgt=tgt, tgt_mask=tgt_mask, inv_count=np.asarray(1.0 / len(samples), self.dtype))
        return {}, feeds

    def _feeds(self) -> dict:
        """The decoder's feeds as named behaviours (minicavs.train.behaviour.FEEDS) with their settings."""
        L, dtype = self.max_len, self.dtype.name
        return {"src": ("padded_source", {"max_len": L}), "src_mask": ("source_mask", {"max_len": L, "dtype": dtype}),
                "dec_in": ("reversed_decoder_input", {"max_len": L, "go": GO, "eos": EOS}),
                "state0": ("zero_state", {"width": self.hidden, "dtype": dtype})}

    def decode(self, samples, batch_size: int) -> list:
        """The greedy decoding of each sample: its digits up to the first <eos>."""
        out = []
        for i in range(0, len(samples), batch_size):
            _, feeds = self.batch(samples[i:i + batch_size])
            tokens = to_host(self.decoder.infer({}, feeds, self.params).outputs["tokens"])
            ids = np.argmax(tokens, axis=-1)   # (steps that never ran are zeros: argmax 0, after <eos>)
            eos = ids == EOS
            stops = np.where(eos.any(axis=1), eos.argmax(axis=1), ids.shape[1])   # (each row's first <eos>)
            out += [row[:stop] for row, stop in zip(ids, stops.tolist())]
        return out

    # --- evaluation ----------------------------------------------------------------------------------

    def eval_sums(self, samples, batch_size: int) -> dict:
        nll = 0.0
        for i in range(0, len(samples), batch_size):
            _, feeds = self.batch(samples[i:i + batch_size])
            nll += float(self.model.infer({}, feeds, self.params).outputs["nll"])
        sums = {"nll": nll, "sequences": float(len(samples))}
        for name, guess in (("", self.decode(samples, batch_size)), ("copy_", list(samples))):
            seq, tok, positions = _scores(samples, guess)
            sums.update({f"{name}seq_right": seq, f"{name}tokens_right": tok})
        sums["positions"] = float(positions)
        return sums

    def eval_metrics(self, sums: dict, samples) -> dict:
        n, positions = sums["sequences"], sums["positions"]
        return {"loss": sums["nll"] / n, "seq_acc": sums["seq_right"] / n,
                "token_acc": sums["tokens_right"] / positions, "copy_seq_acc": sums["copy_seq_right"] / n,
                "copy_token_acc": sums["copy_tokens_right"] / positions}

    # --- minicavs predict ----------------------------------------------------------------------------

    def parse_input(self, line: str, where: str):
        return behaviour.read_digits(line, where, self.max_len)

    def predict(self, samples, batch_size: int) -> list[dict]:
        digits = [out.tolist() for out in self.decode(list(samples), batch_size)]
        return [{"text": "".join(map(str, d)), "digits": d} for d in digits]

    def export_spec(self) -> dict:
        """The greedy decoder (its while_loop) and predict's reading, feeding and rendering, by name."""
        return {"outputs": dict(self._decoding),
                "behaviour": {"predicts": self.predicts,
                              "reader": {"name": "digits", "settings": {"max_len": self.max_len}},
                              "graphs": {"name": "none"},
                              "feeds": {k: {"name": n, "settings": st} for k, (n, st) in self._feeds().items()},
                              "render": {"name": "tokens_until", "settings": {"output": "tokens", "eos": EOS}}}}

def _scores(samples, guesses) -> tuple[float, float, int]:
    """(sequences exactly right, target positions right (<eos> included), target positions)."""
    seq = tok = positions = 0
    for s, g in zip(samples, guesses):
        want = np.concatenate([s[::-1], [EOS]])
        got = np.concatenate([g, [EOS]])[:len(want)]
        got = np.pad(got, (0, len(want) - len(got)), constant_values=-1)
        seq += int(len(g) == len(s) and np.array_equal(g, s[::-1]))
        tok += int(np.sum(got == want))
        positions += len(want)
    return float(seq), float(tok), positions


def build(cfg: dict) -> Reverse:
    return Reverse(cfg)
