"""A structure's pulls when its static stage is one lookup of a parameter table by fed ids (the tree models'
word embeddings, ``lookup(E, words)``): the rows taken here, in place of the static graph's machinery around
the same take (its program found by key, its leaves, the step runner, its record: ~15 µs of a batch-1 Tree-LSTM
inference at hidden 128, against ~5 for the take and its checks).

What it leaves in ``env`` and the record it adds to the run's static runs are the step runner's (the same
arrays, the same StaticRun). Anything it would not check as the step runner does (ids not int64 or out of range,
a missing feed, arrays on another device) goes to the static graph, which raises its error naming the vertex;
nothing is written to ``env`` before every check has passed.
"""
from __future__ import annotations

import numpy as np

from ..core.errors import FeedError
from ..core.validate import indices
from .program import leaf_value, record


def lookup_of(stage) -> tuple | None:
    """(table, ids, lookup) nodes when ``stage`` (a StaticNodes) is exactly one lookup of a parameter matrix by a
    fed vector of ids, else None; found once per stage."""
    found = stage.__dict__.get("pull_lookup", False)
    if found is False:
        computed = [n for n in stage if n.op not in ("input", "param")]
        found = None
        if len(computed) == 1 and computed[0].op == "lookup":
            table, ids = computed[0].inputs
            if table.op == "param" and ids.op == "input" and table.ndim == 2 and ids.ndim == 1 \
                    and len(stage) == 3:
                found = (table, ids, computed[0])
        stage.__dict__["pull_lookup"] = found
    return found


def pulled(model, s, stage, env: dict, feeds, params, ctx, static: list, title: str, training: bool) -> bool:
    """Take the rows of structure ``s``'s pull stage into ``env`` and record it as the step runner does, when the
    stage is one lookup (:func:`lookup_of`) on the host and every check passes; False: run the static graph."""
    found = lookup_of(stage)
    if found is None or model.device.xp is not np:
        return False
    table_node, ids_node, node = found
    if table_node in env or ids_node in env or node in env:
        return False
    try:
        table = leaf_value(table_node, feeds, params)
        ids = leaf_value(ids_node, feeds, params)
        ids = indices(ids, "lookup: index", size=table.shape[0])
    except FeedError:
        return False   # (the static graph raises it, naming the sample and vertex)
    if type(table) is not np.ndarray or type(ids) is not np.ndarray:
        return False
    program = model._static.program(stage, s.pulls.values(), (False,) * len(stage), training, title, model.device)
    if program.lowered is not None or program.after or [step.outputs for step in program.before] != [(node,)]:
        return False
    env[table_node], env[ids_node] = table, ids
    env[node] = table.take(ids, axis=0)
    ran = record(program.title, program.before, env, np)
    ran.program, ran.left = None, program.split.left
    static.append(ran)
    return True
