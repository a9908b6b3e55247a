"""Checks of integer indices and keys before they reach a kernel (C, CUDA or numpy fancy indexing).

A C or CUDA kernel trusts every index it is given: one out of range reads or writes outside its buffer, a
float or bool silently truncates, numpy wraps a negative index to the end. Everything that hands indices to
a kernel calls :func:`indices` first: a few vectorised passes (dtype, shape, min and max), and only on
failure a search for the first bad position, so the message can name it. The checks work on numpy and
CuPy arrays alike (``xp`` is taken from the array).
"""
from __future__ import annotations

import math

import numpy as np

from .arrays import array_module as _module
from .errors import FeedError

_INT64_MAX = np.iinfo(np.int64).max
_INT64, _UINT64 = np.dtype(np.int64), np.dtype(np.uint64)
_MAX = np.maximum.reduce   # (the ufunc's own method: ndarray.max adds a Python frame)


def _where(pos: int, shape: tuple, at: str) -> str:
    return f"{at} {pos}" if len(shape) <= 1 else f"{at} {tuple(int(i) for i in np.unravel_index(pos, shape))}"


def _failure(error: type, message: str, pos: int, shape: tuple) -> Exception:
    """``error(message)`` carrying ``row``: the bad entry's index along the first axis, so a caller that
    knows what the rows are (a pull buffer's vertices: Model.run) can name the sample and vertex."""
    e = error(message)
    e.row = int(np.unravel_index(pos, shape)[0]) if len(shape) else None
    return e


def is_integer(x) -> bool:
    """A Python or numpy integer, not a bool (True is an int to Python, never an id here)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def show(x) -> str:
    """``repr`` of a value as the user wrote it: 1.0, not np.float64(1.0)."""
    return repr(x.item() if isinstance(x, np.generic) else x)


def _first_bad_object(flat, lo: int, hi: int) -> tuple[int, object] | None:
    for i, x in enumerate(flat):
        if not is_integer(x) or not lo <= x <= hi:
            return i, x
    return None


def indices(values, what: str, *, size: int | None = None, shape: tuple | None = None,
            dtype=np.int64, at: str = "position", of: str = "", error: type = FeedError):
    """``values`` as a C-contiguous array of ``dtype`` (int64 or uint64; None: the integer dtype it has,
    with no range check beyond ``size``) after checking that it holds
    integers (not floats, bools or objects), has ``shape`` (None entries match anything) and, with
    ``size``, lies in ``[0, size)`` (uint64 keys: in ``[0, 2**64)``, so only negative values fail).
    Raises ``error`` (a FeedError by default) naming ``what`` (singular: 'lookup: index'), the sizes and
    the first bad position (``at``: 'position', 'row', 'vertex'); ``of`` ends the message (' for ...')."""
    if dtype is np.int64 and shape is None and _int64_below(values, size):
        return values   # (the usual case, a plan's or a feed's int64 rows: one reduction and no lookups)
    xp = _module(values)
    # Not an array (a list): look at each object, since numpy would make [1, True] ints and [2**63, 1] floats.
    a = values if hasattr(values, "dtype") and hasattr(values, "shape") else np.asarray(values, dtype=object)
    if a.dtype.kind == "O":
        flat = a.reshape(-1).tolist()
        unsigned = dtype is not None and np.dtype(dtype).kind == "u"
        bad = _first_bad_object(flat, *((0, 2 ** 64 - 1) if unsigned else (-_INT64_MAX - 1, _INT64_MAX)))
        if bad is not None:
            raise _failure(error, f"{what} {show(bad[1])} at {_where(bad[0], a.shape, at)} is not "
                                  f"{'a uint64' if unsigned else 'an int64'} integer", bad[0], a.shape)
        to = np.uint64 if unsigned else np.int64
        a = np.array(flat, to).reshape(a.shape) if flat else np.zeros(a.shape, to)
    elif a.dtype.kind not in "iu" and a.size:   # an empty list is float64 to numpy: no value is wrong
        flat = a.reshape(-1)
        nonint = xp.flatnonzero(flat != xp.floor(flat)) if a.dtype.kind == "f" else ()
        if len(nonint):
            pos = int(nonint[0])
            raise _failure(error, f"{what} dtype {a.dtype} is not an integer type (first non-integer "
                                  f"{float(flat[pos])!r} at {_where(pos, a.shape, at)})", pos, a.shape)
        raise error(f"{what} dtype {a.dtype} is not an integer type")
    if shape is not None and (a.ndim != len(shape) or any(w is not None and w != s for w, s in zip(shape, a.shape))):
        want = "(" + ", ".join("any" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
        raise error(f"{what} array of shape {tuple(a.shape)}, need {want}{of}")
    ranged = dtype is not None or size is not None
    dtype = a.dtype if dtype is None else np.dtype(dtype)
    unsigned = dtype.kind == "u"
    limit = size if size is not None else (None if unsigned else _INT64_MAX + 1)
    signed = a.dtype.kind == "i"    # unsigned values are never negative: only an upper limit can fail
    if ranged and a.size and (limit is not None or signed) and _out_of_range(a, signed, limit):
        flat = a.reshape(-1)
        bad = flat < 0
        if limit is not None and limit <= np.iinfo(a.dtype).max:
            bad = bad | (flat >= limit)
        pos = int(xp.flatnonzero(bad)[0])
        rng = f"[0, {size})" if size is not None else ("[0, 2**64)" if unsigned else "[0, 2**63)")
        raise _failure(error, f"{what} {int(flat[pos])} out of range {rng} at {_where(pos, a.shape, at)}{of}",
                       pos, a.shape)
    if a.dtype == dtype and a.flags.c_contiguous:
        return a
    return xp.ascontiguousarray(a, dtype=dtype).reshape(a.shape)   # (ascontiguousarray makes 0-d 1-d)


def _int64_below(values, size: int | None) -> bool:
    """Is ``values`` a non-empty C-contiguous int64 numpy array with every value in [0, ``size``)? One
    reduction: read as uint64, a negative value is 2**63 or more. False means "look closer", not "bad"."""
    return (type(values) is np.ndarray and values.dtype is _INT64 and size is not None and 0 < size <= _INT64_MAX
            and values.size > 0 and values.flags.c_contiguous and int(_MAX(values.view(_UINT64), axis=None)) < size)


def _out_of_range(a, signed: bool, limit: int | None) -> bool:
    """Whether some value of the integer array ``a`` is negative or at least ``limit``: one reduction where a
    signed array's values read as unsigned put every negative one at or above 2**(bits - 1), so above any
    limit up to that (a batch-1 step checks a few small index arrays, where each reduction costs
    microseconds)."""
    if signed and limit is not None and limit <= 1 << (8 * a.dtype.itemsize - 1):
        return int(a.view(a.dtype.str.replace("i", "u")).max()) >= limit
    return (signed and int(a.min()) < 0) or (limit is not None and int(a.max()) >= limit)


def rows(n: int, want: int, what: str, of: str, error: type = FeedError) -> None:
    """``n`` rows where ``want`` are needed: raise ``error`` naming both counts."""
    if n != want:
        raise error(f"{what}: {n} rows, but {of} has {want}")


def check_labels(logits, labels, op: str = "softmax_cross_entropy"):
    """One integer label in [0, classes) per row of ``logits``: the labels as int64, or a FeedError naming
    the sizes and the first bad row (the cross-entropy kernels index each row with its label)."""
    if logits.ndim >= 1 and getattr(labels, "shape", None) == logits.shape[:-1] and _int64_below(labels,
                                                                                                  logits.shape[-1]):
        return labels   # (the usual case, checked in one reduction)
    if not hasattr(labels, "shape"):
        labels = indices(labels, f"{op}: label", dtype=None, at="row")
    if logits.ndim < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise FeedError(f"{op}: labels of shape {tuple(labels.shape)} for logits of shape {tuple(logits.shape)}: "
                        f"need one label per row, shape {tuple(logits.shape[:-1])}")
    return indices(labels, f"{op}: label", size=logits.shape[-1], at="row", of=f" ({logits.shape[-1]} classes)")


def check_rows(kernel: str, idx, n: int | None, size: int, src_shape=None, dst_shape=None):
    """The row indices of a row kernel (C or CUDA), checked: a 1-D integer array of ``n`` entries (any
    length when None) in [0, ``size``), and rows of the same shape on both sides; returned as int64."""
    if src_shape is not None and tuple(src_shape) != tuple(dst_shape):
        raise FeedError(f"{kernel}: source rows of shape {tuple(src_shape)}, destination rows {tuple(dst_shape)}")
    shape = tuple(getattr(idx, "shape", ()))
    if n is not None and len(shape) == 1 and shape[0] != n:
        raise FeedError(f"{kernel}: {shape[0]} row indices and {n} source rows do not match")
    return indices(idx, f"{kernel}: row index", size=size, shape=(n,), of=f" (the indexed array has {size} rows)")


def check_dropout(rows: int, keys, h, p) -> tuple:
    """The dropout kernels' arguments, checked (C's and CUDA's alike): ``rows`` uint64 row keys, the hash
    word ``h`` in [0, 2**64), ``p`` in [0, 1). Returns (keys, h, threshold, scale) for the kernel."""
    keys = indices(keys, "dropout: row key", shape=(rows,), dtype=np.uint64, at="row", of=f" ({rows} rows)")
    if not is_integer(h) or not 0 <= int(h) < 1 << 64:
        raise FeedError(f"dropout: hash word {h!r} is not an integer in [0, 2**64)")
    if not (is_integer(p) or isinstance(p, (float, np.floating))) or not 0.0 <= p < 1.0:
        raise FeedError(f"dropout: p={p!r} must be a number in [0, 1)")
    return keys, int(h), math.ceil(p * (1 << 24)), 1.0 / (1.0 - p)
