"""Eager / lazy / recurrent: the Proposition of §3.4 made exact.

In F, a node is *recurrent* if it lies on a path from a gather to the scatter, *eager* if it has no gather
ancestor (it depends only on pulls, parameters and constants), and *lazy* otherwise (it depends on a gather
but nothing on the gather -> scatter path depends on it: pushes and what only feeds them). ∂F mirrors F:
its "gather" is the gradient parents send back (the scatter cotangent) and its "scatter" the gradients sent
to children (the gather gradients); forward values, push cotangents and parameters count as inputs, so
parameter and pull gradients are lazy. Eager nodes can run once over all vertices of their kind before the
task loop, lazy nodes once after it; only recurrent nodes must follow the schedule.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from ...ir.graph import Node

EAGER, LAZY, RECURRENT = "eager", "lazy", "recurrent"


def classify(nodes: Sequence[Node], sources: Iterable[Node], sinks: Iterable[Node]) -> dict[Node, str]:
    """Classes of ``nodes`` (topological order) given the recurrent entries and exits."""
    sources, sinks = set(sources), set(sinks)
    member = set(nodes)
    below = set()            # depends on a source (a source depends on itself)
    for n in nodes:
        if n in sources or any(x in below for x in n.inputs):
            below.add(n)
    above = set(sinks) & member   # some sink depends on it
    for n in reversed(nodes):
        if n in above:
            above.update(x for x in n.inputs if x in member)
    return {n: (EAGER if n not in below else RECURRENT if n in above else LAZY) for n in nodes}
