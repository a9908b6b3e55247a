"""Fewer, larger GEMMs: products in F that read one operand become one product over a merged
weight, so a task runs one GEMM of N_1 + ... + N_n columns instead of n narrow ones (one call and one pass
over the left operand instead of n, which counts where a GEMM has a few dozen rows).

A candidate is a product ``x·W`` (``OpDef.product``, 2-D operands, plus the bias of a linear) whose left
operand has the vertex axis and whose right operand is row-free: a function of parameters and constants,
evaluated once per batch. Products whose left operands are the same value ``L``, or column blocks of one
concat ``L`` (the binary Tree-LSTM's ``[h1; h2]·U``, ``h1·U_f1``, ``h2·U_f2``), of the same class (eager /
recurrent / lazy, so that no eager or lazy product moves into the task loop) and dtype become::

    Y = L·[W_1' | ... | W_n'],    x_j·W_j + b_j = Y[:, o_j : o_j + N_j] + b_j

where ``W_j'`` is ``W_j`` with zero rows outside ``x_j``'s block of ``L`` (more flops for one call instead
of several: ``pad_limit``). The merged weight is a row-free node, concats of the
declared parameters, built once per batch; autodiff runs on the rewritten F, so ∂F gets the merged GEMMs
too (``dY·W'ᵀ`` and ``Lᵀ·dY``), and the concat's adjoint splits ``∂W'`` back into the parameters' gradients:
the parameters a user declared stay the parameters (names, checkpoints, optimizer state). ED-Batch §3.2
plans the memory of a whole static subgraph; this is its part about a product's weights: by default the
merged weight is copied once per batch (0.05 ms at the Tree-LSTM's hidden 128); with ``plan_layout``
(passes/layout.py) it is a view of a planned parameter buffer, and so are the biases, which the merged GEMM
then adds (``linear``). Whether a merge pays is measured, not assumed: see PAD_LIMIT and WEIGHT_LIMIT (a
view copies nothing, so WEIGHT_LIMIT does not bound it). The summation order inside a merged GEMM differs
(DESIGN.md's "equal" allows it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...ir.graph import Node, consumers, type_str
from ...ops import add, concat, constant, linear, matmul, slice_
from ...ops.registry import OPS, make_node
from ...runtime.vertex import VertexFunction
from . import layout
from .classify import classify


@dataclass(frozen=True)
class Merge:
    """One merged GEMM: ``products`` (F's declared nodes) now read column blocks of ``merged`` = ``left``
    times the merged weight. ``zero_entries``: entries of the merged weight that are padding."""

    left: Node
    products: tuple
    merged: Node
    zero_entries: int
    buffer: tuple | None = None   # the planned buffer's parameters (passes/layout.py) the weight is a view of
    bias_buffer: tuple | None = None   # the planned buffer the biases are a view of (added by the merged GEMM)

    def text(self) -> str:
        K, N = self.merged.inputs[1].shape
        pad = f", {self.zero_entries * 100 // max(1, K * N)}% of the weight zero padding" if self.zero_entries else ""
        how = (f"; weight a view of the planned buffer [{' | '.join(self.buffer)}]" if self.buffer is not None
               else f"; weight copied per batch ({K * N} entries)")
        if self.bias_buffer is not None:
            how += f", biases a view of [{' | '.join(self.bias_buffer)}]"
        return (f"{len(self.products)} products ({', '.join(map(_product_text, self.products))}) -> one GEMM "
                f"{type_str(self.left)} x ({K},{N}){pad}{how}")


def _product_text(p: Node) -> str:
    """``·W + b``: a product named by its weight and bias."""
    _, W, b = operands(p)
    return f"·{W.name or W.label()}" + ("" if b is None else f" + {b.name or b.label()}")


def operands(n: Node) -> tuple | None:
    """(left, right, bias or None) of a product that may merge, else None."""
    idx = OPS[n.op].product
    if idx is None:
        return None
    left, right = n.inputs[idx[0]], n.inputs[idx[1]]
    bias_input = OPS[n.op].bias_input
    bias = None if bias_input is None else n.inputs[bias_input]
    if (left.ndim != 2 or right.ndim != 2 or not left.has_rows or right.has_rows or left.dtype != right.dtype
            or (bias is not None and (bias.has_rows or bias.ndim != 1))):
        return None
    return left, right, bias


def _covers(nodes) -> dict:
    """value -> [(concat, first column, end)]: the concats among ``nodes`` holding it as a column block."""
    out: dict = {}
    for n in nodes:
        blocks = OPS[n.op].column_blocks
        found = blocks(n) if blocks is not None and n.has_rows else None
        for x, a, b in found or ():
            out.setdefault(x, []).append((n, a, b))
    return out


def _acyclic(nodes, deps) -> bool:
    """Whether ``deps`` (node -> the nodes it needs) orders ``nodes`` (Kahn's algorithm)."""
    member = set(nodes)
    waiting = {n: sum(1 for d in deps(n) if d in member) for n in nodes}
    users: dict = {n: [] for n in nodes}
    for n in nodes:
        for d in deps(n):
            if d in member:
                users[d].append(n)
    ready = [n for n, w in waiting.items() if w == 0]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        for u in users[n]:
            waiting[u] -= 1
            if not waiting[u]:
                ready.append(u)
    return done == len(nodes)


# What a merge costs and saves, measured per training step (batch 64, one BLAS thread, median process CPU
# time of steps alternating off/on: OPENBLAS_NUM_THREADS=1 python tools/bench_merge_gemms.py --models ...
# --pad-limit / --weight-limit): it saves GEMM calls, and costs a slice step per product (run in
# Python, a step costs about what a small GEMM call does), copies of the merged weight and its gradient
# every batch (0.05 ms for 256 x 1024), and, with padding, the flops on the zero blocks. The binary
# Tree-LSTM's padded merge (20% zeros) lost 4-7% at hidden 64 and 128, 16% at 192, 13% at 512, and 10% of
# the batch-1 forward latency at 128: no padding by default. An LSTM written one GEMM per gate (four
# products per operand) gained 4% (three runs: 4-12%) at hidden 64, was even at 128, lost 3-4% at 256
# (weights of 256 x 1024: the GEMM time is flops, the calls saved are few): merged weights up to
# WEIGHT_LIMIT entries only. The noise floor (the same program timed twice) was 1-2%.
PAD_LIMIT = 0
WEIGHT_LIMIT = 1 << 17


def _zero_entries(L: Node, members) -> int:
    return sum((L.shape[1] - (b - a)) * p.shape[1] for p, a, b in members)


def layout_names(L: Node, members) -> frozenset | None:
    """The parameter names of a group's weights when a planned buffer can hold them as adjacent column blocks
    (each weight a distinct trainable parameter, no padding); else None."""
    names = []
    for p, a, b in members:
        W = operands(p)[1]
        if W.op != "param" or W.attrs.get("frozen") or (a, b) != (0, L.shape[1]):
            return None
        names.append(W.name)
    return frozenset(names) if len(set(names)) == len(names) else None


def bias_names(members) -> tuple | None:
    """The bias parameters of a group's products, in the members' order, when a planned buffer can hold them
    as adjacent blocks (each product's bias a distinct trainable parameter); else None."""
    names = []
    for p, _, _ in members:
        bias = operands(p)[2]
        if bias is None or bias.op != "param" or bias.attrs.get("frozen"):
            return None
        names.append(bias.name)
    return tuple(names) if len(set(names)) == len(names) else None


def merge_groups(F: VertexFunction, pad_limit: int | None = None, weight_limit: int | None = None,
         views: bool = False) -> list[tuple]:
    """The groups to merge: [(L, [(product, first column of L, end)])], largest first.

    Each product joins at most one group; a group needs two products; a group whose merged GEMM would
    need its own output (L depends on one of its products, directly or through another group) is dropped;
    a group whose weight would hold more than ``pad_limit`` (default :data:`PAD_LIMIT`) zero entries keeps
    only the products of all of L; a group whose weight would hold more than ``weight_limit`` (default
    :data:`WEIGHT_LIMIT`) entries is not merged, unless ``views`` and its weights can be a view of a planned
    parameter buffer (:func:`layout_names`: no copy, so no weight to bound)."""
    pad_limit = PAD_LIMIT if pad_limit is None else pad_limit
    weight_limit = WEIGHT_LIMIT if weight_limit is None else weight_limit
    nodes = F.graph.nodes
    classes = classify(nodes, F.gathers.values(), [] if F.scattered is None else [F.scattered])
    covers = _covers(nodes) if pad_limit > 0 else {}
    candidates: dict = {}
    for p in nodes:
        ops_ = operands(p)
        if ops_ is None:
            continue
        x = ops_[0]
        for L, a, b in [(x, 0, x.shape[1])] + covers.get(x, []):
            candidates.setdefault((L, classes[p], p.dtype), []).append((p, a, b))
    # Largest groups first; among equals, less padding first, then declaration order (deterministic).
    ranked = sorted(candidates.items(), key=lambda kv: (
        -len(kv[1]), sum(kv[0][0].shape[1] - (b - a) for _, a, b in kv[1]), kv[0][0].id))
    taken, groups, member_of = set(), [], {}
    for (L, _, _), members in ranked:
        members = [m for m in members if m[0] not in taken]
        if _zero_entries(L, members) > pad_limit:
            members = [m for m in members if m[2] - m[1] == L.shape[1]]
        if len(members) < 2:
            continue
        viewable = views and layout_names(L, members) is not None
        if not viewable and L.shape[1] * sum(p.shape[1] for p, _, _ in members) > weight_limit:
            continue
        trial = dict(member_of)
        for p, _, _ in members:
            trial[p] = L

        def deps(n, trial=trial):
            return ((trial[n],) + tuple(x for x in n.inputs if not x.has_rows)) if n in trial else n.inputs
        if not _acyclic(nodes, deps):
            continue
        member_of = trial
        taken.update(p for p, _, _ in members)
        groups.append((L, sorted(members, key=lambda m: m[0].id)))
    return groups


def _zeros(shape, dtype) -> Node:
    return constant(np.zeros(shape, dtype.np), dtype)


def _merged_product(L: Node, members: list, biased: bool = False) -> tuple[Node, list]:
    """``L·W'`` for the group (``L·W' + b'`` with ``biased``: the members' biases concatenated, a view of a
    planned bias buffer) and the column offset of each member."""
    K = L.shape[1]
    columns, offsets, start = [], [], 0
    for p, a, b in members:
        W = operands(p)[1]
        N = W.shape[1]
        parts = ([_zeros((a, N), W.dtype)] if a else []) + [W] + ([_zeros((K - b, N), W.dtype)] if b < K else [])
        columns.append(concat(parts, axis=0))
        offsets.append(start)
        start += N
    if biased:
        return linear(L, concat(columns, axis=1), concat([operands(p)[2] for p, _, _ in members], axis=0)), offsets
    return matmul(L, concat(columns, axis=1)), offsets


def _block(merged: Node, product: Node, offset: int, biased: bool = False) -> Node:
    """The product's value: its column block of the merged GEMM, plus its bias unless the merged GEMM adds
    it (``biased``). Without a planned bias buffer the bias is added to the block, not to the merged GEMM,
    so that a fused consumer adds it in its kernel (as it does a linear's), with no pass over the whole
    output and no concat of the biases; ``(x·W) + b`` is what linear computes. With one, the merged GEMM
    adds the biases as the fused cell's linear does, and ∂F sums the merged output's gradient once instead
    of once per block."""
    bias = operands(product)[2]
    block = slice_(merged, offset, offset + product.shape[1], axis=1)
    return block if bias is None or biased else add(block, bias)


def merge_products(F: VertexFunction, pad_limit: int | None = None, weight_limit: int | None = None,
                   plan_layout: bool = False, planned: layout.Layout | None = None
                   ) -> tuple[VertexFunction, list[Merge]]:
    """F with its mergeable products merged (:func:`merge_groups`), and what was merged; F itself if nothing was.

    With ``plan_layout`` the groups' weights are laid out (passes/layout.py): each group a view of a planned
    parameter buffer where one order of the parameters serves it, its products in that order (a Merge's
    ``buffer``); the groups no order serves copy their weight per batch, within ``weight_limit``.
    ``planned``: the layout to follow (a model's, over all its functions: :func:`layout_groups`); default
    this function's own.

    The rewrite keeps every node that does not depend on a merged product (gathers, pulls, parameters and
    everything before the products are the same nodes) and rebuilds those downstream."""
    groups = merge_groups(F, pad_limit, weight_limit, views=plan_layout)
    if plan_layout:
        groups, buffer_of = _laid_out(groups, weight_limit, planned, F)
    else:
        buffer_of = {}
    if not groups:
        return F, []
    group_of = {p: i for i, (_, members) in enumerate(groups) for p, _, _ in members}
    built: dict = {}   # group index -> (merged node, {product: its column block of the merged output})
    new: dict = {}     # F's node -> the rewritten graph's node

    def needs(n):
        if n in group_of:
            L, members = groups[group_of[n]]
            return [L] + [x for p, _, _ in members for x in operands(p)[1:] if x is not None]
        return list(n.inputs)

    def build(n):
        if n in group_of:
            i = group_of[n]
            if i not in built:
                L, members = groups[i]
                weights, biases = buffer_of.get(i, (None, None))
                merged, offsets = _merged_product(new[L], members, biases is not None)
                blocks = {p: _block(merged, p, o, biases is not None) for (p, _, _), o in zip(members, offsets)}
                built[i] = (Merge(L, tuple(p for p, _, _ in members), merged, _zero_entries(L, members),
                                  weights, biases), blocks)
            return built[i][1][n]
        inputs = tuple(new[x] for x in n.inputs)
        if all(a is b for a, b in zip(inputs, n.inputs)):
            return n
        return make_node(n.op, inputs, n.attrs, n.name)

    _rewrite(F.outputs, needs, build, new)
    merged_F = F.rewritten(new[F.scattered] if F.scattered is not None else None,
                           {name: new[node] for name, node in F.pushes.items()})
    return merged_F, [built[i][0] for i in sorted(built)]



def _rewrite(outputs, needs, build, new: dict) -> None:
    """``new[n] = build(n)`` for every node the ``outputs`` need, after the nodes ``needs(n)`` names: depth
    first, without recursion (F can be deep)."""
    for out in outputs:
        stack = [out]
        while stack:
            n = stack[-1]
            if n in new:
                stack.pop()
                continue
            missing = [x for x in needs(n) if x not in new]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            new[n] = build(n)

def _named(groups: list, users: dict | None = None) -> list[tuple]:
    """[(parameter names, bytes of the merged weight)] of the groups a planned buffer could serve: with
    ``users`` (F's consumers), only parameters that F reads as a product's weight or bias and nowhere else
    (a view is then read by GEMMs alone, through its row stride)."""
    out = []
    for L, members in groups:
        names = layout_names(L, members)
        if names is not None and users is not None and not _only_products(members, users):
            continue
        if names is not None:   # (in declaration order: the buffer's order where the groups leave it free)
            ordered = sorted(members, key=lambda m: m[0].id)
            names = tuple(operands(p)[1].name for p, _, _ in ordered)
            out.append((names, L.shape[1] * sum(p.shape[1] for p, _, _ in members) * L.dtype.np.itemsize))
            biases = bias_names(ordered)
            if biases is not None:
                out.append((biases, sum(p.shape[1] for p, _, _ in members) * L.dtype.np.itemsize))
    return out


def _only_products(members, users: dict) -> bool:
    """Whether each member's weight (and bias) is read by products as their weight (bias) only."""
    for p, _, _ in members:
        for k, x in enumerate(operands(p)[1:]):
            if x is None:
                continue
            for u in users.get(x, ()):
                found = operands(u)
                if found is None or found[1 + k] is not x or found[0] is x or (k == 0 and found[2] is x):
                    return False
    return True


def layout_groups(F: VertexFunction) -> list[tuple]:
    """The weight groups of F's merges that a planned buffer could serve: [(parameter names, bytes a view
    saves per batch)], for :func:`minicavs.engine.passes.layout.solve` over all of a model's functions."""
    return _named(merge_groups(F, views=True), consumers(F.graph.nodes))


def _laid_out(groups: list, weight_limit, planned, F: VertexFunction) -> tuple[list, dict]:
    """The groups with each served one's members in its planned buffer's order, and group index -> the
    buffer's parameter names; a group no order serves keeps the copy only within ``weight_limit``."""
    weight_limit = WEIGHT_LIMIT if weight_limit is None else weight_limit
    solved = planned if planned is not None else layout.solve(_named(groups, consumers(F.graph.nodes)))
    position = solved.position()
    out, buffer_of = [], {}
    for L, members in groups:
        names = layout_names(L, members)
        if names is not None and solved.serves(names):
            members = sorted(members, key=lambda m: position[operands(m[0])[1].name][1])
            weights = tuple(solved.buffers[position[operands(members[0][0])[1].name][0]])
            biases = bias_names(members)
            served = biases is not None and solved.serves(biases) and _in_order(biases, position)
            buffer_of[len(out)] = (weights, tuple(solved.buffers[position[biases[0]][0]]) if served else None)
        elif L.shape[1] * sum(p.shape[1] for p, _, _ in members) > weight_limit:
            continue
        out.append((L, members))
    return out, buffer_of


def _in_order(names: tuple, position: dict) -> bool:
    """Whether ``names`` lie in their planned buffer in this order (the biases follow the weights' order)."""
    at = [position[n] for n in names]
    return all(b == at[0][0] for b, _ in at) and [k for _, k in at] == list(range(at[0][1], at[0][1] + len(at)))
