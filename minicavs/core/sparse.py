"""Row-sparse gradients: the gradient of a row lookup touches only the looked-up rows of the table.

A :class:`RowSparse` holds ``indices`` (may repeat) and the matching ``rows``; the dense value it stands for is
``zeros(shape)`` with each row added at its index. Embedding tables therefore never get a dense gradient per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import array_module, as_module
from .errors import FeedError
from .validate import indices as _indices


@dataclass
class RowSparse:
    indices: np.ndarray  # (n,) integer row indices into the table, possibly repeated
    rows: np.ndarray     # (n, *shape[1:]) values added at those rows
    shape: tuple         # the dense shape (table shape)

    @property
    def dtype(self):
        return self.rows.dtype

    def checked(self, what: str = "row-sparse value") -> "RowSparse":
        """This value with int64 indices, after checking they are integers in [0, shape[0]), one per row of
        ``rows``, and that the rows fit the dense shape; a FeedError naming ``what`` otherwise. Everything
        that indexes with a RowSparse (numpy and CuPy wrap negative indices; the optimizers' C kernels
        trust theirs) checks it first."""
        shape = tuple(self.shape)
        rows_shape = tuple(getattr(self.rows, "shape", ()))
        if not shape or not rows_shape or rows_shape[1:] != shape[1:]:
            raise FeedError(f"{what}: rows of shape {rows_shape} do not fit the dense shape {shape}")
        idx = _indices(self.indices, f"{what}: index", size=shape[0], shape=(rows_shape[0],),
                       of=f" for a dense shape {shape}")
        return self if idx is self.indices else RowSparse(idx, self.rows, shape)

    def coalesce(self, xp=np) -> "RowSparse":
        """Sum repeated indices: unique sorted indices, one row each. A stable sort and one segmented sum
        (``add.reduceat``), so repeated rows add in their original order (deterministic) and fast."""
        idx = self.indices.reshape(-1)
        if len(idx) == 0:
            return RowSparse(idx, self.rows.reshape((0,) + tuple(self.shape[1:])), self.shape)
        ixp = array_module(idx)   # indices made on the host are sorted there; rows stay where they live
        order = ixp.argsort(idx, kind="stable")
        sidx = idx[order]
        starts = ixp.flatnonzero(ixp.concatenate((ixp.ones(1, bool), sidx[1:] != sidx[:-1])))
        rows = xp.add.reduceat(self.rows[as_module(xp, order)], as_module(xp, starts), axis=0)
        return RowSparse(sidx[starts], rows, self.shape)   # (host positions for device rows: copied over)

    def to_dense(self, xp=None):
        """The dense array, on the device its rows live on (or ``xp``'s)."""
        xp = array_module(self.rows) if xp is None else xp
        out = xp.zeros(self.shape, dtype=self.rows.dtype)
        c = self.checked().coalesce(xp)
        out[c.indices] = c.rows   # unique indices: a plain assignment, no add.at
        return out

    def copy(self) -> "RowSparse":
        return RowSparse(self.indices.copy(), self.rows.copy(), self.shape)

    def scale(self, s) -> "RowSparse":
        return RowSparse(self.indices, self.rows * self.rows.dtype.type(s), self.shape)


def densify(xp, x):
    return x.to_dense(xp) if isinstance(x, RowSparse) else x


def add_all(xp, xs):
    """Sum dense arrays and RowSparse values; the result stays sparse only if every operand is."""
    sparse = [x for x in xs if isinstance(x, RowSparse)]
    dense = [x for x in xs if not isinstance(x, RowSparse)]
    if not dense:   # indices stay where they live (a feed's on the host), unless they live in both places
        idx = [s.indices for s in sparse]
        ixp = array_module(idx[0]) if len({array_module(i) for i in idx}) == 1 else xp
        return RowSparse(ixp.concatenate([as_module(ixp, i) for i in idx]),
                         xp.concatenate([s.rows for s in sparse]), sparse[0].shape)
    out = dense[0] + dense[1] if len(dense) > 1 else xp.array(dense[0], copy=True)
    for d in dense[2:]:
        out += d
    for s in sparse:
        if tuple(s.shape) != out.shape:
            raise FeedError(f"add_all: a row-sparse value of shape {tuple(s.shape)} added to one of {out.shape}")
        c = s.checked().coalesce(xp)
        out[c.indices] += c.rows
    return out
