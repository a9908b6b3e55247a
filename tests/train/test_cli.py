"""The command line: one line on stderr and exit 2 for every user error, 130 on Ctrl-C, a traceback only for
bugs; bad data and unusable run dirs found before anything is written or trained; checkpoints that carry
their config and vocabulary (eval RUN_DIR, resume without --set, other data refused)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from minicavs.train import checkpoint
from minicavs.train.cli import main
from minicavs.core.errors import CheckpointError
from minicavs.train.trainer import Trainer

from .test_rundir import tiny_config

MODELS = Path(__file__).resolve().parents[2] / "models"


def user_error(argv, capsys, *expected) -> str:
    """Run the CLI, expect exit 2 and one line on stderr that contains every expected piece."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"minicavs {argv[0]}: error: "), err
    assert "Traceback" not in err
    for piece in expected:
        assert piece in err, (piece, err)
    return err


@pytest.mark.parametrize("override, message", [
    ("train.batch_size=-5", "train.batch_size = -5: must be an integer >= 1 (from --set)"),
    ("model.hidden=0", "model.hidden = 0: must be an integer >= 1"),
    ("train.lr=0", "train.lr = 0.0: must be a finite number > 0"),
    ("train.optimizer=adamw", "train.optimizer = 'adamw': must be one of sgd, adagrad, adam"),
    ("train.dtype=float16", "train.dtype = 'float16': must be one of float32, float64"),
    ("train.lr=null", "train.lr: null is not allowed"),
    ("train.early_stopping.metric=dev_acc", "train.early_stopping.metric = 'dev_acc': must be one of train_loss, "
                                            "dev_loss, dev_root_acc"),
    ("train.lr=1e-3x", "train.lr: expected a number, got '1e-3x'"),
    ("train", "--set 'train': expected key=value"),
])
def test_config_errors_are_one_line_and_nothing_is_written(tmp_path, capsys, override, message):
    cfg = tiny_config(tmp_path)
    user_error(["train", str(cfg), "--run-dir", str(tmp_path / "run"), "--set", override], capsys, str(cfg), message)
    assert not (tmp_path / "run").exists()


def test_cuda_without_cupy_is_a_user_error(tmp_path, capsys):
    from minicavs.cuda import available
    if available():
        pytest.skip("a usable GPU: cuda trains")
    user_error(["train", str(tiny_config(tmp_path)), "--run-dir", str(tmp_path / "run"), "--set",
                "train.device=cuda"], capsys, "tiny.yaml: train.device = 'cuda': device: cuda")
    assert not (tmp_path / "run").exists()


def test_a_yaml_1_2_learning_rate_trains(tmp_path, capsys):
    assert main(["train", str(tiny_config(tmp_path)), "--run-dir", str(tmp_path / "run"), "--no-progress",
                 "--epochs", "1", "--set", "train.lr=1e-1"]) == 0
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["lr"] == 0.1


@pytest.mark.parametrize("prefetch", [False, True])
def test_ctrl_c_exits_130_and_the_run_resumes(tmp_path, capsys, monkeypatch, prefetch):
    """With train.prefetch the interrupt comes while the next batch may be preparing: no thread stays."""
    import threading
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    prefetching = ["--set", f"train.prefetch={str(prefetch).lower()}"]
    assert main(["train", str(cfg), "--run-dir", str(run), "--no-progress", "--epochs", "1"] + prefetching) == 0
    real = Trainer.train_step

    def interrupted(self, ids, *prepared):
        if self.epoch == 1 and self.optimizer.steps == 4:   # epoch 2's second batch of 3
            raise KeyboardInterrupt
        return real(self, ids, *prepared)
    monkeypatch.setattr(Trainer, "train_step", interrupted)
    capsys.readouterr()
    assert main(["train", str(cfg), "--run-dir", str(run), "--no-progress", "--resume", "--epochs", "3"]
                + prefetching) == 130
    err = capsys.readouterr().err
    assert err.strip() == "minicavs train: interrupted: resume with --resume"
    assert not [t for t in threading.enumerate() if t.name.startswith("minicavs-prefetch")]
    monkeypatch.undo()
    assert main(["train", str(cfg), "--run-dir", str(run), "--no-progress", "--resume", "--epochs", "3"]) == 0


def test_a_bug_still_gets_a_traceback(tmp_path, monkeypatch):
    def broken(self, ids, *prepared):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(Trainer, "train_step", broken)
    with pytest.raises(ZeroDivisionError):
        main(["train", str(tiny_config(tmp_path)), "--run-dir", str(tmp_path / "run"), "--no-progress"])


def test_an_unwritable_run_dir_is_found_before_training(tmp_path, capsys, monkeypatch):
    cfg = tiny_config(tmp_path)
    (tmp_path / "a_file").write_text("x")
    trained = []
    monkeypatch.setattr(Trainer, "train_epoch", lambda self, *a: trained.append(1))
    user_error(["train", str(cfg), "--run-dir", str(tmp_path / "a_file" / "run")], capsys,
               f"cannot write to run dir {tmp_path / 'a_file' / 'run'}: Not a directory")
    if os.geteuid() != 0:   # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        user_error(["train", str(cfg), "--run-dir", str(tmp_path / "ro")], capsys, "Permission denied")
    assert not trained


def write_sst(path: Path, words) -> Path:
    lines = [f"(3 (2 {a}) (4 {b}))" for a, b in zip(words, words[1:] + words[:1])]
    path.write_text("\n".join(lines) + "\n")
    return path


def sst_config(tmp_path, train: Path) -> Path:
    cfg = yaml.safe_load(tiny_config(tmp_path).read_text())
    cfg["data"].update(train=str(train), dev=str(train), test=str(train))
    cfg["train"]["early_stopping"] = None
    path = tmp_path / "sst.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_empty_training_data_is_refused_before_anything_is_written(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    user_error(["train", str(sst_config(tmp_path, empty)), "--run-dir", str(tmp_path / "run")], capsys,
               f"data.train: {empty} holds no trees")
    assert not (tmp_path / "run").exists()
    user_error(["train", "var_lstm", "--run-dir", str(tmp_path / "run"), "--set", f"data.train={empty}"], capsys,
               f"data.train: {empty} holds no sentences")
    user_error(["train", "fixed_lstm", "--run-dir", str(tmp_path / "run"), "--set", "data.synthetic.train=1",
                "--set", "model.window=500"], capsys, "data.train (synthetic) holds no samples")
    assert not (tmp_path / "run").exists()


def test_non_utf8_data_is_reported_with_its_path_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"(3 (2 good) (4 words))\n(3 (2 caf\xe9) (4 x))\n")
    user_error(["train", str(sst_config(tmp_path, bad)), "--run-dir", str(tmp_path / "run")], capsys,
               f"{bad}:2: not UTF-8 (invalid continuation byte at byte 10 of the line)")
    user_error(["train", "var_lstm", "--run-dir", str(tmp_path / "run"), "--set", f"data.train={bad}"], capsys,
               f"{bad}:2: not UTF-8")
    assert not (tmp_path / "run").exists()


def test_eval_refuses_data_whose_vocabulary_differs(tmp_path, capsys):
    a = write_sst(tmp_path / "a.txt", ["apple", "bean", "corn", "date"])
    b = write_sst(tmp_path / "b.txt", ["apple", "bean", "corn", "eel"])    # same size, one other word
    cfg = sst_config(tmp_path, a)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run), "--no-progress", "--epochs", "1"]) == 0
    assert main(["eval", str(run)]) == 0
    assert main(["eval", str(cfg), "--checkpoint", str(run / "best.npz")]) == 0
    user_error(["eval", str(run), "--set", f"data.train={b}"], capsys,
               "was trained with another vocabulary than data.train", f"({b})", "5 vs 5 words",
               "1 word only in the data (e.g. 'eel'); 1 word only in the checkpoint (e.g. 'date')")
    user_error(["eval", str(cfg), "--checkpoint", str(run / "best.npz"), "--set", f"data.train={b}"], capsys,
               "another vocabulary")
    write_sst(a, ["apple", "bean", "date", "corn", "apple"])      # the same words, other ids? no: sorted ids
    assert main(["eval", str(run)]) == 0
    write_sst(a, ["apple", "bean", "corn", "fig"])                # the train file changed under the run
    user_error(["train", str(run), "--resume", "--epochs", "2"], capsys, "another vocabulary", "'fig'")
    user_error(["eval", str(run)], capsys, "another vocabulary")


def test_the_readme_sequence_needs_no_repeated_set(tmp_path, capsys, monkeypatch):
    """train with --set, then --resume, eval RUN_DIR and eval CONFIG --checkpoint: the checkpoint's settings."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(tmp_path)
    assert main(["train", str(cfg), "--set", "train.epochs=2", "--set", "model.hidden=6", "--no-progress"]) == 0
    assert (tmp_path / "runs" / "tiny" / "config.yaml").exists()
    out = capsys.readouterr().out
    assert re.search(r"^epoch 2/2: train loss [\d.]+, dev loss [\d.]+, dev root_acc [\d.]+%( \(best\))?; "
                     r"[\d.]+ s \([\d,]+ trees/s\)$", out, re.M), out
    assert main(["train", str(cfg), "--resume", "--set", "train.epochs=3", "--no-progress"]) == 0
    assert "epoch 3/3" in capsys.readouterr().out
    assert main(["eval", "runs/tiny"]) == 0
    assert main(["eval", str(cfg), "--checkpoint", "runs/tiny/best.npz", "--split", "dev"]) == 0
    out = capsys.readouterr().out
    assert "note: using the checkpoint's model.hidden = 6" in out and "dev_root_acc" in out
    user_error(["eval", str(cfg), "--checkpoint", "runs/tiny/best.npz", "--set", "model.hidden=4"], capsys,
               "--set model.hidden: the model and training settings come from the checkpoint")
    user_error(["eval", "var_lstm", "--checkpoint", "runs/tiny/best.npz"], capsys,
               "configures model var_lstm, the checkpoint runs/tiny/best.npz holds a tree_lstm model")
    results = yaml.safe_load((tmp_path / "runs" / "tiny" / "results.json").read_text())
    assert results["checkpoint"] == "best.npz" and "test_root_acc" in results and "dev_loss" in results


def test_load_checks_everything_before_it_changes_anything(tmp_path):
    cfg = tiny_config(tmp_path)
    trained = Trainer(cfg, run_dir=tmp_path / "a")
    trained.fit(epochs=1, progress=False, log=lambda s: None)
    other = Trainer(cfg, ["model.dropout=0.0"], run_dir=tmp_path / "b")   # same shapes, other model
    res = other.loss_and_grads(other.task.data["train"][:4])
    other.optimizer.step(res.grads, loss=res.loss)
    before = {k: p.value.copy() for k, p in other.params.items()}
    slots = {k: {s: a.copy() for s, a in v.items()} for k, v in other.optimizer.state.items()}
    with pytest.raises(CheckpointError, match=r"other model settings: model.dropout is 0.2 there, 0.0 here"):
        other.load(tmp_path / "a" / "last.npz")
    assert all(np.array_equal(before[k], p.value) for k, p in other.params.items())
    assert all(np.array_equal(slots[k][s], a) for k, v in other.optimizer.state.items() for s, a in v.items())
    assert other.optimizer.steps == 1 and other.epoch == 0


def test_older_and_newer_checkpoints(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    t = Trainer(cfg, run_dir=tmp_path / "run")
    old = tmp_path / "old.npz"     # what minicavs wrote before checkpoints recorded their config
    checkpoint.save(old, t.params, t.optimizer, extra={"version": 1, "epoch": 3, "batch": 0, "model": t.cfg["model"]})
    assert main(["eval", str(cfg), "--checkpoint", str(old)]) == 0
    (tmp_path / "oldrun").mkdir()
    checkpoint.save(tmp_path / "oldrun" / "last.npz", t.params, t.optimizer, extra={"version": 1, "epoch": 3})
    user_error(["train", str(tmp_path / "oldrun"), "--resume"], capsys, "older minicavs (run format 1)",
               "cannot resume it")
    newer = tmp_path / "newer.npz"
    checkpoint.save(newer, t.params, t.optimizer, extra={"version": 99, "config": {}})
    user_error(["eval", str(cfg), "--checkpoint", str(newer)], capsys, "run format 99 is not supported")


def test_resuming_from_python_with_other_settings_is_refused(tmp_path):
    cfg = tiny_config(tmp_path)
    Trainer(cfg, run_dir=tmp_path / "run").fit(epochs=1, progress=False, log=lambda s: None)
    other = Trainer(cfg, ["train.lr=0.5"], run_dir=tmp_path / "run")
    before = {k: p.value.copy() for k, p in other.params.items()}
    with pytest.raises(CheckpointError, match=r"other settings: train.lr is 0.3 there, 0.5 here"):
        other.fit(resume=True, progress=False, log=lambda s: None)
    assert all(np.array_equal(before[k], p.value) for k, p in other.params.items())
    longer = Trainer(cfg, ["train.epochs=2"], run_dir=tmp_path / "run")   # training longer is allowed
    assert [r["epoch"] for r in longer.fit(resume=True, progress=False, log=lambda s: None)] == [2]


def test_ctrl_c_before_the_first_checkpoint_resumes_by_starting_over(tmp_path, capsys, monkeypatch):
    """Interrupted in epoch 1: the advice ('resume with --resume') works, a new run names the same way on,
    and the resumed run ends as an uninterrupted one."""
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    real = Trainer.train_step

    def interrupted(self, ids, *prepared):
        if self.optimizer.steps == 1:
            raise KeyboardInterrupt
        return real(self, ids, *prepared)
    monkeypatch.setattr(Trainer, "train_step", interrupted)
    assert main(["train", str(cfg), "--run-dir", str(run), "--no-progress", "--epochs", "2"]) == 130
    assert capsys.readouterr().err.strip() == "minicavs train: interrupted: resume with --resume"
    monkeypatch.undo()
    assert (run / "config.yaml").exists() and not (run / "last.npz").exists()
    user_error(["train", str(cfg), "--run-dir", str(run), "--epochs", "2"], capsys,
               "already holds a run (no checkpoint yet); continue it with --resume (it starts over: no epoch was "
               "saved), replace it with --force")
    assert main(["train", str(run), "--resume", "--epochs", "2", "--no-progress"]) == 0
    assert "holds no checkpoint yet (stopped before its first epoch ended): starting the run over from its " \
           "config.yaml" in capsys.readouterr().out
    assert main(["train", str(cfg), "--run-dir", str(tmp_path / "straight"), "--epochs", "2", "--no-progress"]) == 0
    for name in ("last.npz", "best.npz"):
        got, want = checkpoint.read(run / name), checkpoint.read(tmp_path / "straight" / name)
        assert got.step == want.step == 6
        assert all(np.array_equal(got.params[k], want.params[k]) for k in want.params)


def test_resume_starting_over_still_refuses_another_model(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(Trainer(cfg, run_dir=run)._config_text())   # as a new run writes it
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.iterdir()}
    user_error(["train", str(run), "--resume", "--set", "model.hidden=5"], capsys, "cannot change model.hidden")
    user_error(["train", "tree_gru", "--resume", "--run-dir", str(run)], capsys,
               "configures a tree_gru model, but run dir", "holds a tree_lstm run (its config.yaml)")
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.iterdir()} == before


@pytest.mark.parametrize("override, what", [
    ("model.hidden=1000000000000", "Unable to allocate"),     # weights of hundreds of terabytes: numpy refuses them
    ("model.embed=1000000000000", "Unable to allocate"),
])
def test_a_model_too_large_for_memory_is_one_line_naming_it_and_what_to_lower(tmp_path, capsys, override, what):
    err = user_error(["train", str(tiny_config(tmp_path)), "--run-dir", str(tmp_path / "run"), "--set", override],
                     capsys, "out of memory: ", what, "for an array with shape", "lower train.batch_size",
                     "model.hidden")
    assert not (tmp_path / "run").exists(), err


@pytest.mark.parametrize("command", ["train", "eval", "predict"])
def test_running_out_of_memory_mid_run_is_one_line(tmp_path, capsys, monkeypatch, command):
    """Where a step, an evaluation or a prediction does not fit (simulated: numpy's MemoryError message)."""
    cfg = tiny_config(tmp_path)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run), "--no-progress", "--epochs", "1"]) == 0
    (tmp_path / "in.txt").write_text("(a b)\n")

    def too_big(*args, **kwargs):
        raise MemoryError("Unable to allocate 9.31 GiB for an array with shape (25000, 100000) and data type "
                          "float32")
    from minicavs.engine.model import Model
    monkeypatch.setattr(Model, "forward_backward", too_big)
    monkeypatch.setattr(Model, "infer", too_big)
    argv = {"train": ["train", str(run), "--resume", "--epochs", "2", "--no-progress"],
            "eval": ["eval", str(run)], "predict": ["predict", str(run), str(tmp_path / "in.txt")]}[command]
    user_error(argv, capsys, "out of memory: Unable to allocate 9.31 GiB for an array with shape (25000, 100000)",
               "lower train.batch_size" if command == "train" else "lower train.eval_batch_size")


def _closed_stdout(argv: list, cwd: Path) -> tuple[int, bytes]:
    """Run ``minicavs argv`` in a process whose standard output's reader has gone (``| head -0``)."""
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": str(MODELS.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "minicavs", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=cwd, env=env)
    proc.stdout.close()
    with proc.stderr:
        err = proc.stderr.read()
    return proc.wait(timeout=120), err


@pytest.mark.parametrize("command", ["train", "predict", "demo"])
def test_a_closed_pipe_ends_quietly_as_unix_tools_do(tmp_path, command):
    """``minicavs train ... | head -1``: no 'Broken pipe' error, no traceback, exit 141 (128 + SIGPIPE)."""
    cfg = tiny_config(tmp_path)
    if command == "predict":
        assert main(["train", str(cfg), "--run-dir", str(tmp_path / "run"), "--epochs", "1", "--no-progress"]) == 0
        (tmp_path / "in.txt").write_text("((a b) c)\n" * 200)
    argv = {"train": ["train", str(cfg), "--run-dir", str(tmp_path / "run2"), "--epochs", "1", "--no-progress"],
            "predict": ["predict", str(tmp_path / "run"), str(tmp_path / "in.txt")],
            "demo": ["demo", "--steps", "1"]}[command]
    status, err = _closed_stdout(argv, tmp_path)
    assert (status, err.decode()) == (141, "")


@pytest.mark.parametrize("config, dataset, file", [("tree_lstm_sst", "sst", "train.txt"),
                                                   ("var_lstm_ptb", "ptb", "ptb.valid.txt")])
def test_a_data_set_not_prepared_points_at_minicavs_prepare(tmp_path, capsys, monkeypatch, config, dataset, file):
    monkeypatch.setenv("MINICAVS_DATA", str(tmp_path / "data"))
    user_error(["train", config, "--run-dir", str(tmp_path / "run")], capsys,
               f"data.train: file not found: {tmp_path / 'data' / dataset / file} (",
               f"is not prepared: download it (data/README.md says where), then minicavs prepare {dataset} FOLDER")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model", ["tree_lstm", "var_lstm", "tree_gru"])
@pytest.mark.parametrize("split", ["train", "dev", "test"])
def test_a_directory_given_as_a_data_file_says_so(tmp_path, capsys, model, split):
    user_error(["train", model, "--run-dir", str(tmp_path / "run"), "--set", f"data.{split}={tmp_path}"], capsys,
               f"data.{split}: {tmp_path} is a directory, not a data file")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model, known, unknown", [
    ("tree_lstm", "(3 (2 {a}) (4 {b}))", "(3 (2 zzz{i}) (4 yyy{i}))"),
    ("var_lstm", "{a} {b}", "zzz{i} yyy{i}"),
])
@pytest.mark.parametrize("unknown_lines, warned", [(0, False), (1, False), (3, True), (10, True)])
def test_eval_reports_the_out_of_vocabulary_rate(tmp_path, capsys, model, known, unknown, unknown_lines, warned):
    """Every word of a line is known or every word unknown: the rate is unknown lines / lines, warned above 10%."""
    words = [f"w{i}" for i in range(10)]
    train = tmp_path / "train.txt"
    train.write_text("".join(known.format(a=a, b=b) + "\n" for a, b in zip(words, words[1:] + words[:1])))
    test = tmp_path / "test.txt"
    lines = [known.format(a=words[i], b=words[(i + 1) % 10]) for i in range(10 - min(unknown_lines, 9))]
    lines += [unknown.format(i=i) for i in range(unknown_lines)]
    test.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    sets = ["--set", f"data.train={train}", "--set", f"data.dev={train}", "--set", f"data.test={test}",
            "--set", "model.hidden=4", "--set", "model.embed=4"]
    assert main(["train", model, "--run-dir", str(run), "--no-progress", "--epochs", "1", *sets]) == 0
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    out, err = capsys.readouterr()
    rate = unknown_lines / len(lines)
    assert f"  test_oov_rate {rate:.1%}  (" in out
    warning = (f"minicavs eval: warning: {rate:.1%} of the test words ({2 * unknown_lines} of {2 * len(lines)}) "
               "are not in the model's vocabulary (each reads as <unk>)")
    assert (warning in err) == warned and (err == "") == (not warned), err
