"""A ``cond`` of a static graph inside its instruction program (engine/static_program.py): the branch F's lowering
makes (engine/branches.py: ``BRANCH`` on the pred's one value, each side's steps inline, ``JUMP`` past the
else-side), so only the taken side runs, forward and backward (a static graph's gradient of a cond is a cond on
the same pred of the sides' gradients). Inside the sides the static program's own step lowering runs (row
functions, lookups, loops: ``lower_step``, passed in).

The pred is one value of the cond's float type: BRANCH reads it from its buffer where the graph is given it (a
feed, a parameter; on a device its host copy, read once a pass), IF from its register where the program computes
it (on a device one counted read per IF run).
"""
from __future__ import annotations

import math
from typing import Callable

from ..ir.graph import Node
from ..ops.flow import flow
from ..ops.registry import holds_tuple
from . import instructions
from .branches import branches, lower_cond


def refusal(n: Node) -> str | None:
    """Why no branch computes cond ``n`` in a static program (None: one does)."""
    pred = n.inputs[0]
    types = n.attrs["_types"] if holds_tuple(n) else [(n.shape, n.dtype)]
    if any(d != n.dtype or not d.is_float for _, d in types):
        return "a cond whose results are not all of one float type"
    if pred.dtype != n.dtype or math.prod(pred.shape) != 1:
        return f"a cond whose pred {pred.label()} is not one {n.dtype.name} value"
    for _, body in flow(n).bodies:
        for x in body.computed:
            if not x.dtype.is_float or any(not i.dtype.is_float for i in x.inputs):
                return f"{x.label()} in branch '{body.name}' reads or computes an int value"
    return None


def lower(t, step, statics: set, device, singles: dict, lower_step: Callable) -> None:
    """Cond ``step`` as a branch whose sides ``lower_step`` lowers, where its pred is a static the template
    reads; else F's step lowering (an APPLY: a cond inside a loop's body on a pred the body computes)."""
    for x in step.inputs:
        if x not in t.regs and x in statics:
            t.emit("STATIC", t.reg(x), t.buf(("static", x)))
    if branches(t, step, statics, computed=True):
        lower_cond(t, step, statics, device, singles, lower_step)
    else:
        instructions._step(t, step, statics, device, singles)
