"""The gradient of a ``cond`` inside a vertex function from what its taken branch saved.

The generic cond gradient (cond.py) is a cond of the two bodies' backward graphs, each re-applying its forward
body to differentiate it, once per gradient, and once more over all rows for each parameter's. Here, instead, the
forward cond is one tuple node that also keeps, as per-row results of its own, the values its taken body's
gradient reads (its *residuals*: a sigmoid's output, a tanh's), so:

- ∂F's cond is one tuple node whose bodies are the two bodies' gradients alone: they read the saved values and
  recompute no forward op; it yields the per-row values' gradients and, per side, the per-row values its
  parameters' gradients read;
- each parameter gradient, a sum of terms ``Aᵀ·B`` (a product's weight) or ``Σ_rows B`` (a bias), is a cond of
  its own after the task loop over those values (the lazy phase batches it over all the kind's rows, as F's own
  parameter gradients); the side that does not read the parameter gives zeros of its shape (once, not per row).

Results one side computes (its residuals, its gradient's per-row values) are *side results*: the other side never
writes them (the tuple's ``_sides``: results, then-side's, else-side's), and only a branch on the same side of the
same pred reads them. The untaken body, NaN or not, is never run, forward or backward.

It applies (:func:`saving_cond`) where both bodies' results and residuals are per-row values, no body holds
control flow and each parameter's gradient is such a sum; elsewhere cond.py's generic gradient runs.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..ir.graph import Graph, Node
from .autodiff import grad, needs_gradient
from .elementwise import accum
from .flow import is_cond, is_loop
from .hoist import closed
from .loop_grad import grad_terms, invariants
from .registry import OPS, make_node
from .sources import input as placeholder, zeros_like
from .subgraph import Subgraph, _cotangents, _tuple_node, item


def _view_base(x: Node, args: set) -> Node | None:
    """The value ``x`` is a view of (a column block, a reshape, a transpose: free to take again), ``x`` itself
    when it is no view; None when it is an arg, a view of one or a literal (∂F takes those again)."""
    while True:
        if x in args:
            return None
        opdef = OPS[x.op]
        if opdef.source and not x.inputs:
            return None
        native = opdef.native(x) if opdef.native is not None else None
        if not (x.inputs and (opdef.identity or native in ("cols", "alias", "transpose"))):
            return x
        x = x.inputs[0]


class Side:
    """One body's gradient over its saved values: the cotangents it reads, each arg's gradient, the residuals
    (the body's values its gradient reads, bar views of args and literals) and each value without the row
    axis's gradient as a sum of terms (loop_grad.grad_terms)."""

    def __init__(self, body: Subgraph, n_out: int, given: Sequence[int]):
        self.body = body
        outs = [body.outputs[k] for k in given]
        self.cts = [placeholder(o.shape, o.dtype, name=f"d{o.name or 'y'}") for o in outs]
        wrt = [a for a in body.args if a.dtype.is_float]
        grads = grad(outs, wrt, self.cts, zeros=False) if outs else [None] * len(wrt)
        self.grads = dict(zip(wrt, grads))
        forward, args = set(body.nodes), set(body.args)
        back = [n for n in Graph([g for g in grads if g is not None]).nodes if n not in forward] if outs else []
        read = {x for n in back for x in n.inputs if x in forward} | {g for g in grads if g in forward}
        bases = {_view_base(x, args) for x in read} - {None}
        self.residuals = sorted(bases, key=lambda n: n.id)
        self.terms = {a: grad_terms(g) for a, g in self.grads.items() if g is not None and not a.has_rows}

    def applies(self) -> bool:
        """Per-row residuals, every rowless value's gradient a sum of terms, no control flow in the body."""
        return (all(r.has_rows and r.dtype.is_float for r in self.residuals)
                and all(t is not None for t in self.terms.values())
                and not any(is_cond(n) or is_loop(n) for n in self.body.computed))


def saving_cond(pred: Node, then: Subgraph, else_: Subgraph, values: list, n_operands: int) -> list | None:
    """The results of a cond in a vertex function as items of one tuple node that keeps each side's residuals
    (side results), or None where the saved-values gradient does not apply."""
    outs = then.outputs
    if not outs or not all(o.has_rows and o.dtype.is_float for o in list(outs) + list(else_.outputs)):
        return None
    n_out = len(outs)
    sides = [Side(body, n_out, range(n_out)) for body in (then, else_)]
    if not all(s.applies() for s in sides):
        return None
    bodies = [Subgraph(b.args, list(b.outputs) + s.residuals, b.name) for b, s in zip((then, else_), sides)]
    types = [(o.shape, o.dtype) for o in outs] + [(r.shape, r.dtype) for s in sides for r in s.residuals]
    attrs = {"then": bodies[0], "else_": bodies[1], "n_operands": n_operands, "_in_vertex_function": True,
             "_sides": (n_out, len(sides[0].residuals), len(sides[1].residuals)), "dtype": outs[0].dtype}
    node = _tuple_node("cond", [pred] + list(values), attrs, types)
    return [item(node, k) for k in range(n_out)]


def side_slots(sides: tuple) -> tuple[range, range]:
    """The result indices of the then-side's and the else-side's side results."""
    n_out, n_then, n_else = sides
    return range(n_out, n_out + n_then), range(n_out + n_then, n_out + n_then + n_else)


def side_results(xp, outs: list, sides: tuple, taken: bool, types: tuple, rows: int) -> list:
    """A side's results as the tuple's (its own side results in their slots, zeros in the other side's, of
    ``rows`` rows)."""
    n_out, n_then, n_else = sides
    other = [xp.zeros((rows,) + tuple(s[1:]), dtype=d.np) for s, d in types[n_out:]]
    own = outs[n_out:]
    if taken:
        return list(outs[:n_out]) + list(own) + other[n_then:]
    return list(outs[:n_out]) + other[:n_then] + list(own)


def saved_cond_vjp(g: Node, node: Node, pred: Node, args: Sequence[Node], cond: Callable) -> tuple:
    """The gradients of a saving cond's values: one tuple cond over the saved values (the per-row values'
    gradients; per side, the per-row values its terms read), then each value without the row axis's gradient
    as a cond (``cond``: cond.cond) of its terms' sums over those."""
    a = node.attrs
    n_out = a["_sides"][0]
    cts = _cotangents(g, node)
    given = [k for k in range(n_out) if k in cts]
    bodies = (a["then"], a["else_"])
    sides = [Side(Subgraph(b.args, b.outputs[:n_out], b.name), n_out, given) for b in bodies]
    saved = [[item(node, i) for i in slots] for slots in side_slots(a["_sides"])]
    per_row = [i for i, x in enumerate(args) if x.dtype.is_float and x.has_rows and needs_gradient(x)]
    rowless = [i for i, x in enumerate(args) if x.dtype.is_float and not x.has_rows and needs_gradient(x)]
    operands = list(args) + saved[0] + saved[1] + [cts[k] for k in given]
    slots = _Slots(operands, len(args), [len(s) for s in saved])
    grads: list = [None] * len(args)
    vectors, outer_terms = _per_row_cond(pred, bodies, sides, slots, per_row, grads, n_out)
    for i in rowless:
        grads[i] = _rowless_cond(cond, pred, args[i], [sides[k].terms.get(bodies[k].args[i]) for k in (0, 1)],
                                 vectors, outer_terms)
    return (None, *grads)


class _Slots:
    """The backward cond's operands and the placeholders standing for them in either body: the forward cond's
    values, the then-side's residuals, the else-side's, the given cotangents."""

    def __init__(self, operands: list, n_values: int, n_saved: list):
        self.operands = operands
        self.n_values, self.n_saved = n_values, n_saved
        self.fresh = [placeholder(x.shape, x.dtype, name=f"back.{i}") for i, x in enumerate(operands)]

    def extend(self, values: list) -> None:
        """More operands (values made outside the cond), each with a placeholder."""
        self.fresh += [placeholder(x.shape, x.dtype, name=f"back.{len(self.operands) + i}")
                       for i, x in enumerate(values)]
        self.operands += values

    def cut(self, side: int, s: Side, residuals: list) -> dict:
        """Side ``side``'s nodes (its args, its residuals, its cotangents) -> their placeholders."""
        first = self.n_values + (0 if side == 0 else self.n_saved[0])
        cut = dict(zip(s.body.args, self.fresh[:self.n_values]))
        cut.update(zip(residuals, self.fresh[first:first + len(residuals)]))
        cut.update(zip(s.cts, self.fresh[self.n_values + sum(self.n_saved):len(self.fresh)]))
        return cut

    def outer(self, side: int, s: Side, residuals: list) -> dict:
        """Side ``side``'s nodes -> the values outside the cond they are (its args, its residuals' items, its
        cotangents)."""
        cut = self.cut(side, s, residuals)
        mine = dict(zip(self.fresh, self.operands))
        return {n: mine[p] for n, p in cut.items()}


def _per_row_cond(pred, bodies, sides, slots: _Slots, per_row: list, grads: list, n_out: int):
    """The backward tuple cond: the per-row values' gradients (zeros on a side that does not read one), then
    each side's per-row term values; sets ``grads`` and returns, per side, {term value: its value outside} and
    the map of every side's cut nodes to their outside values. A body's values that read values without the
    row axis alone (a weight's transpose) are made outside it, once per batch (statics of ∂F)."""
    parts, vectors, outer, common = [], [], {}, []
    for k, (body, s) in enumerate(zip(bodies, sides)):
        residuals = list(body.outputs[n_out:])
        cut = slots.cut(k, s, residuals)
        outer.update(slots.outer(k, s, residuals))
        mine = [s.grads.get(body.args[i]) for i in per_row]
        shared = {g: i for g, i in zip(mine, per_row) if g is not None}   # (a term's value that is one: its item)
        mine = [g if g is not None else zeros_like(body.args[i]) for g, i in zip(mine, per_row)]
        terms = [v for ts in s.terms.values() for _, A, B, _ in ts for v in (A, B) if v is not None]
        wanted = list(dict.fromkeys(v for v in terms if v not in cut and v not in shared
                                    and _view_base(v, set(cut)) is not None))
        common.append(shared)
        fixed = invariants(mine + wanted, {a for a in body.args if not a.has_rows})
        parts.append((body, cut, mine + wanted, fixed))
        vectors.append(wanted)
    fixed = [f for _, _, _, fs in parts for f in fs]
    slots.extend([_remade(f, outer) for f in fixed])
    at = dict(zip(fixed, slots.fresh[len(slots.fresh) - len(fixed):]))
    subs = []
    for body, cut, outs, fs in parts:
        cut = dict(cut) | {f: at[f] for f in fs}
        sub = closed(list(cut), outs, f"{body.name}.backward", list(cut.values()))
        subs.append(Subgraph(slots.fresh, sub.outputs, sub.name))
    n_common = len(per_row)
    if n_common + len(vectors[0]) + len(vectors[1]) == 0:
        return [{}, {}], outer
    types = [(bodies[0].args[i].shape, bodies[0].args[i].dtype) for i in per_row]
    types += [(v.shape, v.dtype) for vs in vectors for v in vs]
    attrs = {"then": subs[0], "else_": subs[1], "n_operands": len(slots.operands), "_in_vertex_function": False,
             "_sides": (n_common, len(vectors[0]), len(vectors[1])), "dtype": types[0][1]}
    back = _tuple_node("cond", [pred] + slots.operands, attrs, types)
    for j, i in enumerate(per_row):
        grads[i] = item(back, j)
    then_slots, else_slots = side_slots(attrs["_sides"])
    found = [dict(zip(vectors[0], (item(back, i) for i in then_slots))),
             dict(zip(vectors[1], (item(back, i) for i in else_slots)))]
    for k in (0, 1):
        found[k].update((v, grads[i]) for v, i in common[k].items())
    return found, outer


def _rowless_cond(cond: Callable, pred, value: Node, terms: list, vectors: list, outer: dict) -> Node | None:
    """A value without the row axis's gradient: a cond of each side's sum of its terms over the values outside
    (zeros on a side without terms); None where no side has any."""
    if all(t is None for t in terms):
        return None
    reads: list = []

    def where(v: Node, k: int) -> Node:
        found = vectors[k].get(v)
        if found is None:
            found = _remade(v, outer)
        if found not in reads:
            reads.append(found)
        return found
    picked = [[(kind, where(A, k) if A is not None else None, where(B, k), made) for kind, A, B, made in ts]
              if ts else None for k, ts in enumerate(terms)]

    def side(k):
        def body(*formals):
            at = dict(zip(reads, formals))
            if picked[k] is None:
                return zeros_like(value)
            parts = [make_node("matmul", (make_node("transpose", (at[A],), {"perm": (1, 0)}), at[B]))
                     if kind == "mm" else make_node(made.op, (at[B],), made.attrs)
                     for kind, A, B, made in picked[k]]
            return accum(*parts) if len(parts) > 1 else parts[0]
        body.__name__ = f"{'then' if k == 0 else 'else'}.grad"
        return body
    got = cond(pred, side(0), side(1), reads)
    return got[0] if isinstance(got, list) else got


def _remade(v: Node, outer: dict) -> Node:
    """``v`` (a body's node over its cut nodes: a view of an arg, a residual) made over the values outside."""
    if v not in outer:   # (kept, and one node for the same op of the same values: a view both sides read)
        inputs = tuple(_remade(x, outer) for x in v.inputs)
        key = (v.op, inputs, repr(sorted(v.attrs.items())))
        outer[v] = outer.setdefault(key, make_node(v.op, inputs, v.attrs))
    return outer[v]
