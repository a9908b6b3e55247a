"""Control flow as operators: ``cond``, ``foreach`` and ``while_loop`` hold their bodies as subgraphs, so a
model with data-dependent control flow is still one graph that can be dumped, differentiated and run. The
loops live here, ``cond`` in cond.py (imported here: the three are used as ``control.*``), a per-row trip
count's steps in row_steps.py.

A body is built by calling a Python function once on fresh symbols (``subgraph.trace``): the nodes it makes
become a closed ``Subgraph``; every value it reads from outside (a parameter, a node of the enclosing graph, a
node of an enclosing body) becomes an explicit input of the control-flow node, and inside the body a
placeholder stands for it. So autodiff sees every dependency on the node's inputs, and gradients reach
parameters read inside a loop (accumulated over its iterations).

Each op runs its subgraph with the registry's impls (plain Python over ``xp``: numpy, or a device's module),
so it runs wherever ops run; the C runner has no opcode for it and leaves that pass to the
Python path. Gradients are themselves control flow: the backward of a ``cond`` is a ``cond`` of the two
branches' backward graphs (only the taken branch runs, so the untaken one contributes exactly nothing, even
where it would be NaN or inf); the backward of a loop is a ``foreach`` over the saved per-iteration states,
in reverse, carrying the state cotangents and the sums of the captured values' gradients.

Iteration axis: a loop never iterates over the run-time row axis (each row of a static graph's batch, each
vertex in a vertex function, is an independent sequence): it iterates over axis 0 of a value without a row
axis and over axis 1 (the first axis a vertex function's author sees) of one with it; per-step slices and
stacked outputs keep the row axis in front.

Values with several outputs: the node of a control-flow op with more than one result holds a tuple, and each
result is an ``item`` node of it (``subgraph.item``). Inside a vertex
function a value may be stored per vertex between phases and passes, which a tuple cannot be: there each
result is a node of its own (running the body once per result read), a loop's gradient replays it to get its
per-step states, and the gradients of per-vertex values and of parameters come from separate nodes; except a
foreach whose gradient can run from saved values (loop_grad.py: one node keeping what its gradient reads, its
items stored per vertex) and a cond's products of values from outside, made before it (hoist.py).

Run-time shapes: a static graph's shapes are fixed at declaration, so outputs sized by the iterations that
actually ran (``while_loop``, ``foreach(steps=n)``) keep their declared length and are zero after the last
step run; the number of steps is an output (``while_loop``) or an input (``foreach``): one for the loop, or
in a static graph one per row (padded sequences: each row runs its own length, the body on the active rows).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..core.arrays import on_device
from ..core.dtypes import int64
from ..core.errors import FeedError, ShapeError
from ..ir.graph import Node, _rows_implicit, fmt_shape, type_str
from .cond import _float_grads, _host_true, cond  # noqa: F401  (cond: the three operators in one place)
from .loop_grad import loop_types, saved_vjp, saving_loop
from .registry import OpDef, make_node, register
from .row_steps import foreach_rows, rows_in
from .sources import zeros_like
from .subgraph import (Subgraph, Traced, _as_list, _cotangents, _extend_captures, _is_tuple_node,
                       _merged_captures, _results, _tuple_node, item, trace)


# --- loops -----------------------------------------------------------------------------------------------

def _iter_axis(x: Node) -> int:
    """The stored axis a loop iterates over (the row axis never: see the module's docstring)."""
    return 1 if x.has_rows else 0


def _step_shape(x: Node, what: str) -> tuple:
    ax = _iter_axis(x)
    if x.ndim <= ax:
        raise ShapeError(f"{what} {x.label()} has shape {fmt_shape(x.shape)}: no axis to iterate over "
                         "(the row axis is never iterated)")
    return x.shape[:ax] + x.shape[ax + 1:]


def _take_step(x, t: int, rows: bool):
    return x[:, t] if rows else x[t]


def _stack(xp, parts: list, length: int, shape: tuple, dtype, rows: int | None):
    """Per-step values stacked on the iteration axis; ``length`` steps, where only the first ``len(parts)``
    ran (the others zero: a while_loop's padding); ``rows`` is the row count when no step ran."""
    ax = 1 if shape and shape[0] is None else 0
    if len(parts) == length and length:
        return xp.stack(parts, axis=ax)
    lead = (parts[0].shape[0] if parts else rows or 0,) if ax else ()
    out = xp.zeros(lead + (length,) + tuple(shape[ax:]), dtype=dtype.np)
    for t, p in enumerate(parts):
        if ax:
            out[:, t] = p
        else:
            out[t] = p
    return out


def _check_states(body: Subgraph, n_out: int, states: list, what: str) -> None:
    new = body.outputs[n_out:]
    if len(new) != len(states):
        raise ShapeError(f"{what}: the body returns {len(new)} states for {len(states)} loop states")
    for j, (s, ns) in enumerate(zip(states, new)):
        if s.shape != ns.shape or s.dtype != ns.dtype:
            raise ShapeError(f"{what}: state {j} enters as {s.dtype.name}{fmt_shape(s.shape)} but the body "
                             f"returns {ns.dtype.name}{fmt_shape(ns.shape)}; a state keeps its shape and dtype")


def _unpack_pair(result, what: str) -> list:
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(f"{what}: the body must return a pair (outputs, new_states)")
    outs, _ = _as_list(result[0], f"{what} outputs") if result[0] is not None else ([], False)
    states, _ = _as_list(result[1], f"{what} states") if result[1] is not None else ([], False)
    return outs + states


def foreach(body: Callable, inputs: Sequence[Node] | Node, states: Sequence[Node] | Node,
            length: int | None = None, reverse: bool = False, steps: Node | None = None,
            name: str | None = None):
    """Run ``body`` over the iteration axis of ``inputs`` (axis 0, or axis 1 of a value with the row axis):
    ``outputs_t, states = body(inputs_t, states)``. Returns ``(outputs, final_states)``: each output stacked
    over the steps, on the same axis. ``inputs``/``states`` and the body's two results are each one node or
    a list of nodes (the body gets what was given: a node or a list). ``length`` gives the trip count when
    there are no inputs; ``reverse`` runs the steps from the last (outputs still stacked at their step).
    ``steps`` (an int scalar node, read on the host once per run) runs only the first ``steps`` of them (at
    most the static length; padded batches: the batch's longest sequence): the outputs keep the static
    length, zero after the last step run, as a while_loop's do. In a static graph ``steps`` may instead give
    one trip count per row (an int node of shape ``(None,)``: each sequence's length): step t runs the body
    on the rows with ``steps > t`` alone, so padding does no work and reaches no value or gradient; a
    finished row keeps its states and its outputs are zero past its length (rows sorted longest first run
    on views of the arrays, other orders on gathered rows).

    Shapes are inferred from one trace of ``body`` (now, on fresh symbols); a state must come back with its
    shape and dtype. Gradients: the pre-step states are saved in the forward and the backward is a
    ``foreach`` over them in reverse, carrying the state cotangents and summing the gradients of every value
    the body reads from outside (parameters, closure values) over the steps."""
    what = f"foreach '{name}'" if name else "foreach"
    xs, x_single = _as_list(inputs, f"{what} inputs") if inputs is not None else ([], False)
    ss, s_single = _as_list(states, f"{what} states") if states is not None else ([], False)
    lengths = {x.shape[_iter_axis(x)] for x in xs if x.ndim > _iter_axis(x)}
    slice_types = [(_step_shape(x, f"{what}: input"), x.dtype) for x in xs]
    if len(lengths) > 1:
        raise ShapeError(f"{what}: the inputs have different lengths {sorted(lengths)} along their iteration "
                         "axes (" + ", ".join(f"{x.label()} {fmt_shape(x.shape)}" for x in xs) + ")")
    if xs:
        if length is not None and length != next(iter(lengths)):
            raise ShapeError(f"{what}: length={length} but the inputs have {next(iter(lengths))} steps")
        length = next(iter(lengths))
    elif length is None or length < 0:
        raise ShapeError(f"{what}: without inputs, give the trip count as length=")

    def call(*formals):
        x_part, s_part = formals[:len(xs)], formals[len(xs):]
        return body(x_part[0] if x_single else list(x_part), s_part[0] if s_single else list(s_part))

    n_out = []

    def unpack(result):
        flat = _unpack_pair(result, what)
        n_out.append(len(flat) - len(ss))
        return flat

    traced, _ = trace(call, slice_types + [(s.shape, s.dtype) for s in ss], name or "body", unpack)
    _check_states(traced.graph, n_out[0], ss, what)
    _check_steps(steps, reverse, what)
    outs, finals, _ = _loop_node("foreach", xs, ss, traced, n_out[0], length, {"reverse": bool(reverse)},
                                 x_single, s_single, count=steps)
    return outs, finals


def _check_steps(steps: Node | None, reverse: bool, what: str) -> None:
    """Refuse a ``steps`` that is neither one int value nor one int per row of a static graph (shape
    ``(None,)``: inside a vertex function that shape is per vertex, which a loop there does not take)."""
    if steps is None:
        return
    is_int = isinstance(steps, Node) and not steps.dtype.is_float
    one = is_int and not steps.has_rows and all(d == 1 for d in steps.shape)
    per_row = is_int and steps.shape == (None,) and not _rows_implicit.get()
    if not (one or per_row):
        shown = steps.label() + " " + type_str(steps) if isinstance(steps, Node) else repr(steps)
        raise ShapeError(f"{what}: steps must be one integer value (an int scalar node) or, in a static graph, "
                         f"one per row (an int node of shape (None,)), got {shown}")
    if reverse:
        raise ShapeError(f"{what}: reverse with a run-time number of steps is not supported")


def _loop_node(op: str, xs: list, ss: list, traced: Traced, n_out: int, length: int, extra: dict,
               x_single: bool, s_single: bool, count: Node | None = None, backward: bool = False,
               _pick: Sequence[int] | None = None):
    """The node(s) of a loop; returns its outputs, its final states as the caller gave them (one node or a
    list) and a while_loop's count (else None).

    A loop with one result (a foreach with one state and no outputs: a vertex function's encoder) is a
    node of that value, which saves nothing: its gradient replays it once to get the per-step states. Any
    other loop is a tuple node whose value holds the per-step states too (``_save``), for its gradient,
    except in a vertex function (``_in_vertex_function``): a value there may be stored per vertex between
    phases and passes, which a tuple cannot be, so each result is a node of its own (``_pick``: running the
    loop once per result read) and the gradient replays the loop."""
    body = traced.graph
    in_vf = bool(_rows_implicit.get()) and not backward
    n_results = n_out + len(ss) + (1 if op == "while_loop" else 0)
    keeps = in_vf or not (backward or _pick is not None)   # (a static graph's loop too: one node of its own)
    saving = saving_loop(op, xs, ss, traced, n_out, length, extra, count, in_vf) if keeps else None
    if saving is not None:   # one node keeping what its gradient reads (ops/loop_grad.py)
        n_kept = saving.attrs["n_out"]   # (its residuals are outputs after the loop's own)
        ran = 1 if op == "while_loop" else 0   # (and a while_loop's count)
        results = [item(saving, k) for k in range(n_out)]
        results += [item(saving, n_kept + j) for j in range(len(ss) + ran)]
        return _split_results(results, n_out, len(ss), s_single, op)
    if in_vf and _pick is None and n_results > 1:
        results = [_loop_node(op, xs, ss, traced, n_out, length, extra, False, False, count, backward, [i])
                   for i in range(n_results)]
        flat = [r[0][i] if i < n_out else r[1][i - n_out] if i < n_out + len(ss) else r[2]
                for i, r in enumerate(results)]
        return _split_results(flat, n_out, len(ss), s_single, op)
    single = (op == "foreach" and not backward and n_results == 1) or (_pick is not None and len(_pick) == 1
                                                                      and not backward)
    attrs = dict(extra, body=body, n_in=len(xs), n_state=len(ss), n_out=n_out, length=length,
                 _has_count=count is not None, _save=not (single or backward or in_vf),
                 _differentiable=not backward, _in_vertex_function=in_vf,
                 _pick=None if _pick is None else tuple(_pick))
    if count is not None and count.has_rows:   # a trip count per row (its backward: the same, in reverse)
        attrs["_per_row"] = True
    inputs = xs + ss + traced.captured + ([count] if count is not None else [])
    types = loop_types(op, body, ss, n_out, length, attrs["_save"])
    if _pick is not None:
        types = [types[i] for i in _pick]
    if single:
        node = make_node(op, inputs, dict(attrs, shape=types[0][0], dtype=types[0][1]))
    else:
        node = _tuple_node(op, inputs, dict(attrs, dtype=(types[0][1] if types else int64)), types)
    results = _results(node, len(types) if _pick is not None else n_results)
    if _pick is not None:   # the results not picked are None
        full = dict(zip(_pick, results))
        results = [full.get(i) for i in range(n_results)]
    return _split_results(results, n_out, len(ss), s_single, op)


def _split_results(results: list, n_out: int, n_state: int, s_single: bool, op: str):
    outs, finals = results[:n_out], results[n_out:n_out + n_state]
    count = results[n_out + n_state] if op == "while_loop" else None
    return outs, (finals[0] if s_single else finals), count


def _loop_infer(*inputs, shape, dtype, **attrs):
    return shape, dtype


def _run_steps(xp, body: Subgraph, xs, states, caps, rows_of, order, n_out, _save: bool):
    """The loop proper: per step, the input slices and states through the body."""
    outs = [dict() for _ in range(n_out)]
    saved = [dict() for _ in states]
    for t in order:
        slices = [_take_step(x, t, rows) for x, rows in zip(xs, rows_of)]
        if _save:
            for j, s in enumerate(states):
                saved[j][t] = s
        res = body.run(xp, slices + states + caps)
        for k in range(n_out):
            outs[k][t] = res[k]
        states = res[n_out:]
    return outs, states, saved


def _foreach_impl(xp, *values, body, n_in, n_state, n_out, length, reverse, _has_count, _save, _differentiable,
                  _in_vertex_function, _pick, shape, dtype, _types=None, _per_row=False, _residuals=None):
    if _per_row:
        result = foreach_rows(xp, body, values, n_in, n_state, n_out, length, reverse, _save)
    else:
        result = _foreach_all(xp, body, values, n_in, n_state, n_out, length, reverse, _has_count, _save)
    if _pick is not None:
        result = [result[i] for i in _pick]
    return tuple(result) if _types is not None else result[0]


def _foreach_all(xp, body: Subgraph, values, n_in, n_state, n_out, length, reverse, _has_count, _save) -> list:
    """A foreach whose steps run on every row: its outputs, final states and (``_save``) saved states."""
    xs, states = list(values[:n_in]), list(values[n_in:n_in + n_state])
    caps = list(values[n_in + n_state:len(values) - (1 if _has_count else 0)])
    ran = length
    if _has_count:   # a run-time trip count (a while_loop's backward: the steps that ran), read on the host
        count = values[-1]
        ran = int((count.get() if on_device(count) else np.asarray(count)).reshape(-1)[0])
        if not 0 <= ran <= length:
            raise FeedError(f"foreach: {ran} steps asked of a loop over {length}")
    order = range(ran - 1, -1, -1) if reverse else range(ran)
    rows_of = [a.has_rows for a in body.args[:n_in]]   # a slice keeps the row axis: so did its input
    outs, states, saved = _run_steps(xp, body, xs, states, caps, rows_of, order, n_out, _save)
    rows = rows_in(values, body, n_in, n_state)
    result = [_stack(xp, [o[t] for t in range(ran)], length, body.outputs[k].shape, body.outputs[k].dtype, rows)
              for k, o in enumerate(outs)]
    result += states
    if _save:
        result += [_stack(xp, [s[t] for t in range(ran)], length, body.args[n_in + j].shape,
                          body.args[n_in + j].dtype, rows) for j, s in enumerate(saved)]
    return result


def _loop_vjp(g, node, *inputs, body, n_in, n_state, n_out, length, _has_count, _save, _differentiable,
              _in_vertex_function, _pick, shape, dtype, _types=None, **attrs):
    """The backward of foreach and while_loop: a reverse ``foreach`` over the saved pre-step states."""
    if not _differentiable:
        raise NotImplementedError(f"{node.label()} is the backward of a loop: its own gradient (second "
                                  "order) is not defined")
    if attrs.get("_residuals") is not None:   # its forward saved what the gradient reads
        count = _rowless_replay(node, inputs, [None] * n_state, None)[1] if "cond" in node.attrs else None
        found = saved_vjp(g, node, inputs, count)
        return found if found is not None else _replayed_vjp(g, node, inputs)
    cts = _cotangents(g, node)
    if _pick is not None:   # (a result of its own, in a vertex function)
        cts = {_pick[i]: c for i, c in cts.items()}
    is_while = "cond" in node.attrs   # (a while_loop holds its condition)
    reverse = attrs.get("reverse", False)
    xs, ss = list(inputs[:n_in]), list(inputs[n_in:n_in + n_state])
    caps = list(inputs[n_in + n_state:len(inputs) - (1 if _has_count else 0)])
    first_saved = n_out + n_state + (1 if is_while else 0)
    keeper = node
    if not _save:   # a one-result loop: replayed once, saving its states
        types = loop_types(node.op, body, ss, n_out, length, True)
        keeper = _tuple_node(node.op, inputs, dict(node.attrs, _save=True, _pick=None, dtype=types[0][1]), types)
    saved = [item(keeper, first_saved + j) for j in range(n_state)]
    count = item(keeper, n_out + n_state) if is_while else (inputs[-1] if _has_count else None)
    if _in_vertex_function:
        saved, count = _rowless_replay(node, inputs, saved, count)
    out_given = [k for k in range(n_out) if k in cts]
    cap_slots = [k for k, c in enumerate(caps) if c.dtype.is_float]   # by slot: a node may fill several
    # carried: the state cotangents (zero where none came back) and the captured values' gradient sums
    carried = [cts.get(n_out + j) if (n_out + j) in cts else zeros_like(s) for j, s in enumerate(ss)]
    carried += [zeros_like(caps[k]) for k in cap_slots]
    n_x = len(xs)

    def backward(step_in, carry, cap_t):
        x_t = step_in[:n_x]
        s_t = step_in[n_x:n_x + n_state]
        gy_t = step_in[n_x + n_state:]
        gs, gcap = carry[:n_state], carry[n_state:]
        res = body.inline(list(x_t) + list(s_t) + list(cap_t))
        ct = [None] * len(res)
        for k, c in zip(out_given, gy_t):
            ct[k] = c
        for j in range(n_state):
            ct[n_out + j] = gs[j]
        grads = _float_grads(res, ct, list(x_t) + list(s_t) + [cap_t[k] for k in cap_slots])
        gx = [gr if gr is not None else zeros_like(x) for gr, x in zip(grads[:n_x], x_t) if x.dtype.is_float]
        g_states = [gr if gr is not None else zeros_like(s) for gr, s in zip(grads[n_x:n_x + n_state], s_t)]
        g_caps = [acc + gr for acc, gr in zip(gcap, grads[n_x + n_state:])]
        return gx, g_states + g_caps

    # per-step inputs of the backward: the forward's inputs, its saved states, the outputs' cotangents
    step_inputs = xs + saved + [cts[k] for k in out_given]
    back_outs, back_finals = _backward_loop(backward, step_inputs, carried, caps, length, not reverse, count,
                                            _in_vertex_function)
    return _slot_grads(len(inputs), xs, ss, cap_slots, back_outs, back_finals)


def _replayed_vjp(g, node: Node, inputs) -> tuple:
    """A saving loop's gradient the generic way (a state its saved-values gradient leaves out, a step counter,
    has a cotangent): the gradient of a twin without the residuals, whose replay saves its states."""
    a = node.attrs
    n_user, n_res, n_state = a["n_out"] - a["_residuals"], a["_residuals"], a["n_state"]
    body = a["body"]
    plain = Subgraph(body.args, list(body.outputs[:n_user]) + list(body.outputs[a["n_out"]:]), body.name)
    attrs = {k: v for k, v in a.items() if k not in ("_residuals", "_types", "shape", "dtype")}
    types = loop_types(node.op, plain, list(inputs[a["n_in"]:a["n_in"] + n_state]), n_user, a["length"], True)
    twin = _tuple_node(node.op, inputs, dict(attrs, body=plain, n_out=n_user, dtype=types[0][1]), types)
    moved = [(i if i < n_user else i - n_res, part) for i, part in _cotangents(g, node).items() if not
             n_user <= i < a["n_out"]]
    ct = make_node("tuple_ct", [p for _, p in moved], {"index": tuple(i for i, _ in moved), "shape": twin.shape,
                                                       "dtype": twin.dtype})
    return _loop_vjp(ct, twin, *inputs, **twin.attrs)


def _slot_grads(n_inputs: int, xs: list, ss: list, cap_slots: list, back_outs: list, back_finals: list) -> tuple:
    """A loop's input gradients, one per slot (autodiff sums the slots of a node that fills several): the
    iterated inputs' from the backward's outputs, the states' and captured values' from its final carries."""
    grads: list = [None] * n_inputs
    float_xs = [i for i, x in enumerate(xs) if x.dtype.is_float]
    for i, gx in zip(float_xs, back_outs):
        grads[i] = gx
    for j, s in enumerate(ss):
        grads[len(xs) + j] = back_finals[j] if s.dtype.is_float else None
    for k, gc in zip(cap_slots, back_finals[len(ss):]):
        grads[len(xs) + len(ss) + k] = gc
    return tuple(grads)


def _rowless_replay(node: Node, inputs: Sequence[Node], saved: list, count: Node | None):
    """In a vertex function: the saved states without the row axis (a step counter) and a while_loop's
    count, from a replay of the loop over its values without the row axis alone.

    Such values are one for the whole batch (nothing per vertex reaches them, which is what lets a
    predicate be one value), but the replay of the whole loop, which saves the per-vertex states, is
    computed over a task's vertices, and ∂F must not read a value computed over a task's vertices in a
    per-vertex node (phases store values per vertex). Returns ``saved`` and ``count`` with those
    replaced; unchanged where the part without the row axis reads a per-vertex value."""
    a = node.attrs
    body, n_in, n_state, n_out, has_count = a["body"], a["n_in"], a["n_state"], a["n_out"], a["_has_count"]
    is_while = "cond" in a
    slots = [i for i, x in enumerate(inputs[:len(inputs) - (1 if has_count else 0)]) if not x.has_rows]
    states = [i - n_in for i in slots if n_in <= i < n_in + n_state]
    if not states and not is_while:
        return saved, count
    sub_body = _closed(body, slots, [n_out + j for j in states])
    sub_cond = _closed(a["cond"], [i - n_in for i in slots], [0]) if is_while else None
    if sub_body is None or (is_while and sub_cond is None):
        return saved, count
    iterated = [i for i in slots if i < n_in]
    attrs = dict(body=sub_body, n_in=len(iterated), n_state=len(states), n_out=0, length=a["length"],
                 _has_count=has_count, _save=True, _differentiable=False, _in_vertex_function=False, _pick=None)
    attrs.update({"cond": sub_cond} if is_while else {"reverse": a.get("reverse", False)})
    types = loop_types(node.op, sub_body, [inputs[n_in + j] for j in states], 0, a["length"], True)
    sub_inputs = [inputs[i] for i in slots] + ([inputs[-1]] if has_count else [])
    replay = _tuple_node(node.op, sub_inputs, dict(attrs, dtype=types[0][1]), types)
    first_saved = len(states) + (1 if is_while else 0)
    saved = list(saved)
    for k, j in enumerate(states):
        saved[j] = item(replay, first_saved + k)
    return saved, (item(replay, len(states)) if is_while else count)


def _closed(sub: Subgraph, arg_slots: list, output_slots: list) -> Subgraph | None:
    """``sub`` restricted to some of its args and outputs, or None where those outputs read another arg."""
    part = Subgraph([sub.args[i] for i in arg_slots], [sub.outputs[k] for k in output_slots], sub.name)
    return None if any(n.op == "input" for n in part.computed) else part


def _backward_loop(backward, step_inputs, carried, caps, length, reverse, count, split: bool):
    """Trace ``backward`` as a foreach body over ``step_inputs`` (with ``count``: only that many steps ran).

    The forward body's captured values ``caps`` enter the traced body as placeholders of their own, made
    captures of the loop afterwards: the body is differentiated with respect to those placeholders, so a
    captured value computed from another (``x`` and ``2 * x``) is not differentiated through the enclosing
    graph inside the body, which would count its gradient twice.

    ``split`` (in a vertex function): two nodes running the same loop, one for the per-vertex results (the
    inputs' and states' gradients) and one for those without the row axis (parameter gradients, summed over
    the vertices): ∂F computes a value without the row axis in the phase that reads it, and a node there
    must not mix the two."""
    n_step, n_carried = len(step_inputs), len(carried)

    def call(*formals):
        return backward(formals[:n_step], formals[n_step:n_step + n_carried], formals[n_step + n_carried:])

    n_out = []

    def unpack(result):
        flat = list(result[0]) + list(result[1])
        n_out.append(len(result[0]))
        return flat

    types = [(_step_shape(x, "backward input"), x.dtype) for x in step_inputs]
    types += [(v.shape, v.dtype) for v in list(carried) + list(caps)]
    traced, _ = trace(call, types, "backward", unpack)
    # the placeholders of ``caps`` are the args right before the trace's own captures: captures too
    traced = Traced(traced.graph, list(caps) + traced.captured)
    results = list(traced.graph.outputs)
    groups: list = [None]
    if split:
        with_rows = [i for i, r in enumerate(results) if r.has_rows]
        groups = [grp for grp in (with_rows, [i for i in range(len(results)) if i not in with_rows]) if grp]
    outs: list = [None] * n_out[0]
    finals: list = [None] * len(carried)
    for grp in groups:
        o, f, _ = _loop_node("foreach", step_inputs, carried, traced, n_out[0], length, {"reverse": reverse},
                             False, False, count=count, backward=True, _pick=grp)
        outs = [a if a is not None else b for a, b in zip(outs, o)]
        finals = [a if a is not None else b for a, b in zip(finals, f)]
    return outs, finals


register(OpDef("foreach", infer=_loop_infer, impl=_foreach_impl, vjp=_loop_vjp, fuse=False,
               tuple_valued=_is_tuple_node))


# --- while_loop ------------------------------------------------------------------------------------------

def while_loop(cond_fn: Callable, body: Callable, loop_vars: Sequence[Node] | Node, max_iterations: int,
               name: str | None = None):
    """``while cond_fn(vars) != 0 and steps < max_iterations: outputs_t, vars = body(vars)``.

    ``cond_fn(vars)`` returns one value (a size-1 shape without the row axis), true when nonzero (NaN
    included, as ``cond`` reads its predicate); it is read on the host once per iteration (on a device: one
    device-to-host copy per iteration). Inside a vertex function everything computed from a vertex's
    values is per vertex (a sum over its axes too), so the predicate reads values without the row axis: a
    loop state without it (a step counter), parameters, constants. ``body(vars)`` returns a pair
    (outputs, new_vars); ``vars`` is one node or a list, as given. Returns ``(outputs, final_vars, count)``.

    The shape rule for outputs sized by the iterations actually run: a static graph's shapes are known at
    declaration, so each output is stacked to ``max_iterations`` steps on the iteration axis (axis 0; axis 1
    for a value with the row axis), and ``count`` (an int64 scalar) says how many ran: steps ``count`` and
    later are zero. Gradients: the backward is a reverse ``foreach`` over the first ``count`` steps (the
    cotangents of the padding steps are ignored), with no gradient through the predicate."""
    what = f"while_loop '{name}'" if name else "while_loop"
    if not isinstance(max_iterations, (int, np.integer)) or max_iterations < 0:
        raise ShapeError(f"{what}: max_iterations must be a non-negative int, got {max_iterations!r}")
    vs, v_single = _as_list(loop_vars, f"{what} loop_vars")
    types = [(v.shape, v.dtype) for v in vs]

    def _pick(formals):
        return formals[0] if v_single else list(formals)

    cond_t, _ = trace(lambda *f: cond_fn(_pick(f)), types, f"{name or 'while'}.cond")
    (p,) = cond_t.graph.outputs if len(cond_t.graph.outputs) == 1 else (None,)
    if p is None or p.has_rows or any(d != 1 for d in p.shape):
        shown = "several values" if p is None else f"shape {fmt_shape(p.shape)}"
        raise ShapeError(f"{what}: the condition returns {shown}; it must be one value (a size-1 shape "
                         f"without the row axis): {_ONE_PREDICATE[bool(_rows_implicit.get())]}")
    n_out = []

    def unpack(result):
        flat = _unpack_pair(result, what)
        n_out.append(len(flat) - len(vs))
        return flat

    body_t, _ = trace(lambda *f: body(_pick(f)), types, name or "body", unpack)
    _check_states(body_t.graph, n_out[0], vs, what)
    captured = _merged_captures(body_t, cond_t)
    body_g, cond_g = _extend_captures(body_t, captured), _extend_captures(cond_t, captured)
    return _loop_node("while_loop", [], vs, Traced(body_g, captured), n_out[0], int(max_iterations),
                      {"cond": cond_g}, False, v_single)


_ONE_PREDICATE = {
    False: "per-row 'not done' masks reduce to one value with sum(...) over every axis",
    True: "inside a vertex function a value computed from the vertex's inputs stays per vertex, a sum too; "
          "compute it from values without the row axis: a loop state without it (a step counter), "
          "parameters, constants",
}


def _while_impl(xp, *values, body, cond, n_in, n_state, n_out, length, _has_count, _save, _differentiable,
                _in_vertex_function, _pick, shape, dtype, _types=None, _residuals=None):
    states, caps = list(values[:n_state]), list(values[n_state:])
    outs: list = [[] for _ in range(n_out)]
    saved: list = [[] for _ in states]
    ran = 0
    while ran < length and _host_true(cond.run(xp, states + caps)[0]):
        for j, s in enumerate(states):
            saved[j].append(s)
        res = body.run(xp, states + caps)
        for k in range(n_out):
            outs[k].append(res[k])
        states = res[n_out:]
        ran += 1
    rows = rows_in(values, body, 0, n_state)
    result = [_stack(xp, o, length, body.outputs[k].shape, body.outputs[k].dtype, rows) for k, o in enumerate(outs)]
    result += states
    result.append(xp.full((), ran, dtype=np.int64))   # made on the device: no host copy
    if _save:
        result += [_stack(xp, s, length, body.args[j].shape, body.args[j].dtype, rows)
                   for j, s in enumerate(saved)]
    if _pick is not None:
        result = [result[i] for i in _pick]
    return tuple(result) if _types is not None else result[0]


register(OpDef("while_loop", infer=_loop_infer, impl=_while_impl, vjp=_loop_vjp, fuse=False,
               tuple_valued=_is_tuple_node))
