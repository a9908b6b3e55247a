"""YAML run configs: defaults, ``--set key=value`` overrides, and validation with clear errors.

A config has three sections. ``model`` names the model module under ``model.name``: a bundled model
(``tree_lstm``: the repository's ``models/``, installed with the package as ``minicavs/models``), a module
beside the config file, or a path to a ``.py`` file (relative to the config file); every other ``model.*``
key is that module's own (its ``DEFAULTS``, checked by its ``RULES``). ``data`` and ``train`` are shared.

Every value is checked when the config is loaded, before any work: unknown keys (with the closest known
key), wrong types, nulls where a value is needed, and values out of range or not among the choices raise a
:class:`ConfigError` that names the file, the key, the value and what is allowed.

Numbers follow YAML 1.2 (``1e-3`` is a float; ``010`` is ten), in files and in ``--set`` values alike.

Data paths (``data.train``, ``data.dev``, ``data.test``, and ``model.pretrained``: a file of pretrained word
vectors) written in a config file are relative to that
file's directory; paths given with ``--set`` are relative to the current directory, like any other
command-line path. Both become absolute in the resolved config, which a run records in its
``config.yaml`` and its checkpoints.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import yaml

from ..core.errors import MinicavsError
from ..data.vectors import FORMATS as VECTOR_FORMATS


class ConfigError(MinicavsError, ValueError):
    """A config file or override that does not fit the schema. ``key``: the dotted key at fault, where the
    message does not start with it (an unknown key), so an error can say whether ``--set`` gave it."""

    key: str | None = None


# --- YAML 1.2 numbers ---------------------------------------------------------------------------------

_INT = re.compile(r"^[-+]?[0-9]+$|^0o[0-7]+$|^0x[0-9a-fA-F]+$")
_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$")
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class Loader(yaml.SafeLoader):
    """PyYAML's safe loader with the YAML 1.2 core schema's numbers instead of YAML 1.1's (which read
    ``1e-3`` as a string, ``010`` as 8 and ``1:30`` as 90). PyYAML implements only YAML 1.1; this is the
    usual resolver fix rather than a second YAML library."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Loader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
Loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+.0123456789"))


def _construct_int(loader: yaml.SafeLoader, node) -> int:
    text = loader.construct_scalar(node)
    with _number(node, "an integer"):
        if text.startswith("0o"):
            return int(text[2:], 8)
        return int(text, 16) if text.startswith("0x") else int(text, 10)


def _construct_float(loader: yaml.SafeLoader, node) -> float:
    text = loader.construct_scalar(node).lower()
    with _number(node, "a number"):
        return float(text.replace(".inf", "inf").replace(".nan", "nan"))


@contextlib.contextmanager
def _number(node: yaml.Node, what: str):
    """A text int() or float() refuses as a YAML error: an explicit tag skips the resolver (``!!float abc``),
    and int() takes at most 4300 digits."""
    try:
        yield
    except ValueError as e:
        raise yaml.constructor.ConstructorError(None, None, f"!!{node.tag.rsplit(':', 1)[-1]} needs {what}: {e}",
                                                node.start_mark) from None


Loader.add_constructor(_INT_TAG, _construct_int)
Loader.add_constructor(_FLOAT_TAG, _construct_float)


def parse_yaml(text: str):
    return yaml.load(text, Loader=Loader)


def yaml_problem(error: yaml.YAMLError | UnicodeDecodeError) -> str:
    """A YAML error in one line (PyYAML's own text spans several: the problem, its place, the line, a caret),
    with the line it found it in (of a text of several lines), which names the key where a value is at fault."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or getattr(error, "context", None)
    if not problem or mark is None:
        return " ".join(str(error).split())
    lines = (mark.buffer or "").rstrip("\0").splitlines()
    line = f": {lines[mark.line].strip()!r}" if 1 < len(lines) and mark.line < len(lines) else ""
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1}{line})"


# --- value rules ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    """A number (``integer=True``: an integer) in [lo, hi], either end open or absent."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        what = "an integer" if self.integer else "a finite number"
        if self.lo is not None and self.hi is not None:
            return f"{what} in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {self.lo}"
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {self.hi}"
        return what

    def ok(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int) or not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)


@dataclass(frozen=True)
class Choice:
    """One of the given strings (case-insensitive with ``fold_case``)."""

    options: tuple
    fold_case: bool = False

    def describe(self) -> str:
        return "one of " + ", ".join(self.options)

    def ok(self, value) -> bool:
        if not isinstance(value, str):
            return False
        return (value.lower() if self.fold_case else value) in self.options


@dataclass(frozen=True)
class Text:
    """A non-empty string (a file path, a name): for a key whose default is null, which no type check covers."""

    what: str = "a non-empty string"

    def describe(self) -> str:
        return self.what

    def ok(self, value) -> bool:
        return isinstance(value, str) and value != ""


@dataclass(frozen=True)
class Nullable:
    """``rule``, or null, which means ``meaning``: a key a model lets its user leave unset (``model.embed:
    null`` takes the dimension from the pretrained vectors). Other keys refuse null where the default is not."""

    rule: Any
    meaning: str

    def describe(self) -> str:
        return f"{self.rule.describe()}, or null ({self.meaning})"

    def ok(self, value) -> bool:
        return value is None or self.rule.ok(value)


def at_least(lo, integer: bool = True) -> Range:
    return Range(lo=lo, integer=integer)


# the rules of the pretrained-vector keys (minicavs.data.vectors.KEYS) of a model with an embedding table
PRETRAINED_RULES = {"pretrained": Text(), "pretrained_format": Choice(VECTOR_FORMATS)}
POSITIVE = Range(lo=0, lo_open=True)
NON_NEGATIVE = Range(lo=0)
PROBABILITY = Range(lo=0, hi=1, hi_open=True)   # dropout rates, held-out fractions


# --- the shared sections ------------------------------------------------------------------------------------

TRAIN_DEFAULTS: dict[str, Any] = {
    "optimizer": "adam", "lr": 1e-3, "weight_decay": 0.0, "clip_norm": None, "sparse_updates": False,
    "batch_size": 25, "epochs": 10, "seed": 1, "dtype": "float32", "policy": "cavs",
    "early_stopping": None,   # e.g. {metric: dev_root_acc, mode: max, patience: 3}
    "eval_batch_size": 256, "log_every": 1.0, "device": "cpu",
    # "distributed": mpirun's settings, minicavs.train.distributed.SETTINGS (added by defaults())
    "deterministic": False,   # cuda: sum a DAG child's gradient rows in a fixed order, not by atomicAdd
    "order": "shuffle",  # or "bucket": batches of samples of similar length (padded loops; train/order.py)
    "prefetch": False,   # prepare the next batch (inputs, schedule, memory plan) while one trains (prefetch.py)
    "engine": {"lazy_batching": True, "eager_batching": True, "streaming": False,  # §3.4 (EngineOptions)
               "fusion": True, "gather_elision": True, "merge_gemms": True,
               "plan_layout": True,     # ED-Batch's memory layout: merged products' weights as views (passes/layout.py)
               "runner": "device",      # the device's runner; or "reference": the same program run by
                                        # reference.py (slow; the opcodes' definition)
               "check": False,          # the runners' debug mode: every address bounds-checked
               "tf32": False},   # cuda, float32: products issued by the CUDA runner read TF32 inputs (faster
                                 # on tensor cores, 10-bit mantissas: results move by ~1e-3 relative)
}
EARLY_STOPPING_KEYS = {"metric": None, "mode": None, "patience": None}
# Keys given a new name: a config, an override or a run's record (config.yaml, checkpoints) that says the old
# one means the new one, its value translated. (section path, old key) -> (new key, {old value: new value}).
RENAMED = {("train", "engine", "executor"): ("runner", {"native": "device", "reference": "reference"})}


def _train_rules() -> dict:
    from .distributed import SPARSE_MODES
    from .optim import OPTIMIZERS
    from .order import ORDERS
    from ..runtime.scheduler import policy_names
    return {"optimizer": Choice(tuple(OPTIMIZERS), fold_case=True), "lr": POSITIVE, "weight_decay": NON_NEGATIVE,
            "clip_norm": POSITIVE, "batch_size": at_least(1), "epochs": at_least(1), "seed": at_least(0),
            "dtype": Choice(("float32", "float64")), "policy": Choice(policy_names()),
            "eval_batch_size": at_least(1), "log_every": NON_NEGATIVE, "device": Choice(("cpu", "cuda")),
            "order": Choice(ORDERS),
            "early_stopping.metric": Text(), "early_stopping.mode": Choice(("min", "max")),
            "early_stopping.patience": at_least(1), "engine.runner": Choice(("device", "reference")),
            "distributed.digest_every": at_least(0), "distributed.timeout": POSITIVE,
            "distributed.sparse": Choice(SPARSE_MODES)}


def defaults(module: ModuleType) -> dict:
    """Each section's defaults for a model module: the shared tables under the model's own, and
    ``train.distributed`` (mpirun's settings: :data:`minicavs.train.distributed.SETTINGS`)."""
    from .distributed import SETTINGS
    return {"model": module.DEFAULTS, "data": {**DATA_DEFAULTS, **getattr(module, "DATA_DEFAULTS", {})},
            "train": {**TRAIN_DEFAULTS, "distributed": dict(SETTINGS), **getattr(module, "TRAIN_DEFAULTS", {})}}


def rules(module: ModuleType) -> dict:
    """Each section's value rules ('key' or 'key.sub' within the section): the model's and the shared ones."""
    return {"model": getattr(module, "RULES", {}),
            "data": {**{k: DATA_PATH for k in DATA_PATH_KEYS}, **getattr(module, "DATA_RULES", {})},
            "train": _train_rules()}


DATA_DEFAULTS: dict[str, Any] = {"train": None, "dev": None, "test": None}
DATA_PATH_KEYS = ("train", "dev", "test")   # a file path, 'synthetic' (generated data) or null
DATA_PATH = Text("a file path or 'synthetic'")
MODEL_PATH_KEYS = ("pretrained",)   # model keys that name a file (pretrained vectors): resolved as data paths
PATH_KEYS = {"data": DATA_PATH_KEYS, "model": MODEL_PATH_KEYS}
SYNTHETIC = "synthetic"
SECTIONS = ("model", "data", "train")
REPO_ROOT = Path(__file__).resolve().parents[2]
NULLABLE = {("train", "clip_norm"), ("train", "early_stopping"), ("data", "dev"), ("data", "test"),
            ("train", "early_stopping", "metric"), ("train", "early_stopping", "mode"),
            ("train", "early_stopping", "patience")}


def _installed() -> bool:
    """Whether minicavs runs as an installed package (``pip install .`` copies ``models/`` into it)."""
    return (Path(__file__).resolve().parents[1] / "models").is_dir()


def bundled_models_dir() -> Path:
    """The bundled models: ``minicavs/models`` when installed, else the repository's ``models/``."""
    return Path(__file__).resolve().parents[1] / "models" if _installed() else REPO_ROOT / "models"


DATA_ROOT_VAR = "MINICAVS_DATA"
_DATA_ROOT_PREFIX = re.compile(r"^\$(?:\{%s\}|%s)(?=/|$)" % (DATA_ROOT_VAR, DATA_ROOT_VAR))


def data_root() -> Path:
    """Where prepared real data sets live (``minicavs prepare`` writes there; configs name it
    ``$MINICAVS_DATA/...``): the environment variable if set; the checkout's ``data/`` when running from
    source; for an installed package, whose own folder is no place for data (site-packages may be read-only
    and is replaced on upgrade), the user's data directory ``$XDG_DATA_HOME/minicavs``
    (``~/.local/share/minicavs``)."""
    if os.environ.get(DATA_ROOT_VAR):
        return Path(os.path.expanduser(os.environ[DATA_ROOT_VAR])).resolve()
    if not _installed():
        return REPO_ROOT / "data"
    user_data = os.environ.get("XDG_DATA_HOME") or os.path.join("~", ".local", "share")
    return (Path(os.path.expanduser(user_data)) / "minicavs").resolve()


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in bundled_models_dir().glob("*.yaml"))


def find_config(name: str | os.PathLike) -> Path:
    """A config file by path, or a bundled config by name (``tree_lstm`` -> the bundled tree_lstm.yaml)."""
    path = Path(name)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        bundled = bundled_models_dir() / f"{path.name}.yaml"
        if bundled.is_file():
            return bundled
    raise FileNotFoundError(f"config file not found: {name} (bundled configs: {', '.join(bundled_configs())})")


def _suggest(key, known) -> str:
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1)   # a YAML key may be 1 or null
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
        return _merge(where, default, value)
    return value


def _merge(where: str, defaults: dict, given: dict) -> dict:
    """Defaults overridden by ``given``."""
    out = copy.deepcopy(defaults)
    for k, v in (given or {}).items():
        if k not in defaults:
            error = ConfigError(f"unknown config key '{where}.{k}'{_suggest(k, defaults)}; "
                                f"known keys: {', '.join(sorted(defaults))}")
            error.key = f"{where}.{k}"
            raise error
        out[k] = _typecheck(f"{where}.{k}", v, defaults.get(k))
    return out


def _check_values(cfg: dict, defaults: dict, rules: dict, nullable: set) -> None:
    """Nulls where a value is needed, then each rule ('key' or 'key.sub' within its section)."""
    def walk(prefix: tuple, node, dflt):
        for k, v in node.items():
            key = prefix + (k,)
            d = dflt.get(k) if isinstance(dflt, dict) else None
            if v is None and d is not None and key not in nullable and not isinstance(
                    rules.get(key[0], {}).get(".".join(key[1:])), Nullable):
                raise ConfigError(f"{'.'.join(key)}: null is not allowed; "
                                  f"{_expected(rules, key) or f'default {d!r}'}")
            if isinstance(v, dict):
                walk(key, v, d)
    walk((), cfg, defaults)
    for section, section_rules in rules.items():
        for dotted, rule in section_rules.items():
            node = cfg[section]
            *parents, last = dotted.split(".")
            for p in parents:
                node = node.get(p) if isinstance(node, dict) else None
            if not isinstance(node, dict) or node.get(last) is None:
                continue
            if not rule.ok(node[last]):
                raise ConfigError(f"{section}.{dotted} = {node[last]!r}: must be {rule.describe()}")


def _expected(rules: dict, key: tuple) -> str:
    rule = rules.get(key[0], {}).get(".".join(key[1:]))
    return f"expected {rule.describe()}" if rule else ""


def load_model_module(name: str, base: Path | None = None) -> ModuleType:
    """A model module: ``name``.py in ``base`` (the config's directory) or among the bundled models; or a
    path to a .py file (relative to ``base``)."""
    candidates = []
    if name.endswith(".py") or "/" in name or os.sep in name:
        if not name.endswith(".py"):   # importlib has no loader for another file
            raise ConfigError(f"model.name = {name!r}: must be a model name (tree_lstm) or a path to a .py file")
        candidates.append(Path(name) if base is None or Path(name).is_absolute() else base / name)
    else:
        for root in ([base] if base else []) + [bundled_models_dir()]:
            candidates.append(root / f"{name}.py")
    for path in candidates:
        if path.is_file():
            return _import_model(name, path.resolve())
    raise ConfigError(f"model.name: model '{name}' not found (looked for {', '.join(str(c) for c in candidates)})")


def _import_model(name: str, path: Path) -> ModuleType:
    """The module of ``path`` (imported once), which must define a model's ``DEFAULTS`` mapping."""
    mod_name = f"minicavs_models.{path.stem}"
    if mod_name in sys.modules and getattr(sys.modules[mod_name], "__file__", None) == str(path):
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    if not isinstance(getattr(module, "DEFAULTS", None), dict):
        del sys.modules[mod_name]
        raise ConfigError(f"model.name = {name!r}: {path} is not a model module (it defines no DEFAULTS mapping)")
    return module


def model_reference(module: ModuleType) -> str:
    """How a resolved config names a model module: its name if bundled, else its absolute path."""
    path = Path(module.__file__).resolve()
    bundled = bundled_models_dir().resolve() / path.name
    return path.stem if bundled == path else str(path)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``train.lr=0.01`` -> (['train', 'lr'], 0.01); values are parsed as YAML 1.2 scalars."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.lr=0.01")
    key, value = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"--set {item!r}: the key needs a section, e.g. train.lr or model.hidden")
    try:
        return path, parse_yaml(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: not a YAML value ({yaml_problem(e)})") from None


def _resolve_paths(raw: dict, section: str, base: Path) -> None:
    """Make the file paths of ``raw[section]`` (its :data:`PATH_KEYS`) absolute ($MINICAVS_DATA and ~
    expanded, relative to ``base``); 'synthetic', null and values of other types (refused later, by the
    section's rules) stay as they are."""
    node = raw.get(section)
    for k in PATH_KEYS[section] if isinstance(node, dict) else ():
        v = node.get(k)
        if isinstance(v, str) and "\0" in v:   # the OS takes no such path: os.path.realpath raises ValueError
            raise ConfigError(f"{section}.{k} = {v!r}: a file path cannot hold a NUL character")
        if isinstance(v, str) and v and v != SYNTHETIC:
            v = _DATA_ROOT_PREFIX.sub(lambda _: str(data_root()), v)   # a function: used verbatim
            node[k] = str((base / os.path.expanduser(v)).resolve())


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> dict:
    """Read, override and validate a config file; returns a plain dict with every default filled in."""
    path = find_config(path)
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(e)}") from None
    return resolve(raw, path, overrides)


def resolve(raw: dict, source: str | os.PathLike, overrides: Sequence[str] = (),
            base: Path | None = None) -> dict:
    """Validate a config given as a dict (read from ``source``: a file, or a checkpoint's record) after
    applying ``overrides``; relative paths resolve against ``base`` (default: ``source``'s directory)."""
    source = Path(source)
    base = Path(base) if base is not None else source.resolve().parent
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)})")
    raw = copy.deepcopy(raw)
    for k in raw:
        if k not in SECTIONS:
            raise ConfigError(f"{source}: unknown config section '{k}'{_suggest(k, SECTIONS)}")
        if raw[k] is not None and not isinstance(raw[k], dict):
            raise ConfigError(f"{source}: section '{k}' must be a mapping, got {raw[k]!r}")
    overridden = []
    try:
        for section in PATH_KEYS:
            _resolve_paths(raw, section, base)
        _renamed_keys(raw)
        for item in overrides:
            keys, value = parse_override(item)
            overridden.append(".".join(keys))
            keys, value = _renamed(keys, value)
            if keys[0] not in SECTIONS:
                raise ConfigError(f"--set {item!r}: unknown config section '{keys[0]}'{_suggest(keys[0], SECTIONS)};"
                                  f" sections: {', '.join(SECTIONS)}")
            node = raw
            for k in keys[:-1]:
                if node.get(k) is None:
                    node[k] = {}
                node = node[k]
                if not isinstance(node, dict):
                    raise ConfigError(f"--set {item!r}: '{k}' is not a section")
            node[keys[-1]] = value
            if keys[0] in PATH_KEYS and len(keys) == 2:
                _resolve_paths(raw, keys[0], Path.cwd())   # command-line paths: relative to where you are
            overridden.append(".".join(keys))
        return _resolved(raw, source, base)
    except ConfigError as e:
        key = e.key or str(e).split(" ", 1)[0].rstrip(":")
        note = " (from --set)" if any(key == o or key.startswith(o + ".") for o in overridden) else ""
        raise ConfigError(f"{source}: {e}{note}") from None


def _renamed(keys: list, value) -> tuple[list, Any]:
    """An override's key and value under the key's new name, where :data:`RENAMED` has its old one."""
    renamed = RENAMED.get(tuple(keys))
    if renamed is None:
        return keys, value
    new, values = renamed
    if not any(value == old for old in values):   # not `in`: a list or a mapping is a value too, unhashable
        where = ".".join(keys[:-1])
        raise ConfigError(f"{where}.{keys[-1]} (now {where}.{new}) = {value!r}: expected one of "
                          f"{', '.join(map(str, values))}")
    return keys[:-1] + [new], values[value]


def _renamed_keys(raw: dict) -> None:
    """Move each old key of :data:`RENAMED` in ``raw`` (a file's or a record's config: the overrides are
    renamed one by one, later) to its new name, translating its value."""
    for (*path, old), (new, values) in RENAMED.items():
        section = raw
        for k in path:
            section = section.get(k) if isinstance(section, dict) else None
        if not isinstance(section, dict) or old not in section:
            continue
        given = section.pop(old)
        keys, value = _renamed(path + [old], given)
        if new in section and section[new] != value:
            raise ConfigError(f"{'.'.join(path)}.{old} = {given!r} (the old name of {'.'.join(keys)}) "
                              f"contradicts {'.'.join(keys)} = {section[new]!r}: give one")
        section[new] = value


def _resolved(raw: dict, source: Path, base: Path) -> dict:
    model = dict(raw.get("model") or {})
    if model.get("name") is None:
        raise ConfigError("model.name is required (e.g. tree_lstm)")
    if not isinstance(model["name"], str):
        raise ConfigError(f"model.name = {model['name']!r}: must be a model name or a .py path")
    module = load_model_module(model.pop("name"), base)
    table = defaults(module)
    train = _merge("train", table["train"], raw.get("train") or {})
    if train["early_stopping"] is not None:
        train["early_stopping"] = _typecheck("train.early_stopping", train["early_stopping"], EARLY_STOPPING_KEYS)
    cfg = {"model": _merge("model", table["model"], model),
           "data": _merge("data", table["data"], raw.get("data") or {}), "train": train}
    _check_values(cfg, table, rules(module),
                  NULLABLE | {("data", k) for k, v in table["data"].items() if v is None})
    if cfg["data"].get("train") is None:
        raise ConfigError("data.train: null is not allowed; the training data (a file path or 'synthetic')")
    cfg["model"] = {"name": model_reference(module), **cfg["model"]}
    cfg["config_path"] = str(source)
    cfg["config_name"] = source.stem
    return cfg


def recorded(cfg: dict) -> dict:
    """The part of a resolved config a run records (config.yaml, checkpoints): the three sections."""
    return {k: copy.deepcopy(cfg[k]) for k in SECTIONS}


def differences(a: dict, b: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) for every leaf that differs between two configs."""
    out = []
    for k in sorted(set(a) | set(b), key=str):
        va, vb = a.get(k), b.get(k)
        key = f"{prefix}{k}"
        if isinstance(va, dict) and isinstance(vb, dict):
            out += differences(va, vb, key + ".")
        elif va != vb:
            out.append((key, va, vb))
    return out


def dump(cfg: dict, header: str = "") -> str:
    """A resolved config as YAML that :func:`load_config` reads back to the same config."""
    text = yaml.safe_dump(recorded(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True)
    return "".join(f"# {line}\n" for line in header.splitlines()) + text
