"""A synthetic sentiment treebank: the quick start's data, generated so no download is needed.

Random binary trees over a made-up vocabulary; every vertex gets a label 0-4 from a hidden compositional
rule, so a tree model can learn it and accuracy is measurable:

- each ordinary word has a hidden polarity in {-1, -0.5, 0, 0.5, 1} (most words are neutral);
- a phrase's value is the clipped sum of its children's values, except that a negator word ("not_*")
  flips its sibling phrase (value -0.8 * sibling) and an intensifier ("very_*") doubles it;
- label = the bucket of the value: < -0.6 -> 0, < -0.2 -> 1, <= 0.2 -> 2, <= 0.6 -> 3, else 4.

Lengths follow an SST-like distribution (mean about 19 tokens, 1 to max_len).
"""
from __future__ import annotations

import numpy as np

from .trees import Tree

POLARITIES = np.array([-1.0, -0.5, 0.0, 0.5, 1.0])


class Lexicon:
    def __init__(self, vocab_size: int, seed: int):
        rng = np.random.default_rng([seed, 0])
        n_neg, n_int = max(1, vocab_size // 50), max(1, vocab_size // 50)
        n_plain = vocab_size - n_neg - n_int
        self.words = ([f"w{i}" for i in range(n_plain)] + [f"not_{i}" for i in range(n_neg)]
                      + [f"very_{i}" for i in range(n_int)])
        pol = rng.choice(POLARITIES, size=n_plain, p=[0.1, 0.15, 0.5, 0.15, 0.1])
        self.polarity = dict(zip(self.words[:n_plain], pol.tolist()))
        self.freq = np.concatenate([1.0 / np.arange(1, n_plain + 1) ** 0.8, np.full(n_neg + n_int, 0.6)])
        self.freq /= self.freq.sum()

    def kind(self, word: str) -> str:
        return "neg" if word.startswith("not_") else "int" if word.startswith("very_") else "plain"


def label_of(v: float) -> int:
    """The 5-way bucket of a phrase value."""
    if v < -0.6:
        return 0
    if v < -0.2:
        return 1
    if v <= 0.2:
        return 2
    if v <= 0.6:
        return 3
    return 4


def compose(left: tuple, right: tuple) -> float:
    """(kind, value) of two children -> the parent's value."""
    (lk, lv), (rk, rv) = left, right
    if lk == "neg":
        return -0.8 * rv
    if rk == "neg":
        return -0.8 * lv
    if lk == "int":
        return float(np.clip(2.0 * rv, -1, 1))
    if rk == "int":
        return float(np.clip(2.0 * lv, -1, 1))
    return float(np.clip(lv + rv, -1, 1))


def random_tree(rng: np.random.Generator, lex: Lexicon, length: int) -> Tree:
    words = rng.choice(len(lex.words), size=length, p=lex.freq)
    children: list = []
    labels: list = []
    toks: list = []
    state: list = []       # (kind, value) per vertex
    nodes = []
    for w in words:
        word = lex.words[w]
        kind = lex.kind(word)
        value = lex.polarity.get(word, 0.0)
        children.append([])
        toks.append(word)
        state.append((kind, value))
        labels.append(label_of(value))
        nodes.append(len(children) - 1)
    while len(nodes) > 1:  # random binary bracketing: merge a random adjacent pair
        i = int(rng.integers(0, len(nodes) - 1))
        a, b = nodes[i], nodes[i + 1]
        value = compose(state[a], state[b])
        children.append([a, b])
        toks.append(None)
        state.append(("plain", value))
        labels.append(label_of(value))
        nodes[i:i + 2] = [len(children) - 1]
    return Tree(children, np.array(labels, np.int64), toks)


def sentence_lengths(rng: np.random.Generator, n: int, max_len: int = 50) -> np.ndarray:
    """SST-like: a gamma distribution with mean about 19, clipped to 1..max_len."""
    return np.clip(np.round(rng.gamma(3.0, 19.0 / 3.0, size=n)), 1, max_len).astype(int)


def synthetic_treebank(n: int, seed: int = 0, vocab_size: int = 1000, max_len: int = 50,
                       split: int = 0) -> list[Tree]:
    """``n`` trees; the lexicon depends on ``seed`` only, the trees on (seed, split)."""
    lex = Lexicon(vocab_size, seed)
    rng = np.random.default_rng([seed, 1 + split])
    return [random_tree(rng, lex, int(k)) for k in sentence_lengths(rng, n, max_len)]
