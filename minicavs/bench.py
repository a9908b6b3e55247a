"""``minicavs bench``: training throughput against peers measured in the same run, and the switch ablation.

Workloads (float32, Adam, forward + backward + update; medians over the timed epochs after a warm-up):
- ``tree_lstm``: binary Tree-LSTM on the first 1024 SST train trees, embeddings 128, batch 64, sparse
  embedding updates (as DyNet updates lookup parameters); peers: DyNet with autobatching
  (tools/dynet_tree_lstm.py, ``--dynet-python``), PyTorch batched by level and PyTorch per-sample recursion
  on the first ``--recursive-trees`` trees (tools/torch_tree_lstm.py, ``--torch-python``).
- ``tree_fc``: Tree-FC on complete binary trees of 256 leaves, hidden 256, batch 64; peer: PyTorch batched
  by level by hand (tools/torch_tree_fc.py, ``--torch-python``).
- ``var_lstm``: LSTM LM on the first 2000 sentences of PTB's ptb.valid.txt (vocabulary from that file),
  hidden 512, embeddings 256, batch 64; peer: PyTorch ``nn.LSTM`` on packed sequences (tools/torch_lstm_lm.py).
Before timing, each peer computes the loss of a few samples with minicavs' weights; the check is printed.
Each model's useful matmul FLOPs (the equations' products, no rows of zeros; forward + backward = 3x forward)
give its achieved rate as a fraction of this machine's numpy float32 2048^3 matmul rate, measured here.
Peers run in their own environments: tools/setup_peers.sh. ``--ablation`` prints each engine switch's
speedup over all switches off (the paper's Fig. 10) on Tree-LSTM and Fixed-LSTM.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from .config import REPO_ROOT, load_config
from .engine import EngineOptions
from .training import Trainer

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


def tool(name: str) -> Path:
    for d in (REPO_ROOT / "tools", Path.cwd() / "tools"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"tools/{name} not found (run minicavs bench from the repository)")


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


def peer_settings(t: Trainer) -> dict:
    """What every PyTorch peer is told besides weights and data: batch size, this trainer's optimizer
    (name and hyperparameters, tools/torch_peer.py builds the same rule) and one thread per core."""
    return {"batch": t.cfg["train"]["batch_size"], "lr": t.optimizer.lr, "threads": os.cpu_count() or 1,
            "optimizer": {"name": type(t.optimizer).__name__.lower(), **t.optimizer.hyper()}}


def _peer(python: str, script: str, spec: dict, arrays: dict) -> dict:
    """Run a peer script in its own environment with weights and data handed over as .npz files."""
    with tempfile.TemporaryDirectory() as d:
        for name, content in arrays.items():
            np.savez(os.path.join(d, f"{name}.npz"), **content)
            spec[name] = os.path.join(d, f"{name}.npz")
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        out = subprocess.run([python, str(tool(script)), os.path.join(d, "spec.json")], capture_output=True,
                             text=True)
    if out.returncode:
        raise RuntimeError(f"{script} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _trees(t: Trainer, limit: int | None = None) -> list:
    """The trainer's SST trees as plain JSON for the peers: children, labels, leaf word ids."""
    trees = []
    for tree in t.task.data["train"][:limit]:
        _, ids, labels = t.task._prepared(tree)
        leaves = [v for v, ch in enumerate(tree.children) if not ch]
        trees.append({"children": tree.children, "labels": labels.tolist(),
                      "words": {str(v): int(i) for v, i in zip(leaves, ids)}})
    return trees


def dynet(python: str, t: Trainer, check_trees: int, epochs: int) -> dict:
    """Run tools/dynet_tree_lstm.py with this trainer's current weights and trees."""
    trees = _trees(t)
    with tempfile.TemporaryDirectory() as d:
        np.savez(os.path.join(d, "w.npz"), **{k: p.value for k, p in t.params.items()})
        spec = {"weights": os.path.join(d, "w.npz"), "trees": trees, "hidden": t.cfg["model"]["hidden"],
                "batch": t.cfg["train"]["batch_size"], "lr": t.cfg["train"]["lr"], "epochs": epochs,
                "check_trees": check_trees}
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        out = subprocess.run([python, str(tool("dynet_tree_lstm.py")), os.path.join(d, "spec.json")],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(f"DyNet run failed:\n{out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"check_loss": res["check_loss"], "rates": res["trees_per_s"]}


def torch_tree_lstm(python: str, t: Trainer, mode: str, limit: int | None, epochs: int) -> dict:
    """tools/torch_tree_lstm.py (``level`` or ``recursive``) with this trainer's weights and trees."""
    return _peer(python, "torch_tree_lstm.py",
                 {**peer_settings(t), "mode": mode, "trees": _trees(t, limit), "epochs": epochs, "check_trees": 8},
                 {"weights": {k: p.value for k, p in t.params.items()}})


def torch_tree_fc(python: str, t: Trainer, check_trees: int, epochs: int) -> dict:
    """tools/torch_tree_fc.py with this trainer's weights and trees (inputs in minicavs' leaf order)."""
    data = t.task.data["train"]
    return _peer(python, "torch_tree_fc.py", {**peer_settings(t), "epochs": epochs, "check_trees": check_trees},
                 {"weights": {k: p.value for k, p in t.params.items()},
                  "data": {"xs": np.stack([x for x, _ in data]), "ys": np.array([y for _, y in data])}})


def torch_lstm_lm(python: str, t: Trainer, check_sentences: int, epochs: int) -> dict:
    """tools/torch_lstm_lm.py with this trainer's weights and sentences (input and target ids)."""
    data = t.task.data["train"]
    return _peer(python, "torch_lstm_lm.py",
                 {**peer_settings(t), "epochs": epochs, "check_sentences": check_sentences},
                 {"weights": {k: p.value for k, p in t.params.items()},
                  "data": {"inputs": np.concatenate([x for x, _ in data]),
                           "targets": np.concatenate([y for _, y in data]),
                           "ptr": np.concatenate(([0], np.cumsum([len(x) for x, _ in data])))}})


def _check_line(name: str, k: int, unit: str, ours: float, theirs: float) -> str:
    rel = abs(ours - theirs) / max(1.0, abs(ours))
    return (f"    same loss for the same weights on {k} {unit}: {'yes' if rel < 1e-4 else 'NO'} "
            f"(minicavs {ours:.6f}, {name} {theirs:.6f})")


def _report(label: str, unit: str, rate: float, flops: float, machine: float, peer: str | None,
            ref: dict | None) -> None:
    """One line: minicavs' rate and matmul FLOP rate (% of the machine); the peer's, and the ratio."""
    line = (f"  {label:<34} minicavs {rate:9.1f} {unit}/s   matmul rate {rate * flops / 1e9:6.1f} GFLOP/s "
            f"= {100 * rate * flops / machine:4.1f}% of the machine")
    if ref is not None:
        theirs = float(np.median(ref["rates"]))
        threads = f", {ref['threads']} threads" if "threads" in ref else ""
        line += (f"   {peer}{threads} {theirs:9.1f} {unit}/s ({100 * theirs * flops / machine:4.1f}%)"
                 f"   ratio {rate / theirs:5.2f}x")
    print(line)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--sst", default="../shared/data/sst/train.txt", help="SST train file")
    p.add_argument("--ptb", default="../shared/data/ptb/ptb.valid.txt", help="text of the LM workloads")
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 512], help="Tree-LSTM hidden sizes")
    p.add_argument("--embed", type=int, default=128, help="Tree-LSTM embedding size")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--trees", type=int, default=1024, help="SST trees per Tree-LSTM epoch")
    p.add_argument("--fc-trees", type=int, default=512, help="trees per Tree-FC epoch")
    p.add_argument("--sentences", type=int, default=2000, help="sentences per Var-LSTM epoch")
    p.add_argument("--recursive-trees", type=int, default=128,
                   help="trees per epoch of the (slow) per-sample PyTorch Tree-LSTM")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs (after one warm-up epoch)")
    p.add_argument("--dynet-python", default=None, help="a python with dynet38 (tools/setup_peers.sh)")
    p.add_argument("--torch-python", default=None, help="a python with torch (tools/setup_peers.sh)")
    p.add_argument("--ablation", action="store_true", help="speedup of each switch over all-off (Fig. 10)")


def run(args: argparse.Namespace) -> int:
    machine = machine_rate()
    print(f"machine: numpy float32 2048^3 matmul {machine / 1e9:.1f} GFLOP/s (median of 5); "
          f"medians of {args.epochs} timed epochs after a warm-up; float32, Adam")
    if "tree_lstm" in args.workloads:
        if not os.path.isfile(args.sst):
            raise FileNotFoundError(f"SST train file not found: {args.sst} (pass --sst)")
        print(f"Tree-LSTM: first {args.trees} SST trees, embeddings {args.embed}, batch {args.batch}")
        for h in args.hidden:
            t = tree_lstm(args.sst, h, args.embed, args.batch, args.trees, EngineOptions())
            ref = None
            if args.dynet_python:
                check = t.task.data["train"][:8]
                ref = dynet(args.dynet_python, t, len(check), args.epochs)
                print(_check_line("DyNet", len(check), "trees", t.loss_and_grads(check, training=False).loss,
                                  ref["check_loss"]))
            flops = 3 * tree_lstm_flops(t.task.data["train"], args.embed, h) / len(t.task.data["train"])
            rate = float(np.median(throughput(t, args.epochs)))
            _report(f"hidden {h}", "trees", rate, flops, machine, "DyNet (autobatching)", ref)
            if args.torch_python:
                for mode, limit in (("level", None), ("recursive", args.recursive_trees)):
                    ref = torch_tree_lstm(args.torch_python, t, mode, limit, args.epochs)
                    print(_check_line(f"PyTorch {mode}", 8, "trees", t.loss_and_grads(
                        t.task.data["train"][:8], training=False).loss, ref["check_loss"]))
                    label = "batched by level" if mode == "level" else f"per-sample recursion, {limit} trees"
                    _report(f"hidden {h}", "trees", rate, flops, machine, f"PyTorch ({label})", ref)
    if "tree_fc" in args.workloads:
        H, L = 256, 256
        print(f"Tree-FC: {args.fc_trees} complete binary trees of {L} leaves, hidden {H}, batch {args.batch}")
        t = tree_fc(H, L, args.batch, args.fc_trees, EngineOptions())
        ref = None
        if args.torch_python:
            check = t.task.data["train"][:4]
            ref = torch_tree_fc(args.torch_python, t, len(check), args.epochs)
            print(_check_line("PyTorch", len(check), "trees", t.loss_and_grads(check, training=False).loss,
                              ref["check_loss"]))
        _report(f"leaves {L}, hidden {H}", "trees", float(np.median(throughput(t, args.epochs))),
                3 * tree_fc_flops(1, L, H), machine, "PyTorch (by level)", ref)
    if "var_lstm" in args.workloads:
        if not os.path.isfile(args.ptb):
            raise FileNotFoundError(f"PTB text not found: {args.ptb} (pass --ptb)")
        H, D = 512, 256
        t = var_lstm(args.ptb, args.sentences, H, D, args.batch, EngineOptions())
        data = t.task.data["train"]
        V = len(t.task.vocab)
        print(f"Var-LSTM LM: first {len(data)} sentences of {os.path.basename(args.ptb)} "
              f"({t.task.units(data)} words), vocabulary {V} from that file, hidden {H}, embeddings {D}, "
              f"batch {args.batch}")
        ref = None
        if args.torch_python:
            check = data[:8]
            ref = torch_lstm_lm(args.torch_python, t, len(check), args.epochs)
            print(_check_line("PyTorch", len(check), "sentences", t.loss_and_grads(check, training=False).loss,
                              ref["check_loss"]))
        flops = 3 * lstm_lm_flops([len(x) for x, _ in data], D, H, V) / t.task.units(data)
        _report("hidden 512", "words", float(np.median(throughput(t, args.epochs))), flops, machine,
                "PyTorch nn.LSTM (packed)", ref)
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
