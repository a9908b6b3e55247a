"""Character lattices from a lexicon (Lattice LSTM, Zhang & Yang 2018; ED-Batch's LatticeLSTM workload).

A sentence is a character sequence; every substring of two or more characters that is a lexicon word adds a
word cell. As an input graph, three vertex kinds (Zhang & Yang's character cell takes a different form where
lexicon words end, so it is two kinds):

- ``char``: a character where no word ends; gathers char e-1 (absent for e = 0);
- ``char_words``: a character where words end; gathers char e-1, then the word cells ending at e (shortest
  word first);
- ``word``: the word cell of characters b..e (b < e); gathers char b, the character where it starts.

Vertex ids are topological: for each position e, the word cells ending at e, then char e.

Generated data (no third-party text): a seeded lexicon of random character strings over a small alphabet;
a sentence concatenates lexicon words (70%) and single characters; each character's label is 1 where a
generated word starts and 0 elsewhere (a segmentation task a lattice model can learn, since the lattice
shows the lexicon matches and the labels need context to choose among overlapping ones).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.inputs import InputGraph


@dataclass
class Lattice:
    chars: np.ndarray        # (n,) character ids
    words: list              # (start, end, word id) per word cell, end inclusive, start < end
    labels: np.ndarray       # (n,) per character: 1 where a generated word starts

    @property
    def num_chars(self) -> int:
        return len(self.chars)

    def vertex_ids(self) -> tuple[np.ndarray, list]:
        """Vertex id of every char and of every word cell (in ``words`` order)."""
        ending = [[] for _ in range(self.num_chars)]
        for w, (b, e, _) in enumerate(self.words):
            ending[e].append(w)
        char_id, word_id, v = np.zeros(self.num_chars, np.int64), [0] * len(self.words), 0
        for e in range(self.num_chars):
            for w in sorted(ending[e], key=lambda w: (e - self.words[w][0], w)):
                word_id[w] = v
                v += 1
            char_id[e] = v
            v += 1
        return char_id, word_id

    def to_graph(self) -> InputGraph:
        char_id, word_id = self.vertex_ids()
        n = self.num_chars + len(self.words)
        children: list = [None] * n
        kinds: list = [None] * n
        ending = [[] for _ in range(self.num_chars)]
        for w, (b, e, _) in enumerate(self.words):
            children[word_id[w]] = [int(char_id[b])]
            kinds[word_id[w]] = "word"
            ending[e].append(word_id[w])
        for e in range(self.num_chars):
            children[char_id[e]] = ([int(char_id[e - 1])] if e else []) + sorted(ending[e])
            kinds[char_id[e]] = "char_words" if ending[e] else "char"
        return InputGraph(children, kinds)

    def word_mask(self, slots: int) -> np.ndarray:
        """One row per character where words end (in order): 1 for each of its word slots that holds a word
        (the first ``len(words ending there)``), 0 after; ``slots`` is a char cell's number of word slots."""
        ending = np.bincount([e for _, e, _ in self.words], minlength=self.num_chars)
        ending = ending[ending > 0]
        if len(ending) and ending.max() > slots:
            raise ValueError(f"a character ends {ending.max()} lexicon words, more than the {slots} word slots")
        return (np.arange(slots)[None, :] < ending[:, None]).astype(np.float64)


class LatticeLexicon:
    """``size`` distinct words of 2..max_len characters over ``alphabet`` characters (ids 0..alphabet-1)."""

    def __init__(self, size: int, alphabet: int, seed: int, max_len: int = 4):
        if alphabet < 2 or size < 1 or max_len < 2:
            raise ValueError("a lattice lexicon needs alphabet >= 2, size >= 1 and max_len >= 2")
        rng = np.random.default_rng([seed, 0])
        words: dict = {}
        while len(words) < size:
            length = int(rng.integers(2, max_len + 1))
            words.setdefault(tuple(rng.integers(0, alphabet, size=length).tolist()), len(words))
        self.words = list(words)
        self.index = words
        self.alphabet = alphabet
        self.max_len = max_len

    def matches(self, chars) -> list:
        """(start, end, word id) of every lexicon word in ``chars``, by end then start."""
        chars = list(chars)
        out = []
        for e in range(len(chars)):
            for length in range(2, min(self.max_len, e + 1) + 1):
                w = self.index.get(tuple(chars[e - length + 1:e + 1]))
                if w is not None:
                    out.append((e - length + 1, e, w))
        return out


def random_lattice(rng: np.random.Generator, lex: LatticeLexicon, length: int) -> Lattice:
    chars, starts = [], []
    while len(chars) < length:
        piece = lex.words[int(rng.integers(len(lex.words)))] if rng.random() < 0.7 else \
            (int(rng.integers(lex.alphabet)),)
        starts.append(len(chars))
        chars.extend(piece)
    chars = chars[:length]
    labels = np.zeros(length, np.int64)
    labels[[s for s in starts if s < length]] = 1
    return Lattice(np.asarray(chars, np.int64), lex.matches(chars), labels)


def synthetic_lattices(n: int, seed: int = 0, lexicon: int = 400, alphabet: int = 60, min_len: int = 8,
                       max_len: int = 48, split: int = 0) -> tuple[list[Lattice], LatticeLexicon]:
    """``n`` lattices; the lexicon depends on ``seed`` only, the sentences on (seed, split)."""
    lex = LatticeLexicon(lexicon, alphabet, seed)
    rng = np.random.default_rng([seed, 1 + split])
    lengths = rng.integers(min_len, max_len + 1, size=n)
    return [random_lattice(rng, lex, int(k)) for k in lengths], lex
