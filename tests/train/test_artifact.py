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

from minicavs.train import artifact, behaviour
from minicavs.train.artifact import ArtifactError
from minicavs.train.predict import predict_lines
from minicavs.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
LINES = ["((the movie) (was great))", "(3 (2 it) (4 works))", "word", "(zzz-unknown (w1 w2))"]

# Run in a fresh interpreter whose only importable minicavs code is a copy of the package: load the artifact,
# print its rows and raw outputs and the model modules it imported (there must be none).
LOADER = """
import json, sys
import numpy as np
import minicavs
from minicavs.train.predict import predict_lines
model = minicavs.load(sys.argv[1])
lines = json.loads(sys.argv[2])
rows = predict_lines(model, lines)
probs = model.outputs([model.parse_input(line, "x") for line in lines])["probs"]
np.save("probs.npy", probs)
foreign = [m for m, mod in sys.modules.items() if m.startswith("minicavs_models") or
           "models" in str(getattr(mod, "__file__", "") or "").split("/")[:-1]]
print(json.dumps({"rows": rows, "foreign": foreign, "package": minicavs.__file__}))
"""


def tiny_trainer(tmp_path, model: str = "tree_lstm", **model_cfg) -> Trainer:
    cfg = yaml.safe_load((ROOT / "models" / f"{model}.yaml").read_text())
    cfg["model"]["name"] = str(ROOT / "models" / f"{model}.py")
    cfg["model"].update(model_cfg)
    cfg["data"]["synthetic"] = {"train": 40, "dev": 5, "test": 5, "seed": 7, "vocab": 30}
    path = tmp_path / f"{model}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Trainer(str(path), ["train.dtype=float64"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    trainer = tiny_trainer(tmp, hidden=8, embed=6)
    path = tmp / "tree.mcav"
    artifact.export(path, trainer.task, trainer.cfg)
    return trainer, path


def test_a_fresh_process_with_only_the_package_predicts_what_the_model_predicts(exported, tmp_path):
    trainer, path = exported
    alone = tmp_path / "alone"
    shutil.copytree(ROOT / "minicavs", alone / "site" / "minicavs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (alone / "cwd").mkdir()
    env = {**os.environ, "PYTHONPATH": str(alone / "site")}
    done = subprocess.run([sys.executable, "-c", LOADER, str(path), json.dumps(LINES)], cwd=alone / "cwd",
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["package"].startswith(str(alone / "site")) and got["foreign"] == []
    assert got["rows"] == predict_lines(trainer.task, LINES)
    trees = [trainer.task.parse_input(line, "x") for line in LINES]
    want = trainer.task.inference_model({"probs": trainer.task.model.outputs["probs"]}).infer(
        trainer.task.graphs_of(trees), {"words": behaviour.leaf_word_ids(trees, trainer.task.vocab, "<unk>")},
        trainer.task.params).outputs["probs"]
    probs = np.load(alone / "cwd" / "probs.npy")
    assert probs.dtype == np.float64 and probs.shape == want.shape
    assert np.max(np.abs(probs - want)) <= 1e-10 * max(1.0, np.max(np.abs(want)))


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
def test_damaged_truncated_newer_files_are_one_clear_error(exported, tmp_path, damage, match):
    _, path = exported
    bad = tmp_path / "bad.mcav"
    damage(path, bad)
    with pytest.raises(ArtifactError, match=match) as e:
        artifact.load(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_a_model_whose_kinds_come_from_python_code_is_refused(tmp_path):
    trainer = tiny_trainer(tmp_path, "tree_lstm_2type", hidden=4, embed=4)
    with pytest.raises(ArtifactError, match=r"TreeLSTM2Type\.graphs_of, which exists only as Python code"):
        artifact.export(tmp_path / "m.mcav", trainer.task, trainer.cfg)
    assert not (tmp_path / "m.mcav").exists()


def test_a_custom_kind_rule_is_refused_naming_the_structure(exported, tmp_path):
    trainer, _ = exported
    structure = trainer.task.model.structures[0]
    rule = structure.kinds
    structure.kinds = lambda batch: rule(batch)
    try:
        with pytest.raises(ArtifactError, match=r"structure 'tree': its kind rule <lambda> exists only as Python"):
            artifact.export(tmp_path / "m.mcav", trainer.task, trainer.cfg)
    finally:
        structure.kinds = rule
    assert not (tmp_path / "m.mcav").exists()
