"""A run directory and the protocol that keeps it one consistent state at every instant.

Files (every one written atomically, :mod:`minicavs.core.atomic`)::

    config.yaml     the resolved config (every default filled in, absolute data paths), written at start
    last.npz        the checkpoint after the latest epoch: THE COMMIT POINT (see below)
    metrics.jsonl   one JSON line per committed epoch (a copy of the history last.npz records)
    best.npz        the checkpoint of the best epoch by the early-stopping metric (every epoch without dev)
    results.json    final dev/test metrics of the best checkpoint, written when training ends
    fsm.json        with ``train.policy: fsm``: the FSM learned before the first step (last.npz records it too)

An epoch ends by writing, in this order: last.npz, metrics.jsonl, best.npz (if the epoch is the best).
last.npz records the epoch, the optimizer and early-stopping state (best epoch included), the resolved
config, the vocabulary and the metric rows of every epoch so far; everything else is derived from it.
A crash at any instant therefore leaves either the old commit or the new one, and what the other files can
lack is repaired from last.npz by :meth:`RunDir.recover` (``--resume`` calls it): metrics.jsonl is rewritten
from the recorded rows (so it never keeps a torn or uncommitted line), a best epoch equal to the last one is
copied from last.npz when best.npz is older, fsm.json is rewritten from the FSM last.npz records, and
temporary files are deleted. Readers find the best
checkpoint with :meth:`RunDir.best_checkpoint`, which is right at every instant, before any repair too.
A run stopped before its first commit (config.yaml, no last.npz) has no epoch to continue: resuming it starts
it over (:meth:`RunDir.resumable` returns None), and a new run is told so.

One writer at a time: a trainer holds an exclusive lock on ``.lock`` in the directory (:meth:`RunDir.lock`)
from its first write to the end, so a second process training, resuming or finishing into the same
directory is refused instead of interleaving commits. The lock is the kernel's (``flock``): it dies with the
process, so a crash leaves no stale lock to clear by hand.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

try:
    import fcntl
except ImportError:       # not POSIX: no cross-process lock (documented in RunDir.lock)
    fcntl = None

from ..core import atomic, wording
from ..core.errors import CheckpointError, RunDirError
from . import checkpoint

RUN_FILES = ("config.yaml", "last.npz", "best.npz", "metrics.jsonl", "results.json", "fsm.json")


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.config = self.path / "config.yaml"
        self.last = self.path / "last.npz"
        self.best = self.path / "best.npz"
        self.metrics = self.path / "metrics.jsonl"
        self.results = self.path / "results.json"
        self.fsm = self.path / "fsm.json"   # an fsm policy's learned FSM, a copy of what last.npz records
        self._lock_file = None               # the open .lock while this process holds it

    def lock(self) -> None:
        """Take the directory's writer lock (creating the directory), or fail naming the holder's pid;
        holding it already is fine. Released by :meth:`unlock` or when the process ends, however it ends.
        Where ``fcntl`` is missing (Windows) there is no lock."""
        if self._lock_file is not None or fcntl is None:
            return
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"run dir {self.path} exists and is not a directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            f = open(self.path / ".lock", "a+")
        except OSError as e:
            raise RunDirError(f"cannot write to run dir {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise wording.error(RunDirError, f"run dir {self.path} is in use by another minicavs process (pid "
                                             f"{holder}); wait for it to finish, or choose {{run_dir}}") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock_file = f

    def unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()      # closing the descriptor releases the flock
            self._lock_file = None

    def __str__(self) -> str:
        return str(self.path)

    def existing(self) -> list[str]:
        return [name for name in RUN_FILES if (self.path / name).exists()]

    def describe(self) -> str:
        """What the directory holds, for messages: 'epoch 3 of 6' or 'no checkpoint yet'."""
        if not self.last.exists():
            return "no checkpoint yet"
        try:
            extra = checkpoint.read(self.last, finite=False).extra
            return f"epoch {extra.get('epoch')} of {extra.get('config', {}).get('train', {}).get('epochs', '?')}"
        except CheckpointError:
            return "an unreadable last.npz"

    def start(self, config_text: str, force: bool = False) -> None:
        """Make the directory ready for a new run and write its config.yaml: refuses a directory that holds
        a run unless ``force`` (then only the run's own files are deleted); fails here, before training,
        when the directory cannot be written."""
        held = self.check_start(force)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            for name in held:
                (self.path / name).unlink()
            atomic.remove_temporaries(self.path, RUN_FILES)
            atomic.write_text(self.config, config_text)
        except OSError as e:
            raise RunDirError(f"cannot write to run dir {self.path}: {e.strerror or e}") from None

    def check_start(self, force: bool = False) -> list[str]:
        """The run files a new run would replace; refuses (changing nothing) what :meth:`start` refuses."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"run dir {self.path} exists and is not a directory")
        held = self.existing()
        if held and not force:
            again = "" if self.last.exists() else " (it starts over: no epoch was saved)"
            raise wording.error(RunDirError, f"run dir {self.path} already holds a run ({self.describe()}); "
                                             f"continue it with {{resume}}{again}, replace it with {{force}}, or "
                                             f"choose {{run_dir}}")
        return held

    def resumable(self) -> checkpoint.Checkpoint | None:
        """last.npz (checked: :func:`checkpoint.read`); None for a run stopped before its first checkpoint
        (config.yaml, no last.npz), which resuming starts over; or an error that says how to start fresh."""
        if self.last.exists():
            return checkpoint.read(self.last)
        if self.config.is_file():
            return None
        what = ("does not exist" if not self.path.exists() else "is not a directory" if not self.path.is_dir()
                else "holds no run (no config.yaml, no last.npz)")
        raise wording.error(RunDirError, f"cannot resume: run dir {self.path} {what}; start a fresh run without "
                                         f"{{resume}}" + (" (with {force} to replace what is there)"
                                                          if self.path.is_dir() and self.existing() else ""))

    def recover(self, last: checkpoint.Checkpoint, config_text: str | None = None) -> list[str]:
        """Repair what a crash after the commit of ``last`` (this directory's last.npz) can leave; returns
        what was repaired."""
        repaired = [f"removed {name}" for name in atomic.remove_temporaries(self.path, RUN_FILES)]
        try:
            if config_text is not None:   # always: an unwritable run dir is found now, not after an epoch
                atomic.write_text(self.config, config_text)
            rows = last.extra.get("history", [])
            if not self.metrics.exists() or self.metrics.read_bytes() != metrics_text(rows).encode():
                self.write_metrics(rows)
                repaired.append(f"rewrote metrics.jsonl ({len(rows)} epochs)")
            policy = last.extra.get("policy")
            if policy is not None and (not self.fsm.exists() or self.fsm.read_bytes() != fsm_text(policy).encode()):
                self.write_fsm(policy)
                repaired.append("rewrote fsm.json")
            epoch, best_epoch = last.extra.get("epoch"), last.extra.get("early_stopping", {}).get("best_epoch")
            if best_epoch == epoch and _epoch_of(self.best) != epoch:
                atomic.write_bytes(self.best, self.last.read_bytes())
                repaired.append(f"best.npz <- last.npz (epoch {epoch})")
        except OSError as e:
            raise RunDirError(f"cannot write to run dir {self.path}: {e.strerror or e}") from None
        return repaired

    def write_metrics(self, rows: list[dict]) -> None:
        atomic.write_text(self.metrics, metrics_text(rows))

    def write_fsm(self, policy: dict) -> None:
        atomic.write_text(self.fsm, fsm_text(policy))

    def write_results(self, results: dict) -> None:
        atomic.write_text(self.results, json.dumps(results, indent=1) + "\n")

    def best_checkpoint(self) -> Path:
        """The file holding the best epoch's state, as last.npz's record says."""
        if not self.last.exists():
            raise RunDirError(f"run dir {self.path} holds no checkpoint ({self.describe()})")
        extra = checkpoint.read(self.last, finite=False).extra   # the record only: its user checks the values
        epoch, best_epoch = extra.get("epoch"), extra.get("early_stopping", {}).get("best_epoch")
        if best_epoch is None:    # an older run, or no epoch was ever better than none
            return self.best if self.best.exists() else self.last
        if _epoch_of(self.best) == best_epoch:
            return self.best
        if best_epoch == epoch:   # committed, best.npz not yet written: last.npz is the best
            return self.last
        raise RunDirError(f"run dir {self.path}: best.npz does not hold the best epoch {best_epoch} that "
                          f"last.npz records (files changed by hand?)")


def fsm_text(policy: dict) -> str:
    return json.dumps(policy, indent=1)


def metrics_text(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def _epoch_of(path: Path):
    if not path.exists():
        return None
    try:
        return checkpoint.read(path, finite=False).extra.get("epoch")
    except CheckpointError:
        return None
