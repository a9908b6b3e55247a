"""``minicavs bench``: the measuring stick of the engine passes.

Workload: binary Tree-LSTM training (forward, backward, Adam update, sparse embedding rows as in DyNet) on the first 1024 trees of SST train,
embeddings 128, batch 64 trees, float32. Prints trees/s for minicavs and, given a Python that has DyNet 2.2
(`pip install dynet38` in its own environment, `--dynet-python`), for the same model in DyNet with
autobatching (tools/dynet_tree_lstm.py), in one run, after checking both compute the same loss for the same
weights. ``--ablation`` prints the speedup of each engine switch over all-off (the paper's Fig. 10) on
Tree-LSTM and Fixed-LSTM. Medians over the timed epochs; the machine is noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from .config import REPO_ROOT, load_config
from .engine import EngineOptions
from .training import Trainer

SWITCHES = {"all off": EngineOptions(False, False), "lazy batching": EngineOptions(True, False),
            "eager batching": EngineOptions(False, True), "streaming": EngineOptions(False, False, True),
            "lazy + eager (default)": EngineOptions(True, True), "all on": EngineOptions(True, True, True)}


def models_dir() -> Path:
    for d in (Path.cwd() / "models", REPO_ROOT / "models"):
        if (d / "tree_lstm.yaml").is_file():
            return d
    raise FileNotFoundError("minicavs bench needs the models/ directory of the repository (run it from there)")


def tree_lstm(sst: str, hidden: int, embed: int, batch: int, trees: int, opts: EngineOptions) -> Trainer:
    cfg = load_config(models_dir() / "tree_lstm.yaml", [
        f"data.train={sst}", "data.dev=null", "data.test=null", f"data.limit={trees}", f"model.hidden={hidden}",
        f"model.embed={embed}", "model.dropout=0.0", "train.optimizer=adam", "train.lr=0.001",
        f"train.batch_size={batch}", "train.weight_decay=0.0", "train.sparse_updates=true"])
    t = Trainer(cfg, run_dir=tempfile.mkdtemp(prefix="minicavs-bench-"))
    t.model.options = opts
    return t


def fixed_lstm(text: str | None, hidden: int, batch: int, opts: EngineOptions) -> Trainer:
    data = [f"data.train={text}", "data.dev=null", "data.test=null"] if text else \
        ["data.synthetic.train=1500", "data.synthetic.vocab=2000", "data.dev=null", "data.test=null"]
    cfg = load_config(models_dir() / "fixed_lstm.yaml", data + [
        f"model.hidden={hidden}", "model.embed=128", "model.dropout=0.0", f"train.batch_size={batch}"])
    t = Trainer(cfg, run_dir=tempfile.mkdtemp(prefix="minicavs-bench-"))
    t.task.data["train"] = t.task.data["train"][:batch * 8]
    t.model.options = opts
    return t


def throughput(t: Trainer, epochs: int) -> list[float]:
    """Samples per second of each timed epoch (one warm-up epoch first)."""
    data = t.task.data["train"]
    bs = t.cfg["train"]["batch_size"]
    rates = []
    for epoch in range(epochs + 1):
        start = time.perf_counter()
        for i in range(0, len(data), bs):
            res = t.loss_and_grads(data[i:i + bs])
            t.optimizer.step(res.grads, loss=res.loss)
        if epoch:
            rates.append(len(data) / (time.perf_counter() - start))
    return rates


def dynet(python: str, t: Trainer, check_trees: int, epochs: int) -> dict:
    """Run tools/dynet_tree_lstm.py with this trainer's current weights and trees."""
    tool = REPO_ROOT / "tools" / "dynet_tree_lstm.py"
    if not tool.is_file():
        tool = Path.cwd() / "tools" / "dynet_tree_lstm.py"
    trees = []
    for tree in t.task.data["train"]:
        _, ids, labels = t.task._prepared(tree)
        leaves = [v for v, ch in enumerate(tree.children) if not ch]
        trees.append({"children": tree.children, "labels": labels.tolist(),
                      "words": {str(v): int(i) for v, i in zip(leaves, ids)}})
    with tempfile.TemporaryDirectory() as d:
        np.savez(os.path.join(d, "w.npz"), **{k: p.value for k, p in t.params.items()})
        spec = {"weights": os.path.join(d, "w.npz"), "trees": trees, "hidden": t.cfg["model"]["hidden"],
                "batch": t.cfg["train"]["batch_size"], "lr": t.cfg["train"]["lr"], "epochs": epochs,
                "check_trees": check_trees}
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        out = subprocess.run([python, str(tool), os.path.join(d, "spec.json")], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(f"DyNet run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sst", default="../shared/data/sst/train.txt", help="SST train file")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 512])
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--trees", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up epoch)")
    p.add_argument("--dynet-python", default=None, help="a python with dynet38 installed")
    p.add_argument("--ablation", action="store_true", help="speedup of each switch over all-off (Fig. 10)")
    p.add_argument("--ptb", default="../shared/data/ptb/ptb.valid.txt", help="text for the Fixed-LSTM ablation")


def run(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.sst):
        raise FileNotFoundError(f"SST train file not found: {args.sst} (pass --sst)")
    print(f"Tree-LSTM training: first {args.trees} SST trees, embeddings {args.embed}, batch {args.batch}, "
          f"float32, Adam; median of {args.epochs} epochs after a warm-up")
    for h in args.hidden:
        t = tree_lstm(args.sst, h, args.embed, args.batch, args.trees, SWITCHES["lazy + eager (default)"])
        line = f"  hidden {h:>4}: minicavs "
        ref = None
        if args.dynet_python:
            check = t.task.data["train"][:8]
            ours = t.loss_and_grads(check, training=False).loss
            ref = dynet(args.dynet_python, t, len(check), args.epochs)
            rel = abs(ours - ref["check_loss"]) / max(1.0, abs(ours))
            print(f"  hidden {h:>4}: same loss for the same weights on {len(check)} trees: "
                  f"{'yes' if rel < 1e-4 else 'NO'} (minicavs {ours:.6f}, DyNet {ref['check_loss']:.6f})")
        rate = float(np.median(throughput(t, args.epochs)))
        line += f"{rate:8.1f} trees/s"
        if ref:
            dy = float(np.median(ref["trees_per_s"]))
            line += f"   DyNet (autobatching) {dy:8.1f} trees/s   ratio {rate / dy:5.2f}x"
        print(line)
    if args.ablation:
        print("\nspeedup over all switches off (Fig. 10), median epoch time ratio")
        ptb = args.ptb if os.path.isfile(args.ptb) else None
        for name in ("Tree-LSTM", "Fixed-LSTM"):
            for h in (64, 128, 256, 512):
                rates = {}
                for label, opts in SWITCHES.items():
                    t = (tree_lstm(args.sst, h, args.embed, args.batch, args.trees, opts) if name == "Tree-LSTM"
                         else fixed_lstm(ptb, h, args.batch, opts))
                    rates[label] = float(np.median(throughput(t, args.epochs)))
                base = rates["all off"]
                print(f"  {name:<10} hidden {h:>3}: " + "  ".join(
                    f"{k} {v / base:4.2f}x" for k, v in rates.items() if k != "all off")
                    + f"   (all off {base:.1f}/s)")
    return 0
