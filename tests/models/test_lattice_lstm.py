"""The lattice LSTM against Zhang & Yang's equations written out in plain numpy, lattice by lattice."""
from __future__ import annotations

import numpy as np

from .test_models import trainer


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def reference_loss(lattices, P: dict, H: int) -> float:
    """Summed cross-entropy over every char of every lattice / number of lattices, from the paper's cells:
    word cells (Eq. 12-13), the plain LSTM where no word ends, the normalised merge (Eq. 14-16) where
    words end. Indexes the lattice directly (no input graph, no vertex ids)."""
    total = 0.0
    for lat in lattices:
        h_prev, c_prev = np.zeros(H), np.zeros(H)
        states = []
        for e, ch in enumerate(lat.chars):
            x = P["E_c"][ch]
            i, f, o, u = np.split(x @ P["W_c"] + P["b_c"] + h_prev @ P["U_c"], 4)
            words = sorted((e - b, b, w) for b, end, w in lat.words if end == e)
            if not words:
                c = sigmoid(f) * c_prev + sigmoid(i) * np.tanh(u)
            else:
                cells, weights = [np.tanh(u)], [np.exp(sigmoid(i))]
                for _, b, w in words:
                    h_b, c_b = states[b]
                    wi, wf, wu = np.split(P["E_w"][w] @ P["W_w"] + P["b_w"] + h_b @ P["U_w"], 3)
                    c_w = sigmoid(wf) * c_b + sigmoid(wi) * np.tanh(wu)
                    cells.append(c_w)
                    weights.append(np.exp(sigmoid(x @ P["W_g"] + P["b_g"] + c_w @ P["U_g"])))
                c = sum(a * v for a, v in zip(weights, cells)) / sum(weights)
            h = sigmoid(o) * np.tanh(c)
            states.append((h, c))
            h_prev, c_prev = h, c
            logits = h @ P["W_o"] + P["b_o"]
            total += np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[lat.labels[e]]
    return total / len(lattices)


def test_forward_matches_the_papers_equations(tmp_path):
    t = trainer("lattice_lstm", tmp_path, "train.dtype=float64")
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
    H = t.cfg["model"]["hidden"]
    assert np.isclose(float(loss), reference_loss(samples, params, H), rtol=1e-12, atol=0)
