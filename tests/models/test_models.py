"""Every bundled model: a short training run lowers the loss below a bound, gradients match finite
differences, and the batched run equals the serial one."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minicavs.data.text import synthetic_corpus
from minicavs.engine.compile import EngineOptions
from minicavs.engine.explain import check
from minicavs.engine.passes import gemm
from minicavs.runtime.fsm import Hyper
from minicavs.runtime.scheduler import FsmPolicy, get_policy
from minicavs.train.testing import check_model_grads
from minicavs.train.trainer import Trainer

MODELS = Path(__file__).resolve().parents[2] / "models"

TINY = {
    "tree_lstm": ["model.embed=6", "model.hidden=5", "data.synthetic.train=60", "data.synthetic.dev=20",
                  "data.synthetic.test=20", "data.synthetic.vocab=40", "model.dropout=0.0"],
    "tree_lstm_child_sum": ["model.variant=child_sum", "model.embed=6", "model.hidden=5",
                            "data.synthetic.train=60", "data.synthetic.dev=20", "data.synthetic.test=20",
                            "data.synthetic.vocab=40", "model.dropout=0.0"],
    "var_lstm": ["model.embed=6", "model.hidden=5", "data.synthetic.train=60", "data.synthetic.dev=20",
                 "data.synthetic.test=20", "data.synthetic.vocab=30", "model.dropout=0.0"],
    "fixed_lstm": ["model.embed=6", "model.hidden=5", "model.window=8", "data.synthetic.train=40",
                   "data.synthetic.dev=10", "data.synthetic.test=10", "data.synthetic.vocab=30",
                   "model.dropout=0.0"],
    "tree_fc": ["model.hidden=4", "model.leaves=8", "data.synthetic.train=40", "data.synthetic.dev=10"],
    "tree_gru": ["model.embed=6", "model.hidden=5", "data.synthetic.train=60", "data.synthetic.dev=20",
                 "data.synthetic.test=20", "data.synthetic.vocab=40", "model.dropout=0.0"],
    "tree_lstm_2type": ["model.embed=6", "model.hidden=5", "data.synthetic.train=60", "data.synthetic.dev=20",
                        "data.synthetic.test=20", "data.synthetic.vocab=40", "model.dropout=0.0"],
    "mv_rnn": ["model.hidden=3", "data.synthetic.train=60", "data.synthetic.dev=20", "data.synthetic.test=20",
               "data.synthetic.vocab=40", "model.dropout=0.0"],
    "lattice_lstm": ["model.embed=4", "model.hidden=5", "data.synthetic.train=40", "data.synthetic.dev=10",
                     "data.synthetic.test=10", "data.synthetic.max_len=12"],
    "lattice_gru": ["model.embed=4", "model.hidden=5", "data.synthetic.train=40", "data.synthetic.dev=10",
                    "data.synthetic.test=10", "data.synthetic.max_len=12"],
    "bilstm_tagger": ["model.embed=4", "model.hidden=5", "model.vocab=12", "data.synthetic.train=40",
                      "data.synthetic.dev=10", "data.synthetic.test=10", "data.synthetic.max_len=8"],
    "lstm_nmt": ["model.embed=4", "model.hidden=5", "model.max_len=4", "data.synthetic.train=40",
                 "data.synthetic.dev=10", "data.synthetic.test=10"],
}


def trainer(name, tmp_path, *extra):
    config = MODELS / f"{name.replace('_child_sum', '')}.yaml"
    return Trainer(config, TINY[name] + list(extra), run_dir=tmp_path / name)


# (overrides for a short run, the training-loss bound it must reach)
SHORT = {
    "tree_lstm": (["model.embed=16", "model.hidden=16", "train.epochs=5", "train.lr=0.1",
                   "data.synthetic.train=300"], 0.75),
    "tree_lstm_child_sum": (["model.embed=16", "model.hidden=16", "train.epochs=5", "train.lr=0.1",
                             "data.synthetic.train=300"], 0.75),
    "var_lstm": (["model.embed=16", "model.hidden=32", "train.epochs=8", "train.lr=0.01",
                  "data.synthetic.train=300", "train.batch_size=16"], 0.85),
    "fixed_lstm": (["model.embed=16", "model.hidden=32", "train.epochs=8", "train.lr=0.01",
                    "data.synthetic.train=300", "model.window=16", "train.batch_size=8"], 0.85),
    "tree_fc": (["train.epochs=30", "train.lr=0.01", "train.batch_size=8"], 0.3),
    "tree_gru": (["model.embed=16", "model.hidden=16", "train.epochs=5", "train.lr=0.1",
                  "data.synthetic.train=300"], 0.75),
    "tree_lstm_2type": (["model.embed=16", "model.hidden=16", "train.epochs=5", "train.lr=0.1",
                         "data.synthetic.train=300"], 0.75),
    "mv_rnn": (["model.hidden=8", "train.epochs=5", "train.lr=0.1", "data.synthetic.train=300"], 0.75),
    "lattice_lstm": (["model.embed=16", "model.hidden=16", "train.epochs=6", "train.lr=0.02",
                      "data.synthetic.train=200", "train.batch_size=16", "train.policy=cavs"], 0.75),
    "lattice_gru": (["model.embed=16", "model.hidden=16", "train.epochs=6", "train.lr=0.02",
                     "data.synthetic.train=200", "train.batch_size=16", "train.policy=cavs"], 0.75),
    "bilstm_tagger": (["model.embed=8", "model.hidden=16", "train.epochs=4", "data.synthetic.train=300"], 0.75),
    "lstm_nmt": (["model.hidden=16", "train.epochs=4", "data.synthetic.train=300", "train.batch_size=16"], 0.75),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_short_training_lowers_the_loss(name, tmp_path):
    overrides, ratio = SHORT[name]
    t = trainer(name, tmp_path, *overrides)
    before = t.evaluate("train")["train_loss"]
    history = t.fit(progress=False, log=lambda s: None)
    after = t.evaluate("train")["train_loss"]
    bound = ratio * before
    assert before > bound and after < bound, (before, after, [h["train_loss"] for h in history])


@pytest.mark.parametrize("runner", ["device", "reference"])   # (the C runner, the reference runner)
@pytest.mark.parametrize("name", sorted(TINY))
def test_gradients_match_finite_differences(name, runner, tmp_path):
    t = trainer(name, tmp_path, "train.dtype=float64", f"train.engine.runner={runner}")
    samples = t.task.data["train"][:3]
    graphs, feeds = t.task.batch(samples)
    params = {k: p.value for k, p in t.params.items()}
    report = check_model_grads(t.model, graphs, feeds, params, directions=1, ctx=t.context(training=False))
    assert set(report) == set(params)
    rep = check(t.model, graphs, feeds, params, ctx=t.context(training=False))
    assert rep["max"] <= 1e-10 * max(1.0, abs(t.model.run(graphs, feeds, params, t.context(False),
                                                             backward_pass=False).loss))


# The products each model's cells merge into one GEMM (passes/gemm.py), counted by hand from the cells: the
# binary Tree-LSTM's [h1; h2]·U, h1·U_f1, h2·U_f2 (per internal type in 2Type); the lattices' char_words cells
# x·W_c and x·W_g (their plain char cells have only x·W_c). The child-sum variant's h_k·U_f share the weight,
# not the left operand (so do the lattice GRU's h_k·U_g); the LSTMs' x·W_x (eager) and h·W_h (recurrent) differ
# in class (the tagger's and the encoder-decoder's too); Tree-GRU's second product reads the first's output;
# MV-RNN's [B·a; A·b]·W and W_M·[A; B] share no operand.
MERGED = {"tree_lstm": {"internal": 3}, "tree_lstm_2type": {"cell_a": 3, "cell_b": 3},
          "lattice_lstm": {"char_words": 2}, "lattice_gru": {"char_words": 2}}


@pytest.mark.parametrize("name", sorted(TINY))
def test_merged_gemms_equal_the_declared_products(name, tmp_path, monkeypatch):
    monkeypatch.setattr(gemm, "PAD_LIMIT", 10**9)   # every merge the pass can make, whatever its size
    monkeypatch.setattr(gemm, "WEIGHT_LIMIT", 10**9)
    t = trainer(name, tmp_path, "train.dtype=float64",
                *([] if name in ("tree_fc", "lstm_nmt") else ["model.dropout=0.3"]))
    merged = {k: sum(len(m.products) for m in fn.variant(EngineOptions()).merges)
              for s in t.model.structures for k, fn in s.compiled.items()}
    assert {k: n for k, n in merged.items() if n} == MERGED.get(name, {})
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    params = {k: p.value for k, p in t.params.items()}
    off, on = (t.model.forward_backward(graphs, feeds, params, t.context(training=True),
                                        options=EngineOptions(merge_gemms=m)) for m in (False, True))
    scale = max(1.0, abs(off.loss))
    assert abs(off.loss - on.loss) <= 1e-10 * scale
    assert set(off.grads) == set(on.grads)
    for k in off.grads:
        a, b = (np.asarray(getattr(g, "to_dense", lambda: g)()) for g in (off.grads[k], on.grads[k]))
        assert np.max(np.abs(a - b)) <= 1e-10 * max(1.0, float(np.max(np.abs(a)))), k


@pytest.mark.parametrize("runner", ["device", "reference"])
@pytest.mark.parametrize("name", ["tree_lstm", "tree_gru", "tree_lstm_2type", "lattice_lstm", "mv_rnn",
                                  "lattice_gru", "bilstm_tagger", "lstm_nmt"])
def test_batched_equals_serial_for_every_policy(name, runner, tmp_path):
    t = trainer(name, tmp_path, "train.dtype=float64", f"train.engine.runner={runner}")
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    params = {k: p.value for k, p in t.params.items()}
    scale = max(1.0, abs(t.model.run(graphs, feeds, params, t.context(False), backward_pass=False).loss))
    fsm = [FsmPolicy(encoding="S3", hyper=Hyper(episodes=100))]   # short learning
    for policy in ["cavs", "agenda", "greedy"] + fsm:
        t.model.policy = get_policy(policy)
        assert check(t.model, graphs, feeds, params, ctx=t.context(training=False))["max"] <= 1e-10 * scale, policy


def test_perplexity_is_exp_of_mean_nll(tmp_path):
    t = trainer("var_lstm", tmp_path)
    m = t.evaluate("dev")
    assert np.isclose(m["dev_perplexity"], np.exp(m["dev_nll_per_word"]))
    words = sum(len(y) for _, y in t.task.data["dev"])
    assert np.isclose(m["dev_loss"] * len(t.task.data["dev"]), m["dev_nll_per_word"] * words)


def test_unigram_baseline_counts_training_words_and_eos(tmp_path):
    """The reported baseline: an add-one unigram over the training sentences' words and their <eos>,
    counted here from the raw tokens rather than the model's id arrays."""
    t = trainer("var_lstm", tmp_path)
    vocab = t.task.vocab
    syn = t.cfg["data"]["synthetic"]  # the sentences the config generates
    train = synthetic_corpus(int(syn["train"]), int(syn["seed"]), int(syn["vocab"]), 0)
    dev = synthetic_corpus(int(syn["dev"]), int(syn["seed"]), int(syn["vocab"]), 1)
    counts = {w: 1 for w in vocab.words}
    for s in train:
        for w in s + ["<eos>"]:
            counts[w if w in counts else "<unk>"] += 1
    total = sum(counts.values())
    dev_words = [w if w in counts else "<unk>" for s in dev for w in s + ["<eos>"]]
    want = np.exp(-np.mean([np.log(counts[w] / total) for w in dev_words]))
    got = t.evaluate("dev")["dev_unigram_perplexity"]
    assert np.isclose(got, want, rtol=1e-12)
    assert t.evaluate("dev")["dev_perplexity"] != got


def test_tree_fc_batch_of_consecutive_trees_is_a_read_only_view_and_trains_the_same(tmp_path):
    """Tree-FC's batch feeds the leaf inputs of consecutive trees as a view of the data set's array (no copy);
    other batches are copies; both give the same loss and gradients, and a run cannot write the data set."""
    t = trainer("tree_fc", tmp_path)
    data = t.task.data["train"]
    in_order, shuffled = data[4:12], [data[i] for i in (5, 4, 6, 7, 8, 9, 10, 11)]
    view = t.task.batch(in_order)[1]["xs"]
    assert np.shares_memory(view, data[4][0]) and not view.flags.writeable
    assert np.array_equal(view, np.concatenate([x for x, _ in in_order]))
    assert not np.shares_memory(t.task.batch(shuffled)[1]["xs"], data[5][0])
    assert not np.shares_memory(t.task.batch([data[4], data[6]])[1]["xs"], data[4][0])
    before = np.stack([x for x, _ in data]).copy()
    a = t.loss_and_grads(in_order)
    copied = [(x.copy(), y) for x, y in in_order]
    assert not np.shares_memory(t.task.batch(copied)[1]["xs"], data[4][0])
    b = t.loss_and_grads(copied)
    assert a.loss == b.loss and all(np.array_equal(a.grads[k], b.grads[k]) for k in a.grads)
    assert np.array_equal(np.stack([x for x, _ in data]), before)


def _sample_key(task, sample):
    """A comparable form of a data sample: a tree's brackets, or the words its arrays of ids stand for (a
    vocabulary built from fewer sentences numbers them otherwise)."""
    if hasattr(sample, "to_bracket"):
        return sample.to_bracket()
    if isinstance(sample, (tuple, list)):
        return tuple(_sample_key(task, x) for x in sample)
    return [task.vocab.words[i] for i in np.asarray(sample).tolist()]


READS_DATA = ["tree_lstm", "tree_gru", "tree_lstm_2type", "mv_rnn", "var_lstm", "fixed_lstm"]


@pytest.mark.parametrize("name", READS_DATA)
def test_data_limit_keeps_the_first_samples_of_every_split(name, tmp_path):
    """``data.limit`` exists on every bundled model that reads a data set (tree_fc and lattice_lstm generate
    theirs, sized by data.synthetic)."""
    full = trainer(name, tmp_path).task
    limited = trainer(name, tmp_path, "data.limit=3").task
    assert set(limited.data) == set(full.data)
    for split, samples in limited.data.items():
        assert 0 < len(samples) < len(full.data[split])
        ours, theirs = _sample_key(limited, samples), _sample_key(full, full.data[split][:len(samples)])
        assert len(ours) == len(theirs)
        for a, b in zip(_flat(ours), _flat(theirs), strict=True):   # (fewer training words: more of them <unk>)
            assert a == b or a == "<unk>", (split, a, b)


def _flat(key) -> list:
    return [x for item in key for x in _flat(item)] if isinstance(key, (tuple, list)) else [key]
