"""models/lattice_gru.py: its loss equals the module's equations written out in numpy, lattice by lattice;
trained through the CLI it beats the lattice LSTM's baseline (the majority tag)."""
from __future__ import annotations

import json

import numpy as np

from minicavs.train.cli import main

from .test_models import MODELS, trainer


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def gru(P, pre: str, x, h):
    z, r, n = np.split(x @ P[f"W_{pre}"] + P[f"b_{pre}"], 3)
    zh, rh = np.split(h @ P[f"U_{pre}"], 2)
    z, r = sigmoid(z + zh), sigmoid(r + rh)
    n = np.tanh(n + (r * h) @ P[f"U_{pre}n"])
    return (1 - z) * h + z * n


def reference_loss(lattices, P: dict, H: int) -> float:
    """Summed cross-entropy over every char / number of lattices: a GRU over the chars; where words end, the
    char's update and the word cells' states (a GRU step from the state of the char where each word starts)
    weighted by exp(gates) normalised against each other. Indexes the lattice directly (no input graph)."""
    total = 0.0
    for lat in lattices:
        h, states = np.zeros(H), []
        for e, ch in enumerate(lat.chars):
            x = P["E_c"][ch]
            h = gru(P, "c", x, h)
            words = [gru(P, "w", P["E_w"][w], states[b]) for b, end, w in lat.words if end == e]
            if words:
                cells = [h] + words
                weights = [np.exp(sigmoid(x @ P["W_g"] + P["b_g"] + c @ P["U_g"])) for c in cells]
                h = sum(a * c for a, c in zip(weights, cells)) / sum(weights)
            states.append(h)
            logits = h @ P["W_o"] + P["b_o"]
            total += np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[lat.labels[e]]
    return total / len(lattices)


def test_forward_matches_the_equations(tmp_path):
    t = trainer("lattice_gru", tmp_path, "train.dtype=float64", "train.policy=cavs")
    data = t.task.data["train"]
    most = lambda lat: np.bincount([e for _, e, _ in lat.words]).max() if lat.words else 0  # noqa: E731
    samples = [next(lat for lat in data if most(lat) > 1)] + data[:5]     # a char where two words end
    assert any(most(lat) == 1 for lat in samples)                          # and one where a single word ends
    graphs, feeds = t.task.batch(samples)
    params = {k: p.value for k, p in t.params.items()}
    for k, v in params.items():                     # non-zero biases, so every term is exercised
        if k.startswith("b_"):
            params[k] = np.random.default_rng(3).normal(0, 0.5, v.shape)
    loss = t.model.run(graphs, feeds, params, t.context(False), backward_pass=False).loss
    assert np.isclose(float(loss), reference_loss(samples, params, t.cfg["model"]["hidden"]), rtol=1e-12, atol=0)


def test_cli_training_beats_the_majority_tag(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", str(MODELS / "lattice_gru.yaml"), "--run-dir", str(run), "--no-progress",
                 "--set", "model.embed=16", "--set", "model.hidden=16", "--set", "train.epochs=3",
                 "--set", "train.lr=0.02", "--set", "train.batch_size=16", "--set", "data.synthetic.train=200",
                 "--set", "data.synthetic.dev=50", "--set", "data.synthetic.test=50",
                 "--set", "train.policy=cavs"])
    assert code == 0
    results = json.loads((run / "results.json").read_text())
    assert results["test_char_acc"] > results["test_majority_acc"] + 0.15, results
    assert "test_majority_acc" in capsys.readouterr().out
