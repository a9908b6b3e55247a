"""The optimum searches of `bench --policies --policy-search` against the brute-force optimum."""
from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minicavs.bench.optimum import astar, beam, best_table, encoding_states, table_count
from minicavs.runtime.frontier import TypedGraph
from minicavs.runtime.fsm import ENCODINGS, Fsm, actions, encode
from minicavs.runtime.inputs import InputGraph, make_batch

from ..runtime.test_frontier import HAND, brute_force_optimum, typed_dags


@settings(max_examples=60, deadline=None)
@given(typed_dags())
def test_astar_finds_the_optimum_and_a_cut_off_search_a_lower_bound(case):
    graphs, names = case
    batch = make_batch(graphs, kind_names=names)
    children = [batch.child_idx[batch.child_ptr[v]:batch.child_ptr[v + 1]].tolist()
                for v in range(batch.num_vertices)]
    optimum = brute_force_optimum(children, batch.kind.tolist())
    graph = TypedGraph.of(batch)
    assert astar(graph) == (optimum, True)
    low, exact = astar(graph, max_expansions=1)
    assert graph.lower_bound() <= low <= optimum and (not exact or low == optimum)
    assert beam(graph, width=1) >= optimum and beam(graph, width=50) >= optimum


def test_hand_built_graphs():
    for make, names, _, optimum, _ in HAND.values():
        children, kinds = make()
        graph = TypedGraph.of(make_batch([InputGraph(children, kinds)] * 3, kind_names=names))
        assert astar(graph) == (optimum, True) and beam(graph) == optimum


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.sampled_from(ENCODINGS))
def test_every_state_an_encoding_gives_is_searched(counts, encoding):
    """A state missing from the search would leave it to the fallback rule: the search would not be exhaustive."""
    assume(any(counts))
    assert encode(np.array(counts), encoding) in encoding_states(len(counts), encoding)


def test_table_counts():
    assert len(encoding_states(3, "S3")) == 15 and table_count(3, "S3") == 2 ** 6 * 3 ** 6
    assert len(encoding_states(3, "S1")) == 7 and table_count(3, "S1") == 2 ** 3 * 3
    assert len(encoding_states(3, "S2")) == 3 + 6 + 3 and table_count(3, "S2") == 2 ** 6 * 3 ** 3
    assert best_table([], ("a", "b", "c", "d"), "S3") is None                     # ~10^29 tables: refused


@settings(max_examples=25, deadline=None)
@given(typed_dags(max_vertices=8, max_graphs=2, max_types=3))
def test_best_table_between_the_optimum_and_every_table_tried(case):
    """S2 here (1,728 tables over 3 types; S3's 46,656 are tried on ED-Batch's Fig. 1 below): the same search."""
    graphs, names = case
    batch = make_batch(graphs, kind_names=names)
    graph = TypedGraph.of(batch)
    children = [batch.child_idx[batch.child_ptr[v]:batch.child_ptr[v + 1]].tolist()
                for v in range(batch.num_vertices)]
    tasks, table = best_table([graph], names, "S2")
    fsm = Fsm("S2", names)
    fsm.set_best(table)                                               # the table found: its count reproduced
    assert len(fsm.schedule(graph, native=False)[1]) == tasks
    assert brute_force_optimum(children, batch.kind.tolist()) <= tasks
    assert tasks <= len(Fsm("S2", names).schedule(graph)[1])          # the empty table (the fallback rule)
    rng = np.random.default_rng(tasks)
    states = encoding_states(len(names), "S2")
    for _ in range(5):                                                # no random table does better
        pick = Fsm("S2", names, {s: rng.random(len(actions(s, "S2"))).tolist() for s in states})
        assert tasks <= len(pick.schedule(graph)[1])


def test_best_table_reaches_the_optimum_of_ed_batch_fig1():
    """The fallback (an empty S3 table) needs 8 tasks here; some S3 table needs the optimum's 6."""
    make, names, _, optimum, _ = HAND["fig1"]
    children, kinds = make()
    graph = TypedGraph.of(make_batch([InputGraph(children, kinds)] * 2, kind_names=names))
    assert best_table([graph], names, "S3")[0] == optimum
