"""Pretrained word vectors (GloVe, word2vec, fastText text files) read into a model's embedding table.

A model with an embedding table takes three keys (:data:`KEYS`): ``model.pretrained`` (a file),
``model.pretrained_format`` and ``model.freeze_embeddings``. Its ``build`` makes the table with
:func:`embedding_table`, which reads the file, fills the rows of the words it holds and leaves the others at
the model's initializer.

Formats (``model.pretrained_format``):

- ``glove``: one line per word, ``WORD V1 ... VD``, values separated by single spaces, no header;
- ``word2vec-text`` and ``fasttext-vec``: the same lines after a header line ``COUNT DIM`` (word2vec's
  ``-binary 0`` output, fastText's ``.vec``); the file must hold COUNT vectors of DIM values;
- ``auto`` (the default): a header when the first line is two integers or the name ends in ``.vec``
  (``.vec.gz``), else GloVe.

Files are UTF-8, gzip-compressed when the name ends in ``.gz``. A trailing space on a line (word2vec writes
one) is allowed, blank lines are skipped, and a line with more fields than the dimension takes the leading
ones as the word (GloVe's 840B file has words such as ``. . .``).

The file is streamed line by line and only the vocabulary's rows are kept, so memory is V x D numbers
however large the file (a 5 GB GloVe file for a 20k-word model: 24 MB of float32). Every line is checked:
its number of values, and that they are written with number characters only (so ``nan``, ``inf`` and
words are refused wherever they are); the vocabulary's lines are converted and must be finite in the
table's dtype. A bad line is a :class:`~minicavs.core.errors.DataError` naming ``FILE:LINE``. A word seen again
keeps its first line's vector; the later lines are counted (``duplicates``).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from ..core.errors import DataError
from ..core.onetime import one_time

if TYPE_CHECKING:   # (only for the hints: minicavs.train.config reads FORMATS without importing the engine)
    from ..nn import Parameter, ParameterSet

FORMATS = ("auto", "glove", "word2vec-text", "fasttext-vec")
HEADER_FORMATS = ("word2vec-text", "fasttext-vec")
# the model keys of a model with an embedding table (merged into its DEFAULTS; rules in minicavs.train.config)
KEYS = {"pretrained": None, "pretrained_format": "auto", "freeze_embeddings": False}
_NUMBER_CHARS = b"0123456789.-+eE "   # what a line's values may be written with (then converted to check)


@dataclass
class Vectors:
    """The vectors of a file for the words of a vocabulary (ids as the vocabulary's order)."""

    path: str
    format: str           # the format read: glove, word2vec-text or fasttext-vec
    dim: int
    rows: np.ndarray      # (V, dim): the file's vector of each found word; zeros elsewhere
    found: np.ndarray     # (V,) bool: the words the file holds
    lines: int            # vector lines read
    duplicates: int       # lines of a vocabulary word already found (the first line's vector is kept)

    def record(self) -> dict:
        """What a checkpoint keeps about the vectors: where they came from, the counts, and a sha256 of
        the rows used (the found ids as little-endian int64, then their rows in the table's dtype)."""
        ids = np.flatnonzero(self.found)
        h = hashlib.sha256(ids.astype("<i8").tobytes())
        h.update(np.ascontiguousarray(self.rows[ids], self.rows.dtype.newbyteorder("<")).tobytes())
        return {"path": self.path, "format": self.format, "dim": self.dim, "found": int(ids.size),
                "words": int(self.found.size), "duplicates": self.duplicates, "lines": self.lines,
                "sha256": h.hexdigest()}


def describe(name: str, record: dict, frozen: bool) -> str:
    """The report line of a table filled from vectors: ``pretrained: N of M words found (P%)`` and details."""
    found, words = record["found"], record["words"]
    dup = record.get("duplicates", 0)
    return (f"pretrained: {found:,} of {words:,} words found ({100 * found / max(words, 1):.1f}%) in "
            f"{record['path']} ({record['format']}, {record['dim']}-d"
            + (f", {dup:,} duplicate {'line' if dup == 1 else 'lines'} ignored" if dup else "")
            + f"); table {name} {'frozen' if frozen else 'trained'}")


def read_vectors(path: str | os.PathLike, vocabulary: Sequence[str], fmt: str = "auto", dtype="float32",
                 on_dim: Callable[[int, str], None] | None = None) -> Vectors:
    """The vectors of ``path`` for the words of ``vocabulary`` (see the module's docstring). ``on_dim(dim,
    where)`` is called as soon as the dimension is known (before the rest of the file is read), so a
    caller can refuse a file of the wrong dimension at once."""
    path = os.fspath(path)
    if fmt not in FORMATS:
        raise ValueError(f"model.pretrained_format = {fmt!r}: must be one of {', '.join(FORMATS)}")
    if path.endswith((".bin", ".bin.gz")):
        raise DataError(f"model.pretrained: {path} looks like a binary word2vec/fastText file; only the text "
                        "formats are read (word2vec -binary 0, fastText .vec, GloVe .txt)")
    index = {w: i for i, w in reversed(list(enumerate(vocabulary)))}   # a word twice: its first id
    with closing(_lines(path)) as lines:
        return _read(path, lines, index, fmt, np.dtype(dtype), on_dim)


def _read(path: str, lines: Iterator[tuple[int, bytes]], index: dict, fmt: str, dtype: np.dtype,
          on_dim: Callable[[int, str], None] | None) -> Vectors:
    first = next(lines, None)
    while first is not None and not first[1].strip():
        first = next(lines, None)
    if first is None:
        raise DataError(f"model.pretrained: {path} holds no vectors (an empty file)")
    lineno, raw = first
    if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):   # a UTF-8 byte order mark
        raw = raw[3:]
    header = _header(raw)
    if fmt == "auto":
        named_vec = path.endswith((".vec", ".vec.gz"))
        fmt = ("fasttext-vec" if named_vec else "word2vec-text") if header or named_vec else "glove"
    where = f"{path}:{lineno}"
    if fmt in HEADER_FORMATS:
        if header is None:
            raise DataError(f"{where}: expected the header line 'COUNT DIM' of a {fmt} file, got "
                            f"{_show(raw)}; a GloVe file has none (model.pretrained_format: glove)")
        count, dim = header
        pending: list = []
    else:
        count, dim = None, len(raw.rstrip().split(b" ")) - 1
        if dim < 1:
            raise DataError(f"{where}: a word without values ({_show(raw)})")
        pending = [(lineno, raw)]
    if on_dim is not None:
        on_dim(dim, where)
    hint = (f" (line {lineno} looks like a word2vec/fastText header: model.pretrained_format: word2vec-text "
            "reads it)") if header is not None and fmt == "glove" else ""
    reader = _Reader(path, index, dim, dtype, f"the header, line {lineno}" if count is not None else
                     f"line {lineno}" + hint)
    read = reader.read
    for item in pending:
        read(*item)
    for item in lines:
        read(*item)
    if count is not None and reader.lines != count:
        raise DataError(f"{path}: the header (line {lineno}) announces {count:,} vectors, the file holds "
                        f"{reader.lines:,}" + ("; is it truncated?" if reader.lines < count else ""))
    return Vectors(path, fmt, dim, reader.rows, reader.found, reader.lines, reader.duplicates)


class _Reader:
    """The per-line work of :func:`read_vectors`: check a line, keep it if its word is in the vocabulary."""

    def __init__(self, path: str, index: dict, dim: int, dtype: np.dtype, dim_from: str):
        self.path, self.index, self.dim, self.dtype, self.dim_from = path, index, dim, dtype, dim_from
        self.rows = np.zeros((len(index), dim), dtype)
        self.found = np.zeros(len(index), bool)
        self.lines = self.duplicates = 0

    def read(self, lineno: int, raw: bytes) -> None:
        body = raw.rstrip()
        if not body:
            return   # a blank line carries no vector
        self.lines += 1
        word, _, values = body.partition(b" ")
        if values.count(b" ") != self.dim - 1 or not values:
            word, values = self._spaced_word(body, lineno)
        if values.translate(None, _NUMBER_CHARS) or b"  " in values:
            raise self._bad_value(values, lineno)
        try:
            i = self.index.get(word.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{self.path}:{lineno}: the word is not UTF-8 ({e.reason} at byte {e.start}: "
                            f"{_show(word)})") from None
        if i is None:
            return
        if self.found[i]:
            self.duplicates += 1
            return
        try:
            row = np.array(values.split(b" "), np.float64)
        except ValueError:
            raise self._bad_value(values, lineno) from None
        with np.errstate(over="ignore"):
            cast = row.astype(self.dtype)
        if not np.isfinite(cast).all():
            raise self._bad_value(values, lineno)
        self.rows[i] = cast
        self.found[i] = True

    def _spaced_word(self, body: bytes, lineno: int) -> tuple[bytes, bytes]:
        """(word, values) of a line whose field count is not the dimension + 1: a word with spaces in it
        (its last part not a number), else an error naming the counts."""
        fields = body.split(b" ")
        n = len(fields) - 1
        if n > self.dim and not _numeric(fields[-self.dim - 1]) and all(fields[-self.dim:]):
            return b" ".join(fields[:-self.dim]), b" ".join(fields[-self.dim:])
        empty = " (values are separated by single spaces)" if not all(fields) else ""
        raise DataError(f"{self.path}:{lineno}: {n} values, expected {self.dim} (the dimension of "
                        f"{self.dim_from}){empty}")

    def _bad_value(self, values: bytes, lineno: int) -> DataError:
        """The error naming a line's first value that is not a finite number of the table's dtype."""
        for k, text in enumerate(values.split(b" "), 1):
            if not text:
                return DataError(f"{self.path}:{lineno}: value {k} is empty (values are separated by single spaces)")
            try:
                v = float(text)
            except ValueError:
                return DataError(f"{self.path}:{lineno}: value {k} is {_show(text)}, not a number")
            if not np.isfinite(v):
                return DataError(f"{self.path}:{lineno}: value {k} is {_show(text)}: NaN and infinite values "
                                 "are not allowed")
            with np.errstate(over="ignore"):
                if not np.isfinite(self.dtype.type(v)):
                    return DataError(f"{self.path}:{lineno}: value {k} is {_show(text)}, out of {self.dtype.name}"
                                     "'s range")
        return DataError(f"{self.path}:{lineno}: the values are not numbers")   # (not reached: one is bad)


def _numeric(field: bytes) -> bool:
    """Whether a field reads as a number (number characters, a digit among them: '...' is a word)."""
    return not field.translate(None, _NUMBER_CHARS) and any(c in b"0123456789" for c in field)


def _header(raw: bytes) -> tuple[int, int] | None:
    """(count, dim) when the line is a word2vec/fastText header: two positive integers."""
    parts = raw.split()
    if len(parts) == 2 and all(p.isdigit() for p in parts) and all(int(p) > 0 for p in parts):
        return int(parts[0]), int(parts[1])
    return None


def _show(text: bytes, limit: int = 40) -> str:
    s = text.decode("utf-8", "backslashreplace")
    return repr(s if len(s) <= limit else s[:limit] + "...")


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of a file, gunzipped when the name ends in .gz; errors as DataError."""
    if os.path.isdir(path):
        raise DataError(f"model.pretrained: {path} is a directory, not a file of vectors")
    if not os.path.isfile(path):
        raise DataError(f"model.pretrained: file not found: {path}")
    lineno = 0
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            for lineno, raw in enumerate(f, 1):
                yield lineno, raw
    except (OSError, EOFError, zlib.error) as e:   # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}:{lineno + 1}: cannot be read: {e}") from None


# --- the embedding table of a model ---------------------------------------------------------------------

def embedding_table(params: ParameterSet, name: str, vocabulary: Sequence[str], cfg: dict, *, init: str,
                    dim: int | None, dim_key: str = "model.embed", extra_columns: int = 0) -> Parameter:
    """Add the embedding table ``name`` to ``params`` (one row per word of ``vocabulary``) and return it:
    ``dim`` columns for the word vectors (None: the dimension of ``model.pretrained``'s file; ``dim_key``
    is the config key it comes from) and ``extra_columns`` after them that vectors do not fill (MV-RNN's
    word matrices). Every row starts at the initializer ``init`` (seeded by ``train.seed`` and the name, as
    without vectors); with ``model.pretrained`` the rows of the words the file holds take its vectors, and
    the parameter's ``source`` records the file (:meth:`Vectors.record`). ``model.freeze_embeddings`` makes
    the table a frozen parameter (no gradient, no optimizer slot).

    ``cfg["restoring"]`` (the trainer sets it to a checkpoint's ``extra`` when every parameter is about to be
    loaded from that checkpoint: eval, predict, ``--resume``) skips the file: the rows are the checkpoint's,
    and the file need not exist any more."""
    m, tc = cfg["model"], cfg["train"]
    path, fmt, freeze = m.get("pretrained"), m.get("pretrained_format", "auto"), bool(m.get("freeze_embeddings"))
    if freeze and extra_columns:
        raise ValueError(f"model.freeze_embeddings: table {name} holds more than the word vectors (its last "
                         f"{extra_columns} columns are trained with the model), so it cannot be frozen")
    if dim is None and path is None:
        raise ValueError(f"{dim_key} is null, which takes the dimension from model.pretrained's vectors, but "
                         "model.pretrained is not set: give one of them")

    def table(width: int) -> Parameter:
        return params.new(name, (len(vocabulary), width + extra_columns), init=init, dtype=tc["dtype"],
                          rng=tc["seed"], trainable=not freeze)

    if path is None:
        return table(dim)
    restoring = cfg.get("restoring")
    if restoring is not None:   # the rows come from a checkpoint: the file is not read
        record = (restoring.get("pretrained") or {}).get(name)
        if dim is None:
            if record is None:
                raise ValueError(f"{dim_key} is null and the checkpoint does not record the dimension of "
                                 f"{name}'s vectors")
            dim = int(record["dim"])
        p = table(dim)
        p.source = record
        return p

    def check_dim(found: int, where: str) -> None:
        if dim is not None and found != dim:
            fix = f"set {dim_key}: {found}" + (", or null to take the file's" if dim_key == "model.embed" else "")
            raise ValueError(f"{dim_key} = {dim}, but model.pretrained {path} holds {found}-dimensional vectors "
                             f"({where}); {fix}")

    with one_time(f"reading pretrained vectors from {path}"):   # (announced: a large file takes a while)
        vectors = read_vectors(path, vocabulary, fmt, tc["dtype"], check_dim)
    p = table(vectors.dim)
    p.value[vectors.found, :vectors.dim] = vectors.rows[vectors.found]
    p.source = vectors.record()
    return p


__all__ = ["FORMATS", "KEYS", "Vectors", "read_vectors", "embedding_table", "describe"]
