"""Atomic file writes: the one way minicavs writes a run's files (checkpoints, metrics, configs, results).

A file is written whole to a temporary file beside it (``.NAME.<pid>.<random>.tmp``), flushed and fsynced,
then renamed over the target (``os.replace``, atomic on POSIX and Windows) and the directory fsynced, so
a reader sees the old file or the new one, never a torn one. A temporary file left by a killed process is
removed by :func:`remove_temporaries` (``--resume`` and new runs do it).
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

TMP_SUFFIX = ".tmp"


def write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Replace ``path`` by ``data`` atomically; on any error the old file (or no file) stays."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    # os.open with mode 0o666 rather than mkstemp (0o600): the file gets the usual umask permissions
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (not possible on every OS)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def is_temporary(name: str, of: tuple = ()) -> bool:
    """Is ``name`` a temporary file of :func:`write_bytes` (of one of the files named ``of``, if given)?"""
    if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
        return False
    return not of or any(name.startswith(f".{target}.") for target in of)


def remove_temporaries(directory: str | os.PathLike, of: tuple = ()) -> list[str]:
    """Delete the temporary files an interrupted :func:`write_bytes` left in ``directory`` (only those of
    the files named ``of``, if given); their names."""
    removed = []
    for entry in sorted(Path(directory).iterdir()) if Path(directory).is_dir() else []:
        if is_temporary(entry.name, of) and entry.is_file():
            entry.unlink()
            removed.append(entry.name)
    return removed
