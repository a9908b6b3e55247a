"""Vertex functions used by the runtime tests, each a few lines, plus an engine-free reference.

The reference unrolls F over one sample's input graph into an ordinary static graph (cloning F's nodes with
gathers replaced by the children's values) and differentiates it with the core autodiff: it shares no code with
the scheduler, the memory plan or the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minicavs import ops
from minicavs.ops.autodiff import grad
from minicavs.engine.executor import Executor
from minicavs.ir.graph import Graph
from minicavs.engine.model import Model, Structure, leaf_internal
from minicavs.ops import make_node
from minicavs.runtime.vertex import VertexFunction

F64 = "float64"


@dataclass
class Case:
    model: Model
    params: dict
    data: callable            # data(rng, graph) -> per-sample feed arrays {name: array}
    kinds: callable = None    # graph -> kind name per vertex (for the reference)
    extra: dict = field(default_factory=dict)


def P(name, shape, rng, scale=0.5, dtype=F64):
    return ops.param_node(name, shape, dtype), rng.uniform(-scale, scale, shape).astype(dtype)


def _params(rng, dtype=F64, **shapes):
    nodes, values = {}, {}
    for name, shape in shapes.items():
        nodes[name], values[name] = P(name, shape, rng, dtype=dtype)
    return nodes, values


def _classifier(structure, p, H, C):
    hs = structure.pushed("h")
    labels = ops.input((None,), "int64", name="labels")
    return ops.sum(ops.softmax_cross_entropy(ops.linear(hs, p["Wo"], p["bo"]), labels)) * 0.5


def _one_kind_classifier(F, p, vals, H, D, C, dtype=F64) -> Case:
    """Every vertex pulls a D-vector and is classified into C labels."""
    s = Structure(F, pulls={"x": ops.input((None, D), dtype, name="xs")})
    model = Model(s, loss=_classifier(s, p, H, C))

    def data(rng, g):
        return {"xs": rng.standard_normal((g.num_vertices, D)).astype(dtype),
                "labels": rng.integers(0, C, g.num_vertices)}
    return Case(model, vals, data, lambda g: np.full(g.num_vertices, F.name))


def binary_tree_lstm(rng, H=3, D=2, V=7, C=3, p_drop=0.0, dtype=F64) -> Case:
    p, vals = _params(rng, dtype, E=(V, D), W=(D, 3 * H), bl=(3 * H,), U=(2 * H, 3 * H), bi=(3 * H,),
                      Uf1=(H, H), Uf2=(H, H), bf=(H,), Wo=(H, C), bo=(C,))
    leaf = VertexFunction("leaf", arity=0, message=(2 * H,), dtype=dtype)
    with leaf:
        x = leaf.pull((D,), "x")
        if p_drop:
            x = ops.dropout(x, p_drop, site=11)
        i, o, u = ops.split(ops.linear(x, p["W"], p["bl"]), 3)
        c = ops.sigmoid(i) * ops.tanh(u)
        h = ops.sigmoid(o) * ops.tanh(c)
        leaf.scatter(ops.concat([h, c]))
        leaf.push(h)
    internal = VertexFunction("internal", arity=2, message=(2 * H,), dtype=dtype)
    with internal:
        h1, c1 = ops.split(internal.gather(0), 2)
        h2, c2 = ops.split(internal.gather(1), 2)
        i, o, u = ops.split(ops.linear(ops.concat([h1, h2]), p["U"], p["bi"]), 3)
        f1 = ops.sigmoid(ops.linear(h1, p["Uf1"], p["bf"]))
        f2 = ops.sigmoid(ops.linear(h2, p["Uf2"], p["bf"]))
        c = ops.sigmoid(i) * ops.tanh(u) + f1 * c1 + f2 * c2
        if p_drop:
            c = ops.dropout(c, p_drop, site=12)
        h = ops.sigmoid(o) * ops.tanh(c)
        internal.scatter(ops.concat([h, c]))
        internal.push(h)
    words = ops.input((None,), "int64", name="words")
    s = Structure({"leaf": leaf, "internal": internal}, pulls={"x": ops.lookup(p["E"], words)}, kinds=leaf_internal)
    model = Model(s, loss=_classifier(s, p, H, C))

    def data(rng, g):
        leaves = int(np.sum(g.num_children() == 0))
        return {"words": rng.integers(0, V, leaves), "labels": rng.integers(0, C, g.num_vertices)}
    return Case(model, vals, data, lambda g: np.where(g.num_children() == 0, "leaf", "internal"))


def child_sum_tree_lstm(rng, arity=3, H=3, D=2, C=3, dtype=F64) -> Case:
    """Tai et al.'s child-sum Tree-LSTM (the paper's Fig. 4 with W^(u) for u): every vertex pulls x."""
    p, vals = _params(rng, dtype, Wi=(D, H), Ui=(H, H), bi=(H,), Wo_=(D, H), Uo=(H, H), bo_=(H,), Wu=(D, H),
                      Uu=(H, H), bu=(H,), Wf=(D, H), Uf=(H, H), bf=(H,), Wo=(H, C), bo=(C,))
    F = VertexFunction("cell", arity=arity, message=(2 * H,), dtype=dtype)
    with F:
        x = F.pull((D,), "x")
        hs, cs = zip(*(ops.split(F.gather(k), 2) for k in range(arity)))
        ht = ops.accum(*hs)
        i = ops.sigmoid(ops.linear(x, p["Wi"], p["bi"]) + ht @ p["Ui"])
        o = ops.sigmoid(ops.linear(x, p["Wo_"], p["bo_"]) + ht @ p["Uo"])
        u = ops.tanh(ops.linear(x, p["Wu"], p["bu"]) + ht @ p["Uu"])
        wx = ops.linear(x, p["Wf"], p["bf"])
        c = i * u
        for hk, ck in zip(hs, cs):
            c = c + ops.sigmoid(wx + hk @ p["Uf"]) * ck
        h = o * ops.tanh(c)
        F.scatter(ops.concat([h, c]))
        F.push(h)
    return _one_kind_classifier(F, p, vals, H, D, C, dtype)


def typed_child_sum_tree_lstm(rng, types=2, arity=3, H=3, D=2, C=3) -> Case:
    """Child-sum Tree-LSTMs of ``types`` kinds (t0, t1, ...: each its own parameters), the kind of each vertex
    given with its graph: a kind's vertices sit at many heights, so its rows of the scatter tensor are
    interleaved with the other kinds' (as 2Type's and the lattice's)."""
    names = [f"t{k}" for k in range(types)]
    shapes = {}
    for t in names:
        shapes.update({f"{t}.W": (D, 4 * H), f"{t}.U": (H, 3 * H), f"{t}.Uf": (H, H), f"{t}.b": (4 * H,)})
    p, vals = _params(rng, F64, Wo=(H, C), bo=(C,), **shapes)
    functions = {}
    for t in names:
        F = functions[t] = VertexFunction(t, arity=arity, message=(2 * H,), dtype=F64)
        with F:
            x = F.pull((D,), "x")
            hs, cs = zip(*(ops.split(F.gather(k), 2) for k in range(arity)))
            i, o, u, f = ops.split(ops.linear(x, p[f"{t}.W"], p[f"{t}.b"]), 4)
            iou = ops.split(ops.accum(*hs) @ p[f"{t}.U"], 3)
            c = ops.sigmoid(i + iou[0]) * ops.tanh(u + iou[2])
            for hk, ck in zip(hs, cs):
                c = c + ops.sigmoid(f + hk @ p[f"{t}.Uf"]) * ck
            h = ops.sigmoid(o + iou[1]) * ops.tanh(c)
            F.scatter(ops.concat([h, c]))
            F.push(h)
    s = Structure(functions, pulls={"x": ops.input((None, D), F64, name="xs")})
    model = Model(s, loss=_classifier(s, p, H, C))

    def data(rng, g):
        return {"xs": rng.standard_normal((g.num_vertices, D)), "labels": rng.integers(0, C, g.num_vertices)}
    return Case(model, vals, data, lambda g: list(g.kinds))


def chain_lstm(rng, H=3, D=2, C=4) -> Case:
    p, vals = _params(rng, Wx=(D, 4 * H), Wh=(H, 4 * H), b=(4 * H,), Wo=(H, C), bo=(C,))
    F = VertexFunction("lstm", arity=1, message=(2 * H,), dtype=F64)
    with F:
        h0, c0 = ops.split(F.gather(0), 2)
        i, f, o, u = ops.split(ops.linear(F.pull((D,)), p["Wx"], p["b"]) + h0 @ p["Wh"], 4)
        c = ops.sigmoid(f) * c0 + ops.sigmoid(i) * ops.tanh(u)
        h = ops.sigmoid(o) * ops.tanh(c)
        F.scatter(ops.concat([h, c]))
        F.push(h)
    return _one_kind_classifier(F, p, vals, H, D, C)


def per_row_matrices(rng, H=3, D=2, C=3, col_factor: bool = False) -> Case:
    """A chain whose vertices carry an H x H matrix each (per-row values of three axes, as MV-RNN's): products
    by a static on either side and by the child's matrix transposed, elementwise ops over the flat rows, a
    block of rows along the first vertex axis pushed. ``col_factor``: the matrix also scaled row by row by a
    per-row (H, 1) vector (a fused input broadcast along the last axis)."""
    p, vals = _params(rng, Wx=(D, H * H), bx=(H * H,), L=(H, H), R=(H, H), Wo=(H, C), bo=(C,))
    F = VertexFunction("m", arity=1, message=(H * H,), dtype=F64)
    with F:
        child = ops.reshape(F.gather(0), (H, H))
        x = ops.reshape(ops.linear(F.pull((D,)), p["Wx"], p["bx"]), (H, H))
        y = ops.tanh(p["L"] @ child @ p["R"] + ops.matmul(ops.transpose(child), x) * 0.5 + x)
        if col_factor:
            y = y * ops.slice_(x, 0, 1, axis=1)
        F.scatter(ops.reshape(y, (H * H,)))
        row = min(1, H - 1)   # (the second row: a column block that does not start at 0)
        F.push(ops.reshape(ops.slice_(y, row, row + 1, axis=0), (H,)))
    return _one_kind_classifier(F, p, vals, H, D, C)


def tree_fc_functions(p, H):
    leaf = VertexFunction("leaf", message=(H,), dtype=F64)
    with leaf:
        h = ops.tanh(ops.linear(leaf.pull((H,)), p["Wl"], p["bl"]))
        leaf.scatter(h)
        leaf.push(h)
    internal = VertexFunction("internal", arity=2, message=(H,), dtype=F64)
    with internal:
        h = ops.tanh(ops.linear(ops.concat([internal.gather(0), internal.gather(1)]), p["W"], p["b"]))
        internal.scatter(h)
        internal.push(h)
    return {"leaf": leaf, "internal": internal}


def tree_fc(rng, H=3) -> Case:
    """TensorFlow Fold's Tree-FC: the loss is the squared error of the root outputs only."""
    p, vals = _params(rng, Wl=(H, H), bl=(H,), W=(2 * H, H), b=(H,), wo=(H, 1), bo=(1,))
    xs = ops.input((None, H), F64, name="xs")
    s = Structure(tree_fc_functions(p, H), pulls={"x": xs}, kinds=leaf_internal)
    roots = ops.input((None,), "int64", name="roots")
    target = ops.input((None, 1), F64, name="target")
    r = ops.linear(ops.lookup(s.pushed("h"), roots), p["wo"], p["bo"])
    model = Model(s, loss=ops.sum(ops.square(r - target)))

    def data(rng, g):
        leaves = int(np.sum(g.num_children() == 0))
        return {"xs": rng.standard_normal((leaves, H)), "roots": g.roots(),
                "target": rng.uniform(-1, 1, (len(g.roots()), 1))}
    return Case(model, vals, data, lambda g: np.where(g.num_children() == 0, "leaf", "internal"),
                extra={"row_feeds": {"roots"}})


def pushed_outputs(rng, H=3, eager_child=False, share=True) -> Case:
    """A binary tree (or DAG) whose vertices push an output layer computed in F, so that ∂F computes parameter
    gradients in its eager phase: the leaves' output layer (Wlo, blo) only there, by one kind; with ``share``
    Wo there too (the leaves' share of it) and, as the internal vertices' recurrent path multiplies the left
    child's state by Wo, in their task loop (without lazy batching). ``eager_child``: the right child's state
    feeds only the pushed output (its gradient, added into the child's rows, is eager too)."""
    p, vals = _params(rng, Wl=(H, H), bl=(H,), W=(H if eager_child else 2 * H, H), b=(H,), Wo=(H, H), bo=(H,),
                      Wlo=(H, H), blo=(H,), Wg=(H, H))
    if not eager_child:
        del vals["Wg"]
    leaf = VertexFunction("leaf", message=(H,), dtype=F64)
    with leaf:
        h = ops.tanh(ops.linear(leaf.pull((H,)), p["Wl"], p["bl"]))
        leaf.scatter(h)
        y = ops.linear(h, p["Wlo"], p["blo"])
        leaf.push(y + ops.matmul(h, p["Wo"]) if share else y, name="y")
    internal = VertexFunction("internal", arity=2, message=(H,), dtype=F64)
    with internal:
        left, right = internal.gather(0), internal.gather(1)
        if eager_child:
            h = ops.tanh(ops.linear(left, p["W"], p["b"]) + ops.matmul(left, p["Wo"]))
            y = ops.linear(h, p["Wo"], p["bo"]) + ops.matmul(right, p["Wg"])
        else:
            h = ops.tanh(ops.linear(ops.concat([left, right]), p["W"], p["b"]) + ops.matmul(left, p["Wo"]))
            y = ops.linear(h, p["Wo"], p["bo"])
        internal.scatter(h)
        internal.push(y, name="y")
    xs = ops.input((None, H), F64, name="xs")
    s = Structure({"leaf": leaf, "internal": internal}, pulls={"x": xs}, kinds=leaf_internal)
    target = ops.input((None, H), F64, name="target")
    model = Model(s, loss=ops.sum(ops.square(s.pushed("y") - target)))

    def data(rng, g):
        leaves = int(np.sum(g.num_children() == 0))
        return {"xs": rng.standard_normal((leaves, H)), "target": rng.uniform(-1, 1, (g.num_vertices, H))}
    return Case(model, vals, data, lambda g: np.where(g.num_children() == 0, "leaf", "internal"))


def batch_feeds(case: Case, graphs, per_sample: list) -> dict:
    """Concatenate per-sample feeds in global vertex order; row-index feeds get sample offsets."""
    out = {}
    offsets = np.cumsum([0] + [g.num_vertices for g in graphs])
    for name in per_sample[0]:
        parts = [d[name] + (offsets[k] if name in case.extra.get("row_feeds", ()) else 0)
                 for k, d in enumerate(per_sample)]
        out[name] = np.concatenate(parts)
    return out


# --- the engine-free reference ------------------------------------------------------------------------

def clone(outputs, mapping):
    """Rebuild ``outputs`` with some nodes replaced; everything else is re-created with make_node."""
    new = dict(mapping)
    for n in Graph(outputs).nodes:
        if n in new:
            continue
        if n.op in ("input", "param", "constant"):
            new[n] = n
        else:
            new[n] = make_node(n.op, tuple(new[x] for x in n.inputs), n.attrs, name=n.name)
    return [new[o] for o in outputs]


def unrolled_reference(case: Case, g, feeds: dict):
    """Loss and parameter gradients of one sample by unrolling F over its graph (single structure)."""
    model = case.model
    (s,) = model.structures
    kinds = case.kinds(g)
    n = g.num_vertices
    scattered, pushed = [None] * n, {}
    pull_rank = {}
    for name in s.pulls:
        users = np.array([name in s.functions[k].pulls for k in kinds])
        pull_rank[name] = np.cumsum(users) - 1
    order = topo(g)
    for v in order:
        F = s.functions[kinds[v]]
        sub = {}
        for k, gnode in F.gathers.items():
            ch = g.children(v)
            sub[gnode] = (scattered[ch[k]] if k < len(ch)
                          else ops.constant(np.zeros((1,) + F.message), F64))
        for name, pnode in F.pulls.items():
            row = ops.constant(np.array([pull_rank[name][v]]), "int64")
            sub[pnode] = ops.lookup(s.pulls[name], row)
        outs = clone(list(F.outputs), sub)
        for o_old, o_new in zip(F.outputs, outs):
            if o_old is F.scattered:
                scattered[v] = o_new
            else:
                pushed.setdefault(o_old.name, {})[v] = o_new
    sub = {}
    for name, node in s._pushed.items():
        rows = [pushed[name][v] for v in range(n) if v in pushed[name]]
        sub[node] = ops.concat(rows, axis=0) if len(rows) > 1 else rows[0]
    (loss,) = clone([model.loss], sub)
    names = sorted(case.params)
    pnodes = {p.name: p for p in Graph([loss]).params}
    wrt = [pnodes[k] for k in names if k in pnodes]
    grads = grad(loss, wrt)
    values = Executor([loss] + grads).run(feeds, case.params)
    from minicavs.core.sparse import densify
    return float(values[0]), {p.name: densify(np, v) for p, v in zip(wrt, values[1:])}


def topo(g):
    """Children before parents, by a plain depth-first walk (test-only; the scheduler is vectorised)."""
    seen, out = set(), []
    for root in range(g.num_vertices):
        stack = [(root, False)]
        while stack:
            v, done = stack.pop()
            if done:
                out.append(v)
            elif v not in seen:
                seen.add(v)
                stack.append((v, True))
                stack.extend((int(c), False) for c in g.children(v) if int(c) not in seen)
    return out


def encoder_decoder(rng, H=3):
    """A Tree-FC encoder whose root state is pulled by every vertex of a chain decoder (§3.1's remark)."""
    p, vals = _params(rng, Wl=(H, H), bl=(H,), W=(2 * H, H), b=(H,), Wd=(2 * H, H), bd=(H,), wo=(H, 1),
                      bo=(1,))
    enc = Structure(tree_fc_functions(p, H), pulls={"x": ops.input((None, H), F64, name="xs")}, kinds=leaf_internal,
                    name="enc")
    roots = ops.input((None,), "int64", name="roots")          # encoder row of each sample's root
    dec_sample = ops.input((None,), "int64", name="dec_sample")  # sample of each decoder vertex
    context = ops.lookup(ops.lookup(enc.pushed("h"), roots), dec_sample)
    dec = VertexFunction("dec", arity=1, message=(H,), dtype=F64)
    with dec:
        h = ops.tanh(ops.linear(ops.concat([dec.gather(0), dec.pull((H,), "ctx")]), p["Wd"], p["bd"]))
        dec.scatter(h)
        dec.push(h)
    decs = Structure(dec, pulls={"ctx": context}, name="dec")
    target = ops.input((None, 1), F64, name="target")
    y = ops.linear(decs.pushed("h"), p["wo"], p["bo"])
    return Model([enc, decs], loss=ops.sum(ops.square(y - target))), vals
