"""The real data sets the bundled configs train on, and ``minicavs prepare``: check a downloaded copy (sha256 of
every file, then its format, sample by sample) and put it where the configs look (``$MINICAVS_DATA/<name>/``: the
checkout's ``data/``, or the user's data directory for an installed package; see ``config.data_root``).

Nothing here downloads: the files come from their publishers (URLs in ``data/README.md``) and are never
committed. A copy whose bytes differ from the known checksums (another release, a re-encoding) is refused
unless ``--skip-checksums`` is given; its format is checked either way.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.atomic import write_bytes
from ..core.errors import DataError
from ..data.sst import read_sst
from ..data.text import read_sentences
from .config import data_root, find_config, load_config


@dataclass(frozen=True)
class DataFile:
    name: str
    sha256: str
    samples: int          # trees or sentences (non-empty lines)


@dataclass(frozen=True)
class Dataset:
    name: str
    title: str
    files: tuple
    read: Callable        # path -> list of samples; raises DataError naming file and line

    def file(self, name: str) -> DataFile:
        return next(f for f in self.files if f.name == name)


DATASETS = {
    "sst": Dataset("sst", "Stanford Sentiment Treebank, PTB-bracketed trees, labels 0-4 on every node", (
        DataFile("train.txt", "e2f3f41b0b1e6d4dddc0effe3bfc2d27ed8928079aa9a03d652311614fc5feb7", 8544),
        DataFile("dev.txt", "0e9336aed6e4730e19f58d00a77b3f0297efdb755f7b5e598c98a05e3f97ea40", 1101),
        DataFile("test.txt", "6e54806dee95cf80cd918e7dfb3f6770f6df24bf826f289a4d1f709e1c8f6761", 2210),
    ), read_sst),
    "ptb": Dataset("ptb", "Penn Treebank language-model text (Mikolov's preprocessing), valid and test splits", (
        DataFile("ptb.valid.txt", "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2", 3370),
        DataFile("ptb.test.txt", "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0", 3761),
    ), read_sentences),
}


CONFIGS = {"sst": "tree_lstm_sst", "ptb": "var_lstm_ptb"}   # the bundled config that reads each data set


def default_dir(name: str) -> Path:
    """Where the bundled config of data set ``name`` looks for its files (its data paths resolved: the
    checkout's ``data/NAME``, or ``NAME`` in the user's data directory for an installed package)."""
    cfg = load_config(find_config(CONFIGS[name]))
    folders = {Path(cfg["data"][split]).parent for split in ("train", "dev", "test")
               if cfg["data"].get(split) not in (None, "synthetic")}
    if len(folders) != 1:
        raise DataError(f"the bundled {CONFIGS[name]} config reads {name} from {sorted(map(str, folders))}: "
                        "give --root")
    return folders.pop()


def require_file(path: str | os.PathLike, key: str) -> str:
    """``path`` if it is a file, else a DataError naming the config ``key`` (``data.train``) that says what is
    wrong: a directory given for a file, or a missing file; for a data set's file missing from where the
    bundled configs look, how to put it there (``minicavs prepare NAME FOLDER``)."""
    if os.path.isdir(path):
        raise DataError(f"{key}: {path} is a directory, not a data file")
    if not os.path.isfile(path):
        raise DataError(f"{key}: file not found: {path} ({_how_to_get(Path(path), key)})")
    return str(path)


def _how_to_get(path: Path, key: str) -> str:
    for name, dataset in DATASETS.items():
        prepared_here = path.parent.resolve() == (data_root() / name).resolve()
        if prepared_here and path.name in {f.name for f in dataset.files}:
            what = re.split(r",| [(]", dataset.title)[0]
            return (f"the {what} is not prepared: download it (data/README.md says where), then minicavs prepare "
                    f"{name} FOLDER puts it here")
    return f"paths in a config file are relative to the file, --set {key}=PATH to the current directory"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check(dataset: Dataset, source: Path, checksums: bool = True) -> list[str]:
    """Validate every file of ``dataset`` in directory ``source``; returns one line per file. Raises
    DataError naming the first file that is missing, has other bytes, or does not parse."""
    if not source.is_dir():
        raise DataError(f"{source}: not a directory (give the folder holding "
                        f"{', '.join(f.name for f in dataset.files)})")
    report = []
    for f in dataset.files:
        path = source / f.name
        if not path.is_file():
            raise DataError(f"{path}: missing ({dataset.name} needs {', '.join(x.name for x in dataset.files)})")
        digest = sha256(path)
        if checksums and digest != f.sha256:
            raise DataError(f"{path}: sha256 {digest}, expected {f.sha256} (another release or a modified "
                            "copy; --skip-checksums to use it anyway, its format is still checked)")
        samples = dataset.read(path)      # DataError with file:line for a malformed sample
        if checksums and len(samples) != f.samples:
            raise DataError(f"{path}: {len(samples)} samples, expected {f.samples}")
        report.append(f"{f.name}: {len(samples)} samples, sha256 "
                      f"{'ok' if digest == f.sha256 else 'differs (not checked)'}")
    return report


def prepare(name: str, source: str | os.PathLike, root: str | os.PathLike | None = None,
            checksums: bool = True) -> tuple[Path, list[str]]:
    """Check ``source`` then copy its files to ``root/name`` (atomically, file by file); returns the folder."""
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    dataset = DATASETS[name]
    report = check(dataset, Path(source), checksums)
    dest = Path(root) / name if root else default_dir(name)
    dest.mkdir(parents=True, exist_ok=True)
    for f in dataset.files:
        src, target = Path(source) / f.name, dest / f.name
        if target.is_file() and os.path.samefile(src, target):
            continue
        write_bytes(target, src.read_bytes())   # a few MB: whole, then renamed into place
    return dest, report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(DATASETS), help="which data set")
    p.add_argument("source", help="the folder holding the downloaded files (e.g. ../shared/data/sst)")
    p.add_argument("--root", default=None, help="prepare into ROOT/NAME (default: where the bundled config "
                   "looks, $MINICAVS_DATA/NAME: the checkout's data/, or ~/.local/share/minicavs when installed)")
    p.add_argument("--skip-checksums", action="store_true",
                   help="accept files whose sha256 differs from the known release (the format is still checked)")


def run(args: argparse.Namespace) -> int:
    dest, report = prepare(args.name, args.source, args.root, not args.skip_checksums)
    for line in report:
        print(f"  {line}")
    print(f"{args.name}: prepared in {dest}")
    return 0
