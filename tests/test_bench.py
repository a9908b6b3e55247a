"""`minicavs bench`'s FLOP counts (independent arithmetic), its command line and what it tells the peers.

The peers themselves need torch: set MINICAVS_TORCH_PYTHON to run them on tiny configs (never in CI)."""
from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import pytest

from minicavs.bench import add_arguments
from minicavs.bench.peers import peer_settings, torch_lstm_lm, torch_tree_fc
from minicavs.bench.workloads import WORKLOADS, lstm_lm_flops, tree_fc, tree_fc_flops, tree_lstm_flops, var_lstm
from minicavs.engine import EngineOptions


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


def test_tree_fc_flops_level_by_level():
    # complete tree of 8 leaves, hidden 3: levels of 8, 4, 2, 1 vertices; (n x K) @ (K x N) costs 2nKN
    trees, H = 2, 3
    levels = [8, 4, 2, 1]
    per_tree = 2 * levels[0] * H * H + sum(2 * n * (2 * H) * H for n in levels[1:]) + 2 * 1 * H * 1
    assert tree_fc_flops(trees, 8, H) == trees * per_tree


def test_lstm_lm_flops_step_by_step():
    D, H, V = 5, 4, 11
    lengths = [1, 4, 2]
    total = 0
    for n in lengths:
        for step in range(n):
            total += 2 * D * 4 * H                 # x·W_x
            total += 2 * H * 4 * H if step else 0   # h·W_h, h = 0 at the first step
            total += 2 * H * V                     # h·W_o
    assert lstm_lm_flops(lengths, D, H, V) == total


def test_peer_settings_name_this_trainers_optimizer():
    t = tree_fc(4, 4, 2, 4, EngineOptions())
    s = peer_settings(t)
    assert s["batch"] == 2 and s["threads"] == (os.cpu_count() or 1)
    o = s["optimizer"]
    assert o["name"] == "adam" and o["lr"] == 1e-3 and (o["beta1"], o["beta2"], o["eps"]) == (0.9, 0.999, 1e-8)
    assert o["weight_decay"] == 0.0 and o["clip_norm"] is None
    json.dumps(s)   # handed to the peer as JSON


def test_command_line_workloads_and_caps():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--workloads", "tree_fc", "var_lstm", "--epochs", "1", "--fc-trees", "64",
                         "--sentences", "100", "--torch-python", "/p/bin/python"])
    assert args.workloads == ["tree_fc", "var_lstm"] and args.epochs == 1
    assert (args.fc_trees, args.sentences, args.torch_python, args.dynet_python) == (64, 100, "/p/bin/python", None)
    with pytest.raises(SystemExit):
        p.parse_args(["--workloads", "fixed_lstm"])


TORCH_PYTHON = os.environ.get("MINICAVS_TORCH_PYTHON")


@pytest.mark.skipif(not TORCH_PYTHON, reason="set MINICAVS_TORCH_PYTHON to a python with torch (setup_peers.sh)")
def test_torch_peers_compute_minicavs_loss(tmp_path):
    t = tree_fc(8, 8, 4, 8, EngineOptions())
    ref = torch_tree_fc(TORCH_PYTHON, t, 3, epochs=1)
    ours = t.loss_and_grads(t.task.data["train"][:3], training=False).loss
    assert abs(ref["check_loss"] - ours) <= 1e-5 * max(1.0, abs(ours)) and len(ref["rates"]) == 1
    text = tmp_path / "lm.txt"
    text.write_text("the cat sat\na dog ran far away\nthe dog sat\n\ncat ran\n")
    t = var_lstm(str(text), 3, 6, 5, 2, EngineOptions())
    ref = torch_lstm_lm(TORCH_PYTHON, t, 3, epochs=1)
    ours = t.loss_and_grads(t.task.data["train"][:3], training=False).loss
    assert abs(ref["check_loss"] - ours) <= 1e-5 * max(1.0, abs(ours)) and ref["threads"] == os.cpu_count()
