"""Run dirs survive a crash at any instant: a failure injected at every write, flush, fsync, rename and file
creation of a run, then ``--resume``, ends with the same files (parameters, optimizer state, metrics, best
checkpoint, results) as an uninterrupted run; and the repairs resume makes by itself."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from minicavs.train import checkpoint
from minicavs.train.cli import main
from minicavs.train.rundir import RunDir

MODELS = Path(__file__).resolve().parents[2] / "models"


def tiny_config(tmp_path) -> Path:
    """4 epochs of a tiny Tree-LSTM whose dev root accuracy improves at epochs 1 and 2, not at 3 and 4
    (early stopping with patience 2 ends it after epoch 4): every branch of an epoch's end is taken."""
    cfg = yaml.safe_load((MODELS / "tree_lstm.yaml").read_text())
    cfg["model"].update(embed=4, hidden=4)
    cfg["data"]["synthetic"] = {"train": 24, "dev": 12, "test": 12, "seed": 7, "vocab": 30}
    cfg["train"].update(epochs=6, batch_size=8, lr=0.3, seed=1,
                        early_stopping={"metric": "dev_root_acc", "mode": "max", "patience": 2})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Crash(BaseException):
    """The process dies here (not an Exception: nothing in minicavs may catch it)."""


class Injector:
    """Counts the file operations on a run dir; the k-th raises Crash, and so does every later one (a dead
    process does no more I/O, not even the cleanup in its exception handlers)."""

    def __init__(self, run_dir: Path, k: int | None = None):
        self.run_dir, self.k = str(run_dir.resolve()), k
        self.calls: list[str] = []
        self.dead = False
        self.fds: set = set()

    def ours(self, path) -> bool:
        return os.path.abspath(os.fspath(path)).startswith(self.run_dir)

    def hit(self, what: str) -> None:
        if self.dead:
            raise Crash(f"dead: {what}")
        self.calls.append(what)
        if len(self.calls) == self.k:
            self.dead = True
            raise Crash(f"injected at {what} (call {self.k})")

    def install(self, monkeypatch) -> None:
        real = {name: getattr(os, name) for name in ("open", "fdopen", "fsync", "replace", "unlink")}
        inj = self

        class File:
            def __init__(self, f):
                self.f = f

            def write(self, data):
                inj.hit("write")
                return self.f.write(data)

            def flush(self):
                inj.hit("flush")
                return self.f.flush()

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.__exit__(*exc)

        def open_(path, flags, *args, **kw):
            if not self.ours(path):
                return real["open"](path, flags, *args, **kw)
            self.hit(f"open {os.path.basename(path)}")
            fd = real["open"](path, flags, *args, **kw)
            self.fds.add(fd)
            return fd

        def fdopen(fd, *args, **kw):
            f = real["fdopen"](fd, *args, **kw)
            return File(f) if fd in self.fds else f

        def fsync(fd):
            if fd in self.fds:   # counted and injected; not paid for (durability is the disk's, order is ours)
                self.hit("fsync")
                return None
            return real["fsync"](fd)

        def replace(src, dst, **kw):
            if self.ours(dst):
                self.hit(f"rename to {os.path.basename(dst)}")
            return real["replace"](src, dst, **kw)

        def unlink(path, **kw):
            if self.ours(path) and self.dead:
                raise Crash("dead: unlink")
            return real["unlink"](path, **kw)

        for name, fn in (("open", open_), ("fdopen", fdopen), ("fsync", fsync), ("replace", replace),
                         ("unlink", unlink)):
            monkeypatch.setattr(os, name, fn)


def train(cfg, run_dir, *extra) -> int:
    return main(["train", str(cfg), "--run-dir", str(run_dir), "--no-progress", *extra])


def state(run_dir: Path) -> dict:
    """Everything a run dir holds, timings left out (they differ between any two runs)."""
    def untimed(rows):
        return [{k: v for k, v in r.items() if k != "timing"} for r in rows]

    out = {"files": sorted(os.listdir(run_dir)), "config": (run_dir / "config.yaml").read_text(),
           "metrics": untimed(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()),
           "results": untimed([json.loads((run_dir / "results.json").read_text())])}
    for name in ("last.npz", "best.npz"):
        ck = checkpoint.read(run_dir / name)
        extra = dict(ck.extra, history=untimed(ck.extra["history"]))
        out[name] = (ck.step, extra, {k: v.tobytes() for k, v in ck.params.items()},
                     {k: {s: a.tobytes() for s, a in slots.items()} for k, slots in ck.optimizer["slots"].items()})
    return out


def test_a_crash_at_every_write_then_resume_ends_as_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    cfg = tiny_config(tmp_path)
    reference = tmp_path / "reference"
    counter = Injector(reference)
    with monkeypatch.context() as m:
        counter.install(m)
        assert train(cfg, reference) == 0
    expected = state(reference)
    assert [r["epoch"] for r in expected["metrics"]] == [1, 2, 3, 4]        # early stopping after epoch 4
    assert expected["last.npz"][1]["early_stopping"]["best_epoch"] == 2
    assert "early stopping: dev_root_acc has not improved for 2 epochs" in capsys.readouterr().out
    points = len(counter.calls)
    kinds = {c.split()[0] for c in counter.calls}
    assert kinds == {"open", "write", "flush", "fsync", "rename"}
    # per file: create the temporary, write, flush, fsync, rename, open and fsync the directory; files:
    # config.yaml, 4 x (last.npz, metrics.jsonl), best.npz at epochs 1 and 2, results.json
    assert points == 7 * (1 + 4 + 4 + 2 + 1)
    restarted = 0
    for k in range(1, points + 1):
        run_dir = tmp_path / f"crash{k}"
        with monkeypatch.context() as m:
            Injector(run_dir, k).install(m)
            with pytest.raises(Crash):
                train(cfg, run_dir)
        capsys.readouterr()
        code = train(cfg, run_dir, "--resume")
        if code == 2:   # the crash came before the first commit: nothing to resume, said so
            err = capsys.readouterr().err
            assert "cannot resume" in err and "start a fresh run without --resume" in err, err
            assert not (run_dir / "last.npz").exists()
            code = train(cfg, run_dir, "--force")
            restarted += 1
        assert code == 0, (k, counter.calls[k - 1], capsys.readouterr().err)
        assert state(run_dir) == expected, (k, counter.calls[k - 1])
    assert 0 < restarted < points


def test_readers_see_the_best_checkpoint_at_every_instant(tmp_path, monkeypatch):
    """Between the commit of a new best epoch and the write of best.npz, the best state is last.npz's."""
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    calls = Injector(run_dir)
    with monkeypatch.context() as m:
        calls.install(m)
        assert train(cfg, run_dir, "--epochs", "2") == 0
    k = [i for i, c in enumerate(calls.calls, 1) if c.startswith("open .best.npz")][1]   # epoch 2: best.npz
    crashed = tmp_path / "crashed"
    with monkeypatch.context() as m:
        Injector(crashed, k).install(m)
        with pytest.raises(Crash):
            train(cfg, crashed, "--epochs", "2")
    run = RunDir(crashed)
    assert checkpoint.read(run.best).extra["epoch"] == 1
    assert checkpoint.read(run.last).extra["early_stopping"]["best_epoch"] == 2
    assert run.best_checkpoint() == run.last
    assert main(["eval", str(crashed), "--split", "dev"]) == 0


def test_resume_repairs_a_torn_metrics_line_and_removes_temporaries(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    assert train(cfg, run_dir, "--epochs", "2") == 0
    good = (run_dir / "metrics.jsonl").read_text()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 3, "train_lo')          # a full disk tore the last line
    (run_dir / ".last.npz.123.abcd.tmp").write_bytes(b"PK\x03\x04 half")
    capsys.readouterr()
    assert train(cfg, run_dir, "--resume", "--epochs", "2") == 0
    out = capsys.readouterr().out
    assert "removed .last.npz.123.abcd.tmp" in out and "rewrote metrics.jsonl (2 epochs)" in out
    assert (run_dir / "metrics.jsonl").read_text() == good
    assert not any(name.endswith(".tmp") for name in os.listdir(run_dir))
    assert train(cfg, run_dir, "--resume", "--epochs", "3") == 0
    assert [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_resume_without_a_checkpoint_is_an_error_that_says_how_to_start(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    assert train(cfg, tmp_path / "none", "--resume") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot resume: run dir" in err and "does not exist" in err
    assert "start a fresh run without --resume" in err
    assert not (tmp_path / "none").exists()          # nothing written


def test_a_new_run_never_overwrites_an_old_one(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    assert train(cfg, run_dir, "--epochs", "1") == 0
    before = {name: (run_dir / name).read_bytes() for name in os.listdir(run_dir)}
    capsys.readouterr()
    assert train(cfg, run_dir, "--epochs", "1") == 2
    err = capsys.readouterr().err
    assert "already holds a run (epoch 1 of 6)" in err and "--resume" in err and "--force" in err
    assert {name: (run_dir / name).read_bytes() for name in os.listdir(run_dir)} == before
    (run_dir / "notes.txt").write_text("mine")
    assert train(cfg, run_dir, "--epochs", "2", "--force") == 0
    assert (run_dir / "notes.txt").read_text() == "mine"   # --force deletes the run's own files only
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def test_resume_refuses_changes_to_what_is_trained(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    assert train(cfg, run_dir, "--epochs", "1") == 0
    capsys.readouterr()
    assert train(cfg, run_dir, "--resume", "--set", "model.hidden=5") == 2
    assert "cannot change model.hidden (5, the run has 4)" in capsys.readouterr().err
    before = (run_dir / "last.npz").read_bytes()
    assert main(["train", str(run_dir), "--resume", "--set", "train.epochs=2", "--no-progress"]) == 0
    assert (run_dir / "last.npz").read_bytes() != before
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["epochs"] == 2


def test_only_the_runs_own_temporaries_are_removed(tmp_path):
    from minicavs.core import atomic
    for name in (".last.npz.1.ab.tmp", ".metrics.jsonl.2.cd.tmp", ".notes.txt.tmp", "last.npz.tmp", ".x.tmp"):
        (tmp_path / name).write_text("")
    assert atomic.remove_temporaries(tmp_path, ("last.npz", "metrics.jsonl")) == [".last.npz.1.ab.tmp",
                                                                                   ".metrics.jsonl.2.cd.tmp"]
    assert sorted(os.listdir(tmp_path)) == [".notes.txt.tmp", ".x.tmp", "last.npz.tmp"]


def test_without_dev_data_the_latest_epoch_is_the_best(tmp_path):
    cfg = tiny_config(tmp_path)     # early stopping on dev_root_acc, patience 2: inert without dev data
    run_dir = tmp_path / "run"
    assert train(cfg, run_dir, "--epochs", "3", "--set", "data.dev=null") == 0
    assert checkpoint.read(run_dir / "best.npz").extra["epoch"] == 3
    results = json.loads((run_dir / "results.json").read_text())
    assert results["epoch"] == 3 and "test_loss" in results and "dev_loss" not in results


@contextlib.contextmanager
def _holder(run_dir: Path):
    """Another process holding ``run_dir``'s writer lock until it is killed (SIGKILL: a crash, no cleanup
    in the holder) when the block ends."""
    code = ("import sys; from minicavs.train.rundir import RunDir; run = RunDir(sys.argv[1]); run.lock(); "
            "print('held', flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2]) as proc:
        try:
            assert proc.stdout.readline().strip() == "held"
            yield proc
        finally:
            proc.kill()


def test_a_second_process_cannot_write_into_a_run_dir_in_use(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    assert train(cfg, run_dir, "--epochs", "1") == 0
    before = {name: (run_dir / name).read_bytes() for name in os.listdir(run_dir) if name != ".lock"}
    with _holder(run_dir) as holder:
        capsys.readouterr()
        for extra in (("--epochs", "2", "--resume"), ("--epochs", "1", "--force")):
            assert train(cfg, run_dir, *extra) == 2
            err = capsys.readouterr().err
            assert f"is in use by another minicavs process (pid {holder.pid})" in err
            assert {name: (run_dir / name).read_bytes() for name in os.listdir(run_dir)
                    if name != ".lock"} == before                # refused before any write
    assert train(cfg, run_dir, "--epochs", "2", "--resume") == 0   # the kernel dropped the dead holder's lock
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_lock_is_released_when_training_ends(tmp_path):
    from minicavs.train.trainer import Trainer
    cfg = tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    first = Trainer(str(cfg), ["train.epochs=1"], run_dir=run_dir)
    first.fit(progress=False, log=lambda _: None)
    first.final_results(log=lambda _: None)
    again = Trainer.resuming(run_dir, ["train.epochs=2"])    # the same process, while `first` still lives
    again.fit(resume=True, progress=False, log=lambda _: None)
    with _holder(run_dir):                                  # and another process can take it too
        pass


# --- tampered checkpoints: refused by eval, predict and --resume, with every file of the run dir unchanged ---

def tiny_config_of(tmp_path, model: str) -> Path:
    """:func:`tiny_config` for another bundled tree model (the same synthetic data, so the same vocabulary)."""
    cfg = yaml.safe_load(tiny_config(tmp_path).read_text())
    cfg["model"] = {**yaml.safe_load((MODELS / f"{model}.yaml").read_text())["model"], "embed": 4, "hidden": 4}
    path = tmp_path / f"tiny_{model}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def files_of(run_dir: Path) -> dict:
    """Every file of a run dir (the lock file included): its bytes and modification time."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.iterdir())}


def rewrite_arrays(path: Path, edit) -> None:
    """Change a checkpoint's parameter arrays behind minicavs' back, keeping the metadata consistent (the
    shapes it records follow the arrays): only the values or the shapes are wrong, not the file."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["__meta__"].tobytes().decode())
    for entry in meta["params"]:
        arrays[entry["key"]] = edit(entry["name"], arrays[entry["key"]])
        entry["shape"] = list(arrays[entry["key"]].shape)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _poison(value):
    def edit(name, a):
        if name == "E":    # the embedding table: every model's first lookup
            a = a.copy()
            a.flat[::3] = value
        return a
    return edit


TAMPERS = {
    "another model": None,    # the same file of a Tree-GRU run of the same data (vocabulary and epoch)
    "NaN": _poison(np.nan),
    "inf": _poison(np.inf),
    "-inf": _poison(-np.inf),
    "wrong shape": lambda name, a: np.concatenate([a, a[:1]]) if name == "E" else a,
}
EXPECTED = {"another model": r"holds a tree_gru model, but run dir .* is a run of another model: its "
                             r"(config.yaml names|last.npz holds) a tree_lstm model",
            "NaN": r"parameter 'E' holds non-finite values \(\d+ NaN, of \d+\)",
            "inf": r"parameter 'E' holds non-finite values \(\d+ infinite, of \d+\)",
            "-inf": r"parameter 'E' holds non-finite values \(\d+ infinite, of \d+\)",
            "wrong shape": r"parameter 'E' is float32\(\d+, 4\) in the checkpoint, float32\(\d+, 4\) in the model"}
# each command and the files of the run dir it loads
COMMANDS = {"eval": ["best.npz"], "predict": ["best.npz"], "resume": ["last.npz", "best.npz"],
            "resume naming its config": ["last.npz", "best.npz"]}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """One epoch of a tiny Tree-LSTM and of a tiny Tree-GRU on the same data (each file epoch 1, the best)."""
    tmp = tmp_path_factory.mktemp("two_runs")
    cfg, gru_cfg = tiny_config(tmp), tiny_config_of(tmp, "tree_gru")
    assert train(cfg, tmp / "lstm", "--epochs", "1") == 0
    assert train(gru_cfg, tmp / "gru", "--epochs", "1") == 0
    (tmp / "trees.txt").write_text("(3 (2 good) (2 film))\n")
    return tmp, cfg


def run_command(command: str, run_dir: Path, cfg: Path, inputs: Path) -> int:
    if command == "eval":
        return main(["eval", str(run_dir)])
    if command == "predict":
        return main(["predict", str(run_dir), str(inputs), "-o", str(run_dir / "predictions.txt")])
    named = [str(cfg), "--run-dir", str(run_dir)] if command == "resume naming its config" else [str(run_dir)]
    return main(["train", *named, "--resume", "--set", "train.epochs=2", "--no-progress"])


@pytest.mark.parametrize("tamper", list(TAMPERS))
@pytest.mark.parametrize("command, target", [(c, f) for c, files in COMMANDS.items() for f in files])
def test_a_tampered_checkpoint_is_refused_and_changes_nothing(two_runs, tmp_path, capsys, command, target, tamper):
    runs, cfg = two_runs
    run_dir = tmp_path / "run"
    shutil.copytree(runs / "lstm", run_dir)
    if tamper == "another model":
        shutil.copyfile(runs / "gru" / target, run_dir / target)
    else:
        rewrite_arrays(run_dir / target, TAMPERS[tamper])
    before = files_of(run_dir)
    capsys.readouterr()
    assert run_command(command, run_dir, cfg, runs / "trees.txt") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run_dir / target}" in err, err
    assert re.search(EXPECTED[tamper], err), err
    assert files_of(run_dir) == before


def test_resume_naming_another_models_config_is_refused(two_runs, tmp_path, capsys):
    runs, _ = two_runs
    run_dir = tmp_path / "run"
    shutil.copytree(runs / "lstm", run_dir)
    before = files_of(run_dir)
    capsys.readouterr()
    assert train(tiny_config_of(tmp_path, "tree_gru"), run_dir, "--resume") == 2
    err = capsys.readouterr().err
    assert "tiny_tree_gru.yaml configures a tree_gru model, but run dir" in err
    assert "holds a tree_lstm run (its last.npz)" in err and f"minicavs train {run_dir} --resume" in err
    assert files_of(run_dir) == before


def test_the_untampered_copy_passes_every_command(two_runs, tmp_path, capsys):
    """The counterpart of the tampered cases: the same commands on the untouched copy succeed."""
    runs, cfg = two_runs
    for command in COMMANDS:
        run_dir = tmp_path / command.replace(" ", "_")
        shutil.copytree(runs / "lstm", run_dir)
        assert run_command(command, run_dir, cfg, runs / "trees.txt") == 0, capsys.readouterr().err


# --- early stopping is when to stop: a resumed run says why it trains nothing, and trains on when told ---

def untimed_state(run_dir: Path) -> tuple:
    """The metric rows and every parameter of a run's last.npz, timings left out."""
    rows = [{k: v for k, v in json.loads(line).items() if k != "timing"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, {k: v.tobytes() for k, v in checkpoint.read(run_dir / "last.npz").params.items()}


@pytest.mark.parametrize("go_on", [["train.early_stopping.patience=10"], ["train.early_stopping=null"]])
def test_a_run_that_early_stopping_ended_says_so_and_trains_on(tmp_path, capsys, go_on):
    """The README's ``train RUN --resume --set train.epochs=N`` after early stopping: one line says why
    nothing trains and how to go on; going on that way trains the remaining epochs exactly as a run that
    never stopped would have."""
    cfg = tiny_config(tmp_path)            # patience 2: stops after epoch 4 of 6
    run = tmp_path / "run"
    assert train(cfg, run) == 0
    capsys.readouterr()
    assert main(["train", str(run), "--resume", "--set", "train.epochs=6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith("stopped early")]
    assert len(said) == 1, out
    assert said[0].startswith("stopped early at epoch 4: dev_root_acc has not improved for 2 epochs (best ")
    assert said[0].endswith("at epoch 2); to train on, resume with --set train.early_stopping.patience=N (N > 2) "
                            "or --set train.early_stopping=null")
    assert [r["epoch"] for r in untimed_state(run)[0]] == [1, 2, 3, 4]
    sets = [a for item in ["train.epochs=6"] + go_on for a in ("--set", item)]
    assert main(["train", str(run), "--resume", *sets, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "epoch 5/6" in out and "epoch 6/6" in out and "stopped early" not in out
    straight = tmp_path / "straight"           # the same settings from the start
    assert train(cfg, straight, *[a for item in go_on for a in ("--set", item)]) == 0
    assert untimed_state(run) == untimed_state(straight)
    assert json.loads((run / "results.json").read_text())["epoch"] == \
        json.loads((straight / "results.json").read_text())["epoch"]


@pytest.mark.parametrize("change, message", [
    ("train.early_stopping.metric=dev_loss", "the run's early stopping has metric 'dev_root_acc', this config "
                                             "'dev_loss'"),
    ("train.early_stopping.mode=min", "the run's early stopping has mode 'max', this config 'min'"),
])
def test_resume_keeps_the_metric_that_chose_the_best_epoch(tmp_path, capsys, change, message):
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    assert train(cfg, run, "--epochs", "2") == 0
    before = files_of(run)
    capsys.readouterr()
    assert main(["train", str(run), "--resume", "--set", change, "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert files_of(run) == before


def test_a_run_trained_to_its_last_epoch_says_how_to_train_longer(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    assert train(cfg, run, "--set", "train.epochs=2") == 0
    capsys.readouterr()
    assert main(["train", str(run), "--resume", "--no-progress"]) == 0
    assert ("the run has trained 2 of 2 epochs: nothing to train; to train longer, resume with --set "
            "train.epochs=N (N > 2)") in capsys.readouterr().out
