"""The benchmark's workloads: trainers for each model at a given size, their useful matmul FLOPs, the
machine's matmul rate and the timed training loop."""
from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..config import REPO_ROOT, load_config
from ..engine import EngineOptions
from ..training import Trainer

OFF = EngineOptions(lazy_batching=False, eager_batching=False, fusion=False, gather_elision=False)
SWITCHES = {"all off": OFF, "lazy batching": replace(OFF, lazy_batching=True),
            "eager batching": replace(OFF, eager_batching=True), "streaming": replace(OFF, streaming=True),
            "fusion": replace(OFF, fusion=True), "gather elision": replace(OFF, gather_elision=True),
            "default (all but streaming)": EngineOptions(), "all on": EngineOptions(streaming=True)}
WORKLOADS = ("tree_lstm", "tree_fc", "var_lstm")


def models_dir() -> Path:
    for d in (Path.cwd() / "models", REPO_ROOT / "models"):
        if (d / "tree_lstm.yaml").is_file():
            return d
    raise FileNotFoundError("minicavs bench needs the models/ directory of the repository (run it from there)")


def _trainer(config: str, overrides: list, opts: EngineOptions) -> Trainer:
    t = Trainer(load_config(models_dir() / config, overrides), run_dir=tempfile.mkdtemp(prefix="minicavs-bench-"))
    t.model.options = opts
    return t


def tree_lstm(sst: str, hidden: int, embed: int, batch: int, trees: int, opts: EngineOptions) -> Trainer:
    return _trainer("tree_lstm.yaml", [
        f"data.train={sst}", "data.dev=null", "data.test=null", f"data.limit={trees}", f"model.hidden={hidden}",
        f"model.embed={embed}", "model.dropout=0.0", "train.optimizer=adam", "train.lr=0.001",
        f"train.batch_size={batch}", "train.weight_decay=0.0", "train.sparse_updates=true"], opts)


def tree_fc(hidden: int, leaves: int, batch: int, trees: int, opts: EngineOptions) -> Trainer:
    return _trainer("tree_fc.yaml", [f"model.hidden={hidden}", f"model.leaves={leaves}", f"train.batch_size={batch}",
                                     f"data.synthetic.train={trees}", "data.dev=null"], opts)


def var_lstm(text: str, sentences: int, hidden: int, embed: int, batch: int, opts: EngineOptions) -> Trainer:
    t = _trainer("var_lstm.yaml", [f"data.train={text}", "data.dev=null", "data.test=null", "model.dropout=0.0",
                                   f"model.hidden={hidden}", f"model.embed={embed}", f"train.batch_size={batch}",
                                   "train.lr=0.001"], opts)
    t.task.data["train"] = t.task.data["train"][:sentences]
    return t


def fixed_lstm(text: str | None, hidden: int, batch: int, opts: EngineOptions) -> Trainer:
    data = [f"data.train={text}", "data.dev=null", "data.test=null"] if text else \
        ["data.synthetic.train=1500", "data.synthetic.vocab=2000", "data.dev=null", "data.test=null"]
    t = _trainer("fixed_lstm.yaml", data + [f"model.hidden={hidden}", "model.embed=128", "model.dropout=0.0",
                                            f"train.batch_size={batch}"], opts)
    t.task.data["train"] = t.task.data["train"][:batch * 8]
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


def machine_rate(repeats: int = 5) -> float:
    """Median FLOP/s of numpy float32 2048 x 2048 x 2048 matmuls in this process."""
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - start)
    return 2 * 2048 ** 3 / float(np.median(times[1:]))


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
