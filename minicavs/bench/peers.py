"""The peers: the benchmark's models written in DyNet and PyTorch for the comparison only (tools/dynet_*.py,
tools/torch_*.py), run in their own environment (tools/setup_peers.sh), never imported by minicavs. This
module hands a minicavs :class:`~minicavs.train.trainer.Trainer`'s weights, data and optimizer to a peer script
and parses what it reports.

Which peers each model has (:data:`PEERS`), by framework and mode::

    model        DyNet (autobatching)       PyTorch per sample            PyTorch batched
    tree_lstm    dynet_tree_lstm.py         torch_tree_lstm.py recursive  torch_tree_lstm.py level
    tree_fc      dynet_tree_fc.py           torch_tree_fc.py recursive    torch_tree_fc.py level
    var_lstm     dynet_lstm_lm.py           torch_lstm_lm.py recursive    torch_lstm_lm.py packed (nn.LSTM)
    fixed_lstm   dynet_lstm_lm.py           torch_lstm_lm.py recursive    torch_lstm_lm.py packed (nn.LSTM)

ED-Batch's other workloads have DyNet peers only, run by :func:`run` (and minicavs/bench/ed_batch.py) but
not by the sweeps: the BiLSTM tagger, the LSTM encoder-decoder, the lattice GRU and LSTM
(dynet_bilstm_tagger.py, dynet_lstm_nmt.py, dynet_lattice_gru.py, dynet_lattice_lstm.py), the Tree-GRU,
the MV-RNN (dynet_tree_gru.py, dynet_mv_rnn.py) and TreeLSTM-2Type (dynet_tree_lstm.py, with kinds).
DyNet also runs ``unbatched`` (autobatch=0).
Every peer computes the same function as the minicavs model with the same weights (each script's docstring
writes its equations and how minicavs' layout maps onto its framework's); Fixed-LSTM's peers are the LM
scripts fed minicavs' 64-word windows.

The protocol, the same for every peer script::

    python tools/PEER.py SPEC.json

SPEC.json (written by :func:`run`):

- ``mode``: how the peer computes (above);
- ``samples``: the first samples to time, the very ones minicavs was timed on at the point (default all);
  ``epochs``: timed epochs over them, after one whole untimed warm-up epoch in the same process (tools/
  peer_common.py: one-time costs such as DyNet's memory pools land there); ``check``: the number of samples
  (the first ones) whose loss the peer computes with the weights as handed over, before any update;
- ``max_seconds``: the warm-up epoch stops after the first batch that reaches it (its whole epoch's seconds
  extrapolated from the batches run); a system whose warm-up epoch took (or would take) longer is timed for
  fewer epochs (at least one), never on other samples;
- ``timed_seconds`` (optional): a timed epoch stops after the first batch that reaches it, its rate taken over
  the batches it ran (the sweep's hard cap: only a peer several times slower than minicavs reaches it);
- ``inference``: also time forward-only passes (no gradient) over the same prefix;
- ``device`` (PyTorch only; default ``cpu``): where the peer computes, e.g. ``cuda`` (tools/gpu_check.py);
- ``per_core`` (PyTorch only): after the timed protocol, the same again on one intra-op thread in the same
  process, reported under ``per_core`` (the per-core measurement without a second start-up);
- ``batch``, ``threads`` (PyTorch's intra-op threads; DyNet computes on one), ``optimizer``: minicavs'
  optimizer as ``{"name", **hyper()}`` (tools/torch_peer.py and tools/dynet_peer.py build the same rule);
- ``weights``: an .npz of the trainer's parameters under minicavs' names and layout (rows @ W);
- the data: ``trees`` inline (Tree-LSTM, Tree-GRU, MV-RNN, TreeLSTM-2Type: children lists, leaf word ids,
  labels; ``kinds`` for TreeLSTM-2Type); ``children`` inline and
  ``data`` .npz with ``xs`` (trees x leaves x H) and ``ys`` (Tree-FC); ``data`` .npz with ``inputs`` and
  ``targets`` of all samples concatenated and ``ptr`` (sample offsets) (LMs; the BiLSTM tagger: words and
  tags); ``data`` with ``inputs`` and ``ptr`` and inline ``eos``, ``go`` (the LSTM encoder-decoder);
  ``lattices`` inline (the lattice GRU and LSTM: chars, words as [start, end, word id], labels).

Output: the LAST line of the peer's stdout is one JSON object with

- ``check_loss`` (and ``check``, ``mode``, ``epochs``, ``max_seconds`` echoed);
- ``rates``: units per second (trees, or words = predictions) of each timed training epoch (forward,
  backward, update); ``infer_rates`` likewise for forward-only passes, when asked;
- ``units``, ``samples``, ``batches``: what one timed epoch covered (``timed_batches``, ``infer_timed_batches``:
  the batches a capped epoch ran, at most ``batches``); ``capped``: whether it is less than the
  data handed over; ``warmup_s``: the warm-up epoch's seconds (extrapolated when capped), ``warmup_batches``:
  the batches it ran; ``epochs_timed``;
- DyNet: ``construction_s`` and ``compute_s``, seconds per timed epoch spent building the graph in Python
  (renew_cg and the expressions) vs in forward (with autobatching), backward and update (the paper's
  Fig. 9 / Table 1 split); ``infer_construction_s``/``infer_compute_s`` for inference;
- DyNet: ``mem_mb``, the memory pools it was given (:func:`run`: 2048 MB from the start, so that no epoch
  waits on a pool sized too small for it);
- ``threads`` (DyNet: 1, with ``threads_note`` saying why), ``peak_rss_mb`` (the peer process's peak resident
  memory, getrusage ru_maxrss), ``versions`` (python, numpy, torch or dynet38), ``framework``,
  ``optimizer`` (the framework's class).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine.backend import to_host
from ..train.config import REPO_ROOT
from ..train.trainer import Trainer


@dataclass(frozen=True)
class Peer:
    framework: str   # "dynet" or "pytorch": which environment runs it (--dynet-python, --torch-python)
    mode: str
    label: str


PER_SAMPLE = ("recursive",)   # the modes that run one sample at a time (no batching)
_LM = (Peer("dynet", "autobatch", "DyNet (autobatching)"),
       Peer("pytorch", "recursive", "PyTorch (per-sample LSTMCell loop)"),
       Peer("pytorch", "packed", "PyTorch (nn.LSTM, packed)"))
PEERS = {
    "tree_lstm": (Peer("dynet", "autobatch", "DyNet (autobatching)"),
                  Peer("pytorch", "recursive", "PyTorch (per-sample recursion)"),
                  Peer("pytorch", "level", "PyTorch (batched by level)")),
    "tree_fc": (Peer("dynet", "autobatch", "DyNet (autobatching)"),
                Peer("pytorch", "recursive", "PyTorch (per-sample recursion)"),
                Peer("pytorch", "level", "PyTorch (batched by level)")),
    "var_lstm": _LM,
    "fixed_lstm": _LM,
}
_DYNET = ("autobatch", "unbatched")
SCRIPTS = {   # (framework, model) -> (peer script, its modes: the default first)
    ("dynet", "tree_lstm"): ("dynet_tree_lstm.py", _DYNET), ("dynet", "tree_fc"): ("dynet_tree_fc.py", _DYNET),
    ("dynet", "var_lstm"): ("dynet_lstm_lm.py", _DYNET), ("dynet", "fixed_lstm"): ("dynet_lstm_lm.py", _DYNET),
    ("dynet", "bilstm_tagger"): ("dynet_bilstm_tagger.py", _DYNET),
    ("dynet", "lstm_nmt"): ("dynet_lstm_nmt.py", _DYNET),
    ("dynet", "lattice_gru"): ("dynet_lattice_gru.py", _DYNET),
    ("dynet", "lattice_lstm"): ("dynet_lattice_lstm.py", _DYNET),
    ("dynet", "tree_gru"): ("dynet_tree_gru.py", _DYNET), ("dynet", "mv_rnn"): ("dynet_mv_rnn.py", _DYNET),
    ("dynet", "tree_lstm_2type"): ("dynet_tree_lstm.py", _DYNET),
    ("pytorch", "tree_lstm"): ("torch_tree_lstm.py", ("level", "recursive")),
    ("pytorch", "tree_fc"): ("torch_tree_fc.py", ("level", "recursive")),
    ("pytorch", "var_lstm"): ("torch_lstm_lm.py", ("packed", "recursive")),
    ("pytorch", "fixed_lstm"): ("torch_lstm_lm.py", ("packed", "recursive")),
}
IMPORTS = {"dynet": "import dynet_config; dynet_config.set(mem=32); import dynet", "pytorch": "import torch"}
SETUP = "tools/setup_peers.sh makes one (then pass its bin/python)"


def tool(name: str) -> Path:
    for d in (REPO_ROOT / "tools", Path.cwd() / "tools"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"tools/{name} not found (run minicavs bench from the repository)")


def peer_settings(t: Trainer) -> dict:
    """What every peer is told besides weights and data: batch size, this trainer's optimizer (name and
    hyperparameters) and one thread per core."""
    return {"batch": t.cfg["train"]["batch_size"], "lr": t.optimizer.lr, "threads": os.cpu_count() or 1,
            "optimizer": {"name": type(t.optimizer).__name__.lower(), **t.optimizer.hyper()}}


def missing(python: str | None, framework: str) -> str | None:
    """Why ``python`` cannot run ``framework``'s peers (not given, not found, the import fails), or None."""
    if not python:
        return f"no python given for the {framework} peers ({SETUP})"
    if shutil.which(python) is None:
        return f"{python} not found ({SETUP})"
    out = subprocess.run([python, "-c", IMPORTS[framework]], capture_output=True, text=True)
    if out.returncode:
        return f"{python} cannot {IMPORTS[framework].split('; ')[-1]} ({SETUP}): {out.stderr.strip()[-300:]}"
    return None


def check_loss(t: Trainer, k: int) -> float:
    """minicavs' loss of the first ``k`` training samples with the trainer's weights (the peers' check)."""
    graphs, feeds = t.task.batch(t.task.data["train"][:k])
    return float(t.model.infer(graphs, feeds, t.params, t.context(training=False)).loss)


def same_loss(ours: float, theirs: float, rel: float = 1e-4) -> bool:
    return abs(ours - theirs) <= rel * abs(ours) + 1e-12


def _trees(t: Trainer, limit: int | None = None) -> list:
    """The trainer's SST trees as plain JSON for the peers: children, labels, leaf word ids and, where the
    model gives its vertices kinds (TreeLSTM-2Type), the kinds."""
    trees = []
    for tree in t.task.data["train"][:limit]:
        graph, ids, labels = t.task._prepared(tree)
        leaves = [v for v, ch in enumerate(tree.children) if not ch]
        trees.append({"children": tree.children, "labels": labels.tolist(),
                      "words": {str(v): int(i) for v, i in zip(leaves, ids)}})
        if graph.kinds is not None:
            trees[-1]["kinds"] = list(graph.kinds)
    return trees


def _handover(t: Trainer, model: str, limit: int | None) -> tuple[dict, dict]:
    """(spec entries, .npz arrays by spec key) with the trainer's weights and its first ``limit`` samples."""
    arrays = {"weights": {k: to_host(p.value) for k, p in t.params.items()}}
    data = t.task.data["train"][:limit]
    if model in ("tree_lstm", "tree_gru", "mv_rnn", "tree_lstm_2type"):
        return {"trees": _trees(t, limit)}, arrays
    if model == "tree_fc":
        arrays["data"] = {"xs": np.stack([x for x, _ in data]), "ys": np.array([y for _, y in data])}
        return {"children": t.task.tree.children}, arrays
    if model in ("lattice_gru", "lattice_lstm"):
        return {"lattices": [{"chars": lat.chars.tolist(), "labels": lat.labels.tolist(),
                              "words": [[int(b), int(e), int(w)] for b, e, w in lat.words]}
                             for lat in data]}, arrays
    if model == "lstm_nmt":   # sources only: the peer makes the targets (reversed, then <eos>)
        arrays["data"] = {"inputs": np.concatenate(data),
                          "ptr": np.concatenate(([0], np.cumsum([len(x) for x in data])))}
        return {"eos": t.task.eos, "go": t.task.go}, arrays
    arrays["data"] = {"inputs": np.concatenate([x for x, _ in data]), "targets": np.concatenate([y for _, y in data]),
                      "ptr": np.concatenate(([0], np.cumsum([len(x) for x, _ in data])))}
    return {}, arrays


def run(python: str, framework: str, t: Trainer | None, *, mode: str | None = None, epochs: int = 3,
        check: int = 8, max_seconds: float | None = None, inference: bool = False, limit: int | None = None,
        samples: int | None = None, threads: int | None = None, timeout: float | None = None,
        dynet_mem: int = 2048, device: str | None = None, timed_seconds: float | None = None,
        prepared: dict | None = None, per_core: bool = False) -> dict:
    """Run ``framework``'s peer of ``t``'s model ("dynet" or "pytorch"; ``mode`` defaults to the first of
    :data:`SCRIPTS`: DyNet's autobatching, PyTorch's batched peer) on ``t``'s current weights, timed on its
    first ``samples`` training samples (all by default; the samples minicavs was timed on) with the protocol
    above, and handed its first ``limit`` (default: ``samples``); returns the peer's JSON. PyTorch
    computes with ``threads`` intra-op threads (default: one per core; DyNet always uses one), on ``device``
    (PyTorch's name for it, e.g. ``cuda``; default the CPU; DyNet runs on the CPU only). ``timed_seconds``
    caps each timed epoch, ``per_core`` adds the one-thread run (the protocol's keys). ``prepared``:
    :func:`prepare`'s handover of ``t``, written once and run by several peers and rounds (``t`` may then be
    None).

    DyNet starts with ``dynet_mem`` MB of memory pools (2048: as much as its graphs at hidden 512 and batch
    64 need, so the pools are never what a timed epoch waits for) and is run again with twice as much while
    its graphs do not fit (with autobatching it cannot grow them; tools/dynet_peer.py), up to 64 GB.

    Raises FileNotFoundError when ``python`` does not exist, RuntimeError naming the module when it cannot
    import the framework, when the peer fails (its stderr) or one run of it takes longer than ``timeout``
    seconds."""
    model = prepared["model"] if prepared else t.cfg["model"]["name"]
    if (framework, model) not in SCRIPTS:
        raise ValueError(f"no {framework} peer for model {model!r}; peers: {sorted(SCRIPTS)}")
    script, modes = SCRIPTS[framework, model]
    mode = mode or modes[0]
    if mode not in modes:
        raise ValueError(f"{script}: mode {mode!r} unknown; it runs {', '.join(modes)}")
    if device and framework != "pytorch":
        raise ValueError(f"device {device!r}: only the PyTorch peers take a device")
    if not python or shutil.which(python) is None:
        raise FileNotFoundError(f"python for the {framework} peers not found: {python!r} ({SETUP})")
    with tempfile.TemporaryDirectory(prefix="minicavs-peer-") as d:
        spec = dict(prepared or prepare(t, limit if limit is not None else samples, d))
        spec.update(mode=mode, epochs=epochs, check=check, max_seconds=max_seconds, inference=inference,
                    samples=samples, timed_seconds=timed_seconds)
        if threads:
            spec["threads"] = threads
        if per_core and framework == "pytorch":
            spec["per_core"] = True
        if device:
            spec["device"] = device
        if framework == "dynet":
            spec["mem"] = dynet_mem
        return _launch(python, script, mode, spec, d, timeout)


def prepare(t: Trainer, limit: int | None, directory: str) -> dict:
    """The spec's trainer part (``model``, weights, data, batch, optimizer) with ``t``'s weights and its first
    ``limit`` samples, the arrays saved as .npz files in ``directory``: what every peer of a point is
    handed, in every round."""
    model = t.cfg["model"]["name"]
    spec, arrays = _handover(t, model, limit)
    for name, content in arrays.items():
        spec[name] = os.path.join(directory, f"{name}.npz")
        np.savez(spec[name], **content)
    return {**spec, **peer_settings(t), "model": model}


def _launch(python: str, script: str, mode: str, spec: dict, d: str, timeout: float | None) -> dict:
    """Run the peer ``script`` on ``spec`` (written into ``d``), DyNet again with twice its memory pools while
    its graphs do not fit; the peer's JSON line, or RuntimeError naming what failed."""
    while True:
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump(spec, f)
        try:
            out = subprocess.run([python, str(tool(script)), os.path.join(d, "spec.json")],
                                 capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{script} ({mode}) ran longer than {timeout} s") from None
        if not (out.returncode and "pre-allocate enough memory" in out.stderr and spec["mem"] < 2 ** 16):
            break
        spec["mem"] *= 2
    if out.returncode:
        gone = re.search(r"No module named '([\w.]+)'", out.stderr)
        if gone:
            raise RuntimeError(f"{python} cannot import {gone.group(1)} for {script} ({SETUP})")
        raise RuntimeError(f"{script} ({mode}) failed:\n{out.stderr[-2000:]}")
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"{script} ({mode}) printed no JSON line:\n{out.stdout[-1000:]}") from None
