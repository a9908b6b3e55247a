"""Products of a control-flow body over values from outside it, made before it (the phase analysis of a
vertex function then batches them as F's own products, over all rows before the task loop where they read per-row
inputs alone, and ∂F reads them as stored forward values instead of recomputing them).

- A ``foreach``'s products of a per-step input by a captured matrix (``x_t · W``) become one product of every
  step, ``(rows, T, D) · (D, H)``, the body reading its step's block (:func:`hoisted`).
- A ``cond``'s products of its operands and captured values (or views of them: a split of the state, a
  reshape, a transpose) are made before the branch (:func:`hoisted_cond`): both passes then run only
  elementwise work of the taken branch. The product is computed whichever branch runs (one value for the
  whole batch decides), so a non-finite value that only the untaken branch's product reads reaches that product
  (not the result: the taken branch never reads it; its gradient, the product's input times a zero cotangent).
"""
from __future__ import annotations

from ..ir.graph import Node
from .registry import OPS, make_node
from .sources import input as placeholder
from .subgraph import Subgraph


def closed(args: list, outputs: list, name: str, fresh: list | None = None) -> Subgraph:
    """A subgraph of ``outputs`` over placeholders standing for ``args`` (any nodes: a body's values cut there;
    ``fresh``: the placeholders, default new ones), every node between copied."""
    if fresh is None:
        fresh = [placeholder(x.shape, x.dtype, name=f"{name}.{i}") for i, x in enumerate(args)]
    mapping = dict(zip(args, fresh))
    inner, stack = {}, list(outputs)
    while stack:
        n = stack.pop()
        if n in mapping or n.id in inner:
            continue
        if n.op in ("input", "param"):
            raise AssertionError(f"{name}: {n.label()} is read but is none of the loop's values")
        inner[n.id] = n
        stack.extend(n.inputs)
    for i in sorted(inner):
        n = inner[i]
        mapping[n] = Node(n.op, tuple(mapping[x] for x in n.inputs), n.attrs, n.shape, n.dtype, n.name)
    return Subgraph(fresh, [mapping[o] for o in outputs], name)



def hoisted(xs: list, n_state: int, body: Subgraph, captured: list) -> tuple[list, Subgraph]:
    """The loop with the body's products of a per-step input by a captured matrix (``x_t · W``: nothing of the
    loop's state) made one product before it, of every step at once ((rows, T, D) · (D, H): F's eager phase
    runs it over all rows, as the unrolled F's products), the body reading its step's block as an input; inputs
    the body then no longer reads are dropped. Returns the loop's iterated inputs and body."""
    n_in = len(xs)
    x_args, caps = body.args[:n_in], body.args[n_in + n_state:]
    outer = dict(zip(x_args, xs)) | dict(zip(caps, captured))
    products = [n for n in body.computed if n.op == "matmul" and n.inputs[0] in x_args and n.inputs[1] in caps
                and n.inputs[0].ndim == 2 and n.inputs[1].ndim == 2 and n.dtype.is_float]
    if not products:
        return xs, body
    stacked = [make_node("matmul", (outer[p.inputs[0]], outer[p.inputs[1]])) for p in products]
    sub = closed(list(x_args) + products + list(body.args[n_in:]), list(body.outputs), body.name)
    read = {x for n in sub.computed for x in n.inputs} | set(sub.outputs)
    n_iter = n_in + len(products)
    keep = [i for i in range(n_iter) if sub.args[i] in read]
    values = list(xs) + stacked
    kept = Subgraph([sub.args[i] for i in keep] + list(sub.args[n_iter:]), sub.outputs, body.name)
    return [values[i] for i in keep], kept



def hoisted_captures(body: Subgraph, n_fixed: int, captured: list) -> tuple[Subgraph, list]:
    """The body with its products of captured values alone (args from ``n_fixed`` on, or views of them) made
    before it, over the values ``captured`` gives those args: returns the body reading each as a captured value
    of its own (its last args) and the products made (one node for the same product)."""
    caps = set(body.args[n_fixed:])
    products = [n for n in body.computed if OPS[n.op].product is not None and n.dtype.is_float
                and all(_outer(x, caps) for x in n.inputs)]
    if not products:
        return body, []
    made = _remade(products, dict(zip(body.args[n_fixed:], captured)))
    unique = list(dict.fromkeys(made))
    extra = [placeholder(m.shape, m.dtype, name=f"hoisted:{m.name or m.op}") for m in unique]
    fresh = [extra[unique.index(m)] for m in made]
    sub = closed(list(body.args) + products, list(body.outputs), body.name, list(body.args) + fresh)
    return Subgraph(list(body.args) + extra, sub.outputs, body.name), unique


def hoisted_cond(then: Subgraph, else_: Subgraph, values: list, n_operands: int,
                 eager_only: bool = False) -> tuple:
    """The two bodies of a cond over ``values`` (its operands, then the values it captured), with their
    products of those values (or of views of them) made before it: returns the bodies, reading each such
    product as a captured value of its own, and the cond's values (a captured value no body reads any more
    dropped). ``eager_only``: only the products that read no gathered value (F's eager phase makes them over
    all rows before the task loop); the others stay in their body, made only where it runs."""
    products = [n for body in (then, else_) for n in body.computed
                if OPS[n.op].product is not None and n.dtype.is_float
                and all(_outer(x, set(body.args)) for x in n.inputs)]
    made = _remade(products, dict(zip(then.args, values)) | dict(zip(else_.args, values)))
    if eager_only:
        eager = [not _gathered(m) for m in made]
        products = [p for p, e in zip(products, eager) if e]
        made = [m for m, e in zip(made, eager) if e]
    if not products:
        return then, else_, values
    extra = [placeholder(p.shape, p.dtype, name=f"hoisted:{p.name or p.op}") for p in products]
    bodies = [closed(list(b.args) + products, list(b.outputs), b.name, list(b.args) + extra) for b in (then, else_)]
    read = {x for b in bodies for n in b.computed for x in n.inputs} | {o for b in bodies for o in b.outputs}
    keep = [i for i in range(len(bodies[0].args)) if i < n_operands or any(b.args[i] in read for b in bodies)]
    values = list(values) + made
    return (*[Subgraph([b.args[i] for i in keep], b.outputs, b.name) for b in bodies], [values[i] for i in keep])


def _outer(x: Node, args: set) -> bool:
    """Is ``x`` a value from outside the body, or a view of one (a column block, a reshape, a transpose)?"""
    if x in args:
        return True
    native = OPS[x.op].native
    return bool(x.inputs) and native is not None and native(x) in ("cols", "alias", "transpose") and \
        _outer(x.inputs[0], args)


def _remade(nodes: list, outer: dict) -> list:
    """``nodes`` (of bodies over their args) made again over the values ``outer`` gives their args."""
    mapping, same = dict(outer), {}

    def make(n: Node) -> Node:
        if n not in mapping:   # (the same op of the same values in both bodies: one node)
            inputs = tuple(make(x) for x in n.inputs)
            key = (n.op, inputs, repr(sorted(n.attrs.items())))
            if key not in same:
                same[key] = make_node(n.op, inputs, n.attrs)
            mapping[n] = same[key]
        return mapping[n]
    return [make(n) for n in nodes]


def _gathered(x: Node) -> bool:
    """Does ``x`` read a gathered value (a child's message: F's recurrent part)?"""
    seen, stack = set(), [x]
    while stack:
        n = stack.pop()
        if n.op == "gather":
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.inputs)
    return False
