"""Atomic file output for the product's commands: a reader sees the old file or the whole new one, never a
torn one, and a failure leaves no temporary file behind."""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to (by any writer: savefig, a subprocess); it replaces
    ``path`` when the block ends without an error and is removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
