"""Lattice GRU character tagger (ED-Batch's LatticeGRU workload) on the lattice LSTM's generated lattices.

The lattice LSTM's task, data, vertex kinds and classifier (``lattice_lstm.py``), with GRU cells: every kind
scatters its state h (H,), so the structure has one message shape. ED-Batch's LatticeGRU is Su et al. 2017's
lattice encoder; this is the GRU analogue of Zhang & Yang's cells, not Su et al.'s exact network: a char
cell where words end merges its own update and the word cells ending there with gates normalised against
each other, as the lattice LSTM merges cells. Rows @ W convention, σ = sigmoid.

One GRU step from state h with input x, weights W (D, 3H), U (H, 2H), U_n (H, H), bias b (3H,):
    [z, r, n_x] = x·W + b;   [z_h, r_h] = h·U;   z = σ(z + z_h);   r = σ(r + r_h)
    n = tanh(n_x + (r ⊙ h)·U_n);   h' = h + z ⊙ (n - h)              (= (1 - z) ⊙ h + z ⊙ n)
``word`` (word w over chars b..e, gathers char b's state h_b): h_w = gru_step(p, "w", x_w, h_b)
``char`` (no word ends here, gathers the previous char's h_p; char 0 reads zeros): h = gru_step(p, "c", x, h_p)
``char_words`` (words k = 1..n end here, with states h_k): h_0 = gru_step(p, "c", x, h_p), then
    g_k = σ(x·W_g + h_k·U_g + b_g) for k = 0..n;   a_0 = exp(g_0),  a_k = m_k · exp(g_k)
    h = Σ_k a_k ⊙ h_k / Σ_k a_k        (m_k: the pulled word mask, 0 for an empty slot, which reads h_k = 0)
Every char pushes h; softmax(h·W_o + b_o) tags it; loss and metrics (``char_acc`` beside the
``majority_acc`` baseline) as in ``lattice_lstm.py``.
"""
from __future__ import annotations

from pathlib import Path

from minicavs import ops
from minicavs.runtime.vertex import VertexFunction
from minicavs.train.config import load_model_module

lattice_lstm = load_model_module("lattice_lstm", Path(__file__).resolve().parent)

NAME = "lattice_gru"
DEFAULTS = {k: v for k, v in lattice_lstm.DEFAULTS.items() if k != "cell"}
DATA_DEFAULTS = lattice_lstm.DATA_DEFAULTS
TRAIN_DEFAULTS = lattice_lstm.TRAIN_DEFAULTS
RULES = {k: v for k, v in lattice_lstm.RULES.items() if k != "cell"}
DATA_RULES = lattice_lstm.DATA_RULES


def gru_step(p, pre: str, x, h):
    """One GRU step (the module docstring's equation) with the parameters ``W_<pre>``, ``U_<pre>``,
    ``U_<pre>n``, ``b_<pre>``."""
    zx, rx, nx = ops.split(ops.linear(x, p[f"W_{pre}"].node, p[f"b_{pre}"].node), 3)
    zh, rh = ops.split(h @ p[f"U_{pre}"].node, 2)
    z, r = ops.sigmoid(zx + zh), ops.sigmoid(rx + rh)
    n = ops.tanh(nx + (r * h) @ p[f"U_{pre}n"].node)
    return h + z * (n - h)


def cells(p, H: int, D: int, words_per_char: int, dropout: float, dtype) -> dict:
    def embedded(fn: VertexFunction, name: str, site: int):
        x = fn.pull((D,), name)
        return ops.dropout(x, dropout, site=site) if dropout else x

    def finish(fn: VertexFunction, h, site: int) -> None:
        fn.scatter(h)
        fn.push(ops.dropout(h, dropout, site=site) if dropout else h)

    word = VertexFunction("word", arity=1, message=(H,), dtype=dtype)
    with word:
        word.scatter(gru_step(p, "w", embedded(word, "xw", 1), word.gather(0, kinds=("char", "char_words"))))
    char = VertexFunction("char", arity=1, message=(H,), dtype=dtype)
    with char:
        finish(char, gru_step(p, "c", embedded(char, "x", 2), char.gather(0, kinds=("char", "char_words"))), 3)
    merge = VertexFunction("char_words", arity=1 + words_per_char, message=(H,), dtype=dtype)
    with merge:
        x = embedded(merge, "x", 4)
        h0 = gru_step(p, "c", x, merge.gather(0, kinds=("char", "char_words")))
        mask = ops.split(merge.pull((words_per_char,), "word_mask"), words_per_char)
        xg = ops.linear(x, p["W_g"].node, p["b_g"].node)
        a0 = ops.exp(ops.sigmoid(xg + h0 @ p["U_g"].node))
        num, den = a0 * h0, a0
        for k in range(1, 1 + words_per_char):
            h_k = merge.gather(k, kinds="word")
            a_k = ops.exp(ops.sigmoid(xg + h_k @ p["U_g"].node)) * mask[k - 1]
            num, den = num + a_k * h_k, den + a_k
        finish(merge, num / den, 5)
    return {"char": char, "char_words": merge, "word": word}


class LatticeGRU(lattice_lstm.LatticeLSTM):
    def make_params(self, p, m: dict, dtype, seed) -> None:
        H, D = m["hidden"], m["embed"]
        for kind in ("w", "c"):
            p.new(f"W_{kind}", (D, 3 * H), dtype=dtype, rng=seed)
            p.new(f"U_{kind}", (H, 2 * H), dtype=dtype, rng=seed)
            p.new(f"U_{kind}n", (H, H), dtype=dtype, rng=seed)
            p.new(f"b_{kind}", (3 * H,), init="zeros", dtype=dtype, rng=seed)
        p.new("W_g", (D, H), dtype=dtype, rng=seed)
        p.new("U_g", (H, H), dtype=dtype, rng=seed)
        p.new("b_g", (H,), init="zeros", dtype=dtype, rng=seed)

    def make_cells(self, p, m: dict, dtype) -> dict:
        return cells(p, m["hidden"], m["embed"], self.slots, m["dropout"], dtype)


def build(cfg: dict) -> LatticeGRU:
    return LatticeGRU(cfg)
