"""The native planner (one C call: flatten, heights, kinds, cavs schedule, memory plan) against the reference
path (make_batch, Structure.batch, the policy's schedule, plan_memory): the same batch and plan, array for
array, on random trees, chains and DAGs and on every bundled model; input the reference refuses never runs
through C to the end, and gives the reference's error."""
from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.engine import planner
from minicavs.core.errors import InputGraphError
from minicavs.runtime.inputs import InputGraph
from minicavs.runtime.scheduler import get_policy
from minicavs.train.trainer import Trainer

from .. import cells
from ..models.test_models import MODELS, TINY
from .test_alg1 import CASES

pytestmark = pytest.mark.skipif(planner.library() is None, reason="no C compiler: the reference path plans")


PLANNER_ONLY = ("task_views", "gather_copies", "view_arity")   # what only the planner makes (the task table)


def assert_same(a, b, where="plan"):
    """Equal values, dtypes and structure (numpy arrays, dataclasses, dicts, sequences); the graphs list and the
    lazily built views are the same objects or caches, not compared."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{where}: {a} != {b}"
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b), where
        for f in fields(a):
            if f.name not in ("graphs", "_views") + PLANNER_ONLY:
                assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


def native_and_reference(structure, graphs, policy="cavs", sample_ids=None):
    policy = get_policy(policy)
    spec = structure._planner_spec()
    assert spec is not None, "the planner covers this structure"
    made = planner.prepare(list(graphs), spec, sample_ids)
    assert made is not None, "the planner accepted the batch"
    return made, structure.prepare(graphs, policy, sample_ids, native=False)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 6), size=st.integers(1, 9),
       policy=st.sampled_from(["cavs", "agenda", "greedy", "fsm"]), ids=st.booleans())
def test_random_graphs_plan_as_the_reference(name, seed, k, size, policy, ids):
    """Trees (binary, up to 3 children), DAGs (shared children: not a forest), chains; one function or the
    leaf/internal rule; several samples of different heights; every policy that schedules such kinds as
    cavs does; given or default sample ids (the dropout row keys)."""
    build, make_graph = CASES[name]
    rng = np.random.default_rng(seed)
    case = build(rng)
    graphs = [make_graph(rng, int(rng.integers(1, size + 1))) for _ in range(k)]
    sample_ids = rng.integers(0, 1 << 32, k) if ids else None
    for s in case.model.structures:
        if s._planner_spec() is not None:
            (batch, plan), (ref_batch, ref_plan) = native_and_reference(s, graphs, policy, sample_ids)
            assert_same(batch, ref_batch, "batch")
            assert_same(batch.parents_csr(), ref_batch.parents_csr(), "parents")
            assert_same(plan, ref_plan)
            for kind_plan, ref in zip(plan.kinds, ref_plan.kinds):
                assert (kind_plan is None) == (ref is None)
                if kind_plan is not None:
                    assert_same(kind_plan.views, ref.views, f"kind {kind_plan.name} views")
            assert_same_task_tables(s, batch, plan, ref_plan)


def assert_same_task_tables(s, batch, plan, ref_plan):
    """The C runner's task table and copy counters from the planner's table equal those task_table
    builds from the reference plan, forward and backward, under the switches that change them."""
    from minicavs.engine import program
    from minicavs.engine.compile import EngineOptions
    for opts in (EngineOptions(), EngineOptions(gather_elision=False), EngineOptions(merge_gemms=False, lazy_batching=False, eager_batching=False)):
        compiled = s.compiled_for(batch, opts)
        for backward in (False, True):
            assert_same(program.task_table(compiled, plan, opts, backward),
                        program.task_table(compiled, ref_plan, opts, backward), f"task table {opts} {backward}")


# kinds given with the graphs
UNCOVERED = ("tree_lstm_2type", "lattice_lstm", "lattice_gru", "bilstm_tagger", "lstm_nmt")


@pytest.mark.parametrize("name", sorted(TINY))
def test_bundled_models_plan_as_the_reference(name, tmp_path):
    """Each bundled model's structures on its own data (batches of 1 and of 10 samples): where the planner
    covers them (no kinds given with the graphs), it gives their reference plans."""
    t = Trainer(MODELS / f"{name.replace('_child_sum', '')}.yaml", TINY[name], run_dir=tmp_path)
    data = t.task.data["train"]
    covered = 0
    for samples in (data[:1], data[:10]):
        graphs, _ = t.task.batch(samples)
        by_name = t.model._graphs_by_structure(graphs)
        for s in t.model.structures:
            if s._planner_spec() is None or any(g.kinds is not None for g in by_name[s.name]):
                continue   # (kinds given with the graphs: the reference path)
            covered += 1
            (batch, plan), (ref_batch, ref_plan) = native_and_reference(s, by_name[s.name], t.model.policy)
            assert_same(batch, ref_batch, "batch")
            assert_same(plan, ref_plan)
            assert_same_task_tables(s, batch, plan, ref_plan)
    assert covered or name in UNCOVERED, f"{name}: the planner covers none of its structures"
    assert not (covered and name in UNCOVERED)


def test_model_runs_take_the_native_plan(monkeypatch):
    """Model.prepare plans natively (the reference is not called) and the run equals one planned by the
    reference, value for value."""
    rng = np.random.default_rng(3)
    case = cells.binary_tree_lstm(rng)
    graphs = [CASES["binary_tree_lstm"][1](rng, n) for n in (4, 1, 6)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    native = case.model.forward_backward(graphs, feeds, case.params)
    s = case.model.structures[0]
    monkeypatch.setattr(type(s), "batch", lambda *a, **k: pytest.fail("the reference path ran"))
    case.model.prepare(graphs)
    monkeypatch.undo()
    monkeypatch.setattr(planner, "prepare", lambda *a, **k: None)
    reference = case.model.forward_backward(graphs, feeds, case.params)
    assert native.loss == reference.loss
    for k in reference.grads:
        a, b = native.grads[k], reference.grads[k]
        assert np.array_equal(getattr(a, "to_dense", lambda: a)(), getattr(b, "to_dense", lambda: b)())


@pytest.mark.parametrize("bad, match", [
    ([InputGraph([[1], [0]])], r"sample 0, vertex [01]: lies on a cycle"),
    ([InputGraph([[], []]), InputGraph([[], [5]])], r"sample 1, vertex 1: child index 5 out of range"),
    ([InputGraph([[], [-1]])], r"sample 0, vertex 1: child index -1 out of range"),
    ([InputGraph([[0]])], r"sample 0, vertex 0: lists itself as a child"),
    ([InputGraph([[], [], [], [0, 1, 2]])], r"sample 0, vertex 3: 3 children, more than the arity 2"),
    ([InputGraph([[], []]), InputGraph([])], "sample 1: empty graph"),
])
def test_refused_input_gives_the_reference_error(bad, match):
    rng = np.random.default_rng(7)
    case = cells.binary_tree_lstm(rng)
    s = case.model.structures[0]
    assert planner.prepare(bad, s._planner_spec()) is None
    with pytest.raises(InputGraphError, match=match):
        case.model.prepare(bad)


def test_a_kind_without_a_function_gives_the_reference_error():
    from minicavs.engine.model import Structure, by_child_count
    rng = np.random.default_rng(1)
    case = cells.binary_tree_lstm(rng)
    s = case.model.structures[0]
    odd = Structure(dict(s.functions), pulls=s.pulls, kinds=by_child_count("leaf", "inner"))
    graphs = [InputGraph([[], [], [0, 1]])]
    assert planner.prepare(graphs, odd._planner_spec()) is None
    with pytest.raises(InputGraphError, match="kind 'inner'.*has no vertex function"):
        odd.prepare(graphs, get_policy("cavs"))


def _forged(ptr, idx) -> InputGraph:
    """A graph whose arrays were replaced after its checks (what no constructor makes)."""
    g = InputGraph([[]])
    g.child_ptr, g.child_idx, g.num_vertices = np.asarray(ptr, np.int64), np.asarray(idx, np.int64), len(ptr) - 1
    return g


@pytest.mark.parametrize("ptr, idx", [
    ([0, 2, 1, 3], [0, 0, 1]),          # pointers decrease: no child id is read past the array
    ([0, 0, 9], [0]),                   # the last pointer beyond the child ids
    ([1, 1, 2], [0]),                   # not starting at 0
    ([0, 0, 1], [1 << 40]),             # a huge id
    ([0, 0, -5], []),                   # negative pointers
])
def test_forged_arrays_are_checked_in_c(ptr, idx):
    """Arrays changed behind the graph's back get a nonzero code from the C checks (the reference then
    explains or fails on them), never a read outside the buffers."""
    rng = np.random.default_rng(2)
    spec = cells.binary_tree_lstm(rng).model.structures[0]._planner_spec()
    assert planner.prepare([_forged(ptr, idx)], spec) is None
    assert planner.prepare([InputGraph([[]]), _forged(ptr, idx)], spec) is None


def test_large_graphs_plan_as_the_reference():
    """A 20k-vertex chain (20k tasks), a 4k-leaf complete tree and a wide DAG in one batch: the counting sorts
    and the scratch sized for them."""
    rng = np.random.default_rng(11)
    case = cells.child_sum_tree_lstm(rng)
    wide = [[]] * 300 + [[int(c) for c in rng.choice(300, 3, replace=False)] for _ in range(300)]
    graphs = [InputGraph.chain(20_000), InputGraph.complete_binary_tree(4096), InputGraph(wide)]
    s = case.model.structures[0]
    (batch, plan), (ref_batch, ref_plan) = native_and_reference(s, graphs)
    assert_same(batch, ref_batch, "batch")
    assert_same(plan, ref_plan)


def test_without_a_library_the_reference_path_plans(monkeypatch):
    """No library provided (no C compiler, no backend providing one): prepare declines and Model.prepare gives the
    reference's batch and plan."""
    rng = np.random.default_rng(5)
    case = cells.binary_tree_lstm(rng)
    graphs = [CASES["binary_tree_lstm"][1](rng, n) for n in (3, 5)]
    s = case.model.structures[0]
    (native_batch, native_plan), _ = native_and_reference(s, graphs)
    from minicavs.engine import backend
    monkeypatch.setattr(backend, "_PLANNER", [])
    assert planner.library() is None
    assert planner.prepare(list(graphs), s._planner_spec()) is None
    batch, plan = s.prepare(graphs, get_policy("cavs"))
    assert_same(batch, native_batch, "batch")
    assert_same(plan, native_plan)
