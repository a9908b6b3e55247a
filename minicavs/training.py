"""Training and evaluation from a config: the engine behind ``minicavs train|eval`` and the Python API.

    trainer = Trainer("models/tree_lstm.yaml", overrides=["train.epochs=3"])
    history = trainer.fit()                       # per-epoch metrics, also in RUN_DIR/metrics.jsonl
    trainer.evaluate("test")
    result = trainer.loss_and_grads(trainer.task.data["dev"][:4])    # loss + gradient of every parameter

Determinism: every random choice is counter-based. Parameters are initialised from (seed, name), the epoch's
sample order from (seed, epoch), dropout masks from (seed, step, site, sample id, vertex id). The checkpoint
written after each epoch therefore holds all the "RNG state" there is (seed, epoch, step) plus the data
position and the early-stopping state, and ``--resume`` continues exactly where an uninterrupted run would be.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import checkpoint, distributed
from .config import ConfigError, load_config, load_model_module
from .backend import Backend as Device
from .engine import EngineOptions
from .errors import MinicavsError
from .executor import RunContext
from .model import get_device
from .optim import make_optimizer
from .progress import Progress
from .scheduler import FsmPolicy, get_policy

CHECKPOINT_FORMAT_EXTRA = 1
FSM_SAMPLE_BATCHES = 4   # training batches an FSM policy learns on before training


class Trainer:
    def __init__(self, config: dict | str | os.PathLike, overrides: Sequence[str] = (),
                 run_dir: str | os.PathLike | None = None, comm: "distributed.Communicator | None" = None):
        """``comm``: train data-parallel over its ranks (default: the MPI job's, when started by mpirun)."""
        self.cfg = config if isinstance(config, dict) else load_config(config, overrides)
        self.device = check_device(self.cfg["train"]["device"], self.cfg["train"]["deterministic"])
        try:
            self.policy = get_policy(self.cfg["train"]["policy"])
        except ValueError as e:
            raise ConfigError(f"{self.cfg['config_path']}: train.policy: {e}") from None
        module = load_model_module(self.cfg["model"]["name"], Path(self.cfg["config_path"]).resolve().parent)
        try:
            self.task = module.build(self.cfg)
        except MinicavsError:
            raise
        except ValueError as e:  # a model's check of its config values (model.variant, an initializer, ...)
            raise ConfigError(f"{self.cfg['config_path']}: {e}") from e
        self.model = self.task.model
        self.model.policy = self.policy   # evaluation schedules with the same (learned) policy
        self.model.options = engine_options(self.cfg["train"]["engine"])
        self.model.device = self.device
        self.params = self.task.params
        for p in self.params.values():   # parameters (and so the optimizer's slots) live on the device
            p.value = self.device.asarray(p.value)
        tc = self.cfg["train"]
        kw = dict(lr=tc["lr"], weight_decay=tc["weight_decay"], clip_norm=tc["clip_norm"],
                  sparse_updates=tc["sparse_updates"])
        self.optimizer = make_optimizer(tc["optimizer"], self.params.values(), **kw)
        self.seed = int(tc["seed"])
        self.epoch = 0
        es = tc["early_stopping"] or {}
        self.early = {"metric": es.get("metric", f"dev_{self.task.key_metric}"),
                      "mode": es.get("mode", self.task.key_mode), "patience": es.get("patience"),
                      "best": None, "best_epoch": None, "bad_epochs": 0, "stopped": False}
        self.run_dir = Path(run_dir) if run_dir else Path("runs") / self.cfg["config_name"]
        # --- data parallelism (issue 19; the logic is in distributed.py): None in a single process ---
        comm = comm if comm is not None else distributed.world()
        self.parallel = distributed.DataParallel(self, comm) if comm is not None and comm.size > 1 else None
        self.is_root = self.parallel is None or self.parallel.root   # rank 0 alone writes and prints

    # --- one batch --------------------------------------------------------------------------------------

    def context(self, training: bool = True) -> RunContext:
        return RunContext(seed=self.seed, step=self.optimizer.steps, training=training)

    def loss_and_grads(self, samples, training: bool = True, sample_ids=None):
        """Forward and backward over ``samples``: a Result with ``loss`` and ``grads`` (name -> array)."""
        self.prepare_policy()
        graphs, feeds = self.task.batch(samples)
        return self.model.forward_backward(graphs, feeds, self.params, self.context(training),
                                           policy=self.policy, sample_ids=sample_ids)

    def prepare_policy(self) -> None:
        """An ``fsm`` policy learns its FSM (ED-Batch §2.3) on a seeded sample of training batches before
        the first step, and writes it to RUN_DIR/fsm.json; checkpoints carry it too."""
        policy = self.policy
        if not isinstance(policy, FsmPolicy) or policy.learned:
            return
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
        if self.is_root:   # every rank learns the same FSM (same seed, same samples); one writes it
            self.run_dir.mkdir(parents=True, exist_ok=True)
            policy.save(self.run_dir / "fsm.json")

    # --- epochs -----------------------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.task.data["train"]))

    def train_epoch(self, progress: bool = True) -> dict:
        data = self.task.data["train"]
        bs = self.cfg["train"]["batch_size"]
        order = self.epoch_order(self.epoch + 1)
        batches = [order[i:i + bs] for i in range(0, len(order), bs)]
        bar = Progress(len(batches), f"epoch {self.epoch + 1}", self.task.unit,
                       every=self.cfg["train"]["log_every"]) if progress and self.is_root else None
        total, weight, units = 0.0, 0, 0
        start = time.perf_counter()
        for idx in batches:
            if self.parallel:   # issue 19: this rank's shard of the batch, gradients summed over ranks
                res, n = self.parallel.loss_and_grads(idx)
            else:
                samples = [data[i] for i in idx]
                res, n = self.loss_and_grads(samples, sample_ids=idx), self.task.units(samples)
            self.optimizer.step(res.grads, loss=res.loss)
            total += res.loss * len(idx)
            weight += len(idx)
            units += n
            if bar:
                bar.update(n, loss=res.loss)
        if bar:
            bar.close()
        seconds = time.perf_counter() - start
        self.epoch += 1
        return {"train_loss": total / max(weight, 1),
                "timing": {"epoch_seconds": seconds, f"train_{self.task.unit}_per_s": units / seconds}}

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
            log: Callable[[str], None] = print) -> list[dict]:
        """Train to ``epochs`` (default: the config's), evaluating on dev and checkpointing every epoch."""
        epochs = self.cfg["train"]["epochs"] if epochs is None else epochs
        root, log = self.is_root, log if self.is_root else _quiet
        if root:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.run_dir / "metrics.jsonl"
        last = self.run_dir / "last.npz"
        if resume and (self.parallel.bcast(last.exists()) if self.parallel else last.exists()):
            self.load(last)
            if root:
                _truncate_metrics(metrics_path, self.epoch)
            log(f"resumed from {last} at epoch {self.epoch} (step {self.optimizer.steps})")
        elif self.parallel:
            self.parallel.sync_state()   # every rank starts from rank 0's parameters (and checks it)
        if not resume and root and metrics_path.exists():
            metrics_path.unlink()
        self.prepare_policy()
        history = []
        has_dev = bool(self.task.data.get("dev"))
        while self.epoch < epochs and not self.early["stopped"]:
            row = {"epoch": self.epoch + 1}
            row.update(self.train_epoch(progress))
            row["step"] = self.optimizer.steps
            if has_dev:
                dev = self.evaluate("dev")
                timing = {**row.pop("timing"), **dev.pop("timing")}
                row.update(dev)
                row["timing"] = timing
                self._early_stopping(row)
            log(_format(row))
            if root:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                self.save(last)
                if self.early["best_epoch"] == self.epoch or not has_dev:
                    self.save(self.run_dir / "best.npz")
            history.append(row)
        return history

    def _early_stopping(self, row: dict) -> None:
        e = self.early
        value = row.get(e["metric"])
        if value is None:
            raise MinicavsError(f"early stopping metric '{e['metric']}' is not among {sorted(row)}")
        better = e["best"] is None or (value > e["best"] if e["mode"] == "max" else value < e["best"])
        if better:
            e.update(best=value, best_epoch=self.epoch, bad_epochs=0)
        else:
            e["bad_epochs"] += 1
            if e["patience"] is not None and e["bad_epochs"] >= e["patience"]:
                e["stopped"] = True

    # --- checkpoints ------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        extra = {"version": CHECKPOINT_FORMAT_EXTRA, "epoch": self.epoch, "batch": 0,
                 "rng": {"seed": self.seed, "epoch": self.epoch, "step": self.optimizer.steps},
                 "early_stopping": dict(self.early), "model": self.cfg["model"]}
        if isinstance(self.policy, FsmPolicy) and self.policy.learned:
            extra["policy"] = self.policy.to_json()
        checkpoint.save(path, self.params, self.optimizer, self.optimizer.steps, extra=extra)

    def load(self, path: str | os.PathLike, optimizer: bool = True) -> dict:
        if self.parallel:   # issue 19: rank 0 reads the file, every rank gets its state
            extra = self.parallel.load(path, optimizer)
            if isinstance(self.policy, FsmPolicy) and "policy" in extra:   # rank 0 checked it
                self.policy.fsms = FsmPolicy.from_json(extra["policy"]).fsms
            return extra
        return self._load(path, optimizer)

    def _load(self, path: str | os.PathLike, optimizer: bool = True) -> dict:
        fsms = None
        if isinstance(self.policy, FsmPolicy):   # checked before anything is assigned
            doc = (checkpoint.read(path).extra or {}).get("policy")
            try:
                fsms = FsmPolicy.from_json(doc).fsms if doc is not None else None
            except (ValueError, KeyError, TypeError) as e:
                raise MinicavsError(f"{path}: its FSM policy cannot be read: {e}") from None
        ck = checkpoint.load(path, self.params, self.optimizer if optimizer else None)
        extra = ck.extra or {}
        if extra.get("model", self.cfg["model"]) != self.cfg["model"]:
            raise MinicavsError(f"{path}: written for model settings {extra.get('model')}, "
                                f"the config says {self.cfg['model']}")
        if fsms is not None:
            self.policy.fsms = fsms
        if optimizer:
            self.epoch = int(extra.get("epoch", 0))
            if "early_stopping" in extra:
                self.early.update(extra["early_stopping"])
        return extra


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
    return EngineOptions(**{k: bool(v) for k, v in cfg.items()})


def _quiet(_: str) -> None:
    pass


def _truncate_metrics(path: Path, epoch: int) -> None:
    """Drop lines of epochs after the checkpoint (written before a crash): resume rewrites them."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if json.loads(line).get("epoch", 0) <= epoch]
    path.write_text("".join(line + "\n" for line in keep))


def _format(row: dict) -> str:
    parts = [f"epoch {row['epoch']}"]
    for k, v in row.items():
        if k in ("epoch", "timing"):
            continue
        parts.append(f"{k} {v:.4f}" if isinstance(v, float) and math.isfinite(v) else f"{k} {v}")
    t = row.get("timing", {})
    parts += [f"{k} {v:,.1f}" for k, v in t.items()]
    return "  ".join(parts)
