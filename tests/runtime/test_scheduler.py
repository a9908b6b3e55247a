"""Input graphs, batches and batching policies: structure checked on random trees, chains and DAGs."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.core.errors import InputGraphError
from minicavs.runtime.inputs import InputGraph, make_batch
from minicavs.runtime.memory import plan_memory
from minicavs.engine.model import leaf_internal
from minicavs.runtime.scheduler import CavsPolicy, SerialPolicy, get_policy

from ..engine.test_alg1 import random_dag, random_tree


def heights_by_recursion(g: InputGraph) -> list[int]:
    memo = {}

    def h(v):
        if v not in memo:
            ch = g.children(v)
            memo[v] = 0 if len(ch) == 0 else 1 + max(h(int(c)) for c in ch)
        return memo[v]
    return [h(v) for v in range(g.num_vertices)]


graphs_strategy = st.lists(
    st.tuples(st.sampled_from(["tree", "chain", "dag", "binary"]), st.integers(1, 12), st.integers(0, 2**31)),
    min_size=1, max_size=6)


def build(specs):
    out = []
    for kind, n, seed in specs:
        rng = np.random.default_rng(seed)
        out.append({"tree": lambda: random_tree(rng, n, 3), "chain": lambda: InputGraph.chain(n),
                    "dag": lambda: random_dag(rng, n, 3),
                    "binary": lambda: random_tree(rng, n, 2, full_binary=True)}[kind]())
    return out


@settings(max_examples=60, deadline=None)
@given(graphs_strategy)
def test_flattening_and_heights(specs):
    graphs = build(specs)
    b = make_batch(graphs)
    assert b.num_vertices == sum(g.num_vertices for g in graphs)
    for k, g in enumerate(graphs):
        off = b.offsets[k]
        assert np.all(b.sample[off:off + g.num_vertices] == k)
        assert np.all(b.local[off:off + g.num_vertices] == np.arange(g.num_vertices))
        for v in range(g.num_vertices):
            got = b.child_idx[b.child_ptr[off + v]:b.child_ptr[off + v + 1]]
            assert got.tolist() == (g.children(v) + off).tolist()   # order of children kept
        assert b.height[off:off + g.num_vertices].tolist() == heights_by_recursion(g)
    pptr, pidx = b.parents_csr()
    for v in range(b.num_vertices):
        for c in b.child_idx[b.child_ptr[v]:b.child_ptr[v + 1]]:
            assert v in pidx[pptr[c]:pptr[c + 1]]


@settings(max_examples=60, deadline=None)
@given(graphs_strategy, st.booleans())
def test_policies_partition_and_respect_dependencies(specs, two_kinds):
    b = make_batch(build(specs))
    if two_kinds:
        b = b.with_kinds(*leaf_internal(b))
    for policy in (CavsPolicy(), SerialPolicy()):
        s = policy.schedule(b)
        assert sorted(s.order.tolist()) == list(range(b.num_vertices))         # a partition
        assert np.array_equal(s.row[s.order], np.arange(b.num_vertices))     # row inverts order
        task_of = np.repeat(np.arange(s.num_tasks), s.sizes())[s.row]
        for v in range(b.num_vertices):
            for c in b.child_idx[b.child_ptr[v]:b.child_ptr[v + 1]]:
                assert task_of[c] < task_of[v]                                # children run earlier
        for t in range(s.num_tasks):
            assert len(set(b.kind[s.task(t)].tolist())) == 1 and b.kind[s.task(t)][0] == s.task_kind[t]
    s = CavsPolicy().schedule(b)
    if not two_kinds:
        assert s.num_tasks == b.height.max() + 1
        for t in range(s.num_tasks):
            assert np.all(b.height[s.task(t)] == t)
    else:
        pairs = {(int(b.height[v]), int(b.kind[v])) for v in range(b.num_vertices)}
        assert s.num_tasks == len(pairs)
    assert SerialPolicy().schedule(b).num_tasks == b.num_vertices


@pytest.mark.parametrize("graphs, match", [
    ([], "empty batch"),
    ([InputGraph([[]]), InputGraph([])], "sample 1: empty graph"),
    ([InputGraph([[], [2]])], r"sample 0, vertex 1: child index 2 out of range"),
    ([InputGraph([[], [-1]])], r"sample 0, vertex 1: child index -1 out of range"),
    ([InputGraph([[], [1]])], r"sample 0, vertex 1: lists itself"),
    ([InputGraph([[]]), InputGraph([[], [2], [3], [1]])], r"sample 1, vertex [123]: lies on a cycle"),
])
def test_bad_graphs(graphs, match):
    with pytest.raises(InputGraphError, match=match):
        make_batch(graphs)


def test_arity_and_kinds():
    g = InputGraph([[], [], [], [0, 1, 2]], kinds=["leaf", "leaf", "leaf", "internal"])
    with pytest.raises(InputGraphError, match=r"sample 0, vertex 3: 3 children, more than the arity 2"):
        make_batch([g], max_arity={"internal": 2})
    b = make_batch([g, InputGraph([[]], kinds=["leaf"])], kind_names=["leaf", "internal"])
    assert b.kind.tolist() == [0, 0, 0, 1, 0] and b.kind_names == ("leaf", "internal")
    with pytest.raises(InputGraphError, match="unknown kind 'internal'"):
        make_batch([g], kind_names=["leaf"])
    with pytest.raises(ValueError, match="choose one of"):
        get_policy("fifo")


def test_constructors():
    t, payload = InputGraph.from_nested((("a", "b"), "c"))
    assert [t.children(v).tolist() for v in range(5)] == [[], [], [0, 1], [], [2, 3]]
    assert payload == ["a", "b", None, "c", None] and t.roots().tolist() == [4]
    c = InputGraph.complete_binary_tree(4)
    assert c.num_vertices == 7 and c.children(6).tolist() == [4, 5] and heights_by_recursion(c)[6] == 2
    assert InputGraph.chain(3).children(2).tolist() == [1]
    with pytest.raises(InputGraphError):
        InputGraph.complete_binary_tree(6)


def test_memory_plan_rows():
    #  tree 0: 2 <- (0, 1); tree 1: a single vertex; DAG-free so the plan is a forest
    b = make_batch([InputGraph([[], [], [0, 1]]), InputGraph([[]])])
    b = b.with_kinds(*leaf_internal(b))
    s = CavsPolicy().schedule(b)
    plan = plan_memory(b, s, {"leaf": 0, "internal": 2}, {"leaf": ("x",)}, {"leaf": ("h",), "internal": ("h",)},
                       sample_ids=[10, 11])
    leaf, internal = plan.kinds
    assert leaf.vertices.tolist() == [0, 1, 3] and internal.vertices.tolist() == [2]
    assert internal.child_rows[0].tolist() == [s.row[0]] and internal.child_rows[1].tolist() == [s.row[1]]
    assert leaf.pull_rows["x"].tolist() == [0, 1, 2] and plan.pull_rows["x"] == 3
    assert plan.push_order["h"].tolist() == [0, 1, 2, 3] and internal.push_rows["h"].tolist() == [2]
    assert plan.tasks == [(0, 0, 3, 0), (1, 0, 1, 3)]
    assert leaf.row_keys.tolist() == [(10 << 32) | 0, (10 << 32) | 1, (11 << 32) | 0]
    assert plan.forest
    dag = make_batch([InputGraph([[], [0], [0, 1]])])
    assert not plan_memory(dag, CavsPolicy().schedule(dag), {"vertex": 2}, {}, {}).forest
    missing = make_batch([InputGraph([[], [0]])])
    p2 = plan_memory(missing, CavsPolicy().schedule(missing), {"vertex": 2}, {}, {})
    assert p2.kinds[0].child_rows[1].tolist() == [2, 2]   # both vertices lack child 1: the zero row N
