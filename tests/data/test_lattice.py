"""Generated lattices and TreeLSTM-2Type kinds: structure, determinism, and the lexicon matches."""
from __future__ import annotations

import numpy as np

from minicavs.data.lattice import LatticeLexicon, synthetic_lattices
from minicavs.data.synthetic import synthetic_treebank
from minicavs.data.trees import two_type_kinds
from minicavs.runtime.inputs import make_batch


def test_lattice_graph_structure():
    lattices, lex = synthetic_lattices(30, seed=2)
    assert any(lat.words for lat in lattices)
    for lat in lattices:
        g = lat.to_graph()
        char_id, word_id = lat.vertex_ids()
        assert g.num_vertices == lat.num_chars + len(lat.words)
        assert sorted(char_id.tolist() + list(word_id)) == list(range(g.num_vertices))
        for w, (b, e, wid) in enumerate(lat.words):
            assert 0 <= b < e < lat.num_chars
            assert tuple(lat.chars[b:e + 1].tolist()) == lex.words[wid]      # a real lexicon match
            assert g.children(word_id[w]).tolist() == [char_id[b]] and g.kinds[word_id[w]] == "word"
        for e in range(lat.num_chars):
            ending = sorted(word_id[w] for w, (_, end, _) in enumerate(lat.words) if end == e)
            assert g.children(char_id[e]).tolist() == ([char_id[e - 1]] if e else []) + ending
            assert g.kinds[char_id[e]] == ("char_words" if ending else "char")
        mask = lat.word_mask(3)
        ends = [e for e in range(lat.num_chars) if any(end == e for _, end, _ in lat.words)]
        assert mask.shape == (len(ends), 3)
        assert mask.sum(1).tolist() == [sum(end == e for _, end, _ in lat.words) for e in ends]
        assert all(row.tolist() == sorted(row.tolist(), reverse=True) for row in mask)   # filled slots first
        # every lexicon occurrence is a word cell
        occurrences = {(b, b + len(w) - 1) for b in range(lat.num_chars) for w in lex.words
                       if tuple(lat.chars[b:b + len(w)].tolist()) == w}
        assert occurrences == {(b, e) for b, e, _ in lat.words}
        assert lat.labels[0] == 1 and set(lat.labels.tolist()) <= {0, 1}
        make_batch([g], kind_names=("char", "char_words", "word"))     # a valid DAG


def test_lattices_deterministic_and_split_dependent():
    a, _ = synthetic_lattices(10, seed=3)
    b, _ = synthetic_lattices(10, seed=3)
    c, _ = synthetic_lattices(10, seed=3, split=1)
    key = lambda ls: [(x.chars.tolist(), x.words) for x in ls]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)
    assert LatticeLexicon(50, 10, seed=1).words == LatticeLexicon(50, 10, seed=1).words


def test_two_type_kinds():
    trees = synthetic_treebank(200, seed=1)
    kinds = [two_type_kinds(t, 7, i) for i, t in enumerate(trees)]
    assert kinds == [two_type_kinds(t, 7, i) for i, t in enumerate(trees)]
    assert kinds != [two_type_kinds(t, 8, i) for i, t in enumerate(trees)]
    for t, ks in zip(trees, kinds):
        assert all((k == "leaf") == (not ch) for ch, k in zip(t.children, ks))
    internal = np.array([k == "cell_a" for ks in kinds for k in ks if k != "leaf"])
    assert abs(internal.mean() - 0.5) < 0.03    # 50% each
