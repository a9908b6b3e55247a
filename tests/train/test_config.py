"""Configs: YAML 1.2 numbers, every value range- and choice-checked at load with the file, key, value and the
allowed values named, nulls refused where a value is needed, data paths relative to the config file."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from minicavs.train import config
from minicavs.train.config import (ConfigError, Loader, bundled_models_dir, data_root, dump, find_config, load_config,
                             parse_yaml)
from minicavs.train.datasets import default_dir

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
TREE_LSTM = MODELS / "tree_lstm.yaml"


@pytest.mark.parametrize("text, value", [
    ("1e-3", 1e-3), ("1E3", 1000.0), ("-2.5e+2", -250.0), (".5", 0.5), ("1.", 1.0), ("3", 3), ("-7", -7),
    ("010", 10), ("0o17", 15), ("0x1f", 31), (".inf", float("inf")), ("1_000", "1_000"), ("1:30", "1:30"),
    ("1e", "1e"), ("e3", "e3"), ("true", True), ("null", None), ("0.001", 0.001),
])
def test_yaml_1_2_numbers(text, value):
    assert parse_yaml(f"v: {text}")["v"] == value
    assert type(parse_yaml(f"v: {text}")["v"]) is type(value)


def test_yaml_1_2_numbers_in_files_and_overrides(tmp_path):
    cfg = yaml.safe_load(TREE_LSTM.read_text())
    cfg["train"]["lr"] = "LR"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg).replace("LR", "1e-3").replace("'1e-3'", "1e-3"))
    assert load_config(path)["train"]["lr"] == 1e-3
    assert load_config(TREE_LSTM, ["train.lr=2e-2", "train.weight_decay=1E-5"])["train"]["lr"] == 0.02
    assert yaml.load("a: 1e-3", Loader=yaml.SafeLoader)["a"] == "1e-3"    # what PyYAML's own loader does
    assert yaml.load("a: 1e-3", Loader=Loader)["a"] == 1e-3


@pytest.mark.parametrize("override, message", [
    ("train.batch_size=-5", "train.batch_size = -5: must be an integer >= 1"),
    ("train.batch_size=0", "train.batch_size = 0: must be an integer >= 1"),
    ("model.hidden=0", "model.hidden = 0: must be an integer >= 1"),
    ("model.embed=-1", "model.embed = -1: must be an integer >= 1"),
    ("train.lr=0", "train.lr = 0.0: must be a finite number > 0"),
    ("train.lr=-1e-3", "train.lr = -0.001: must be a finite number > 0"),
    ("train.lr=.nan", "train.lr = nan: must be a finite number > 0"),
    ("train.optimizer=adamw", "train.optimizer = 'adamw': must be one of sgd, adagrad, adam"),
    ("train.dtype=float16", "train.dtype = 'float16': must be one of float32, float64"),
    ("train.device=tpu", "train.device = 'tpu': must be one of cpu, cuda"),
    ("train.policy=greedy2", "train.policy = 'greedy2': must be one of cavs, depth, agenda, greedy, fsm, serial, "
                             "fsm:S1, fsm:S2, fsm:S3"),
    ("train.policy=fsm:S9", "train.policy = 'fsm:S9': must be one of cavs, depth, agenda, greedy, fsm, serial, "
                            "fsm:S1, fsm:S2, fsm:S3"),
    ("train.epochs=0", "train.epochs = 0: must be an integer >= 1"),
    ("train.seed=-1", "train.seed = -1: must be an integer >= 0"),
    ("train.weight_decay=-0.1", "train.weight_decay = -0.1: must be a finite number >= 0"),
    ("train.clip_norm=0", "train.clip_norm = 0: must be a finite number > 0"),
    ("train.eval_batch_size=0", "train.eval_batch_size = 0: must be an integer >= 1"),
    ("model.dropout=1.0", r"model.dropout = 1.0: must be a finite number in \[0, 1\)"),
    ("model.variant=foo", "model.variant = 'foo': must be one of binary, child_sum"),
    ("model.classes=1", "model.classes = 1: must be an integer >= 2"),
    ("data.synthetic.train=0", "data.synthetic.train = 0: must be an integer >= 1"),
    ("train.early_stopping.mode=up", "train.early_stopping.mode = 'up': must be one of min, max"),
    ("train.early_stopping.patience=0", "train.early_stopping.patience = 0: must be an integer >= 1"),
    ("train.lr=null", "train.lr: null is not allowed; expected a finite number > 0"),
    ("train.batch_size=null", "train.batch_size: null is not allowed; expected an integer >= 1"),
    ("model.hidden=null", "model.hidden: null is not allowed; expected an integer >= 1"),
    ("train.engine.fusion=null", "train.engine.fusion: null is not allowed"),
    ("data.train=null", "data.train: null is not allowed"),
    ("model.name=null", "model.name is required"),
    ("train.engine.streams=true", "unknown config key 'train.engine.streams' \\(did you mean 'streaming'\\?\\)"),
    ("data.synthetic.size=3", "unknown config key 'data.synthetic.size'"),
])
def test_every_value_is_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=f"^{TREE_LSTM}: {message}") as info:
        load_config(TREE_LSTM, [override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("old, new", [("native", "device"), ("reference", "reference")])
def test_the_runners_old_key_reads_as_the_new_one_in_files_overrides_and_records(tmp_path, old, new):
    """``train.engine.executor`` (native | reference) was renamed ``runner`` (device | reference): a config
    file, a --set and a run's record that still say it mean the new key."""
    cfg = yaml.safe_load(TREE_LSTM.read_text())
    cfg.setdefault("train", {}).setdefault("engine", {})["executor"] = old
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(cfg))
    for got in (load_config(path), load_config(TREE_LSTM, [f"train.engine.executor={old}"])):
        assert got["train"]["engine"]["runner"] == new and "executor" not in got["train"]["engine"]
    current = load_config(TREE_LSTM, [f"train.engine.runner={new}"])
    record = config.recorded(current)
    record["train"]["engine"]["executor"] = old
    del record["train"]["engine"]["runner"]
    assert config.differences(config.recorded(config.resolve(record, TREE_LSTM)), config.recorded(current)) == []


def test_the_runners_old_key_with_a_bad_or_contradicting_value_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train.engine.executor \(now train.engine.runner\) = 'python': expected "
                                          r"one of native, reference \(from --set\)$"):
        load_config(TREE_LSTM, ["train.engine.executor=python"])
    cfg = yaml.safe_load(TREE_LSTM.read_text())
    cfg.setdefault("train", {})["engine"] = {"executor": "native", "runner": "reference"}
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=rf"^{path}: train.engine.executor = 'native' \(the old name of "
                                          r"train.engine.runner\) contradicts train.engine.runner = 'reference'"):
        load_config(path)
    cfg["train"]["engine"] = {"executor": "reference", "runner": "reference"}
    path.write_text(yaml.safe_dump(cfg))
    assert load_config(path)["train"]["engine"]["runner"] == "reference"


def test_an_old_key_given_by_set_overrides_the_new_key_of_a_file_or_record(tmp_path):
    """``--set train.engine.executor=reference`` on a config (or a run's record, which names every key) that
    says ``runner: device``: the later word wins, as with any override."""
    cfg = yaml.safe_load(TREE_LSTM.read_text())
    cfg.setdefault("train", {})["engine"] = {"runner": "device"}
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert load_config(path, ["train.engine.executor=reference"])["train"]["engine"]["runner"] == "reference"
    assert load_config(path, ["train.engine.executor=reference",
                              "train.engine.runner=device"])["train"]["engine"]["runner"] == "device"


def test_a_bad_value_in_a_file_names_the_file_and_not_set(tmp_path):
    cfg = yaml.safe_load(TREE_LSTM.read_text())
    cfg["train"]["batch_size"] = -5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=rf"^{path}: train.batch_size = -5: must be an integer >= 1$"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"train.batch_size = -5: must be an integer >= 1 \(from --set\)$"):
        load_config(TREE_LSTM, ["train.batch_size=-5"])


def test_other_models_rules():
    with pytest.raises(ConfigError, match="model.window = 0: must be an integer >= 1"):
        load_config(MODELS / "fixed_lstm.yaml", ["model.window=0"])
    with pytest.raises(ConfigError, match=r"data.dev_fraction = 1.5: must be a finite number in \[0, 1\)"):
        load_config(MODELS / "var_lstm.yaml", ["data.dev_fraction=1.5"])
    with pytest.raises(ConfigError, match="model.leaves = 1: must be an integer >= 2"):
        load_config(MODELS / "tree_fc.yaml", ["model.leaves=1"])


def test_data_paths_resolve_against_the_config_file_and_set_against_the_cwd(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "work").mkdir()
    path = tmp_path / "cfg" / "c.yaml"
    path.write_text("model: {name: tree_lstm}\ndata: {train: ../data/train.txt, dev: null, test: synthetic}\n")
    monkeypatch.chdir(tmp_path / "work")
    cfg = load_config(path)
    assert cfg["data"]["train"] == str(tmp_path / "data" / "train.txt")
    assert cfg["data"]["test"] == "synthetic" and cfg["data"]["dev"] is None
    cfg = load_config(path, ["data.dev=mine/dev.txt"])
    assert cfg["data"]["dev"] == str(tmp_path / "work" / "mine" / "dev.txt")
    assert cfg["data"]["train"] == str(tmp_path / "data" / "train.txt")


def test_data_paths_under_the_data_root(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("model: {name: tree_lstm}\n"
                    "data: {train: $MINICAVS_DATA/sst/a.txt, dev: '${MINICAVS_DATA}/b.txt', test: $MINICAVS_DATAX/c}\n")
    monkeypatch.delenv("MINICAVS_DATA", raising=False)
    data = load_config(path)["data"]
    assert data["train"] == str(REPO / "data" / "sst" / "a.txt") and data["dev"] == str(REPO / "data" / "b.txt")
    assert data["test"] == str(tmp_path / "$MINICAVS_DATAX" / "c")     # another variable: a plain relative path
    monkeypatch.setenv("MINICAVS_DATA", str(tmp_path / "mine"))
    assert load_config(path)["data"]["train"] == str(tmp_path / "mine" / "sst" / "a.txt")
    assert default_dir("ptb") == tmp_path / "mine" / "ptb"


def test_an_installed_package_keeps_data_in_the_users_data_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MINICAVS_DATA", raising=False)
    monkeypatch.setattr(config, "_installed", lambda: True)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert data_root() == tmp_path / "minicavs"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert data_root() == Path.home().resolve() / ".local" / "share" / "minicavs"


def test_bundled_configs_by_name_and_the_resolved_config_reads_back(tmp_path):
    assert find_config("tree_lstm") == bundled_models_dir() / "tree_lstm.yaml"
    with pytest.raises(FileNotFoundError, match="bundled configs: bilstm_tagger, fixed_lstm, lattice_gru, lattice_lstm, lstm_nmt, mv_rnn, "
                       "seq2seq, tree_fc, tree_gru, tree_lstm, tree_lstm_2type, tree_lstm_sst, var_lstm, var_lstm_ptb"):
        find_config("tree_lsmt")
    cfg = load_config("tree_lstm", ["model.hidden=7", "train.lr=1e-4"])
    assert cfg["model"]["name"] == "tree_lstm"
    again = tmp_path / "config.yaml"
    again.write_text(dump(cfg, header="a header"))
    assert load_config(again)["model"] == cfg["model"] and load_config(again)["train"] == cfg["train"]


def test_a_model_file_given_by_path_is_recorded_by_absolute_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{name: {MODELS / 'tree_fc.py'}}}\n")
    assert load_config(path)["model"]["name"] == "tree_fc"       # the bundled module, by name
    (tmp_path / "mine.py").write_text((MODELS / "tree_fc.py").read_text())
    path.write_text("model: {name: mine.py}\n")
    assert load_config(path)["model"]["name"] == str(tmp_path / "mine.py")


@pytest.mark.parametrize("model, key, value", [
    ("tree_fc", "data.limit", 5), ("var_lstm", "model.hiden", 3), ("tree_lstm", "train.engine.fast", True),
    ("tree_lstm", "data.synthetic.size", 5), ("var_lstm", "train.early_stopping.metrc", "dev_loss"),
])
def test_an_unknown_key_says_whether_set_or_the_file_gave_it(tmp_path, model, key, value):
    with pytest.raises(ConfigError, match=rf"^{MODELS / model}.yaml: unknown config key '{key}'.* \(from --set\)$"):
        load_config(MODELS / f"{model}.yaml", [f"{key}={str(value).lower()}"])
    cfg = yaml.safe_load((MODELS / f"{model}.yaml").read_text())
    *parents, last = key.split(".")
    node = cfg
    for k in parents:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    node[last] = value
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'c.yaml'}: unknown config key '{key}'") as info:
        load_config(tmp_path / "c.yaml")
    assert "--set" not in str(info.value)


@pytest.mark.parametrize("override", ["foo.bar=1", "modle.hidden=3", "Train.lr=0.1"])
def test_an_unknown_section_from_set_is_refused(override):
    with pytest.raises(ConfigError, match=rf"--set '{override}': unknown config section '{override.split('.')[0]}'"):
        load_config(TREE_LSTM, [override])


# --- the pretrained-vector keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tree_lstm", "tree_gru", "tree_lstm_2type", "mv_rnn", "var_lstm", "fixed_lstm"])
def test_models_with_a_word_table_take_the_pretrained_keys(model):
    cfg = load_config(MODELS / f"{model}.yaml")
    assert {k: cfg["model"][k] for k in ("pretrained", "pretrained_format", "freeze_embeddings")} == \
        {"pretrained": None, "pretrained_format": "auto", "freeze_embeddings": False}
    with pytest.raises(ConfigError, match=r"model.pretrained_format = 'word2vec': must be one of auto, glove, "
                                          r"word2vec-text, fasttext-vec"):
        load_config(MODELS / f"{model}.yaml", ["model.pretrained_format=word2vec"])
    with pytest.raises(ConfigError, match=r"model.pretrained = 5: must be a non-empty string"):
        load_config(MODELS / f"{model}.yaml", ["model.pretrained=5"])
    with pytest.raises(ConfigError, match=r"model.freeze_embeddings: expected true/false"):
        load_config(MODELS / f"{model}.yaml", ["model.freeze_embeddings=yes please"])


def test_a_nullable_key_takes_null_and_others_still_refuse_it():
    """model.embed: null means "the vectors' dimension"; model.hidden has no such meaning and refuses null."""
    assert load_config(TREE_LSTM, ["model.embed=null"])["model"]["embed"] is None
    with pytest.raises(ConfigError, match=r"model.embed = 0: must be an integer >= 1, or null \(the dimension of "
                                          r"model.pretrained's vectors\)"):
        load_config(TREE_LSTM, ["model.embed=0"])
    with pytest.raises(ConfigError, match=r"model.hidden: null is not allowed"):
        load_config(TREE_LSTM, ["model.hidden=null"])


def test_the_vector_path_is_relative_to_the_config_file_or_to_the_cwd_with_set(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    cfg = yaml.safe_load(TREE_LSTM.read_text())
    cfg["model"].update(name="tree_lstm", pretrained="vecs/glove.txt.gz")
    (tmp_path / "conf" / "c.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    assert load_config("conf/c.yaml")["model"]["pretrained"] == str(tmp_path / "conf" / "vecs" / "glove.txt.gz")
    assert load_config("conf/c.yaml", ["model.pretrained=here.vec"])["model"]["pretrained"] == \
        str(tmp_path / "here.vec")
    assert load_config("conf/c.yaml", ["model.hidden=3"])["model"]["pretrained"] == \
        str(tmp_path / "conf" / "vecs" / "glove.txt.gz")     # another --set leaves the file's path as it was
    monkeypatch.setenv("MINICAVS_DATA", str(tmp_path / "data"))
    assert load_config(TREE_LSTM, ["model.pretrained=$MINICAVS_DATA/glove/g.txt"])["model"]["pretrained"] == \
        str(tmp_path / "data" / "glove" / "g.txt")
