"""The benchmark's workloads: trainers for each model at a given size, their useful matmul FLOPs, the
machine's matmul rate and the timed training loop."""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ..engine.compile import EngineOptions
from ..train.config import bundled_models_dir, load_config
from ..train.trainer import Trainer

OFF = EngineOptions(lazy_batching=False, eager_batching=False, fusion=False, gather_elision=False)
SWITCHES = {"all off": OFF, "lazy batching": replace(OFF, lazy_batching=True),
            "eager batching": replace(OFF, eager_batching=True), "streaming": replace(OFF, streaming=True),
            "fusion": replace(OFF, fusion=True), "gather elision": replace(OFF, gather_elision=True),
            "default (all but streaming)": EngineOptions(), "all on": EngineOptions(streaming=True)}
ABLATED = tuple(f for f in EngineOptions.__dataclass_fields__    # the fields SWITCHES vary
                if len({getattr(o, f) for o in SWITCHES.values()}) > 1)
WORKLOADS = ("tree_lstm", "tree_fc", "var_lstm")


def models_dir() -> Path:
    return bundled_models_dir()


def _trainer(config: str, overrides: list, opts: EngineOptions, extra: Sequence[str] = ()) -> Trainer:
    """``extra`` overrides come last (e.g. ``train.device=cuda``)."""
    t = Trainer(load_config(models_dir() / config, list(overrides) + list(extra)),
                run_dir=tempfile.mkdtemp(prefix="minicavs-bench-"))
    t.model.options = opts
    return t


def tree_lstm(sst: str, hidden: int, embed: int, batch: int, trees: int, opts: EngineOptions,
              extra: Sequence[str] = ()) -> Trainer:
    return _trainer("tree_lstm.yaml", [
        f"data.train={sst}", "data.dev=null", "data.test=null", f"data.limit={trees}", f"model.hidden={hidden}",
        f"model.embed={embed}", "model.dropout=0.0", "train.optimizer=adam", "train.lr=0.001",
        f"train.batch_size={batch}", "train.weight_decay=0.0", "train.sparse_updates=true"], opts, extra)


def tree_fc(hidden: int, leaves: int, batch: int, trees: int, opts: EngineOptions,
            extra: Sequence[str] = ()) -> Trainer:
    return _trainer("tree_fc.yaml", [f"model.hidden={hidden}", f"model.leaves={leaves}", f"train.batch_size={batch}",
                                     f"data.synthetic.train={trees}", "data.dev=null"], opts, extra)


def var_lstm(text: str, sentences: int, hidden: int, embed: int, batch: int, opts: EngineOptions,
             extra: Sequence[str] = ()) -> Trainer:
    t = _trainer("var_lstm.yaml", [f"data.train={text}", "data.dev=null", "data.test=null", "model.dropout=0.0",
                                   f"model.hidden={hidden}", f"model.embed={embed}", f"train.batch_size={batch}",
                                   "train.lr=0.001"], opts, extra)
    t.task.data["train"] = t.task.data["train"][:sentences]
    return t


def fixed_lstm(text: str | None, hidden: int, batch: int, opts: EngineOptions, windows: int | None = None,
               embed: int = 128, extra: Sequence[str] = ()) -> Trainer:
    """64-word windows of ``text`` (synthetic text without it); the first ``windows`` (default 8 batches)."""
    data = [f"data.train={text}", "data.dev=null", "data.test=null"] if text else \
        ["data.synthetic.train=1500", "data.synthetic.vocab=2000", "data.dev=null", "data.test=null"]
    t = _trainer("fixed_lstm.yaml", data + [f"model.hidden={hidden}", f"model.embed={embed}", "model.dropout=0.0",
                                            f"train.batch_size={batch}", "train.lr=0.001"], opts, extra)
    t.task.data["train"] = t.task.data["train"][:windows or batch * 8]
    return t


# --- useful matmul FLOPs of one forward pass (the equations' products; backward counts 2x more) ---------

def tree_lstm_flops(trees, embed: int, hidden: int, classes: int = 5) -> float:
    """Leaf: x·W (E x 3H); internal: [h1; h2]·U (2H x 3H) and h_k·U_fk (H x H, twice); classifier at
    every vertex (H x C)."""
    leaves = sum(sum(1 for ch in t.children if not ch) for t in trees)
    vertices = sum(len(t.children) for t in trees)
    internal = vertices - leaves
    H = hidden
    return 2.0 * (leaves * embed * 3 * H + internal * (2 * H * 3 * H + 2 * H * H) + vertices * H * classes)


def tree_fc_flops(trees: int, leaves: int, hidden: int) -> float:
    """Leaves x·W_l (H x H), internal [h_l; h_r]·W (2H x H), root h·w_o (H x 1)."""
    H = hidden
    return 2.0 * trees * (leaves * H * H + (leaves - 1) * 2 * H * H + H)


def lstm_lm_flops(lengths, embed: int, hidden: int, vocab: int) -> float:
    """Per step x·W_x (D x 4H) and the softmax layer (H x V); h·W_h (H x 4H) except at the first step,
    whose h is zero."""
    steps = float(sum(lengths))
    H = hidden
    return 2.0 * (steps * (embed * 4 * H + H * vocab) + (steps - len(lengths)) * H * 4 * H)


def machine_rate(repeats: int = 5, n: int = 2048) -> float:
    """Median FLOP/s of numpy float32 n x n x n matmuls in this process."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / float(np.median(times[1:]))


def throughput(t: Trainer, epochs: int) -> list[float]:
    """Units (trees or words) per second of each timed epoch (one warm-up epoch first)."""
    data = t.task.data["train"]
    bs = t.cfg["train"]["batch_size"]
    units = t.task.units(data)
    rates = []
    for epoch in range(epochs + 1):
        start = time.perf_counter()
        for i in range(0, len(data), bs):
            res = t.loss_and_grads(data[i:i + bs])
            t.optimizer.step(res.grads, loss=res.loss)
        if epoch:
            rates.append(units / (time.perf_counter() - start))
    return rates


# --- the sweeps' workloads: one trainer per sweep point ----------------------------------------------------

@dataclass(frozen=True)
class Data:
    """Where each model's data comes from and how many samples one epoch has before the time cap."""

    sst: str | None = None     # SST train file (Tree-LSTM); None: minicavs' synthetic treebank
    ptb: str | None = None     # PTB text (Var-LSTM, Fixed-LSTM); None: minicavs' synthetic corpus
    trees: int = 1024          # Tree-LSTM trees
    fc_trees: int = 256        # Tree-FC trees
    sentences: int = 2000      # Var-LSTM sentences
    windows: int = 512         # Fixed-LSTM 64-word windows
    tree_embed: int = 128      # Tree-LSTM embeddings
    lm_embed: int = 256        # LM embeddings


def build(point, data: Data, opts: EngineOptions = EngineOptions(), extra: Sequence[str] = ()) -> Trainer:
    """The trainer of one sweep point (``sweeps.Point``) with ``data``'s samples; ``extra`` config overrides
    come last (``train.device=cuda``: tools/gpu_check.py)."""
    m, H, B = point.model, point.hidden, point.batch
    if m == "tree_lstm":
        if data.sst is None:
            return _trainer("tree_lstm.yaml", [
                f"data.synthetic.train={data.trees}", "data.dev=null", "data.test=null", f"model.hidden={H}",
                f"model.embed={data.tree_embed}", "model.dropout=0.0", "train.optimizer=adam", "train.lr=0.001",
                f"train.batch_size={B}", "train.weight_decay=0.0", "train.sparse_updates=true"], opts, extra)
        return tree_lstm(data.sst, H, data.tree_embed, B, data.trees, opts, extra)
    if m == "tree_fc":
        return tree_fc(H, point.leaves, B, data.fc_trees, opts, extra)
    if m == "var_lstm":
        if data.ptb is None:
            t = _trainer("var_lstm.yaml", ["data.synthetic.train=" + str(data.sentences), "data.dev=null",
                                           "data.test=null", "model.dropout=0.0", f"model.hidden={H}",
                                           f"model.embed={data.lm_embed}", f"train.batch_size={B}",
                                           "train.lr=0.001"], opts, extra)
            t.task.data["train"] = t.task.data["train"][:data.sentences]
            return t
        return var_lstm(data.ptb, data.sentences, H, data.lm_embed, B, opts, extra)
    if m == "fixed_lstm":
        return fixed_lstm(data.ptb, H, B, opts, windows=data.windows, embed=data.lm_embed, extra=extra)
    raise ValueError(f"unknown model {m!r}")


def flops_per_unit(t: Trainer, samples, point) -> float:
    """Useful matmul FLOPs of one forward pass per unit (tree or word) over ``samples``."""
    m, H = point.model, point.hidden
    if m == "tree_lstm":
        return tree_lstm_flops(samples, t.cfg["model"]["embed"], H) / len(samples)
    if m == "tree_fc":
        return tree_fc_flops(1, point.leaves, H)
    lengths = [len(x) for x, _ in samples]
    return lstm_lm_flops(lengths, t.cfg["model"]["embed"], H, len(t.task.vocab)) / sum(lengths)
