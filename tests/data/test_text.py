"""LM text: reader, vocabulary, unigram perplexity and fixed windows."""
from __future__ import annotations

import math

import numpy as np
import pytest

from minicavs.data.text import EOS, UNK, Vocab, read_sentences, synthetic_corpus, unigram_perplexity, windows
from minicavs.core.errors import DataError


def test_reader_and_vocab(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("the cat sat\n\n the dog sat \n")
    sents = read_sentences(p)
    assert sents == [["the", "cat", "sat"], ["the", "dog", "sat"]]
    v = Vocab.build(sents)
    assert v.words == [UNK, EOS, "sat", "the", "cat", "dog"]
    assert v.encode(["the", "bird"]).tolist() == [3, 0]
    v.save(tmp_path / "v.txt")
    assert Vocab.load(tmp_path / "v.txt").words == v.words
    assert Vocab.build(sents, max_size=4).words == [UNK, EOS, "sat", "the"]


def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_sentences(tmp_path / "none.txt")
    p = tmp_path / "bad.txt"
    p.write_bytes(b"fine line\nbad \xff byte\n")
    with pytest.raises(DataError, match=r"bad.txt:2: not UTF-8"):
        read_sentences(p)


def test_unigram_perplexity_by_hand():
    train = [np.array([2, 2, 3, 1])]   # one sentence and its <eos> (id 1)
    # counts with add-one over V=4: <unk> 1, <eos> 1+1, id2 1+2, id3 1+1 -> total 8
    ppl = unigram_perplexity(train, [np.array([2, 1])], vocab_size=4)
    assert math.isclose(ppl, math.exp(-(math.log(3 / 8) + math.log(2 / 8)) / 2))


def test_windows():
    w = windows([np.array([5, 6]), np.array([7])], length=2)
    assert [x.tolist() for x in w] == [[5, 6, 1], [1, 7, 1]]   # inputs w[:-1], targets w[1:]


def test_synthetic_corpus_is_deterministic_and_predictable():
    a, b = synthetic_corpus(50, seed=1), synthetic_corpus(50, seed=1)
    assert a == b and synthetic_corpus(50, seed=1, split=1) != a
    v = Vocab.build(a)
    ids = [np.append(v.encode(s), v.index[EOS]) for s in a]
    assert unigram_perplexity(ids, ids, len(v)) > 50   # many words are used, roughly uniformly


@pytest.mark.parametrize("blank", ["", "   ", "\t", "\r", " \t \r"])
@pytest.mark.parametrize("reader, text, samples", [
    ("sst", "(1 (0 bad) (2 film))\n{b}\n(4 great)\n{b}", [3, 1]),
    ("sentences", "the cat sat\n{b}\n the dog \n{b}", [3, 2]),
])
def test_blank_lines_are_skipped_by_every_data_reader(tmp_path, reader, text, samples, blank):
    """One rule in every reader (minicavs predict's input too): blank lines are skipped."""
    from minicavs.data.sst import read_sst
    (tmp_path / "d.txt").write_bytes(text.format(b=blank).encode())
    read = {"sst": lambda p: [t.num_vertices for t in read_sst(p)],
            "sentences": lambda p: [len(s) for s in read_sentences(p)]}[reader]
    assert read(tmp_path / "d.txt") == samples
