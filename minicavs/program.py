"""Programs as data and the one interpreter that runs them.

A program is a list of :class:`~minicavs.compile.Step` records: what runs (a registry op's impl, or a generated kernel computing
a fused group), on which values, into which. Static graphs (``Executor``), F and ∂F (the engine's phases)
all run through :func:`run_steps`; a step can be written straight into a buffer it is given (``outs``: a
dynamic tensor's rows, the scatter tensor's rows, a concat's column block), which is how values land where
the compiler placed them without copies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import FeedError
from .graph import Node, fmt_shape
from .compile import Step


@dataclass
class RunContext:
    """What an op may read besides its inputs: the dropout hash words and the train/eval switch."""

    seed: int = 0
    step: int = 0
    training: bool = True
    row_keys: Any = None  # per-row keys of the rows being computed (None: the row index)


def run_steps(steps: Sequence[Step], env: dict, xp, ctx: RunContext, outs: Mapping | None = None) -> None:
    """The interpreter: run ``steps`` in order, reading and writing values in ``env``. A fused step whose
    output is in ``outs`` writes its result there (no copy)."""
    outs = outs or {}
    for step in steps:
        args = [env[x] for x in step.inputs]
        if step.fused:
            for node, value in zip(step.outputs, step.run(args, [outs.get(o) for o in step.outputs])):
                env[node] = value
        elif step.needs_ctx:
            env[step.outputs[0]] = step.run(xp, *args, ctx=ctx, **step.attrs)
        else:
            env[step.outputs[0]] = step.run(xp, *args, **step.attrs)
        for x in step.frees:
            del env[x]


def check_value(node: Node, value, what: str):
    """Return ``value`` as an array of the node's dtype, or raise naming the node and both shapes. Arrays
    of another array module (a device's) are checked and kept there."""
    arr = value if hasattr(value, "__array_namespace__") or isinstance(value, np.ndarray) else np.asarray(value)
    want = node.dtype.np
    if arr.dtype != want:
        if arr.dtype.kind != want.kind and not (arr.dtype.kind in "iub" and want.kind in "iu"):
            raise FeedError(f"{what} {node.label()}: got dtype {arr.dtype}, declared {node.dtype.name}")
        arr = arr.astype(want)
    if arr.ndim != node.ndim or any(d is not None and d != a for d, a in zip(node.shape, arr.shape)):
        raise FeedError(f"{what} {node.label()}: got shape {arr.shape}, declared {fmt_shape(node.shape)}")
    return arr


def is_fed(n: Node) -> bool:
    """Inputs and parameters: values a graph is given, not computed."""
    return n.op in ("input", "param")


def leaf_value(n: Node, feeds: Mapping, params: Mapping):
    """The value of an ``input`` (from feeds, by node or name) or ``param`` (by name) node, checked."""
    if n.op == "input":
        if n in feeds:
            value = feeds[n]
        elif n.name is not None and n.name in feeds:
            value = feeds[n.name]
        else:
            raise FeedError(f"missing feed for input {n.label()} {fmt_shape(n.shape)}")
        return check_value(n, value, "feed for input")
    if n.name not in params:
        raise FeedError(f"missing value for parameter '{n.name}' {fmt_shape(n.shape)}")
    value = params[n.name]
    return check_value(n, getattr(value, "value", value), "parameter")


def evaluate(nodes: Sequence[Node], env: dict, feeds: Mapping, params: Mapping, ctx: RunContext, xp=np) -> None:
    """Evaluate ``nodes`` (in topological order) into ``env``, keeping every value (for a backward pass):
    nodes already in ``env`` are not recomputed. Feeds and parameters must already be arrays of ``xp``'s
    device."""
    steps = []
    for n in nodes:
        if n in env:
            continue
        if is_fed(n):
            env[n] = leaf_value(n, feeds, params)
        else:
            steps.append(Step.of(n))
    run_steps(steps, env, xp, ctx)
