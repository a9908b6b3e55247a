"""The frontier policies' schedule in one C call (minicavs/cpu/frontier_kernel.py) against the numpy Frontier it
replaces (minicavs/runtime/frontier.py, the reference): the same task for every vertex and the same type for every
task, under every rule (FSM S1/S2/S3 with learned and random tables, agenda, greedy), on random typed DAGs,
the bundled 2Type and lattice graphs and ED-Batch's Fig. 1; and bad input refused before C sees it."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.cpu.frontier_kernel import MAX_FSM_TYPES, FsmTable, frontier_kernel
from minicavs.data.lattice import synthetic_lattices
from minicavs.runtime.frontier import Frontier, TypedGraph, run_agenda, run_greedy, run_policy
from minicavs.runtime.fsm import ENCODINGS, Fsm, Hyper, actions, encode, learn
from minicavs.runtime.inputs import InputGraph, make_batch
from minicavs.runtime.scheduler import get_policy

from ..runtime.test_frontier import fig1_graph, two_type_batch, typed_dags


@pytest.fixture(scope="module")
def kernel():
    k = frontier_kernel()
    if k is None:
        pytest.skip("no C compiler")
    return k


def random_table(graph: TypedGraph, encoding: str, rng: np.random.Generator) -> dict:
    """Q values for the states a random run of ``graph`` visits (one-hot on a random action), so that the
    table, not the fallback rule, decides most steps; a few visited states are left out (fallback)."""
    q: dict = {}

    def choose(frontier):
        state = encode(frontier.counts, encoding)
        acts = actions(state, encoding)
        if state not in q:
            values = [0.0] * len(acts)
            values[int(rng.integers(len(acts)))] = 1.0
            q[state] = values
        return acts[int(np.argmax(q[state]))]
    run_policy(Frontier(graph), choose)
    return {s: v for s, v in q.items() if rng.random() < 0.8}


def fresh(graph: TypedGraph) -> TypedGraph:
    """The same graph without its cached parents and G[t] (so the native run builds its own)."""
    return TypedGraph(graph.child_ptr, graph.child_idx, graph.kind, graph.num_types, graph.height)


def assert_same_typewise(kernel, graph: TypedGraph):
    """The C G[t] is frontier.py's: the same typewise child count and the same typewise parents per vertex."""
    count, ptr, idx = kernel.typewise(graph.child_ptr, graph.child_idx, graph.kind, graph.num_types)
    want_count, want_ptr, want_idx = fresh(graph).typewise()
    assert np.array_equal(count, want_count) and np.array_equal(ptr, want_ptr)
    for v in range(graph.num_vertices):
        assert sorted(idx[ptr[v]:ptr[v + 1]].tolist()) == sorted(want_idx[want_ptr[v]:want_ptr[v + 1]].tolist())


def assert_same_runs(graph: TypedGraph, fsms=()):
    """Native and numpy agree for agenda, greedy and every given FSM (the native run on a graph without the
    numpy run's cached G[t])."""
    for run in (run_agenda, run_greedy):
        a, b = run(fresh(graph), native=False), run(fresh(graph))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), run.__name__
    for fsm in fsms:
        a, b = fsm.schedule(graph, native=False), fsm.schedule(graph)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), fsm.encoding


def many_typed_dags():
    """1-4 random DAGs with 1-6 types, repeated children allowed, at most 40 vertices in all."""
    return typed_dags(max_vertices=40, max_graphs=4, max_types=6, max_children=4, repeats=True)


@settings(max_examples=50, deadline=None)
@given(many_typed_dags(), st.integers(0, 2**31 - 1))
def test_native_schedule_is_the_numpy_schedule_on_random_typed_dags(kernel, case, seed):
    graphs, names = case
    graph = TypedGraph.of(make_batch(graphs, kind_names=names))
    rng = np.random.default_rng(seed)
    fsms = [Fsm(enc, names, random_table(graph, enc, rng)) for enc in ENCODINGS]
    fsms += [Fsm(enc, names, {}) for enc in ENCODINGS]       # the fallback rule alone
    assert_same_runs(graph, fsms)
    assert_same_typewise(kernel, graph)


def lattice_batch(n=30, seed=4):
    lattices, _ = synthetic_lattices(n, seed=seed)
    return make_batch([lat.to_graph() for lat in lattices], kind_names=("char", "char_words", "word"))


@pytest.mark.parametrize("make", [two_type_batch, lattice_batch, lambda: make_batch(
    [InputGraph(*fig1_graph())] * 3, kind_names=("I", "O", "R"))], ids=["tree_lstm_2type", "lattice", "fig1"])
def test_native_schedule_is_the_numpy_schedule_on_the_bundled_graphs(kernel, make):
    batch = make()
    graph = TypedGraph.of(batch)
    rng = np.random.default_rng(3)
    fsms = [learn([graph], batch.kind_names, enc, Hyper(episodes=100)) for enc in ENCODINGS]
    fsms += [Fsm(enc, batch.kind_names, random_table(graph, enc, rng)) for enc in ENCODINGS]
    assert_same_runs(graph, fsms)
    assert_same_typewise(kernel, graph)
    # through the policies too: the tasks the numpy run gives, vertex for vertex
    fsm = fsms[2]
    for policy, numpy_task in (("agenda", run_agenda(graph, native=False)[0]),
                               ("greedy", run_greedy(graph, native=False)[0])):
        s = get_policy(policy).schedule(batch)
        assert np.array_equal(np.repeat(np.arange(s.num_tasks), s.sizes())[s.row], numpy_task), policy
    assert len(fsm.schedule(graph)[1]) == len(fsm.schedule(graph, native=False)[1])


def test_fig1_hand_derived_task_counts_natively(kernel):
    """ED-Batch's Fig. 1 (tests/runtime/test_frontier.py derives the counts by hand): agenda 7, greedy 6."""
    graph = TypedGraph.of(make_batch([InputGraph(*fig1_graph())], kind_names=("I", "O", "R")))
    assert len(run_agenda(graph)[1]) == 7 and len(run_greedy(graph)[1]) == 6
    assert run_greedy(graph)[1].tolist() == [0, 0, 0, 0, 1, 2]


def test_more_types_than_a_c_table_holds_runs_in_numpy(kernel):
    """An FSM over more than MAX_FSM_TYPES types keeps the numpy run (its state keys would not fit 63 bits)."""
    T = MAX_FSM_TYPES + 2
    children = [[]] * T + [[i, i + 1] for i in range(T - 1)]
    kinds = [f"t{i}" for i in range(T)] + [f"t{i % T}" for i in range(T - 1)]
    names = tuple(f"t{i}" for i in range(T))
    graph = TypedGraph.of(make_batch([InputGraph(children, kinds)], kind_names=names))
    fsm = Fsm("S3", names, {})
    a, b = fsm.schedule(graph, native=False), fsm.schedule(graph)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="1 to 14 types"):
        FsmTable({}, T)
    assert_same_runs(graph)


def test_bad_input_is_refused_before_c(kernel):
    ptr, idx, kind = np.array([0, 0, 1, 3]), np.array([0, 0, 1]), np.array([0, 1, 0])
    table = FsmTable({}, 2)
    task, kinds = kernel.schedule("S3", ptr, idx, kind, 2, table=table)
    assert task.tolist() == [0, 1, 2] and kinds.tolist() == [0, 1, 0]
    bad = {"kind out of range": dict(kind=np.array([0, 2, 0])),
           "negative kind": dict(kind=np.array([0, -1, 0])),
           "kind of wrong length": dict(kind=np.array([0, 1])),
           "child out of range": dict(child_idx=np.array([0, 0, 3])),
           "negative child": dict(child_idx=np.array([0, -1, 1])),
           "ptr too short": dict(child_ptr=np.array([0, 0, 1])),
           "ptr not from 0": dict(child_ptr=np.array([1, 1, 2, 3])),
           "ptr past the edges": dict(child_ptr=np.array([0, 0, 1, 4])),
           "ptr decreasing": dict(child_ptr=np.array([0, 2, 1, 3]))}
    for what, change in bad.items():
        args = dict(child_ptr=ptr, child_idx=idx, kind=kind) | change
        with pytest.raises(ValueError, match="frontier schedule"):
            kernel.schedule("S3", args["child_ptr"], args["child_idx"], args["kind"], 2, table=table)
    with pytest.raises(ValueError, match="unknown frontier rule"):
        kernel.schedule("S4", ptr, idx, kind, 2, table=table)
    with pytest.raises(ValueError, match="FsmTable of 2 types"):
        kernel.schedule("S3", ptr, idx, kind, 2, table=FsmTable({}, 3))
    with pytest.raises(ValueError, match="heights"):
        kernel.schedule("agenda", ptr, idx, kind, 2)
    with pytest.raises(ValueError, match="height values"):
        kernel.schedule("agenda", ptr, idx, kind, 2, height=np.array([0, -1, 2]))
    with pytest.raises(ValueError, match="typewise"):
        kernel.schedule("greedy", ptr, idx, kind, 2)
    with pytest.raises(ValueError, match="typewise parents idx"):
        kernel.schedule("greedy", ptr, idx, kind, 2, typewise=(np.zeros(3), np.array([0, 1, 1, 1]), np.array([5])))
    for state, t in (((2,), 0), ((0,), 2), ((), 0), ((0, 1, 0, 1), 0)):
        with pytest.raises(ValueError, match="not a state of 2 types"):
            FsmTable({state: t}, 2)
    # a cycle (vertex 1 and 2 each other's child) and a table choosing a type with nothing ready
    with pytest.raises(RuntimeError, match="cycle"):
        kernel.schedule("S3", np.array([0, 0, 1, 2]), np.array([2, 1]), kind, 2, table=table)
    with pytest.raises(RuntimeError, match="cycle"):
        kernel.typewise(np.array([0, 0, 1, 2]), np.array([2, 1]), kind, 2)
    with pytest.raises(ValueError, match="frontier schedule: kind"):
        kernel.typewise(ptr, idx, np.array([0, 2, 0]), 2)
    with pytest.raises(RuntimeError, match="no ready vertex"):
        kernel.schedule("S3", ptr, idx, kind, 2, table=FsmTable({(0,): 1}, 2))


def test_without_a_compiler_the_numpy_run_schedules(monkeypatch):
    """No C compiler (CC names none): no kernel, and every frontier policy still schedules (in numpy)."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert frontier_kernel() is None
    batch = two_type_batch(20, seed=7)
    for policy in ("agenda", "greedy", "fsm"):
        assert get_policy(policy).schedule(batch).num_tasks >= 1


def test_typewise_graph_larger_than_its_first_buffer(kernel):
    """A dense one-type DAG has more typewise edges (every edge) than the first guess of room (2n): the C
    call reports the size and runs again."""
    n = 12
    graph = TypedGraph.of(make_batch([InputGraph([list(range(v)) for v in range(n)])]))
    count, ptr, idx = kernel.typewise(graph.child_ptr, graph.child_idx, graph.kind, graph.num_types)
    assert len(idx) == n * (n - 1) // 2 > 2 * n and count.tolist() == list(range(n))
    assert_same_typewise(kernel, graph)
