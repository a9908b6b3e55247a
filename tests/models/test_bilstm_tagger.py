"""models/bilstm_tagger.py: its loss equals two numpy LSTMs per sentence, its baseline is the most frequent
training tag per word counted here in plain Python, and trained through the CLI it beats that baseline and
tags a line by the language's rule."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np

from minicavs.train.cli import main

from .test_models import MODELS, trainer


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def lstm_states(P, d: str, xs, H: int) -> list:
    h, c, out = np.zeros(H), np.zeros(H), []
    for x in xs:
        i, f, o, u = np.split(x @ P[f"W_{d}"] + P[f"b_{d}"] + h @ P[f"U_{d}"], 4)
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(u)
        h = sigmoid(o) * np.tanh(c)
        out.append(h)
    return out


def reference_loss(samples, P: dict, H: int) -> float:
    total = 0.0
    for words, tags in samples:
        xs = [P["E"][w] for w in words]
        fwd, bwd = lstm_states(P, "f", xs, H), lstm_states(P, "b", xs[::-1], H)[::-1]
        for hf, hb, y in zip(fwd, bwd, tags):
            z = hf @ P["W_of"] + hb @ P["W_ob"] + P["b_o"]
            total += np.log(np.exp(z - z.max()).sum()) + z.max() - z[y]
    return total / len(samples)


def test_forward_matches_two_numpy_lstms(tmp_path):
    t = trainer("bilstm_tagger", tmp_path, "train.dtype=float64")
    samples = t.task.data["train"][:6]
    assert len({len(w) for w, _ in samples}) > 2
    graphs, feeds = t.task.batch(samples)
    params = {k: p.value for k, p in t.params.items()}
    for k, v in params.items():
        if k.startswith("b_"):
            params[k] = np.random.default_rng(4).normal(0, 0.5, v.shape)
    loss = t.model.run(graphs, feeds, params, t.context(False), backward_pass=False).loss
    assert np.isclose(float(loss), reference_loss(samples, params, t.cfg["model"]["hidden"]), rtol=1e-12, atol=0)


def test_baseline_is_the_most_frequent_training_tag_per_word(tmp_path):
    t = trainer("bilstm_tagger", tmp_path)
    counts: dict = {}
    for words, tags in t.task.data["train"]:
        for w, y in zip(words.tolist(), tags.tolist()):
            counts.setdefault(w, Counter())[y] += 1
    best = {w: min(c, key=lambda y: (-c[y], y)) for w, c in counts.items()}
    dev = t.task.data["dev"]
    right = sum(best[w] == y for words, tags in dev for w, y in zip(words.tolist(), tags.tolist()))
    want = right / sum(len(w) for w, _ in dev)
    assert np.isclose(t.evaluate("dev")["dev_baseline_acc"], want, rtol=1e-12)


def test_cli_training_beats_the_baseline_and_tags_by_the_rule(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", str(MODELS / "bilstm_tagger.yaml"), "--run-dir", str(run), "--no-progress",
                 "--set", "model.embed=16", "--set", "model.hidden=16", "--set", "train.epochs=4",
                 "--set", "data.synthetic.train=600", "--set", "data.synthetic.dev=50",
                 "--set", "data.synthetic.test=50"])
    assert code == 0
    results = json.loads((run / "results.json").read_text())
    assert results["test_acc"] > results["test_baseline_acc"] + 0.2, results
    assert "test_baseline_acc" in capsys.readouterr().out
    # w1, w3: left and right neighbours' parities; w30: a fixed tag (30 mod 3); past the ends parity 0
    (tmp_path / "in.txt").write_text("w1 w2 w3 w30 w4\n")
    assert main(["predict", str(run), str(tmp_path / "in.txt")]) == 0
    assert capsys.readouterr().out.split() == ["w1/3", "w2/6", "w3/3", "w30/0", "w4/3"]
    (tmp_path / "bad.txt").write_text("w1 cat\n")
    assert main(["predict", str(run), str(tmp_path / "bad.txt")]) == 2
    assert "bad.txt:1: unknown words ['cat']" in capsys.readouterr().err
