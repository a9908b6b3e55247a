"""Language-model text: one sentence per line, tokens separated by spaces (PTB style), and its vocabulary."""
from __future__ import annotations

import math
import os
from collections import Counter
from typing import Callable, Iterable, Sequence

import numpy as np

from ..core.errors import DataError

UNK, EOS = "<unk>", "<eos>"


def read_lines(path: str | os.PathLike):
    """(line number, text) of every line of a UTF-8 file; undecodable bytes are a DataError naming the file
    and the line."""
    if os.path.isdir(path):
        raise DataError(f"{path} is a directory, not a data file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    with open(path, "rb") as f:
        yield from decode_lines(f, str(path))


def decode_lines(lines: Iterable[bytes | str], name: str, on_bad: Callable[[DataError], None] | None = None):
    """(line number, text) of each line, decoded as strict UTF-8 (files and standard input alike): a line that
    is not UTF-8 is a DataError naming ``name:line``, or with ``on_bad`` is passed to it and left out. Lines
    given as text (a stream already decoded, e.g. with surrogate escapes) must encode back to UTF-8."""
    for lineno, raw in enumerate(lines, 1):
        try:
            yield lineno, raw.decode("utf-8") if isinstance(raw, bytes) else _valid_text(raw)
        except UnicodeError as e:
            bad = DataError(f"{name}:{lineno}: not UTF-8 ({e.reason} at "
                            f"{'byte' if isinstance(raw, bytes) else 'character'} {e.start + 1} of the line)")
            if on_bad is None:
                raise bad from None
            on_bad(bad)


def _valid_text(text: str) -> str:
    text.encode("utf-8")    # a lone surrogate (an undecodable byte, escaped) cannot be encoded
    return text


def is_blank(line: str) -> bool:
    """Blank lines (nothing but white space) are skipped by every reader: data sets and predict input."""
    return not line.strip()


def read_sentences(path: str | os.PathLike) -> list[list[str]]:
    """Non-blank lines as token lists."""
    return [line.split() for _, line in read_lines(path) if not is_blank(line)]


class Vocab:
    """Word <-> id; ids ordered by frequency in the training text, then alphabetically; <unk>, <eos> first."""

    def __init__(self, words: Sequence[str]):
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}
        if self.words[:2] != [UNK, EOS] or len(self.index) != len(self.words):
            raise ValueError("a vocabulary starts with <unk>, <eos> and has no repeated word")

    @classmethod
    def build(cls, sentences, max_size: int | None = None, min_count: int = 1) -> "Vocab":
        counts = Counter(w for s in sentences for w in s if w not in (UNK, EOS))
        ranked = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        return cls([UNK, EOS] + ranked[:None if max_size is None else max_size - 2])

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, tokens: Sequence[str]) -> np.ndarray:
        unk = self.index[UNK]
        return np.fromiter((self.index.get(w, unk) for w in tokens), np.int64, len(tokens))

    def save(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(self.words) + "\n")

    @classmethod
    def load(cls, path) -> "Vocab":
        with open(path, encoding="utf-8") as f:
            return cls([w for w in f.read().split("\n") if w])


def unigram_perplexity(train_targets: Sequence[np.ndarray], eval_targets: Sequence[np.ndarray],
                       vocab_size: int) -> float:
    """Perplexity on ``eval_targets`` of an add-one unigram model fitted on ``train_targets`` (id arrays of
    the predicted words, each sentence's <eos> included): the baseline a language model must beat."""
    counts = np.bincount(np.concatenate(list(train_targets)), minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return math.exp(-float(logp[np.concatenate(list(eval_targets))].mean()))


def windows(sentences_ids: Sequence[np.ndarray], length: int = 64, eos: int = 1) -> list[np.ndarray]:
    """The corpus joined with <eos> after each sentence, cut into windows of ``length + 1`` ids (inputs are
    the first ``length``, targets the last ``length``); the ragged tail is dropped."""
    stream = np.concatenate([np.append(s, eos) for s in sentences_ids])
    n = (len(stream) - 1) // length
    return [stream[i * length:(i + 1) * length + 1] for i in range(n)]


def synthetic_corpus(n: int, seed: int = 0, vocab_size: int = 200, split: int = 0) -> list[list[str]]:
    """Sentences from a random sparse Markov chain over made-up words: an LSTM beats unigram clearly."""
    rng = np.random.default_rng([seed, 0])
    succ = rng.integers(0, vocab_size, size=(vocab_size, 4))       # each word has 4 likely successors
    rng = np.random.default_rng([seed, 1 + split])
    out = []
    for length in np.clip(rng.gamma(3.0, 6.0, size=n).round(), 2, 40).astype(int):
        w = int(rng.integers(0, vocab_size))
        sent = [w]
        for _ in range(length - 1):
            w = int(succ[w, rng.integers(0, 4)]) if rng.random() < 0.9 else int(rng.integers(0, vocab_size))
            sent.append(w)
        out.append([f"t{x}" for x in sent])
    return out
