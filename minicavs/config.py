"""YAML run configs: defaults, ``--set key=value`` overrides, and validation with clear errors.

A config has four sections. ``model`` names the model module (a module of the top-level ``models/``
directory, or a path to a .py file) under ``model.name``; every other ``model.*`` key is that module's own
(its ``DEFAULTS`` dict). ``data``, ``train`` and ``eval`` are shared. Unknown keys and wrong types are errors
that name the key, the file, and (for typos) the closest known key.
"""
from __future__ import annotations

import copy
import difflib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import yaml

from .errors import MinicavsError


class ConfigError(MinicavsError, ValueError):
    """A config file or override that does not fit the schema."""


TRAIN_DEFAULTS: dict[str, Any] = {
    "optimizer": "adam", "lr": 1e-3, "weight_decay": 0.0, "clip_norm": None, "sparse_updates": False,
    "batch_size": 25, "epochs": 10, "seed": 1, "dtype": "float32", "policy": "cavs",
    "early_stopping": None,   # e.g. {metric: dev_root_acc, mode: max, patience: 3}
    "eval_batch_size": 256, "log_every": 1.0, "device": "cpu",
    "distributed": {},   # mpirun: digest_every, timeout, sparse (minicavs.distributed.SETTINGS)
    "deterministic": False,   # cuda: sum a DAG child's gradient rows in a fixed order, not by atomicAdd
    "engine": {"lazy_batching": True, "eager_batching": True, "streaming": False,  # §3.4 (EngineOptions)
               "fusion": True, "gather_elision": True},
}
DATA_DEFAULTS: dict[str, Any] = {"train": None, "dev": None, "test": None}
SECTIONS = ("model", "data", "train")
REPO_ROOT = Path(__file__).resolve().parent.parent


def _suggest(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _typecheck(where: str, value, default):
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if isinstance(default, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _merge(where, default, value, strict=False)
    return value


def _merge(where: str, defaults: dict, given: dict, strict: bool = True) -> dict:
    out = copy.deepcopy(defaults)
    for k, v in (given or {}).items():
        if strict and k not in defaults:
            raise ConfigError(f"unknown config key '{where}.{k}'{_suggest(k, defaults)}; "
                              f"known keys: {', '.join(sorted(defaults))}")
        out[k] = _typecheck(f"{where}.{k}", v, defaults.get(k))
    return out


def load_model_module(name: str, base: Path | None = None) -> ModuleType:
    """``tree_lstm`` -> models/tree_lstm.py of the repo (or of the config's directory); or a .py path."""
    candidates = []
    if name.endswith(".py") or os.sep in name:
        candidates.append(Path(name) if base is None or Path(name).is_absolute() else base / name)
    else:
        for root in ([base] if base else []) + [base.parent if base else None, Path.cwd() / "models",
                                                REPO_ROOT / "models"]:
            if root is not None:
                candidates.append(root / f"{name}.py")
    for path in candidates:
        if path.is_file():
            mod_name = f"minicavs_models.{path.stem}"
            if mod_name in sys.modules and getattr(sys.modules[mod_name], "__file__", None) == str(path):
                return sys.modules[mod_name]
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            spec.loader.exec_module(module)
            return module
    raise ConfigError(f"model '{name}' not found (looked for {', '.join(str(c) for c in candidates)})")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``train.lr=0.01`` -> (['train', 'lr'], 0.01); values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.lr=0.01")
    key, value = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {item!r}: the key needs a section, e.g. train.lr or model.hidden")
    return path, yaml.safe_load(value)


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> dict:
    """Read, override and validate a config; returns a plain dict with every default filled in."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)})")
    for item in overrides:
        keys, value = parse_override(item)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: '{k}' is not a section")
        node[keys[-1]] = value
    for k in raw:
        if k not in SECTIONS:
            raise ConfigError(f"{path}: unknown config section '{k}'{_suggest(k, SECTIONS)}")
    model = dict(raw.get("model") or {})
    if "name" not in model:
        raise ConfigError(f"{path}: model.name is required (e.g. tree_lstm)")
    module = load_model_module(str(model.pop("name")), path.resolve().parent)
    try:
        cfg = {
            "model": {"name": module.NAME, **_merge("model", module.DEFAULTS, model)},
            "data": _merge("data", {**DATA_DEFAULTS, **getattr(module, "DATA_DEFAULTS", {})},
                           raw.get("data") or {}),
            "train": _merge("train", {**TRAIN_DEFAULTS, **getattr(module, "TRAIN_DEFAULTS", {})},
                            raw.get("train") or {}),
        }
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    cfg["config_path"] = str(path)
    cfg["config_name"] = path.stem
    return cfg
