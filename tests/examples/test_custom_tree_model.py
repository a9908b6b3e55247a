"""examples/custom_tree_model.py runs as a user runs it (its own process) and does what it says."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_custom_tree_model_example_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_tree_model.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    first, last, acc = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) after 30 steps; training accuracy (\d+)%",
                                            out).groups())
    assert last < 0.5 * first and acc >= 90                       # it learned the rule
    assert re.search(r"structure 'tree': \d+ vertices in \d+ tasks", out)     # explain
    assert "kind 'leaf'" in out and "kind 'internal'" in out
    diff = float(re.search(r"largest difference: (\S+)", out).group(1))      # check: batched == serial
    assert diff < 1e-10
