"""Model artifacts: a Tree-LSTM exported, loaded in a fresh process that has only the package (no models/, no
config), predicts what the original predicts; damaged, truncated and newer files and code-only parts are
clear errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from minicavs.runtime.inputs import InputGraph
from minicavs.train import artifact, behaviour
from minicavs.train.artifact import ArtifactError
from minicavs.train.predict import predict_lines
from minicavs.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
LINES = {"tree_lstm": ["((the movie) (was great))", "(3 (2 it) (4 works))", "word", "(zzz-unknown (w1 w2))"],
         "seq2seq": ["123", "4 5 6 7", "9", "012345"],
         "var_lstm": ["the cat sat", "zzz-unknown words here <unk>", "a"]}
LINES.update(tree_gru=LINES["tree_lstm"], mv_rnn=LINES["tree_lstm"], tree_lstm_2type=LINES["tree_lstm"] + [
    "((a (b c)) ((d e) (f (g h))))"], fixed_lstm=LINES["var_lstm"], lstm_nmt=LINES["seq2seq"],
    bilstm_tagger=["w0 w1 w2", "w5", "w3 w3 w9 w1 w20 w39"])

# Run in a fresh interpreter whose only importable minicavs code is a copy of the package: load the artifact,
# print its rows and the model modules it imported (there must be none), save its raw outputs.
LOADER = """
import json, sys
import numpy as np
import minicavs
from minicavs.train.predict import predict_lines
model = minicavs.load(sys.argv[1])
lines = json.loads(sys.argv[2])
rows = predict_lines(model, lines)
np.savez("outputs.npz", **model.outputs([model.parse_input(line, "x") for line in lines]))
foreign = [m for m, mod in sys.modules.items() if m.startswith("minicavs_models") or
           "models" in str(getattr(mod, "__file__", "") or "").split("/")[:-1]]
print(json.dumps({"rows": rows, "foreign": foreign, "package": minicavs.__file__}))
"""


def tiny_trainer(tmp_path, model: str = "tree_lstm", **model_cfg) -> Trainer:
    cfg = yaml.safe_load((ROOT / "models" / f"{model}.yaml").read_text())
    cfg["model"]["name"] = str(ROOT / "models" / f"{model}.py")
    cfg["model"].update(model_cfg)
    cfg["data"]["synthetic"] = {"train": 40, "dev": 5, "test": 5, "seed": 7}
    if model not in ("seq2seq", "lstm_nmt", "bilstm_tagger"):
        cfg["data"]["synthetic"]["vocab"] = 30
    if model == "fixed_lstm":
        cfg["model"]["window"] = 8
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    trainer = Trainer(str(path), ["train.dtype=float64"])
    rng = np.random.default_rng(5)   # weights further from the initial ones, so that outputs differ per input
    for p in trainer.task.params.values():
        p.value[...] = rng.normal(0.0, 0.5, p.value.shape)
    return trainer


def original_outputs(task, lines: list) -> dict:
    """The outputs the exported model computes, from the model's own code (no artifact involved)."""
    samples = [task.parse_input(line, "x") for line in lines]
    if type(task).__name__ == "LstmNmt":   # greedy decoding: its Python loop of runs over growing graphs
        decoded = np.full((len(samples), task.max_len + 1), task.eos, np.int64)
        for row, digits in zip(decoded, task.decode(samples, len(samples))):
            row[:len(digits)] = digits
        return {"decoded": decoded}
    if hasattr(task, "decoder"):   # seq2seq: its greedy decoder (a while_loop)
        return task.decoder.infer({}, task.batch(samples)[1], task.params).outputs
    if hasattr(task, "tags"):   # the tagger: words, then reversed; per word the backward row that read it
        back = [np.arange(n - 1, -1, -1) + start for n, start in
                zip(*(lambda n: (n, np.cumsum(n) - n))(np.array([len(w) for w, _ in samples])))]
        feeds = {"words": np.concatenate([np.r_[w, w[::-1]] for w, _ in samples]), "back": np.concatenate(back)}
        return task.inference_model({"probs": task.probs}).infer(task.batch(samples)[0], feeds, task.params).outputs
    if hasattr(task, "_prediction_outputs"):   # language models: <eos> w_1..w_n predicts w_1..w_n <eos>
        eos = task.vocab.index["<eos>"]
        ids = [task.vocab.encode(s) for s in samples]
        feeds = {"inputs": np.concatenate([np.r_[eos, x] for x in ids]),
                 "targets": np.concatenate([np.r_[x, eos] for x in ids]),
                 "last": np.cumsum([len(x) + 1 for x in ids]) - 1}
        graphs = [InputGraph.chain(len(x) + 1) for x in ids]
        return task.inference_model(task._prediction_outputs()).infer(graphs, feeds, task.params).outputs
    words = behaviour.leaf_word_ids(samples, task.vocab, "<unk>")
    model = task.inference_model({"probs": task.model.outputs["probs"]})
    return model.infer(task.graphs_of(samples), {"words": words}, task.params).outputs


def _export(tmp_path_factory, model: str) -> tuple:
    tmp = tmp_path_factory.mktemp("export")
    trainer = tiny_trainer(tmp, model, hidden=8, **({} if model == "mv_rnn" else {"embed": 6}))
    path = tmp / f"{model}.mcav"
    artifact.export(path, trainer.task, trainer.cfg)
    return model, trainer, path


@pytest.fixture(scope="module", params=sorted(LINES))
def exported(request, tmp_path_factory):
    return _export(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def seq2seq_file(tmp_path_factory) -> Path:
    """A model with control-flow bodies, to damage."""
    return _export(tmp_path_factory, "seq2seq")[2]


def test_a_fresh_process_with_only_the_package_predicts_what_the_model_predicts(exported, tmp_path):
    name, trainer, path = exported
    alone = tmp_path / "alone"
    shutil.copytree(ROOT / "minicavs", alone / "site" / "minicavs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (alone / "cwd").mkdir()
    env = {**os.environ, "PYTHONPATH": str(alone / "site")}
    done = subprocess.run([sys.executable, "-c", LOADER, str(path), json.dumps(LINES[name])], cwd=alone / "cwd",
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["package"].startswith(str(alone / "site")) and got["foreign"] == []
    rows = predict_lines(trainer.task, LINES[name])
    assert got["rows"] == rows and len({r["text"] for r in rows}) > 1
    want = original_outputs(trainer.task, LINES[name])
    with np.load(alone / "cwd" / "outputs.npz") as outputs:
        assert sorted(outputs.files) == sorted(want)
        for key, value in want.items():
            value = np.asarray(value)
            assert outputs[key].dtype == value.dtype and outputs[key].shape == value.shape, key
            assert np.max(np.abs(outputs[key] - value)) <= 1e-10 * max(1.0, np.max(np.abs(value))), key


def _rewrite(src: Path, dst: Path, meta_change) -> None:
    """``src`` with its metadata changed by ``meta_change(meta)``, written to ``dst``."""
    with np.load(src, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(bytes(arrays["__meta__"]).decode())
    meta_change(meta)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(dst, "wb") as f:
        np.savez(f, **arrays)


def _flip_byte_in_member(src: Path, dst: Path) -> None:
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        info = max(z.infolist(), key=lambda i: i.compress_size)   # the largest member: a parameter
    data[info.header_offset + 30 + len(info.filename) + info.compress_size // 2] ^= 0xFF
    dst.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, match", [
    (lambda src, dst: dst.write_bytes(src.read_bytes()[:len(src.read_bytes()) // 2]), "not a readable"),
    (_flip_byte_in_member, "not a readable"),
    (lambda src, dst: _rewrite(src, dst, lambda m: m.update(version=artifact.VERSION + 1)),
     r"version 2, this minicavs .* reads versions 1\.\.1 \(written by a newer minicavs"),
    (lambda src, dst: _rewrite(src, dst, lambda m: m["nodes"][3].__setitem__(0, "no_such_op")),
     "op 'no_such_op' is not in this minicavs's registry"),
    (lambda src, dst: _rewrite(src, dst, lambda m: m["behaviour"]["reader"].update(name="xml")),
     "reader 'xml' is not one this minicavs knows"),
    (lambda src, dst: _rewrite(src, dst, lambda m: m["nodes"][-1][1].append(10 ** 6)),
     "damaged model artifact .*outside the table"),
    (lambda src, dst: _rewrite(src, dst, lambda m: m.update(format="other")), "is not a minicavs model"),
])
def test_damaged_truncated_newer_files_are_one_clear_error(seq2seq_file, tmp_path, damage, match):
    path = seq2seq_file
    bad = tmp_path / "bad.mcav"
    damage(path, bad)
    with pytest.raises(ArtifactError, match=match) as e:
        artifact.load(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_a_model_whose_kinds_come_from_python_code_is_refused(tmp_path):
    """A Tree-LSTM whose graphs_of gives kinds its export does not describe."""
    trainer = tiny_trainer(tmp_path, hidden=4, embed=4)
    trainer.task.__class__ = type("OwnKinds", (type(trainer.task),), {"graphs_of": lambda self, trees: []})
    with pytest.raises(ArtifactError, match=r"OwnKinds\.graphs_of, which exists only as Python code"):
        artifact.export(tmp_path / "m.mcav", trainer.task, trainer.cfg)
    assert not (tmp_path / "m.mcav").exists()


def test_a_custom_kind_rule_is_refused_naming_the_structure(tmp_path):
    trainer = tiny_trainer(tmp_path, hidden=4, embed=4)
    structure = trainer.task.model.structures[0]
    rule = structure.kinds
    structure.kinds = lambda batch: rule(batch)
    try:
        with pytest.raises(ArtifactError, match=r"structure 'tree': its kind rule <lambda> exists only as Python"):
            artifact.export(tmp_path / "m.mcav", trainer.task, trainer.cfg)
    finally:
        structure.kinds = rule
    assert not (tmp_path / "m.mcav").exists()


def test_export_reads_the_push_buffers_without_making_any(tmp_path):
    """Export asks ``Structure.pushes`` (read-only), never ``pushed`` (which makes a buffer for a name it is
    asked): the model keeps exactly the buffers it had, and the file names those its graphs read."""
    trainer = tiny_trainer(tmp_path, hidden=4, embed=4)
    structure = trainer.task.model.structures[0]
    before = dict(structure.pushes)
    assert before and all(structure.pushed(name) is node for name, node in before.items())
    meta = artifact.export(tmp_path / "m.mcav", trainer.task, trainer.cfg)
    assert dict(structure.pushes) == before
    assert sorted(meta["structures"][0]["pushed"]) == sorted(before)
    with pytest.raises(TypeError):
        structure.pushes["extra"] = next(iter(before.values()))


def test_a_loaded_model_holds_its_parameters_read_only(seq2seq_file):
    """A loaded model only predicts: its parameters (and the buffers they view) are read-only, which lets the C
    runner keep what it derives from them across batches (cpu/c_runner.py _KEPT); writing one is an error."""
    loaded = artifact.load(seq2seq_file, say=None)
    for p in loaded.params.values():
        a = p.value
        while isinstance(a, np.ndarray):
            assert not a.flags.writeable, p.name
            a = a.base
    with pytest.raises(ValueError, match="read-only"):
        next(iter(loaded.params.values())).value[...] = 0.0
