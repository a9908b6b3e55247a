"""minicavs prepare: checksums and formats of downloaded data sets, copied where the configs look."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from minicavs.train.cli import main
from minicavs.train.datasets import DATASETS, check, default_dir, prepare, sha256
from minicavs.core.errors import DataError

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("MINICAVS_SHARED_DATA", ROOT.parent / "shared" / "data"))  # the workspace's copies
needs_shared = pytest.mark.skipif(not (SHARED / "sst").is_dir(), reason="../shared/data is not beside the checkout")


def test_readme_lists_the_checksums_prepare_checks():
    text = (ROOT / "data" / "README.md").read_text()
    rows = re.findall(r"^\| `(\w+)/([\w.]+)` \| (\d+) \| `([0-9a-f]{64})` \|$", text, re.M)
    listed = {(d, f, int(n), h) for d, f, n, h in rows}
    known = {(d.name, f.name, f.samples, f.sha256) for d in DATASETS.values() for f in d.files}
    assert listed == known and len(rows) == 5


def test_prepared_files_are_git_ignored_the_readme_is_not():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "data/sst/train.txt", "data/ptb/ptb.test.txt",
                              "data/README.md"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert ignored == ["data/sst/train.txt", "data/ptb/ptb.test.txt"]


def test_default_folder_is_where_the_bundled_configs_look(monkeypatch):
    monkeypatch.delenv("MINICAVS_DATA", raising=False)
    assert default_dir("sst") == ROOT / "data" / "sst" and default_dir("ptb") == ROOT / "data" / "ptb"


def test_configs_look_where_prepare_puts_files():
    for config, name in (("tree_lstm_sst.yaml", "sst"), ("var_lstm_ptb.yaml", "ptb")):
        paths = re.findall(r"\$MINICAVS_DATA/(\w+)/([\w.]+\.txt)", (ROOT / "models" / config).read_text())
        assert paths and all(d == name and f in {x.name for x in DATASETS[name].files} for d, f in paths)


@needs_shared
@pytest.mark.parametrize("name", sorted(DATASETS))
def test_prepare_the_workspace_copy(tmp_path, name, capsys):
    assert main(["prepare", name, str(SHARED / name), "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{name}: prepared in {tmp_path / name}" in out and "sha256 ok" in out
    for f in DATASETS[name].files:
        assert sha256(tmp_path / name / f.name) == f.sha256
    assert sorted(p.name for p in (tmp_path / name).iterdir()) == sorted(f.name for f in DATASETS[name].files)
    assert main(["prepare", name, str(tmp_path / name), "--root", str(tmp_path)]) == 0   # in place: a no-op


@pytest.fixture
def sst_copy(tmp_path):
    if not (SHARED / "sst").is_dir():
        pytest.skip("../shared/data is not beside the checkout")
    src = tmp_path / "download"
    shutil.copytree(SHARED / "sst", src)
    for p in src.iterdir():
        p.chmod(0o644)
    return src


def test_a_modified_copy_is_refused_then_format_checked(sst_copy, tmp_path):
    dev = sst_copy / "dev.txt"
    lines = dev.read_text().splitlines()
    lines[4] = lines[4].replace("(", "(7 ", 1)
    dev.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"dev.txt: sha256 [0-9a-f]{64}, expected 0e9336"):
        prepare("sst", sst_copy, tmp_path / "root")
    with pytest.raises(DataError, match=r"dev.txt:5: .*label"):
        prepare("sst", sst_copy, tmp_path / "root", checksums=False)
    assert not (tmp_path / "root" / "sst" / "dev.txt").exists()        # nothing half-prepared
    lines[4] = lines[4].replace("(7 ", "(", 1)
    dev.write_text("\n".join(lines[:100]) + "\n")                        # a short but well-formed copy
    dest, report = prepare("sst", sst_copy, tmp_path / "root", checksums=False)
    assert "dev.txt: 100 samples, sha256 differs (not checked)" in report


@pytest.mark.parametrize("setup, match", [
    (lambda d: None, r"ptb.valid.txt: missing \(ptb needs ptb.valid.txt, ptb.test.txt\)"),
    (lambda d: d.rmdir(), r"not a directory"),
])
def test_missing_files_name_what_is_needed(tmp_path, setup, match, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    setup(folder)
    with pytest.raises(DataError, match=match):
        check(DATASETS["ptb"], folder)
    assert main(["prepare", "ptb", str(folder), "--root", str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
