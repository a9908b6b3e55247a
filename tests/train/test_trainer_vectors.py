"""Training with pretrained word vectors, end to end: the report line, the checkpoint's record of the
vectors, and --resume, eval and predict of a run whose vector file is gone (the rows are in the
checkpoint)."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from minicavs.train import checkpoint
from minicavs.train.cli import main
from minicavs.core.errors import DataError
from minicavs.train.trainer import Trainer
from tests.train.test_trainer import read_metrics, tiny_config, without_timing

DIM = 8   # tiny_config's model.embed


def write_glove(path, words, seed=0, gz=False) -> dict:
    rng = np.random.default_rng(seed)
    vecs = {w: np.round(rng.uniform(-1, 1, DIM), 3).astype(np.float32) for w in words}
    text = "".join(w + " " + " ".join(f"{v:.3f}" for v in vec) + "\n" for w, vec in vecs.items())
    path.write_bytes(text.encode())
    return vecs


def vocabulary(cfg) -> list:
    return Trainer(cfg).task.vocabulary


def rows_hash(vocab, vecs) -> str:
    """The sha256 a checkpoint should record, computed here from the file's vectors."""
    ids = [i for i, w in enumerate(vocab) if w in vecs]
    h = hashlib.sha256(np.array(ids, "<i8").tobytes())
    h.update(np.stack([vecs[vocab[i]] for i in ids]).astype("<f4").tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("freeze", [True, False])
def test_cli_train_then_resume_eval_and_predict_without_the_file(tmp_path, capsys, monkeypatch, freeze):
    cfg = tiny_config(tmp_path, epochs=2)
    vocab = vocabulary(cfg)
    monkeypatch.chdir(tmp_path)          # --set paths are relative to the current directory
    vecs = write_glove(tmp_path / "vectors.txt", vocab[::2] + ["notaword"])
    run = tmp_path / "run"
    sets = ["--set", "model.pretrained=vectors.txt", "--set", f"model.freeze_embeddings={str(freeze).lower()}"]
    assert main(["train", str(cfg), "--run-dir", str(run), "--no-progress", *sets]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"reading pretrained vectors from {tmp_path / 'vectors.txt'} ...\ntraining tree_lstm")
    found = len(vocab[::2])
    assert f"pretrained: {found} of {len(vocab)} words found ({100 * found / len(vocab):.1f}%) in " \
           f"{tmp_path / 'vectors.txt'} (glove, 8-d); table E {'frozen' if freeze else 'trained'}" in out
    ck = checkpoint.read(run / "last.npz")
    record = ck.extra["pretrained"]["E"]
    assert record["path"] == str(tmp_path / "vectors.txt") and record["found"] == found
    assert record["sha256"] == rows_hash(vocab, vecs)
    assert ck.extra["config"]["model"]["pretrained"] == str(tmp_path / "vectors.txt")
    E = ck.params["E"]
    if freeze:   # the trained table is still the file's where the file has the word
        for i, w in enumerate(vocab):
            if w in vecs:
                np.testing.assert_array_equal(E[i], vecs[w])
    (tmp_path / "vectors.txt").unlink()
    assert main(["eval", str(run), "--split", "dev"]) == 0
    assert "dev_loss" in capsys.readouterr().out
    (tmp_path / "trees.txt").write_text(f"(({vocab[1]} {vocab[2]}) {vocab[3]})\n")
    assert main(["predict", str(run), str(tmp_path / "trees.txt")]) == 0
    assert main(["train", str(run), "--resume", "--no-progress", "--set", "train.epochs=3"]) == 0
    resumed = checkpoint.read(run / "last.npz")
    assert resumed.extra["epoch"] == 3 and resumed.extra["pretrained"]["E"] == record
    if freeze:
        assert resumed.params["E"].tobytes() == E.tobytes()


def test_a_resumed_run_without_the_file_equals_an_uninterrupted_one(tmp_path):
    cfg = tiny_config(tmp_path)
    vocab = vocabulary(cfg)
    write_glove(tmp_path / "v.txt", vocab[1::3])
    sets = [f"model.pretrained={tmp_path / 'v.txt'}", "model.freeze_embeddings=true"]
    full = Trainer(cfg, sets, run_dir=tmp_path / "full")
    full.fit(progress=False, log=lambda s: None)
    part = Trainer(cfg, sets, run_dir=tmp_path / "part")
    part.fit(epochs=1, progress=False, log=lambda s: None)
    (tmp_path / "v.txt").unlink()
    with pytest.raises(DataError, match="model.pretrained: file not found"):
        Trainer(cfg, sets, run_dir=tmp_path / "new")       # a new run needs the file...
    resumed = Trainer.resuming(tmp_path / "part")          # ...a resumed one does not
    resumed.fit(resume=True, progress=False, log=lambda s: None)
    assert without_timing(read_metrics(tmp_path / "full")) == without_timing(read_metrics(tmp_path / "part"))
    for name, p in full.params.items():
        assert np.array_equal(p.value, resumed.params[name].value), name
    quiet = lambda s: None   # noqa: E731
    ours, theirs = resumed.final_results(quiet), full.final_results(quiet)
    assert (ours["epoch"], ours["test_loss"]) == (theirs["epoch"], theirs["test_loss"])
    assert json.loads((tmp_path / "part" / "results.json").read_text())["test_loss"] == ours["test_loss"]


def test_eval_with_a_config_and_checkpoint_needs_no_file(tmp_path):
    cfg = tiny_config(tmp_path, epochs=1)
    vocab = vocabulary(cfg)
    write_glove(tmp_path / "v.txt", vocab[:10])
    t = Trainer(cfg, [f"model.pretrained={tmp_path / 'v.txt'}", "model.embed=null"], run_dir=tmp_path / "run")
    t.fit(progress=False, log=lambda s: None)
    expected = t.evaluate("dev")["dev_loss"]
    (tmp_path / "v.txt").unlink()
    evaluated, _ = Trainer.for_target(tmp_path / "run")      # model.embed null: the dimension is the record's
    assert evaluated.params["E"].shape == (len(vocab), DIM)
    assert evaluated.evaluate("dev")["dev_loss"] == expected
    other, _ = Trainer.for_target(cfg, tmp_path / "run" / "best.npz")
    assert other.evaluate("dev")["dev_loss"] == expected


def test_a_bad_vector_file_is_refused_before_the_run_dir_is_touched(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    (tmp_path / "v.txt").write_text("the 0.1 0.2\nmovie 0.1 nan\n")
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--run-dir", str(run), "--set", f"model.pretrained={tmp_path / 'v.txt'}",
                 "--set", "model.embed=null"]) == 2
    assert f"{tmp_path / 'v.txt'}:2: value 2 is 'nan': NaN and infinite values are not allowed" \
        in capsys.readouterr().err
    assert not run.exists()
    assert main(["train", str(cfg), "--run-dir", str(run), "--set", f"model.pretrained={tmp_path / 'v.txt'}"]) == 2
    assert "model.embed = 8, but model.pretrained" in capsys.readouterr().err and not run.exists()
