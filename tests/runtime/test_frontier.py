"""Batching policies (cavs/depth, agenda, greedy, fsm) run over the typed frontier (minicavs/runtime/frontier.py)
and ED-Batch's lower bound, against hand-derived optima and a brute-force search over all type orders (an
independent reference)."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.data.lattice import Lattice
from minicavs.data.synthetic import synthetic_treebank
from minicavs.data.trees import two_type_kinds
from minicavs.runtime.frontier import TypedGraph, typewise_children
from minicavs.runtime.fsm import Hyper
from minicavs.runtime.inputs import InputGraph, make_batch
from minicavs.runtime.scheduler import FsmPolicy, Schedule, get_policy, lower_bound

from ..engine.test_alg1 import CASES, assert_same, run_case

POLICIES = ("cavs", "depth", "agenda", "greedy", "fsm")


def make(policy: str):
    """The policy by name; an FSM learns briefly (100 episodes) so that property tests stay fast."""
    return FsmPolicy(hyper=Hyper(episodes=100)) if policy == "fsm" else get_policy(policy)


def brute_force_optimum(children, kinds) -> int:
    """Fewest steps of Alg. 1 (run every ready vertex of one chosen type) over all type orders: BFS over
    the sets of executed vertices (bit masks)."""
    n = len(children)
    child_mask = [functools.reduce(lambda m, c: m | (1 << c), ch, 0) for ch in children]
    full, seen, layer, steps = (1 << n) - 1, {0}, [0], 0
    while full not in seen:
        nxt = []
        for done in layer:
            ready = [v for v in range(n) if not done >> v & 1 and child_mask[v] & ~done == 0]
            for t in {kinds[v] for v in ready}:
                new = done | functools.reduce(lambda m, v: m | (1 << v), [v for v in ready if kinds[v] == t], 0)
                if new not in seen:
                    seen.add(new)
                    nxt.append(new)
        layer, steps = nxt, steps + 1
    return steps


def lower_bound_by_recursion(children, kinds) -> int:
    """A.3 written directly: sum over types of the most vertices of that type on one path."""
    @functools.lru_cache(None)
    def d(v, t):
        return (kinds[v] == t) + max((d(c, t) for c in children[v]), default=0)
    return sum(max(d(v, t) for v in range(len(children))) for t in set(kinds))


def assert_valid(batch, s: Schedule):
    """Each vertex once, each task one kind, each vertex after all its children."""
    assert sorted(s.order.tolist()) == list(range(batch.num_vertices))
    assert np.array_equal(s.row[s.order], np.arange(batch.num_vertices))
    task_of = np.repeat(np.arange(s.num_tasks), s.sizes())[s.row]
    for t in range(s.num_tasks):
        assert set(batch.kind[s.task(t)].tolist()) == {int(s.task_kind[t])}
    for v in range(batch.num_vertices):
        for c in batch.child_idx[batch.child_ptr[v]:batch.child_ptr[v + 1]]:
            assert task_of[c] < task_of[v]


def fig1_graph():
    """ED-Batch's Fig. 1 on a left-deep parse tree: tree vertices I (leaves a-d, n1 = (a, b), n2 = (n1, c),
    n3 = (n2, d)), an output vertex O on each I vertex, one reduction R over all outputs."""
    tree = ["a", "b", "c", "d", "n1", "n2", "n3"]
    below = {"n1": ["a", "b"], "n2": ["n1", "c"], "n3": ["n2", "d"]}
    names = tree + ["o_" + v for v in tree] + ["r"]
    at = {v: i for i, v in enumerate(names)}
    children = [[at[c] for c in below.get(v, [])] for v in tree] + [[at[v]] for v in tree] + \
        [[at["o_" + v] for v in tree]]
    kinds = ["I"] * 7 + ["O"] * 7 + ["R"]
    return children, kinds


def small_lattice():
    """5 characters c0..c4, words spanning c0-c2, c1-c3 and c2-c4 (the generator's graph)."""
    lat = Lattice(np.arange(5), [(0, 2, 0), (1, 3, 1), (2, 4, 2)], np.zeros(5, np.int64))
    g = lat.to_graph()
    return [g.children(v).tolist() for v in range(g.num_vertices)], list(g.kinds)


# Hand derivations.
# Fig. 1: heights I 0..3 (a-d 0, n1 1, n2 2, n3 3), O 1..4, R 5.
#   depth/cavs: one task per (height, kind): I0 | I1 O1 | I2 O2 | I3 O3 | O4 | R5 = 9.
#   lower bound: 4 I's on the path a-n1-n2-n3, one O and one R on any path: 4 + 1 + 1 = 6, and the order
#   I I I I O R reaches it, so the optimum is 6.
#   agenda after the leaves: unexecuted I depths n1 1, n2 2, n3 3 (avg 2); O depths 1,1,1,1,2,3,4 (avg
#   13/7 < 2), so it runs the 4 leaf outputs early: I O I I I O R = 7.
#   greedy: after the leaves the O ratio is 4 ready / 7 on G[O]'s frontier, I's is 1/1: I I I I O R = 6.
# Small lattice: kinds C (char: c0, c1), M (char_words: c2, c3, c4, where words end), W (w02, w13, w24); heights
#   c0 0, c1 1, w02 1, c2 2, w13 2, c3 3, w24 3, c4 4.
#   cavs by (height, kind): C0 | C1 W1 | M2 W2 | M3 W3 | M4 = 8 tasks.
#   lower bound: 2 C on the chain c0-c1-c2-c3-c4, 3 M (c2, c3, c4), 2 W on c0-w02-c2-w24-c4: 7; reached by
#   C(c0) C(c1) W(w02, w13) M(c2) W(w24) M(c3) M(c4), so the optimum is 7.
#   agenda: after c0, c1 (C avg depth 1) beats w02 (W avg (1+2+3)/3 = 2); then W runs w02 and w13; M (c2) is
#   all that is ready; then W (w24 at 3) beats M (c3, c4 avg 3.5); then c3, c4: 7 tasks.
#   greedy (Eq. 1 ratios; G[M]: c3 -> c2, c4 -> c3 and c2 (through w24); G[W]: w24 -> w02): C 1/1; C 1/1 vs
#   W 1/2; W 2/2; M 1/1; then M c3 1/1 ties W w24 1/1, the lower id (M) runs; W; M: 7 tasks.
HAND = {"fig1": (fig1_graph, ("I", "O", "R"), {"cavs": 9, "depth": 9, "agenda": 7, "greedy": 6, "fsm": 6}, 6, 6),
        "lattice": (small_lattice, ("char", "char_words", "word"),
                    {"cavs": 8, "depth": 8, "agenda": 7, "greedy": 7, "fsm": 7},
                    7, 7)}


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_built_graphs(name):
    make, kind_names, expected, optimum, bound = HAND[name]
    children, kinds = make()
    assert brute_force_optimum(children, kinds) == optimum
    assert lower_bound_by_recursion(children, kinds) == bound
    for copies in (1, 3):   # several samples of the same graph batch the same way
        batch = make_batch([InputGraph(children, kinds)] * copies, kind_names=kind_names)
        assert lower_bound(batch) == bound
        for policy, tasks in expected.items():
            s = get_policy(policy).schedule(batch)
            assert_valid(batch, s)
            assert s.num_tasks == tasks, policy


def test_depth_is_cavs():
    trees = synthetic_treebank(20, seed=4)
    batch = make_batch([InputGraph(t.children, two_type_kinds(t, 3, i)) for i, t in enumerate(trees)],
                       kind_names=("leaf", "cell_a", "cell_b"))
    a, b = get_policy("cavs").schedule(batch), get_policy("depth").schedule(batch)
    assert np.array_equal(a.order, b.order) and np.array_equal(a.task_ptr, b.task_ptr)


@st.composite
def typed_dags(draw, max_vertices=11, max_graphs=3, max_types=3, max_children=3, repeats=False):
    """1-``max_graphs`` random DAGs (children among earlier vertices; ``repeats``: a child may be listed twice)
    with 1-``max_types`` types, at most ``max_vertices`` vertices in all."""
    num_types = draw(st.integers(1, max_types))
    graphs, total = [], 0
    for _ in range(draw(st.integers(1, max_graphs))):
        n = draw(st.integers(1, max(1, max_vertices - total)))
        if total + n > max_vertices:
            break
        children = [draw(st.lists(st.integers(0, v - 1), max_size=max_children)) if v else [] for v in range(n)]
        children = children if repeats else [sorted(set(c)) for c in children]
        kinds = [f"t{draw(st.integers(0, num_types - 1))}" for _ in range(n)]
        graphs.append(InputGraph(children, kinds))
        total += n
    return graphs, tuple(f"t{i}" for i in range(num_types))


@settings(max_examples=60, deadline=None)
@given(typed_dags())
def test_no_policy_beats_the_lower_bound_or_the_optimum(case):
    graphs, names = case
    batch = make_batch(graphs, kind_names=names)
    children = [batch.child_idx[batch.child_ptr[v]:batch.child_ptr[v + 1]].tolist()
                for v in range(batch.num_vertices)]
    kinds = batch.kind.tolist()
    bound = lower_bound(batch)
    assert bound == lower_bound_by_recursion(children, kinds)
    optimum = brute_force_optimum(children, kinds)
    assert bound <= optimum
    for policy in POLICIES:
        s = make(policy).schedule(batch)
        assert_valid(batch, s)
        assert s.num_tasks >= optimum, policy


@settings(max_examples=40, deadline=None)
@given(typed_dags(max_vertices=30))
def test_typewise_children_are_the_nearest_same_type_descendants(case):
    graphs, names = case
    batch = make_batch(graphs, kind_names=names)
    ptr, idx = typewise_children(batch.child_ptr, batch.child_idx, batch.kind, batch.height)
    for v in range(batch.num_vertices):
        expected, stack, seen = set(), list(batch.child_idx[batch.child_ptr[v]:batch.child_ptr[v + 1]]), set()
        while stack:   # depth-first below v, stopping at vertices of v's type
            u = int(stack.pop())
            if u in seen:
                continue
            seen.add(u)
            if batch.kind[u] == batch.kind[v]:
                expected.add(u)
            else:
                stack.extend(batch.child_idx[batch.child_ptr[u]:batch.child_ptr[u + 1]].tolist())
        assert sorted(idx[ptr[v]:ptr[v + 1]].tolist()) == sorted(expected)


def two_type_batch(n=40, seed=5):
    trees = synthetic_treebank(n, seed=seed)
    return make_batch([InputGraph(t.children, two_type_kinds(t, seed, i)) for i, t in enumerate(trees)],
                      kind_names=("leaf", "cell_a", "cell_b"))


def test_learned_fsm_saved_and_reloaded_gives_the_same_schedule(tmp_path):
    learn_on, apply_to = two_type_batch(30, seed=5), two_type_batch(40, seed=6)
    policy = FsmPolicy(encoding="S3", hyper=Hyper(episodes=200))
    fsm = policy.learn([learn_on])
    assert fsm.stats["episodes"] >= 50 and fsm.stats["batches"] >= fsm.stats["lower_bound"]
    policy.save(tmp_path / "fsm.json")
    again = FsmPolicy.load(tmp_path / "fsm.json")
    a, b = policy.schedule(apply_to), again.schedule(apply_to)
    assert np.array_equal(a.order, b.order) and np.array_equal(a.task_ptr, b.task_ptr)
    assert np.array_equal(a.task_kind, b.task_kind)
    assert_valid(apply_to, a)
    assert a.num_tasks <= get_policy("cavs").schedule(apply_to).num_tasks


@pytest.mark.parametrize("name", ["binary_tree_lstm", "child_sum_dag", "chain_lstm"])
@pytest.mark.parametrize("policy", POLICIES[1:])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5), size=st.integers(1, 6))
def test_batched_equals_serial_for_every_policy(name, policy, seed, k, size):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(seed)
    case = build(rng)
    graphs = [make_graph(rng, int(rng.integers(1, size + 1))) for _ in range(k)]
    state = rng.bit_generator.state
    batched, _ = run_case(case, graphs, rng, policy=make(policy))
    rng.bit_generator.state = state
    serial, _ = run_case(case, graphs, rng, policy="serial")
    assert_same(batched, serial)


def test_typed_graph_of_a_batch_keeps_its_arrays():
    batch = two_type_batch(5)
    g = TypedGraph.of(batch)
    assert g.num_types == 3 and g.kind is batch.kind and g.lower_bound() == lower_bound(batch)


@settings(max_examples=30, deadline=None)
@given(typed_dags(max_vertices=25))
def test_one_kind_shortcut_is_what_the_frontier_gives(case):
    """With one kind, agenda/greedy/fsm return cavs's schedule directly; the frontier run agrees."""
    from minicavs.runtime.frontier import Frontier, run_policy
    graphs, _ = case
    batch = make_batch([InputGraph([g.children(v).tolist() for v in range(g.num_vertices)]) for g in graphs])
    task, _ = run_policy(Frontier(TypedGraph.of(batch)), lambda f: 0)
    assert np.array_equal(task, batch.height)
    cavs = get_policy("cavs").schedule(batch)
    for policy in ("agenda", "greedy", "fsm"):
        s = get_policy(policy).schedule(batch)
        assert np.array_equal(s.order, cavs.order) and np.array_equal(s.task_ptr, cavs.task_ptr)
    # leaf/internal kinds (the childless vertices one kind, the rest another): the frontier runs cavs's tasks
    # whatever the policy picks, since only one kind is ever ready
    kinds = [["leaf" if not len(g.children(v)) else "internal" for v in range(g.num_vertices)] for g in graphs]
    batch = make_batch([InputGraph([g.children(v).tolist() for v in range(g.num_vertices)], k)
                        for g, k in zip(graphs, kinds)], kind_names=("leaf", "internal"))
    cavs = get_policy("cavs").schedule(batch)
    task, _ = run_policy(Frontier(TypedGraph.of(batch)), lambda f: int(np.flatnonzero(f.counts)[0]))
    assert np.array_equal(task, np.repeat(np.arange(cavs.num_tasks), cavs.sizes())[cavs.row])
    for policy in ("agenda", "greedy", "fsm"):
        s = get_policy(policy).schedule(batch)
        assert np.array_equal(s.order, cavs.order) and np.array_equal(s.task_ptr, cavs.task_ptr)
