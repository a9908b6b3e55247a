"""The optimum searches of `bench --policies --policy-search` against the brute-force optimum."""
from __future__ import annotations

from hypothesis import given, settings

from minicavs.bench.optimum import astar, beam
from minicavs.frontier import TypedGraph
from minicavs.inputs import InputGraph, make_batch

from .test_policies import HAND, brute_force_optimum, typed_dags


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
