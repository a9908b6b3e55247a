"""A ``cond`` of a static graph inside its instruction program (engine/static_program.py): the branch F's lowering
makes (engine/branches.py: ``BRANCH`` on the pred's one value, each side's steps inline, ``JUMP`` past the
else-side), so only the taken side runs, forward and backward (a static graph's gradient of a cond is a cond on
the same pred of the sides' gradients). Inside the sides the static program's own step lowering runs (row
functions, lookups, loops: ``lower_step``, passed in).

BRANCH reads its pred from a buffer the program is given (on a device its host copy, read once a pass), so the
pred must be a value the graph is given, a feed or a parameter, of the cond's float type: a pred the graph
computes keeps the cond on the step runner, and says so.
"""
from __future__ import annotations

import math
from typing import Callable

from ..ir.graph import Node
from ..ops.flow import flow
from ..ops.registry import holds_tuple
from . import instructions
from .branches import branches, lower_cond
from .program import is_fed


def refusal(n: Node) -> str | None:
    """Why no branch computes cond ``n`` in a static program (None: one does)."""
    pred = n.inputs[0]
    types = n.attrs["_types"] if holds_tuple(n) else [(n.shape, n.dtype)]
    if any(d != n.dtype or not d.is_float for _, d in types):
        return "a cond whose results are not all of one float type"
    if not is_fed(pred) or pred.dtype != n.dtype or math.prod(pred.shape) != 1:
        return (f"a cond whose pred {pred.label()} is not a {n.dtype.name} value the graph is given (a branch "
                "reads its pred from a buffer given to the program)")
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
    if branches(t, step, statics):
        lower_cond(t, step, statics, device, singles, lower_step)
    else:
        instructions._step(t, step, statics, device, singles)
