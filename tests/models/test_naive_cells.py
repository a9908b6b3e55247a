"""``model.cell: naive`` (one product and one bias per gate, minicavs/nn/gates.py) computes the fused cell's
numbers: its parameters are the fused weights' gate blocks, so loss and gradients (float64) are equal, with
the GEMM-merging and layout passes on or off, and the planned buffers leave the parameters per parameter."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.engine import EngineOptions
from tests.models.test_models import trainer

NAIVE_MODELS = ["tree_lstm", "tree_lstm_child_sum", "var_lstm", "lattice_lstm"]
OPTIONS = [EngineOptions(merge_gemms=False), EngineOptions(), EngineOptions(plan_layout=True),
           EngineOptions(plan_layout=True, executor="reference")]


def _dense(g):
    return np.asarray(getattr(g, "to_dense", lambda: g)())


def _step(t, options):
    graphs, feeds = t.task.batch(t.task.data["train"][:6])
    return t.model.forward_backward(graphs, feeds, t.params, t.context(training=True), options=options)


@pytest.mark.parametrize("options", OPTIONS, ids=["unmerged", "merged-copied", "merged-views", "reference"])
@pytest.mark.parametrize("name", NAIVE_MODELS)
def test_naive_cell_equals_the_fused_cell(name, options, tmp_path):
    fused = trainer(name, tmp_path / "fused", "train.dtype=float64")
    naive = trainer(name, tmp_path / "naive", "train.dtype=float64", "model.cell=naive")
    ref, got = _step(fused, EngineOptions()), _step(naive, options)
    scale = max(1.0, abs(ref.loss))
    assert abs(ref.loss - got.loss) <= 1e-10 * scale
    split = {k for k in got.grads if "." in k}
    assert split, "the naive cell has per-gate parameters"
    views = {k for k in split if naive.params[k].value.base is not None}
    assert bool(views) == (options.plan_layout and options.merge_gemms)   # laid out in planned buffers or not
    for k, g in ref.grads.items():
        parts = sorted((n for n in got.grads if n.startswith(k + ".")), key=list(naive.params).index)
        have = np.concatenate([_dense(got.grads[n]) for n in parts], axis=-1) if parts else _dense(got.grads[k])
        want = _dense(g)
        assert np.max(np.abs(want - have)) <= 1e-10 * max(1.0, float(np.max(np.abs(want)))), k
