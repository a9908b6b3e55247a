"""What a control-flow node holds, for its readers (explain, the lowering of conds and loops into the instruction
program, the step runner's trip counts): the attributes that control.py's ``cond``, ``foreach`` and ``while_loop``
lay out, summarized, so that no reader outside ops/ reads them or branches on an op's name."""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Node
from .subgraph import Subgraph


@dataclass(frozen=True)
class Flow:
    """A control-flow node as a reader summarizes it."""

    bodies: tuple        # (role, Subgraph): ("body",) and a while_loop's ("cond",); a cond's ("then",), ("else",)
    length: int | None   # a foreach's trip count, a while_loop's max_iterations; None for a cond
    counted: bool        # whether fewer steps may run than ``length`` (a while_loop; foreach(steps=n))
    reverse: bool
    iterated: int        # inputs sliced per step (a cond: its operands)
    states: int          # loop states
    outputs: int         # a loop's per-step outputs, stacked; a cond's results
    captured: int        # values the bodies read from outside
    saves: bool          # whether the value holds the per-step states for the gradient
    kept: bool = False   # whether it keeps what its gradient reads (loop_grad.py, cond_grad.py): its items are
    # results written in place


def flow(node: Node) -> Flow | None:
    """The control-flow facts of ``node`` (None: it holds no subgraph)."""
    a = node.attrs
    if "then" in a:
        results = len(a["_types"]) if "_sides" in a else len(a["then"].outputs)
        return Flow((("then", a["then"]), ("else", a["else_"])), None, False, False, a["n_operands"], 0,
                    results, len(node.inputs) - 1 - a["n_operands"], "_sides" in a, "_sides" in a)
    if not isinstance(a.get("body"), Subgraph):
        return None
    bodies = (("body", a["body"]),) + ((("cond", a["cond"]),) if "cond" in a else ())
    fixed = a["n_in"] + a["n_state"] + (1 if a["_has_count"] else 0)
    return Flow(bodies, a["length"], a["_has_count"] or "cond" in a, bool(a.get("reverse", False)), a["n_in"],
                a["n_state"], a["n_out"], len(node.inputs) - fixed, a["_save"], a.get("_residuals") is not None)


def is_cond(node: Node) -> bool:
    """Is ``node`` a ``cond`` (a then and an else body)?"""
    return isinstance(node.attrs.get("then"), Subgraph)


def is_foreach(node: Node) -> bool:
    """Is ``node`` a ``foreach`` (a body, and no condition: a while_loop has one)?"""
    return isinstance(node.attrs.get("body"), Subgraph) and "cond" not in node.attrs


def is_loop(node: Node) -> bool:
    """Is ``node`` a control-flow operator with a body (whose steps a run may report: :func:`steps_run`)?"""
    return isinstance(node.attrs.get("body"), Subgraph)


def steps_run(node: Node, env: dict):
    """The steps loop ``node`` ran, as the run left them in ``env`` (its count input, or a while_loop's count
    result: a 0-d array, not read here, since on a device a read is a crossing); None where they are its
    ``length`` or ``node`` is no loop."""
    a = node.attrs
    if not isinstance(a.get("body"), Subgraph):
        return None
    if a["_has_count"]:
        return env.get(node.inputs[-1])
    if "cond" in a and a.get("_pick") is None and node in env:
        return env[node][a["n_out"] + a["n_state"]]
    return None
