"""models/lstm_nmt.py: with seq2seq.py's parameters it computes seq2seq.py's loss and gradients and decodes
the same strings (the same network written as padded foreach loops and a while_loop), under every policy;
trained through the CLI it beats copying the source."""
from __future__ import annotations

import json

import numpy as np
import pytest

from minicavs.core.sparse import densify
from minicavs.runtime.scheduler import get_policy
from minicavs.train.cli import main
from minicavs.train.trainer import Trainer

from .test_models import MODELS

SMALL = ["model.hidden=8", "model.embed=4", "model.max_len=4", "data.synthetic.train=300",
         "data.synthetic.dev=10", "data.synthetic.test=10", "train.dtype=float64"]


@pytest.fixture
def pair(tmp_path):
    """seq2seq briefly trained (its decodings stop at several lengths), and lstm_nmt with its parameters."""
    ref = Trainer(MODELS / "seq2seq.yaml", SMALL + ["train.epochs=3", "train.lr=0.03", "train.batch_size=16"],
                  run_dir=tmp_path / "seq2seq")
    ref.fit(progress=False, log=lambda s: None)
    nmt = Trainer(MODELS / "lstm_nmt.yaml", SMALL, run_dir=tmp_path / "nmt")
    assert set(nmt.params) == set(ref.params)
    for k, p in ref.params.items():
        nmt.params[k].value[...] = p.value
    return ref, nmt


def test_loss_gradients_and_decoding_equal_seq2seq(pair):
    ref, nmt = pair
    samples = ref.task.data["train"][:40]
    want, got = ref.loss_and_grads(samples), nmt.loss_and_grads(samples)
    assert abs(got.loss - want.loss) <= 1e-10 * max(1.0, abs(want.loss))
    for k, g in want.grads.items():
        a, b = np.asarray(densify(np, got.grads[k])), np.asarray(densify(np, g))
        assert np.max(np.abs(a - b)) <= 1e-10 * max(1.0, float(np.max(np.abs(b)))), k
    expected = [list(d) for d in ref.task.decode(samples, batch_size=7)]
    assert len({len(d) for d in expected}) > 2, expected     # decodings of several lengths
    for policy in ("cavs", "agenda", "greedy"):
        nmt.task.model.policy = get_policy(policy)
        nmt.task._decoder = None
        assert [list(d) for d in nmt.task.decode(samples, batch_size=7)] == expected, policy


def test_cli_training_beats_the_copy_baseline(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", str(MODELS / "lstm_nmt.yaml"), "--run-dir", str(run), "--no-progress",
                 "--set", "model.hidden=32", "--set", "model.max_len=4", "--set", "train.epochs=6",
                 "--set", "data.synthetic.train=2000", "--set", "data.synthetic.dev=100",
                 "--set", "data.synthetic.test=100"])
    assert code == 0
    results = json.loads((run / "results.json").read_text())
    assert results["test_seq_acc"] >= 0.8 and results["test_copy_seq_acc"] < 0.5, results
    assert results["test_token_acc"] > results["test_copy_token_acc"] + 0.3, results
    assert "test_copy_seq_acc" in capsys.readouterr().out
    (tmp_path / "in.txt").write_text("1 2 3\n4071\n9\n")
    assert main(["predict", str(run), str(tmp_path / "in.txt")]) == 0
    assert capsys.readouterr().out.split() == ["321", "1704", "9"]
    (tmp_path / "bad.txt").write_text("12345\n")
    assert main(["predict", str(run), str(tmp_path / "bad.txt")]) == 2
    assert "bad.txt:1: 5 digits; this model reads at most 4" in capsys.readouterr().err
