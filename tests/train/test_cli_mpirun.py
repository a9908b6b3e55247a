"""Every command under ``mpirun -n 2`` prints and writes once, what one process prints and writes (predict's
rows in input order, whichever rank predicted them). Each rank runs in a directory of its own, so a relative
path exists for rank 0 alone: a file rank 1 wrote, or needed, would show. One run, trained under mpirun,
serves every test (a module fixture)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.train.test_distributed import REPO_ROOT, launcher, mpi_env   # noqa: F401 (launcher: a fixture)

TREES = ["(3 (2 a) (2 b))", "(1 (2 c) (2 d))", "", "(4 (2 e) (3 (2 f) (2 g)))", "(0 (2 h) (2 a))", "(2 b)"]


def run_job(launcher, home: Path, *args: str) -> subprocess.CompletedProcess:
    """``mpirun -n 2 python -m minicavs ARGS``, rank r in ``home/rank<r>``."""
    wdir = "--wdir" if "--oversubscribe" in launcher else "-wdir"   # Open MPI / MPICH's Hydra
    contexts = [[":"] * (r > 0) + ["-n", "1", wdir, str(home / f"rank{r}"), sys.executable, "-m", "minicavs", *args]
                for r in range(2)]
    return subprocess.run(launcher + [a for c in contexts for a in c], capture_output=True, text=True,
                          env={**mpi_env(), "PYTHONPATH": str(REPO_ROOT)}, timeout=300)


def run_alone(home: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m minicavs ARGS`` as one process in ``home/alone``."""
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_", "PMI", "PMIX_"))}
    return subprocess.run([sys.executable, "-m", "minicavs", *args], cwd=home / "alone", capture_output=True,
                          text=True, env={**env, "PYTHONPATH": str(REPO_ROOT)}, timeout=300)


def same(job: subprocess.CompletedProcess, alone: subprocess.CompletedProcess, normal=lambda text: text) -> None:
    """Both ended well and printed the same, and the job printed something."""
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert job.stdout.strip() and normal(job.stdout) == normal(alone.stdout), (job.stdout, alone.stdout)


def untimed(text: str) -> str:
    """Training's lines without what differs between runs: times, rates, the rank count, one-time work."""
    text = re.sub(r"\d+(\.\d+)? s\b", "T s", text)
    text = re.sub(r" \([\d.]+ trees/s[^)]*\)", "", text)
    text = text.replace("; 2 ranks", "")
    return "".join(line for line in text.splitlines(True) if not line.startswith("compiling kernels"))


def written(home: Path) -> dict[str, list[str]]:
    """The files below each rank's directory and the single process's."""
    return {d.name: sorted(str(p.relative_to(d)) for p in d.rglob("*")) for d in sorted(home.iterdir())}


@pytest.fixture(scope="module")
def trained(launcher, tmp_path_factory):
    """(home, the job's train output, the single process's): a tiny Tree-LSTM trained one epoch by
    ``mpirun -n 2`` into ``home/rank0/run``, and by one process into ``home/alone/run``."""
    home = tmp_path_factory.mktemp("cli_mpirun")
    cfg = yaml.safe_load((REPO_ROOT / "models" / "tree_lstm.yaml").read_text())
    cfg["model"].update(name=str(REPO_ROOT / "models" / "tree_lstm.py"), embed=4, hidden=4)
    cfg["data"]["synthetic"] = {"train": 12, "dev": 6, "test": 6, "seed": 7, "vocab": 30}
    cfg["train"].update({"epochs": 1, "batch_size": 6, "dtype": "float64", "early_stopping": None})
    (home / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    for d in ("rank0", "rank1", "alone"):
        (home / d).mkdir()
    job = run_job(launcher, home, "train", str(home / "tiny.yaml"), "--run-dir", "run")
    alone = run_alone(home, "train", str(home / "tiny.yaml"), "--run-dir", "run")
    return home, job, alone


def input_file(home: Path) -> str:
    """Trees to predict, in rank 0's directory (and the single process's) only: rank 0 reads the input."""
    for d in ("rank0", "alone"):
        (home / d / "in.txt").write_text("\n".join(TREES) + "\n")
    return "in.txt"


def test_train(trained):
    home, job, alone = trained
    same(job, alone, untimed)
    assert untimed(job.stdout).count("epoch 1/1:") == 1
    assert written(home)["rank1"] == []


def test_eval(launcher, trained):
    home, _, _ = trained
    run = str(home / "rank0" / "run")
    same(run_job(launcher, home, "eval", run), run_alone(home, "eval", run), untimed)


@pytest.mark.parametrize("flags", [[], ["--json"]], ids=["text", "json"])
def test_predict(launcher, trained, flags):
    """Five trees, shards of 3 and 2: every row once, in input order (the input named by its relative path,
    which rank 0 alone can read, and by its absolute path, which both ranks could read)."""
    home, _, _ = trained
    path = input_file(home) if flags else str(home / "rank0" / input_file(home))
    args = ["predict", str(home / "rank0" / "run"), path, *flags]
    job, alone = run_job(launcher, home, *args), run_alone(home, *args)
    same(job, alone)
    assert len(job.stdout.splitlines()) == 5


def test_predict_to_a_file(launcher, trained):
    """``-o FILE``: written by rank 0 alone (rank 1's directory stays empty), as one process writes it."""
    home, _, _ = trained
    args = ["predict", str(home / "rank0" / "run"), input_file(home), "--json", "-o", "out.jsonl"]
    job, alone = run_job(launcher, home, *args), run_alone(home, *args)
    assert job.returncode == 0 and alone.returncode == 0, job.stderr[-3000:] + alone.stderr[-3000:]
    assert job.stdout == "" and job.stderr == ""
    got = (home / "rank0" / "out.jsonl").read_text()
    assert len(got.splitlines()) == 5 and got == (home / "alone" / "out.jsonl").read_text()
    assert written(home)["rank1"] == [] and "out.jsonl" in written(home)["rank0"]


def test_show(launcher, trained):
    home, _, _ = trained
    args = ["show", str(home / "tiny.yaml"), "--out", "graphs", "--format", ""]
    same(run_job(launcher, home, *args), run_alone(home, *args))
    assert written(home)["rank1"] == []
    assert [f for f in written(home)["rank0"] if f.startswith("graphs")] == \
        [f for f in written(home)["alone"] if f.startswith("graphs")]


def test_plot(launcher, trained):
    home, _, _ = trained
    run = str(home / "rank0" / "run")
    same(run_job(launcher, home, "plot", run, "-o", "curves.png"), run_alone(home, "plot", run, "-o", "curves.png"))
    assert written(home)["rank1"] == [] and (home / "rank0" / "curves.png").stat().st_size > 0


ERRORS = {"a bad input line": (["predict", "RUN", "bad.txt"], "minicavs predict: error: bad.txt:2"),
          "not a run dir": (["eval", "nowhere"], "minicavs eval: error: nowhere is not a run dir"),
          "a run dir in use": (["train", "CONFIG", "--run-dir", "run"], "minicavs train: error: run dir run already"),
          "a usage error": (["eval", "RUN", "--split", "nope"], "minicavs eval: error: argument --split")}


@pytest.mark.parametrize("case", ERRORS)
def test_an_error_is_said_once(launcher, trained, case):
    """An error every rank meets (rank 0 found it and told the others, or the same command line): one
    line, exit 2, no rank aborting the others."""
    home, _, _ = trained
    (home / "rank0" / "bad.txt").write_text("(3 (2 a) (2 b))\n(3 (2 a)\n")
    args, said = ERRORS[case]
    where = {"RUN": str(home / "rank0" / "run"), "CONFIG": str(home / "tiny.yaml")}
    job = run_job(launcher, home, *[where.get(a, a) for a in args])
    assert job.returncode == 2 and job.stdout == ""
    assert job.stderr.count(said) == 1 and job.stderr.count("error:") == 1, job.stderr
    assert "MPI_ABORT" not in job.stderr


FAIL_ON_RANK_1 = """
import sys
from minicavs.core.errors import DataError
from minicavs.train import cli, distributed, predict
def predict_samples(task, numbered, batch_size=64):
    if distributed.world().rank == 1:
        raise DataError("rank 1's shard cannot be predicted")
    return original(task, numbered, batch_size)
original, predict.predict_samples = predict.predict_samples, predict_samples
sys.exit(cli.main(sys.argv[1:]))
"""


def test_an_error_on_rank_1_surfaces(launcher, trained):
    """Rank 1 fails while rank 0 waits for its rows: rank 0 says so, naming rank 1, and the job ends non-zero."""
    home, _, _ = trained
    wdir = "--wdir" if "--oversubscribe" in launcher else "-wdir"
    job = subprocess.run(launcher + ["-n", "2", wdir, str(home / "rank0"), sys.executable, "-c", FAIL_ON_RANK_1,
                                     "predict", str(home / "rank0" / "run"), input_file(home)],
                         capture_output=True, text=True, env={**mpi_env(), "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    assert job.returncode != 0 and job.stdout == ""
    assert job.stderr.count("rank 1 of 2: rank 1's shard cannot be predicted") == 1, job.stderr
