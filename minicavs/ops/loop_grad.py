"""The gradient of a ``foreach`` or ``while_loop`` inside a vertex function from what its forward saved per step.

The generic loop gradient (control.py) replays the loop to get its per-step states, then runs a reverse loop
whose body re-applies the forward body to differentiate it, once for the per-vertex gradients and once more
over all rows for the parameters' (summed over the steps as a carried state). Here, instead, the forward loop
is one node that keeps, stacked per step (as ``(rows, T, ...)`` results of its own), its pre-step states and
the body's per-row values that the body's gradient reads (its *residuals*: a tanh's output, a sigmoid's), so:

- the backward is one reverse loop, once per task, whose body is the body's gradient alone: it reads the saved
  values as per-step inputs and recomputes no forward product;
- each parameter gradient, a sum over the steps of terms ``Aᵀ·B`` (a product's weight) or ``Σ_rows B`` (a
  bias), is computed after the loop from the stacked A and B: per step, one product over all the kind's rows
  (the lazy phase batches it as it does F's own parameter gradients), not one per task and step; in a static
  graph (one task) ONE product over every row and step (:func:`.linalg.steps_matmul`).

It applies where the body's parameter gradients are such sums and every per-step value has the row axis, bar
states without it that no per-row value reads (a while_loop's step counter: outside the gradient) (:func:`plan`);
captured per-row values' gradients are summed over the steps as carried values; a while_loop's reverse loop runs
over the steps it ran. Elsewhere control.py's generic gradient runs.
"""
from __future__ import annotations

from typing import Sequence

from ..core.dtypes import int64
from ..ir.graph import Graph, Node
from .autodiff import grad
from .elementwise import accum
from .flow import is_cond, is_loop
from .linalg import steps_matmul
from .nn import is_row_sparse
from .registry import make_node
from .sources import input as placeholder, zeros_like
from .hoist import closed, hoisted, hoisted_captures
from .subgraph import Subgraph, _cotangents, _tuple_node, item


def stacked_shape(shape: tuple, length: int) -> tuple:
    """A per-step value's shape stacked over ``length`` steps (axis 1 when it has the row axis, else 0)."""
    ax = 1 if shape and shape[0] is None else 0
    return shape[:ax] + (length,) + shape[ax:]


def loop_types(op: str, body: Subgraph, ss: list, n_out: int, length: int, save: bool) -> list:
    """(shape, dtype) of a loop's results: the stacked outputs, the final states (a while_loop's count),
    and with ``save`` the stacked pre-step states."""
    out_types = [(stacked_shape(o.shape, length), o.dtype) for o in body.outputs[:n_out]]
    state_types = [(s.shape, s.dtype) for s in ss]
    saved_types = [(stacked_shape(s.shape, length), s.dtype) for s in ss] if save else []
    return out_types + state_types + ([((), int64)] if op == "while_loop" else []) + saved_types


class Plan:
    """The body's gradient as a loop of its own: the per-step values it reads (the body's per-step args, the
    residuals, the given outputs' cotangents), the state cotangents it carries, per captured value without the
    row axis the terms of its gradient, ("mm", A, B, product node) or ("sum", None, B, sum node), over per-row
    values, and the captured per-row values with a gradient (summed over the steps as carried values).
    ``control``: the states without the row axis (a while_loop's step counter), which no per-row value reads:
    outside the gradient."""

    def __init__(self, body: Subgraph, n_in: int, n_state: int, n_user: int, given: Sequence[int],
                 control: frozenset = frozenset()):
        self.body, self.n_in, self.n_state = body, n_in, n_state
        args = body.args
        self.caps = list(args[n_in + n_state:])
        self.rows_states = [j for j in range(n_state) if j not in control]
        first_state = len(body.outputs) - n_state
        outs = [body.outputs[k] for k in given] + [body.outputs[first_state + j] for j in self.rows_states]
        self.cts = [placeholder(o.shape, o.dtype, name=f"d{o.name or 'y'}") for o in outs]
        wrt = [x for x in args[:n_in] if x.dtype.is_float] + [args[n_in + j] for j in self.rows_states] + [c for c in self.caps
                                                                                 if c.dtype.is_float]
        grads = grad(outs, wrt, self.cts, zeros=False)
        self.grads = dict(zip(wrt, grads))
        forward = set(body.nodes)
        back = [n for n in Graph([g for g in grads if g is not None]).nodes if n not in forward]
        read = {x for n in back for x in n.inputs} | {g for g in grads if g in forward}
        self.residuals = [n for n in body.computed if n in read and n.has_rows]
        self.terms = {c: grad_terms(self.grads[c]) for c in self.caps
                      if self.grads.get(c) is not None and not c.has_rows}
        self.row_caps = [c for c in self.caps if c.has_rows and self.grads.get(c) is not None]

    def applies(self) -> bool:
        """Can the gradient run from saved values: every captured value's gradient a sum of terms, no
        gradient row-sparse."""
        return all(t is not None for t in self.terms.values()) and not any(
            g is not None and is_row_sparse(g) for g in self.grads.values())


def grad_terms(g: Node) -> list | None:
    """``g`` (a captured value's gradient in the body) as a sum of ("mm", A, B, node): node = Aᵀ·B, and
    ("sum", None, B, node): node sums B over the rows, with A and B per-row matrices; None: not such a sum."""
    if g.has_rows:
        return None
    if g.op == "accum" or (g.op == "add" and all(x.shape == g.shape for x in g.inputs)):
        parts = [grad_terms(x) for x in g.inputs]
        return None if any(p is None for p in parts) else [t for p in parts for t in p]
    if g.op == "matmul":
        a, b = g.inputs
        if (a.op == "transpose" and a.attrs["perm"] == (1, 0) and a.inputs[0].has_rows and a.inputs[0].ndim == 2
                and b.has_rows and b.ndim == 2):
            return [("mm", a.inputs[0], b, g)]
    if g.op in ("sum_to", "sum") and g.attrs.get("axes") == (0,) and g.ndim == 1 and g.inputs[0].has_rows \
            and g.inputs[0].ndim == 2:
        return [("sum", None, g.inputs[0], g)]
    return None


def plan(xs: list, ss: list, body: Subgraph, n_out: int) -> Plan | None:
    """The saved-values gradient of a loop, when it applies: per-row inputs (int ones: labels, no gradient),
    float states and outputs of one dtype, bar states without the row axis that no per-row value reads (a step
    counter: outside the gradient), no control flow in the body."""
    control = frozenset(j for j, s in enumerate(ss) if not s.has_rows)
    values = [x for x in xs if x.dtype.is_float] + [s for j, s in enumerate(ss) if j not in control]
    if not values or not all(x.has_rows for x in xs):
        return None
    dtype = values[0].dtype
    if not all(v.has_rows and v.dtype == dtype and v.dtype.is_float for v in values):
        return None
    first_state = len(body.outputs) - len(ss)
    per_row = [o for k, o in enumerate(body.outputs) if k < first_state or k - first_state not in control]
    if not all(o.has_rows and o.dtype == dtype for o in per_row):
        return None
    if any(is_cond(n) or is_loop(n) for n in body.computed):
        return None
    if _reads(per_row, {body.args[len(xs) + j] for j in control}):
        return None
    found = Plan(body, len(xs), len(ss), n_out, range(n_out), control)
    return found if found.applies() else None


def _reads(outputs: list, values: set) -> bool:
    """Does any of ``outputs`` read one of ``values``?"""
    stack, seen = list(outputs), set()
    while stack:
        n = stack.pop()
        if n in values:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.inputs)
    return False


def saving_loop(op: str, xs: list, ss: list, traced, n_out: int, length: int, extra: dict, count,
                in_vf: bool = True) -> Node | None:
    """The forward node of a foreach or while_loop in a vertex function (or of a static graph's foreach,
    ``in_vf`` false) that keeps what its gradient reads (one tuple node: its outputs, its residuals stacked as
    further outputs, its final states, a while_loop's count, its saved pre-step states), or None where the
    saved-values gradient does not apply. A static graph's foreach may have a trip count per row (its last
    input): a finished row's residuals are zeros, its saved states those it kept."""
    body, captured = traced.graph, list(traced.captured)
    per_row = count is not None and count.has_rows and not in_vf and op == "foreach"
    if (count is not None and not per_row) or (not in_vf and op != "foreach"):
        return None
    if length:   # (a loop of no step computes no product)
        if op == "foreach" and not per_row:   # (per row: a padding's input reaches no weight's gradient)
            xs, body = hoisted(xs, len(ss), body, captured)
        body, captured, extra = _invariant_products(body, len(xs) + len(ss), captured, extra)
    found = plan(xs, ss, body, n_out)
    if found is None:
        return None
    n_res = len(found.residuals)
    kept = Subgraph(body.args, list(body.outputs[:n_out]) + found.residuals + list(body.outputs[n_out:]),
                    body.name)
    attrs = dict(extra, body=kept, n_in=len(xs), n_state=len(ss), n_out=n_out + n_res, length=length,
                 _has_count=per_row, _save=True, _differentiable=True, _in_vertex_function=in_vf, _pick=None,
                 _residuals=n_res, **({"_per_row": True} if per_row else {}))
    types = loop_types(op, kept, ss, n_out + n_res, length, True)
    inputs = xs + ss + captured + ([count] if per_row else [])
    return _tuple_node(op, inputs, dict(attrs, dtype=types[0][1]), types)


def _invariant_products(body: Subgraph, n_fixed: int, captured: list, extra: dict) -> tuple:
    """The body's products of captured values alone (``x · W`` of a vertex's captured input: the same at every
    step) made once before the loop (F's eager phase batches them over all rows), read as captured values of
    their own; a while_loop's condition takes the new captured values too (unread)."""
    body, made = hoisted_captures(body, n_fixed, captured)
    if not made:
        return body, captured, extra
    if "cond" in extra:
        test = extra["cond"]
        fresh = [placeholder(m.shape, m.dtype, name=f"{test.name}.unused") for m in made]
        extra = dict(extra, cond=Subgraph(list(test.args) + fresh, test.outputs, test.name))
    return body, captured + made, extra


def saved_vjp(g: Node, node: Node, inputs: Sequence[Node], count: Node | None = None) -> tuple | None:
    """The gradients of a saving loop's inputs: one reverse loop over the saved values (over the ``count``
    steps a while_loop ran: the iterated inputs' and the per-row states' gradients, the captured per-row
    values' summed as carried values, and the per-step values the other captured values' terms read), then
    each of those captured values' gradient summed over the steps from the stacked terms. None where a state
    outside the gradient (a step counter) has a cotangent: the caller's generic gradient then runs."""
    a = node.attrs
    body, n_in, n_state, n_out, n_res, length = (a["body"], a["n_in"], a["n_state"], a["n_out"], a["_residuals"],
                                                 a["length"])
    per_row = a.get("_per_row", False)
    if per_row:   # (its last input: the trip count per row, which the reverse loop runs by too)
        count, inputs = inputs[-1], inputs[:-1]
    n_user = n_out - n_res
    cts = _cotangents(g, node)
    control = frozenset(j for j in range(n_state) if not body.args[n_in + j].has_rows)
    if any(n_out + j in cts for j in control):
        return None
    given = [k for k in range(n_user) if k in cts]
    found = Plan(body, n_in, n_state, n_user, given, control)
    rows = found.rows_states
    first_saved = n_out + n_state + (1 if "cond" in a else 0)
    xs, ss, caps = list(inputs[:n_in]), list(inputs[n_in:n_in + n_state]), list(inputs[n_in + n_state:])
    step_args = list(body.args[:n_in]) + [body.args[n_in + j] for j in rows] + \
        list(body.outputs[n_user:n_user + n_res]) + found.cts[:len(given)]
    step_values = xs + [item(node, first_saved + j) for j in rows] + \
        [item(node, n_user + r) for r in range(n_res)] + [cts[k] for k in given]
    source = dict(zip(step_args, step_values))
    floats = [i for i, x in enumerate(body.args[:n_in]) if x.dtype.is_float]   # (int inputs: labels)
    gx = [_or_zeros(found.grads.get(body.args[i]), body.args[i]) for i in floats]
    # (a trip count per row: its terms summed in the loop, over the steps run; a product over every row and
    # step of its stacked values would also run over the steps past the batch's longest row)
    inside = found.row_caps + (list(found.terms) if per_row else [])
    terms = {c: t for c, t in found.terms.items() if c not in inside}
    vectors = list(dict.fromkeys(v for ts in terms.values() for _, A, B, _ in ts
                                 for v in (A, B) if v is not None and v not in source and v not in gx))
    gs = [_or_zeros(found.grads.get(body.args[n_in + j]), body.args[n_in + j]) for j in rows]
    sums = [placeholder(c.shape, c.dtype, name=f"sum:{c.name}") for c in inside]
    summed = [accum(acc, found.grads[c]) for acc, c in zip(sums, inside)]
    invariant = invariants(gx + vectors + gs + summed, set(found.caps))
    sub = closed(step_args + found.cts[len(given):] + sums + found.caps + invariant, gx + vectors + gs + summed,
                 f"{body.name}.backward")
    caps = caps + _outside(invariant, dict(zip(found.caps, caps)))
    cap_of = dict(zip(found.caps, inputs[n_in + n_state:]))
    carried = [cts[n_out + j] if n_out + j in cts else zeros_like(ss[j]) for j in rows]
    carried += [zeros_like(cap_of[c]) for c in inside]
    back = _backward_node(sub, step_values, carried, caps, len(gx) + len(vectors), length, a, count)
    n_back = len(gx) + len(vectors)
    grads = [item(back, floats.index(i)) if i in floats else None for i in range(n_in)]
    grads += [item(back, n_back + rows.index(j)) if j in rows else None for j in range(n_state)]
    source.update((v, item(back, len(gx) + i)) for i, v in enumerate(vectors))
    source.update((v, item(back, i)) for i, v in enumerate(gx) if v not in source)   # (a term's B: an input's gradient)
    sums_at = {c: item(back, n_back + len(rows) + i) for i, c in enumerate(inside)}
    grads += [sums_at[c] if c in sums_at else _summed(terms[c], source)
              if c in terms and length else None
              for c in body.args[n_in + n_state:]]   # (a loop of no step adds nothing)
    return tuple(grads) + ((None,) if per_row else ())


def _backward_node(sub: Subgraph, step_values: list, carried: list, caps: list, n_back: int, length: int,
                   forward: dict, count: Node | None) -> Node:
    """The reverse foreach of a saving loop's gradient (over ``count`` steps: those a while_loop ran)."""
    attrs = dict(body=sub, n_in=len(step_values), n_state=len(carried), n_out=n_back, length=length,
                 reverse=not forward.get("reverse", False), _has_count=count is not None, _save=False,
                 _differentiable=False, _in_vertex_function=False, _pick=None,
                 **({"_per_row": True} if forward.get("_per_row") else {}))
    types = loop_types("foreach", sub, carried, n_back, length, False)
    inputs = step_values + carried + caps + ([count] if count is not None else [])
    return _tuple_node("foreach", inputs, dict(attrs, dtype=types[0][1]), types)


def invariants(outputs: list, caps: set) -> list:
    """The values of the gradient's body that read captured values alone (a weight's transpose), where a
    value of a step reads them: computed once, before the loop (a static of ∂F), not at every step."""
    fixed: dict = {}

    def invariant(n: Node) -> bool:
        if n not in fixed:
            fixed[n] = n in caps or (bool(n.inputs) and not n.has_rows and n.op not in ("input", "param")
                                     and all(invariant(x) for x in n.inputs))
        return fixed[n]
    found, stack, seen = [], list(outputs), set()
    while stack:
        n = stack.pop()
        if n in seen or n in caps:
            continue
        seen.add(n)
        if invariant(n):
            found.append(n)
        else:
            stack.extend(n.inputs)
    return sorted(found, key=lambda n: n.id)


def _outside(values: list, caps: dict) -> list:
    """``values`` (nodes of a body over its captured placeholders) re-made over the loop's captured values."""
    mapping = dict(caps)
    made = []
    for v in values:
        inner = sorted(_between(v, mapping), key=lambda n: n.id)
        for n in inner:
            mapping[n] = make_node(n.op, tuple(mapping[x] for x in n.inputs), n.attrs)
        made.append(mapping[v])
    return made


def _between(v: Node, known: dict) -> set:
    out, stack = set(), [v]
    while stack:
        n = stack.pop()
        if n in known or n in out:
            continue
        out.add(n)
        stack.extend(n.inputs)
    return out


def _or_zeros(g: Node | None, x: Node) -> Node:
    return zeros_like(x) if g is None else g


def _summed(terms: list, source: dict) -> Node:
    """A captured value's gradient: each of its terms one product (one sum) over every row and step of its
    stacked values (:func:`.linalg.steps_matmul`: FLAT views, the steps' blocks read as rows)."""
    return accum(*(steps_matmul(source[A], source[B]) if kind == "mm" else
                   make_node("sum", (source[B],), {"axes": (0, 1), "keepdims": False})
                   for kind, A, B, _ in terms))
