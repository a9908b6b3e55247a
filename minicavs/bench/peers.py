"""The peers (tools/dynet_*.py, tools/torch_*.py), run in their own environment (tools/setup_peers.sh): what
each is handed (this trainer's weights, data and settings as a spec.json and .npz files) and what it reports
(the last line of its stdout, JSON)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..config import REPO_ROOT
from ..training import Trainer


def tool(name: str) -> Path:
    for d in (REPO_ROOT / "tools", Path.cwd() / "tools"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"tools/{name} not found (run minicavs bench from the repository)")


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
