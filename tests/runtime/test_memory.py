"""Gather elision: the schedule puts siblings side by side and chains sorted by length, so the rows a task
gathers are an evenly strided block of the scatter tensor and are read as a view; results never change."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from minicavs.engine.compile import POST
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.explain import explain
from minicavs.runtime.inputs import InputGraph
from minicavs.runtime.memory import _strided_arrays

from .. import cells
from ..engine.test_alg1 import assert_same, random_tree

ON = EngineOptions()
OFF = replace(ON, gather_elision=False)



def _strided(rows: np.ndarray, offs: np.ndarray, sizes: np.ndarray, sentinel: int) -> dict:
    """{task's kind offset: (start, step)} for the tasks of memory._strided_arrays whose rows are a view."""
    if not len(rows):
        return {}
    start, step = _strided_arrays(rows, np.asarray(offs), np.asarray(sizes), sentinel)
    return {o: (a, b) for o, a, b in zip(np.asarray(offs).tolist(), start.tolist(), step.tolist()) if b >= 0}


def test_strided_blocks_found_per_task():
    rows = np.array([0, 2, 4, 6, 1, 3, 5, 9, 7, 8, 10, 12, 12])
    offs, sizes = np.array([0, 4, 7, 8, 11]), np.array([4, 3, 1, 3, 2])
    # 7, 8, 10 is not evenly strided; 12, 12 are missing children (the zero sentinel row 12): step 0
    assert _strided(rows, offs, sizes, sentinel=12) == {0: (0, 2), 4: (1, 2), 7: (9, 1), 11: (12, 0)}
    assert _strided(np.array([12, 3]), np.array([0]), np.array([2]), sentinel=12) == {}


def _strided_by_task(rows, offs, sizes, sentinel):
    """The per-task reference: a task is a view iff its rows are start + step * i, step >= 1, or all the
    sentinel (step 0)."""
    out = {}
    for off, bs in zip(offs.tolist(), sizes.tolist()):
        r = rows[off:off + bs].tolist()
        steps = {b - a for a, b in zip(r, r[1:])}
        if r[0] == sentinel:
            if all(x == sentinel for x in r):
                out[off] = (sentinel, 0)
        elif bs == 1:
            out[off] = (r[0], 1)
        elif len(steps) == 1 and min(steps) >= 1:
            out[off] = (r[0], steps.pop())
    return out


@pytest.mark.parametrize("seed", range(30))
def test_strided_views_match_a_per_task_reference(seed):
    """The vectorised test (one pass over all tasks, what plan_memory and the native task table use) finds
    exactly the tasks a task-by-task check finds, with the same start and step."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, rng.integers(1, 8))
    offs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    sentinel = 40
    rows = np.empty(sizes.sum(), np.int64)
    for off, bs in zip(offs, sizes):   # strided blocks, sentinel runs, and random rows
        pick = rng.integers(4)
        start, step = int(rng.integers(0, 20)), int(rng.integers(0, 4))
        rows[off:off + bs] = (sentinel if pick == 0 else start + step * np.arange(bs) if pick < 3
                              else rng.choice([sentinel, *range(20)], bs))
    assert _strided(rows, offs, sizes, sentinel) == _strided_by_task(rows, offs, sizes, sentinel)


def run(case, graphs, rng, opts):
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    res = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=opts)
    return res, feeds


@pytest.mark.parametrize("leaves", [1, 2, 8, 32])
def test_complete_trees_gather_nothing(leaves):
    """Tree-FC on complete trees: [h_left; h_right] is a reshape of the previous level's rows."""
    rng = np.random.default_rng(leaves)
    case = cells.tree_fc(rng)
    graphs = [InputGraph.complete_binary_tree(leaves) for _ in range(3)]
    on, feeds = run(case, graphs, np.random.default_rng(0), ON)
    off, _ = run(case, graphs, np.random.default_rng(0), OFF)
    assert_same(off, on)
    internal = sum(g.num_vertices for g in graphs) - 3 * leaves
    st_on, st_off = on.states[case.model.structures[0].name], off.states[case.model.structures[0].name]
    assert st_off.copies["gather"] == 2 * internal and st_on.copies["gathered"] == 2 * internal
    assert st_on.copies["gather"] == 0
    text = str(explain(case.model, graphs, feeds, case.params))
    assert f"gathered rows copied: 0.0% of {2 * internal}" in text


def test_chains_sorted_by_length_gather_nothing():
    rng = np.random.default_rng(5)
    case = cells.chain_lstm(rng)
    graphs = [InputGraph.chain(n) for n in (3, 7, 1, 5, 5, 2)]
    on, _ = run(case, graphs, np.random.default_rng(1), ON)
    off, _ = run(case, graphs, np.random.default_rng(1), OFF)
    assert_same(off, on)
    st = on.states[case.model.structures[0].name]
    assert st.copies["gather"] == 0 and st.copies["gathered"] == sum((3, 7, 1, 5, 5, 2))


@pytest.mark.parametrize("seed", range(4))
def test_irregular_trees_copy_only_what_is_not_strided(seed):
    rng = np.random.default_rng(seed)
    case = cells.binary_tree_lstm(rng)
    graphs = [random_tree(rng, int(n), 2, full_binary=True) for n in rng.integers(1, 9, size=5)]
    on, _ = run(case, graphs, np.random.default_rng(2), ON)
    off, _ = run(case, graphs, np.random.default_rng(2), OFF)
    assert_same(off, on)
    st_on, st_off = (r.states[case.model.structures[0].name] for r in (on, off))
    assert st_on.copies["gathered"] == st_off.copies["gathered"] == st_off.copies["gather"]
    assert st_on.copies["gather"] <= st_off.copies["gather"]


def test_backward_reads_scattered_values_back_from_the_scatter_tensor():
    """h (Tree-FC) and the parts h, c of a scattered [h, c] (Tree-LSTM) are not stored twice."""
    fc = cells.tree_fc(np.random.default_rng(0)).model.structures[0].compiled["internal"]
    assert fc.scatter_source in fc.scatter_parts and fc.scatter_source not in fc.fwd_tensors
    from minicavs import ops
    from minicavs.engine.compile import CompiledFunction
    from minicavs.runtime.vertex import VertexFunction
    F = VertexFunction("sq", arity=1, message=(4,), dtype="float64")
    with F:
        c = ops.tanh(ops.slice_(F.gather(0), 2, 4) + F.pull((2,), "x"))
        h = c * c                       # ∂F reads c (the gradient of c * c is 2c)
        F.scatter(ops.concat([h, c]))
    fn = CompiledFunction(F)
    assert fn.scatter_parts == {c: (2, 4)} and c not in fn.fwd_tensors


def test_lazy_phases_read_scattered_values_and_gathered_children_back_from_the_scatter_tensors():
    """Tree-FC: the lazy phase after F's loop pushes h, the one after ∂F's computes dW = Σ [h_l; h_r]ᵀ·dy
    and the leaves' dW_l from dscatter. All three read the scatter tensor (or its gradient) at the kind's
    rows, so no task copies h, [h_l; h_r] or dscatter into a dynamic tensor; results stay the same."""
    case = cells.tree_fc(np.random.default_rng(0), H=4)
    compiled = case.model.structures[0].compiled
    internal, leaf = compiled["internal"], compiled["leaf"]
    cat, h = internal.gather_concat, internal.scatter_source
    assert internal.lazy_gather_reads(ON) == {cat}
    assert h in internal.lazy_scatter_reads(ON) and leaf.ct[leaf.scattered] in leaf.lazy_scatter_reads(ON)
    f_stored, f_places, b_stored, b_places = internal.placement(ON)
    assert cat not in f_stored and h not in f_stored                 # nothing of F is kept but the tensors ∂F
    assert leaf.ct[leaf.scattered] not in leaf.placement(ON).backward_stored     # reads; the leaves' dscatter not either
    from minicavs.data.trees import complete_binary_tree
    complete = [complete_binary_tree(8).to_graph()] * 3          # siblings side by side: a reshape
    irregular = [random_tree(np.random.default_rng(1), n, 2, full_binary=True) for n in (5, 7, 4)]
    for runner, trees in [(e, t) for e in ("device", "reference") for t in (complete, irregular)]:
        opts = replace(ON, runner=runner)
        rng = np.random.default_rng(2)
        feeds = cells.batch_feeds(case, trees, [case.data(rng, g) for g in trees])
        res = case.model.forward_backward(trees, feeds, case.params, RunContext(), options=opts)
        state = res.states[case.model.structures[0].name]
        # (both runners run the one lowered program: its blocks are templates of the same call)
        back, kind_id = state.backward_program, state.plan.kinds.index(
            next(k for k in state.plan.kinds if k is not None and k.name == "internal"))
        lazy = back.dump()[back.dump().index("kind 'internal' after tasks block template"):]
        # [h_l; h_r] read as a view of the scatter tensor (its block row names the first child row) where
        # siblings are side by side, else gathered row by row (TAKETO); h pushed from the scatter rows
        assert "CATVIEW dst=r0(%" in lazy and "TAKETO" in lazy
        (row,) = back.table[back.table[:, 0] == 2 * (len(back.lowered.ranges) // 3) + kind_id]
        assert (row[4] >= 0) == (trees is complete)
        push = state.program.dump()[state.program.dump().index("kind 'internal' after tasks block template"):]
        # (SROWS: a view of the kind's scatter rows, which the cavs schedule lays out as one block: the
        # block's row gives their first row, not -1, so nothing is copied)
        assert re.search(r"SROWS dst=r\d+\(%\d+\) buf=scatter\S* .*load=1", push)
        fwd = state.program
        (row,) = fwd.table[fwd.table[:, 0] == 2 * (len(fwd.lowered.ranges) // 3) + kind_id]
        assert row[3] >= 0
        # (the workspace is the model's: the serial run reuses the buffers checked above)
        assert_same(res, case.model.forward_backward(trees, feeds, case.params, RunContext(), policy="serial",
                                                     options=opts))


def test_backward_reads_pulled_rows_back_from_the_pull_buffer():
    leaf = cells.tree_fc(np.random.default_rng(0)).model.structures[0].compiled["leaf"]
    (x,) = leaf.pulls.values()
    assert leaf.pull_reads == {"x": x} and x not in leaf.fwd_tensors   # dW_l = x^T g needs x


def test_workspace_is_reused_across_batches(monkeypatch):
    """Steady state: forward and backward run in the model's workspace. After warm-up no dynamic tensor is
    created or regrown (backward included: it used to allocate its tensors anew every batch), the scatter
    tensor and its gradient keep their buffers, and the bytes a batch allocates (tracemalloc: peak above
    what was live before it) do not grow with the number of batches."""
    import gc
    import tracemalloc

    from minicavs.runtime.memory import DynamicTensor

    rng = np.random.default_rng(3)
    case = cells.binary_tree_lstm(rng, H=16)
    big = [random_tree(rng, int(n), 2, full_binary=True) for n in (9, 7, 5, 9)]
    small = big[:2]
    feeds = {k: cells.batch_feeds(case, g, [case.data(np.random.default_rng(1), t) for t in g])
             for k, g in (("big", big), ("small", small))}
    graphs = {"big": big, "small": small}

    def step(which):
        res = case.model.forward_backward(graphs[which], feeds[which], case.params, RunContext(seed=2))
        return res.loss

    for _ in range(3):   # warm-up: kernels loaded, buffers at their size
        step("big")
    created, regrown = [], []
    init, resize = DynamicTensor.__init__, DynamicTensor.resize

    def counting_init(self, *args, **kwargs):
        created.append(args[0])
        init(self, *args, **kwargs)

    def watching_resize(self, rows, zero=False):
        before = self.buffer
        out = resize(self, rows, zero)
        if self.buffer is not before:
            regrown.append(self.name)
        return out

    monkeypatch.setattr(DynamicTensor, "__init__", counting_init)
    monkeypatch.setattr(DynamicTensor, "resize", watching_resize)
    workspace = case.model.workspace(case.model.structures[0].name)
    buffers = [t.buffer for t in list(workspace.scatters.values()) + list(workspace.scatter_grads.values())]
    assert len(buffers) == 2   # one scatter tensor (one message shape) and its gradient
    assert workspace.backward, "backward keeps its cross-phase tensors in the workspace"
    tracemalloc.start()
    try:
        allocated, live, losses = [], [], []
        for i in range(8):
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            losses.append(step("small" if i % 4 == 3 else "big"))
            peak = tracemalloc.get_traced_memory()[1]
            gc.collect()   # reference cycles of a batch (cffi buffers, closures) count only until collected
            allocated.append(peak - before)
            live.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert created == [] and regrown == []
    assert all(a is b for a, b in zip(
        [t.buffer for t in list(workspace.scatters.values()) + list(workspace.scatter_grads.values())], buffers))
    big_runs = [a for i, a in enumerate(allocated) if i % 4 != 3]
    assert max(big_runs[3:]) <= 1.05 * max(big_runs[:3]) + 4096, allocated
    # (what stays live grows by ~2 KB a batch: 56-byte blocks that cffi's from_buffer leaves behind in the
    # C kernels' calls, on main as well; not buffers)
    assert max(live) < 64 * 1024, live
    assert len({round(x, 12) for i, x in enumerate(losses) if i % 4 != 3}) == 1


def test_explain_reports_the_peak_of_the_reused_buffers():
    """The peak counts the model's pooled dynamic tensors (kept per structure and device): at least what this
    batch holds, and what a larger earlier batch grew them to."""
    case = cells.chain_lstm(np.random.default_rng(5))
    big = [InputGraph.chain(n) for n in (30, 20, 25)]
    small = [InputGraph.chain(2)]
    rng = np.random.default_rng(1)
    run(case, big, rng, ON)
    rng = np.random.default_rng(2)
    feeds = cells.batch_feeds(case, small, [case.data(rng, g) for g in small])
    report = explain(case.model, small, feeds, case.params).structures[0]
    assert report.peak_bytes >= report.tensor_bytes > 0
    assert report.peak_bytes > 10 * report.tensor_bytes


def test_lazy_phase_temporaries_live_in_the_workspace():
    """The leaves' ∂F after the loop computes dY = dscatter·(1 - h²) for all leaves with one kernel: its
    output goes into a dynamic tensor of the model's workspace, the same buffer every batch (not a fresh
    array of all the leaves' rows per batch)."""
    case = cells.tree_fc(np.random.default_rng(0), H=4)
    leaf = case.model.structures[0].compiled["leaf"]
    rng = np.random.default_rng(1)
    trees = [random_tree(rng, 6, 2, full_binary=True) for _ in range(3)]
    feeds = cells.batch_feeds(case, trees, [case.data(rng, g) for g in trees])
    (fused,) = [s for s in leaf.phases(ON).backward.programs[POST] if s.fused]
    assert set(fused.outputs) <= set(leaf.placement(ON).backward_stored)   # (its output is a dynamic tensor of ∂F)
    written = []
    for _ in range(2):
        res = case.model.forward_backward(trees, feeds, case.params, RunContext(), options=ON)
        program = res.states[case.model.structures[0].name].backward_program
        kind_id = next(i for i, k in enumerate(program.buffers.plan.kinds) if k is not None and k.name == "leaf")
        # the leaves' block template writes the kernel's output into that tensor's rows (BIND, then FUSED)
        assert ("btensor", fused.outputs[0], kind_id) in program.lowered.keys
        written.append(program.buffers.btensors[kind_id][fused.outputs[0]].buffer)
    assert np.shares_memory(written[0], written[1])
