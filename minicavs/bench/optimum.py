"""How far from the best possible batching a policy is: the optimum of Alg. 1 on one batch, bracketed by search.

The fewest steps (tasks) of ED-Batch's Alg. 1 is NP-hard in general (A.1), and A.3's lower bound can be far
below it. Two searches over type sequences bracket it on a real batch of 64 samples:

- :func:`astar`: A* over the sets of executed vertices, with the lower bound (A.3) of the vertices still to
  run as its heuristic. The bound is admissible and consistent (a step removes at most one vertex of its type
  from any path), so the first complete state popped is an optimum; cut off after ``max_expansions``, the
  smallest f = steps + bound left in the open list is a lower bound on the optimum, at least A.3's.
- :func:`beam`: a beam search over the same states (keeping the ``width`` states with the smallest bound
  left): a schedule, hence an upper bound on the optimum.

A third number bounds learning rather than scheduling: :func:`best_table` runs every table an FSM encoding
can hold (a type for each state) and keeps the fewest tasks. No FSM of that encoding, learned or not, can
schedule those batches in fewer; where this is above a target, the target is out of the encoding's reach.

Used by ``minicavs bench --policies --policy-search N`` to say how many tasks any policy could save.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import numpy as np

from ..runtime.frontier import TypedGraph, levels
from ..runtime.fsm import Fsm, actions


class _Remaining:
    """The lower bound (A.3) of the vertices not yet executed, for many executed sets of one graph."""

    def __init__(self, graph: TypedGraph):
        self.graph = graph
        n = graph.num_vertices
        self.edge_parent = np.repeat(np.arange(n), np.diff(graph.child_ptr))
        self.steps = []
        for level in levels(graph.height)[1:]:
            starts, ends = graph.child_ptr[level], graph.child_ptr[level + 1]
            lens = ends - starts
            pos = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
            self.steps.append((level, graph.child_idx[pos], np.cumsum(lens) - lens))

    def bound(self, done: np.ndarray) -> int:
        g = self.graph
        depth = np.zeros((g.num_vertices, g.num_types), np.int64)
        left = np.flatnonzero(~done)
        depth[left, g.kind[left]] = 1
        for level, children, starts in self.steps:       # every vertex above height 0 has a child
            depth[level] += np.maximum.reduceat(depth[children], starts, axis=0)
        return int(depth.max(axis=0).sum())

    def successors(self, done: np.ndarray):
        """The executed set after running each type with ready vertices."""
        g = self.graph
        waiting = np.bincount(self.edge_parent, weights=~done[g.child_idx], minlength=g.num_vertices)
        ready = ~done & (waiting == 0)
        for t in np.unique(g.kind[ready]).tolist():
            yield done | (ready & (g.kind == t))


def astar(graph: TypedGraph, max_expansions: int = 20000) -> tuple[int, bool]:
    """(optimum, True), or (a lower bound on it, False) when ``max_expansions`` states did not settle it."""
    rem = _Remaining(graph)
    start = np.zeros(graph.num_vertices, bool)
    if graph.num_vertices == 0:
        return 0, True
    heap = [(rem.bound(start), 0, 0, start)]
    best_cost = {start.tobytes(): 0}
    pushed = expanded = 0
    while heap:
        f, cost, _, done = heapq.heappop(heap)
        if cost > best_cost.get(done.tobytes(), cost):
            continue                                   # a stale entry: reached more cheaply since
        if done.all():
            return cost, True
        if expanded == max_expansions:
            return f, False
        expanded += 1
        for new in rem.successors(done):
            key = new.tobytes()
            if best_cost.get(key, cost + 2) <= cost + 1:
                continue
            best_cost[key] = cost + 1
            pushed += 1
            heapq.heappush(heap, (cost + 1 + rem.bound(new), cost + 1, -pushed, new))   # ties: newest first
    raise AssertionError("unreachable: the complete state is always reachable")


def beam(graph: TypedGraph, width: int = 30) -> int:
    """The steps of the best schedule a beam search of ``width`` finds (an upper bound on the optimum)."""
    rem = _Remaining(graph)
    layer, steps = [np.zeros(graph.num_vertices, bool)], 0
    if graph.num_vertices == 0:
        return 0
    while True:
        states = {}
        for done in layer:
            for new in rem.successors(done):
                states.setdefault(new.tobytes(), new)
        steps += 1
        if any(s.all() for s in states.values()):
            return steps
        ranked = sorted(states.values(), key=lambda s: (rem.bound(s), -int(s.sum())))
        layer = ranked[:width]


def encoding_states(num_types: int, encoding: str) -> list[tuple[int, ...]]:
    """Every state ``encoding`` can give a frontier of ``num_types`` types (:func:`minicavs.runtime.fsm.encode`)."""
    states = []
    for size in range(1, num_types + 1):
        for present in itertools.combinations(range(num_types), size):
            if encoding == "S1":
                states.append(present)
            elif encoding == "S2":
                states += [present + (most,) for most in present]
            else:
                states += list(itertools.permutations(present))
    return states


def table_count(num_types: int, encoding: str) -> int:
    """How many distinct tables (one type chosen per state) the encoding has over ``num_types`` types."""
    return int(np.prod([len(actions(s, encoding)) for s in encoding_states(num_types, encoding)], dtype=object))


def best_table(graphs: Sequence[TypedGraph], kind_names: Sequence[str], encoding: str = "S3",
               max_tables: int = 50_000) -> tuple[int, dict] | None:
    """(fewest tasks over ``graphs`` together, one table reaching it as state -> type) among every table of
    ``encoding``; None when there are more than ``max_tables`` (S3 over 3 types has 46,656; over 4, ~10^29)."""
    num_types = len(kind_names)
    if table_count(num_types, encoding) > max_tables:
        return None
    states = encoding_states(num_types, encoding)
    fsm, best = Fsm(encoding, kind_names), None
    for picks in itertools.product(*(actions(s, encoding) for s in states)):
        fsm.set_best(dict(zip(states, picks)))
        tasks = sum(len(fsm.schedule(g)[1]) for g in graphs)
        if best is None or tasks < best[0]:
            best = (tasks, fsm.best)
    return best
