"""The SST bracket reader on good and malformed input."""
from __future__ import annotations

import os

import numpy as np
import pytest

from minicavs.data.sst import parse_any_tree, parse_tree, read_sst, write_sst
from minicavs.core.errors import DataError

SST = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "sst")


def test_parse_small_tree():
    t = parse_tree("(3 (2 It) (4 (4 works) (2 .)))")
    assert t.children == [[], [], [], [1, 2], [0, 3]]
    assert t.labels.tolist() == [2, 4, 2, 4, 3]
    assert t.words == ["It", "works", ".", None, None]
    assert t.sentence() == ["It", "works", "."] and t.root == 4
    assert t.to_bracket() == "(3 (2 It) (4 (4 works) (2 .)))"


def test_multi_token_leaf_is_one_word():
    t = parse_tree(r"(2 (2 8 1\/2) (2 rocks))")
    assert t.sentence() == [r"8 1\/2", "rocks"]


def test_read_and_round_trip(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("(1 (0 bad) (2 film))\n\n(4 great)\n")
    trees = read_sst(path)
    assert [t.num_vertices for t in trees] == [3, 1]
    out = tmp_path / "back.txt"
    write_sst(trees, out)
    again = read_sst(out)
    assert [t.to_bracket() for t in again] == [t.to_bracket() for t in trees]


@pytest.mark.parametrize("line, match", [
    ("(2 (1 a) (3 b)", "unbalanced '\\('"),
    ("(2 (1 a) (3 b)))", "unbalanced '\\)'"),
    ("((1 a) (3 b))", "without a label"),
    ("(x (1 a) (3 b))", "label 'x' is not an integer"),
    ("(7 (1 a) (3 b))", "label 7 out of range"),
    ("(2 (1 a) (3 b) (2 c))", "3 children in a binary treebank"),
    ("(2)", "neither children nor a word"),
    ("(2 (1 a) oops)", "word 'oops' beside other children"),
    ("(2 a) (3 b)", "text after the end"),
])
def test_malformed_lines_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.txt"
    path.write_text("(2 (2 fine) (2 line))\n" + line + "\n")
    with pytest.raises(DataError, match=match) as err:
        read_sst(path)
    assert f"{path}:2" in str(err.value)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        read_sst("nope.txt")


@pytest.mark.skipif(not os.path.isdir(SST), reason="../shared/data/sst is not beside the checkout")
@pytest.mark.parametrize("split, count", [("train", 8544), ("dev", 1101), ("test", 2210)])
def test_real_sst_splits(split, count):
    trees = read_sst(os.path.join(SST, f"{split}.txt"))
    assert len(trees) == count
    assert all(len(c) in (0, 2) for t in trees for c in t.children)
    assert all(t.labels.min() >= 0 and t.labels.max() <= 4 for t in trees)
    assert np.mean([len(t.leaves()) for t in trees]) > 15


def test_undecodable_bytes_name_the_file_and_line(tmp_path):
    from minicavs.data.sst import read_sst
    from minicavs.core.errors import DataError
    path = tmp_path / "bad.txt"
    path.write_bytes(b"(3 (2 a) (4 b))\n\n(1 (2 caf\xe9) (4 b))\n")
    with pytest.raises(DataError, match=rf"^{path}:3: not UTF-8 \(invalid continuation byte at byte 10 of the line\)$"):
        read_sst(path)


def deep_line(depth: int, labelled: bool = True) -> str:
    """A tree of ``depth`` internal nodes, each with a leaf on the left and the rest of the tree on the right."""
    if labelled:
        return "(2 (1 a) " * depth + "(3 z)" + ")" * depth
    return "(a " * depth + "z" + ")" * depth


@pytest.mark.parametrize("depth", [1, 2, 500, 5_000, 100_000])
def test_deep_trees_parse_read_and_render(tmp_path, depth):
    """Parsing, reading a file and rendering walk the tree without recursion: any depth works."""
    line = deep_line(depth)
    tree = parse_tree(line, "x:1")
    assert tree.num_vertices == 2 * depth + 1 and tree.children[tree.root] == [tree.root - 2 * depth, tree.root - 1]
    assert tree.to_bracket() == line
    assert tree.sentence() == ["a"] * depth + ["z"]
    (tmp_path / "deep.txt").write_text(f"{line}\n\n(4 great)\n")
    assert [t.to_bracket() for t in read_sst(tmp_path / "deep.txt")] == [line, "(4 great)"]
    unlabelled = parse_any_tree(deep_line(depth, labelled=False), "x:1")
    assert unlabelled.children == tree.children and unlabelled.words == tree.words
