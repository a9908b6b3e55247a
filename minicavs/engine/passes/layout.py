"""Memory layout of the merged products' weights: an order of the parameters in one planned buffer per
group of products the engine runs together, so that each merged weight ``[W_1 | ... | W_n]`` is a column
block of that buffer (a view: no copy per batch, no padding) instead of a concat built every batch.

A merged GEMM (passes/gemm.py) needs its weights as adjacent column blocks of one row-major buffer, in the
order of its output's column blocks (which the pass is free to choose). Each group is a set of parameters
that must be consecutive in the buffer; several groups sharing a parameter constrain one order together.
That is the consecutive-ones problem ED-Batch (§3.2) solves with a PQ-tree (Booth and Lueker). Here the
sets are few and small (a cell's gates: a handful of parameters per buffer), so :func:`order` decides it
exactly by a search over prefixes of the order with the failed prefixes remembered (a subset dynamic
programme): it finds an order whenever one exists (the PQ-tree's answer, in another representation: both
are exact for the consecutive-ones property), in time exponential in a component's parameters only in the
worst case, which :data:`MAX_SEARCH` bounds. When no order serves every group, :func:`solve` keeps the
groups in order of the bytes their view saves per batch and drops a group only when it cannot join the
groups kept: the dropped groups copy their weight as before (the fewest copies by the greedy rule, exact
for the cells here; the general minimum is NP-hard).

Parameters stay per parameter: names, checkpoints, optimizer slots and gradients are the parameters', and
only their values become views of a planned buffer (:meth:`minicavs.nn.ParameterSet.plan_buffer`). That
moves their storage, so it is done once, before any array is handed out (Model.plan_buffers, called by the
Trainer when built), never by a run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from ...ops.registry import last_axis_block

MAX_SEARCH = 20   # parameters in one component above which a group is served only if disjoint from the rest


def order(elements: Sequence[Hashable], groups: Sequence[frozenset]) -> list | None:
    """An order of ``elements`` in which every group is a consecutive run, or None if there is none.

    Placing elements left to right, a group is *open* once some but not all of its members are placed; the
    next element must then belong to every open group, and a closed group takes no more members. Whether a
    prefix can be completed depends only on the set placed (the open groups follow from it), so a failed
    set is remembered and never searched again."""
    elements = list(dict.fromkeys(elements))
    groups = [g for g in dict.fromkeys(groups) if len(g) > 1]
    of: dict = {e: [i for i, g in enumerate(groups) if e in g] for e in elements}
    failed: set = set()
    placed: list = []
    count = [0] * len(groups)

    def can_place(e) -> bool:
        for i, g in enumerate(groups):
            if 0 < count[i] < len(g) and e not in g:
                return False               # an open group must be finished first
            if count[i] == len(g) and e in g:
                return False               # (cannot happen: e is unplaced; kept for clarity)
        return True

    def search(done: frozenset) -> bool:
        if len(done) == len(elements):
            return True
        if done in failed:
            return False
        for e in elements:
            if e in done or not can_place(e):
                continue
            placed.append(e)
            for i in of[e]:
                count[i] += 1
            if search(done | {e}):
                return True
            for i in of[e]:
                count[i] -= 1
            placed.pop()
        failed.add(done)
        return False

    return list(placed) if search(frozenset()) else None


@dataclass
class Layout:
    """The planned buffers: ``buffers`` lists each buffer's parameter names in column order; ``served``
    the groups (frozensets of names) whose weights are a view; ``copied`` those left to copy per batch."""

    buffers: list = field(default_factory=list)
    served: list = field(default_factory=list)
    copied: list = field(default_factory=list)

    def position(self) -> dict:
        """name -> (buffer index, rank in its buffer)."""
        return {n: (b, k) for b, names in enumerate(self.buffers) for k, n in enumerate(names)}

    def serves(self, names) -> bool:
        return frozenset(names) in set(self.served)


def _components(groups: Sequence[frozenset]) -> list[list[frozenset]]:
    """Groups joined by a shared parameter (union-find over the groups)."""
    parent = list(range(len(groups)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    owner: dict = {}
    for i, g in enumerate(groups):
        for e in g:
            if e in owner:
                parent[root(i)] = root(owner[e])
            else:
                owner[e] = i
    out: dict = {}
    for i, g in enumerate(groups):
        out.setdefault(root(i), []).append(g)
    return list(out.values())


def solve(groups: Sequence[tuple[Sequence, int]]) -> Layout:
    """The layout serving the most bytes of ``groups`` ([(parameter names, bytes a view saves per batch)]):
    groups by bytes saved (then by name, deterministic); each joins if an order serves it with those kept.
    Where the groups leave the order free, the names keep the order they first appear in."""
    rank: dict = {}
    for names, _ in groups:
        for n in names:
            rank.setdefault(n, len(rank))
    saved: dict = {}
    for names, size in groups:
        saved[frozenset(names)] = max(size, saved.get(frozenset(names), 0))
    ranked = sorted(saved.items(), key=lambda kv: (-kv[1], sorted(kv[0])))
    kept: list = []
    layout = Layout()
    for g, _ in ranked:
        trial = kept + [g]
        component = next(c for c in _components(trial) if g in c)
        elements = sorted({e for c in component for e in c}, key=rank.__getitem__)
        if len(elements) > MAX_SEARCH and len(component) > 1:
            layout.copied.append(g)
            continue
        if order(elements, component) is None:
            layout.copied.append(g)
        else:
            kept.append(g)
    for component in _components(kept):
        elements = sorted({e for c in component for e in c}, key=rank.__getitem__)
        layout.buffers.append(order(elements, component))
    layout.served = kept
    return layout


def gradient_blocks(direct: dict, program: list) -> dict:
    """{G: ((parameter, first column, end), ...)} for each row-free matrix or vector G whose column blocks
    (blocks of its last axis), side by side and covering it, are the gradients of several parameters
    (``direct``: gradient node -> parameter) and which no other step reads: the merged GEMM's ∂W' = Lᵀ·dY
    and ∂b' = Σ dY, each computed into one buffer whose blocks the parameters' gradients are (no GACC per
    parameter, no zeros)."""
    blocks: dict = {}
    for g, name in direct.items():
        if last_axis_block(g) is not None and g.ndim in (1, 2) and not g.inputs[0].has_rows:
            blocks.setdefault(g.inputs[0], []).append((g, name))
    readers: dict = {}
    for step in program:
        for x in step.inputs:
            readers.setdefault(x, set()).update(step.outputs)
    out = {}
    for G, parts in blocks.items():
        parts.sort(key=lambda gn: last_axis_block(gn[0]))
        spans = [last_axis_block(g) for g, _ in parts]
        edges = [0] + [b for _, b in spans]
        if (len(parts) < 2 or G in direct or edges[-1] != G.shape[-1]
                or any(a != e for (a, _), e in zip(spans, edges)) or readers.get(G, set()) - {g for g, _ in parts}):
            continue
        out[G] = tuple((name, a, b) for (_, name), (a, b) in zip(parts, spans))
    return out
