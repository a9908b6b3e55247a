"""`minicavs bench`'s FLOP counts (independent arithmetic) and its command line."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

from minicavs.bench import WORKLOADS, add_arguments, lstm_lm_flops, tree_fc_flops, tree_lstm_flops


def test_tree_lstm_flops_count_the_equations():
    # a leaf alone, and ((a b) c): 3 leaves, 2 internal vertices
    trees = [SimpleNamespace(children=[[]]), SimpleNamespace(children=[[], [], [0, 1], [], [2, 3]])]
    E, H, C = 4, 3, 5
    leaf = 2 * E * 3 * H                       # x·W, W is E x 3H
    internal = 2 * (2 * H) * (3 * H) + 2 * 2 * H * H   # [h1; h2]·U and the two forget gates
    cls = 2 * H * C
    assert tree_lstm_flops(trees, E, H, C) == 4 * leaf + 2 * internal + 6 * cls


def test_tree_fc_and_lm_flops():
    assert tree_fc_flops(2, 4, 3) == 2 * 2 * (4 * 9 + 3 * 18 + 3)
    # two sentences of 3 and 1 steps: 4 steps of x·W_x and softmax, h·W_h only after each first step
    D, H, V = 2, 3, 7
    assert lstm_lm_flops([3, 1], D, H, V) == 2 * (4 * (D * 4 * H + H * V) + 2 * H * 4 * H)


def test_command_line_defaults_and_choices():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    assert args.workloads == list(WORKLOADS) and args.hidden == [128, 512] and args.sentences == 2000
    args = p.parse_args(["--workloads", "tree_fc", "--torch-python", "/x/python", "--recursive-trees", "16"])
    assert args.workloads == ["tree_fc"] and args.torch_python == "/x/python" and args.recursive_trees == 16
