"""Row-sparse gradients: the gradient of a row lookup touches only the looked-up rows of the table.

A :class:`RowSparse` holds ``indices`` (may repeat) and the matching ``rows``; the dense value it stands for is
``zeros(shape)`` with each row added at its index. Embedding tables therefore never get a dense gradient per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RowSparse:
    indices: np.ndarray  # (n,) integer row indices into the table, possibly repeated
    rows: np.ndarray     # (n, *shape[1:]) values added at those rows
    shape: tuple         # the dense shape (table shape)

    @property
    def dtype(self):
        return self.rows.dtype

    def coalesce(self, xp=np) -> "RowSparse":
        """Sum repeated indices: unique sorted indices, one row each."""
        uniq, inv = xp.unique(self.indices, return_inverse=True)
        rows = xp.zeros((len(uniq),) + tuple(self.shape[1:]), dtype=self.rows.dtype)
        xp.add.at(rows, inv.reshape(-1), self.rows)
        return RowSparse(uniq, rows, self.shape)

    def to_dense(self, xp=np):
        out = xp.zeros(self.shape, dtype=self.rows.dtype)
        xp.add.at(out, self.indices, self.rows)
        return out

    def scale(self, s) -> "RowSparse":
        return RowSparse(self.indices, self.rows * self.rows.dtype.type(s), self.shape)


def densify(xp, x):
    return x.to_dense(xp) if isinstance(x, RowSparse) else x


def add_all(xp, xs):
    """Sum dense arrays and RowSparse values; the result stays sparse only if every operand is."""
    sparse = [x for x in xs if isinstance(x, RowSparse)]
    dense = [x for x in xs if not isinstance(x, RowSparse)]
    if not dense:
        return RowSparse(xp.concatenate([s.indices for s in sparse]),
                         xp.concatenate([s.rows for s in sparse]), sparse[0].shape)
    out = dense[0] + dense[1] if len(dense) > 1 else xp.array(dense[0], copy=True)
    for d in dense[2:]:
        out += d
    for s in sparse:
        xp.add.at(out, s.indices, s.rows)
    return out
