"""Input graphs are validated when they are made, by both constructors alike; ids are integers."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.core.errors import InputGraphError
from minicavs.runtime.inputs import InputGraph, make_batch


def test_from_csr_that_would_join_two_samples_is_rejected():
    """Sample 0 claims 3 child ids but holds 2, sample 1 claims none but holds 1: batched unchecked, the
    third id became an edge from sample 0's vertex 2 into sample 1."""
    with pytest.raises(InputGraphError, match=r"child_ptr ends at 3, but there are 2 child ids"):
        make_batch([InputGraph.from_csr([0, 0, 0, 3], [0, 1]), InputGraph.from_csr([0, 0, 0], [0])])
    with pytest.raises(InputGraphError, match=r"child_ptr ends at 0, but there are 1 child ids"):
        InputGraph.from_csr([0, 0, 0], [0])


@pytest.mark.parametrize("ptr, idx, match", [
    ([1, 1, 2], [0], r"child_ptr must start at 0, got \[1\]"),
    ([], [], r"child_ptr must start at 0, got nothing"),
    ([0, 2, 1, 2], [0, 1], r"vertex 1: child_ptr decreases from 2 to 1"),
    ([0, 0, 1.5], [0], r"child_ptr entry 1.5 at position 2 is not an int64 integer"),
    (np.array([0, 0, 1.5]), [0], r"child_ptr entry dtype float64 is not an integer type \(first non-integer 1.5 at "
                                 r"position 2\)"),
    ([0, 0, 1], [0.9], r"child id 0.9 at position 0 is not an int64 integer"),
    ([0, 0, 1], np.array([0.0]), r"child id dtype float64 is not an integer type"),
    ([0, 0, 1], np.array([True]), r"child id dtype bool is not an integer type"),
    ([0, 0, 1], [True], r"child id True at position 0 is not an int64 integer"),
    ([0, 0, 1], np.array([2 ** 63], np.uint64), r"vertex 1: child 0 id 9223372036854775808 out of range for a graph "
                                                 r"of 2 vertices"),
    ([0, 0, 1], [2 ** 64], r"child id 18446744073709551616 at position 0 is not an int64 integer"),
    ([0, 0, 1], np.array([[0]]), r"child id array of shape \(1, 1\), need \(any,\)"),
])
def test_from_csr_validates(ptr, idx, match):
    with pytest.raises(InputGraphError, match=match):
        InputGraph.from_csr(ptr, idx)


@pytest.mark.parametrize("children, match", [
    ([[], [0.9]], r"vertex 1: child 0 is 0.9, not an integer vertex id"),
    ([[], [np.float64(1.0)]], r"vertex 1: child 0 is 1.0, not an integer vertex id"),
    ([[], [True]], r"vertex 1: child 0 is True, not an integer vertex id"),
    ([[], ["0"]], r"vertex 1: child 0 is '0', not an integer vertex id"),
    ([[], [0, None]], r"vertex 1: child 1 is None, not an integer vertex id"),
    ([[], [2 ** 63]], r"vertex 1: child 0 id 9223372036854775808 out of range for a graph of 2 vertices"),
    ([[], [-2 ** 63 - 1]], r"vertex 1: child 0 id -9223372036854775809 out of range"),
    ([[], 0], r"vertex 1: its children must be a list of child ids, got 0"),
    ("ab", r"children must be a list with one list of child ids per vertex"),
])
def test_constructor_rejects_non_integer_ids(children, match):
    with pytest.raises(InputGraphError, match=match):
        InputGraph(children)


@given(st.lists(st.lists(st.integers(-2 ** 63, 2 ** 63 - 1), max_size=4).map(
    lambda ids: ids if len(ids) % 2 else tuple(ids)), max_size=12))
@settings(max_examples=60, deadline=None)
def test_lists_of_ints_give_the_csr_arrays_of_their_ids(children):
    """The bulk path for lists and tuples of ints keeps each vertex's ids in order, as the per-id path does."""
    g = InputGraph(children)
    assert g.num_vertices == len(children)
    assert g.child_ptr.tolist() == [sum(len(ch) for ch in children[:v]) for v in range(len(children) + 1)]
    assert g.child_idx.tolist() == [x for ch in children for x in ch] and g.child_idx.dtype == np.int64
    assert not g.child_ptr.flags.writeable and not g.child_idx.flags.writeable


@given(st.lists(st.lists(st.lists(st.integers(-2 ** 63, 2 ** 63 - 1), max_size=3), max_size=5), max_size=6),
       st.booleans())
@settings(max_examples=60, deadline=None)
def test_many_graphs_at_once_equal_one_at_a_time(children_of, with_kinds):
    kinds_of = [[f"k{v % 2}" for v in range(len(ch))] for ch in children_of] if with_kinds else None
    graphs = InputGraph.many(children_of, kinds_of)
    assert len(graphs) == len(children_of)
    for i, (g, children) in enumerate(zip(graphs, children_of)):
        one = InputGraph(children, kinds_of[i] if with_kinds else None)
        assert g.child_ptr.tolist() == one.child_ptr.tolist() and g.child_idx.tolist() == one.child_idx.tolist()
        assert g.num_vertices == one.num_vertices and g.kinds == one.kinds
        assert g.child_idx.dtype == np.int64 and not g.child_ptr.flags.writeable and not g.child_idx.flags.writeable


@pytest.mark.parametrize("children_of, kinds_of, match", [
    ([[[]], [[], [0.5]]], None, r"vertex 1: child 0 is 0.5, not an integer vertex id"),
    ([[[]], [[], [2 ** 63]]], None, r"vertex 1: child 0 id 9223372036854775808 out of range"),
    ([[[]], "ab"], None, r"children must be a list with one list of child ids per vertex"),
    ([[[]], [[], [0]]], [["leaf"], ["leaf"]], r"1 kinds for 2 vertices"),
    ([[[]]], [["leaf"], ["leaf"]], r"InputGraph.many: 2 kind lists for 1 graphs"),
])
def test_many_graphs_refused_in_bulk_get_the_constructors_errors(children_of, kinds_of, match):
    with pytest.raises(InputGraphError, match=match):
        InputGraph.many(children_of, kinds_of)


@pytest.mark.parametrize("children, match", [
    ([(0,), (0, True)], r"vertex 1: child 1 is True"),
    ([[], (0, 2 ** 63)], r"vertex 1: child 1 id 9223372036854775808 out of range"),
    ([[], [0], (0, 1.0)], r"vertex 2: child 1 is 1.0, not an integer vertex id"),
])
def test_lists_that_the_bulk_path_refuses_get_the_per_id_errors(children, match):
    with pytest.raises(InputGraphError, match=match):
        InputGraph(children)


def test_numpy_integer_ids_and_empty_graph_parts_are_fine():
    g = InputGraph([np.array([], np.int64), np.array([0], np.int32), [np.uint8(0), np.int64(1)], iter([2])])
    assert g.child_ptr.tolist() == [0, 0, 1, 3, 4] and g.child_idx.tolist() == [0, 0, 1, 2]
    h = InputGraph.from_csr(np.array([0, 0, 1], np.uint32), np.array([0], np.uint64))
    assert h.child_idx.dtype == np.int64 and h.child_idx.tolist() == [0]
    assert InputGraph.from_csr([0], []).num_vertices == 0


def test_graph_arrays_are_checked_copies():
    ptr, idx = np.array([0, 0, 1]), np.array([0])
    g = InputGraph.from_csr(ptr, idx)
    idx[0] = 5   # the caller's array changes; the graph does not
    assert g.child_idx.tolist() == [0]
    with pytest.raises(ValueError, match="read-only"):
        g.child_idx[0] = 7


@pytest.mark.parametrize("kinds, match", [
    (["leaf"], r"1 kinds for 2 vertices"),
    ("li", r"kinds must be a list of strings, one per vertex"),
    (["leaf", 1], r"vertex 1: kind 1 is not a string"),
    ([None, "leaf"], r"vertex 0: kind None is not a string"),
])
def test_kinds_are_one_string_per_vertex(kinds, match):
    with pytest.raises(InputGraphError, match=match):
        InputGraph([[], [0]], kinds=kinds)
    with pytest.raises(InputGraphError, match=match):
        InputGraph.from_csr([0, 0, 1], [0], kinds=kinds)


def test_range_and_cycles_still_name_the_sample():
    with pytest.raises(InputGraphError, match=r"sample 1, vertex 1: child index 2 out of range"):
        make_batch([InputGraph([[]]), InputGraph.from_csr([0, 0, 1], [2])])
    with pytest.raises(InputGraphError, match=r"sample 0, vertex 1: lists itself"):
        make_batch([InputGraph.from_csr([0, 0, 1], [1])])


def test_heights_kernel_equals_the_numpy_levels(monkeypatch):
    """The C kernel (one call) and the level-by-level numpy loop give the same heights, cycles included."""
    from minicavs.runtime import inputs
    from minicavs.ops.registry import native_kernels
    from ..engine.test_alg1 import random_dag, random_tree
    if native_kernels(np, np.float64) is None:
        pytest.skip("no C compiler: only the numpy loop exists")
    rng = np.random.default_rng(11)
    for trial in range(60):
        g = (random_dag if trial % 2 else random_tree)(rng, int(rng.integers(1, 40)), 3)
        b = make_batch([g, g])
        args = (b.child_ptr, b.child_idx, b.num_vertices, str)
        native = inputs._heights(*args)
        with monkeypatch.context() as m:
            m.setattr(inputs, "native_kernels", lambda xp, dtype: None)
            assert (native == inputs._heights(*args)).all()
    ptr, idx = np.array([0, 1, 2, 2]), np.array([1, 0])   # 0 -> 1 -> 0 is a cycle, 2 is a leaf
    with pytest.raises(InputGraphError, match="cycle"):
        inputs._heights(ptr, idx, 3, lambda v: f"vertex {v}")


@pytest.mark.parametrize("depth", [1, 2, 500, 5_000, 100_000])
def test_from_nested_takes_any_depth(depth):
    """Nested tuples are user data: no recursion, so a 100,000-level tree converts like a small one."""
    from collections import deque
    tree, leaves = "z", deque(["z"])     # the leaves left to right
    for i in range(depth):               # a new leaf on alternate sides
        tree = (f"a{i}", tree) if i % 2 else (tree, f"a{i}")
        leaves.appendleft(f"a{i}") if i % 2 else leaves.append(f"a{i}")
    graph, payloads = InputGraph.from_nested(tree)
    assert graph.num_vertices == 2 * depth + 1 and graph.roots().tolist() == [2 * depth]
    assert [p for p in payloads if p is not None] == list(leaves)
    assert make_batch([graph]).num_vertices == 2 * depth + 1
