"""MV-RNN against Socher et al.'s composition written out in plain numpy, tree by tree (recursively)."""
from __future__ import annotations

import numpy as np

from .test_models import trainer


def reference_loss(trees, word_ids, P: dict, H: int) -> float:
    """Summed cross-entropy over every vertex / number of trees; (a, A) per vertex by recursion."""
    total, leaf_row = 0.0, iter(word_ids)
    for tree in trees:
        node = {}
        for v, children in enumerate(tree.children):          # children come before their parent
            if not children:
                row = P["E"][next(leaf_row)]
                node[v] = (row[:H], np.eye(H) + row[H:].reshape(H, H))
            else:
                (a, A), (b, B) = node[children[0]], node[children[1]]
                p = np.tanh(np.concatenate([B @ a, A @ b]) @ P["W"] + P["b_W"])
                node[v] = (p, P["W_M"] @ np.vstack([A, B]))
            logits = node[v][0] @ P["W_o"] + P["b_o"]
            total += np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[tree.labels[v]]
    return total / len(trees)


def test_forward_matches_the_papers_composition(tmp_path):
    t = trainer("mv_rnn", tmp_path, "train.dtype=float64")
    trees = t.task.data["train"][:5]
    assert all(len(ch) in (0, 2) for tree in trees for ch in tree.children)
    graphs, feeds = t.task.batch(trees)
    params = {k: p.value for k, p in t.params.items()}
    params["b_W"] = np.random.default_rng(2).normal(0, 0.5, params["b_W"].shape)
    params["E"] = np.random.default_rng(3).normal(0, 0.5, params["E"].shape)   # matrices far from I
    loss = t.model.run(graphs, feeds, params, t.context(False), backward_pass=False).loss
    H = t.cfg["model"]["hidden"]
    assert np.isclose(float(loss), reference_loss(trees, feeds["words"], params, H), rtol=1e-12, atol=0)
