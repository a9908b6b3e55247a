"""minicavs plot: panels from metrics.jsonl, a PNG with matplotlib, one clear line without it."""
from __future__ import annotations

import json
import sys

import pytest

from minicavs.train.cli import main
from minicavs.train.plot import PlotError, panels, read_metrics

ROWS = [{"epoch": e, "train_loss": 3.0 / e, "step": 10 * e, "dev_loss": 2.5 / e, "dev_root_acc": 0.3 + e / 100,
         "dev_root_majority_acc": 0.25, "dev_perplexity": float("nan"),
         "timing": {"epoch_seconds": 1.0, "train_trees_per_s": 100.0 * e}} for e in (1, 2, 3)]


def write(run, rows, tail=""):
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_panels_group_splits_baselines_and_throughput():
    got = panels(ROWS)
    assert list(got) == ["loss", "root_acc", "train trees/s"]     # NaN-only metrics are left out
    assert got["loss"] == {"train": [(1, 3.0), (2, 1.5), (3, 1.0)], "dev": [(1, 2.5), (2, 1.25), (3, 2.5 / 3)]}
    assert got["root_acc"]["dev majority baseline"] == [(1, 0.25), (2, 0.25), (3, 0.25)]
    assert got["train trees/s"]["throughput"][-1] == (3, 300.0)


def test_torn_last_line_is_skipped_a_torn_middle_is_an_error(tmp_path):
    write(tmp_path, ROWS, '{"epoch": 4, "train_lo')
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1\n' + json.dumps(ROWS[0]) + "\n")
    with pytest.raises(PlotError, match=r"metrics.jsonl:1: not a JSON line"):
        read_metrics(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("rows", [ROWS, ROWS[:1]])
def test_png_for_one_and_several_epochs(tmp_path, rows, capsys):
    pytest.importorskip("matplotlib")
    write(tmp_path / "run", rows)
    assert main(["plot", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "curves.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["curves.png", "metrics.jsonl"]


def test_without_matplotlib_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)    # import matplotlib raises ImportError
    write(tmp_path / "run", ROWS)
    assert main(["plot", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["minicavs plot: error: matplotlib is not installed: pip install 'minicavs[plot]'"]
    assert not (tmp_path / "run" / "curves.png").exists()


def test_no_run_dir_is_a_clear_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err
