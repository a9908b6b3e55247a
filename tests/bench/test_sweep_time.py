"""The sweep's time model (minicavs/bench/sweep_time.py): which processes a round runs, bounds from the caps,
the estimate's parts, and ``bench --plan`` / ``--points`` on the command line. Timings are a fake system's
numbers; nothing here is timed."""
from __future__ import annotations

import pytest

from minicavs.bench import sweep_time
from minicavs.bench.sweeps import FULL, Point, distinct_points, per_sample_points, sweeps

BOTH = {"dynet": "py", "pytorch": "py"}


def test_a_round_runs_one_process_per_system_and_per_sample_peers_only_at_the_papers_point():
    sw = sweeps()
    at = per_sample_points(sw)
    assert at == [Point("tree_lstm", 512, 256)]   # the paper's one PyTorch figure (Tree-LSTM, batch 256)
    pts = distinct_points(sw)
    runs = sweep_time.runs(pts, BOTH, at)
    for p in pts:
        mine = [r for r in runs if r.point == p]
        assert [r.framework for r in mine][:2] == ["minicavs", "dynet"] and len(mine) == 3 + (p in at)
        assert sum(r.mode == "recursive" for r in mine) == (p in at)
    assert len(runs) == 3 * 35 + 1 and {r.settings for r in runs if r.framework == "dynet"} == {1}
    assert [r.framework for r in sweep_time.runs(pts[:1], {}, at)] == ["minicavs"]    # no peers installed


def test_the_caps_bound_every_process_whatever_a_peer_costs(monkeypatch):
    """A peer 20x slower than minicavs costs its start-up plus, per thread setting, a capped warm-up and a
    capped timed epoch for training and inference; where one of its batches outlasts a cap, one batch."""
    epoch, timed = 1.0, 3.0
    monkeypatch.setitem(sweep_time.SLOWDOWN, ("recursive", "tree_lstm"), 20.0)
    monkeypatch.setitem(sweep_time.SLOWDOWN, ("packed", "tree_lstm"), 1.0)
    monkeypatch.setattr(sweep_time, "batch_seconds", lambda p: 1.0 if p.batch == 256 else 0.05)
    run = sweep_time.Run(Point("tree_lstm", 512, 1), "PyTorch (per-sample recursion)", "pytorch", "recursive")
    bound = sweep_time.STARTUP["pytorch"] + 2 * (epoch + timed + epoch + timed)
    assert sweep_time.run_seconds(run, epoch, timed) == pytest.approx(bound)
    big = sweep_time.Run(Point("tree_lstm", 512, 256), run.system, "pytorch", "recursive")   # a batch of 20 s
    one_batch = sweep_time.STARTUP["pytorch"] + 2 * (20 + 20 + 2 * sweep_time.INFER * 20)
    assert sweep_time.run_seconds(big, epoch, timed) == pytest.approx(one_batch)
    fast = sweep_time.Run(run.point, "PyTorch (nn.LSTM, packed)", "pytorch", "packed")
    assert sweep_time.run_seconds(fast, epoch, timed) < bound
    ours = sweep_time.Run(run.point, "minicavs", "minicavs")
    later, first = (sweep_time.run_seconds(ours, epoch, timed, first=f) for f in (False, True))
    # round 1 sizes the prefix (two batches) and runs the breakdown epoch
    assert first == pytest.approx(later + sweep_time.BREAKDOWN * epoch + 2 * 0.05)
    # the load stretches what no cap bounds (start-ups, a batch past a cap), never more than the load
    loaded = sweep_time.run_seconds(run, epoch, timed, load=3.0)
    assert bound + 2 * sweep_time.STARTUP["pytorch"] <= loaded <= 3 * bound


def test_a_batch_costs_its_products():
    """minicavs' batch time grows with the batch and the hidden size; one Tree-FC batch of 256 trees at hidden
    512 outlasts a whole epoch cap (the points whose phases are one batch each)."""
    seconds = sweep_time.batch_seconds
    assert seconds(Point("tree_fc", 512, 256, 256)) == pytest.approx(4 * seconds(Point("tree_fc", 512, 64, 256)))
    assert seconds(Point("tree_fc", 512, 256, 256)) > 1.0 > seconds(Point("tree_lstm", 512, 64))
    for model in ("tree_lstm", "var_lstm", "fixed_lstm"):
        assert seconds(Point(model, 1024, 64)) > 2 * seconds(Point(model, 512, 64)) > 0


def test_the_estimate_adds_its_parts_and_says_so():
    grid = {**FULL, "batch": [4], "hidden": [8, 16], "hidden_at": 8, "batch_at": 4, "leaves": [4], "fc_leaves": 4}
    sw = sweeps(["tree_fc"], grid=grid)
    pts = distinct_points(sw)
    est = sweep_time.estimate(pts, BOTH, per_sample_points(sw), repeats=3, epoch_cap=1.0, timed_cap=3.0,
                        ablation_cells=2)
    one = sweep_time.runs(pts, BOTH, per_sample_points(sw))
    rounds = sum(sweep_time.run_seconds(r, 1.0, 3.0, first=True) + 2 * sweep_time.run_seconds(r, 1.0, 3.0) for r in one)
    assert est["rounds"] == pytest.approx(rounds) and est["processes"] == 3 * len(one) and est["points"] == 2
    assert est["total"] == pytest.approx(rounds + 2 * sweep_time.HANDOVER + sweep_time.GEMM + 2 * sweep_time.ABLATION)
    text = sweep_time.headline(est, 3)
    assert text.startswith(f"this sweep: 2 points, {3 * len(one)} processes in 3 rounds, about ")
    assert f"about {est['total'] / 60:.0f} min" in text
    assert sweep_time.stretch(7.0, 2) == 3.5 and sweep_time.stretch(0.3, 2) == 1.0


def test_plan_flag_lists_points_and_estimate_without_running(capsys, monkeypatch):
    from minicavs.bench import suite
    from minicavs.train.cli import main
    monkeypatch.setattr(suite, "run_suite", lambda s: pytest.fail("--plan ran the sweep"))
    monkeypatch.delenv("MINICAVS_DYNET_PYTHON", raising=False)
    monkeypatch.delenv("MINICAVS_TORCH_PYTHON", raising=False)
    assert main(["bench", "--plan", "--models", "tree_fc", "--sst", "synthetic"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len([line for line in out if "processes, ~" in line]) == 10        # Tree-FC's 10 points
    assert out[-1].startswith("this sweep: 10 points, 30 processes in 3 rounds, about ")   # no peers given
    assert main(["bench", "--plan", "--models", "tree_fc", "--points", "tree_fc-h64-b64-l256"]) == 0
    assert "this sweep: 1 points" in capsys.readouterr().out


def test_an_unknown_point_is_one_line_and_exit_2(capsys):
    from minicavs.train.cli import main
    assert main(["bench", "--plan", "--models", "tree_fc", "--points", "tree_fc-h7-b1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--points: unknown ['tree_fc-h7-b1']" in err[0] and "tree_fc-h512-b64-l256" in err[0]


def test_forced_kernel_runs_are_one_more_minicavs_process_at_their_points_without_the_first_rounds_extras():
    """--forced-kernel: a second minicavs process at each of ``forced_at`` (no prefix sizing, no breakdown)."""
    from minicavs.bench.report import FORCED
    pts = [Point("tree_lstm", 128, 64), Point("tree_lstm", 256, 64)]
    runs = sweep_time.runs(pts, {}, [], forced_at=pts[:1])
    assert [(r.point, r.system) for r in runs] == [(pts[0], "minicavs"), (pts[0], FORCED), (pts[1], "minicavs")]
    plain, forced = (sweep_time.estimate(pts, {}, [], repeats=3, epoch_cap=1.0, timed_cap=3.0, forced_at=at)
                     for at in ((), pts[:1]))
    once = sweep_time.run_seconds(runs[1], 1.0, 3.0)
    assert forced["processes"] == plain["processes"] + 3 and forced["total"] == pytest.approx(plain["total"] + 3 * once)
