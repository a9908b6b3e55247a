"""Training from configs: config errors, exact resume, the CLI end to end in a temporary directory."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from minicavs.train import checkpoint
from minicavs.train.cli import main
from minicavs.train.config import ConfigError, load_config
from minicavs.train.trainer import Trainer

MODELS = Path(__file__).resolve().parents[2] / "models"


def tiny_config(tmp_path, **train) -> Path:
    cfg = yaml.safe_load((MODELS / "tree_lstm.yaml").read_text())
    cfg["model"]["name"] = str(MODELS / "tree_lstm.py")
    cfg["model"].update(embed=8, hidden=8)
    cfg["data"]["synthetic"] = {"train": 120, "dev": 40, "test": 40, "seed": 7, "vocab": 60}
    cfg["train"].update({"epochs": 3, "batch_size": 16, **train})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def without_timing(rows):
    return [{k: v for k, v in r.items() if k != "timing"} for r in rows]


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("override, match", [
    ("train.lrr=0.1", r"unknown config key 'train.lrr' \(did you mean 'lr'\?\)"),
    ("model.hiden=3", r"unknown config key 'model.hiden' \(did you mean 'hidden'\?\)"),
    ("train.epochs=many", r"train.epochs: expected an integer, got 'many'"),
    ("train.lr=fast", r"train.lr: expected a number"),
    ("train.sparse_updates=3", r"expected true/false"),
    ("lr=0.1", r"needs a section"),
])
def test_config_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(MODELS / "tree_lstm.yaml", [override])


@pytest.mark.parametrize("override, match", [
    ("model.embed_init=gaussian", r"tree_lstm.yaml: parameter 'E': unknown initializer 'gaussian'"),
    ("model.embed_init=uniform(a)", r"tree_lstm.yaml: parameter 'E': initializer 'uniform\(a\)': arguments"),
])
def test_bad_model_values_are_config_errors(override, match, tmp_path):
    """Values the model itself checks fail as a ConfigError naming the file (the CLI prints it, no traceback)."""
    with pytest.raises(ConfigError, match=match):
        Trainer(MODELS / "tree_lstm.yaml", [override], run_dir=tmp_path)


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle: {name: tree_lstm}\n")
    with pytest.raises(ConfigError, match=r"unknown config section 'modle' \(did you mean 'model'\?\)"):
        load_config(bad)
    bad.write_text("model: {name: no_such_model}\n")
    with pytest.raises(ConfigError, match="model 'no_such_model' not found"):
        load_config(bad)
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_defaults_are_filled_and_overrides_apply():
    cfg = load_config(MODELS / "tree_lstm.yaml", ["train.lr=0.5", "model.variant=child_sum"])
    assert cfg["train"]["lr"] == 0.5 and cfg["model"]["variant"] == "child_sum"
    assert cfg["train"]["dtype"] == "float32" and cfg["model"]["classes"] == 5


def test_training_beats_the_majority_class(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, epochs=4, lr=0.2), run_dir=tmp_path / "run")
    before = trainer.evaluate("dev")
    history = trainer.fit(progress=False, log=lambda s: None)
    after = history[-1]
    assert after["train_loss"] < history[0]["train_loss"]
    assert after["dev_loss"] < 0.8 * before["dev_loss"]
    assert after["dev_all_acc"] > before["dev_all_acc"] + 0.1


def test_resume_equals_uninterrupted_run(tmp_path):
    cfg = tiny_config(tmp_path)
    full = Trainer(cfg, run_dir=tmp_path / "full")
    full.fit(progress=False, log=lambda s: None)
    part = Trainer(cfg, run_dir=tmp_path / "part")
    part.fit(epochs=1, progress=False, log=lambda s: None)
    resumed = Trainer(cfg, run_dir=tmp_path / "part")   # a fresh process would start like this
    resumed.fit(resume=True, progress=False, log=lambda s: None)
    assert without_timing(read_metrics(tmp_path / "full")) == without_timing(read_metrics(tmp_path / "part"))
    for name, p in full.params.items():
        assert np.array_equal(p.value, resumed.params[name].value), name


def test_failed_step_leaves_parameters_unchanged(tmp_path):
    trainer = Trainer(tiny_config(tmp_path), run_dir=tmp_path / "run")
    samples = trainer.task.data["train"][:4]
    res = trainer.loss_and_grads(samples)
    before = {k: p.value.copy() for k, p in trainer.params.items()}
    grads = dict(res.grads)
    grads["W"] = np.full_like(trainer.params["W"].value, np.nan)
    with pytest.raises(Exception, match="W"):
        trainer.optimizer.step(grads, loss=res.loss)
    assert all(np.array_equal(before[k], p.value) for k, p in trainer.params.items())


def test_python_api_gives_named_parameters_and_gradients(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, dtype="float64"), run_dir=tmp_path / "run")
    samples = trainer.task.data["dev"][:3]
    res = trainer.loss_and_grads(samples, training=False)
    assert set(res.grads) == set(trainer.params)
    from minicavs.train.testing import check_model_grads
    graphs, feeds = trainer.task.batch(samples)
    check_model_grads(trainer.model, graphs, feeds, {k: p.value for k, p in trainer.params.items()},
                      directions=1, ctx=trainer.context(training=False))


def test_cli_train_then_eval(tmp_path, capsys):
    cfg = tiny_config(tmp_path, epochs=2)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run), "--no-progress", "--set", "train.lr=0.1"]) == 0
    out = capsys.readouterr().out
    assert "epoch 2" in out and "on test: test_loss" in out
    assert (run / "last.npz").exists() and (run / "best.npz").exists() and len(read_metrics(run)) == 2
    assert main(["eval", str(cfg), "--checkpoint", str(run / "best.npz"), "--split", "dev"]) == 0
    assert "dev_root_acc" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    cfg = tiny_config(tmp_path)
    assert main(["train", str(cfg), "--set", "train.lrr=1"]) == 2
    assert "did you mean 'lr'" in capsys.readouterr().err
    assert main(["eval", str(cfg), "--checkpoint", str(tmp_path / "none.npz")]) == 2


def test_engine_switches_from_config(tmp_path):
    cfg = tiny_config(tmp_path, dtype="float64")
    on = Trainer(cfg, run_dir=tmp_path / "a")
    off = Trainer(cfg, ["train.engine.lazy_batching=false", "train.engine.eager_batching=false"],
                  run_dir=tmp_path / "b")
    assert not off.model.options.lazy_batching and on.model.options.eager_batching
    samples = on.task.data["train"][:5]
    a, b = on.loss_and_grads(samples), off.loss_and_grads(samples)
    assert abs(a.loss - b.loss) <= 1e-10 * max(1, abs(a.loss))
    with pytest.raises(ConfigError, match="train.engine.streams"):
        Trainer(cfg, ["train.engine.streams=true"], run_dir=tmp_path / "c")


def test_device_is_checked_before_any_work(tmp_path):
    from minicavs.train.config import ConfigError
    from minicavs.cuda import CudaUnavailable, available
    from minicavs.train.trainer import Trainer
    from minicavs.train.config import REPO_ROOT
    cfg = REPO_ROOT / "models" / "tree_lstm.yaml"
    with pytest.raises(ConfigError, match=r"train.device = 'tpu': must be one of cpu, cuda \(from --set\)"):
        Trainer(cfg, ["train.device=tpu"], run_dir=tmp_path)
    if not available():   # with a GPU, tests/engine/test_backend.py trains there
        with pytest.raises(CudaUnavailable, match="CuPy|CUDA"):
            Trainer(cfg, ["train.device=cuda"], run_dir=tmp_path)
    assert not any(tmp_path.iterdir())   # nothing written


def test_fsm_policy_learned_before_training_saved_and_restored(tmp_path):
    cfg = tiny_config(tmp_path, epochs=1, policy="fsm")
    trainer = Trainer(cfg, run_dir=tmp_path / "run")
    trainer.fit(progress=False, log=lambda s: None)
    learned = trainer.policy
    assert learned.learned and (tmp_path / "run" / "fsm.json").is_file()
    fresh = Trainer(cfg, run_dir=tmp_path / "other")
    fresh.load(tmp_path / "run" / "last.npz", optimizer=False)
    assert fresh.policy.to_json() == learned.to_json() and fresh.model.policy is fresh.policy
    graphs, _ = trainer.task.batch(trainer.task.data["dev"][:16])
    a = learned.schedule(trainer.model.batches(graphs)["tree"])
    b = fresh.policy.schedule(fresh.model.batches(graphs)["tree"])
    assert np.array_equal(a.order, b.order) and np.array_equal(a.task_ptr, b.task_ptr)
    with pytest.raises(ConfigError, match="train.policy = 'fifo': must be one of cavs, depth, agenda, greedy, fsm"):
        Trainer(cfg, ["train.policy=fifo"], run_dir=tmp_path / "bad")   # the config's RULES, before any work
    # fsm.json is a run file: resume repairs it from the FSM last.npz records
    (tmp_path / "run" / "fsm.json").unlink()
    again = Trainer.resuming(tmp_path / "run", ["train.epochs=2"])
    logged = []
    again.fit(resume=True, progress=False, log=logged.append)
    assert any("rewrote fsm.json" in line for line in logged), logged
    assert json.loads((tmp_path / "run" / "fsm.json").read_text()) == learned.to_json()
    assert again.policy.to_json() == learned.to_json()   # resumed with the learned FSM, not a new one


@pytest.mark.parametrize("empty", [[], (), np.array([], np.int64)], ids=["list", "tuple", "array"])
@pytest.mark.parametrize("model", ["tree_lstm", "tree_fc", "var_lstm"])
def test_a_step_on_an_empty_batch_is_refused_naming_the_function(model, empty, tmp_path):
    """loss_and_grads, train_step and prepare_step of no samples: a FeedError naming the function and saying the
    batch is empty, raised before anything runs (the parameters and the optimizer's step count unchanged)."""
    from minicavs.core.errors import FeedError
    from ..models.test_models import TINY
    t = Trainer(MODELS / f"{model}.yaml", TINY[model], run_dir=tmp_path / "run")
    before = {k: p.value.copy() for k, p in t.params.items()}
    steps = t.optimizer.steps
    for call, name in ((t.loss_and_grads, "loss_and_grads"), (t.train_step, "train_step"),
                       (t.prepare_step, "prepare_step")):
        with pytest.raises(FeedError, match=rf"^Trainer\.{name}: the batch is empty"):
            call(empty)
    assert t.optimizer.steps == steps
    assert all((p.value == before[k]).all() for k, p in t.params.items())
    loss, _ = t.train_step(np.array([0, 1]))   # (a batch of samples still trains)
    assert np.isfinite(loss) and t.optimizer.steps == steps + 1


# --- advice in the words of the interface in use: Python arguments from the API, flags from the CLI ---

def _situations(tmp_path):
    """(what to do from Python, the same from the command line, the Python words, the CLI words)."""
    cfg = tiny_config(tmp_path, epochs=1)
    run = tmp_path / "run"
    Trainer(cfg, run_dir=run).fit(progress=False, log=lambda s: None)
    quiet = dict(progress=False, log=lambda s: None)
    old = tmp_path / "old.npz"      # as minicavs wrote checkpoints before they recorded their config
    checkpoint.save(old, Trainer(cfg).params, extra={"version": 1, "epoch": 1})
    return {
        "a new run into a run dir in use": (
            lambda: Trainer(cfg, run_dir=run).fit(**quiet), ["train", str(cfg), "--run-dir", str(run)],
            ["continue it with resume=True", "replace it with force=True", "choose another run_dir"],
            ["continue it with --resume", "replace it with --force", "choose another --run-dir"]),
        "resuming a run dir that does not exist": (
            lambda: Trainer.resuming(tmp_path / "none"), ["train", str(cfg), "--run-dir", str(tmp_path / "none"),
                                                          "--resume"],
            ["start a fresh run without resume=True"], ["start a fresh run without --resume"]),
        "resuming with another model size": (
            lambda: Trainer.resuming(run, ["model.hidden=5"]),
            ["train", str(run), "--resume", "--set", "model.hidden=5"],
            ["resuming (Trainer.resuming) continues the recorded run", "start a new run (run_dir=...) for that"],
            ["--resume continues the recorded run", "start a new run (--run-dir) for that"]),
        "resuming naming another model's config": (
            lambda: Trainer.resuming(run, config="tree_gru"), ["train", "tree_gru", "--resume", "--run-dir", str(run)],
            [f"resume it as Trainer.resuming({str(run)!r})", "another run dir (run_dir=...)"],
            [f"resume it as minicavs train {run} --resume", "another run dir (--run-dir)"]),
        "a config without its checkpoint": (
            lambda: Trainer.for_target(str(cfg)), ["eval", str(cfg)],
            ["give the checkpoint to use with checkpoint="], ["give the checkpoint to use with --checkpoint"]),
        "an override of the checkpoint's model": (
            lambda: Trainer.for_target(str(cfg), run / "best.npz", ["model.hidden=5"]),
            ["eval", str(cfg), "--checkpoint", str(run / "best.npz"), "--set", "model.hidden=5"],
            ["overrides: model.hidden: the model and training settings come from the checkpoint"],
            ["--set model.hidden: the model and training settings come from the checkpoint"]),
        "a checkpoint that does not record its config": (
            lambda: Trainer.for_target(str(run), old), ["eval", str(run), "--checkpoint", str(old)],
            [f"give it, e.g. Trainer.for_checkpoint({str(old)!r}, CONFIG)"],
            [f"give it, e.g. minicavs eval CONFIG --checkpoint {old}"]),
    }


SITUATIONS = ["a new run into a run dir in use", "resuming a run dir that does not exist",
              "resuming with another model size", "resuming naming another model's config",
              "a config without its checkpoint", "an override of the checkpoint's model",
              "a checkpoint that does not record its config"]


@pytest.mark.parametrize("situation", SITUATIONS)
def test_errors_name_python_arguments_from_python_and_flags_from_the_cli(tmp_path, capsys, situation):
    from minicavs.core.errors import MinicavsError
    call, argv, python_words, cli_words = _situations(tmp_path)[situation]
    with pytest.raises(MinicavsError) as info:
        call()
    message = str(info.value)
    assert all(w in message for w in python_words), message
    assert not re.search(r"(^|\W)--[a-z]", message), message      # no flag in a Python error
    capsys.readouterr()
    assert main(argv + ["--no-progress"] * (argv[0] == "train")) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in cli_words), err


def test_a_stopped_runs_advice_from_python_names_overrides(tmp_path):
    cfg = tiny_config(tmp_path, epochs=6, early_stopping={"metric": "train_loss", "mode": "max", "patience": 1})
    run = tmp_path / "run"
    Trainer(cfg, run_dir=run).fit(progress=False, log=lambda s: None)   # the loss falls: stops after epoch 2
    said: list[str] = []
    Trainer.resuming(run).fit(resume=True, progress=False, log=said.append)
    assert any(s.startswith("stopped early at epoch 2: train_loss has not improved for 1 epochs") and
               s.endswith("resume with overrides=['train.early_stopping.patience=N'] (N > 1) or "
                          "overrides=['train.early_stopping=null']") for s in said), said


@pytest.mark.parametrize("model, overrides, announced", [
    ("tree_lstm", ["model.embed=7", "model.hidden=7"], ["compiling kernels (once, cached in {cache}) ..."]),
    ("lattice_lstm", ["model.embed=4", "model.hidden=5", "data.synthetic.max_len=12", "train.batch_size=8"],
     ["compiling kernels (once, cached in {cache}) ...",
      "learning the FSM batching policy for kinds char, char_words, word (once per run) ..."]),
])
def test_one_time_work_is_announced_and_left_out_of_the_throughput(tmp_path, monkeypatch, model, overrides,
                                                                   announced):
    """With an empty kernel cache the C compilation happens in epoch 1: it is announced in one line, and the
    epoch's throughput is the units over the epoch's time without it (the line says so). An FSM policy is
    learned before epoch 1, announced likewise."""
    from minicavs.cpu.compiler import compiler
    if compiler() is None:
        pytest.skip("no C compiler: nothing is compiled")
    monkeypatch.setenv("MINICAVS_CACHE", str(tmp_path / "cache"))
    sizes = ["data.synthetic.train=40", "data.synthetic.dev=10", "data.synthetic.test=10", "train.epochs=2"]
    trainer = Trainer(MODELS / f"{model}.yaml", sizes + overrides, run_dir=tmp_path / "run")
    lines: list = []
    rows = trainer.fit(progress=False, log=lines.append)
    first_epoch = next(i for i, line in enumerate(lines) if line.startswith("epoch 1/2"))
    expected = [a.format(cache=tmp_path / "cache") for a in announced]
    # (in either order: the kernels this process has loaded already decide which work comes first)
    assert sorted(line for line in lines if line.endswith(" ...")) == sorted(expected)
    assert all(lines.index(a) < first_epoch for a in expected)
    units = trainer.task.units(trainer.task.data["train"])
    once = rows[0]["timing"]["one_time_s"]
    assert 0 < once < rows[0]["timing"]["epoch_seconds"]
    for row in rows:
        t = row["timing"]
        rate = t[f"train_{trainer.task.unit}_per_s"]
        assert rate == pytest.approx(units / (t["epoch_seconds"] - t.get("one_time_s", 0.0)), rel=1e-9)
    assert f"/s without the {once:.1f} s of one-time work)" in lines[first_epoch]
