"""Row-sparse gradients: coalescing sums repeated rows exactly as the dense gradient does."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minicavs.core.sparse import RowSparse, add_all


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=40), st.sampled_from(["float32", "float64"]))
def test_coalesce_equals_dense(indices, dtype):
    rng = np.random.default_rng(len(indices))
    idx = np.array(indices, np.int64)
    g = RowSparse(idx, rng.standard_normal((len(idx), 3)).astype(dtype), (10, 3))
    c = g.coalesce()
    assert np.array_equal(c.indices, np.unique(idx)) and c.rows.dtype == np.dtype(dtype)
    want = np.zeros((10, 3), dtype)
    np.add.at(want, idx, g.rows)
    assert np.allclose(c.to_dense(), want, rtol=1e-6, atol=1e-6)
    assert np.allclose(g.to_dense(), want, rtol=1e-6, atol=1e-6)


def test_add_all_mixes_dense_and_sparse():
    a = RowSparse(np.array([1, 1, 0]), np.ones((3, 2)), (3, 2))
    d = np.full((3, 2), 0.5)
    assert np.array_equal(add_all(np, [a, d]), [[1.5, 1.5], [2.5, 2.5], [0.5, 0.5]])
    both = add_all(np, [a, a])
    assert isinstance(both, RowSparse) and np.array_equal(both.to_dense(), 2 * a.to_dense())
