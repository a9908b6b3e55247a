"""Training and evaluation from a config: the engine behind ``minicavs train|eval`` and the Python API.

    trainer = Trainer("models/tree_lstm.yaml", overrides=["train.epochs=3"], run_dir="runs/demo")
    history = trainer.fit()                       # per-epoch metrics, also in RUN_DIR/metrics.jsonl
    trainer.evaluate("test")
    result = trainer.loss_and_grads(trainer.task.data["dev"][:4])    # loss + gradient of every parameter
    Trainer.resuming("runs/demo").fit(resume=True)                   # a later process continues the run

Structure: :meth:`Trainer.fit` runs epochs; an epoch (:meth:`Trainer.train_epoch`) is a loop of
:meth:`Trainer.train_step` over the batches of :meth:`Trainer.epoch_batches`, then a dev evaluation, the
early-stopping rule, and the commit of the run directory (:mod:`minicavs.train.rundir`). A data-parallel trainer
splits each batch across workers inside ``train_step`` (sum the gradients between ``loss_and_grads`` and the
optimizer's step) and lets one worker commit.

Determinism: every random choice is counter-based. Parameters are initialised from (seed, name), the epoch's
sample order from (seed, epoch), dropout masks from (seed, step, site, sample id, vertex id). The checkpoint
written after each epoch therefore holds all the "RNG state" there is (seed, epoch, step) plus the
early-stopping state, and ``--resume`` continues exactly where an uninterrupted run would be.

Checkpoints written by the trainer record, besides parameters and optimizer state, the resolved config, the
vocabulary, the epoch, the early-stopping state and every epoch's metrics, so ``minicavs eval RUN_DIR`` and
``--resume`` rebuild the model from the checkpoint alone; what a checkpoint records and the checks that a run
resumed or evaluated is the run recorded are :mod:`minicavs.train.runrecord`'s. Every refusal comes before anything is
written, the run dir's lock included.

Under MPI rank 0 alone reads and writes the run dir (it need exist on rank 0 alone), so every decision that
precedes a collective (is the target a directory? is there a checkpoint?) is rank 0's, broadcast
(:func:`~minicavs.train.distributed.on_root`): ranks that each looked for themselves would pair their broadcasts up
wrongly.
"""
from __future__ import annotations

import math
import os
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core import onetime, wording
from ..core.errors import CheckpointError, DataError, MinicavsError
from ..data import vectors
from ..engine.backend import Backend as Device
from ..engine.compile import EngineOptions
from ..engine.executor import RunContext
from ..engine.model import Prepared, get_device
from ..runtime.scheduler import FsmPolicy, get_policy
from . import checkpoint, distributed, order, runrecord
from .config import ConfigError, dump, load_config, load_model_module, recorded
from .distributed import on_root
from .optim import make_optimizer
from .prefetch import prefetched
from .progress import Progress, duration
from .rundir import RunDir
from .runrecord import RUN_FORMAT, check_vocabulary, read_for_run, run_format

FSM_SAMPLE_BATCHES = 4   # training batches an FSM policy learns on before training


class Trainer:
    """A model, its data and optimizer built from a resolved config, and the run directory it trains into.

    Construction checks everything that can be checked before training (config values, the device, data
    that is missing, empty or undecodable, the early-stopping metric) and writes nothing. It also lays the
    parameters out (Model.plan_buffers), before handing any out: ``params[name].value`` is from then on each
    parameter's storage, which training, :meth:`load` and a resume write in place."""

    def __init__(self, config: dict | str | os.PathLike, overrides: Sequence[str] = (),
                 run_dir: str | os.PathLike | None = None, comm: "distributed.Communicator | None" = None,
                 restoring: dict | None = None):
        """``comm``: train data-parallel over its ranks (default: the MPI job's, when started by mpirun).
        ``restoring``: the ``extra`` of the checkpoint every parameter will be loaded from (eval, predict,
        ``--resume``): the model is built without reading files that only initialise parameters
        (``model.pretrained``'s vectors: the checkpoint holds the rows)."""
        self.cfg = config if isinstance(config, dict) else load_config(config, overrides)
        try:
            self.device = check_device(self.cfg["train"]["device"], self.cfg["train"]["deterministic"])
        except MinicavsError as e:   # CudaUnavailable: no CuPy or no GPU
            raise type(e)(f"{self.cfg['config_path']}: train.device = {self.cfg['train']['device']!r}: {e}") from None
        try:
            self.policy = get_policy(self.cfg["train"]["policy"])
        except ValueError as e:
            raise ConfigError(f"{self.cfg['config_path']}: train.policy: {e}") from None
        module = load_model_module(self.cfg["model"]["name"], Path(self.cfg["config_path"]).resolve().parent)
        try:
            self.task = module.build(self.cfg if restoring is None else {**self.cfg, "restoring": restoring})
        except MinicavsError:
            raise
        except ValueError as e:  # a model's check of its config values (model.variant, an initializer, ...)
            raise ConfigError(f"{self.cfg['config_path']}: {e}") from e
        self._check_data()
        self._check_order()
        for samples in self.task.data.values():
            self.task.prepare(samples)
        self.model = self.task.model
        self.model.policy = self.policy   # evaluation schedules with the same (learned) policy
        self.model.options = engine_options(self.cfg["train"]["engine"])
        self.model.device = self.device
        self.device.keep_freed_memory()   # each step's large arrays reuse the last step's pages (on the CPU)
        self.params = self.task.params
        for p in self.params.values():   # parameters (and so the optimizer's slots) live on the device
            p.value = self.device.asarray(p.value)
        # the layout moves parameter storage, so it happens here, before any array is handed out: from now
        # on each parameter's value is its storage for good (trained, loaded and resumed in place)
        self.model.plan_buffers(self.params)
        tc = self.cfg["train"]
        kw = dict(lr=tc["lr"], weight_decay=tc["weight_decay"], clip_norm=tc["clip_norm"],
                  sparse_updates=tc["sparse_updates"])
        # a frozen parameter (model.freeze_embeddings) has no gradient and no optimizer slot
        self.optimizer = make_optimizer(tc["optimizer"], self.params.trainable(), **kw)
        self.seed = int(tc["seed"])
        self.epoch = 0
        self.history: list[dict] = []
        es = tc["early_stopping"] or {}
        self.early = {"metric": es.get("metric") or f"dev_{self.task.key_metric}",
                      "mode": es.get("mode") or self.task.key_mode, "patience": es.get("patience"),
                      "best": None, "best_epoch": None, "bad_epochs": 0, "stopped": False}
        self._check_early_stopping()
        self.run = RunDir(run_dir if run_dir else Path("runs") / self.cfg["config_name"])
        self.words = wording.PYTHON   # advice in logs speaks Python arguments; the CLI sets wording.CLI
        # --- data parallelism (the logic is in distributed.py): None in a single process ---
        comm = comm if comm is not None else distributed.world()
        self.parallel = distributed.DataParallel(self, comm) if comm is not None and comm.size > 1 else None
        self.is_root = self.parallel is None or self.parallel.root   # rank 0 alone writes and prints

    @property
    def run_dir(self) -> Path:
        return self.run.path

    @classmethod
    def resuming(cls, run_dir: str | os.PathLike, overrides: Sequence[str] = (),
                 config: str | os.PathLike | None = None, log: Callable[[str], None] = print) -> "Trainer":
        """A trainer for ``run_dir``'s run, rebuilt from its last.npz (or, stopped before its first
        checkpoint, its config.yaml: resuming starts it over); ``fit(resume=True)`` then continues it.

        ``overrides`` may change only :data:`~minicavs.train.runrecord.RESUME_MAY_CHANGE`. ``config``, a config
        named as well (``minicavs train CONFIG --resume``), must configure the run's model (its module: another
        model is refused); the run's recorded settings are used, and where the config's differ a note says so
        (as eval does).
        Everything is checked before anything is written."""
        cfg, path, extra = runrecord.resumed_run(run_dir, overrides, config, log)
        return cls(cfg, run_dir=path, restoring=extra)

    @classmethod
    def for_target(cls, target: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                   overrides: Sequence[str] = ()) -> tuple["Trainer", Path]:
        """For eval and predict: (trainer, checkpoint) of a run dir (its recorded config, its best checkpoint
        unless ``checkpoint`` names another) or of a config file with ``checkpoint``."""
        comm = distributed.world()   # under MPI rank 0 reads the run dir (it need not exist elsewhere)
        if on_root(comm, lambda: Path(target).is_dir()):
            run = RunDir(target)
            ck = Path(checkpoint) if checkpoint else on_root(comm, run.best_checkpoint)
            return cls.for_checkpoint(ck, None, overrides, run=run), ck
        if checkpoint is None:   # (every rank, on rank 0's answer: said once)
            raise distributed.on_every_rank(wording.error(
                ConfigError, f"{target} is not a run dir: give the checkpoint to use with {{checkpoint}} "
                "(e.g. RUN_DIR/best.npz), or give the run dir"))
        return cls.for_checkpoint(checkpoint, target, overrides), Path(checkpoint)

    @classmethod
    def for_checkpoint(cls, path: str | os.PathLike, config: str | os.PathLike | None = None,
                       overrides: Sequence[str] = (), log: Callable[[str], None] = print,
                       run: RunDir | None = None) -> "Trainer":
        """A trainer with the model a checkpoint records and its parameters loaded (for eval and predict):
        data and how to run (:data:`~minicavs.train.runrecord.EVAL_FROM_CONFIG`) come from ``config`` and
        ``overrides`` if given. ``run``: the run dir it was found in, whose model (config.yaml, last.npz) it
        must hold."""
        ck = on_root(distributed.world(), lambda: read_for_run(path, run))
        run_format(ck)
        stored = ck.extra.get("config")
        if stored is None:    # run format 1: the config must be given and must fit
            if config is None:
                raise wording.error(CheckpointError, f"checkpoint file {path} was written by an older minicavs and "
                                    "does not record its config: give it, e.g. {alt[minicavs eval CONFIG --checkpoint "
                                    f"{path}|Trainer.for_checkpoint({str(path)!r}, CONFIG)]}}")
            trainer = cls(config, overrides, restoring=ck.extra or {})
        else:
            cfg = runrecord.evaluated_config(ck, path, config, overrides, log)
            trainer = cls(cfg, restoring=ck.extra or {})
        trainer.load(path, optimizer=False, ck=ck)
        return trainer

    def _check_data(self) -> None:
        for split, samples in self.task.data.items():
            if len(samples) == 0:
                src = self.cfg["data"].get(split, split)
                raise DataError(f"data.{split} ({src}) holds no samples"
                                + ("; training needs at least one" if split == "train" else ""))

    def _check_order(self) -> None:
        if self.cfg["train"]["order"] == "bucket" and self.task.sample_lengths(self.task.data["train"][:1]) is None:
            raise ConfigError(f"{self.cfg['config_path']}: train.order = 'bucket': model "
                              f"{self.cfg['model']['name']} gives no sample lengths to bucket by "
                              "(Task.sample_lengths); use train.order=shuffle")

    def _check_early_stopping(self) -> None:
        e, metrics = self.early, ["train_loss"] + [f"dev_{m}" for m in self.task.metrics]
        where = f"{self.cfg['config_path']}: train.early_stopping"
        if e["metric"] not in metrics:   # (without dev data a dev metric never stops a run: best = latest)
            raise ConfigError(f"{where}.metric = {e['metric']!r}: must be one of {', '.join(metrics)}")

    # --- one batch --------------------------------------------------------------------------------------

    def context(self, training: bool = True) -> RunContext:
        return RunContext(seed=self.seed, step=self.optimizer.steps, training=training)

    def loss_and_grads(self, samples, training: bool = True, sample_ids=None):
        """Forward and backward over ``samples``: a Result with ``loss`` and ``grads`` (name -> array)."""
        _not_empty(samples, "Trainer.loss_and_grads", "samples")
        self.prepare_policy()
        graphs, feeds = self.task.batch(samples)
        return self.model.forward_backward(graphs, feeds, self.params, self.context(training),
                                           policy=self.policy, sample_ids=sample_ids)

    def prepare_policy(self) -> bool:
        """An ``fsm`` policy learns its FSM (ED-Batch §2.3) on a seeded sample of training batches before
        the first step (every rank the same: same seed, same samples); returns whether it learned one now.
        :meth:`fit` writes it to RUN_DIR/fsm.json, checkpoints carry it (resume and eval reuse it)."""
        policy = self.policy
        if not isinstance(policy, FsmPolicy) or policy.learned:
            return False
        data = self.task.data["train"]
        bs = self.cfg["train"]["batch_size"]
        pick = np.random.default_rng([self.seed, 18]).permutation(len(data))[:FSM_SAMPLE_BATCHES * bs]
        by_structure: dict = {}
        for i in range(0, len(pick), bs):
            graphs, _ = self.task.batch([data[j] for j in pick[i:i + bs]])
            for name, batch in self.model.batches(graphs).items():
                by_structure.setdefault(name, []).append(batch)
        for batches in by_structure.values():
            policy.learn(batches)
        return True

    def prepare_step(self, sample_ids: np.ndarray) -> "PreparedStep":
        """The part of a training step that reads no parameter: the samples' graphs and feeds, their
        schedule and memory plan (:meth:`Model.prepare`). With ``train.prefetch`` it runs on a background
        thread for the next batch while the current one trains."""
        _not_empty(sample_ids, "Trainer.prepare_step", "sample_ids")
        samples = [self.task.data["train"][i] for i in sample_ids]
        graphs, feeds = self.task.batch(samples)
        return PreparedStep(self.model.prepare(graphs, self.policy, sample_ids), feeds, self.task.units(samples))

    def train_step(self, sample_ids: np.ndarray, prepared: "PreparedStep | None" = None) -> tuple[float, int]:
        """One optimizer step on the training samples ``sample_ids`` (``prepared``: their
        :meth:`prepare_step`, made ahead): (mean loss, units processed). Under MPI each rank computes its
        shard of the batch and the gradients are summed over ranks."""
        _not_empty(sample_ids, "Trainer.train_step", "sample_ids")
        if self.parallel:
            res, units = self.parallel.loss_and_grads(sample_ids)
        else:
            self.prepare_policy()
            prepared = prepared or self.prepare_step(sample_ids)
            res = self.model.forward_backward(prepared.batch, prepared.feeds, self.params, self.context(True),
                                              outputs=False)   # a step reads the loss and gradients only
            units = prepared.units
        self.optimizer.step(res.grads, loss=res.loss)
        return self.optimizer.last_loss, units   # (read in the step's one device-to-host copy on a device)

    def train_batches(self, batches: Sequence[np.ndarray], label: str = "training",
                      after_step: Callable[[np.ndarray, float, int], None] | None = None) -> tuple[float, int, int]:
        """:meth:`train_step` on each batch of sample ids in turn (``after_step(ids, loss, units)`` after
        each); returns (sum of loss x samples, samples, units). With ``train.prefetch`` (one process) the
        next batch is prepared while one trains, with the same results bit for bit; an error preparing a
        batch names it (``label`` batch i of n) and is raised when the batches before it have trained,
        with or without prefetching."""
        self.prepare_policy()   # an FSM is learned before the first step, not on the prefetch thread

        def prepare(i: int):
            if self.parallel:   # each rank prepares its own shard inside the step
                return None
            try:
                return self.prepare_step(batches[i])
            except Exception as e:
                named = _naming(e, f"{label} batch {i + 1} of {len(batches)}")
                if named is e:
                    raise
                raise named from e.__cause__
        total, weight, units = 0.0, 0, 0
        ahead = bool(self.cfg["train"]["prefetch"]) and self.parallel is None
        with closing(prefetched(prepare, range(len(batches)), ahead)) as stream:
            for idx, prepared in zip(batches, stream):
                loss, n = self.train_step(idx, prepared)
                total += loss * len(idx)
                weight += len(idx)
                units += n
                if after_step:
                    after_step(idx, loss, n)
        return total, weight, units

    # --- epochs -----------------------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Every training sample id in ``epoch``'s order (``train.order``), batch after batch."""
        return np.concatenate(self.epoch_batches(epoch))

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The sample ids of each batch of ``epoch`` (1-based), in order (``train.order``: order.py)."""
        data, bs = self.task.data["train"], self.cfg["train"]["batch_size"]
        rng = np.random.default_rng([self.seed, epoch])
        if self.cfg["train"]["order"] == "bucket":
            return order.bucketed(self.task.sample_lengths(data), bs, rng)
        return order.shuffled(len(data), bs, rng)

    def train_epoch(self, progress: bool = True, epochs: int | None = None) -> dict:
        batches = self.epoch_batches(self.epoch + 1)
        label = f"epoch {self.epoch + 1}" + (f"/{epochs}" if epochs else "")
        bar = Progress(len(batches), label, self.task.unit, every=self.cfg["train"]["log_every"]) \
            if progress and self.is_root else None
        start, once = time.perf_counter(), onetime.seconds()
        total, weight, units = self.train_batches(batches, f"epoch {self.epoch + 1}: training",
                                                  (lambda _, loss, n: bar.update(n, loss=loss)) if bar else None)
        if bar:
            bar.close()
        seconds, once = time.perf_counter() - start, onetime.seconds() - once
        self.epoch += 1
        timing = {"epoch_seconds": seconds, f"train_{self.task.unit}_per_s": units / max(seconds - once, 1e-9)}
        if once:   # compiling kernels on a cold cache: not what the throughput measures
            timing["one_time_s"] = once
        return {"train_loss": total / max(weight, 1), "timing": timing}

    def evaluate(self, split: str = "dev") -> dict:
        samples = self.task.data.get(split)
        if not samples:
            raise MinicavsError(f"no '{split}' data in this config (data.{split})")
        self.prepare_policy()
        start = time.perf_counter()
        bs = self.cfg["train"]["eval_batch_size"]
        metrics = self.parallel.evaluate(samples, bs) if self.parallel else self.task.evaluate(samples, bs)
        metrics = {f"{split}_{k}": v for k, v in metrics.items()}
        metrics["timing"] = {f"{split}_seconds": time.perf_counter() - start}
        return metrics

    def fit(self, epochs: int | None = None, resume: bool = False, progress: bool = True,
            log: Callable[[str], None] = print, force: bool = False) -> list[dict]:
        """Train to ``epochs`` (default: the config's), evaluating on dev and committing the run dir after
        every epoch; returns the metric rows of the epochs trained by this call.

        A new run refuses a run dir that holds a run unless ``force``; ``resume`` continues the run dir's
        last.npz (the trainer must have been built for it: :meth:`resuming`)."""
        epochs = self.cfg["train"]["epochs"] if epochs is None else epochs
        log = log if self.is_root else _quiet   # under MPI rank 0 alone reads and writes the run dir, and speaks
        # one writer per run dir (rundir's protocol); no directory to resume: _fit's error says so. Decided on
        # rank 0, the one rank that sees the run dir: every rank makes the same collective calls
        self._on_root(lambda: self._check_before_lock(resume, force))   # a refusal leaves even .lock alone
        self._on_root(lambda: self.run.lock() if not resume or self.run.path.is_dir() else None)
        try:
            with onetime.announcing(log):   # compiling kernels, learning an FSM: said once, as they start
                return self._fit(epochs, resume, progress, log, force)
        finally:
            self.run.unlock()

    def _fit(self, epochs: int, resume: bool, progress: bool, log: Callable[[str], None],
             force: bool) -> list[dict]:
        path = self._on_root(lambda: getattr(self.run.resumable(), "path", None)) if resume else None
        if path is not None:
            self.load(path)
            self._on_root(self._check_best)   # final_results will load it: refused now, before any write
            for what in self._on_root(lambda: self.run.recover(checkpoint.read(path), self._config_text())):
                log(f"repaired {self.run.path}: {what}")
            log(f"resumed {self.run.path} at epoch {self.epoch} (step {self.optimizer.steps})" + self.device_note())
            why = self._nothing_to_train(epochs)
            if why:
                log(why)
        else:
            if resume:   # stopped before its first checkpoint: no epoch to continue, so it starts over
                self._on_root(lambda: runrecord.check_started(self.run, self.cfg))
                log(f"run dir {self.run.path} holds no checkpoint yet (stopped before its first epoch ended): "
                    "starting the run over from its config.yaml")
            self._on_root(lambda: self.run.start(self._config_text(), force or resume))
            if self.parallel:
                self.parallel.sync_state()   # every rank starts from rank 0's parameters (and checks it)
            frozen = sum(p.value.size for p in self.params.values() if not p.trainable)
            log(f"training {Path(self.cfg['model']['name']).stem} ({sum(p.value.size for p in self.params.values()):,}"
                f" parameters{f', {frozen:,} of them frozen' if frozen else ''}) on {len(self.task.data['train']):,}"
                f" samples; run dir {self.run.path}" + (f"; {self.parallel.comm.size} ranks" if self.parallel else "")
                + self.device_note())
            for name, p in self.params.items():
                if p.source is not None:
                    log(vectors.describe(name, p.source, frozen=not p.trainable))
        if self.prepare_policy():   # a new FSM: learned before the first step, kept beside the run's files
            self._on_root(lambda: self.run.write_fsm(self.policy.to_json()))
        rows = []
        has_dev = bool(self.task.data.get("dev"))
        started = time.perf_counter()
        while self.epoch < epochs and not self.early["stopped"]:
            row = {"epoch": self.epoch + 1}
            row.update(self.train_epoch(progress, epochs))
            row["step"] = self.optimizer.steps
            if has_dev:
                dev = self.evaluate("dev")
                timing = {**row.pop("timing"), **dev.pop("timing")}
                row.update(dev)
                row["timing"] = timing
            self._early_stopping(row)
            self.history.append(row)
            if self.is_root:
                self._commit()
            rows.append(row)
            left = (time.perf_counter() - started) / len(rows) * (epochs - self.epoch)
            log(self.format_epoch(row, epochs, left))
            if self.early["stopped"]:
                e = self.early
                log(f"early stopping: {e['metric']} has not improved for {e['bad_epochs']} epochs (best "
                    f"{_value(e['metric'], e['best'])} at epoch {e['best_epoch']}); stopped after epoch "
                    f"{self.epoch} of {epochs}")
        return rows

    def _on_root(self, work: Callable):
        return on_root(self.parallel.comm if self.parallel else None, work)

    def _check_before_lock(self, resume: bool, force: bool) -> None:
        """What refuses a run, checked before the lock is taken (and again under it): the checkpoints a
        resumed run loads, or a run dir a new run may not take."""
        if not resume:
            self.run.check_start(force)
            return
        last = self.run.resumable()
        if last is None:
            runrecord.check_started(self.run, self.cfg)
        else:
            self._verify(last.path, True, last)
            self._check_best()

    def _nothing_to_train(self, epochs: int) -> str | None:
        """Why a resumed run will train no epoch, with how to go on; None when it will train."""
        e = self.early
        if e["stopped"]:
            return self.words.say(
                f"stopped early at epoch {self.epoch}: {e['metric']} has not improved for {e['bad_epochs']} epochs "
                f"(best {_value(e['metric'], e['best'])} at epoch {e['best_epoch']}); to train on, resume with "
                f"{{set[train.early_stopping.patience=N]}} (N > {e['bad_epochs']}) or "
                "{set[train.early_stopping=null]}")
        if self.epoch >= epochs:
            return self.words.say(f"the run has trained {self.epoch} of {epochs} epochs: nothing to train; to train "
                                  f"longer, resume with {{set[train.epochs=N]}} (N > {self.epoch})")
        return None

    def _check_best(self) -> None:
        """The best checkpoint a resumed run's end will load fits this model (best.npz can be another file
        than last.npz: copied in, damaged)."""
        best = self.run.best_checkpoint()
        if best != self.run.last:
            self._verify(best, optimizer=False, ck=read_for_run(best, self.run))

    def _commit(self) -> None:
        """End an epoch (rundir's protocol): last.npz (the commit point), metrics.jsonl, best.npz."""
        self.save(self.run.last)
        self.run.write_metrics(self.history)
        if self.early["best_epoch"] == self.epoch:
            self.save(self.run.best)

    def _config_text(self) -> str:
        return dump(self.cfg, header="The resolved config of this run: every default filled in, data paths "
                                     "absolute.\nminicavs train RUN_DIR/config.yaml --run-dir NEW repeats it.")

    def _early_stopping(self, row: dict) -> None:
        e = self.early
        if e["metric"] not in row:  # no dev data: the latest epoch is the best
            e.update(best_epoch=self.epoch)
            return
        value = row[e["metric"]]
        better = e["best"] is None or (value > e["best"] if e["mode"] == "max" else value < e["best"])
        if better:
            e.update(best=value, best_epoch=self.epoch, bad_epochs=0)
        else:
            e["bad_epochs"] += 1
            if e["patience"] is not None and e["bad_epochs"] >= e["patience"]:
                e["stopped"] = True

    def format_epoch(self, row: dict, epochs: int, seconds_left: float | None = None) -> str:
        """One compact line: losses, the early-stopping metric, time and throughput."""
        parts = [f"train loss {row['train_loss']:#.4g}"]
        if "dev_loss" in row:
            parts.append(f"dev loss {row['dev_loss']:#.4g}")
        metric = self.early["metric"]
        if metric in row and metric != "dev_loss":
            parts.append(f"{metric.replace('_', ' ', 1)} {_value(metric, row[metric])}")
        if self.early["best_epoch"] == row["epoch"] and "dev_loss" in row:
            parts[-1] += " (best)"
        t = row.get("timing", {})
        rate = t.get(f"train_{self.task.unit}_per_s")
        took = sum(v for k, v in t.items() if k.endswith("_seconds"))
        once = f" without the {t['one_time_s']:.1f} s of one-time work" if t.get("one_time_s") else ""
        timing = f"{took:.1f} s" + (f" ({rate:,.0f} {self.task.unit}/s{once})" if rate else "")
        if seconds_left and seconds_left >= 1:
            timing += f", {duration(seconds_left)} left"
        return f"epoch {row['epoch']}/{epochs}: " + ", ".join(parts) + f"; {timing}"

    def device_note(self) -> str:
        """'; device D' for a log line, where the run is not on the CPU (an emulated device says so)."""
        return "" if self.device.name == "cpu" else f"; device {self.device.description}"

    def final_results(self, log: Callable[[str], None] = print) -> dict:
        """Load the best checkpoint, evaluate it on dev and test, write RUN_DIR/results.json."""
        log = log if self.is_root else _quiet
        # no directory: _final_results's error says so (the lock would create it); decided on rank 0 alone
        self._on_root(lambda: self.run.lock() if self.run.path.is_dir() else None)
        try:
            return self._final_results(log)
        finally:
            self.run.unlock()

    def _final_results(self, log: Callable[[str], None]) -> dict:
        best = self._on_root(self.run.best_checkpoint)
        extra = self.load(best, optimizer=False)
        results = {"checkpoint": best.name, "epoch": extra.get("epoch"), "step": extra.get("rng", {}).get("step"),
                   "device": self.device.description, "timing": {}}
        for split in ("dev", "test"):
            if self.task.data.get(split):
                metrics = self.evaluate(split)
                results["timing"].update(metrics.pop("timing"))
                results.update(metrics)
                log(f"best checkpoint (epoch {results['epoch']}) on {split}: " + format_metrics(metrics))
        if self.is_root:
            self.run.write_results(results)
        log(f"results in {self.run.results}")
        return results

    # --- checkpoints ------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        extra = {"version": RUN_FORMAT, "epoch": self.epoch,
                 "rng": {"seed": self.seed, "epoch": self.epoch, "step": self.optimizer.steps},
                 "early_stopping": dict(self.early), "config": recorded(self.cfg),
                 "vocab": self.task.vocabulary, "history": self.history}
        sources = {name: p.source for name, p in self.params.items() if p.source is not None}
        if sources:   # where pretrained rows came from: eval and --resume take them from here, not the file
            extra["pretrained"] = sources
        if isinstance(self.policy, FsmPolicy) and self.policy.learned:
            extra["policy"] = self.policy.to_json()   # resume and eval schedule with the same FSM
        checkpoint.save(path, self.params, self.optimizer, self.optimizer.steps, extra=extra)

    def load(self, path: str | os.PathLike, optimizer: bool = True,
             ck: checkpoint.Checkpoint | None = None) -> dict:
        """Restore parameters (and with ``optimizer`` the optimizer, epoch, early-stopping state and
        history) and a learned FSM policy from a checkpoint; everything is checked first, so an error
        changes nothing. Under MPI rank 0 reads the file and every rank gets the state."""
        if self.parallel:
            extra = self.parallel.load(path, optimizer)
            if isinstance(self.policy, FsmPolicy) and "policy" in extra:   # rank 0 checked it
                self.policy.fsms = FsmPolicy.from_json(extra["policy"]).fsms
            return extra
        return self._load(path, optimizer, ck)

    def _load(self, path: str | os.PathLike, optimizer: bool = True,
              ck: checkpoint.Checkpoint | None = None) -> dict:
        ck, early, fsms = self._verify(path, optimizer, ck)
        checkpoint.apply(ck, self.params, self.optimizer if optimizer else None)
        if fsms is not None:
            self.policy.fsms = fsms
        if optimizer:
            self.epoch = int(ck.extra.get("epoch", 0))
            self.early = early
            self.history = list(ck.extra.get("history", []))
        return ck.extra or {}

    def _verify(self, path: str | os.PathLike, optimizer: bool = True, ck: checkpoint.Checkpoint | None = None
                ) -> tuple[checkpoint.Checkpoint, dict | None, list | None]:
        """Every check :meth:`_load` makes, changing nothing: (the checkpoint, the early-stopping state to
        continue with, the FSMs of a learned policy or None)."""
        ck = ck or checkpoint.read(path)   # ck: the file, already read
        extra = ck.extra or {}
        runrecord.check_recorded(ck, self.cfg, path, optimizer)
        early = self._resumed_early(extra.get("early_stopping") or {}, path) if optimizer else None
        if "vocab" in extra:
            check_vocabulary(extra["vocab"], self.task.vocabulary, path, self.cfg["data"].get("train"))
        fsms = None
        if isinstance(self.policy, FsmPolicy) and "policy" in extra:
            try:
                fsms = FsmPolicy.from_json(extra["policy"]).fsms
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"checkpoint file {path}: its FSM policy cannot be read: {e}") from None
        checkpoint.check(ck, self.params, self.optimizer if optimizer else None)
        return ck, early, fsms

    def _resumed_early(self, stored: dict, path) -> dict:
        """The early-stopping state a resumed run continues with: the run's record (best value and epoch,
        epochs without improvement) under this config's patience (None: early stopping off), so a run that
        early stopping ended trains on with a larger patience. The metric and mode stay the run's: they say
        which epoch is the best, and best.npz holds it."""
        mine = self.early
        if self.cfg["train"]["early_stopping"] is not None:
            for key in ("metric", "mode"):
                if stored.get(key) not in (None, mine[key]):
                    raise CheckpointError(f"checkpoint file {path}: the run's early stopping has {key} "
                                          f"{stored[key]!r}, this config {mine[key]!r}: a resumed run keeps the "
                                          "metric that chose its best epoch; start a new run to change it")
        early = {**mine, **stored, "patience": mine["patience"]}
        early["stopped"] = early["patience"] is not None and early.get("bad_epochs", 0) >= early["patience"]
        return early


@dataclass(frozen=True)
class PreparedStep:
    """A training batch made ready to run by :meth:`Trainer.prepare_step`."""

    batch: Prepared      # the model's scheduled and planned batch
    feeds: dict
    units: int           # what throughput counts (trees, words)


def _naming(e: Exception, where: str) -> Exception:
    """``e`` with ``where`` in front of its message (same type; a minicavs error's message is its only
    argument), or ``e`` itself with a note where its type takes other arguments."""
    if isinstance(e, MinicavsError) and len(e.args) == 1:
        try:
            named = type(e)(f"{where}: {e}")
            return named.with_traceback(e.__traceback__)
        except TypeError:
            pass
    if hasattr(e, "add_note"):   # Python 3.11+: shown under the traceback
        e.add_note(f"(while preparing {where})")
    return e


def _quiet(_: str) -> None:
    pass



def format_metrics(metrics: dict) -> str:
    return "  ".join(f"{k} {_value(k, v)}" for k, v in metrics.items() if k != "timing")


def _value(key: str, v) -> str:
    """Accuracies as percentages, other numbers with 4 significant digits."""
    if not isinstance(v, float) or not math.isfinite(v):
        return str(v)
    return f"{100 * v:.1f}%" if key.endswith("acc") else f"{v:#.4g}"


def check_device(device: str, deterministic: bool = False) -> Device:
    """The device to train on, or an error before any work when it cannot be used: at start, never
    mid-epoch (CudaUnavailable names what is missing: CuPy, a device)."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"train.device: unknown device {device!r}; known: cpu, cuda")
    return get_device(device, deterministic)


def engine_options(cfg: dict) -> EngineOptions:
    unknown = set(cfg) - set(EngineOptions.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown config key(s) train.engine.{', train.engine.'.join(sorted(unknown))}; "
                          f"known: {', '.join(EngineOptions.__dataclass_fields__)}")
    return EngineOptions(**{k: str(v) if k == "runner" else bool(v) for k, v in cfg.items()})


def _not_empty(samples, where: str, what: str) -> None:
    """Refuse an empty batch before anything runs: a step over no samples has no loss to take a mean of."""
    if len(samples) == 0:
        from ..core.errors import FeedError   # (here: the module's imports are other work's to change)
        raise FeedError(f"{where}: the batch is empty ({what} holds no sample); a step needs at least one")
