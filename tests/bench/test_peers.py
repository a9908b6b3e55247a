"""The benchmark's peers (minicavs/bench/peers.py, tools/*_peer.py, tools/peer_common.py).

Without a peer environment: the peer table, the errors a missing peer gives and the timed protocol the peer
scripts share (run here with plain Python steps). With one (tools/setup_peers.sh), set
MINICAVS_TORCH_PYTHON and/or MINICAVS_DYNET_PYTHON to its python: every peer of every model then computes
minicavs' loss for minicavs' weights (relative 1e-4) on tiny configurations and reports the protocol's keys.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import numpy as np
import pytest

from minicavs.bench import peers
from minicavs.bench.workloads import models_dir
from minicavs.train.config import load_config
from minicavs.train.trainer import Trainer

TORCH_PYTHON = os.environ.get("MINICAVS_TORCH_PYTHON")
DYNET_PYTHON = os.environ.get("MINICAVS_DYNET_PYTHON")
PYTHONS = {"pytorch": TORCH_PYTHON, "dynet": DYNET_PYTHON}
VARIABLE = {"pytorch": "MINICAVS_TORCH_PYTHON", "dynet": "MINICAVS_DYNET_PYTHON"}


def _peer_common():
    """tools/peer_common.py, loaded from its file (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("peer_common", peers.tool("peer_common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_peer_has_a_script_and_a_known_mode():
    for model, listed in peers.PEERS.items():
        assert {p.framework for p in listed} == {"dynet", "pytorch"}
        for p in listed:
            script, modes = peers.SCRIPTS[p.framework, model]
            assert peers.tool(script).is_file() and p.mode in modes
    assert set(peers.PEERS) == {"tree_lstm", "tree_fc", "var_lstm", "fixed_lstm"}


def test_a_missing_peer_says_what_is_missing(tmp_path):
    t = _trainer("tree_fc", hidden=4, leaves=4, batch=2, samples=4)
    with pytest.raises(FileNotFoundError, match="setup_peers.sh"):
        peers.run(str(tmp_path / "no-python"), "pytorch", t)
    assert "not found" in peers.missing(str(tmp_path / "no-python"), "dynet")
    assert "no python given" in peers.missing(None, "pytorch")
    if importlib.util.find_spec("dynet") is None:   # this interpreter lacks DyNet: the import error is named
        assert "cannot import dynet" in peers.missing(sys.executable, "dynet")
        with pytest.raises(RuntimeError, match="cannot import dynet"):
            peers.run(sys.executable, "dynet", t, epochs=1)
    with pytest.raises(ValueError, match="mode"):
        peers.run(sys.executable, "pytorch", t, mode="packed")
    with pytest.raises(ValueError, match="only the PyTorch peers take a device"):
        peers.run(sys.executable, "dynet", t, device="cuda")


def test_protocol_warms_up_a_whole_epoch_then_times_the_given_samples():
    pc = _peer_common()
    calls = []

    def train(batch):
        calls.append(("train", batch))
        return 0.25, 0.5

    def infer(batch):
        calls.append(("infer", batch))

    spec = {"batch": 2, "epochs": 2, "samples": 5, "inference": True}
    out = pc.measure(spec, [3] * 100, lambda i, j: list(range(i, j)), train, infer)
    batches = [[0, 1], [2, 3], [4]]          # the first 5 samples, whole batches and the rest
    assert (out["samples"], out["units"], out["batches"], out["capped"]) == (5, 15, 3, True)
    assert [b for kind, b in calls if kind == "train"] == 3 * batches    # one warm-up epoch, two timed
    assert [b for kind, b in calls if kind == "infer"] == 3 * batches
    assert out["construction_s"] == [0.25 * 3] * 2 and out["compute_s"] == [0.5 * 3] * 2
    assert len(out["rates"]) == len(out["infer_rates"]) == out["epochs_timed"] == 2 and out["warmup_s"] > 0
    calls.clear()
    out = pc.measure({"batch": 2, "epochs": 1}, [1, 2, 3], lambda i, j: list(range(i, j)), train)
    assert (out["samples"], out["units"], out["batches"], out["capped"]) == (3, 6, 2, False)   # default: all
    assert calls == 2 * [("train", [0, 1]), ("train", [2])] and "infer_rates" not in out


def test_protocol_waits_for_the_device_before_every_clock_read():
    """A GPU peer's work is queued when a step returns: ``sync`` brackets every timed region."""
    pc = _peer_common()
    log = []
    spec = {"batch": 2, "epochs": 2, "samples": 4, "inference": True}
    out = pc.measure(spec, [1] * 4, lambda i, j: list(range(i, j)), lambda b: log.append("train"),
                     lambda b: log.append("infer"), sync=lambda: log.append("sync"))
    assert out["batches"] == 2
    epoch = ["sync", "{}", "{}", "sync"]
    assert log == [x.format("train") for x in 3 * epoch] + [x.format("infer") for x in 3 * epoch]


def test_a_peer_far_slower_than_the_cap_warms_up_within_it_and_is_timed_on_the_same_samples():
    pc = _peer_common()
    sizes = []

    def train(batch):   # per-sample cost, as per-sample recursion has
        sizes.append(len(batch))
        time.sleep(0.002 * len(batch))

    out = pc.measure({"batch": 10, "epochs": 3, "samples": 30, "max_seconds": 0.01}, [1] * 200,
                     lambda i, j: list(range(i, j)), train)
    assert out["samples"] == 30 and out["batches"] == 3 and out["warmup_s"] > 0.01
    # the warm-up stops at the cap (its first batch), like a timed epoch; one whole timed epoch
    assert out["warmup_batches"] == 1 and out["epochs_timed"] == len(out["rates"]) == 1
    assert sizes == [10] + [10, 10, 10]


def test_a_timed_epoch_stops_at_the_timed_cap_and_is_rated_over_the_batches_it_ran(monkeypatch):
    """``timed_seconds``: a peer far slower than the others (a fake clock: 2 s a sample) warms up within the
    epoch cap and times only its first batches, each epoch's rate over the units those batches hold."""
    pc = _peer_common()
    clock = [0.0]
    monkeypatch.setattr(pc.time, "perf_counter", lambda: clock[0])
    batches = []

    def train(batch):
        batches.append(batch)
        clock[0] += 2.0 * len(batch)

    spec = {"batch": 2, "epochs": 2, "samples": 8, "max_seconds": 3.0, "timed_seconds": 7.0, "inference": True}
    out = pc.measure(spec, [5, 1, 1, 1, 1, 1, 1, 1], lambda i, j: list(range(i, j)), train, train)
    assert out["warmup_batches"] == 1 and out["batches"] == 4            # warm-up: the batch reaching 3 s
    assert out["timed_batches"] == out["infer_timed_batches"] == 2       # 4 s, then 8 s >= 7 s: stop
    assert out["epochs_timed"] == 1 and out["rates"] == [(5 + 1 + 1 + 1) / 8.0] == out["infer_rates"]
    assert batches == [[0, 1]] + [[0, 1], [2, 3]] + [[0, 1]] + [[0, 1], [2, 3]]
    batches.clear()
    out = pc.measure({**spec, "timed_seconds": None, "inference": False}, [1] * 8, lambda i, j: list(range(i, j)), train)
    assert out["timed_batches"] == 4 and len(batches) == 1 + 4      # no timed cap: the whole epoch


# --- the peers themselves (need tools/setup_peers.sh's environment) ------------------------------------------

def _trainer(model: str, hidden: int, batch: int, samples: int, leaves: int = 8, extra=()) -> Trainer:
    sets = {"tree_lstm": ["data.synthetic.vocab=50", "model.embed=6", "model.dropout=0.0", "train.optimizer=adam",
                          "train.lr=0.001", "train.weight_decay=0.0", "train.sparse_updates=true"],
            "tree_fc": [f"model.leaves={leaves}"],
            "var_lstm": ["data.synthetic.vocab=30", "model.embed=5", "model.dropout=0.0"],
            "fixed_lstm": ["data.synthetic.vocab=30", "model.embed=5", "model.dropout=0.0", "model.window=9"],
            "bilstm_tagger": ["model.vocab=12", "model.embed=5", "model.dropout=0.0", "data.synthetic.max_len=9"],
            "lstm_nmt": ["model.embed=5", "model.max_len=5"],
            "lattice_gru": ["model.embed=5", "data.synthetic.max_len=12", "train.policy=cavs"],
            "lattice_lstm": ["model.embed=5", "data.synthetic.max_len=12", "train.policy=cavs"],
            "tree_gru": ["data.synthetic.vocab=50", "model.embed=6", "model.dropout=0.0", "train.weight_decay=0.0"],
            "mv_rnn": ["data.synthetic.vocab=50", "model.dropout=0.0", "train.weight_decay=0.0"],
            "tree_lstm_2type": ["data.synthetic.vocab=50", "model.embed=6", "model.dropout=0.0",
                                "train.optimizer=adam", "train.lr=0.001", "train.weight_decay=0.0"]}
    over = sets[model] + [f"model.hidden={hidden}", f"train.batch_size={batch}", f"data.synthetic.train={samples}",
                          "data.dev=null"] + (["data.test=null"] if model != "tree_fc" else []) + list(extra)
    t = Trainer(load_config(models_dir() / f"{model}.yaml", over), run_dir=None)
    t.task.data["train"] = t.task.data["train"][:samples]
    return t


CASES = [(model, p) for model, listed in peers.PEERS.items() for p in listed] + \
    [("tree_fc", peers.Peer("dynet", "unbatched", "DyNet (no batching)"))] + \
    [(model, peers.Peer("dynet", "autobatch", "DyNet (autobatching)"))
     for model in ("bilstm_tagger", "lstm_nmt", "lattice_gru", "lattice_lstm", "tree_gru", "mv_rnn",
                   "tree_lstm_2type")]


def _scramble(t: Trainer, scale: float = 0.3) -> None:
    """Every weight drawn anew, each of its own (at initialization some share their values, e.g. the two cell
    types of TreeLSTM-2Type, and small weights leave a loss near log(classes) whatever a cell computes), so
    that the loss check tells a peer's cells apart. Written into the arrays the model computes with."""
    rng = np.random.default_rng(5)
    for p in t.params.values():
        p.value[...] = rng.normal(0.0, scale, p.value.shape)


@pytest.mark.parametrize("model,peer", CASES, ids=[f"{m}-{p.framework}-{p.mode}" for m, p in CASES])
def test_peer_computes_minicavs_loss_and_reports_the_protocol(model, peer):
    python = PYTHONS[peer.framework]
    if not python:
        pytest.skip(f"set {VARIABLE[peer.framework]} to a python with the {peer.framework} peers "
                    "(tools/setup_peers.sh)")
    t = _trainer(model, hidden=6, batch=3, samples=7)
    _scramble(t)
    check = 4
    ours = peers.check_loss(t, check)
    out = peers.run(python, peer.framework, t, mode=peer.mode, epochs=2, check=check, inference=True, samples=7)
    assert peers.same_loss(ours, out["check_loss"]), (ours, out["check_loss"])
    assert out["mode"] == peer.mode and out["check"] == check and not out["capped"]
    assert out["samples"] == 7 and out["batches"] == 3
    assert out["units"] == t.task.units(t.task.data["train"])
    assert len(out["rates"]) == len(out["infer_rates"]) == 2 and min(out["rates"] + out["infer_rates"]) > 0
    assert out["peak_rss_mb"] > 10 and out["versions"]["python"]
    if peer.framework == "dynet":
        assert out["threads"] == 1 and "MKL" in out["threads_note"] and "dynet38" in out["versions"]
        assert out["mem_mb"] == 2048   # the pools it was given from the start, as reported
        assert len(out["construction_s"]) == len(out["compute_s"]) == len(out["infer_compute_s"]) == 2
        assert min(out["construction_s"] + out["compute_s"]) > 0
    else:
        assert out["threads"] == (os.cpu_count() or 1) and out["versions"]["torch"].startswith("2.")


@pytest.mark.skipif(not TORCH_PYTHON, reason="set MINICAVS_TORCH_PYTHON to a python with torch (setup_peers.sh)")
def test_samples_and_limit_set_what_a_peer_times():
    t = _trainer("tree_fc", hidden=16, batch=4, samples=40, leaves=16)
    out = peers.run(TORCH_PYTHON, "pytorch", t, mode="level", epochs=1, check=2, samples=6, limit=40)
    assert out["capped"] and out["samples"] == 6 and out["batches"] == 2 and out["epochs_timed"] == 1
    out = peers.run(TORCH_PYTHON, "pytorch", t, mode="level", epochs=1, check=2, limit=6)
    assert not out["capped"] and out["samples"] == 6 and out["batches"] == 2


LAZY_ADAM = ["train.optimizer=adam", "train.lr=0.01", "train.weight_decay=0.0", "train.sparse_updates=true"]


@pytest.mark.skipif(not TORCH_PYTHON, reason="set MINICAVS_TORCH_PYTHON to a python with torch (setup_peers.sh)")
@pytest.mark.parametrize("model,mode", [("tree_lstm", "level"), ("tree_lstm", "recursive"), ("var_lstm", "packed"),
                                        ("var_lstm", "recursive")])
def test_pytorch_peers_update_every_parameter_as_minicavs_does(model, mode, tmp_path):
    """After two updates (the bench's Adam with lazy embedding rows) every parameter of the PyTorch peer equals
    minicavs': the rows the first batch looked up and the second did not stay where the first step put them
    (a dense Adam moves them again, by their first moment)."""
    import subprocess
    import numpy as np
    t = _trainer(model, hidden=6, batch=3, samples=6, extra=LAZY_ADAM)
    spec, arrays = peers._handover(t, model, 6)
    spec.update(peers.peer_settings(t), mode=mode, epochs=1, check=1, steps=2, steps_to=str(tmp_path / "after.npz"))
    for name, content in arrays.items():
        spec[name] = str(tmp_path / f"{name}.npz")
        np.savez(spec[name], **content)
    (tmp_path / "spec.json").write_text(__import__("json").dumps(spec))
    script = peers.tool(peers.SCRIPTS["pytorch", model][0])
    subprocess.run([TORCH_PYTHON, str(script), str(tmp_path / "spec.json")], check=True, capture_output=True)
    before = {k: np.array(p.value) for k, p in t.params.items()}
    t.train_batches([np.arange(0, 3), np.arange(3, 6)])
    theirs = np.load(tmp_path / "after.npz")
    assert set(theirs.files) == set(t.params)
    for name, p in t.params.items():
        moved = np.abs(p.value - before[name]).max()
        assert moved > 0, name
        np.testing.assert_allclose(theirs[name], p.value, rtol=0, atol=1e-3 * moved, err_msg=name)
