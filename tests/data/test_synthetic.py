"""The synthetic sentiment treebank: deterministic, labelled by its hidden rule, not dominated by one label."""
from __future__ import annotations

import numpy as np

from minicavs.data.sst import read_sst, write_sst
from minicavs.data.synthetic import Lexicon, compose, label_of, synthetic_treebank
from minicavs.data.trees import complete_binary_tree


def test_deterministic_and_split_dependent():
    a = synthetic_treebank(50, seed=3)
    b = synthetic_treebank(50, seed=3)
    c = synthetic_treebank(50, seed=3, split=1)
    assert [t.to_bracket() for t in a] == [t.to_bracket() for t in b]
    assert [t.to_bracket() for t in a] != [t.to_bracket() for t in c]


def test_labels_follow_the_hidden_rule():
    lex = Lexicon(1000, seed=3)
    for t in synthetic_treebank(100, seed=3):
        value = {}
        for v, ch in enumerate(t.children):  # children come before parents
            if not ch:
                value[v] = (lex.kind(t.words[v]), lex.polarity.get(t.words[v], 0.0))
            else:
                value[v] = ("plain", compose(value[ch[0]], value[ch[1]]))
            assert t.labels[v] == label_of(value[v][1])


def test_rule_pieces():
    assert compose(("neg", 0.0), ("plain", 1.0)) == -0.8
    assert compose(("plain", 0.5), ("int", 0.0)) == 1.0
    assert compose(("plain", 0.5), ("plain", 0.75)) == 1.0
    assert [label_of(v) for v in (-1, -0.5, 0, 0.5, 1)] == [0, 1, 2, 3, 4]


def test_label_distribution_and_lengths():
    trees = synthetic_treebank(1000, seed=7)
    roots = np.bincount([t.labels[t.root] for t in trees], minlength=5) / len(trees)
    assert roots.max() < 0.4 and (roots > 0.05).all()   # the majority class is far from a sure bet
    lengths = np.array([len(t.leaves()) for t in trees])
    assert 15 < lengths.mean() < 23 and lengths.min() >= 1 and lengths.max() <= 50


def test_written_treebank_reads_back(tmp_path):
    trees = synthetic_treebank(20, seed=1)
    write_sst(trees, tmp_path / "syn.txt")
    back = read_sst(tmp_path / "syn.txt")
    assert [t.to_bracket() for t in back] == [t.to_bracket() for t in trees]
    assert all(a.sentence() == b.sentence() and sorted(a.labels) == sorted(b.labels) for a, b in zip(trees, back))


def test_complete_binary_tree():
    t = complete_binary_tree(8)
    assert t.num_vertices == 15 and t.children[-1] == [12, 13] and t.leaves() == list(range(8))
    g = t.to_graph()
    assert g.num_vertices == 15 and g.roots().tolist() == [14]
