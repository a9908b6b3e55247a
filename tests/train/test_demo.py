"""The quick-start job: an MLP on a synthetic spiral learns it, deterministically, with readable logs."""
import numpy as np
import pytest

from minicavs.train.demo import spiral, train_mlp


def test_spiral_data():
    x, y = spiral(n_per_class=50, classes=3, seed=0)
    assert x.shape == (150, 2) and x.dtype == np.float32 and y.dtype == np.int32
    assert np.bincount(y).tolist() == [50, 50, 50]
    assert np.abs(x).max() < 1.5
    np.testing.assert_array_equal(x, spiral(n_per_class=50, classes=3, seed=0)[0])
    assert not np.array_equal(x, spiral(n_per_class=50, classes=3, seed=1)[0])


@pytest.mark.parametrize("optimizer", ["adam", "adagrad", "sgd"])
def test_train_mlp_learns(optimizer):
    lines = []
    r = train_mlp(steps=300, optimizer=optimizer, seed=0, log=lines.append)
    assert r["initial_loss"] > 1.0 and r["initial_accuracy"] < 0.5  # chance level for 3 classes
    assert r["loss"] < 0.3 and r["accuracy"] > 0.9
    assert r["steps"] == 300 and r["optimizer"] == optimizer
    assert len(lines) == 12 and lines[0].startswith("step     0  loss ")
    assert "step   300" in lines[-2] and lines[-1].startswith("done: loss")


def test_train_mlp_is_deterministic_and_quiet_without_log(capsys):
    a = train_mlp(steps=40, seed=3, log=None)
    b = train_mlp(steps=40, seed=3, log=None)
    assert capsys.readouterr().out == ""
    assert (a["loss"], a["accuracy"]) == (b["loss"], b["accuracy"])
    c = train_mlp(steps=40, seed=4, log=None)
    assert c["loss"] != a["loss"]


def test_train_mlp_prints_by_default(capsys):
    train_mlp(steps=4, log_every=2)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out[:3]] == ["0", "2", "4"] and out[3].startswith("done")


def test_zero_steps_evaluates_only():
    r = train_mlp(steps=0, log=None)
    assert r["loss"] == r["initial_loss"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown optimizer"):
        train_mlp(steps=1, optimizer="lbfgs", log=None)
    with pytest.raises(ValueError, match="steps"):
        train_mlp(steps=-1, log=None)
