"""A foreach with one trip count per row (``foreach(steps=lengths)``, lengths of shape ``(None,)``) run on the
numpy path: each step on the rows still active alone, so padding does no work and reaches no value or gradient.
The lowered programs read the same checked trip counts (engine/row_trips.py)."""
from __future__ import annotations

import numpy as np

from ..core.arrays import on_device
from ..core.errors import FeedError
from ..ir.graph import Node, fmt_shape
from .subgraph import Subgraph


def foreach_rows(xp, body: Subgraph, values, n_in, n_state, n_out, length, reverse, _save) -> list:
    """A foreach where row r runs its own ``steps[r]`` steps: at step t the body runs on the rows still
    active alone (a row never read past its length: padding does no work and, NaN or not, reaches no value
    and no gradient). A finished row's states stay as they were and its outputs are zero from then on;
    values without the row axis are the loop's own (iterated, carried, stacked over every step that ran),
    computed over the active rows. Rows sorted longest first are active as a prefix: views, not copies.
    Returns the outputs, final states and (``_save``) the states before each step, as control.py's ``_foreach_all``."""
    args = body.args
    rows_of = [a.has_rows for a in args]
    lengths = checked_row_trips(values[-1], rows_in(values[:-1], body, n_in, n_state), length, body.name)
    n = len(lengths)
    xs, caps = values[:n_in], values[n_in + n_state:-1]
    states = [xp.array(s, copy=True) if r else s            # written row by row below: our own copy
              for s, r in zip(values[n_in:n_in + n_state], rows_of[n_in:n_in + n_state])]
    outs = [_zeros_stacked(xp, o, n, length) for o in body.outputs[:n_out]]
    saved = [_zeros_stacked(xp, a, n, length) for a in args[n_in:n_in + n_state]] if _save else []
    ran = int(lengths.max(initial=0))
    for t in (range(ran - 1, -1, -1) if reverse else range(ran)):
        act = _active_rows(xp, lengths, t)
        for j, s in enumerate(states):
            if _save:
                _put_step(saved[j], slice(None), t, s, rows_of[n_in + j])
        step_in = [x[act, t] if r else x[t] for x, r in zip(xs, rows_of)]
        step_in += [v[act] if r else v for v, r in zip(states + list(caps), rows_of[n_in:])]
        res = body.run(xp, step_in)
        for k in range(n_out):
            _put_step(outs[k], act, t, res[k], body.outputs[k].has_rows)
        for j in range(n_state):
            if rows_of[n_in + j]:
                states[j][act] = res[n_out + j]
            else:
                states[j] = res[n_out + j]
    return outs + states + saved


def checked_row_trips(count, n_rows: int | None, length: int, loop: str) -> np.ndarray:
    """The per-row trip counts, read on the host (one copy on a device), checked: one per row, each in
    [0, length]."""
    trips = count.get() if on_device(count) else np.asarray(count)
    if trips.ndim != 1 or (n_rows is not None and trips.shape[0] != n_rows):
        raise FeedError(f"foreach '{loop}': steps has shape {fmt_shape(trips.shape)}; it must hold one trip "
                        f"count per row ({n_rows if n_rows is not None else 'any number of'} rows)")
    bad = np.flatnonzero((trips < 0) | (trips > length))
    if bad.size:
        r = int(bad[0])
        raise FeedError(f"foreach '{loop}': steps[{r}] = {trips[r]}: a row's trip count must be in [0, {length}] "
                        f"(the loop's length)")
    return trips.astype(np.int64, copy=False)


def _active_rows(xp, trips: np.ndarray, t: int):
    """The rows still running at step ``t``: a slice where they are the leading ones, else their indices."""
    running = trips > t
    m = int(np.count_nonzero(running))
    if running[:m].all():
        return slice(0, m)
    return xp.asarray(np.flatnonzero(running))


def _zeros_stacked(xp, node: Node, n: int, length: int):
    """Zeros for ``node``'s per-step values stacked over ``length`` steps (``n`` rows if it has the axis)."""
    shape = (n, length) + node.shape[1:] if node.has_rows else (length,) + node.shape
    return xp.zeros(shape, dtype=node.dtype.np)


def _put_step(stacked, rows, t: int, value, with_rows: bool) -> None:
    if with_rows:
        stacked[rows, t] = value
    else:
        stacked[t] = value


def rows_in(values, body: Subgraph, n_in: int, n_state: int) -> int | None:
    """The row count of the loop's values with the row axis (for outputs of a loop that ran no step)."""
    for k, a in enumerate(body.args[:n_in]):
        if a.has_rows:
            return values[k].shape[0]
    for k, a in enumerate(body.args[n_in:]):
        if a.has_rows and n_in + k < len(values):
            return values[n_in + k].shape[0]
    return None
