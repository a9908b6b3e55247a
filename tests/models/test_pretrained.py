"""Pretrained word vectors in every bundled model with a word table: the rows the file holds are its vectors,
the others the initializer's; a frozen table gets no gradient, no optimizer slot, and stays bit-identical
through training while the other parameters change."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.engine.backend import to_host
from minicavs.train.config import ConfigError
from tests.models.test_models import TINY, trainer

WITH_TABLE = ["tree_lstm", "tree_lstm_child_sum", "tree_gru", "tree_lstm_2type", "mv_rnn", "var_lstm",
              "fixed_lstm"]


def vector_dim(name: str) -> int:
    """The dimension of the vectors a model's table takes: model.embed, or model.hidden for MV-RNN."""
    key = "model.hidden=" if name == "mv_rnn" else "model.embed="
    return int(next(o for o in TINY[name] if o.startswith(key)).split("=")[1])


def write_vectors(path, words, dim, seed=0) -> dict:
    """A GloVe file with a vector for each of ``words`` (values exact in float32) plus a word no model has."""
    rng = np.random.default_rng(seed)
    vecs = {w: np.round(rng.uniform(-1, 1, dim), 3).astype(np.float32) for w in list(words) + ["qqq-not-a-word"]}
    path.write_text("".join(w + " " + " ".join(f"{v:.3f}" for v in vec) + "\n" for w, vec in vecs.items()),
                    encoding="utf-8")
    return vecs


@pytest.mark.parametrize("name", WITH_TABLE)
def test_every_model_fills_its_table_from_the_file(name, tmp_path):
    plain = trainer(name, tmp_path / "plain")
    vocab = plain.task.vocabulary
    dim = vector_dim(name)
    vecs = write_vectors(tmp_path / "v.txt", vocab[1::2], dim)
    t = trainer(name, tmp_path, f"model.pretrained={tmp_path / 'v.txt'}")
    E, E0 = t.params["E"].value, plain.params["E"].value
    assert E.shape == E0.shape
    for i, w in enumerate(vocab):
        if w in vecs:
            np.testing.assert_array_equal(E[i, :dim], vecs[w])
            np.testing.assert_array_equal(E[i, dim:], E0[i, dim:])   # MV-RNN: the word's matrix stays random
        else:
            np.testing.assert_array_equal(E[i], E0[i])
    for other in plain.params:   # the other parameters are what they are without vectors
        if other != "E":
            np.testing.assert_array_equal(t.params[other].value, plain.params[other].value)
    source = t.params["E"].source
    assert (source["found"], source["words"], source["format"]) == (len(vocab[1::2]), len(vocab), "glove")


@pytest.mark.parametrize("name", [n for n in WITH_TABLE if n != "mv_rnn"])
def test_a_frozen_table_stays_bit_identical_while_the_rest_trains(name, tmp_path):
    write_vectors(tmp_path / "v.txt", trainer(name, tmp_path / "plain").task.vocabulary[::3], vector_dim(name))
    t = trainer(name, tmp_path, f"model.pretrained={tmp_path / 'v.txt'}", "model.freeze_embeddings=true")
    before = {k: p.value.copy() for k, p in t.params.items()}
    assert "E" not in t.optimizer.params and "E" not in t.optimizer.state     # no optimizer slot
    assert t.params["E"].node.attrs.get("frozen") and not t.params["E"].trainable
    assert all(not s.pull_grads for s in t.model.structures)    # the looked-up embeddings need no gradient
    data = t.task.data["train"]
    res = t.loss_and_grads(data[:8])
    assert "E" not in res.grads and set(res.grads) == set(t.params) - {"E"}
    for step in range(3):
        t.train_step(np.arange(8 * step, 8 * step + 8))
    assert t.params["E"].value.tobytes() == before["E"].tobytes()
    assert all(not np.array_equal(t.params[k].value, before[k]) for k in t.params if k != "E")


def test_the_same_model_unfrozen_trains_its_table(tmp_path):
    """The control of the test above: without freeze_embeddings the table has a gradient and changes."""
    t = trainer("tree_lstm", tmp_path)
    assert "E" in t.optimizer.params and all(s.pull_grads for s in t.model.structures)
    before = t.params["E"].value.copy()
    t.train_step(np.arange(8))
    assert not np.array_equal(t.params["E"].value, before)


def test_mv_rnns_table_cannot_be_frozen(tmp_path):
    with pytest.raises(ConfigError, match="model.freeze_embeddings: table E holds more than the word vectors"):
        trainer("mv_rnn", tmp_path, "model.freeze_embeddings=true")


@pytest.mark.parametrize("name", ["tree_fc", "lattice_lstm"])
def test_models_without_words_have_no_pretrained_key(name, tmp_path):
    """Tree-FC has no table; Lattice-LSTM's tables index generated character ids, which no file names."""
    with pytest.raises(ConfigError, match="unknown config key 'model.pretrained'"):
        trainer(name, tmp_path, "model.pretrained=v.txt")


@pytest.mark.parametrize("name", ["tree_lstm", "var_lstm"])
def test_a_null_embed_takes_the_files_dimension(name, tmp_path):
    vocab = trainer(name, tmp_path / "plain").task.vocabulary
    write_vectors(tmp_path / "v.txt", vocab[:5], 7)
    t = trainer(name, tmp_path, f"model.pretrained={tmp_path / 'v.txt'}", "model.embed=null")
    assert t.params["E"].shape == (len(vocab), 7)
    assert t.cfg["model"]["embed"] is None      # recorded as given: the checkpoint's record has the dimension
    t.train_step(np.arange(4))
    with pytest.raises(ConfigError, match="model.embed = 6, but model.pretrained .* holds 7-dimensional"):
        trainer(name, tmp_path, f"model.pretrained={tmp_path / 'v.txt'}")
    with pytest.raises(ConfigError, match="model.embed is null, which takes the dimension from model.pretrained"):
        trainer(name, tmp_path, "model.embed=null")


def test_a_frozen_table_on_the_emulated_device(cuda_standin, tmp_path):
    """On the device too: no slot for the frozen table, which stays bit-identical; the other parameters
    train as on the CPU."""
    write_vectors(tmp_path / "v.txt", trainer("tree_lstm", tmp_path / "plain").task.vocabulary[::2], 6)
    sets = [f"model.pretrained={tmp_path / 'v.txt'}", "model.freeze_embeddings=true", "train.dtype=float64"]
    cpu, dev = trainer("tree_lstm", tmp_path / "cpu", *sets), trainer("tree_lstm", tmp_path, *sets, "train.device=cuda")
    assert dev.device.name == "cuda" and "E" not in dev.optimizer.state
    before = cpu.params["E"].value.copy()
    for step in range(3):
        for t in (cpu, dev):
            t.train_step(np.arange(8 * step, 8 * step + 8))
    assert to_host(dev.params["E"].value).tobytes() == before.tobytes()
    for name, p in cpu.params.items():
        np.testing.assert_allclose(to_host(dev.params[name].value), p.value, rtol=1e-10, atol=1e-10)
