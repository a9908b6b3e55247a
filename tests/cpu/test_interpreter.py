"""The C interpreter's products a few rows past OpenBLAS's small-matrix bound, run in row blocks under it
(minicavs/cpu/interpreter.py's small_matrix_bound, codegen/machine.py's GEMM case): the bound only on the cores
with small-matrix kernels and float; row blocks give the one call's numbers (float64, 1e-12) and the reference
runner's, in training and inference."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.cpu import interpreter as ci
from minicavs.engine.compile import EngineOptions

from ..engine.test_instructions import close
from ..models.test_models import trainer


@pytest.mark.parametrize("c_type,core,bound", [("float", "SkylakeX", ci.SMALL_MNK), ("float", "COOPERLAKE", ci.SMALL_MNK),
                                               ("float", "Haswell", 0), ("float", None, 0), ("double", "SkylakeX", 0)])
def test_only_cores_with_small_matrix_kernels_split_products(c_type, core, bound, monkeypatch):
    monkeypatch.setattr(ci, "corename", lambda: core)
    assert ci.small_matrix_bound(c_type) == bound


def _run(t, graphs, feeds, runner: str, training: bool):
    params = {k: p.value for k, p in t.params.items()}
    ctx = t.context(training=False)
    options = EngineOptions(runner=runner, check=True)
    if training:
        return t.model.forward_backward(graphs, feeds, params, ctx, options=options)
    return t.model.infer(graphs, feeds, params, ctx, options=options)


def _same(got, want) -> None:
    close(got.loss, want.loss, "float64")
    for k in want.outputs:
        close(got.outputs[k], want.outputs[k], "float64")
    for k in (want.grads or {}):
        close(got.grads[k], want.grads[k], "float64")


@pytest.mark.parametrize("training", [False, True])
def test_products_in_row_blocks_give_one_calls_and_the_reference_runners_numbers(training, tmp_path):
    t = trainer("tree_lstm", tmp_path, "train.dtype=float64")
    graphs, feeds = t.task.batch(t.task.data["train"][:12])
    ex = ci.interpreter(np.dtype(np.float64))
    hidden = t.params["b_f"].value.shape[0]
    per = 3   # rows a block of the internal vertices' product [h1; h2] U (2H x 3H) holds
    tasks = t.model.prepare(graphs).plans["tree"][1].task_array
    assert ((tasks[:, 2] > per) & (tasks[:, 2] <= 2 * per)).any()   # (tasks whose products are split)
    one_call = _run(t, graphs, feeds, "device", training)
    reference = _run(t, graphs, feeds, "reference", training)
    try:
        ex.lib.mc_set_small_mnk(per * 2 * hidden * 3 * hidden)
        blocks = _run(t, graphs, feeds, "device", training)
    finally:
        ex.lib.mc_set_small_mnk(ex.small_mnk)
    _same(blocks, one_call)
    _same(blocks, reference)
