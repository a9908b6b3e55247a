"""`minicavs bench`: FLOP counts (independent arithmetic), the sweep definitions, the report writers from given
numbers, the time split, the command line and a tiny end-to-end run without peers (tests/bench/test_peers.py
covers the peers)."""
from __future__ import annotations

import argparse
import csv
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest

from minicavs.bench import add_arguments, settings
from minicavs.bench import report
from minicavs.bench.breakdown import instrumented_epoch
from minicavs.bench.point import prefix_size
from minicavs.bench.suite import Settings, run_suite
from minicavs.bench.sweeps import FULL, MODELS, Point, distinct_points, sweeps
from minicavs.bench.workloads import Data, lstm_lm_flops, tree_fc, tree_fc_flops, tree_lstm_flops
from minicavs.engine.compile import EngineOptions


def test_tree_lstm_flops_count_the_equations():
    # a leaf alone, and ((a b) c): 3 leaves, 2 internal vertices
    trees = [SimpleNamespace(children=[[]]), SimpleNamespace(children=[[], [], [0, 1], [], [2, 3]])]
    E, H, C = 4, 3, 5
    leaf = 2 * E * 3 * H                       # x·W, W is E x 3H
    internal = 2 * (2 * H) * (3 * H) + 2 * 2 * H * H   # [h1; h2]·U and the two forget gates
    cls = 2 * H * C
    assert tree_lstm_flops(trees, E, H, C) == 4 * leaf + 2 * internal + 6 * cls


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


# --- sweeps ----------------------------------------------------------------------------------------------

def test_full_sweeps_are_the_papers_scaled_grid():
    sw = sweeps()
    assert set(sw) == {f"{m}/{k}" for m in MODELS for k in ("batch", "hidden")} | {"tree_fc/leaves",
                                                                                     "tree_lstm/latency"}
    assert sw["tree_lstm/latency"] == [Point("tree_lstm", 128, 1)]   # the batch-1 latency target
    for m in MODELS:
        assert [(p.hidden, p.batch) for p in sw[f"{m}/batch"]] == [(512, 1), (512, 16), (512, 64), (512, 256)]
        assert [(p.hidden, p.batch) for p in sw[f"{m}/hidden"]] == [(64, 64), (128, 64), (256, 64), (512, 64),
                                                                      (1024, 64)]
    assert [(p.leaves, p.hidden, p.batch) for p in sw["tree_fc/leaves"]] == [(32, 512, 64), (256, 512, 64),
                                                                              (1024, 512, 64)]
    assert all(p.leaves == 256 for p in sw["tree_fc/batch"] + sw["tree_fc/hidden"])
    # per model 4 + 5 points sharing (512, 64); Tree-FC's leaves sweep adds 32 and 1024 leaves, Tree-LSTM's
    # latency one point
    pts = distinct_points(sw)
    assert len(pts) == 4 * (4 + 5 - 1) + 2 + 1 and len(set(p.key() for p in pts)) == len(pts)


def test_quick_sweeps_are_a_subset_and_models_are_checked():
    full = set(distinct_points(sweeps()))
    quick = distinct_points(sweeps(quick=True))
    assert set(quick) < full and len(quick) == 4
    assert set(sweeps(["var_lstm"])) == {"var_lstm/batch", "var_lstm/hidden"}
    with pytest.raises(ValueError, match="unknown model"):
        sweeps(["lstm"])
    grid = {**FULL, "batch": [2], "hidden": [8], "hidden_at": 8, "batch_at": 2, "leaves": [4], "fc_leaves": 4}
    assert distinct_points(sweeps(["tree_fc"], grid=grid)) == [Point("tree_fc", 8, 2, 4)]


def test_prefix_is_whole_batches_within_the_cap():
    assert prefix_size(1000, 64, 0.5, 2.0) == 4 * 64       # 4 batches of 0.5 s fit in 2 s
    assert prefix_size(1000, 64, 0.5, 2.2) == 4 * 64
    assert prefix_size(1000, 64, 5.0, 2.0) == 64           # at least one batch
    assert prefix_size(100, 64, 0.01, 2.0) == 100          # never more than the data


# --- reports from given numbers --------------------------------------------------------------------------

def _systems():
    return {"minicavs": {"rates": [90.0, 100.0, 130.0], "infer_rates": [300.0, 310.0], "flops_per_unit": 2e9,
                         "samples": 64, "units": 64, "peak_rss_mb": 250.0, "threads": 2,
                         "per_core": {"rates": [60.0, 64.0], "threads": 1},
                         "breakdown": {"step_s": 4.0, "scheduling_s": 0.4, "memory_s": 0.2, "update_s": 0.2,
                                       "compute_s": 3.2}},
            "DyNet (autobatching)": {"rates": [40.0, 50.0, 45.0], "infer_rates": [150.0], "peak_rss_mb": 180.0,
                                     "same_loss": True, "construction_s": [1.0, 1.2, 1.1], "threads": 1,
                                     "compute_s": [3.0, 3.3, 3.3], "per_core": {"rates": [40.0, 50.0, 45.0],
                                                                                "threads": 1}},
            "PyTorch (per-sample recursion)": {"error": "failed: boom"},
            "PyTorch (batched by level)": {"rates": [5.0], "samples": 64, "threads": 2,
                                           "per_core": {"error": "failed: slow"}}}


def test_rows_have_medians_ratios_and_gemm_share():
    rows = report.rows_for("tree_lstm/hidden", Point("tree_lstm", 512, 64), _systems(), machine=1e12)
    ours, dy, failed, torch = rows
    assert torch["ratio_train"] == 20.0 and math.isnan(torch["core_ratio_train"])
    assert torch["note"] == "per core: failed: slow"
    assert (ours["core_train_median"], ours["core_threads"], ours["threads"]) == (62.0, 1, 2)
    assert dy["core_ratio_train"] == pytest.approx(62 / 45) and report.threads_cell(dy) == "1 / 1"
    assert (ours["train_median"], ours["train_min"], ours["train_max"]) == (100.0, 90.0, 130.0)
    assert ours["infer_median"] == 305.0 and ours["ratio_train"] == 1.0
    assert ours["gemm_fraction"] == pytest.approx(100 * 3 * 2e9 / 1e12)        # 60%
    assert dy["ratio_train"] == pytest.approx(100 / 45) and dy["ratio_infer"] == pytest.approx(305 / 150)
    assert dy["gemm_fraction"] == pytest.approx(45 * 3 * 2e9 / 1e12)
    assert ours["scheduling_frac"] == pytest.approx(0.1) and ours["compute_frac"] == pytest.approx(0.8)
    assert dy["construction_frac"] == pytest.approx(1.1 / (1.1 + 3.3))
    assert math.isnan(failed["train_median"]) and failed["note"] == "failed: boom"


def test_csv_and_markdown_from_given_numbers(tmp_path):
    rows = report.rows_for("tree_lstm/hidden", Point("tree_lstm", 512, 64), _systems(), machine=1e12)
    csv_path, md_path = report.write_sweep(tmp_path, "tree_lstm/hidden", rows)
    with open(csv_path) as f:
        back = list(csv.DictReader(f))
    assert [r["system"] for r in back] == ["minicavs", "DyNet (autobatching)", "PyTorch (per-sample recursion)",
                                           "PyTorch (batched by level)"]
    assert float(back[1]["ratio_train"]) == pytest.approx(100 / 45, rel=1e-5)
    assert back[2]["train_median"] == "" and back[0]["hidden"] == "512"
    md = md_path.read_text()
    lines = [line for line in md.splitlines() if line.startswith("| h512 b64")]
    assert len(lines) == 4
    assert "100 (90-130)" in lines[0] and "60%" in lines[0] and "sched 10%" in lines[0]
    assert "45.0 (40.0-50.0)" in lines[1] and "2.22x" in lines[1] and "| yes |" in lines[1]
    assert "construction 25%" in lines[1] and "failed: boom" in lines[2]


def test_a_peer_stopped_by_the_timed_cap_says_so_and_still_counts(tmp_path):
    """A capped timed epoch: the row names the fewest batches a round ran, in the CSV and the table, without a
    note (a note would mark the row "not measured" for the targets)."""
    systems = _systems()
    systems["PyTorch (batched by level)"].update(batches=3, timed_batches=[2, 3, 2])
    rows = report.rows_for("tree_lstm/hidden", Point("tree_lstm", 512, 64), systems, machine=1e12)
    level = rows[3]
    assert (level["batches"], level["timed_batches"], level["note"]) == (3, 2, "per core: failed: slow")
    assert rows[1]["timed_batches"] == "" and "timed on" not in report.markdown(rows[:3])
    csv_path, md_path = report.write_sweep(tmp_path, "tree_lstm/hidden", rows)
    with open(csv_path) as f:
        assert list(csv.DictReader(f))[3]["timed_batches"] == "2"
    assert "timed on 2 of 3 batches (timed cap)" in md_path.read_text().splitlines()[-1]


def _sweep_rows(sweep: str, values) -> list[dict]:
    """Rows of one sweep measured at the given values of its axis (the other fields at the quick point)."""
    model, kind = sweep.split("/")
    field = "hidden" if kind == "latency" else kind
    base = {"hidden": 512, "batch": 1 if kind == "latency" else 64, "leaves": 256 if model == "tree_fc" else 0}
    return [row for v in values
            for row in report.rows_for(sweep, Point(model, **{**base, field: v}), _systems(), machine=1e12)]


def test_plots_or_a_clear_reason(tmp_path):
    rows = _sweep_rows("tree_lstm/hidden", (128, 512))
    out = report.plot_sweeps(tmp_path, {}, {"tree_lstm/hidden": rows})
    ab = report.plot_ablation(tmp_path, {"Tree-LSTM": {64: {"fusion": 1.2, "all on": 1.4}}})
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out and "matplotlib is not installed" in ab
    else:
        assert [p.name for p in out] == ["tree_lstm_hidden.png"] and out[0].stat().st_size > 1000
        assert ab.name == "ablation.png" and ab.stat().st_size > 1000


QUICK_SWEEPS = list(sweeps(quick=True))   # every sweep --quick measures: one point each


@pytest.mark.parametrize("sweep", QUICK_SWEEPS + ["tree_lstm/latency"])
def test_a_sweep_of_one_point_gets_no_plot(tmp_path, sweep):
    pytest.importorskip("matplotlib")
    one, two = _sweep_rows(sweep, (128,)), _sweep_rows(sweep, (64, 128))
    assert not report.plottable(sweep, one) and report.plottable(sweep, two)
    assert report.plot_sweeps(tmp_path, {}, {sweep: one}) == [] and not list(tmp_path.iterdir())
    assert [p.name for p in report.plot_sweeps(tmp_path, {}, {sweep: two})] == [sweep.replace("/", "_") + ".png"]


def test_quick_sweeps_are_all_single_points():
    """What the test above relies on: --quick measures each of its nine sweeps at one point."""
    assert len(QUICK_SWEEPS) == 9 and all(len(pts) == 1 for pts in sweeps(quick=True).values())


def test_breakdown_parts_and_restored_methods():
    t = tree_fc(8, 8, 4, 8, EngineOptions())
    data = t.task.data["train"]
    b = instrumented_epoch(t, data, 4)
    assert b["scheduling_s"] > 0 and b["update_s"] > 0
    assert b["memory_s"] > 0   # the C runner's pass copies rows (the loop's, and the blocks' pushes)
    assert b["compute_s"] == pytest.approx(b["step_s"] - b["update_s"] - b["scheduling_s"] - b["memory_s"],
                                           abs=1e-9)
    assert "batch" not in vars(t.task) and "_plan" not in vars(t.model)    # the wrappers are gone
    assert t.device.clock is None                                      # and the C runner's clock is off


# --- command line ------------------------------------------------------------------------------------------

def _parser():
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_command_line_defaults_quick_and_env(monkeypatch, tmp_path):
    args = _parser().parse_args(["--out", str(tmp_path), "--sst", "synthetic", "--ptb", "synthetic"])
    s = settings(args)
    assert s.models == MODELS and s.cap == 2.5 and s.repeats == 3 and s.epoch_cap == pytest.approx(2.5 / 3)
    assert s.timed_cap == pytest.approx(2.5) and s.ablation_hidden == (64, 512) and not s.points
    assert s.data.sst is None and s.data.trees == 1024 and s.ablation and s.inference
    s = settings(_parser().parse_args(["--quick", "--sst", "synthetic", "--ptb", "synthetic", "--cap", "3"]))
    assert s.quick and s.cap == 3.0 and s.repeats == 2 and s.data.trees == 256
    monkeypatch.setenv("MINICAVS_TORCH_PYTHON", "/p/bin/python")
    monkeypatch.delenv("MINICAVS_DYNET_PYTHON", raising=False)   # set when the peer tests run
    args = _parser().parse_args(["--models", "tree_fc", "--no-ablation"])
    assert args.torch_python == "/p/bin/python" and args.dynet_python is None and not args.ablation
    assert args.models == ["tree_fc"]


def test_command_line_errors(tmp_path):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--models", "lstm"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--cap", "soon"])
    with pytest.raises(ValueError, match="--cap must be positive"):
        settings(_parser().parse_args(["--cap", "0", "--sst", "synthetic", "--ptb", "synthetic"]))
    with pytest.raises(FileNotFoundError, match="SST not found: .*nope.txt"):
        settings(_parser().parse_args(["--models", "tree_lstm", "--sst", str(tmp_path / "nope.txt")]))


# --- end to end --------------------------------------------------------------------------------------------

def test_tiny_suite_end_to_end(tmp_path):
    grid = {**FULL, "batch": [4], "hidden": [8], "hidden_at": 8, "batch_at": 4, "leaves": [4], "fc_leaves": 4}
    logged = []
    s = Settings(models=("tree_fc", "fixed_lstm"), quick=True, cap=0.05, repeats=1,
                 data=Data(fc_trees=8, windows=8, lm_embed=8), out=tmp_path, grid=grid, ablation_hidden=(8,),
                 gemm_n=128, plots=False,
                 log=logged.append)
    summary = run_suite(s)
    assert any("skipping the pytorch peers" in line for line in logged)
    assert any("cap 0.05 s of timed training" in line for line in logged)
    assert not (tmp_path / "targets.md").exists() and "target" not in summary.read_text().lower()
    names = {p.name for p in tmp_path.iterdir()}
    for sweep in ("tree_fc_batch", "tree_fc_hidden", "tree_fc_leaves", "fixed_lstm_batch", "fixed_lstm_hidden"):
        assert {f"{sweep}.csv", f"{sweep}.md"} <= names
    with open(tmp_path / "all.csv") as f:
        rows = list(csv.DictReader(f))
    # one point per model, in both of its Fig. 8 sweeps (and Tree-FC's leaves sweep)
    assert sorted((r["sweep"], r["model"], r["hidden"], r["batch"]) for r in rows) == sorted(
        [(f"tree_fc/{k}", "tree_fc", "8", "4") for k in ("batch", "hidden", "leaves")]
        + [(f"fixed_lstm/{k}", "fixed_lstm", "8", "4") for k in ("batch", "hidden")])
    for r in rows:
        assert r["system"] == "minicavs" and float(r["train_median"]) > 0 and float(r["infer_median"]) > 0
        assert float(r["peak_rss_mb"]) > 10 and 0 <= float(r["compute_frac"]) <= 1
        assert int(r["samples"]) % 4 == 0 and 4 <= int(r["samples"]) <= 8     # whole batches, at most all
        assert float(r["core_train_median"]) > 0 and r["core_threads"] == "1"   # the same samples, one thread
        assert r["threads"] == str(os.cpu_count() or 1)
    text = summary.read_text()
    assert "| Tree-FC, 4 leaves | minicavs |" in text and "| Fixed-LSTM | 8 |" in text   # main table, ablation
    assert np.isfinite(float(rows[0]["gemm_fraction"]))


def test_peak_rss_is_the_childs_own_not_its_parents():
    import subprocess
    import sys
    held = np.ones(300 * 2 ** 20 // 8)      # 300 MB touched in this (the parent) process
    code = "from minicavs.bench.point import peak_rss_mb; print(peak_rss_mb())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 5 < float(out.stdout) < 200 and held[-1] == 1.0


def test_each_point_record_names_the_blas_it_ran_on_one_thread_per_core():
    """A point's child measures free to use the machine, then really computes on one BLAS thread (set at run
    time), and each record says so (threadpoolctl), with the CPU and the variables set."""
    from dataclasses import asdict
    from minicavs.bench.point import run_in_child
    pytest.importorskip("threadpoolctl")
    spec = {"point": Point("tree_fc", 8, 4, 4).as_dict(), "data": asdict(Data(fc_trees=8)), "repeats": 1,
            "epoch_cap": 0.05, "inference": False, "breakdown": False}
    got = run_in_child(spec)
    core = got["per_core"]
    assert core["samples"] == got["samples"] and core["threads"] == 1 and len(core["rates"]) == 1
    assert core["machine"]["blas"] and all(b["threads"] == 1 and b["kernel"] and b["version"]
                                           for b in core["machine"]["blas"])
    assert all(b["threads"] == got["threads"] for b in got["machine"]["blas"]) and got["machine"]["cpu"]["model"]


@pytest.mark.parametrize("model,chains", [("bilstm_tagger", True), ("lstm_nmt", True), ("lattice_gru", False)])
def test_policies_rows_of_ed_batchs_chain_and_lattice_workloads(model, chains, monkeypatch):
    """`bench --policies` knows the tagger, the encoder-decoder and the lattice GRU: tasks per batch for every
    policy at or above the lower bound, and the FSM's learning time; on chains (ED-Batch: every policy but
    depth-first finds the optimum) agenda reaches the bound."""
    from minicavs.bench import policies
    from minicavs.runtime.fsm import Hyper
    from minicavs.runtime.scheduler import FsmPolicy, get_policy
    config, extra = policies.WORKLOADS[model]
    monkeypatch.setitem(policies.WORKLOADS, model, (config, lambda: extra() + ["data.synthetic.train=128"]))
    monkeypatch.setattr(policies, "POLICIES", ("cavs", "agenda", "fsm:S3"))
    monkeypatch.setattr(policies, "get_policy", lambda name: FsmPolicy(encoding=name[4:], hyper=Hyper(
        episodes=50)) if name.startswith("fsm:") else get_policy(name))     # short learning
    row = policies.count_model(model, batches=1, learn=1, log=lambda s: None)
    assert set(row["tasks"]) == {"cavs", "agenda", "fsm:S3"} and row["fsm"]["fsm:S3"]["seconds"] > 0
    assert all(t >= row["lower_bound"] for t in row["tasks"].values()), row
    assert (row["tasks"]["agenda"] == row["lower_bound"]) == chains, row


def test_policies_table_end_to_end(tmp_path, monkeypatch):
    """`bench --policies` on two small workloads: every policy at or above the lower bound, the files."""
    from minicavs.bench import policies
    small = ["data.synthetic.train=256", "model.dropout=0.0"]
    monkeypatch.setattr(policies, "WORKLOADS", {"tree_lstm": ("tree_lstm.yaml", lambda: small),
                                                "tree_lstm_2type": ("tree_lstm_2type.yaml", lambda: small)})
    monkeypatch.setattr(policies, "POLICIES", ("cavs", "agenda", "greedy", "fsm:S3"))
    from minicavs.runtime.fsm import Hyper
    from minicavs.runtime.scheduler import FsmPolicy, get_policy
    monkeypatch.setattr(policies, "get_policy", lambda name: FsmPolicy(encoding=name[4:], hyper=Hyper(
        episodes=100)) if name.startswith("fsm:") else get_policy(name))     # short learning
    res = policies.run_policies(["tree_lstm", "tree_lstm_2type", "tree_lstm_2type+outputs"], tmp_path, batches=2,
                                learn=1, log=lambda s: None)
    rows = {r["model"]: r for r in res["rows"]}
    ops = rows["tree_lstm_2type+outputs"]    # every vertex pushes: one output per vertex, one sum per tree
    assert ops["kinds"] == ["cell_a", "cell_b", "leaf", "out", "sum"]
    assert ops["vertices"] == 2 * rows["tree_lstm_2type"]["vertices"] + 64
    for r in rows.values():
        assert all(t >= r["lower_bound"] for t in r["tasks"].values()) and r["fsm"]["fsm:S3"]["episodes"] >= 50
    assert rows["tree_lstm"]["tasks"]["cavs"] == rows["tree_lstm"]["lower_bound"]   # leaf/internal: optimal
    text = (tmp_path / "policies.md").read_text()
    assert "| tree_lstm_2type |" in text and "| tree_lstm_2type+outputs |" in text and "lower bound" in text and (tmp_path / "policies.json").is_file()
    with pytest.raises(ValueError, match="--policy-models: unknown"):
        from minicavs.bench import run
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        run(parser.parse_args(["--policies", "--policy-models", "nope"]))
    with pytest.raises(ValueError, match="--policy-repeats must be positive"):
        run(parser.parse_args(["--policies", "--policy-repeats", "0"]))


def test_with_outputs_is_ed_batch_fig1():
    """The output/sum vertices added to a tree are ED-Batch's Fig. 1 graph: the same policy counts."""
    from minicavs.bench.policies import with_outputs
    from minicavs.runtime.inputs import InputGraph, make_batch
    from minicavs.runtime.scheduler import get_policy, lower_bound

    from ..runtime.test_frontier import fig1_graph
    tree = InputGraph([[], [], [], [], [0, 1], [4, 2], [5, 3]], ["I"] * 7)
    ours = with_outputs(make_batch([tree] * 3, kind_names=("I",)), {"I"})
    children, kinds = fig1_graph()
    theirs = make_batch([InputGraph(children, [{"O": "out", "R": "sum"}.get(k, k) for k in kinds])] * 3,
                        kind_names=("I", "out", "sum"))
    assert ours.kind.tolist() == theirs.kind.tolist()
    assert ours.child_idx.tolist() == theirs.child_idx.tolist() and ours.child_ptr.tolist() == theirs.child_ptr.tolist()
    assert lower_bound(ours) == 6
    assert [get_policy(p).schedule(ours).num_tasks for p in ("cavs", "agenda", "greedy")] == [9, 7, 6]


def _figures(monkeypatch):
    """The figures a plot function builds (it closes them; keep them to look at their axes)."""
    plt = pytest.importorskip("matplotlib.pyplot")
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    return figs


def test_sweep_axes_are_log_with_every_point_ticked(tmp_path, monkeypatch):
    figs = _figures(monkeypatch)
    rows = _sweep_rows("tree_lstm/hidden", (128, 512))
    report.plot_sweeps(tmp_path, {}, {"tree_lstm/hidden": rows})
    train, infer = figs[0].axes
    for ax in (train, infer):
        assert ax.get_xscale() == "log" and list(ax.get_xticks()) == [128, 512]
    assert infer.get_yscale() == "linear" and infer.get_ylim()[0] == 0    # 150-310/s: no empty log decades
    assert train.get_yscale() == "log"                                     # 5-130/s spans decades


def test_ablation_legend_is_clear_of_the_bars(tmp_path, monkeypatch):
    figs = _figures(monkeypatch)
    switches = {"lazy batching": 1.1, "eager batching": 1.0, "fusion": 1.2, "gather elision": 0.98,
                "streaming": 0.9, "all on": 1.4}
    report.plot_ablation(tmp_path, {m: {h: switches for h in (64, 128, 256, 512)} for m in ("A", "B")})
    fig = figs[0]
    fig.canvas.draw()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    assert all(ax.get_legend() is None for ax in fig.axes)
    assert all(box.y1 < ax.get_window_extent().y0 for ax in fig.axes)   # below every panel


# --- the speed targets ----------------------------------------------------------------------------------

def _result(ours: float, fpu: float = 1e6, infer: float | None = None, machine: float = 1.0, **peers) -> dict:
    """A point's systems: minicavs' rate (and forward-only rate) per core, the peers' by label; free to use
    the machine, minicavs' rates are ``machine`` times those (the peers' the same)."""
    def rates(rate, forward):
        return {"rates": [rate], **({"infer_rates": [forward]} if forward else {})}
    out = {"minicavs": {**rates(ours * machine, infer and infer * machine), "flops_per_unit": fpu,
                        "per_core": rates(ours, infer)}}
    for label, rate in peers.items():
        out[label] = {**rates(rate, infer and rate), "per_core": rates(rate, infer and rate)}
    return out


def test_targets_are_judged_per_core_on_their_worst_point():
    from minicavs.bench import targets
    dy, lvl, packed = targets.DYNET, targets.TORCH_LEVEL, targets.TORCH_PACKED
    results = {
        "tree_lstm-h64-b64": _result(500.0, **{dy: 100.0}),                   # 5.0x: met (the bound itself)
        "tree_lstm-h128-b64": _result(300.0, machine=2.0, **{dy: 100.0, lvl: 350.0}),   # 3.0x per core: missed
                                                                              # (6.0x on the machine)
        "tree_lstm-h128-b1": _result(30.0, infer=50.0, **{dy: 20.0}),         # forward-only 2.5x: met
        "tree_fc-h512-b64-l256": _result(100.0, fpu=1e9, machine=2.0, **{lvl: 90.0}),   # 100 * 3e9 / 1e12 = 30%
                                                                              # of one thread's GEMM (60%)
        "tree_fc-h64-b64-l256": _result(50.0, **{lvl: 100.0}),                # 0.5x: the worst Tree-FC point
        "tree_fc-h512-b1-l256": _result(5.0, **{lvl: 4.0, dy: 1.0}),
    }
    rows = {r["target"]: r for r in targets.evaluate(results, 1e12, ("tree_lstm", "tree_fc"), core=1e12)}
    assert all(r["target"].startswith(("Tree-LSTM", "Tree-FC", "No sweep")) for r in rows.values())
    by = {k.split(":")[0]: r for k, r in rows.items()}
    assert by["Tree-LSTM, batch 64, hidden 64"]["status"] == "met"
    assert by["Tree-LSTM, batch 64, hidden 128"]["value"] == pytest.approx(3.0)
    assert by["Tree-LSTM, batch 64, hidden 128"]["status"] == "missed"
    assert by["Tree-LSTM, batch 64, hidden 512"]["status"] == "not measured"   # no such point in the results
    assert by["Tree-LSTM, batch 1, hidden 128, forward only"]["value"] == pytest.approx(2.5)
    gemm = by["Tree-FC, 256 leaves, batch 64, hidden 512"]
    assert gemm["value"] == pytest.approx(0.3) and gemm["status"] == "missed"
    every = by["Tree-FC"]
    assert (every["value"], every["worst"], every["measured"], every["points"]) == (
        0.5, "Tree-FC h64 b64 l256", 3, 10)
    fastest = by["No sweep point below 1.0x the fastest batched peer"]
    assert fastest["value"] == pytest.approx(0.5) and fastest["measured"] == 6
    assert by["Tree-LSTM, batch 64, hidden 128"]["value"] == pytest.approx(3.0)   # vs DyNet, not the faster peer
    text = targets.markdown(list(rows.values()), "minicavs bench --targets")
    assert "| Tree-LSTM, batch 64, hidden 128: >= 4x DyNet | >= 4.00x | 3.00x | 6.00x | Tree-LSTM h128 b64 | " \
           "1/1 | **missed** |" in text   # judged per core, the machine's ratio beside
    assert "| 30% | 60% | Tree-FC h512 b64 l256 |" in text and "Measured by `minicavs bench --targets`" in text
    assert "Tree-FC h64 b64 l256 vs PyTorch (batched by level)" in text


def _quick_results() -> dict:
    """Every point --quick measures, minicavs alone, at made-up rates."""
    return {p.key(): _result(100.0) for p in distinct_points(sweeps(quick=True))}


@pytest.mark.parametrize("quick,targets_flag,shown", [(True, False, False), (False, False, True),
                                                      (True, True, True), (False, True, True)])
def test_the_targets_table_is_left_out_of_quick_runs_only(tmp_path, quick, targets_flag, shown):
    from minicavs.bench import suite
    s = Settings(models=MODELS, quick=quick, cap=1.5, repeats=2, data=Data(), out=tmp_path, plots=False,
                 targets=targets_flag, log=lambda *a: None, gemm={"core": [1e11, 1e11]})
    summary = suite.write_reports(s, _quick_results(), (1e11, 1e11), {}, 60.0).read_text()
    assert (tmp_path / "targets.md").exists() == shown
    assert ("| target | bound |" in summary) == shown and ("missed" in summary) == shown
    assert ("## Speed targets" in summary) == shown
    assert "issue" not in summary.lower()


def test_quick_reports_write_no_single_point_plot_and_say_so(tmp_path):
    pytest.importorskip("matplotlib")
    from minicavs.bench import suite
    notes = []
    s = Settings(models=MODELS, quick=True, cap=1.5, repeats=2, data=Data(), out=tmp_path, log=notes.append)
    suite.write_reports(s, _quick_results(), (1e11, 1e11), {}, 60.0)
    assert not [p.name for p in tmp_path.glob("*.png")]
    assert any("no plot of 9 sweep(s) measured at a single point" in n for n in notes)
    assert {f"{n.replace('/', '_')}.md" for n in QUICK_SWEEPS} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize("cap,repeats", [(1.5, 2), (3.0, 3), (0.05, 1), (20.0, 3), (2.25, 2), (0.4, 3)])
def test_reports_state_the_cap_used_unrounded(tmp_path, cap, repeats):
    from minicavs.bench import suite
    s = Settings(models=MODELS, quick=True, cap=cap, repeats=repeats, data=Data(), out=tmp_path)
    text = suite._conditions(s, (1e11, 1e11))
    assert f"cap: {cap:g} s of timed training" in text
    assert float(text.split("fits ")[1].split(" s")[0]) == pytest.approx(cap / repeats, rel=1e-2)   # the epoch cap


def test_target_points_cover_each_target_once():
    from minicavs.bench import targets
    pts = targets.points(MODELS)
    keys = [p.key() for p in pts]
    assert len(set(keys)) == len(keys)
    assert {"tree_lstm-h64-b64", "tree_lstm-h128-b64", "tree_lstm-h512-b64", "tree_lstm-h128-b1",
            "var_lstm-h512-b64"} <= set(keys)
    assert sum(p.model == "tree_fc" for p in pts) == 5 + 4 + 3 - 2     # the three sweeps share h512 b64 l256
    assert sum(p.model == "fixed_lstm" for p in pts) == 5 + 4 - 1
    assert not any(p.model == "var_lstm" and p.key() != "var_lstm-h512-b64" for p in pts)
    assert keys[:4] == ["tree_lstm-h64-b64", "tree_lstm-h128-b64", "tree_lstm-h512-b64", "tree_lstm-h128-b1"]
    assert len(targets.points(["tree_fc"], quick=True)) == 1


def test_engine_settings_are_read_like_config_keys():
    from minicavs.bench import engine_settings
    assert engine_settings([]) == {}
    assert engine_settings(["fusion=false", "streaming=true"]) == {"fusion": False, "streaming": True}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        engine_settings(["fusion"])
    with pytest.raises(ValueError, match="train.engine.fusoin"):
        engine_settings(["fusoin=false"])
    with pytest.raises(ValueError, match="expected true/false"):
        engine_settings(["fusion=3"])
    args = _parser().parse_args(["--targets", "--engine", "fusion=false", "--sst", "synthetic", "--ptb",
                                 "synthetic"])
    s = settings(args)
    assert s.targets and s.engine == {"fusion": False}


def test_tiny_targets_run_end_to_end(tmp_path, monkeypatch):
    """--targets without peers: the points the targets need (here a tiny grid's), rounds, the table; the
    --engine settings reach the measured point."""
    from minicavs.bench import point as point_module
    from minicavs.bench import suite, targets
    tiny = (targets.Target("Tree-FC gemm", "tree_fc", "gemm", 0.85, None, Point("tree_fc", 8, 4, 4)),
            targets.Target("Tree-FC vs level", "tree_fc", "train", 1.0, targets.TORCH_LEVEL,
                           sweeps=("tree_fc/hidden",)),
            targets.Target("fastest", "*", "fastest", 1.0, sweeps=("*",)))
    monkeypatch.setattr(targets, "TARGETS", tiny)
    monkeypatch.setattr(targets.evaluate, "__defaults__", (False, None, tiny))
    monkeypatch.setattr(targets.points, "__defaults__", (False, None, tiny))
    specs, outs = [], []
    monkeypatch.setattr(suite, "run_in_child", lambda spec, timeout=None, env=None: specs.append(dict(spec)) or outs.append(
        {**point_module.measure_both(spec), "peak_rss_mb": 1.0}) or outs[-1])
    grid = {**FULL, "batch": [4], "hidden": [8, 16], "hidden_at": 8, "batch_at": 4, "leaves": [4], "fc_leaves": 4}
    logged = []
    s = Settings(models=("tree_fc",), quick=False, cap=0.05, repeats=2, data=Data(fc_trees=8), out=tmp_path,
                 grid=grid, gemm_n=128, plots=False, breakdown=False, inference=False, log=logged.append,
                 targets=True, engine={"fusion": False}, command="minicavs bench --targets")
    summary = run_suite(s)
    # per point one child: free to use the machine, then on one thread over the same samples; round 2 reversed
    assert [sp["point"]["hidden"] for sp in specs] == [8, 16, 16, 8]
    assert all(o["per_core"]["threads"] == 1 and o["per_core"]["samples"] == o["samples"] for o in outs)
    assert all(sp["options"] == {"fusion": False} and sp["repeats"] == 1 for sp in specs)
    assert "samples" not in specs[0] and specs[3]["samples"] == outs[0]["samples"]   # round 1's prefix
    results = __import__("json").loads((tmp_path / "results.json").read_text())["points"]
    assert len(results["tree_fc-h8-b4-l4"]["minicavs"]["rates"]) == 2           # one per round
    from minicavs.bench import machine_facts as machine
    ours = results["tree_fc-h8-b4-l4"]["minicavs"]
    assert ours["machine"]["blas"] == machine.blas() and ours["machine"]["cpu"] == machine.cpu()
    kernel = machine.blas()[0]["kernel"]
    assert f"kernel {kernel}" in (tmp_path / "targets.md").read_text() and f" {kernel} x" in (
        tmp_path / "all.csv").read_text()
    table = (tmp_path / "targets.md").read_text()
    assert "| Tree-FC gemm | >= 85% |" in table and "| Tree-FC vs level | >= 1.00x | - |" in table
    assert "not measured" in table and "Tree-FC gemm" in summary.read_text()
    assert any("| Tree-FC gemm |" in line for line in logged)


def test_policies_search_table_reports_the_best_s3_table():
    """The search section says how far the best S3 table gets below cavs and agenda, or that none was tried."""
    from minicavs.bench.policies import POLICIES, markdown
    tasks = {p: 40.0 for p in POLICIES} | {"cavs": 40.0, "agenda": 32.0, "fsm:S3": 31.0}
    row = {"model": "m", "vertices": 100.0, "tasks": tasks, "lower_bound": 25.0,
           "fsm": {p: {"seconds": 1.0, "episodes": 50, "states": 3, "lookup_us": 1.0, "native_step_us": 1.0}
                   for p in POLICIES if p.startswith("fsm")}, "schedule_ms": {p: 1.0 for p in POLICIES},
           "search": {"low": 28.0, "high": 29.0, "exact": 1, "per_batch": [{}], "best_s3_table": 30.0}}
    text = markdown([row, {**row, "model": "wide", "search": {**row["search"], "best_s3_table": None}}], {})
    assert "| 30.0 | 25%, 6% fewer |" in text and "| wide |" in text and "n/a (too many tables)" in text


def test_every_system_of_a_point_is_timed_on_the_samples_minicavs_was(monkeypatch, tmp_path):
    """minicavs picks the samples once (its epoch cap); its one-thread run and every peer, on the machine and
    on one thread, are timed on exactly those; DyNet's one-thread figure is its own run (it computes on one
    thread either way)."""
    from minicavs.bench import peers as peer_module
    from minicavs.bench import suite
    children, runs = [], []

    def child(spec, timeout=None, env=None):
        children.append(spec.get("samples"))
        n = spec.get("samples") or 12
        return {"samples": n, "rates": [1.0], "threads": 2, "per_core": {"samples": n, "threads": 1}}

    def peer(python, framework, t, *, mode, samples, per_core=False, **kw):
        runs.append((framework, mode, samples, per_core))
        return {"rates": [1.0], "check_loss": 1.0, "samples": samples, "threads": 2}

    monkeypatch.setattr(suite, "run_in_child", child)
    monkeypatch.setattr(peer_module, "run", peer)
    monkeypatch.setattr(peer_module, "check_loss", lambda t, k: 1.0)
    grid = {**FULL, "batch": [2, 4, 8], "hidden": [8], "hidden_at": 8, "batch_at": 4, "latency": []}
    s = Settings(models=("tree_lstm",), quick=False, cap=0.05, repeats=1, out=tmp_path, grid=grid,
                 data=Data(trees=20), available={"dynet": "py", "pytorch": "py"}, log=lambda *a: None, work=tmp_path)
    point = Point("tree_lstm", 8, 8)   # the largest batch (the paper's PyTorch point): the per-sample peer runs
    ours = suite._ours(s, point)
    assert children == [None] and ours["per_core"]["threads"] == 1
    got = suite._peers_at(s, point, ours)
    assert {r[2] for r in runs} == {12}                         # every run on minicavs' 12 samples
    assert sorted(r[:2] for r in runs) == [                      # one process each, both thread settings
        ("dynet", "autobatch"), ("pytorch", "level"), ("pytorch", "recursive")] and all(r[3] for r in runs)
    dynet = got["DyNet (autobatching)"]
    assert dynet["per_core"]["samples"] == dynet["samples"] == 12
    runs.clear()
    assert "PyTorch (per-sample recursion)" not in suite._peers_at(s, Point("tree_lstm", 8, 4), ours)
    assert sorted(r[:2] for r in runs) == [("dynet", "autobatch"), ("pytorch", "level")]   # not a paper point


def test_rounds_hand_each_point_over_once_cap_every_peer_and_break_down_in_round_one(monkeypatch, tmp_path):
    """Three rounds: the peers' handover (the point's trainer built, checked, written) once per point; every
    peer's warm-up capped at the epoch cap and its timed epochs at the timed cap; minicavs' breakdown epoch
    only in the first round; each process's seconds recorded per round."""
    from minicavs.bench import peers as peer_module
    from minicavs.bench import suite
    specs, kws, built = [], [], []
    monkeypatch.setattr(suite, "run_in_child", lambda spec, timeout=None, env=None: specs.append(dict(spec)) or {
        "samples": 12, "rates": [1.0], "per_core": {"samples": 12, "rates": [1.0]}})
    monkeypatch.setattr(suite, "build", lambda point, data: built.append(point.key()) or SimpleNamespace(
        task=SimpleNamespace(data={"train": [0] * 20})))
    monkeypatch.setattr(peer_module, "prepare", lambda t, limit, d: {"model": "tree_fc", "limit": limit})
    monkeypatch.setattr(peer_module, "check_loss", lambda t, k: 1.0)
    monkeypatch.setattr(peer_module, "run", lambda python, fw, t, **kw: kws.append(kw) or {
        "rates": [1.0], "check_loss": 1.0, "samples": kw["samples"]})
    grid = {**FULL, "batch": [4], "hidden": [8, 16], "hidden_at": 8, "batch_at": 4, "leaves": [4], "fc_leaves": 4}
    s = Settings(models=("tree_fc",), quick=False, cap=0.3, repeats=3, data=Data(), out=tmp_path, grid=grid,
                 available={"dynet": "py", "pytorch": "py"}, log=lambda *a: None, work=tmp_path)
    pts = suite.sweep_points(s)
    results = suite.run_rounds(s, pts)
    assert sorted(built) == sorted(p.key() for p in pts)                  # once per point, not per round
    assert [sp["breakdown"] for sp in specs] == [True] * len(pts) + [False] * 2 * len(pts)
    assert kws and all(kw["max_seconds"] == s.epoch_cap == pytest.approx(0.1) and kw["timed_seconds"] == s.timed_cap
                       and kw["prepared"]["limit"] == kw["samples"] == 12 for kw in kws)
    ours = results[pts[0].key()]["minicavs"]
    assert len(ours["wall_s"]) == len(ours["rates"]) == 3


def test_the_runs_sst_file_holds_the_first_trees_a_point_reads(tmp_path):
    """Every process of a run reads the SST trees a point times from a copy cut to them: the same trees, in
    the same order, as the whole file's first ones."""
    from minicavs.bench.suite import first_trees
    from minicavs.data.sst import read_sst
    full = tmp_path / "train.txt"
    lines = ["(3 (2 a) (4 b))", "", "(1 (2 c) (0 d))", "(2 e)", "(4 (3 f) (2 g))"]
    full.write_text("\n".join(lines))
    data = first_trees(Data(sst=str(full), trees=3), tmp_path)
    assert data.sst != str(full) and data.trees == 3
    assert [t.to_bracket() for t in read_sst(data.sst)] == [t.to_bracket() for t in read_sst(full)[:3]]
    assert first_trees(Data(sst=None), tmp_path) == Data(sst=None)


def test_layout_table_rows_per_cell_and_variant(monkeypatch):
    """``bench --layout`` (bench/layout_table.py) on tiny cells: one row per cell and variant; the layout's merges
    are views (no weight bytes copied) where the naive cells without it copy their merged weights."""
    from minicavs.bench import layout_table as bench_layout
    monkeypatch.setitem(bench_layout.CELLS, "LSTM cell (Var-LSTM)",
                        ("var_lstm", ["model.dropout=0.0", "data.synthetic.train=8", "model.embed=4"]))
    monkeypatch.setattr(bench_layout, "CELLS", {k: v for k, v in bench_layout.CELLS.items() if "Var-LSTM" in k})
    rows = bench_layout.measure(hidden=4, batch=4, batches=1, repeats=1)
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"naive, no layout", "naive + layout", "fused"}
    assert by["naive + layout"]["merged_views"] == 2 and by["naive + layout"]["weight_bytes_copied"] == 0
    assert by["naive, no layout"]["merged_copied"] == 2 and by["naive, no layout"]["weight_bytes_copied"] > 0
    assert by["fused"]["vs_fused"] == 1.0 and all(r["ms_per_batch"] > 0 and r["planning_ms"] < 30 for r in rows)
    assert by["naive + layout"]["row_move_instructions"] == by["fused"]["row_move_instructions"]
    text = bench_layout.table(rows)
    assert text.count("\n") == 4 and "| LSTM cell (Var-LSTM) | naive + layout | 2 / 0 |" in text


def test_layout_hidden_must_be_positive(tmp_path):
    from minicavs.bench import run
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="--layout-hidden must be positive, got 0"):
        run(p.parse_args(["--layout", "--layout-hidden", "0", "--out", str(tmp_path)]))


@pytest.mark.parametrize("targets_flag", [False, True])
def test_every_sweep_alternates_the_systems_round_by_round(monkeypatch, tmp_path, targets_flag):
    """The full sweep as --targets: in each round every system once per point; every other round the points
    reversed and the peers before minicavs; every round on the samples minicavs' first round chose."""
    from minicavs.bench import suite
    calls = []

    def ours(s, point, repeats=None, samples=None, breakdown=None, env=None):
        calls.append(("minicavs", point.key(), samples, repeats))
        return {"samples": 12, "rates": [1.0]}

    def peers_at(s, point, ours, labels=None, epochs=None):
        calls.append(("peers", point.key(), ours.get("samples"), epochs))
        return {"peer": {"rates": [1.0]}}

    monkeypatch.setattr(suite, "_ours", ours)
    monkeypatch.setattr(suite, "_peers_at", peers_at)
    monkeypatch.setattr(suite, "machine_rate", lambda n: 1e11)
    monkeypatch.setattr(suite, "core_rate", lambda n: 5e10, raising=False)
    grid = {**FULL, "batch": [4], "hidden": [8, 16], "hidden_at": 8, "batch_at": 4, "leaves": [4], "fc_leaves": 4}
    s = Settings(models=("tree_fc",), quick=False, cap=0.05, repeats=3, data=Data(), out=tmp_path, grid=grid,
                 ablation=False, plots=False, targets=targets_flag, log=lambda *a: None)
    run_suite(s)
    keys = list(dict.fromkeys(c[1] for c in calls))
    assert len(keys) >= 2
    n = len(keys)
    rounds = [calls[2 * n * r:2 * n * (r + 1)] for r in range(3)]
    assert len(calls) == 2 * n * 3
    for r, got in enumerate(rounds):
        order = keys if r % 2 == 0 else keys[::-1]
        want = [("minicavs", "peers") if r % 2 == 0 else ("peers", "minicavs")] * n
        assert [c[1] for c in got[::2]] == order and [(a[0], b[0]) for a, b in zip(got[::2], got[1::2])] == want
        assert all(c[3] == 1 for c in got)                          # one timed epoch per system and round
        assert all(c[2] == 12 for c in got if r or c[0] == "peers")  # minicavs' first round's samples


def test_forced_kernel_runs_alternate_with_the_users_at_the_headline_points(monkeypatch, tmp_path):
    """--forced-kernel: at the Tree-LSTM headline points a second fresh minicavs process with the machine's BLAS
    variables, after the user's run in round 1 (on its samples, no breakdown) and before it in round 2; the
    other points once; each record names the kernel its process ran; headline.md has both columns."""
    from minicavs.bench import suite
    calls = []

    def child(spec, timeout=None, env=None):
        kernel = "Haswell" if env and env.get("OPENBLAS_CORETYPE") == "Haswell" else "SkylakeX"
        calls.append((spec["point"]["hidden"], spec["point"]["batch"], kernel, spec.get("samples"), spec["breakdown"]))
        assert env is None or env["MINICAVS_TEST_KEPT"] == "yes"   # the rest of the environment as it is
        rate = {"Haswell": 80.0, "SkylakeX": 100.0}[kernel]
        machine = {"blas": [{"library": "openblas", "version": "0.3.31", "kernel": kernel, "threads": 2}]}
        return {"samples": 12, "rates": [rate], "infer_rates": [rate], "machine": machine,
                "per_core": {"samples": 12, "rates": [rate / 2], "infer_rates": [rate / 2]}}

    def peers_at(s, point, ours, labels=None, epochs=None):
        return {"DyNet (autobatching)": {"rates": [20.0], "infer_rates": [40.0],
                                         "per_core": {"rates": [20.0], "infer_rates": [40.0]}}}
    monkeypatch.setenv("MINICAVS_TEST_KEPT", "yes")
    monkeypatch.setattr(suite, "run_in_child", child)
    monkeypatch.setattr(suite, "_peers_at", peers_at)
    s = Settings(models=("tree_lstm",), quick=False, cap=0.05, repeats=2, data=Data(), out=tmp_path,
                 forced={"OPENBLAS_CORETYPE": "Haswell"}, plots=False, log=lambda *a: None)
    pts = [Point("tree_lstm", 128, 64), Point("tree_lstm", 256, 64)]   # a headline point, then one that is not
    assert set(suite.forced_points(suite.sweep_points(s))) == {Point("tree_lstm", h, 64) for h in (64, 128, 512)} | {
        Point("tree_lstm", 128, 1)}
    results = suite.run_rounds(s, pts)
    assert calls == [(128, 64, "SkylakeX", None, True), (128, 64, "Haswell", 12, False),
                     (256, 64, "SkylakeX", None, True),
                     (256, 64, "SkylakeX", 12, False),                                  # round 2: reversed
                     (128, 64, "Haswell", 12, False), (128, 64, "SkylakeX", 12, False)]
    forced = results["tree_lstm-h128-b64"][report.FORCED]
    assert forced["machine"]["blas"][0]["kernel"] == "Haswell" and forced["rates"] == [80.0, 80.0]
    assert report.FORCED not in results["tree_lstm-h256-b64"]
    s.gemm = {"machine": [1e11], "core": [5e10]}
    suite.write_reports(s, results, (1e11, 1e11), {}, 1.0)
    head = (tmp_path / "headline.md").read_text()
    assert "per core, machine's BLAS variables (Haswell: OPENBLAS_CORETYPE=Haswell)" in head
    assert "| training, batch 64, hidden 128 | 2.50x | 5.00x | 2.00x | 4.00x |" in head


@pytest.mark.parametrize("argv", [["--cap", "-1"], ["--engine", "nokv"], ["--policies", "--policy-models", "nope"],
                                  ["--policies", "--policy-batches", "0"], ["--layout", "--layout-hidden", "0"],
                                  ["--policies", "--policy-search", "-1"], ["--forced-kernel"],
                                  ["--forced-kernel", "--as-user", "--layout"]])
def test_a_bad_flag_is_one_line_and_exit_2(argv, capsys):
    """Bad command-line input to ``minicavs bench``: one line naming the flag, exit status 2, no traceback."""
    from minicavs.train.cli import main
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minicavs bench: error: --"), err
