"""A static graph on top of a structure (the classifier head and loss; training, also the gradients of its
pushes and parameters) linked into the structure's F program: its template (static_program.py's) joined after
F's blocks as one more template, run as one more table row of all its rows. A batch's forward pass is then one
bind and one runner call: binding and starting a program of its own cost more than the head computes at a
batch of one tree (about 50 µs against 15). Its values live in F's arenas (its scratch is one more block's,
its fixed values share F's fixed arena as F's templates do); what it hands out is copied into arrays made per
run, read by ∂F (the push gradients) and the model.

Where a graph cannot be linked it runs as its own program (or on the step runner) as before, and the reason
is the StaticRun's ``linked`` (explain shows it): no program (every node on the step runner), a part the step
runner computes before it from the pushes, an op no C loop runs (F's program would go to the reference
runner with it), another dtype than F's.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..core.errors import FeedError
from . import instructions
from .lowered import Lowered
from .program import BatchProgram
from .static_program import StaticProgram

_LINKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # F's Lowered -> {id(head): (head, linked)}


def refusal(head: StaticProgram, pushed, dtype) -> str | None:
    """Why ``head`` (given the structure's pushes ``pushed``) cannot be linked into F's program (None: it can)."""
    if head.lowered is None:
        return "no program (the step runner computes the whole graph)"
    made = set(pushed)
    for step in head.before:
        if any(x in made for x in step.inputs):
            made.update(step.outputs)
    if any(o in made for step in head.before for o in step.outputs):
        return "the step runner computes part of it from the pushes before the program"
    if head.lowered.c_refusal is not None:
        return f"its program holds what no C loop runs ({head.lowered.c_refusal}): F's would go to the reference runner"
    if head.split.program[0].dtype.np != np.dtype(dtype):
        return f"its values are {head.split.program[0].dtype.name}, F's {np.dtype(dtype).name}"
    return None


def linked(f: Lowered, head: Lowered) -> Lowered:
    """F's program ``f`` with the template of ``head`` joined after its blocks (template id: past the kinds'
    ranges), made once per pair."""
    found = _LINKED.setdefault(f, {})
    hit = found.get(id(head))
    if hit is not None and hit[0] is head:
        return hit[1]
    n_kinds, tid = f.n_kinds, len(f.ranges)
    joined = instructions._Joined(n_kinds)
    joined.ranges = np.zeros((tid + 1, 2), np.int64)
    template = head.templates[0]
    tasks = [i for i in range(len(f.templates)) if f.template_ids[i] < n_kinds]
    for i in tasks:
        joined.append(f.template_ids[i], f.templates[i])
    joined.append(tid, template)   # (its keys bound with the tasks': it runs in every pass, blocks or not)
    task_keys = len(joined.keys)
    for i in range(len(f.templates)):
        if i not in tasks:
            joined.append(f.template_ids[i], f.templates[i])
    kernels = joined.kernels
    made = Lowered(f.title, f.template_ids + [tid], f.templates + [template],
                   np.array(joined.code, np.int64).reshape(-1, instructions.WIDTH),
                   np.array(joined.pool or [0], np.int64), joined.ranges, list(joined.keys) + [("scratch",)],
                   np.array([getattr(k, "address", 0) for k in kernels] or [0], np.int64), max(f.nregs, head.nregs),
                   f.scratch_cols, max(f.fixed_size, head.fixed_size), blocks=f.blocks, task_keys=task_keys,
                   table_width=f.table_width, fused=list(kernels), dropouts=joined.dropouts, steps=joined.steps,
                   tail={tid: template.scratch})
    found[id(head)] = (head, made)
    return made


class LinkedHead:
    """One run's static graph on top of a structure, linked into the structure's forward pass: :meth:`link` (at
    F's binding, once the push buffers exist) and :meth:`finish` (after the call)."""

    def __init__(self, head: StaticProgram, pushed: dict, env: dict, ctx, static: list, structure: str):
        self.head, self.pushed, self.env, self.ctx = head, pushed, env, ctx
        self.static, self.structure = static, structure
        self.values = None

    def link(self, lowered: Lowered, buffers, state) -> tuple:
        """(F's program with the head linked, the buffers of both, the head's table row), the push buffers put in
        ``env`` first (F writes them; the head reads them in the same call)."""
        for node, name in self.pushed.items():
            if name not in state.pushes:
                raise FeedError(f"structure '{self.structure}': no vertex in the batch pushes '{name}'")
            self.env[node] = state.pushes[name]
        head = self.head
        self.values = values = head.values(self.env, self.ctx)
        both = linked(lowered, head.lowered)
        row = np.full((1, both.table_width), -1, np.int64)
        row[0, :4] = (len(lowered.ranges), 0, values.rows, -1)
        buffers.head = values   # (the keys F's buffers do not name: the head's)
        return both, buffers, row

    def finish(self, program: BatchProgram) -> None:
        """The head's outputs into ``env``, the step runner's part after it, what ran recorded (``program``: F's;
        the record's program is the head's template over its rows, run by F's runner)."""
        head, values = self.head, self.values
        mine = BatchProgram(head.title, head.lowered, head.table_row(values.rows), slice(0, 1), values, {},
                            program.runner, program.declined, dtype=program.dtype, check=program.check)
        ran = head.finish(self.env, values, mine, self.ctx, self.static)
        if ran is not None:
            ran.linked = f"linked into the forward program of structure '{self.structure}' as its last template " \
                         "(one bind and one runner call for both)"


def head_for(model, s, final: tuple, env: dict, feeds, params, ctx, training: bool, static: list):
    """The static graph ``final`` (nodes, what the model reads, title) to link into the forward pass of
    structure ``s`` (the last one), prepared (its leaves and the step runner's part before it in ``env``), or
    None where it cannot be linked (the reason kept for the StaticRun of its own program)."""
    nodes, explicit, title = final
    pushed = {node: name for name, node in s._pushed.items()}
    present = tuple([n in env or n in pushed for n in nodes])
    head = model._static.program(nodes, explicit, present, training, title, model.device)
    why = head.__dict__.get("link_refusal", False)
    if why is False:   # (found once per program: it depends on the program and the structure's dtype alone)
        why = head.link_refusal = refusal(head, pushed, s.dtype.np)
    if why is not None:
        return None
    head.prepare(env, feeds, params, ctx)
    return LinkedHead(head, pushed, env, ctx, static, s.name)


def final_graph(model, training: bool, outputs: bool) -> tuple:
    """(nodes, what the model reads of them, title) of ``model``'s static graph on top of the structures: training,
    the loss with the gradients that read no pull's cotangent (one graph); else the loss and outputs. Found once
    per model and case (what it reads is fixed when the model is made)."""
    found = model.__dict__.setdefault("_final_graphs", {})
    key = (training, outputs)
    if key not in found:
        found[key] = _final_graph(model, training, outputs)
    return found[key]


def _final_graph(model, training: bool, outputs: bool) -> tuple:
    loss = model.loss
    if training and model._early:
        pushes = [f"the gradient of push '{s}.{name}'" for (s, name), g in model.push_grad.items()
                  if g in model._early]
        title = (f"forward, the loss{' and outputs' * outputs}; backward, " + ", ".join(pushes)
                 + (" and " if pushes else "") + "the gradients of the parameters on top")
        return model._training_stages[outputs], [loss] + list(model.outputs.values()) * outputs + model._early, title
    if outputs or loss is None:
        return (model.final_stage, [loss] * (loss is not None) + list(model.outputs.values()),
                "forward, the loss and outputs")
    return model.loss_stage, [loss], "forward, the loss"
