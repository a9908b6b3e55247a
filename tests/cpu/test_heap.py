"""cpu/heap.py: after keep_freed_memory, a freed large array's pages are reused by the next one of its size
(no page faults); the user's own malloc settings are left alone."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Allocate, touch and free two arrays of ROWS x 6022 floats the way a step does (both live at once), twice;
# print whether the settings were applied and the page faults of the second round. 1024 rows: 24 MB each;
# 1545 rows: 37 MB, above glibc's largest mmap threshold (a Var-LSTM's logits at batch 64).
PROBE = textwrap.dedent("""
    import resource, sys
    import numpy as np
    from minicavs.cpu.heap import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "keep" else False
    def step(rows):
        a = np.ones((rows, 6022), np.float32)
        b = np.ones((rows, 6022), np.float32)
        del a, b
    rows = int(sys.argv[2])
    step(rows)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(rows)
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def probe(mode: str, rows: int = 1024, **env) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(rows)], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, **env}, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not GLIBC, reason="mallopt settings are glibc's")
@pytest.mark.parametrize("rows", [1024, 1545])
def test_freed_arrays_are_reused_without_page_faults(rows):
    applied, faults = probe("keep", rows)
    assert applied == "True" and faults < 100     # glibc's defaults: about 1300 faults (huge and small pages)


@pytest.mark.skipif(not GLIBC, reason="mallopt settings are glibc's")
def test_arrays_above_the_largest_mmap_threshold_fault_without_the_settings():
    applied, faults = probe("default", 1545)
    assert applied == "False" and faults > 100    # mapped and unmapped per use (what the settings avoid)


@pytest.mark.skipif(not GLIBC, reason="mallopt settings are glibc's")
@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])
def test_the_users_malloc_settings_are_kept(env):
    applied, faults = probe("keep", **env)
    assert applied == "False" and faults > 400    # trimmed at every free: each round faults its pages in again (~800)


def test_trainer_on_the_cpu_applies_them(tmp_path, monkeypatch):
    from minicavs.train.trainer import Trainer
    calls = []
    monkeypatch.setattr("minicavs.cpu.keep_freed_memory", lambda: calls.append(1) or True)
    Trainer(REPO / "models" / "var_lstm.yaml", ["data.synthetic.train=8", "data.synthetic.dev=2",
                                                "data.synthetic.test=2"], run_dir=tmp_path)
    assert calls == [1]
