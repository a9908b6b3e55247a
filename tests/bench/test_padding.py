"""``minicavs bench --padding`` (minicavs/bench/padding.py): the foreach Var-LSTM against the chain graph,
shuffled and bucketed, per real word, the systems alternating, on tiny sizes; a bad flag is one line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minicavs.bench import padding


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(padding, "HIDDEN", 4)
    monkeypatch.setattr(padding, "EMBED", 3)
    monkeypatch.setattr(padding, "BATCH", 8)


def test_tiny_padding_table_end_to_end(tiny, tmp_path, monkeypatch):
    calls = []
    timed = padding._epoch_seconds

    def recording(t, epoch):
        calls.append((t.cfg["model"]["graph"], t.cfg["train"]["order"], epoch))
        return timed(t, epoch)
    monkeypatch.setattr(padding, "_epoch_seconds", recording)
    text = padding.run_padding(tmp_path, None, 40, 2)
    systems = json.loads((tmp_path / "padding.json").read_text())["systems"]
    assert list(systems) == list(padding.SYSTEMS) and (tmp_path / "padding.md").read_text().strip() == text
    assert systems[padding.BASELINE]["ratio"] == 1.0 and all(len(s["seconds"]) == 2 for s in systems.values())
    assert systems["foreach, bucketed"]["padding"] < systems["foreach, shuffled"]["padding"]
    assert "foreach with bucketing / chain graph:" in text and "x CPU" in text
    timed_calls = calls[len(padding.SYSTEMS):]   # after one warm-up epoch each: round 1, then round 2 rotated
    order = [(g, o) for g, o, _ in timed_calls]
    assert order[4:] == order[1:4] + order[:1] and {e for *_, e in timed_calls} == {1, 2}


def test_a_bad_padding_flag_is_one_line_and_exit_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "minicavs", "bench", "--padding", "--sentences", "0",
                          "--out", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip() == "minicavs bench: error: --sentences must be positive, got 0"
