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


class _NaNScratch(dict):
    """A hand-written program's buffers; its scratch arena made on first use, full of NaN, and kept."""

    def __init__(self, buffers: dict, dtype):
        super().__init__(buffers)
        self.dtype, self.scratch = dtype, None

    def __missing__(self, key):
        assert key[0] == "arena", key
        self.scratch = np.full(max(1, key[2]), np.nan, self.dtype)
        return self.scratch


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rows, cols, in_place", [
    ([2, 3, 4, 5], 3, True), ([0], 3, True), ([0, 1, 2, 3, 4, 5, 6], 3, True),   # whole rows, one after another
    ([2, 4, 5, 6], 3, False), ([3, 2, 4, 5], 3, False), ([4, 4, 5], 3, False),    # a gap, out of order, twice
    ([-1, 0, 1, 2], 3, False), ([0, 1, 2, -1], 3, False),                         # a missing row (zeros)
    ([2, 3, 4, 5], 2, False)])                                                    # the first columns only
def test_take_reads_consecutive_whole_rows_where_they_lie(dtype, rows, cols, in_place):
    """TAKE (a pull, a push gradient) of whole rows that follow one another points its register at them: its
    scratch rows, NaN before the run, stay NaN (Tree-FC's leaves pull their inputs so; no copy). Other rows are
    copied into scratch. Either way a COPY of the register writes numpy's rows (zeros for -1) on the C runner,
    with and without its check mode, and on the reference runner (which always copies)."""
    from minicavs.cpu import CPU, c_runner
    from minicavs.engine import reference
    from minicavs.engine.program import BatchProgram
    from dataclasses import replace
    from ..engine.test_reference import _program
    x = np.random.default_rng(len(rows) * 10 + cols).standard_normal((7, 3)).astype(dtype)
    idx = np.array(rows, np.int64)
    keys = [("tensor", "X", 0), ("pullrows", "x", 0), ("tensor", "Y", 0)]
    program = replace(_program([("TAKE", 0, 0, 3, 1, cols, 0), ("BIND", 1, 2, 1, 0, 3), ("COPY", 1, 0, -1, cols)],
                               keys, 2), scratch_cols=cols)
    table = np.array([[0, 0, len(idx), 0, -1]], np.int64)
    want = np.zeros((len(idx), 3), dtype)
    want[:, :cols] = np.where(idx[:, None] >= 0, x[np.maximum(idx, 0), :cols], 0)
    for run, check in ((c_runner.run, False), (c_runner.run, True), (reference.run, False)):
        buffers = _NaNScratch({keys[0]: x.copy(), keys[1]: idx, keys[2]: np.zeros((len(idx), 3), dtype)}, dtype)
        run(BatchProgram.of(program, table, buffers, dtype, CPU, check=check))
        np.testing.assert_array_equal(buffers[keys[2]], want)
        np.testing.assert_array_equal(buffers[keys[0]], x)
        if run is c_runner.run:
            assert np.isnan(buffers.scratch[:len(idx) * cols]).all() == in_place, (run, check)
