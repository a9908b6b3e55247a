"""Static graphs (the pulls' stages, the classifier head and loss on top of a structure, the backward's push and
parameter gradients) as instruction programs, run by the device's runner as F is.

A static graph is a vertex function with one task and no messages: its rows are the batch's rows (samples, or a
structure's pushed rows), its operands feeds, parameters and the structures' values. So its steps, fused as F's
(compile.lower), are lowered by F's own step lowering (instructions.py) into one template, run once per pass as
one task of all the rows (kind 0, offset 0, rows the run's row count): a :class:`~.lowered.Lowered` bound per
run (program.BatchProgram.of, the one binder) and run by the C runner, the CUDA issuing loop or the reference
runner. The row functions no other opcode computes (softmax, the cross-entropy and its gradient, a row
broadcast) are ROWOP; a lookup of rows is TAKE, by a matrix of ids (rows x k) one TAKETO per step into its
column block. Its gradient stays row-sparse (the optimizer updates a table's looked-up rows): the host pairs the
rows the program hands out with the fed ids (static_sparse.py; a sum's rows stacked by the program), and a graph
whose program would only move rows (a pull stage's lookups) is gathered on the host instead (:attr:`host`).

What no runner takes stays on the step runner (program.run_steps), before the program (what the program reads)
or after it (what reads the program's values), each node with why (:attr:`Split.left`): an integer
value, control flow the lowering declines, a row-sparse gradient of rows computed after the program, an op with
no instruction, rows of another count than the program's. No bundled model leaves a node there
(tests/engine/test_lowered_refusals.py).

Memory: the program's values live in the run's scratch and fixed arenas, sized per run by the binder from the
row count (operands.scratch_elements: the template's scratch columns x the rows), kept by the program from run
to run and grown when a larger batch comes; what leaves the program (the values later graphs and the model
read) is copied into arrays made per run.
"""
from __future__ import annotations

import numpy as np

from ..core.errors import FeedError
from ..core.validate import check_labels, indices
from ..ir.graph import Node
from ..ops.flow import is_cond, is_loop
from ..ops.nn import is_row_sparse
from ..ops.registry import OPS, holds_tuple
from ..ops.subgraph import item_index
from . import instructions, reference
from .backend import to_host
from .compile import TASK, Step, lower
from .codegen.machine import OPS as OPCODE
from .lowered import NONE, TASK_COLUMNS, Lowered, Template, _cols, _rows
from .passes.fusion import fusible
from . import program as steps_runner
from .program import BatchProgram, RunContext, _located, is_fed, leaf_value, record
from . import row_trips, static_loops, static_sparse


def _rowy(n: Node) -> bool:
    """Has ``n`` the run's row axis somewhere (a per-row value, or its transpose; a loop's tuple over rows)?"""
    return None in n.shape or (holds_tuple(n) and any(None in x.shape for x in n.inputs))


class _Classes:
    """Which values have the same row count: union-find over the graph's nodes with a row axis (a lookup's
    rows are its indices', not its table's; a lookup gradient's its table's)."""

    def __init__(self, nodes):
        self.parent: dict = {}
        for n in nodes:
            for group in _same_rows(n):
                rowy = [x for x in group if _rowy(x)]
                for x in rowy[1:]:
                    self.union(rowy[0], x)

    def find(self, n: Node) -> Node:
        root = n
        while self.parent.get(root, root) is not root:
            root = self.parent[root]
        return root

    def union(self, a: Node, b: Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb


def _same_rows(n: Node) -> list:
    """Groups of ``n`` and its inputs whose row counts are one (OpDef.row_groups)."""
    groups = OPS[n.op].row_groups
    return [(n,) + tuple(n.inputs)] if groups is None else groups(n)


def _register_inputs(n: Node) -> tuple:
    """The inputs of ``n`` that the program reads as registers (a lookup's table and indices, the labels:
    buffers)."""
    lowering = OPS[n.op].row_lowering
    if lowering is not None and lowering.how == "take":
        return ()
    if lowering is not None and lowering.labels:
        return tuple(n.inputs[:-1])
    return tuple(n.inputs)


def refusal(n: Node) -> str | None:
    """Why no instruction computes ``n`` in a static program (None: one does)."""
    if holds_tuple(n) or is_loop(n) or is_cond(n) or item_index(n) is not None:
        return static_loops.flow_refusal(n)
    if not n.dtype.is_float:
        return f"an {n.dtype.name} value"
    if OPS[n.op].needs_ctx:
        return "reads the run context (row keys)"
    if is_row_sparse(n):   # (a table's: the optimizer updates its rows; a push's: its rows read where they are)
        return "a row-sparse gradient (its looked-up rows alone, read where they are)"
    special = _row_function(n)
    if special is not None:
        return None if special else f"{n.op} of this shape (the static program takes one row axis)"
    if fusible(n) or OPS[n.op].identity or (OPS[n.op].native is not None and OPS[n.op].native(n) is not None):
        return None
    return f"op '{n.op}' has no instruction"


def _row_function(n: Node) -> bool | None:
    """For the ops this module lowers itself (OpDef.row_lowering): can it (None: not one of them)?"""
    lowering = OPS[n.op].row_lowering
    return None if lowering is None else lowering.takes(n)


def _transposed_param(n: Node) -> bool:
    """Is ``n`` a parameter's transpose (∂'s Wᵀ)? The program is given it as a view (prepare), read as F's
    transposed statics are: the C runner packs it or copies it contiguous once per run where many rows
    multiply by it, instead of reading it transposed at every step of a loop (OpenBLAS took ~25% longer so
    at seq2seq's (64 x 256)·W_hᵀ)."""
    native = OPS[n.op].native(n) if OPS[n.op].native is not None else None
    return native == "transpose" and all(x.op == "param" for x in n.inputs)


class Split:
    """A static graph's nodes (those not given: not in ``present``) split into the program's and the step
    runner's before and after it, with why each of the latter is not the program's."""

    def __init__(self, nodes, present: set, explicit: set):
        classes = _Classes(nodes)
        self.program, self.before, self.after, self.left = [], [], [], {}
        self.assembled: list = []   # row-sparse gradients the host pairs from rows and ids (static_sparse.py)
        where, rows = {}, None
        needed = _needed(explicit, present)
        self.leaves = [n for n in nodes if n in needed and is_fed(n)]
        computed = self.order = [n for n in nodes if n in needed and not is_fed(n)]
        self.literals = [n for n in computed if OPS[n.op].from_shape is not None and None not in n.shape]
        self.views = [n for n in computed if _transposed_param(n)]
        held = {n.inputs[0]: f"its result {n.label()} is {refusal(n)}" for n in computed   # (a tuple is no
                if item_index(n) is not None and refusal(n) is not None}                  # value to hand out)
        for n in computed:
            if n in self.literals or n in self.views:   # (made before the program, given to it: prepare)
                continue
            if is_row_sparse(n) and _assembled(n, where):
                where[n] = "assembled"
                self.assembled.append(n)
                continue
            why = held.get(n) or refusal(n)
            if why is None:
                rowy = [classes.find(x) for x in _register_inputs(n) + (n,) if _rowy(x)]
                if rowy and rows is None:
                    rows = rowy[0]
                if any(r is not rows for r in rowy):
                    why = "rows of another count than the program's"
            if why is None and item_index(n) is not None and where.get(n.inputs[0]) != "program":
                why = "a result of a loop or cond the step runner runs"
            deps = {where.get(x) for x in n.inputs}
            if why is None and not deps & {"after", "assembled"}:
                where[n] = "program"
                self.program.append(n)
            else:
                where[n] = "before" if not deps & {"program", "after", "assembled"} else "after"
                (self.before if where[n] == "before" else self.after).append(n)
                self.left[n] = why or "reads a value the step runner computes after the program"
        self.row_class, self.classes = rows, classes

    def give_back(self, why: str) -> None:
        """Every node of the program to the step runner (before: the program read only what was given), with
        ``why``."""
        self.left.update(dict.fromkeys(self.program, why))
        self.before = [n for n in self.program + self.views + self.before + self.after]
        self.before.sort(key=self.order.index)
        self.program, self.after, self.views = [], [], []


def _assembled(n: Node, where: dict) -> bool:
    """Can the host pair row-sparse ``n`` (static_sparse.assemble): are its rows known before anything reads it
    (given, the program's, the step runner's before the program)?"""
    return all(where.get(g) != "after" for g in static_sparse.gradient_rows(n))


def _handed_out(program: list, wanted: set) -> tuple[list, list]:
    """(The program's values it hands out, those of ``wanted`` the step runner computes again after it): a
    transpose (a register's flag, a view) or a value whose row axis is not its first is no matrix of rows to
    copy out, so it is recomputed from its inputs (a view again), which the program hands out instead."""
    mine = set(program)
    outputs, again = [], []
    for n in program:
        native = OPS[n.op].native(n) if OPS[n.op].native is not None else None
        if n in wanted and (native == "transpose" or _rowy(n) and n.shape[0] is not None):
            again.append(n)
            wanted = wanted | {x for x in n.inputs if x in mine}
    for n in program:
        if n in wanted and n not in again:
            outputs.append(n)
    return outputs, again


def _needed(wanted: set, present: set) -> set:
    """The nodes that computing ``wanted`` reads, those in ``present`` (and what only they read) aside."""
    needed, stack = set(), [n for n in wanted if n not in present]
    while stack:
        n = stack.pop()
        if n not in needed and n not in present:
            needed.add(n)
            stack.extend(n.inputs)
    return needed


# the opcodes that compute (a program of none only moves rows)
COMPUTING = ("GEMM", "FUSED", "ROWOP", "SUMROWS", "BMM", "DROPOUT", "TRANSROWS", "APPLY", "ADD")


def _computes(lowered: Lowered) -> bool:
    return bool(np.isin(lowered.code[:, 0], [OPCODE[op] for op in COMPUTING]).any())


class StaticProgram:
    """One static graph as a program: its split, its lowered template, the inputs it binds and the values it
    hands out; :meth:`run` binds it to a run's values and runs it."""

    def __init__(self, nodes, present: set, explicit: set, wanted: set, device, title: str):
        self.title, self.device = title, device
        self.split = split = Split(nodes, present, explicit)
        mine = set(split.program)
        read_after = {x for n in split.after for x in n.inputs}
        self.stacked = _stacked(split, mine)   # a sum of row-sparse gradients -> the rows the program stacks
        paired = {g for n in split.assembled if n not in self.stacked for g in static_sparse.gradient_rows(n)}
        self.outputs, again = _handed_out(split.program, wanted | read_after | (paired & mine))
        split.after[:0] = again
        self.before = [Step.of(n) for n in split.before]
        self.after = [Step.of(n) for n in split.after]
        self.row_source = next((x for n in split.program for x in n.inputs if x not in mine and None in x.shape
                                and split.classes.find(x) is split.row_class), None)
        try:
            self.lowered = _lower(split.program, self.outputs, mine, device, self.stacked) if split.program else None
        except instructions.Unsupported as e:   # (a loop the lowering declines: the whole graph stays)
            split.give_back(str(e))
            self.before, self.after, self.outputs, self.lowered = [Step.of(n) for n in split.before], [], [], None
        self.gathers: list = []   # a pull stage's lookups, gathered on the host (static_sparse.gather)
        if self.lowered is not None and not _computes(self.lowered):   # (e.g. a pull's lookup of embeddings)
            self._only_moves_rows()
        self.host = {**dict.fromkeys(split.assembled, static_sparse.ASSEMBLED),
                     **dict.fromkeys(self.gathers, static_sparse.GATHERED)}
        self.classes = static_loops.label_classes(split.program)   # (an int value a loop reads as labels)
        self.tables: dict = {}   # rows -> the one-row task table
        self.row_axis = {x: x.shape.index(None) for n in split.program for x in n.inputs if None in x.shape}
        self.arenas: dict = {}
        self.views: dict = {}   # parameter transpose -> (the parameter's array, its view)

    def _only_moves_rows(self) -> None:
        """A program that would only move rows is not bound: lookups alone are gathered on the host, anything
        else goes back to the step runner."""
        split = self.split
        moved = split.program + split.before + split.after
        if static_sparse.gathers_only(moved):
            self.gathers = sorted(moved, key=split.order.index)
            split.program, split.before, split.after = [], [], []
            for n in moved:
                split.left.pop(n, None)
            self.before = []
        else:
            split.give_back("only moves rows: a gather the step runner makes in one call, for less than binding "
                            "a program costs")
            self.before = [Step.of(n) for n in split.before]
        self.after, self.outputs, self.lowered, self.stacked = [], [], None, {}

    def run(self, env: dict, feeds, params, ctx: RunContext, options, static: list) -> None:
        """Compute the graph into ``env``: its leaves, the step runner's part before, the program, the part after;
        ``static`` gets what ran (a program.StaticRun)."""
        self.prepare(env, feeds, params, ctx)
        values = self.values(env, ctx) if self.lowered is not None else None
        program = self._run_program(values, options) if values is not None else None
        self.finish(env, values, program, ctx, static)

    def prepare(self, env: dict, feeds, params, ctx: RunContext) -> None:
        """What the program reads into ``env``: its leaves, its literals, the step runner's part before it."""
        xp = self.device.xp
        for x in self.split.leaves:
            if x not in env:
                env[x] = leaf_value(x, feeds, params)
        env.update(self._literals(xp))
        for n in self.split.views:
            env[n] = self._view(n, env[n.inputs[0]], xp)
        for n in self.gathers:
            try:
                env[n] = static_sparse.gather(n, env, xp)
            except FeedError as e:
                raise _located(e, n) from None
        if self.before:
            steps_runner.run_steps(self.before, env, xp, ctx)

    def _literals(self, xp) -> dict:
        """The literals' values, made once (read-only on the host: every run reads the same arrays, which the
        binder and the C runner's buffer table then keep)."""
        made = self.__dict__.get("literal_values")
        if made is None:
            made = self.literal_values = {n: OPS[n.op].from_shape(xp, n) for n in self.split.literals}
            for value in made.values():
                if isinstance(value, np.ndarray):
                    value.flags.writeable = False
        return made

    def _view(self, n: Node, source, xp):
        """Parameter transpose ``n`` of ``source``: the view made last run while the parameter is the same array
        (updated in place), so that its operand is kept too."""
        kept = self.views.get(n)
        if kept is None or kept[0] is not source:
            kept = self.views[n] = (source, OPS[n.op].impl(xp, source, **n.attrs))
        return kept[1]

    def values(self, env: dict, ctx: RunContext) -> "_Values":
        """The buffers the program names for a run over ``env`` (its rows: the row source's)."""
        return _Values(self, env, 1 if self.row_source is None else int(env[self.row_source].shape[0]), ctx)

    def table_row(self, rows: int) -> np.ndarray:
        """The program's one-row task table over ``rows`` rows (kept per row count)."""
        table = self.tables.get(rows)
        if table is None:
            if len(self.tables) > 64:
                self.tables.clear()
            table = self.tables[rows] = np.full((1, self.lowered.table_width), -1, np.int64)
            table[0, :4] = (0, 0, rows, -1)
        return table

    def finish(self, env: dict, values, program, ctx: RunContext, static: list):
        """After the program ran (``program``: who ran it, None where none did): its outputs into ``env``, the step
        runner's part after it; ``static`` gets what ran (returned; None when nothing did)."""
        if values is not None:
            env.update((n, v if n.dtype.is_float else static_loops.as_int(v, n)) for n, v in values.made.items())
        stacks = values.stacks if values is not None else {}
        for n in self.split.assembled:
            env[n] = static_sparse.assemble(n, env, self.device.xp, stacks.get(n))
        if self.after:
            steps_runner.run_steps(self.after, env, self.device.xp, ctx)
        if program is None and not self.before and not self.after and not self.host:
            return None
        ran = record(self.title, self.before + self.after, env, self.device.xp)
        ran.program, ran.left, ran.host = program, self.split.left, self.host
        why = self.__dict__.get("link_refusal")   # (linked_head.head_for's: why not in F's program)
        ran.linked = "" if why is None or program is None else f"apart from the structure's program: {why}"
        static.append(ran)
        return ran

    def _run_program(self, values: "_Values", options) -> BatchProgram:
        """Bind the program to this run's values and run it on the device's runner (the reference runner when
        asked for or where the device's runner declines it)."""
        dtype = self.split.program[0].dtype.np
        device = self.device
        program = BatchProgram.of(self.lowered, self.table_row(values.rows), values, dtype, device,
                                  check=options.check, title=self.title)
        program.tf32 = options.tf32 and device.tf32_products
        why = None if options.runner == "reference" else device.runner_declines(program)
        if options.runner != "reference" and why is None:
            program.runner = device.runner_name
            device.run(program)
        else:
            program.runner, program.declined = "reference runner", why
            reference.run(program, device)
        return program


class _Values:
    """The buffers a static program names, by key, for one run (what the binder asks, operands.bind_operands):
    its inputs' values, index and label arrays checked on the host, the arrays it hands out, its arenas."""

    def __init__(self, owner: StaticProgram, env: dict, rows: int, ctx):
        self.owner, self.env, self.rows, self.ctx = owner, env, rows, ctx
        self.xp, self.dtype = owner.device.xp, owner.split.program[0].dtype.np
        self.made: dict = {}
        self.stacks: dict = {}   # a sum of row-sparse gradients -> its rows, stacked by the program

    def __getitem__(self, key: tuple):
        what = key[0]
        if what == "static":
            node = key[1]
            value = self.env[node]
            axis = self.owner.row_axis.get(node)
            if axis is not None and value.shape[axis] != self.rows:
                raise FeedError(f"{node.label()} has {value.shape[axis]} rows where the static graph's other "
                                f"values have {self.rows} ({self.owner.row_source.label()})")
            if static_loops.read_as_float(node):
                value = _as_float(value, self.dtype, node, self.xp, self.owner.classes.get(node))
            elif not node.dtype.is_float:   # (a loop's one-value trip count fed from the host: to the device)
                value = self.xp.asarray(value)
            return value.reshape(-1, 1) if axis == 0 and node.ndim == 1 else value   # (one number a row)
        rest = key[1:]
        if what in (row_trips.LONGEST, row_trips.ORDER, row_trips.ACTIVE):   # (from a loop's trip counts per row)
            made = row_trips.bound(to_host(self.env[rest[0]]), key, self.rows)
            return self.xp.asarray(made) if what == row_trips.LONGEST else made   # (the others: index keys)
        if what == "value":
            return self.xp.ascontiguousarray(self.env[rest[0]])
        if what == "feedrows":
            return self._checked(*rest)
        if what == "feedcols":
            return self._columns(*rest)
        if what == "out":
            return self._made(rest[0])
        if what == "stacked":
            return self.stacks.setdefault(rest[0], self.xp.empty((self.rows, rest[1]), self.dtype))
        if what == "arena":
            return self._arena(*rest)
        raise KeyError(key)

    def _checked(self, node: Node, reader: Node) -> np.ndarray:
        """An index or label array (read on the host), its values checked against what ``reader`` reads."""
        values = self.env[node]
        host = values if isinstance(values, np.ndarray) else np.asarray(self.owner.device.to_host(values))
        try:
            if OPS[reader.op].row_lowering.how == "take":
                table = self.env[reader.inputs[0]]
                if host.shape != (self.rows,) + tuple(node.shape[1:]):
                    raise FeedError(f"{reader.op}: indices of shape {host.shape} where the static graph's rows are "
                                    f"{self.rows} ({self.owner.row_source.label()})")
                return indices(host, f"{reader.op}: row", size=int(table.shape[0]), at="row",
                               of=f" ({int(table.shape[0])} rows)")
            logits = _Shaped((self.rows, _cols(reader.inputs[-2])))   # (what check_labels reads of the logits)
            return np.ascontiguousarray(check_labels(logits, host, reader.op), np.int64)
        except FeedError as e:
            raise _located(e, reader) from None

    def _columns(self, node: Node, reader: Node, step: int) -> np.ndarray:
        """Column ``step`` of id matrix ``node`` (a lookup's ids, rows x k), contiguous: the matrix checked against
        the table ``reader`` reads and transposed once per run."""
        made = self.__dict__.setdefault("columns", {})
        if node not in made:
            made[node] = np.ascontiguousarray(self._checked(node, reader).T)
        return made[node][step]

    def _made(self, node: Node):
        """An array the program hands out: ``node``'s value (the row axis: this run's rows), one per run."""
        value = self.made.get(node)
        if value is None:
            value = self.made[node] = self.xp.empty(tuple(self.rows if d is None else d for d in node.shape),
                                                    node.dtype.np if node.dtype.is_float else self.dtype)
        return value

    def _arena(self, which: str, elements: int):
        """The program's scratch or fixed arena (kept from run to run, grown to this run's size)."""
        arenas = self.owner.arenas
        found = arenas.get(which)
        if found is None or found.size < max(elements, 1):
            found = arenas[which] = self.xp.empty(max(elements, 1, 2 * (0 if found is None else found.size)),
                                                  self.owner.split.program[0].dtype.np)
        return found, elements


def _as_float(value, dtype, node: Node, xp, classes: int | None):
    """Int value ``node`` in the program's float type (whole numbers, exact: else a FeedError naming it), each a
    class of ``classes`` where a loop reads it as labels (else a FeedError naming the first that is not).
    Checked by its extremes (two reductions, ~2 us a decoder's targets); the entries are searched only when
    one is out of range."""
    host = np.asarray(to_host(value))
    as_float = host.astype(dtype)
    lo, hi = (int(host.min()), int(host.max())) if host.size else (0, 0)
    if max(-lo, hi) >= 2 ** (np.finfo(dtype).nmant + 1) and \
            not np.array_equal(as_float.astype(host.dtype), host):
        raise FeedError(f"{node.label()}: int values past what the program's {np.dtype(dtype).name} holds exactly")
    if classes is not None and (lo < 0 or hi >= classes):
        at = tuple(int(i) for i in np.argwhere((host < 0) | (host >= classes))[0])
        raise FeedError(f"{node.label()}{list(at)} = {host[at]}: a label of a loop's step must be a class in "
                        f"[0, {classes})")
    return xp.asarray(as_float)


class _Shaped:
    """A value's shape alone (what a check reads of it)."""

    def __init__(self, shape: tuple):
        self.shape, self.ndim = shape, len(shape)


def _stacked(split: Split, mine: set) -> dict:
    """{a sum of row-sparse gradients: the rows it stacks} where the program computes every one of them over its
    rows (a matrix of rows each: copied side by side into one output)."""
    stacked = {}
    for n in split.assembled:
        rows = static_sparse.gradient_rows(n)
        if len(rows) > 1 and all(g in mine and g.has_rows and split.classes.find(g) is split.row_class
                                   for g in rows):
            stacked[n] = rows
    return stacked


def _lower(nodes: list, outputs: list, mine: set, device, stacked: dict) -> Lowered:
    """The program's one template: its steps fused as F's, lowered by F's step lowering and ROWOP, TAKE and ADJ,
    its outputs copied out, the rows of each sum of row-sparse gradients copied side by side into one output;
    linked as a program of one kind."""
    kept = {g for rows in stacked.values() for g in rows}
    steps = lower([[Step.of(n) for n in nodes]], set(outputs) | kept, device.fused)[0][0]
    t = Template("static graph", TASK)
    statics = {x for n in nodes for x in _register_inputs(n) if x not in mine}
    singles: dict = {}
    t.items.update((o.inputs[0], item_index(o)) for step in steps for o in step.outputs
                   if item_index(o) is not None)
    for step in steps:
        static_loops.lower_step(t, step, statics, device, singles, _own_step, _row_function)
    for node in outputs:
        out = t.reg(name=f"out {node.name or node.id}")
        t.emit("BIND", out, t.buf(("out", node)), NONE, 0, _cols(node))
        t.emit("COPY", out, t.regs[node], _rows(node), _cols(node))
    for node, rows in stacked.items():
        _stack_rows(t, node, rows)
    return _link(t)


def _stack_rows(t: Template, node: Node, rows: list) -> None:
    """The rows of each of ``rows`` (per row: a lookup's rows of a gradient) side by side in one output, which
    the host reads as the row-sparse sum ``node``'s rows (static_sparse.assemble)."""
    total = sum(_cols(g) for g in rows)
    out = t.reg(name=f"rows of {node.name or node.id}")
    t.emit("BIND", out, t.buf(("stacked", node, total)), NONE, 0, total)
    col = 0
    for g in rows:
        block = t.reg(name=f"rows of {node.name or node.id}[:, {col}:]")
        t.emit("COLS", block, out, col)
        t.emit("COPY", block, t.regs[g], -1, _cols(g))
        col += _cols(g)


def _static(t: Template, x: Node, statics: set) -> int:
    """The register of input ``x`` (a value the program is given: STATIC binds it the first time)."""
    if x not in t.regs:
        if x not in statics:
            raise instructions.Unsupported(f"{x.label()} is read before anything binds it")
        t.emit("STATIC", t.reg(x), t.buf(("static", x)))
    return t.regs[x]


def _own_step(t: Template, step, statics: set) -> None:
    """The instructions of a row function (ROWOP), a sum of a column (SUMROWS) or a lookup (TAKE)."""
    node = step.outputs[0]
    ins, lowering = node.inputs, OPS[node.op].row_lowering
    if lowering.how == "sum_rows" and _cols(ins[0]) > 1:
        _sum_of_columns(t, node, _static(t, ins[0], statics), _cols(ins[0]))
    elif lowering.how == "sum_rows":
        _static(t, ins[0], statics)
        instructions._lowering(t, Step(step.run, step.inputs, step.outputs), "sum_rows")
    elif lowering.how == "take" and ins[1].ndim == 2:
        _take_steps(t, node, ins)
    elif lowering.how == "take":
        t.take(node, ("value", ins[0]), _cols(ins[0]), ("feedrows", ins[1], node))
    else:
        src = _static(t, ins[lowering.source], statics)
        if lowering.output_cols and _cols(ins[lowering.source]) < _cols(node):   # (one number: its row first)
            src = _filled_row(t, src, _cols(node))
        g = -1 if lowering.gradient is None else _static(t, ins[lowering.gradient], statics)
        in_register = lowering.labels and ins[-1] in t.regs   # (a loop's step of an int value, as floats)
        labels = t.regs[ins[-1]] if in_register else t.buf(("feedrows", ins[-1], node)) if lowering.labels else -1
        out = t.scratch_reg(node)
        cols = _cols(node if lowering.output_cols else ins[lowering.source])
        t.emit("ROWOP", lowering.fn, out, src, g, labels, cols, int(in_register))


def _take_steps(t: Template, node: Node, ins: tuple) -> None:
    """A lookup by a matrix of ids (rows x k: a sequence's tokens per row): its value is k rows of the table side
    by side per row, each step's rows one TAKETO into its column block, by that step's ids (one index buffer per
    step: the id matrix's columns, checked on the host once)."""
    out, width = t.scratch_reg(node), _cols(ins[0])
    for step in range(ins[1].shape[1]):
        block = t.reg(name=f"{t.reg_names[out]}[:, {step}]")
        t.emit("COLS", block, out, step * width)
        t.emit("TAKETO", block, t.buf(("value", ins[0])), width, t.buf(("feedcols", ins[1], node, step)), width, 0)


def _sum_of_columns(t: Template, node: Node, src: int, cols: int) -> None:
    """A per-row value of ``cols`` columns summed over rows and columns: SUMROWS into a row of the fixed arena,
    that row read as a column (a view, one number a row) and SUMROWS again."""
    row, column = t.reg(name=f"{node.name or node.id} columns"), t.reg(name=f"{node.name or node.id} column")
    t.emit("BIND", row, t.buf(("fixed",)), NONE, t.fixed, cols)
    t.emit("SUMROWS", row, src, -1, cols)
    t.emit("BIND", column, t.buf(("fixed",)), NONE, t.fixed, 1)
    t.fixed += cols
    t.emit("SUMROWS", t.scratch_reg(node), column, cols, 1)


def _filled_row(t: Template, src: int, cols: int) -> int:
    """A row of ``cols`` numbers each the one number of register ``src`` (a broadcast's row, in the fixed arena):
    that number copied into a slot, read ``cols`` times (a view of row stride 0) into the row read as a column."""
    slot, repeated, row, column = (t.reg(name=n) for n in ("one", "one repeated", "filled row", "filled column"))
    t.emit("BIND", slot, t.buf(("fixed",)), NONE, t.fixed, 1)
    t.emit("COPY", slot, src, 1, 1)
    t.emit("BIND", repeated, t.buf(("fixed",)), NONE, t.fixed, 0)
    t.emit("BIND", row, t.buf(("fixed",)), NONE, t.fixed + 1, cols)
    t.emit("BIND", column, t.buf(("fixed",)), NONE, t.fixed + 1, 1)
    t.emit("COPY", column, repeated, cols, 1)
    t.fixed += 1 + cols
    return row


def _link(t: Template) -> Lowered:
    """Template ``t`` as a program of one kind (its task template; no blocks)."""
    joined = instructions._Joined(1)
    t.tid = t.kind_id = 0
    joined.append(0, t)
    return Lowered("static graph", [0], [t], np.array(joined.code, np.int64).reshape(-1, instructions.WIDTH),
                   np.array(joined.pool or [0], np.int64), joined.ranges, list(joined.keys) + [("scratch",)],
                   np.array([getattr(k, "address", 0) for k in joined.kernels] or [0], np.int64),
                   max(len(t.reg_names), 1), t.scratch, t.fixed, task_keys=len(joined.keys),
                   table_width=TASK_COLUMNS + 2, fused=list(joined.kernels), steps=joined.steps)


class StaticGraphs:
    """A model's static graphs as programs: one :class:`StaticProgram` per graph, values given (those already
    computed when it runs) and training or not, made on first use."""

    def __init__(self, graphs: list):
        self.graphs = graphs   # every static graph's nodes, in order
        self.programs: dict = {}

    def run(self, nodes, explicit, env: dict, feeds, params, ctx, options, static: list, title: str,
            training: bool, device) -> None:
        """Compute ``nodes`` into ``env`` on ``device`` (``explicit``: what the model reads of them; training,
        also what the other graphs read), as :meth:`StaticProgram.run`."""
        self.program(nodes, explicit, tuple([n in env for n in nodes]), training, title, device).run(
            env, feeds, params, ctx, options, static)

    def program(self, nodes, explicit, present: tuple, training: bool, title: str, device) -> StaticProgram:
        """The program of ``nodes`` given the values ``present`` says (per node: given or not), made once."""
        key = (id(nodes), present, training, title, device)
        found = self.programs.get(key)
        if found is None:
            wanted = set(explicit) | (self._read_elsewhere(nodes) if training else set())   # (kept, if computed)
            given = {n for n, there in zip(nodes, present) if there}
            found = self.programs[key] = (nodes, StaticProgram(nodes, given, set(explicit), wanted, device, title))
        return found[1]

    def _read_elsewhere(self, nodes) -> set:
        """The nodes of ``nodes`` that the model's other static graphs read."""
        mine = set(nodes)
        return {x for other in self.graphs if other is not nodes for n in other if n not in mine
                for x in n.inputs if x in mine}
