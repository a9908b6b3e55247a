"""minicavs export and predict MODEL.mcav on the command line: what a user sees, and one-line errors (exit 2)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from minicavs.train.cli import main
from minicavs.train.predict import predict_lines
from minicavs.train.trainer import Trainer
from tests.train.test_artifact import ROOT

LINES = ["((the movie) (was great))", "", "(3 (2 it) (4 works))"]


def config(tmp_path, model: str = "tree_lstm") -> str:
    cfg = yaml.safe_load((ROOT / "models" / f"{model}.yaml").read_text())
    cfg["model"].update(name=str(ROOT / "models" / f"{model}.py"), hidden=4)
    cfg["data"]["synthetic"] = {"train": 30, "dev": 5, "test": 5, "seed": 7}
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_export_then_predict_the_file_as_predict_does_the_model(tmp_path, capsys):
    cfg = config(tmp_path)
    out = tmp_path / "m.mcav"
    assert main(["export", cfg, "-o", str(out)]) == 0
    said = capsys.readouterr()
    assert said.out.startswith(f"wrote {out} (") and "format minicavs-model version 1" in said.out
    assert "no --checkpoint: exported the initial (untrained) parameters" in said.err
    lines = tmp_path / "in.txt"
    lines.write_text("\n".join(LINES) + "\n")
    assert main(["predict", str(out), str(lines), "--json"]) == 0
    got = [json.loads(row) for row in capsys.readouterr().out.splitlines()]
    assert got == predict_lines(Trainer(cfg).task, LINES) and [r["line"] for r in got] == [1, 3]


@pytest.mark.parametrize("argv, match", [
    (lambda t: ["export", config(t, "tree_fc"), "-o", str(t / "m.mcav")],
     r"minicavs export: error: cannot export model TreeFC: it does not predict from text input \(no Task.predicts\)"),
    (lambda t: ["export", config(t), "-o", str(t / "no" / "such" / "m.mcav")], r"minicavs export: error: .*no/such"),
    (lambda t: ["predict", str(t / "absent.mcav"), "-"], r"minicavs predict: error: model file not found"),
    (lambda t: (t / "bad.mcav").write_bytes(b"PK\x03\x04junk") and ["predict", str(t / "bad.mcav"), "-"],
     r"minicavs predict: error: .*bad.mcav is not a readable minicavs model artifact"),
    (lambda t: ["predict", str(t / "x.mcav"), "-", "--checkpoint", "ck.npz"],
     r"minicavs predict: error: .*x.mcav is an exported model: it holds its weights and config"),
])
def test_bad_targets_are_one_line_errors_with_exit_status_2(tmp_path, capsys, argv, match):
    assert main(argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and __import__("re").match(match, err), err
    assert not (tmp_path / "m.mcav").exists()


def test_loading_says_it_compiles_its_kernels_then_that_the_cache_has_them(tmp_path):
    """On an empty kernel cache the load compiles (cache miss), the next load finds them (hit): one line on
    stderr each, before the first input is read."""
    model = tmp_path / "m.mcav"
    assert main(["export", config(tmp_path), "-o", str(model)]) == 0
    env = {**os.environ, "MINICAVS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    said = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-m", "minicavs", "predict", str(model), "-"], input="(a b)\n",
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.count("\n") == 1, done.stderr
        said.append(done.stderr.strip())
    assert list((tmp_path / "cache").glob("*.so")) and "\n" not in said[0] and "\n" not in said[1]
    assert re.fullmatch(rf"minicavs: loaded {re.escape(str(model))}: compiled its kernels \(\d+ fused kernels "
                        rf"and the C runner; cache miss, now cached in {re.escape(str(tmp_path / 'cache'))}\), "
                        rf"[\d.]+ s", said[0]), said[0]
    assert re.fullmatch(rf"minicavs: loaded .*: its kernels \(\d+ fused kernels and the C runner\) from the "
                        rf"kernel cache \(hit\), [\d.]+ s", said[1]), said[1]
