"""Static graphs run once: ``Executor`` compiles a graph into a list of steps (compile.Step) and runs them
with program.run_steps, the step runner of static graphs (the loss, the model's graphs around the vertex
functions); the reference the fused paths are checked against."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..ir.graph import Graph, Node
from .program import RunContext, Step, check_value, evaluate, is_fed, leaf_value, run_steps  # noqa: F401


class Executor:
    """A graph compiled once into a list of steps in topological order; ``run`` only interprets them."""

    def __init__(self, graph: Graph | Sequence[Node]):
        self.graph = graph if isinstance(graph, Graph) else Graph(graph)
        nodes = self.graph.nodes
        outputs = set(self.graph.outputs)
        last_use: dict = {}
        for i, n in enumerate(nodes):
            for x in n.inputs:
                last_use[x] = i
        frees = [[] for _ in nodes]
        for x, i in last_use.items():
            if x not in outputs:
                frees[i].append(x)
        self.leaves = [n for n in nodes if is_fed(n)]
        # A value is dropped after its last reader (each value once, however many inputs read it).
        self.steps = [Step.of(n, tuple(frees[i])) for i, n in enumerate(nodes) if not is_fed(n)]

    def run(self, feeds: Mapping | None = None, params: Mapping[str, Any] | None = None,
            ctx: RunContext | None = None, xp=np) -> list:
        """Evaluate the graph. ``feeds`` maps input nodes (or their names) to arrays; ``params`` maps
        parameter names to arrays (or objects with a ``.value``)."""
        feeds = feeds or {}
        params = params or {}
        env = {n: leaf_value(n, feeds, params) for n in self.leaves}
        run_steps(self.steps, env, xp, ctx or RunContext())
        return [env[o] for o in self.graph.outputs]


def run(outputs: Node | Sequence[Node], feeds: Mapping | None = None, params: Mapping | None = None,
        ctx: RunContext | None = None):
    """One-shot evaluation; returns one array for one output node, else a list."""
    single = isinstance(outputs, Node)
    result = Executor([outputs] if single else list(outputs)).run(feeds, params, ctx)
    return result[0] if single else result
