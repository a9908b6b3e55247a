"""What a trainer records in its checkpoints, and the checks that a run resumed or evaluated is the run recorded.

Checkpoints written by the trainer (:mod:`minicavs.train.trainer`) record, besides parameters and optimizer state
(``extra``, run format :data:`RUN_FORMAT`): the resolved config, the vocabulary, the epoch, the early-stopping
state, every epoch's metrics and where pretrained embedding rows came from (``pretrained``: path and sha256), so
``minicavs eval RUN_DIR`` and ``--resume`` rebuild the model from the checkpoint alone (no vector file is read)
and refuse data whose vocabulary differs, and a checkpoint found in a run dir must hold the model of that run
(its config.yaml, its last.npz): a file copied from another run is refused, as are NaN or infinite values
(:func:`checkpoint.read`). Everything here reads and checks; nothing writes, so every refusal comes before the
trainer writes anything, the run dir's lock included.

Run format 1 (before configs were recorded) is still read by ``eval CONFIG --checkpoint``; resuming it is
refused.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import yaml

from ..core import wording
from ..core.errors import CheckpointError, DataError, RunDirError
from . import checkpoint, distributed
from .config import ConfigError, differences, load_config, parse_yaml, recorded, resolve
from .rundir import RunDir

RUN_FORMAT = 2
# what --resume may change: how long to train and where, not what is trained. Early stopping is when to stop
# (its metric and mode stay the run's: they define which epoch is the best; Trainer._resumed_early)
RESUME_MAY_CHANGE = ("train.epochs", "train.log_every", "train.eval_batch_size", "train.device",
                     "train.prefetch", "train.deterministic", "train.engine.", "train.early_stopping")
# what eval takes from the given config rather than the checkpoint: the data and how to run
EVAL_FROM_CONFIG = ("data.", "train.eval_batch_size", "train.device", "train.deterministic", "train.engine.",
                    "train.policy")


def resumed_run(run_dir: str | os.PathLike, overrides: Sequence[str] = (),
                config: str | os.PathLike | None = None, log: Callable[[str], None] = print
                ) -> tuple[dict, Path, dict | None]:
    """What :meth:`Trainer.resuming <minicavs.train.trainer.Trainer.resuming>` builds its trainer from: (the run's
    recorded config with ``overrides``, the run dir, its last.npz's ``extra`` or None when it stopped before
    its first checkpoint). ``overrides`` may change only :data:`RESUME_MAY_CHANGE`; ``config``, a config named
    as well, must configure the run's model, and where its settings differ from the run's a note says so."""
    run = RunDir(run_dir)
    comm = distributed.world()   # under MPI rank 0 reads the run dir (it need not be shared)
    stored, where, extra = distributed.on_root(comm, lambda: run_record(run))
    run_cfg = resolve(stored, run.config)
    cfg = resolve(stored, run.config, overrides)
    if config is not None:
        given = load_config(config, overrides)
        name, theirs = model_key(given["model"])["name"], model_key(run_cfg["model"])["name"]
        if name != theirs:
            raise wording.error(ConfigError, f"{config} configures a {name} model, but run dir {run.path} "
                                f"holds a {theirs} run (its {where}); resume it as {{alt[minicavs train "
                                f"{run.path} --resume|Trainer.resuming({str(run.path)!r})]}}, or start a new "
                                "run in another run dir ({new_run_dir})")
        changed = differences(recorded(given), recorded(cfg))
        if changed and (comm is None or comm.rank == 0):
            log(f"note: resuming the run's recorded settings; {config} differs in "
                + ", ".join(f"{k} ({a!r}, the run has {b!r})" for k, a, b in changed[:6])
                + (f" and {len(changed) - 6} more" if len(changed) > 6 else ""))
    changed = [d for d in differences(recorded(cfg), recorded(run_cfg)) if not may_change_on_resume(d[0])]
    if changed:
        raise wording.error(ConfigError, f"{{resuming}} continues the recorded run of {run.path}; it cannot "
                            "change " + ", ".join(f"{k} ({a!r}, the run has {b!r})" for k, a, b in changed)
                            + ": start a new run ({new_run_dir}) for that")
    return cfg, run.path, extra


def evaluated_config(ck: checkpoint.Checkpoint, path: str | os.PathLike, config: str | os.PathLike | None = None,
                     overrides: Sequence[str] = (), log: Callable[[str], None] = print) -> dict:
    """The config to evaluate a checkpoint that records its config with: the recorded model and training
    settings, the data and how to run (:data:`EVAL_FROM_CONFIG`) from ``config`` and ``overrides`` where given.
    A config of another model is refused, an override of a recorded model setting too; a given config's other
    model settings are noted and ignored. ``path``: the checkpoint's file as named to the user."""
    source = Path(path).with_name("config.yaml")
    cfg = resolve(ck.extra["config"], source)
    if config is None and not overrides:
        return cfg
    given = load_config(config, overrides) if config is not None else resolve(ck.extra["config"], source, overrides)
    if model_key(given["model"])["name"] != model_key(cfg["model"])["name"]:
        raise ConfigError(f"{config}: configures model {given['model']['name']}, the checkpoint {path} "
                          f"holds a {cfg['model']['name']} model")
    for key, ours, theirs in differences(recorded(given), recorded(cfg)):
        if not key.startswith("model."):
            continue   # data and how to run are taken from the config; the rest is unused
        if any(o.split("=", 1)[0].strip() == key for o in overrides):
            raise wording.error(ConfigError, f"{{alt[--set {key}|overrides: {key}]}}: the model and "
                                f"training settings come from the checkpoint {path} ({key} = {theirs!r})")
        log(f"note: using the checkpoint's {key} = {theirs!r} ({config} says {ours!r})")
    take_settings(cfg, given, EVAL_FROM_CONFIG)
    return resolve(recorded(cfg), source)


def check_recorded(ck: checkpoint.Checkpoint, cfg: dict, path, resuming: bool) -> None:
    """A checkpoint's record fits the run configured by ``cfg``: a run format this minicavs reads (one that
    records its config, to resume it), the same model settings and, ``resuming``, the same recorded config
    but for :data:`RESUME_MAY_CHANGE`."""
    extra = ck.extra or {}
    version = run_format(ck)
    if resuming and version < 2:
        raise CheckpointError(f"checkpoint file {path}: written by an older minicavs (run format 1) that "
                              "did not record the config and metrics: it can be evaluated, not resumed")
    stored_model = extra.get("config", {}).get("model", extra.get("model"))
    if stored_model is not None:
        changed = differences(model_key(cfg["model"]), model_key(stored_model))
        if changed:
            raise CheckpointError(f"checkpoint file {path} was written for other model settings: "
                                  + ", ".join(f"model.{k} is {b!r} there, {a!r} here" for k, a, b in changed))
    if resuming:   # the run's recorded config is what continues
        changed = [d for d in differences(recorded(cfg), recorded(resolve(extra["config"], path)))
                   if not may_change_on_resume(d[0])]
        if changed:
            raise CheckpointError(f"checkpoint file {path} was written by a run with other settings: "
                                  + ", ".join(f"{k} is {b!r} there, {a!r} here" for k, a, b in changed))


def check_started(run: RunDir, cfg: dict) -> None:
    """A run started over (no checkpoint yet) must be the one its config.yaml records."""
    raw, _, _ = run_record(run)
    changed = [d for d in differences(recorded(cfg), recorded(resolve(raw, run.config)))
               if not may_change_on_resume(d[0])]
    if changed:
        raise wording.error(ConfigError, f"run dir {run.path} was started with other settings (its "
                            "config.yaml): " + ", ".join(f"{k} is {b!r} there, {a!r} here" for k, a, b in changed)
                            + "; resume it with its own config, or start a new run in another run dir "
                              "({new_run_dir})")


def run_format(ck: checkpoint.Checkpoint) -> int:
    """The version of what the trainer recorded in a checkpoint (1: before configs were recorded)."""
    version = (ck.extra or {}).get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= RUN_FORMAT:
        raise CheckpointError(f"checkpoint file {ck.path}: run format {version!r} is not supported (this "
                              f"minicavs reads 1 to {RUN_FORMAT}; a newer minicavs wrote it?)")
    return version


def recorded_config(ck: checkpoint.Checkpoint, what: str) -> dict:
    run_format(ck)
    stored = ck.extra.get("config")
    if stored is None:
        raise CheckpointError(f"checkpoint file {ck.path} was written by an older minicavs (run format 1) "
                              f"that did not record its config: cannot {what}")
    return stored


def may_change_on_resume(key: str) -> bool:
    return key.startswith(RESUME_MAY_CHANGE)


def run_record(run: RunDir) -> tuple[dict, str, dict | None]:
    """(the recorded config a resumed run continues, where it is recorded, the checkpoint's extra or None):
    last.npz's, which must hold the model config.yaml names; or config.yaml's for a run stopped before its
    first checkpoint."""
    last = run.resumable()
    if last is None:
        raw = config_yaml(run)
        if raw is None:
            raise RunDirError(f"cannot resume: run dir {run.path} holds no checkpoint and its config.yaml "
                              "cannot be read as a config")
        return raw, "config.yaml", None
    stored = recorded_config(last, "resume it")
    check_run_model(last, run)
    return stored, "last.npz", last.extra


def config_yaml(run: RunDir) -> dict | None:
    """A run dir's config.yaml as recorded (None when missing or not a YAML mapping)."""
    try:
        raw = parse_yaml(run.config.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return raw if isinstance(raw, dict) and isinstance(raw.get("model"), dict) else None


def read_for_run(path, run: RunDir | None) -> checkpoint.Checkpoint:
    """Read a checkpoint (its values checked: finite) and, found in ``run``, check it holds the run's model."""
    ck = checkpoint.read(path)
    if run is not None:
        run_format(ck)
        check_run_model(ck, run)
    return ck


def check_run_model(ck: checkpoint.Checkpoint, run: RunDir) -> None:
    """A checkpoint of a run dir must hold the model of the run: the one its config.yaml names and, for
    another file than last.npz (best.npz), the one last.npz records."""
    stored = (ck.extra.get("config") or {}).get("model")
    if stored is None:
        return   # run format 1: no record to compare
    theirs = [("its config.yaml names", (config_yaml(run) or {}).get("model"))]
    if Path(ck.path).resolve() != run.last.resolve() and run.last.exists():
        last = checkpoint.read(run.last, finite=False)
        theirs.append(("its last.npz holds", (last.extra.get("config") or {}).get("model")))
    for they, model in theirs:
        if model is not None:
            refuse_other_model(stored, f"checkpoint file {ck.path} holds", model, f"but run dir {run.path} is a "
                                f"run of another model: {they}", "was the file copied from another run? Put the "
                                "run's own checkpoint back, or use this one with the config it was trained with "
                                f"({{alt[minicavs eval CONFIG --checkpoint {ck.path}|Trainer.for_checkpoint("
                                f"{str(ck.path)!r}, CONFIG)]}})", CheckpointError)


def refuse_other_model(ours: dict, we: str, theirs: dict, they: str, advice: str,
                        kind: type = ConfigError) -> None:
    """Raise ``kind`` naming both sides when two model sections differ (model name first)."""
    changed = differences(model_key(ours), model_key(theirs))
    if not changed:
        return
    name, other = model_key(ours)["name"], model_key(theirs)["name"]
    if name != other:
        what = f"{we} a {name} model, {they} a {other} model"
    else:
        what = (f"{we} a {name} model with " + ", ".join(f"model.{k} = {a!r}" for k, a, _ in changed)
                + f", {they} one with " + ", ".join(f"model.{k} = {b!r}" for k, _, b in changed))
    raise wording.error(kind, f"{what}; {advice}")


def model_key(model: dict) -> dict:
    """A model section compared by module name (a bundled name and a path to the same module agree)."""
    return {**model, "name": Path(str(model.get("name"))).stem}


def take_settings(cfg: dict, given: dict, prefixes: tuple) -> None:
    for section in ("data", "train"):
        for k, v in given[section].items():
            if f"{section}.{k}".startswith(prefixes) or f"{section}.{k}." in prefixes:
                cfg[section][k] = v


def check_vocabulary(stored, current, path, data_train) -> None:
    """The vocabulary a checkpoint was trained with must be the one the data gives, word for word."""
    if stored is None or current is None or list(stored) == list(current):
        return
    only_data = [w for w in current if w not in set(stored)]
    only_ck = [w for w in stored if w not in set(current)]
    if only_data or only_ck:
        what = "; ".join(f"{len(words)} {'word' if len(words) == 1 else 'words'} only in the {where} (e.g. "
                         f"{', '.join(map(repr, words[:3]))})"
                         for words, where in ((only_data, "data"), (only_ck, "checkpoint")) if words)
    else:
        i = next(i for i, (a, b) in enumerate(zip(stored, current)) if a != b)
        what = f"the same words in another order (id {i} is {stored[i]!r} there, {current[i]!r} here)"
    raise DataError(f"checkpoint file {path} was trained with another vocabulary than data.train "
                    f"({data_train}) gives: {len(stored)} vs {len(current)} words, {what}")
