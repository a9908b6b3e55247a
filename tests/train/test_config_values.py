"""A config value of any YAML type, at any key of the key table (every bundled model's keys, the shared
sections, early stopping's, train.distributed's, the renamed old keys), in a file, by ``--set`` and in a run's
record: accepted, with the key's type, or refused by one ConfigError line that names the key; never another
exception."""
from __future__ import annotations

import copy
import functools
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings, strategies as st

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


def _offered(default, rule) -> list:
    """A key's default and its rule's choices."""
    return [default, *getattr(getattr(rule, "rule", rule), "options", ())]   # Nullable(Choice) too


def _near(key: str) -> list:
    """Values a key may well accept: its defaults and choices, small numbers, null, an empty mapping."""
    near = [None, True, False, 0, 1, 2, 0.5, 1e-3, "synthetic", {}]
    for path in HOLDERS[key]:
        near += _offered(*key_table(path)[key][:2])
    return near


def _words() -> list:
    """Strings the tables offer (defaults, choices, old values, key names): values a key may accept."""
    words = {w for _, (new, values) in config.RENAMED.items() for w in (new, *values)}
    for path in CONFIGS:
        for key, (default, rule, _) in key_table(path).items():
            words.update(key.split("."))
            words.update(w for w in _offered(default, rule) if isinstance(w, str))
    return sorted(words)


WORDS = _words()
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(),
                    st.text(st.characters(blacklist_categories=("Cs",)), max_size=6), st.sampled_from(WORDS))
MAP_KEYS = st.one_of(st.sampled_from(WORDS), st.text(max_size=3), st.integers(-3, 3), st.none(), st.booleans())
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(MAP_KEYS, inner,
                                                                                           max_size=3), max_leaves=6)
CASES = st.sampled_from(sorted(HOLDERS)).flatmap(lambda key: st.tuples(
    st.sampled_from(HOLDERS[key]), st.just(key), st.one_of(VALUES, st.sampled_from(_near(key)))))
_BUNDLED = config.bundled_models_dir()
SEEN = [(_BUNDLED / "tree_lstm.yaml", "train.engine.executor", ["a"]),   # TypeError, unhashable
        (_BUNDLED / "tree_lstm.yaml", "train.engine.executor", {"a": 1}),
        (_BUNDLED / "tree_lstm.yaml", "data.synthetic", {1: 2}),         # TypeError: 1 is no text to suggest
        (_BUNDLED / "tree_fc.yaml", "data.test", ["a"]),                 # accepted: no rule for a null default
        (_BUNDLED / "tree_lstm.yaml", "train.early_stopping.metric", {"a": 1}),
        (_BUNDLED / "tree_lstm.yaml", "data.train", "a\0b")]              # ValueError from os.path.realpath


def property_test(test):
    """Hypothesis over ``case``, the cases seen failing always among the examples."""
    for case in SEEN:
        test = example(case=case)(test)
    return settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(case=CASES)(test))


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


@property_test
def test_any_value_in_a_file(tmp_path_factory, case):
    path, key, value = case
    given_file = tmp_path_factory.getbasetemp() / "given.yaml"
    given_file.write_text(yaml.safe_dump(_put(copy.deepcopy(_file(path)), key, value), sort_keys=False,
                                         allow_unicode=True), encoding="utf-8")
    _check(path, key, given_file, lambda: load_config(given_file))


@property_test
def test_any_value_by_set(case):
    path, key, value = case
    _check(path, key, path, lambda: resolve(_file(path), path, [f"{key}={_yaml(value)}"]))


@property_test
def test_any_value_in_a_runs_record(tmp_path_factory, case):
    """The record (config.yaml, a checkpoint's) names every key: an old key meets its new one there."""
    path, key, value = case
    source = tmp_path_factory.getbasetemp() / "run" / "config.yaml"
    _check(path, key, source, lambda: resolve(_put(copy.deepcopy(_record(path)), key, value), source))


@settings(max_examples=120, deadline=None)
@given(key=st.sampled_from(sorted(HOLDERS)), text=st.text(max_size=12))
@example(key="train.engine.executor", text="[a]")
@example(key="train.lr", text="[1")
@example(key="train.lr", text="!!float abc")
def test_any_text_by_set(key, text):
    """What follows ``=`` need not be YAML at all."""
    path = HOLDERS[key][0]
    _check(path, key, path, lambda: resolve(_file(path), path, [f"{key}={text}"]))


TAGGED = ["!!float abc", "!!int 1.5", "!!int [1]", "!!float {a: 1}", "!!binary AAAA", "2001-12-14", "!!set {a: null}",
          "&a [*a]", "{1: 2}", "{null: 2}", "{[a]: 1}", "1" * 5000]   # int() takes at most 4300 digits


def test_tags_anchors_and_odd_keys_in_a_file_and_by_set(tmp_path):
    """Explicit tags skip YAML's resolver (``!!float abc`` made float() raise ValueError); a mapping's keys
    may be numbers or null (the closest known key was looked for among them as text)."""
    path, given_file = HOLDERS["train.lr"][0], tmp_path / "given.yaml"
    for text, key in itertools.product(TAGGED, ("train.lr", "train.engine", "data.synthetic",
                                                "train.engine.executor", "model.name")):
        _check(path, key, path, lambda: resolve(_file(path), path, [f"{key}={text}"]))
        given_file.write_text(yaml.safe_dump(_put(copy.deepcopy(_file(path)), key, "VALUE")).replace("VALUE", text))
        try:
            parse_yaml(given_file.read_text())
        except yaml.YAMLError:   # not YAML: the error names the line, which names the key's last part
            with pytest.raises(ConfigError, match=rf"^{given_file}: not valid YAML: [^\n]*\(line \d+, column \d+: "
                                                  rf"'{key.rsplit('.', 1)[-1]}: [^\n]*'\)$"):
                load_config(given_file)
        else:
            _check(path, key, given_file, lambda: load_config(given_file))


def test_odd_sections_in_a_file(tmp_path):
    given_file = tmp_path / "given.yaml"
    for text in ["1: a", "null: {}", "[train]", "train: [a]", "model: {name: tree_lstm}\n7: x"]:
        given_file.write_text(text + "\n")
        with pytest.raises(ConfigError, match=rf"^{given_file}: [^\n]*$"):
            load_config(given_file)


# --- the command line: exit 2, one line, nothing written ---------------------------------------------------

def test_the_cli_refuses_a_list_given_by_set(tmp_path):
    """The issue's reproduction, as a user runs it: a process, its exit status and its stderr."""
    tree_lstm = config.bundled_models_dir() / "tree_lstm.yaml"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "minicavs", "train", str(tree_lstm), "--set",
                           "train.engine.executor=[a]"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr == (f"minicavs train: error: {tree_lstm}: train.engine.executor (now train.engine.runner) "
                           "= ['a']: expected one of native, reference (from --set)\n")
    assert list(tmp_path.iterdir()) == []


def test_the_cli_refuses_a_mapping_in_a_file_and_a_list_in_a_runs_record(tmp_path, capsys):
    """``train CONFIG`` and ``train RUN --resume`` (a run stopped before its first checkpoint: its
    config.yaml is the record): exit 2, one line naming the key, the record left as it was."""
    tree_lstm = config.bundled_models_dir() / "tree_lstm.yaml"
    given_file, run = tmp_path / "given.yaml", tmp_path / "run"
    given_file.write_text(yaml.safe_dump(_put(copy.deepcopy(_file(tree_lstm)), "train.engine.executor", {"a": 1})))
    run.mkdir()
    record = yaml.safe_dump(_put(config.recorded(load_config(tree_lstm)), "train.distributed.timeout", [1]))
    (run / "config.yaml").write_text(record)
    for argv, where, key in ((["train", str(given_file), "--run-dir", str(run / "new")], given_file,
                              "train.engine.executor (now train.engine.runner) = {'a': 1}: expected one of"),
                             (["train", str(run), "--resume", "--no-progress"], run / "config.yaml",
                              "train.distributed.timeout: expected a number, got [1]")):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"minicavs train: error: {where}: {key}"), err
    assert (run / "config.yaml").read_text() == record and [p.name for p in run.iterdir()] == ["config.yaml"]
