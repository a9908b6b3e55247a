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


READERS: dict[str, Callable[..., Any]] = {"tree": read_tree}
GRAPHS: dict[str, Callable[[Sequence], list]] = {"trees": tree_graphs}
FEEDS: dict[str, Callable[..., np.ndarray]] = {"leaf_word_ids": leaf_word_ids}
RENDERERS: dict[str, Callable[..., list]] = {"tree_labels": tree_labels}
TABLES = {"reader": READERS, "graphs": GRAPHS, "feed": FEEDS, "render": RENDERERS}
