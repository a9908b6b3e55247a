"""``model.cell: naive`` (one product and one bias per gate, minicavs/nn/gates.py) computes the fused cell's
numbers: its parameters are the fused weights' gate blocks, so loss and gradients (float64) are equal, with
the GEMM-merging and layout passes on or off, and the planned buffers leave the parameters per parameter."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.bench.breakdown import ROW_MOVES
from minicavs.engine.compile import EngineOptions
from tests.models.test_models import trainer

NAIVE_MODELS = ["tree_lstm", "tree_lstm_child_sum", "tree_lstm_2type", "var_lstm", "lattice_lstm"]
OPTIONS = [EngineOptions(merge_gemms=False), EngineOptions(), EngineOptions(plan_layout=True),
           EngineOptions(plan_layout=True, runner="reference")]


def _dense(g):
    return np.asarray(getattr(g, "to_dense", lambda: g)())


def _engine(options: EngineOptions) -> list:
    """The overrides building a trainer for ``options``: the trainer lays its parameters out (or not) then."""
    return [f"train.engine.{k}={str(getattr(options, k)).lower()}" for k in ("merge_gemms", "plan_layout")]


def _step(t, options):
    graphs, feeds = t.task.batch(t.task.data["train"][:6])
    return t.model.forward_backward(graphs, feeds, t.params, t.context(training=True), options=options)


@pytest.mark.parametrize("options", OPTIONS, ids=["unmerged", "merged-copied", "merged-views", "reference"])
@pytest.mark.parametrize("name", NAIVE_MODELS)
def test_naive_cell_equals_the_fused_cell(name, options, tmp_path):
    fused = trainer(name, tmp_path / "fused", "train.dtype=float64")
    naive = trainer(name, tmp_path / "naive", "train.dtype=float64", "model.cell=naive", *_engine(options))
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


def _instructions(result) -> dict:
    counts: dict = {}
    for state in result.states.values():
        for program in (state.program, state.backward_program):
            assert program.declined is None, program.declined   # the C runner ran the pass
            for line in program.lowered.lines():
                words = line.split()
                if len(words) > 1:
                    counts[words[1]] = counts.get(words[1], 0) + 1
    return counts


@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("name", ["tree_lstm", "tree_lstm_child_sum", "tree_lstm_2type", "var_lstm"])
def test_naive_cell_moves_the_rows_the_fused_cell_moves(name, layout, tmp_path):
    """The memory kernels of ED-Batch's Table 2: the per-gate products, merged, store and copy what the fused
    cell does (the merged product stored once, one gradient concat, ∂W' computed into the parameters'
    gradients: no GACC); with the layout the biases too (one bias buffer added by the merged GEMM), without
    it each bias is added to its block, so its gradient's rows are moved apart (more COPYs)."""
    fused = trainer(name, tmp_path / "fused")
    naive = trainer(name, tmp_path / "naive", "model.cell=naive", f"train.engine.plan_layout={str(layout).lower()}")
    want = _instructions(_step(fused, EngineOptions()))
    got = _instructions(_step(naive, EngineOptions(plan_layout=layout)))
    for op in ROW_MOVES + ("GACC",) if layout else ("GACC",):
        assert got.get(op, 0) == want.get(op, 0), op


@pytest.mark.parametrize("name", ["tree_lstm", "var_lstm", "lattice_lstm"])
def test_naive_cell_with_the_layout_trains_as_the_fused_cell(name, tmp_path):
    """A few optimizer steps (float64): the naive cell's planned buffers, each updated by the C step as one
    array (no stage: the gradients read in place or joined, the slots laid out alike), hold the fused
    weights' values, and the losses are the fused cell's."""
    fused = trainer(name, tmp_path / "fused", "train.dtype=float64")
    naive = trainer(name, tmp_path / "naive", "train.dtype=float64", "model.cell=naive",
                    "train.engine.plan_layout=true")
    bs = 4
    for step in range(3):
        ids = np.arange(step * bs, (step + 1) * bs)
        want, got = fused.train_step(ids)[0], naive.train_step(ids)[0]
        assert abs(want - got) <= 1e-10 * max(1.0, abs(want)), step
    assert not naive.optimizer.__dict__.get("_stages")
    planned = [b for b in naive.model.layout() if len(b) > 1]
    assert planned and all(naive.params[n].value.base is naive.params[b[0]].value.base for b in planned for n in b)
    for k, p in fused.params.items():
        parts = sorted((n for n in naive.params if n.startswith(k + ".")), key=list(naive.params).index)
        have = np.concatenate([naive.params[n].value for n in parts], axis=-1) if parts else naive.params[k].value
        assert np.max(np.abs(p.value - have)) <= 1e-10 * max(1.0, float(np.max(np.abs(p.value)))), k
