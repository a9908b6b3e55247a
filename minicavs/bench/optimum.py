"""How far from the best possible batching a policy is: the optimum of Alg. 1 on one batch, bracketed by search.

The fewest steps (tasks) of ED-Batch's Alg. 1 is NP-hard in general (A.1), and A.3's lower bound can be far
below it. Two searches over type sequences bracket it on a real batch of 64 samples:

- :func:`astar`: A* over the sets of executed vertices, with the lower bound (A.3) of the vertices still to
  run as its heuristic. The bound is admissible and consistent (a step removes at most one vertex of its type
  from any path), so the first complete state popped is an optimum; cut off after ``max_expansions``, the
  smallest f = steps + bound left in the open list is a lower bound on the optimum, at least A.3's.
- :func:`beam`: a beam search over the same states (keeping the ``width`` states with the smallest bound
  left): a schedule, hence an upper bound on the optimum.

Used by ``minicavs bench --policies --policy-search N`` to say how many tasks any policy could save.
"""
from __future__ import annotations

import heapq

import numpy as np

from ..frontier import TypedGraph, levels


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
