"""What a model does around its graph, by name: so that an exported model can state it as data.

An artifact (:mod:`minicavs.train.artifact`) names one entry of each table with its settings, and the model
that wrote it uses the same functions, so the two cannot drift apart:

- ``READERS``: parse one input line into a sample (``reader(line, where, **settings)``);
- ``GRAPHS``: the input graphs of a chunk of samples;
- ``FEEDS``: one feed array of a chunk (``feed(samples, vocabulary index, **settings)``);
- ``RENDERERS``: per sample its output row (``text`` and the numbers behind it) from the model's outputs.

A model whose reading, feeding or rendering is none of these exists only as Python code, and exporting it is
refused (``Task.export_spec``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..core.errors import DataError
from ..data.sst import parse_any_tree
from ..data.trees import Tree
from ..runtime.inputs import InputGraph


def read_tree(line: str, where: str, num_labels: int, max_children: int) -> Tree:
    return parse_any_tree(line, where, num_labels=num_labels, max_children=max_children)


def tree_graphs(trees: Sequence[Tree]) -> list:
    return InputGraph.many([t.children for t in trees])


def leaf_word_ids(trees: Sequence[Tree], index: dict, unknown: str) -> np.ndarray:
    """The vocabulary id of every leaf's word, tree by tree; a word not in it reads as ``unknown``."""
    unk = index[unknown]
    return np.array([index.get(t.words[v], unk) for t in trees for v, ch in enumerate(t.children) if not ch],
                    np.int64)


def tree_labels(trees: Sequence[Tree], outputs: dict, vocabulary: list, output: str) -> list[dict]:
    """Each tree with its argmax label at every node, its root's label and probabilities (and the gold
    root label when the input had one)."""
    probs = np.split(outputs[output], np.cumsum([t.num_vertices for t in trees])[:-1])
    rows = []
    for tree, p in zip(trees, probs):
        labelled = Tree(tree.children, p.argmax(1), tree.words)
        row = {"text": labelled.to_bracket(), "label": int(p[-1].argmax()),
               "probs": [round(float(q), 6) for q in p[-1]]}
        if tree.labels[tree.root] >= 0:
            row["gold"] = int(tree.labels[tree.root])
        rows.append(row)
    return rows


# --- digit sequences (the bundled seq2seq model: a foreach encoder, a while_loop greedy decoder) ----------

def read_digits(line: str, where: str, max_len: int) -> np.ndarray:
    """Digits separated by spaces or not, 1 to ``max_len`` of them."""
    digits = [ch for ch in line if not ch.isspace()]
    if not digits or not all(ch in "0123456789" for ch in digits):
        raise DataError(f"{where}: expected digits, got {line.strip()!r}")
    if len(digits) > max_len:
        raise DataError(f"{where}: {len(digits)} digits; this model reads at most {max_len} (model.max_len)")
    return np.array([int(ch) for ch in digits], np.int64)


def no_graphs(samples: Sequence) -> dict:
    """A model of static graphs only (its loops are control-flow ops): no input graphs."""
    return {}


def padded_source(samples: Sequence[np.ndarray], index: dict, max_len: int) -> np.ndarray:
    src = np.zeros((len(samples), max_len), np.int64)
    for r, s in enumerate(samples):
        src[r, :len(s)] = s
    return src


def source_mask(samples: Sequence[np.ndarray], index: dict, max_len: int, dtype: str) -> np.ndarray:
    return (np.arange(max_len) < np.array([len(s) for s in samples])[:, None]).astype(dtype)


def reversed_decoder_input(samples: Sequence[np.ndarray], index: dict, max_len: int, go: int,
                           eos: int) -> np.ndarray:
    """<go>, then the source reversed, then <eos> (teacher forcing's input; greedy decoding reads <go>)."""
    out = np.full((len(samples), max_len + 1), eos, np.int64)
    for r, s in enumerate(samples):
        out[r, 0] = go
        out[r, 1:len(s) + 1] = s[::-1]
    return out


def zero_state(samples: Sequence, index: dict, width: int, dtype: str) -> np.ndarray:
    return np.zeros((len(samples), width), dtype)


def tokens_until(samples: Sequence, outputs: dict, vocabulary, output: str, eos: int) -> list[dict]:
    """Per sample its decoded tokens (argmax of the one-hot rows) up to the first ``eos``; steps that never
    ran are zeros, whose argmax 0 comes after <eos>."""
    rows = []
    for row in np.argmax(np.asarray(outputs[output]), axis=-1):
        stop = np.flatnonzero(row == eos)
        digits = [int(d) for d in (row[:stop[0]] if stop.size else row)]
        rows.append({"text": "".join(map(str, digits)), "digits": digits})
    return rows


READERS: dict[str, Callable[..., Any]] = {"tree": read_tree, "digits": read_digits}
GRAPHS: dict[str, Callable[[Sequence], Any]] = {"trees": tree_graphs, "none": no_graphs}
FEEDS: dict[str, Callable[..., np.ndarray]] = {
    "leaf_word_ids": leaf_word_ids, "padded_source": padded_source, "source_mask": source_mask,
    "reversed_decoder_input": reversed_decoder_input, "zero_state": zero_state}
RENDERERS: dict[str, Callable[..., list]] = {"tree_labels": tree_labels, "tokens_until": tokens_until}
TABLES = {"reader": READERS, "graphs": GRAPHS, "feed": FEEDS, "render": RENDERERS}
