"""A config value of any YAML type, at any key of the key table (every bundled model's keys, the shared
sections, early stopping's, train.distributed's, the renamed old keys), in a file, by ``--set`` and in a run's
record: accepted, with the key's type, or refused by one ConfigError line that names the key; never another
exception."""
from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from minicavs.train import config
from minicavs.train.cli import main
from minicavs.train.config import ConfigError, Nullable, load_config, parse_yaml, resolve

CONFIGS = sorted(config.bundled_models_dir().glob("*.yaml"))
RENAMED = {".".join(path): ".".join(path[:-1] + (new,)) for path, (new, _) in config.RENAMED.items()}


def _walk(prefix: str, mapping: dict):
    for k, v in mapping.items():
        yield f"{prefix}{k}", v
        if isinstance(v, dict):
            yield from _walk(f"{prefix}{k}.", v)


@functools.lru_cache(maxsize=None)
def key_table(path: Path) -> dict:
    """{dotted key: (default, rule, nullable)} of the config at ``path``, read from the config module's
    tables: each section, its keys and their keys, early stopping's, ``model.name`` and the old names."""
    module = config.load_model_module(parse_yaml(path.read_text())["model"]["name"], path.parent)
    defaults, rules = config.defaults(module), config.rules(module)
    table = {section: ({}, None, True) for section in config.SECTIONS}
    table["model.name"] = (None, None, False)
    for section, section_defaults in defaults.items():
        for dotted, default in _walk("", section_defaults):
            rule = rules[section].get(dotted)
            nullable = (default is None or (section, *dotted.split(".")) in config.NULLABLE
                        or isinstance(rule, Nullable))
            table[f"{section}.{dotted}"] = (default, rule, nullable)
    for dotted, default in _walk("early_stopping.", config.EARLY_STOPPING_KEYS):
        table[f"train.{dotted}"] = (default, rules["train"].get(dotted), True)
    table.update({old: table[new] for old, new in RENAMED.items()})
    return table


HOLDERS = {}   # dotted key -> the bundled configs whose tables hold it
for _path in CONFIGS:
    for _key in key_table(_path):
        HOLDERS.setdefault(_key, []).append(_path)


def _near(key: str) -> list:
    """Values a key may well accept: its defaults and choices, small numbers, null, an empty mapping."""
    near = [None, True, False, 0, 1, 2, 0.5, 1e-3, "synthetic", {}]
    for path in HOLDERS[key]:
        default, rule, _ = key_table(path)[key]
        near += [default, *getattr(getattr(rule, "rule", rule), "options", ())]
    return near


def _words() -> list:
    """Strings the tables offer (defaults, choices, old values, key names): values a key may accept."""
    words = set()
    for path in CONFIGS:
        for key, (default, rule, _) in key_table(path).items():
            words.update(key.split("."))
            words.update(w for w in (default, *getattr(getattr(rule, "rule", rule), "options", ())) if isinstance(w, str))
    for _, values in config.RENAMED.values():
        words.update(values)
    return sorted(words)


WORDS = _words()
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(),
                    st.text(st.characters(blacklist_categories=("Cs",)), max_size=6), st.sampled_from(WORDS))
MAP_KEYS = st.one_of(st.sampled_from(WORDS), st.text(max_size=3), st.integers(-3, 3), st.none(), st.booleans())
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(MAP_KEYS, inner,
                                                                                           max_size=3), max_leaves=6)
CASES = st.sampled_from(sorted(HOLDERS)).flatmap(lambda key: st.tuples(
    st.sampled_from(HOLDERS[key]), st.just(key), st.one_of(VALUES, st.sampled_from(_near(key)))))
PROPERTY = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _put(cfg: dict, key: str, value) -> dict:
    """``cfg`` with ``value`` at the dotted ``key`` (parent mappings made where missing or not mappings)."""
    *parents, last = key.split(".")
    node = cfg
    for k in parents:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[last] = value
    return cfg


def _get(cfg: dict, key: str):
    for k in key.split("."):
        cfg = cfg[k]
    return cfg


def _yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=float("inf"),
                          allow_unicode=True).removesuffix("\n").removesuffix("\n...")


def _check(path: Path, key: str, source: Path, load) -> None:
    """``load()`` either gives a config whose value at ``key`` fits the key table, or raises one
    ConfigError line naming ``source`` and then the key."""
    try:
        cfg = load()
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and message.startswith(f"{source}: "), message
        assert key in message.removeprefix(f"{source}: "), message
        return
    default, rule, nullable = key_table(path)[key]
    if key in RENAMED:
        key = RENAMED[key]
    value = _get(cfg, key)
    if key == "model.name" or isinstance(default, dict):
        assert isinstance(value, type(default) if default is not None else str), (key, value)
    elif rule is not None or default is not None:
        assert value is None and nullable or (rule.ok(value) if rule else type(value) is type(default)), (key, value)
    else:
        assert value is None or isinstance(value, dict), (key, value)   # train.early_stopping


@functools.lru_cache(maxsize=None)
def _file(path: Path) -> dict:
    return parse_yaml(path.read_text())


@functools.lru_cache(maxsize=None)
def _record(path: Path) -> dict:
    return config.recorded(load_config(path))


@PROPERTY
@given(case=CASES)
def test_any_value_in_a_file(tmp_path_factory, case):
    path, key, value = case
    given_file = tmp_path_factory.getbasetemp() / "given.yaml"
    given_file.write_text(yaml.safe_dump(_put(copy.deepcopy(_file(path)), key, value), sort_keys=False,
                                         allow_unicode=True), encoding="utf-8")
    _check(path, key, given_file, lambda: load_config(given_file))


@PROPERTY
@given(case=CASES)
def test_any_value_by_set(case):
    path, key, value = case
    _check(path, key, path, lambda: resolve(_file(path), path, [f"{key}={_yaml(value)}"]))


@PROPERTY
@given(case=CASES)
def test_any_value_in_a_runs_record(tmp_path_factory, case):
    """The record (config.yaml, a checkpoint's) names every key: an old key meets its new one there."""
    path, key, value = case
    source = tmp_path_factory.getbasetemp() / "run" / "config.yaml"
    _check(path, key, source, lambda: resolve(_put(copy.deepcopy(_record(path)), key, value), source))


@PROPERTY
@given(key=st.sampled_from(sorted(HOLDERS)), text=st.text(max_size=12))
def test_any_text_by_set(key, text):
    """What follows ``=`` need not be YAML at all."""
    path = HOLDERS[key][0]
    _check(path, key, path, lambda: resolve(_file(path), path, [f"{key}={text}"]))


@pytest.mark.parametrize("text", ["!!float abc", "!!int 1.5", "!!int [1]", "!!float {a: 1}", "!!binary AAAA",
                                  "2001-12-14", "!!set {a: null}", "&a [*a]", "{1: 2}", "{null: 2}", "{[a]: 1}"])
def test_tags_anchors_and_odd_keys_in_a_file_and_by_set(tmp_path, text):
    """Explicit tags skip YAML's resolver (``!!float abc`` made float() raise ValueError); a mapping's keys
    may be numbers or null (the closest known key was looked for among them as text)."""
    path = HOLDERS["train.lr"][0]
    for key in ("train.lr", "train.engine", "data.synthetic", "train.engine.executor", "model.name"):
        _check(path, key, path, lambda: resolve(_file(path), path, [f"{key}={text}"]))
        given_file = tmp_path / "given.yaml"
        given_file.write_text(yaml.safe_dump(_put(copy.deepcopy(_file(path)), key, "VALUE")).replace("VALUE", text))
        try:
            _check(path, key, given_file, lambda: load_config(given_file))
        except AssertionError:   # a YAML error names the line, which names the key's last part
            with pytest.raises(ConfigError, match=rf"^{given_file}: not valid YAML: [^\n]*\(line \d+, column \d+: "
                                                  rf"'{key.rsplit('.', 1)[-1]}: [^\n]*'\)$"):
                load_config(given_file)


@pytest.mark.parametrize("text", ["1: a", "null: {}", "[train]", "train: [a]", "model: {name: tree_lstm}\n7: x"])
def test_odd_sections_in_a_file(tmp_path, text):
    given_file = tmp_path / "given.yaml"
    given_file.write_text(text + "\n")
    with pytest.raises(ConfigError, match=rf"^{given_file}: [^\n]*$"):
        load_config(given_file)
