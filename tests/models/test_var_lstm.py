"""models/var_lstm.py with ``model.graph=foreach``: the Var-LSTM as one static graph (a foreach over padded
positions, each sentence run for its own length) equals the chain-graph model on the same sentences, loss and
every gradient (float64), runs no step on a finished sentence, and trains through the CLI."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minicavs.train.config import ConfigError
from minicavs.core.sparse import densify
from minicavs.train.trainer import Trainer

MODELS = Path(__file__).resolve().parents[2] / "models"
TINY = ["model.embed=6", "model.hidden=5", "data.synthetic.train=60", "data.synthetic.dev=20",
        "data.synthetic.test=20", "data.synthetic.vocab=30", "model.dropout=0.0", "train.dtype=float64"]


def equal(a, b):
    a, b = densify(np, a), densify(np, b)
    assert a.shape == b.shape
    assert np.max(np.abs(a - b), initial=0.0) <= 1e-10 * max(1.0, float(np.max(np.abs(b), initial=0.0)))


@pytest.mark.parametrize("batch", [slice(0, 1), slice(0, 7), slice(10, 40)])
def test_foreach_graph_equals_the_chain_graph(batch, tmp_path):
    chain = Trainer(MODELS / "var_lstm.yaml", TINY, run_dir=tmp_path / "chain")
    loop = Trainer(MODELS / "var_lstm.yaml", TINY + ["model.graph=foreach"], run_dir=tmp_path / "loop")
    for name, p in chain.params.items():
        np.testing.assert_array_equal(p.value, loop.params[name].value)   # the same initial parameters
    samples = chain.task.data["train"][batch]
    lengths = {len(x) for x, _ in samples}
    assert len(samples) == 1 or len(lengths) > 1          # sentences of different lengths: padding masked
    if len(samples) <= 7:   # the loop runs the batch's longest sentence, fewer steps than its static length
        assert max(lengths) < loop.task.length
    a, b = chain.loss_and_grads(samples), loop.loss_and_grads(samples)
    equal(np.float64(b.loss), np.float64(a.loss))
    assert set(a.grads) == set(b.grads) == set(chain.params)
    for k in a.grads:
        equal(b.grads[k], a.grads[k])


def test_foreach_graph_runs_each_sentence_for_its_own_length(tmp_path, monkeypatch):
    """Over a batch the loop's body sees each sentence once per word of it (its length in rows), in the
    forward and in the backward: no padded position is computed. (On the step runner, the path of a graph no
    program takes: a static program's loop runs the longest row's steps on every row, masked;
    tests/engine/test_static_loops.py.)"""
    from minicavs.engine import static_program
    from minicavs.ops.subgraph import Subgraph
    monkeypatch.setattr(static_program, "refusal", lambda node: "the step runner's path, for this test")
    loop = Trainer(MODELS / "var_lstm.yaml", TINY + ["model.graph=foreach"], run_dir=tmp_path / "loop")
    samples = loop.task.data["train"][10:40]
    rows = {"lstm": 0, "lstm.backward": 0}   # (the gradient loop's body: ops/loop_grad.py)
    real_run = Subgraph.run

    def counting(self, xp, values):
        if self.name in rows:
            rows[self.name] += len(values[0])
        return real_run(self, xp, values)
    monkeypatch.setattr(Subgraph, "run", counting)
    loop.loss_and_grads(samples)
    words = sum(len(x) for x, _ in samples)
    assert rows == {"lstm": words, "lstm.backward": words}
    assert loop.task.length * len(samples) > 2 * words   # (the padded positions, which would be far more)


def test_foreach_graph_trains_and_refuses_dropout(tmp_path):
    t = Trainer(MODELS / "var_lstm.yaml", TINY + ["model.graph=foreach", "train.epochs=2", "train.lr=0.01"],
                run_dir=tmp_path / "run")
    before = t.evaluate("train")["train_loss"]
    t.fit(progress=False, log=lambda s: None)
    assert t.evaluate("train")["train_loss"] < before
    with pytest.raises(ConfigError, match="model.graph=foreach: a loop body takes no dropout"):
        Trainer(MODELS / "var_lstm.yaml", TINY[:-2] + ["model.graph=foreach", "model.dropout=0.2"],
                run_dir=tmp_path / "bad")
