"""``bench --ed-batch`` (minicavs/bench/ed_batch.py): the harness itself, without DyNet (the peers' loss checks
are tests/bench/test_peers.py's, with MINICAVS_DYNET_PYTHON)."""
from __future__ import annotations

import argparse
from collections import Counter

import pytest

from minicavs.bench import add_arguments, ed_batch, run
from minicavs.train import cli


def test_alternation_puts_every_system_twice_in_every_position_after_different_systems():
    for systems in (("per core", "machine", "dynet"), ("a", "b"), ("a", "b", "c", "d")):
        n = len(systems)
        orders = ed_batch.alternation(systems, 2 * n)
        assert all(sorted(o) == sorted(systems) for o in orders)
        for position in range(n):
            assert Counter(o[position] for o in orders) == {s: 2 for s in systems}, (systems, orders)
        for s in systems:   # what runs right before s (None: s runs first) is not always the same
            assert len({o[o.index(s) - 1] if o.index(s) else None for o in orders}) > 1, (s, orders)
    assert ed_batch.alternation(("a", "b", "c"), 3)[0] == ["a", "b", "c"] and len(ed_batch.alternation("ab", 5)) == 5


def _result(per_core: dict, machine: dict, dynet: dict, unit: str = "trees") -> dict:
    return {"unit": unit, "rates": {"per core": per_core, "machine": machine, "dynet": dynet}}


def test_table_gives_medians_the_best_policy_over_dynet_and_the_paper_beside_inference():
    policies = ("cavs", "fsm:S3")
    per_core = {"cavs": {"train": [10, 30, 20], "infer": [100, 100, 100]},
                "fsm:S3": {"train": [40, 40, 1], "infer": [50, 50, 50]}}
    machine = {"cavs": {"train": [5, 5, 5], "infer": [7, 7, 7]}, "fsm:S3": {"train": [9, 9, 9], "infer": [8, 8, 8]}}
    dynet = {"train": [8, 10, 12], "infer": [25, 20, 30]}
    text = ed_batch.table({"tree_gru": _result(per_core, machine, dynet)}, policies, 3, (3.5, 4.25))
    rows = {tuple(c.strip() for c in line.split("|")[1:5]): [c.strip() for c in line.split("|")[5:-1]]
            for line in text.splitlines() if line.startswith("| tree_gru")}
    per_core_infer = ["100", "50", "25", "2.00-4.00x (best cavs)", "1.46x"]
    assert rows[("tree_gru", "trees", "inference", "per core")] == per_core_infer
    assert rows[("tree_gru", "trees", "training", "per core")] == ["20", "40", "10", "2.00-4.00x (best fsm:S3)", ""]
    assert rows[("tree_gru", "trees", "inference", "machine")] == ["7", "8", "25", "0.28-0.32x (best fsm:S3)", "1.46x"]
    assert rows[("tree_gru", "trees", "training", "machine")][-2] == "0.50-0.90x (best fsm:S3)"
    assert "DyNet *with Cavs's optimizations*" in text and "DyNet's own autobatching" in text
    assert "3.5 at the start, 4.2 at the end" in text and "medians of 3 rounds" in text


def test_a_child_times_every_policy_in_the_order_asked():
    spec = {"model": "lattice_lstm", "hidden": 4, "samples": 3, "policies": ["cavs", "agenda"],
            "overrides": ["model.embed=3", "data.synthetic.train=6", "data.synthetic.max_len=8"]}
    child = ed_batch.Child(spec, one_thread=True)
    try:
        assert child.blas_threads == 1
        for order in (["cavs", "agenda"], ["agenda", "cavs"]):
            got = child.round(order)
            assert list(got) == order and all(r[m] > 0 for r in got.values() for m in ("train", "infer"))
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_without_dynet_or_with_an_unknown_model_the_cli_says_so_in_one_line(tmp_path, capsys):
    status = cli.main(["bench", "--ed-batch", "--dynet-python", str(tmp_path / "none"), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "--ed-batch compares with DyNet" in err and "not found" in err and "setup_peers.sh" in err
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--ed-batch-models: unknown"):
        run(parser.parse_args(["--ed-batch", "--ed-batch-models", "tree_fc"]))
    assert not list(tmp_path.iterdir())   # nothing written
