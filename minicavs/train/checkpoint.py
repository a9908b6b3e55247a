"""Checkpoints: one ``.npz`` file holding parameters, optimizer state, the step and a JSON metadata entry.

Layout (format ``minicavs-checkpoint``, version 1). Arrays are stored under readable keys,
``param/<name>`` and ``slot/<name>/<slot>`` (``np.load("best.npz")["param/W"]``), where a name is made of
letters, digits, ``_``, ``.``, ``-`` and ``/``; any other name gets an opaque key (``p0``, ``o0``, ...: what
every name got before, and what older files hold), so names never need escaping. Readers take each array's key
from the metadata, so both kinds read alike. The entry ``__meta__`` is UTF-8 JSON (a uint8 array)::

    {"format": "minicavs-checkpoint", "version": 1, "step": 1200,
     "params": [{"name": "mlp/W1", "key": "param/mlp/W1", "shape": [2, 32], "dtype": "float32"}, ...],
     "optimizer": null | {"type": "Adam", "steps": 1200, "hyper": {...},
                          "slots": {"mlp/W1": {"m": "slot/mlp/W1/m", "v": "slot/mlp/W1/v"}, ...}},
     "extra": {...}}

``extra`` is a free JSON object for state later issues add (RNG state, data position) without a format
change; readers ignore keys they do not know. A reader accepts versions up to :data:`VERSION`.

Files are written atomically (:mod:`minicavs.core.atomic`: temp file in the same directory, fsync,
``os.replace``), so a crash leaves either the old checkpoint or the new one, never a torn file. :func:`load` checks everything before it
assigns anything: on any :class:`~minicavs.core.errors.CheckpointError` the model and optimizer are unchanged.
:func:`read` refuses NaN and infinite values, naming the parameter or optimizer slot: training never writes
them (a non-finite loss or gradient is refused before a parameter changes), so they mean a damaged file.
"""
from __future__ import annotations

import io
import json
import os
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..core import atomic
from ..core.errors import CheckpointError
from ..engine.backend import array_module, to_host

FORMAT = "minicavs-checkpoint"
VERSION = 1
META_KEY = "__meta__"


@dataclass
class Checkpoint:
    """The decoded contents of a checkpoint file."""

    path: str
    step: int
    params: dict[str, np.ndarray]
    optimizer: dict | None  # in Optimizer.state_dict() form
    extra: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def save(path: str | os.PathLike, params: Mapping[str, Any], optimizer=None, step: int | None = None,
         extra: Mapping | None = None) -> None:
    """Write ``params`` (name -> Parameter or array), the optimizer's state and ``step`` (default: the
    optimizer's step count, else 0) to ``path``, atomically. ``extra`` must be JSON-serialisable."""
    path = os.fspath(path)
    arrays: dict[str, np.ndarray] = {}
    entries = []
    for i, (name, p) in enumerate(params.items()):
        arr = to_host(getattr(p, "value", p))   # device arrays are written from a host copy
        key = _array_key(f"param/{name}", name, f"p{i}", arrays)
        arrays[key] = arr
        entries.append({"name": name, "key": key, "shape": list(arr.shape), "dtype": arr.dtype.name})
    opt_meta = None
    if optimizer is not None:
        state = optimizer.state_dict()
        slots: dict[str, dict[str, str]] = {}
        for name, got in state["slots"].items():
            slots[name] = {}
            for s, arr in got.items():
                key = _array_key(f"slot/{name}/{s}", f"{name}/{s}", f"o{len(arrays) - len(entries)}", arrays)
                slots[name][s] = key
                arrays[key] = to_host(arr)
        opt_meta = {"type": state["type"], "steps": int(state["steps"]), "hyper": state["hyper"],
                    "slots": slots}
    if step is None:
        step = optimizer.steps if optimizer is not None else 0
    meta = {"format": FORMAT, "version": VERSION, "step": int(step), "params": entries,
            "optimizer": opt_meta, "extra": dict(extra or {})}
    try:
        text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot write checkpoint {path}: metadata is not plain JSON ({e})") from None
    arrays[META_KEY] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    _atomic_savez(path, arrays)


_READABLE = re.compile(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*")


def _array_key(readable: str, name: str, opaque: str, taken: Mapping) -> str:
    """``readable`` when ``name`` is plain enough to be a zip member's path (no empty, ``.`` or ``..`` part,
    nothing to escape) and the key is free, else ``opaque`` (which the counters keep unique)."""
    plain = _READABLE.fullmatch(name) and not {".", ".."} & set(name.split("/"))
    return readable if plain and readable not in taken else opaque


def _atomic_savez(path: str, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()   # serialised first, then written in one piece (atomic.write_bytes)
    np.savez(buffer, **arrays)
    atomic.write_bytes(path, buffer.getbuffer())


def _arrays(path: str) -> dict:
    """Every array of the .npz file at ``path``, or CheckpointError saying why it is no checkpoint file."""
    try:
        with open(path, "rb") as f:  # our own handle: np.load leaks its own on some corrupt files
            if f.read(4) != b"PK\x03\x04":
                raise CheckpointError(f"checkpoint file {path} is corrupt or not a checkpoint: "
                                      "not an .npz (zip) file")
            f.seek(0)
            with np.load(f, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint file {path}") from None
    except CheckpointError:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt or not a checkpoint: {e}") from None


def read(path: str | os.PathLike, finite: bool = True) -> Checkpoint:
    """Decode and check a checkpoint file on its own (no model needed); raises CheckpointError.

    With ``finite`` (the default) a parameter or optimizer slot holding NaN or an infinity is refused,
    naming it: such a file is damaged (training refuses a non-finite loss or gradient before it changes a
    parameter, so it never writes one), and a model loaded from it would compute nothing but NaN. Readers of
    the metadata alone (a run dir's epoch and best epoch) pass ``finite=False``."""
    path = os.fspath(path)
    arrays = _arrays(path)

    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {path}: {msg}")

    if META_KEY not in arrays:
        raise bad("no metadata entry: not a minicavs checkpoint")
    try:
        meta = json.loads(arrays.pop(META_KEY).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise bad(f"format is {found!r}, expected {FORMAT!r}")
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
        raise bad(f"format version {version!r} is not supported (this minicavs reads 1 to {VERSION})")

    def array(key, shape=None, dtype=None, what="") -> np.ndarray:
        if key not in arrays:
            raise bad(f"array {key!r} of {what} is missing")
        arr = arrays[key]
        if shape is not None and (list(arr.shape) != list(shape) or arr.dtype.name != dtype):
            raise bad(f"{what} is stored as {arr.dtype}{arr.shape}, metadata says {dtype}{tuple(shape)}")
        return arr

    try:
        params = {}
        for e in meta["params"]:
            params[e["name"]] = array(e["key"], e["shape"], e["dtype"], f"parameter '{e['name']}'")
        optimizer = None
        if meta.get("optimizer") is not None:
            om = meta["optimizer"]
            slots = {name: {s: array(key, what=f"optimizer slot '{s}' of parameter '{name}'")
                            for s, key in got.items()} for name, got in om["slots"].items()}
            optimizer = {"type": om["type"], "steps": om["steps"], "hyper": om.get("hyper", {}),
                         "slots": slots}
        if finite:
            for name, arr in params.items():
                _check_finite(arr, lambda msg: bad(f"parameter '{name}' {msg}"))
            for name, got in (optimizer or {"slots": {}})["slots"].items():
                for s, arr in got.items():
                    _check_finite(arr, lambda msg: bad(f"optimizer slot '{s}' of parameter '{name}' {msg}"))
        step = int(meta["step"])
        extra = meta.get("extra") or {}
    except (KeyError, TypeError, AttributeError) as e:
        raise bad(f"metadata is malformed ({type(e).__name__}: {e})") from None
    return Checkpoint(path, step, params, optimizer, extra, meta)


def _check_finite(arr: np.ndarray, bad) -> None:
    """Raise ``bad(what is wrong)`` when a floating-point ``arr`` holds NaN or an infinity."""
    if arr.dtype.kind not in "fc" or np.isfinite(arr).all():
        return
    nan, inf = int(np.isnan(arr).sum()), int(np.isinf(arr).sum())
    what = ", ".join(f"{n:,} {kind}" for n, kind in ((nan, "NaN"), (inf, "infinite")) if n)
    raise bad(f"holds non-finite values ({what}, of {arr.size:,}): the file is damaged or the run it comes "
              "from diverged; it is not loaded")


def load(path: str | os.PathLike, params: Mapping[str, Any], optimizer=None) -> Checkpoint:
    """Restore ``params`` (name -> Parameter) by name, and the optimizer's state if one is given.

    Every parameter must be present with the same shape and dtype and the checkpoint may hold no other
    parameter; all checks run before any value is assigned, so an error changes nothing."""
    ck = read(path)
    apply(ck, params, optimizer)
    return ck


def check(ck: Checkpoint, params: Mapping[str, Any], optimizer=None) -> None:
    """Raise CheckpointError unless ``ck`` fits ``params`` (and ``optimizer``); changes nothing."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"checkpoint file {ck.path}: {msg}")

    for name, p in params.items():
        if name not in ck.params:
            raise bad(f"parameter '{name}' is missing")
        want, got = p.value, ck.params[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise bad(f"parameter '{name}' is {got.dtype}{got.shape} in the checkpoint, "
                      f"{want.dtype}{want.shape} in the model")
    for name in ck.params:
        if name not in params:
            raise bad(f"unexpected parameter '{name}' (not in the model)")
    if optimizer is not None:
        if ck.optimizer is None:
            raise bad("holds no optimizer state")
        try:
            optimizer.check_state_dict(ck.optimizer)
        except ValueError as e:
            raise bad(str(e)) from None


def apply(ck: Checkpoint, params: Mapping[str, Any], optimizer=None) -> None:
    """:func:`check`, then assign the parameters in place and restore the optimizer's state."""
    check(ck, params, optimizer)
    for name, p in params.items():
        p.value[...] = array_module(p.value).asarray(ck.params[name])
    if optimizer is not None:
        optimizer.load_state_dict(ck.optimizer)


__all__ = ["FORMAT", "VERSION", "Checkpoint", "save", "read", "load", "check", "apply"]
