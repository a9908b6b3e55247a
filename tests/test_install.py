"""The package as users get it: a wheel built from a copy of the repository, installed into a fresh virtual
environment, trains a bundled model by name from a directory that is not the repository, then evaluates it and
predicts with it from its run dir."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import cffi
import numpy
import yaml

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("minicavs", "models", "setup.py", "setup.cfg", "pyproject.toml", "README.md")


def run(cmd, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                         input=kw.pop("input", None), **kw)
    assert res.returncode == 0, f"{cmd}\n{res.stdout}\n{res.stderr}"
    return res


def test_pip_install_then_train_a_bundled_model_from_anywhere(tmp_path):
    src = tmp_path / "src"     # a copy: building writes build/ and *.egg-info beside the sources
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", src])
    wheel, = (tmp_path / "dist").glob("minicavs-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for model in ("tree_lstm", "tree_fc", "var_lstm", "fixed_lstm"):
        assert f"minicavs/models/{model}.py" in names and f"minicavs/models/{model}.yaml" in names
    assert not any(n.startswith(("tests/", "tools/", "models/")) for n in names)

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # then the dependencies (numpy, cffi, pyyaml) from the running environment, after the venv's own packages
    # (that environment may hold an installed minicavs too: CI's does; the venv's own comes first)
    deps = {str(Path(m.__file__).resolve().parent.parent) for m in (numpy, cffi, yaml)}
    (Path(site) / "deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = run([python, "-c", "import minicavs; print(minicavs.__file__)"], cwd=elsewhere, env=env).stdout
    assert Path(where.strip()).is_relative_to(venv)
    minicavs = venv / ("Scripts" if os.name == "nt" else "bin") / "minicavs"
    out = run([minicavs, "train", "tree_lstm", "--set", "train.epochs=1", "--no-progress"], cwd=elsewhere, env=env)
    assert "epoch 1/1" in out.stdout, out.stdout
    results = json.loads((elsewhere / "runs" / "tree_lstm" / "results.json").read_text())
    assert results["epoch"] == 1 and 0 <= results["test_root_acc"] <= 1
    out = run([minicavs, "eval", "runs/tree_lstm", "--split", "dev"], cwd=elsewhere, env=env)
    assert "dev_root_acc" in out.stdout
    trees = "((the movie) (was great))\n(3 (2 an) (4 unseen))\n"
    out = run([minicavs, "predict", "runs/tree_lstm", "-"], cwd=elsewhere, env=env, input=trees)
    predicted = out.stdout.splitlines()
    assert len(predicted) == 2, out.stdout
    # each input tree comes back with the same words and a label 0-4 at every node
    for line, words in zip(predicted, (["the", "movie", "was", "great"], ["an", "unseen"])):
        tokens = line.replace("(", " ").replace(")", " ").split()
        assert [t for t in tokens if not t.isdigit()] == words, line
        assert all(t in "01234" for t in tokens if t.isdigit()), line

    # a real data set goes to the user's data directory, where the bundled config looks, never into the package
    download = tmp_path / "download"
    download.mkdir()
    for name in ("train.txt", "dev.txt", "test.txt"):
        (download / name).write_text(trees.replace("((the movie) (was great))", "(1 (2 the) (0 movie))"))
    env = {k: v for k, v in env.items() if k != "MINICAVS_DATA"} | {"XDG_DATA_HOME": str(tmp_path / "xdg")}
    run([minicavs, "prepare", "sst", download, "--skip-checksums"], cwd=elsewhere, env=env)
    prepared = tmp_path / "xdg" / "minicavs" / "sst"
    assert sorted(p.name for p in prepared.iterdir()) == ["dev.txt", "test.txt", "train.txt"]
    assert not any(venv.rglob("dev.txt"))
    looks = run([python, "-c",
                 "from minicavs.train.config import load_config as l; print(l('tree_lstm_sst')['data']['dev'])"],
                cwd=elsewhere, env=env).stdout.strip()
    assert looks == str(prepared / "dev.txt")
