"""The SST metrics of tree_lstm against an independent computation: a per-tree numpy forward pass (vertex by
vertex, as the equations read) with the task's weights, then fine-grained and binary accuracy counted here
(binary: neutral (label 2) vertices excluded, polarity = larger of P(0)+P(1) and P(3)+P(4))."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from minicavs.data.trees import Tree
from minicavs.train.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "models" / "tree_lstm.yaml"


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _tree_probs(tree, vocab, P, H):
    """Class probabilities of every vertex of one tree (vertex order), binary Tree-LSTM, no dropout."""
    h, c, out = {}, {}, []
    for v, kids in enumerate(tree.children):
        if not kids:
            iou = P["E"][vocab.get(tree.words[v], vocab["<unk>"])] @ P["W"] + P["b_l"]
            c[v] = _sigmoid(iou[:H]) * np.tanh(iou[2 * H:])
        else:
            a, b = kids
            iou = np.concatenate([h[a], h[b]]) @ P["U"] + P["b_i"]
            f1, f2 = _sigmoid(h[a] @ P["U_f1"] + P["b_f"]), _sigmoid(h[b] @ P["U_f2"] + P["b_f"])
            c[v] = _sigmoid(iou[:H]) * np.tanh(iou[2 * H:]) + f1 * c[a] + f2 * c[b]
        h[v] = _sigmoid(iou[H:2 * H]) * np.tanh(c[v])
        z = h[v] @ P["W_o"] + P["b_o"]
        e = np.exp(z - z.max())
        out.append(e / e.sum())
    return np.array(out)


def _accuracies(probs, labels):
    fine = np.mean(probs.argmax(1) == labels)
    polar = labels != 2
    positive = probs[:, 3] + probs[:, 4] > probs[:, 0] + probs[:, 1]
    return fine, np.mean(positive[polar] == (labels[polar] > 2))


def test_sst_metrics_match_an_independent_count(tmp_path):
    t = Trainer(CONFIG, ["model.embed=6", "model.hidden=5", "model.dropout=0.5", "train.dtype=float64",
                         "data.synthetic.train=60", "data.synthetic.dev=45", "data.synthetic.vocab=40",
                         "train.eval_batch_size=7"], run_dir=tmp_path)
    rng = np.random.default_rng(0)
    for name, p in t.params.items():   # large random weights spread the predictions over the classes
        p.value[...] = rng.normal(0.0, 0.3 if name == "b_o" else 2.0, p.value.shape)
    P = {k: p.value for k, p in t.params.items()}
    trees = t.task.data["dev"]
    probs = [_tree_probs(tree, t.task.vocab, P, P["U_f1"].shape[0]) for tree in trees]
    roots = np.array([p[-1] for p in probs])
    root_labels = np.array([tree.labels[-1] for tree in trees])
    all_probs, all_labels = np.concatenate(probs), np.concatenate([tree.labels for tree in trees])
    assert 0 < np.sum(root_labels == 2) < len(trees)          # both neutral and polar roots to tell apart
    assert len(set(roots.argmax(1))) >= 3                       # predictions are not all one class
    root_fine, root_bin = _accuracies(roots, root_labels)
    all_fine, all_bin = _accuracies(all_probs, all_labels)
    m = t.evaluate("dev")   # dropout must be off here: the reference has none
    np.testing.assert_allclose([m["dev_root_acc"], m["dev_root_bin_acc"], m["dev_all_acc"], m["dev_all_bin_acc"]],
                               [root_fine, root_bin, all_fine, all_bin], rtol=0, atol=1e-12)


def test_sst_recipe_decays_every_embedding_row(tmp_path):
    """The recipe puts weight decay on all parameters: after one step, embedding rows the batch did not look up
    have shrunk too (a lazy row-sparse update would leave them as they were)."""
    small = ["model.embed=6", "model.hidden=5", "data.synthetic.train=30", "data.synthetic.vocab=40"]
    small += [f"data.{split}=synthetic" for split in ("train", "dev", "test")]
    t = Trainer(CONFIG.with_name("tree_lstm_sst.yaml"), small, run_dir=tmp_path)
    assert t.optimizer.weight_decay > 0
    batch = t.task.data["train"][:2]
    looked_up = np.unique(t.task.batch(batch)[1]["words"])
    E = t.params["E"].value
    before = E.copy()
    res = t.loss_and_grads(batch)
    t.optimizer.step(res.grads, loss=res.loss)
    others = np.setdiff1d(np.arange(len(E)), looked_up)
    assert len(others) > 0
    big = np.abs(before[others]) > t.optimizer.lr   # Adagrad's first step on g = wd * p moves p by lr toward 0
    assert np.all(np.abs(E[others][big]) < np.abs(before[others][big]))


def test_samples_are_prepared_at_load_time_as_one_tree_at_a_time_would_be(tmp_path):
    """The trainer prepares every split in bulk when it starts; each tree's graph, leaf word ids and labels
    equal what the tree says (ids through the vocabulary, unknown words -> <unk>), and a tree never seen
    (not in any split) is prepared by ``batch`` itself."""
    t = Trainer(CONFIG, ["data.synthetic.train=30", "data.synthetic.dev=12", "data.synthetic.vocab=40"],
                run_dir=tmp_path)
    task, vocab = t.task, t.task.vocab
    trees = t.task.data["train"] + t.task.data["dev"]
    assert all(task.samples[id(tree)][0] is tree for tree in trees)   # before any batch
    for tree in trees:
        graph, ids, labels = task.samples[id(tree)][1:]
        assert [graph.children(v).tolist() for v in range(graph.num_vertices)] == [list(ch) for ch in tree.children]
        leaf_words = [w for w, ch in zip(tree.words, tree.children) if not ch]
        assert ids.tolist() == [vocab.get(w, vocab["<unk>"]) for w in leaf_words]
        assert labels.tolist() == list(tree.labels)
    new = Tree([[], [], [0, 1]], np.array([1, 2, 3]), ["no-such-word", trees[0].words[0], None])
    graphs, feeds = task.batch([trees[1], new])
    assert feeds["words"][-2:].tolist() == [vocab["<unk>"], vocab[trees[0].words[0]]]
    assert graphs[1].child_idx.tolist() == [0, 1] and task.samples[id(new)][0] is new
