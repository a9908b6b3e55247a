"""Labelled trees as samples: children before parents, the root last, a label on every vertex."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Tree:
    children: list          # children[v]: child ids of vertex v, left to right
    labels: np.ndarray      # (n,) int label of every vertex, -1 if unlabelled
    words: list             # token at a leaf, None at an internal vertex

    @property
    def num_vertices(self) -> int:
        return len(self.children)

    @property
    def root(self) -> int:
        return len(self.children) - 1

    def leaves(self) -> list[int]:
        """Leaf ids in sentence order (left to right)."""
        out, stack = [], [self.root]
        while stack:
            v = stack.pop()
            if self.children[v]:
                stack.extend(reversed(self.children[v]))
            else:
                out.append(v)
        return out

    def sentence(self) -> list[str]:
        return [self.words[v] for v in self.leaves()]

    def to_graph(self):
        from ..runtime.inputs import InputGraph
        return InputGraph(self.children)

    def to_bracket(self) -> str:
        """The SST bracket format, e.g. ``(3 (2 it) (4 works))``. Built with an explicit stack rather than
        recursion: a tree is user data, and a deep one (a 100,000-level chain) must render too."""
        parts: list = []
        stack: list = [self.root]     # a vertex id to open, or a str to write as it is (a closing bracket)
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                parts.append(item)
                continue
            kids = self.children[item]
            if not kids:
                parts.append(f"({self.labels[item]} {self.words[item]})")
                continue
            parts.append(f"({self.labels[item]}")
            stack.append(")")
            for c in reversed(kids):
                stack.append(c)
                stack.append(" ")
        return "".join(parts)

def complete_binary_tree(leaves: int) -> Tree:
    """Leaves 0..L-1 left to right, then parents level by level; the root last."""
    if leaves < 1 or leaves & (leaves - 1):
        raise ValueError(f"complete binary tree needs a power-of-two number of leaves, got {leaves}")
    children: list = [[] for _ in range(leaves)]
    level = list(range(leaves))
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level), 2):
            children.append([level[i], level[i + 1]])
            nxt.append(len(children) - 1)
        level = nxt
    return Tree(children, np.full(len(children), -1, np.int64), [None] * len(children))


def two_type_kinds(tree: Tree, seed: int, index: int, types: tuple = ("cell_a", "cell_b")) -> tuple:
    """ED-Batch's TreeLSTM-2Type: each internal vertex one of two cell types, 50% each; leaves 'leaf'.
    The draw depends on (seed, index) only, so a tree keeps its types across epochs and batches."""
    draw = np.random.default_rng([seed, 2, index]).integers(0, len(types), size=tree.num_vertices)
    return tuple("leaf" if not ch else types[int(k)] for ch, k in zip(tree.children, draw))
