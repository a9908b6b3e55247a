"""models/seq2seq.py: the while_loop's greedy decoding equals a Python loop over numpy with the same
parameters, the loss its numpy twin and its gradients finite differences (float64); trained through the CLI
it beats its stated baseline (copying the source); a batch's feeds are numpy passes over the batch."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from minicavs.train.cli import main
from minicavs.train.testing import check_model_grads
from minicavs.train.trainer import Trainer

MODELS = Path(__file__).resolve().parents[2] / "models"
SMALL = ["model.hidden=8", "model.embed=4", "model.max_len=4", "data.synthetic.train=300",
         "data.synthetic.dev=10", "data.synthetic.test=10", "train.dtype=float64"]


def sigmoid(z):
    return 0.5 * np.tanh(0.5 * z) + 0.5


def lstm(x, h, c, Wx, Wh, b):
    i, f, o, u = np.split(x @ Wx + b + h @ Wh, 4, axis=-1)
    c2 = sigmoid(f) * c + sigmoid(i) * np.tanh(u)
    return sigmoid(o) * np.tanh(c2), c2


def numpy_twin(P, src, L):
    """Per sample, with Python control flow: the encoder over its own digits, the teacher-forced loss and
    the greedy decoding (stopping at <eos> or after L + 1 steps)."""
    from models.seq2seq import EOS, GO   # noqa: F401  (the constants only)
    H = P["enc_Wh"].shape[0]
    h = c = np.zeros(H)
    for d in src:
        h, c = lstm(P["E"][d], h, c, P["enc_Wx"], P["enc_Wh"], P["enc_b"])
    target = list(src[::-1]) + [EOS]
    nll, hd, cd, prev = 0.0, h, c, GO
    for y in target:
        hd, cd = lstm(P["E"][prev], hd, cd, P["dec_Wx"], P["dec_Wh"], P["dec_b"])
        z = hd @ P["W_o"] + P["b_o"]
        nll += np.log(np.sum(np.exp(z - z.max()))) + z.max() - z[y]
        prev = y
    out, hd, cd, prev = [], h, c, GO
    for _ in range(L + 1):
        hd, cd = lstm(P["E"][prev], hd, cd, P["dec_Wx"], P["dec_Wh"], P["dec_b"])
        prev = int(np.argmax(hd @ P["W_o"] + P["b_o"]))
        if prev == EOS:
            break
        out.append(prev)
    return nll, out


def per_sample_feeds(samples, L: int) -> dict:
    """The training feeds built sample by sample (what the vectorized Reverse.batch must equal)."""
    from models.seq2seq import EOS, GO
    n = len(samples)
    src, mask = np.zeros((n, L), np.int64), np.zeros((n, L))
    dec_in, tgt, tgt_mask = np.full((n, L + 1), EOS), np.full((n, L + 1), EOS), np.zeros((n, L + 1))
    for r, s in enumerate(samples):
        src[r, :len(s)], mask[r, :len(s)] = s, 1
        dec_in[r, 0], dec_in[r, 1:len(s) + 1] = GO, s[::-1]
        tgt[r, :len(s)], tgt_mask[r, :len(s) + 1] = s[::-1], 1
    return {"src": src, "src_mask": mask, "dec_in": dec_in, "tgt": tgt, "tgt_mask": tgt_mask}


def _python_calls(fn) -> Counter:
    counts: Counter = Counter()

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            counts[event] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def test_batch_feeds_equal_a_per_sample_loop_in_calls_that_do_not_grow_with_the_batch(tmp_path, monkeypatch):
    """Reverse.batch (a training step's feeds) equals the feeds built sample by sample, for batches of one
    length and of mixed lengths, in a number of Python calls that does not grow with the batch (the per-sample
    loops cost ~1 us a sample in each of five feeds: ~7% of a 64-sequence training step)."""
    monkeypatch.syspath_prepend(str(MODELS.parent))
    t = Trainer(MODELS / "seq2seq.yaml", SMALL, run_dir=tmp_path)
    task, data = t.task, t.task.data["train"]
    for samples in (data[:1], data[:50], [s for s in data if len(s) == 2][:9]):
        _, feeds = task.batch(samples)
        for name, want in per_sample_feeds(samples, task.max_len).items():
            assert feeds[name].dtype == (np.int64 if want.dtype.kind == "i" else task.dtype), name
            np.testing.assert_array_equal(feeds[name], want, err_msg=name)
    assert _python_calls(lambda: task.batch(data[:10])) == _python_calls(lambda: task.batch(data[:200]))


@pytest.fixture
def small(tmp_path, monkeypatch):
    """A briefly trained small model (float64): its decodings stop at several lengths."""
    monkeypatch.syspath_prepend(str(MODELS.parent))
    t = Trainer(MODELS / "seq2seq.yaml", SMALL + ["train.epochs=3", "train.lr=0.03", "train.batch_size=16"],
                run_dir=tmp_path / "run")
    t.fit(progress=False, log=lambda s: None)
    return t


def test_loss_and_greedy_decoding_equal_a_python_loop(small):
    task = small.task
    samples = task.data["train"]
    P = {k: p.value for k, p in small.params.items()}
    want = [numpy_twin(P, s, task.max_len) for s in samples]
    _, feeds = task.batch(samples)
    nll = float(task.model.infer({}, feeds, small.params).outputs["nll"])
    assert abs(nll - sum(w[0] for w in want)) <= 1e-10 * max(1.0, abs(nll))
    got = task.decode(samples, batch_size=7)
    assert [list(g) for g in got] == [w[1] for w in want]
    lengths = [len(w[1]) for w in want]   # the loop ran to several lengths
    assert len(set(lengths)) > 2, lengths


def test_gradients_match_finite_differences(small):
    graphs, feeds = small.task.batch(small.task.data["train"][:6])
    params = {k: p.value for k, p in small.params.items()}
    report = check_model_grads(small.task.model, graphs, feeds, params, directions=2)
    assert set(report) == set(params)


def test_cli_training_beats_the_copy_baseline(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", str(MODELS / "seq2seq.yaml"), "--run-dir", str(run), "--no-progress",
                 "--set", "model.hidden=32", "--set", "model.max_len=4", "--set", "train.epochs=8",
                 "--set", "data.synthetic.train=2000", "--set", "data.synthetic.dev=100",
                 "--set", "data.synthetic.test=100"])
    assert code == 0
    results = json.loads((run / "results.json").read_text())
    seq, copy = results["test_seq_acc"], results["test_copy_seq_acc"]
    assert seq >= 0.9 and copy < 0.5, (seq, copy)
    assert "test_copy_seq_acc" in capsys.readouterr().out
    (tmp_path / "in.txt").write_text("1 2 3\n4071\n9\n")
    assert main(["predict", str(run), str(tmp_path / "in.txt")]) == 0
    assert capsys.readouterr().out.split() == ["321", "1704", "9"]
    (tmp_path / "bad.txt").write_text("12a\n")
    assert main(["predict", str(run), str(tmp_path / "bad.txt")]) != 0
    assert "bad.txt:1: expected digits, got '12a'" in capsys.readouterr().err


def _close(a, b):
    from minicavs.engine.backend import to_host
    from minicavs.core.sparse import densify
    a, b = np.asarray(to_host(densify(np, a)) if not isinstance(a, np.ndarray) else a), np.asarray(b)
    assert a.shape == b.shape
    assert np.max(np.abs(a - b), initial=0.0) <= 1e-10 * max(1.0, float(np.max(np.abs(b), initial=0.0)))


@pytest.mark.parametrize("model,extra", [("seq2seq", []), ("var_lstm", ["model.graph=foreach"])])
def test_training_steps_on_the_device_standin_equal_the_cpu(cuda_standin, model, extra, tmp_path):
    """``train.device=cuda`` on the emulated device (arrays that refuse implicit crossings): three Adam steps
    of the models written with foreach equal the CPU's, and evaluation (the seq2seq's while_loop decoding
    included) gives the CPU's metrics."""
    from minicavs.engine.backend import to_host
    tiny = SMALL if model == "seq2seq" else [
        "model.embed=6", "model.hidden=5", "data.synthetic.train=30", "data.synthetic.dev=10",
        "data.synthetic.test=10", "data.synthetic.vocab=30", "model.dropout=0.0", "train.dtype=float64"]
    a = Trainer(MODELS / f"{model}.yaml", tiny + extra, run_dir=tmp_path / "cpu")
    b = Trainer(MODELS / f"{model}.yaml", tiny + extra + ["train.device=cuda"], run_dir=tmp_path / "dev")
    data = a.task.data["train"]
    for samples in (data[0:5], data[5:9], data[0:5]):
        for t in (a, b):
            res = t.loss_and_grads(samples)
            t.optimizer.step(res.grads, loss=res.loss)
    for name in a.params:
        _close(to_host(b.params[name].value), a.params[name].value)
    want, got = a.evaluate("dev"), b.evaluate("dev")
    for k in want:
        if k != "timing":
            assert abs(got[k] - want[k]) <= 1e-9 * max(1.0, abs(want[k])), k
