"""The same LSTM language model on fixed 64-word windows (the paper's Fixed-LSTM): every chain has 64 vertices.

The corpus is joined with <eos> after each sentence and cut into windows; vertex t of a window pulls word t
and predicts word t + 1. See ``var_lstm.py`` for the cell and the loss.
"""
from __future__ import annotations

from pathlib import Path

from minicavs.train.config import at_least, load_model_module
from minicavs.data.text import EOS, windows

var_lstm = load_model_module("var_lstm", Path(__file__).resolve().parent)

NAME = "fixed_lstm"
DEFAULTS = {**var_lstm.DEFAULTS, "window": 64}
DATA_DEFAULTS = var_lstm.DATA_DEFAULTS
TRAIN_DEFAULTS = var_lstm.TRAIN_DEFAULTS
RULES = {**var_lstm.RULES, "window": at_least(1)}
DATA_RULES = var_lstm.DATA_RULES


class FixedLSTM(var_lstm.LanguageModel):
    def make_samples(self, sentences):
        eos = self.vocab.index[EOS]
        ids = [self.vocab.encode(s) for s in sentences]
        return [(w[:-1], w[1:]) for w in windows(ids, self.window, eos)]

    def __init__(self, cfg: dict):
        self.window = cfg["model"]["window"]
        super().__init__(cfg)


def build(cfg: dict) -> FixedLSTM:
    return FixedLSTM({**cfg, "model": {k: v for k, v in cfg["model"].items()}})
