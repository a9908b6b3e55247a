"""Data-parallel training under a real ``mpirun`` (2 and 3 processes) against a single process.

Needs mpi4py and an MPI launcher (``pip install '.[mpi]'``: mpi4py and Open MPI from PyPI). Without them these
tests are skipped, except in CI (``CI=true``), where they must run. Open MPI refuses to run as root unless
OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set, and needs ``--oversubscribe`` for more
processes than cores; :func:`mpirun` does both."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from minicavs.train import checkpoint
from minicavs.train.distributed import shard
from minicavs.train.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]   # the checkout: the ranks run python -m from it
TOL = {"float32": 1e-5, "float64": 1e-10}
SMALL = ["model.hidden=6", "model.embed=4", "train.batch_size=5", "train.epochs=1"]
DATA = ["data.synthetic.train=12", "data.synthetic.dev=7"]
# Every bundled model, 12 training samples in batches of 5, 5, 2: with 3 ranks the last batch leaves one
# rank without a sample. Dropout as the models have it (0.2; Tree-FC has none).
MODELS = {"tree_lstm": ("tree_lstm", SMALL + DATA + ["data.synthetic.test=2"]),
          "tree_lstm_child_sum": ("tree_lstm", SMALL + DATA + ["data.synthetic.test=2", "model.variant=child_sum"]),
          "var_lstm": ("var_lstm", SMALL + DATA + ["data.synthetic.test=2"]),
          "fixed_lstm": ("fixed_lstm", SMALL + ["model.window=6", "data.synthetic.train=6", "data.synthetic.dev=3",
                                                "data.synthetic.test=2"]),
          "tree_fc": ("tree_fc", ["model.hidden=6", "model.leaves=4", "train.batch_size=5", "train.epochs=1"]
                      + DATA)}


def find_mpirun() -> tuple[list[str] | None, str]:
    """The launcher command (with --oversubscribe for Open MPI), or None and why not."""
    if importlib.util.find_spec("mpi4py") is None:   # not imported: MPI is initialised in the ranks, not here
        return None, "mpi4py is not installed: pip install '.[mpi]'"
    exe = shutil.which("mpirun") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if exe is None:
        return None, "no mpirun on PATH: pip install '.[mpi]' installs Open MPI with it"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    return [exe] + (["--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []), ""


MPIRUN, WHY = find_mpirun()


@pytest.fixture(scope="module")
def launcher():
    if MPIRUN is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the MPI tests: {WHY}")
        pytest.skip(WHY)
    return MPIRUN


def mpi_env() -> dict:
    return {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_rmaps_base_oversubscribe": "1", "PYTHONUNBUFFERED": "1",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def mpirun(launcher, n: int, args: list[str], timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``mpirun -n N python ARGS`` from the repository root (``python -m`` imports this checkout)."""
    return subprocess.run(launcher + ["-n", str(n), sys.executable] + args, cwd=REPO_ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=timeout, **kw)


def trainer(module: str, overrides, run_dir) -> Trainer:
    return Trainer(REPO_ROOT / "models" / f"{module}.yaml", overrides, run_dir=run_dir, comm=None)


def close(got, want, dtype, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert err <= TOL[dtype] * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0), (what, err)


def metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "timing"} for r in rows]


def run_worker(launcher, n: int, cases: list[dict], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "cases": cases}))
    proc = mpirun(launcher, n, ["-m", "tests.distributed_worker", str(spec)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r: json.loads((out / f"report-{r}.json").read_text()) for r in range(n)}


def check_against_one_process(case: dict, out: Path, tmp_path: Path, reports: dict) -> None:
    dtype = "float32" if "train.dtype=float32" in case["overrides"] else "float64"
    ref = trainer(case["module"], case["overrides"], tmp_path / "ref" / case["name"])
    want = metrics_of(ref)
    ck = checkpoint.read(out / case["name"] / "last.npz")
    assert ck.step == ref.optimizer.steps >= 3, case["name"]
    for name, p in ref.params.items():
        close(ck.params[name], p.value, dtype, f"{case['name']}: parameter {name}")
    for name, slots in ref.optimizer.state.items():
        for s, a in slots.items():
            close(ck.optimizer["slots"][name][s], a, dtype, f"{case['name']}: slot {s} of {name}")
    (got,) = metrics(out / case["name"])
    assert got.keys() == want.keys()
    for k, v in want.items():
        close(got[k], v, dtype, f"{case['name']}: metric {k}")
    assert all(r[case["name"]]["steps"] == ck.step for r in reports.values())


def metrics_of(t: Trainer) -> dict:
    (row,) = t.fit(progress=False, log=lambda s: None)
    return {k: v for k, v in row.items() if k != "timing"}


def test_shards_cover_the_batch_in_order():
    for n in range(0, 9):
        for size in (1, 2, 3, 5):
            parts = [shard(list(range(n)), r, size) for r in range(size)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_two_ranks_equal_one_process(launcher, tmp_path):
    """2 ranks on every bundled model in float64 and float32 (dropout on), each row-sparse path forced (lazy
    Adam updates, so the rows each path reports as looked up matter), the model on the emulated CUDA device,
    a naive cell on planned parameter buffers, and the digest probe: the same parameters, slots and metrics as
    one process on the whole batches."""
    out = tmp_path / "two"
    cases = []
    for model, (module, overrides) in MODELS.items():
        for dtype in ("float64", "float32"):
            cases.append({"name": f"{model}-{dtype}", "module": module,
                          "overrides": overrides + [f"train.dtype={dtype}"]})
    lazy = MODELS["tree_lstm"][1] + ["train.dtype=float64", "train.optimizer=adam", "train.sparse_updates=true"]
    for path in ("allgather", "allreduce"):
        cases.append({"name": f"sparse-{path}", "module": "tree_lstm",
                      "overrides": lazy + [f"train.distributed.sparse={path}"]})
    cases.append({"name": "emulated-cuda", "module": "tree_lstm", "overrides": MODELS["tree_lstm"][1]
                  + ["train.dtype=float64"], "emulated": True})
    cases.append({"name": "digest", "module": "tree_lstm", "overrides": MODELS["tree_lstm"][1],
                  "digest_probe": "W_o"})
    # a naive cell's parameters laid out as views of planned buffers: still reduced and updated per parameter
    cases.append({"name": "planned-buffers", "module": "var_lstm", "overrides": MODELS["var_lstm"][1]
                  + ["model.cell=naive", "train.engine.plan_layout=true", "train.dtype=float64",
                     "train.optimizer=adam"]})
    reports = run_worker(launcher, 2, cases, out)
    for case in cases:
        if case.get("digest_probe"):
            continue
        check_against_one_process(case, out, tmp_path, reports)
    for path, other in (("allgather", "allreduce"), ("allreduce", "allgather")):
        taken = reports[0][f"sparse-{path}"]["sparse_paths"]
        assert taken[path] == 3 and taken[other] == 0, taken
    for r in (0, 1):
        err = reports[r]["digest"]["error"]
        assert err and "parameter 'W_o' differs on rank(s) [1]" in err, err


def test_three_ranks_on_batches_that_do_not_divide(launcher, tmp_path):
    """Batches of 5, 5, 2 over 3 ranks (shards 2+2+1, then 1+1+0: a rank with nothing to do), every model; and
    3 ranks resuming a run one process began."""
    out = tmp_path / "three"
    cases = [{"name": model, "module": module, "overrides": overrides + ["train.dtype=float64"]}
             for model, (module, overrides) in MODELS.items()]
    # --resume on 3 ranks from a checkpoint one process wrote after epoch 1, to epoch 2
    module, overrides = MODELS["tree_lstm"]
    resume = {"name": "resume", "module": module, "overrides": overrides + ["train.dtype=float64"], "epochs": 2,
              "resume": True}
    trainer(module, resume["overrides"], out / "resume").fit(progress=False, log=lambda s: None)
    reports = run_worker(launcher, 3, cases + [resume], out)
    for case in cases:
        check_against_one_process(case, out, tmp_path, reports)
    straight = trainer(module, resume["overrides"], tmp_path / "straight")
    straight.fit(2, progress=False, log=lambda s: None)
    ck = checkpoint.read(out / "resume" / "last.npz")
    assert ck.step == straight.optimizer.steps == 6 and ck.extra["epoch"] == 2
    for name, p in straight.params.items():
        close(ck.params[name], p.value, "float64", f"resumed on 3 ranks: {name}")
    got, want = metrics(out / "resume"), metrics(tmp_path / "straight")
    assert [r["epoch"] for r in got] == [1, 2]
    for k, v in want[-1].items():
        close(got[-1][k], v, "float64", f"resumed on 3 ranks: metric {k}")


def tiny_config(tmp_path, epochs: int) -> Path:
    cfg = yaml.safe_load((REPO_ROOT / "models" / "tree_lstm.yaml").read_text())
    cfg["model"].update(name=str(REPO_ROOT / "models" / "tree_lstm.py"), embed=8, hidden=8)
    cfg["data"]["synthetic"] = {"train": 400, "dev": 40, "test": 20, "seed": 7, "vocab": 60}
    cfg["train"].update({"epochs": epochs, "batch_size": 16, "dtype": "float64", "early_stopping": None})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_configs_that_differ_across_ranks_are_refused(launcher, tmp_path):
    config = str(tiny_config(tmp_path, 1))
    train = ["-m", "minicavs", "train", config, "--run-dir", str(tmp_path / "run"), "--no-progress"]
    proc = subprocess.run(launcher + ["-n", "1", sys.executable] + train + ["--set", "train.lr=0.05", ":",
                                                                           "-n", "1", sys.executable] + train
                          + ["--set", "train.lr=0.1"], cwd=REPO_ROOT, env=mpi_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert "configs differ" in proc.stderr and "train.lr: ranks 0 have 0.05; ranks 1 have 0.1" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "run" / "last.npz").exists()


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of MPI rank ``rank`` among the launcher's descendants (its environment says its rank)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    for pid in parents:
        p = pid
        while p in parents and p != launcher_pid:
            p = parents[p]
        if p != launcher_pid or pid == launcher_pid:
            continue
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in env or f"PMI_RANK={rank}".encode() in env:
            if b"minicavs" in Path(f"/proc/{pid}/cmdline").read_bytes():   # the rank, not a helper
                return pid
    return None


def signal_rank_after_first_epoch(launcher, config: Path, run: Path, sig: int, extra=()) -> tuple:
    """``mpirun -n 2 minicavs train`` until the first checkpoint, then ``sig`` to rank 1's process. Returns
    (seconds from the signal to the job's end, exit status, stdout, stderr); rank 1 never outlives the test."""
    cmd = launcher + ["-n", "2", sys.executable, "-m", "minicavs", "train", str(config), "--run-dir", str(run),
                      "--no-progress", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    victim = None
    try:
        deadline = time.monotonic() + 240
        while not (run / "last.npz").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        victim = rank_pid(proc.pid, 1)
        assert victim is not None, "rank 1's process not found"
        os.kill(victim, sig)
        sent = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
        return time.monotonic() - sent, proc.returncode, stdout, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)


needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds a rank's process in /proc")


@needs_proc
def test_a_killed_rank_ends_the_job_and_resume_continues(launcher, tmp_path):
    """Rank 1 is killed (SIGKILL) during epoch 2 of 4: the job ends non-zero within 60 s naming rank 1, the
    epoch-1 checkpoint is intact, and one process resuming from it ends where an uninterrupted run does."""
    config = tiny_config(tmp_path, 4)
    run = tmp_path / "run"
    seconds, status, stdout, stderr = signal_rank_after_first_epoch(launcher, config, run, signal.SIGKILL)
    assert status != 0 and seconds < 60
    assert "rank 1" in stderr, stderr[-3000:]
    ck = checkpoint.read(run / "last.npz")        # intact: a whole checkpoint of a finished epoch
    assert ck.extra["epoch"] in (1, 2, 3), ck.extra
    assert "epoch 4 " not in stdout               # killed mid-run, not after it
    resumed = Trainer(config, run_dir=run, comm=None)
    resumed.fit(resume=True, progress=False, log=lambda s: None)
    straight = Trainer(config, run_dir=tmp_path / "straight", comm=None)
    straight.fit(progress=False, log=lambda s: None)
    assert resumed.optimizer.steps == straight.optimizer.steps
    for name, p in straight.params.items():
        close(resumed.params[name].value, p.value, "float64", name)
    assert metrics(run)[-1]["dev_loss"] == pytest.approx(metrics(tmp_path / "straight")[-1]["dev_loss"], rel=1e-10)


@needs_proc
def test_a_hung_rank_trips_the_watchdog(launcher, tmp_path):
    """Rank 1 stopped (SIGSTOP: alive, so the launcher sees nothing): rank 0's collective times out after
    train.distributed.timeout seconds, it says so and ends, and the launcher ends the job."""
    run = tmp_path / "run"
    seconds, status, _, stderr = signal_rank_after_first_epoch(launcher, tiny_config(tmp_path, 4), run,
                                                              signal.SIGSTOP, ["--set", "train.distributed.timeout=5"])
    assert status != 0 and 5 <= seconds < 60
    assert "rank 0 of 2" in stderr and "waited more than 5 s" in stderr, stderr[-3000:]
    checkpoint.read(run / "last.npz")


def test_a_run_dir_on_rank_0_alone(launcher, tmp_path):
    """Ranks in different working directories, so a relative --run-dir exists for rank 0 alone (the README
    allows a run dir on rank 0's machine only): every decision before a collective is rank 0's, so training,
    ``--resume`` (naming the config or the run dir) and ``eval RUN_DIR`` work, rank 1 writes nothing, and the
    run ends where one process ends."""
    cfg = yaml.safe_load((REPO_ROOT / "models" / "tree_lstm.yaml").read_text())
    cfg["model"].update(name=str(REPO_ROOT / "models" / "tree_lstm.py"), embed=4, hidden=4)
    cfg["data"]["synthetic"] = {"train": 24, "dev": 12, "test": 12, "seed": 7, "vocab": 30}
    cfg["train"].update({"epochs": 2, "batch_size": 8, "dtype": "float64", "early_stopping": None})
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(cfg))
    homes = [tmp_path / "rank0", tmp_path / "rank1"]
    for home in homes:
        home.mkdir()
    wdir = "--wdir" if "--oversubscribe" in launcher else "-wdir"   # Open MPI / MPICH's Hydra

    def job(*args: str) -> subprocess.CompletedProcess:
        contexts = [[":"] * (r > 0) + ["-n", "1", wdir, str(home), sys.executable, "-m", "minicavs", *args]
                    for r, home in enumerate(homes)]
        proc = subprocess.run(launcher + [a for c in contexts for a in c], capture_output=True, text=True,
                              env={**mpi_env(), "PYTHONPATH": str(REPO_ROOT)}, timeout=300)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
        return proc

    job("train", str(config), "--run-dir", "run", "--no-progress")
    run = homes[0] / "run"
    assert [r["epoch"] for r in metrics(run)] == [1, 2] and (run / "results.json").exists()
    job("train", str(config), "--run-dir", "run", "--resume", "--set", "train.epochs=3", "--no-progress")
    job("train", "run", "--resume", "--set", "train.epochs=4", "--no-progress")
    assert [r["epoch"] for r in metrics(run)] == [1, 2, 3, 4]
    assert "run/best.npz: test_loss" in job("eval", "run").stdout
    assert list(homes[1].iterdir()) == []                           # rank 1 wrote nothing anywhere
    straight = Trainer(config, ["train.epochs=4"], run_dir=tmp_path / "straight", comm=None)
    straight.fit(progress=False, log=lambda s: None)
    ck = checkpoint.read(run / "last.npz")
    assert ck.step == straight.optimizer.steps
    for name, p in straight.params.items():
        close(ck.params[name], p.value, "float64", f"run dir on rank 0 alone: {name}")
