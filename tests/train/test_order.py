"""The epoch's batch order (minicavs/train/order.py, ``train.order``): bucketing groups samples of similar
length, every sample once an epoch, drawn from (seed, epoch) alone; the trainer uses it, and refuses a bad value
or a model without sample lengths in one line naming the key."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minicavs.train.config import ConfigError
from minicavs.train.order import bucketed, shuffled
from minicavs.train.trainer import Trainer

MODELS = Path(__file__).resolve().parents[2] / "models"
LM = ["model.embed=4", "model.hidden=3", "data.synthetic.train=150", "data.synthetic.dev=10",
      "data.synthetic.test=10", "data.synthetic.vocab=20", "train.batch_size=16"]


def _padded_steps(batches, lengths) -> int:
    """Rows x steps a padded loop runs: each batch as many steps as its longest sample, on every row."""
    return sum(len(b) * int(lengths[b].max()) for b in batches)


def test_buckets_hold_every_sample_once_in_batches_of_neighbouring_lengths():
    lengths = np.random.default_rng(0).integers(1, 40, 203)
    batches = bucketed(lengths, 16, np.random.default_rng([1, 1]))
    assert sorted(np.concatenate(batches).tolist()) == list(range(203))
    assert sorted(len(b) for b in batches) == [11] + [16] * 12
    spans = sorted((int(lengths[b].min()), int(lengths[b].max())) for b in batches)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(spans, spans[1:]))   # no two buckets overlap
    shuffle = shuffled(len(lengths), 16, np.random.default_rng([1, 1]))
    assert _padded_steps(batches, lengths) < 0.7 * _padded_steps(shuffle, lengths)


def test_buckets_are_drawn_from_the_seed_and_epoch_alone():
    lengths = np.repeat(np.arange(1, 6), 20)   # many samples per length: which share a batch is drawn
    again = [bucketed(lengths, 8, np.random.default_rng([3, e])) for e in (1, 1, 2)]
    assert all(np.array_equal(a, b) for a, b in zip(again[0], again[1]))
    assert [b.tolist() for b in again[0]] != [b.tolist() for b in again[2]]   # the next epoch differs: the
    assert {frozenset(b.tolist()) for b in again[0]} != {frozenset(b.tolist()) for b in again[2]}   # members too


def test_the_trainer_draws_bucketed_batches_of_similar_length(tmp_path):
    t = Trainer(MODELS / "var_lstm.yaml", LM + ["train.order=bucket"], run_dir=tmp_path / "b")
    lengths = t.task.sample_lengths(t.task.data["train"])
    batches = t.epoch_batches(1)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    assert np.array_equal(t.epoch_order(1), np.concatenate(batches))
    plain = Trainer(MODELS / "var_lstm.yaml", LM, run_dir=tmp_path / "s")
    assert _padded_steps(batches, lengths) < 0.8 * _padded_steps(plain.epoch_batches(1), lengths)
    other = Trainer(MODELS / "var_lstm.yaml", LM + ["train.order=bucket"], run_dir=tmp_path / "c")
    assert all(np.array_equal(a, b) for a, b in zip(batches, other.epoch_batches(1)))


def test_a_bad_order_or_a_model_without_lengths_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"train.order = 'sorted': must be one of shuffle, bucket"):
        Trainer(MODELS / "var_lstm.yaml", LM + ["train.order=sorted"], run_dir=tmp_path / "x")
    with pytest.raises(ConfigError, match=r"train.order = 'bucket': model tree_fc gives no sample lengths"):
        Trainer(MODELS / "tree_fc.yaml", ["train.order=bucket", "data.synthetic.train=4", "data.dev=null"],
                run_dir=tmp_path / "y")
