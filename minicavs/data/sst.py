"""The Stanford Sentiment Treebank bracket format: ``(label child child)`` or ``(label word)`` per node.

Parsing is iterative (an explicit stack), so deep trees are fine; a malformed line raises DataError naming
the file and the line number.
"""
from __future__ import annotations

import os
import re

import numpy as np

from ..core.errors import DataError
from .text import is_blank, read_lines
from .trees import Tree

_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def parse_tree(line: str, where: str = "<string>", num_labels: int = 5, binary: bool = False) -> Tree:
    tokens = _TOKEN.findall(line)
    children: list = []
    labels: list = []
    words: list = []
    stack: list = []     # open nodes: [label, child ids, word]
    i = 0
    root = None
    while i < len(tokens):
        tok = tokens[i]
        if tok == "(":
            if root is not None:
                raise DataError(f"{where}: text after the end of the tree")
            if i + 1 >= len(tokens) or tokens[i + 1] in "()":
                raise DataError(f"{where}: a node without a label")
            label = tokens[i + 1]
            if not re.fullmatch(r"-?\d+", label):
                raise DataError(f"{where}: label {label!r} is not an integer")
            if not 0 <= int(label) < num_labels:
                raise DataError(f"{where}: label {label} out of range 0..{num_labels - 1}")
            stack.append([int(label), [], None])
            i += 2
        elif tok == ")":
            if not stack:
                raise DataError(f"{where}: unbalanced ')'")
            label, kids, word = stack.pop()
            if not kids and word is None:
                raise DataError(f"{where}: node with label {label} has neither children nor a word")
            if binary and len(kids) not in (0, 2):
                raise DataError(f"{where}: node with {len(kids)} children in a binary treebank")
            children.append(kids)
            labels.append(label)
            words.append(word)
            v = len(children) - 1
            if stack:
                stack[-1][1].append(v)
            else:
                root = v
            i += 1
        else:
            if not stack:
                raise DataError(f"{where}: word {tok!r} outside any node")
            node = stack[-1]
            if node[1]:
                raise DataError(f"{where}: word {tok!r} beside other children")
            node[2] = tok if node[2] is None else f"{node[2]} {tok}"  # SST has leaves like (2 8 1\/2)
            i += 1
    if stack:
        raise DataError(f"{where}: unbalanced '(' (missing {len(stack)} closing parentheses)")
    if root is None:
        raise DataError(f"{where}: no tree")
    return Tree(children, np.array(labels, np.int64), words)


def read_sst(path: str | os.PathLike, binary: bool = True, num_labels: int = 5) -> list[Tree]:
    """One tree per non-blank line."""
    return [parse_tree(line, f"{path}:{lineno}", num_labels, binary)
            for lineno, line in read_lines(path) if not is_blank(line)]


def write_sst(trees, path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in trees:
            f.write(t.to_bracket() + "\n")


def parse_any_tree(line: str, where: str = "<string>", num_labels: int = 5, max_children: int = 2) -> Tree:
    """A tree to predict on: SST-labelled (every node starts with an integer label, as ``parse_tree``
    reads) or unlabelled brackets, where every token is a word, ``(a b)`` a node whose children are the
    leaves a and b, and a node with one child is that child: ``((the movie) (was great))``, ``(great)``,
    ``great``. Unlabelled vertices get label -1."""
    tokens = _TOKEN.findall(line)
    opens = [i for i, t in enumerate(tokens) if t == "("]
    if opens and all(i + 1 < len(tokens) and re.fullmatch(r"-?\d+", tokens[i + 1]) for i in opens):
        tree = parse_tree(line, where, num_labels)
        wide = [v for v, ch in enumerate(tree.children) if len(ch) > max_children]
        if wide:
            raise DataError(f"{where}: a node with {len(tree.children[wide[0]])} children; this model's "
                            f"trees have at most {max_children}")
        return tree
    children: list = []
    words: list = []
    stack: list = [[]]   # per open node: its items (vertex ids)
    for tok in tokens:
        if tok == "(":
            stack.append([])
        elif tok == ")":
            if len(stack) == 1:
                raise DataError(f"{where}: unbalanced ')'")
            items = stack.pop()
            if not items:
                raise DataError(f"{where}: an empty node '()'")
            if len(items) == 1:          # (x) is x
                stack[-1].append(items[0])
                continue
            if len(items) > max_children:
                raise DataError(f"{where}: a node with {len(items)} children; this model's trees have at most "
                                f"{max_children} (bracket them: ((a b) c))")
            children.append(items)
            words.append(None)
            stack[-1].append(len(children) - 1)
        else:
            children.append([])
            words.append(tok)
            stack[-1].append(len(children) - 1)
    if len(stack) > 1:
        raise DataError(f"{where}: unbalanced '(' (missing {len(stack) - 1} closing parentheses)")
    top = stack[0]
    if not top:
        raise DataError(f"{where}: no tree")
    if len(top) > 1:
        raise DataError(f"{where}: {len(top)} trees or words side by side; put one tree per line "
                        "(bracket the words: (a b))")
    return Tree(children, np.full(len(children), -1, np.int64), words)
