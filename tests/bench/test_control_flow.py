"""``minicavs bench --control`` (minicavs/bench/control_flow.py): control flow's rows, every system in a fresh process
per round, alternating, per core and on the machine; the emulated device's values against the C runner's; the
targets judged; a bad flag is one line."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np

from minicavs.bench import control_flow as control, targets

TINY = {"cond_in_f": {"hidden": 8, "batch": 3, "passes": 2}, "seq2seq": {"sequences": 64, "passes": 1}}


def test_the_systems_alternate_round_by_round_per_core_and_on_the_machine(monkeypatch, tmp_path):
    calls = []

    def child(spec, tree, one_thread, timeout=0):
        calls.append((spec["workload"], spec["system"], tree, one_thread))
        seconds = {"cond": 3.0, "plain": 2.0, "now": 1.0, "base": 4.0}[spec["system"]]
        return {"wall": [seconds], "cpu": [seconds / 2], "units": 1.0}
    monkeypatch.setattr(control, "run_child", child)
    run = control.ControlRun(tmp_path, ("cond_in_f", "seq2seq"), repeats=2, log=lambda *_: None)
    base = tmp_path / "base"
    runs, order = control.time_rows(run, base)
    first = [("cond_in_f", "cond"), ("cond_in_f", "plain"), ("seq2seq", "now"), ("seq2seq", "base")]
    second = [("seq2seq", "base"), ("seq2seq", "now"), ("cond_in_f", "plain"), ("cond_in_f", "cond")]
    want = [[r, m, *run_] for r, runs_ in ((0, first), (1, second)) for m in control.MODES for run_ in runs_]
    assert order == want
    assert [c[3] for c in calls] == [m == "per core" for _, m, *_ in want]
    assert {c[2] for c in calls if c[1] == "base"} == {base} and base not in {c[2] for c in calls if c[1] != "base"}
    stats = control.summarize(runs)
    assert stats["cond_in_f"]["per core"]["ratio"] == {"wall": 3.0 / 2.0, "cpu": 1.5 / 1.0}
    assert stats["seq2seq"]["machine"]["ratio"]["wall"] == 4.0   # a rate row: the speedup over the base
    assert all(len(runs[n][s][m]) == 2 for n in runs for s in runs[n] for m in control.MODES)


def test_the_base_commit_rows_alternate_this_tree_with_the_base_checkout(monkeypatch, tmp_path):
    """batch1_infer, batch64_train and seq2seq_predict (what two stand-alone alternation scripts measured before):
    "base" from the base checkout, "now" from this package, swapped and the rows reversed every other
    round; a time row's ratio is now / base, a rate row's the speedup."""
    calls = []

    def child(spec, tree, one_thread, timeout=0):
        calls.append((spec["workload"], spec["system"], tree, one_thread, spec.get("batch")))
        seconds = {"now": 1.0, "base": 2.0}[spec["system"]]
        return {"wall": [seconds], "cpu": [seconds], "units": 1.0}
    monkeypatch.setattr(control, "run_child", child)
    rows = ("batch1_infer", "batch64_train", "seq2seq_predict")
    run = control.ControlRun(tmp_path, rows, repeats=2, log=lambda *_: None)
    assert run.with_base() and not set(rows) & set(control.DEFAULT_ROWS)
    base = tmp_path / "base"
    runs, order = control.time_rows(run, base)
    first = [(n, s) for n in rows for s in ("now", "base")]
    second = [(n, s) for n in rows[::-1] for s in ("base", "now")]
    assert order == [[r, m, *run_] for r, runs_ in ((0, first), (1, second)) for m in control.MODES for run_ in runs_]
    assert {c[2] for c in calls if c[1] == "base"} == {base}
    assert {c[2] for c in calls if c[1] == "now"} == {control.package_root()}
    assert {(c[0], c[4]) for c in calls} == {("batch1_infer", None), ("tree_train", 64), ("seq2seq_predict", None)}
    stats = control.summarize(runs)
    assert stats["batch1_infer"]["per core"]["ratio"]["cpu"] == 0.5        # time per tree: now / base
    assert stats["seq2seq_predict"]["per core"]["ratio"]["cpu"] == 2.0     # sequences/s: the speedup


def test_a_base_commit_row_names_the_commit_and_times_each_system_in_a_fresh_process(tmp_path):
    """A tiny batch1_infer (hidden 8, 3 of 16 synthetic trees) against HEAD checked out: the full hash in the
    results and the table, every run a process of its own importing its tree's minicavs, the BLAS facts in every
    record, one BLAS thread per core; no device rows for it."""
    sizes = {"batch1_infer": {"hidden": 8, "data_trees": 16, "trees": 3, "passes": 1}}
    run = control.ControlRun(tmp_path, ("batch1_infer",), repeats=1, base="HEAD", sizes=sizes, log=lambda *_: None)
    text = run_control_checked(run)
    result = json.loads((tmp_path / "results.json").read_text())
    head = subprocess.run(["git", "-C", str(control.package_root()), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert result["base_commit"] == head and f"Base commit: HEAD ({head})." in text
    records = {(s, m): result["runs"]["batch1_infer"][s][m][0] for s in ("now", "base") for m in control.MODES}
    assert all("error" not in r for r in records.values()), records
    assert len({r["pid"] for r in records.values()} | {os.getpid()}) == 5
    trees = {s: {r["minicavs"] for (s_, _), r in records.items() if s_ == s} for s in ("now", "base")}
    assert trees["now"] == {str(control.package_root() / "minicavs")} and len(trees["base"]) == 1
    assert trees["base"] != trees["now"]
    for (system, mode), r in records.items():
        assert r["machine"]["blas"] and r["machine"]["cpu"]["model"] and r["units"] == 3.0
        if mode == "per core":
            assert all(b["threads"] == 1 for b in r["machine"]["blas"] if b["threads"] is not None)
    assert "batch1_infer" not in result["devices"].get("emulated CUDA", {})
    assert "| batch1_infer: " in text and "us per tree" in text and "### Targets" not in text   # (none for it)


def test_a_tiny_control_run_writes_the_rows_with_the_protocols_fields(tmp_path):
    """(seq2seq alone: its children compile almost nothing; the cond's emulated values: the test below.)"""
    run = control.ControlRun(tmp_path, ("seq2seq",), repeats=1, base="HEAD", sizes=TINY,
                             log=lambda *_: None, command="minicavs bench --control")
    text = run_control_checked(run)
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["machine"]["blas"] and len(result["load"]) == 2 and result["base"] == "HEAD"
    for name, systems in result["runs"].items():
        for system, modes in systems.items():
            per_core, whole = modes["per core"][0], modes["machine"][0]
            assert "error" not in per_core and "error" not in whole, (name, system, per_core, whole)
            assert len(per_core["wall"]) == len(per_core["cpu"]) == TINY[name]["passes"]
            assert all(b["threads"] == 1 for b in per_core["machine"]["blas"] if b["threads"] is not None)
            assert per_core["machine"]["env"]["OPENBLAS_NUM_THREADS"] == "1"
    trees = {s: result["runs"]["seq2seq"][s]["per core"][0]["minicavs"] for s in ("now", "base")}
    assert trees["now"] == str(control.package_root() / "minicavs") and trees["base"] != trees["now"]
    assert [r["row"] for r in result["targets"]] == ["seq2seq"] and result["targets"][0]["status"] in ("met", "missed")
    emulated = result["devices"]["emulated CUDA"]
    assert list(emulated) == ["seq2seq"] and list(emulated["seq2seq"]) == ["now"]
    assert emulated["seq2seq"]["now"]["equal"] and emulated["seq2seq"]["now"]["arrays"] > 1
    assert "GPU" in result["devices"] or any(n.startswith("no GPU rows: ") for n in result["notes"])
    assert (tmp_path / "control.md").read_text() == text and "| seq2seq: " in text and "`minicavs bench" in text


def test_the_emulated_rows_equal_the_c_runners_values(tmp_path):
    """The cond row's two systems run by the C runner and by the emulated CUDA issuing loop, F's passes and the
    static graph's program (the head and loss) alike."""
    run = control.ControlRun(tmp_path, ("cond_in_f",), sizes=TINY, log=lambda *_: None)
    emulated = control.device_rows(run)["emulated CUDA"]
    assert set(emulated["cond_in_f"]) == {"cond", "plain"}
    assert all(e["equal"] and e["arrays"] >= 4 for e in emulated["cond_in_f"].values()), emulated
    assert all(e["runners"] == [["C runner", "static program: C runner"], ["cuda runner", "static program: cuda runner"]]
               for e in emulated["cond_in_f"].values()), emulated


def run_control_checked(run) -> str:
    """run_control, leaving no worktree of the base behind."""
    before = _worktrees()
    text = control.run_control(run)
    assert _worktrees() == before
    return text


def _worktrees() -> str:
    return subprocess.run(["git", "-C", str(control.package_root()), "worktree", "list"], capture_output=True,
                          text=True).stdout


def test_values_that_differ_past_float32s_tolerance_are_not_equal():
    want = {"loss": np.array(2.0), "dW": np.array([[100.0, -3.0]])}
    assert control.same_values(want, {k: v.copy() for k, v in want.items()})["equal"]
    off = {"loss": want["loss"], "dW": want["dW"] + np.array([[0.0, 2e-3]])}   # 2e-5 of max|dW| = 100
    assert not control.same_values(want, off)["equal"]
    assert not control.same_values(want, {"loss": want["loss"]})["equal"]


def test_the_targets_table_judges_the_control_rows():
    judged = targets.judge_rows({"foreach_equal": 1.05, "cond_in_f": 1.2, "seq2seq": 3.5,
                                 "foreach_bucketed": math.nan, "while_in_f": 2.0})
    status = {r["row"]: r["status"] for r in judged}
    assert status == {"foreach_equal": "met", "cond_in_f": "missed", "seq2seq": "met",
                      "foreach_bucketed": "not measured"}
    assert targets.judge_rows({"seq2seq": 2.9})[0]["status"] == "missed"
    table = targets.rows_markdown(judged)
    assert "| 1.20x | **missed** |" in table and "| >= 3.00x | 3.50x | met |" in table


def test_a_bad_control_flag_is_one_line_and_exit_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "minicavs", "bench", "--control", "--control-rows", "nope",
                          "--out", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip().startswith("minicavs bench: error: --control-rows: unknown")
    assert len(res.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_a_base_commit_that_does_not_exist_is_a_note_and_no_checkout():
    notes: list = []
    with control.base_tree("no-such-commit-0123", notes) as tree:
        assert tree is None
    assert len(notes) == 1 and notes[0].startswith("base commit no-such-commit-0123 not measured: ")
