"""The reference runner of a lowered batch program: one short function per opcode, over the device's arrays.

A lowered program (instructions.py: templates linked into one code array, a task table, buffer keys) is run
by the C runner (codegen/machine.py's switch, over raw pointers) or by this module, which is the readable
definition of every opcode. Both keep the same machine: per task (a row of the task table: template id,
kind offset, rows ``bs``, scatter offset, the sibling-concat view's first row, per gather slot a strided view)
the template's instructions run in order over registers. A register names a matrix inside one buffer: the
buffer, an element offset, a row stride ``ld`` and a transposed flag, exactly the C interpreter's (pointer, ld,
trans, buf). :meth:`Machine.matrix` turns a register into an array view of given rows and columns (a strided
view, never a copy, so writes land in the buffer); every such view is bounds-checked against its buffer, so a
wrong instruction raises :class:`CheckError` here instead of writing elsewhere.

The functions are written against ``xp`` (numpy on the CPU; CuPy or the device stand-in on CUDA), so a pass
run here stays on its device. The task table stays on the host (it decides which instructions run); index
arrays (children's rows, pull and push rows, dropout's row keys) are resolved on the host and copied to the
device once per run (the device's copy of a batch plan's array: ``Cuda.index``); the host copies serve the
bounds check of row numbers (only with ``check`` set, as the C runner's check mode) with no device read.

Fused groups run as their scalar expression evaluated with the array module (passes/fusion.py's oracle, the
numbers every generated kernel must reproduce); products as ``a @ b``; everything else as row copies, adds
and scatter-adds.
"""
from __future__ import annotations

import threading

import numpy as np

from ..core.errors import CheckError
from ..core.random import GOLDEN, mix
from ..ops import scalar as S
from ..ops.registry import holds_tuple
from .backend import to_host
from .codegen.machine import ARG_KINDS, OPCODES, matrix_shape
from .codegen.opcodes import BUFFER_SPANS, MAX_DEPTH, OPCODE_TABLE, SPANS, span_values
from .reference_flow import (op_branch, op_endloop, op_if, op_jump, op_loop, op_loopn, op_loopr, op_rows,
                             op_stepcols, op_steps, op_while)


KIND_OF_ARG = {v: k for k, v in ARG_KINDS.items()}


class Machine:
    """The state one run of a lowered program works on: buffers (flat arrays with a row stride and a
    transposed flag each), registers, and the task being run."""

    def __init__(self, device, lowered, flats: list, lds: list, transposed: list, hosts: dict, scratch_buf: int,
                 forest: bool, check: bool):
        self.device, self.xp = device, np if device is None else device.xp
        self.lowered, self.forest, self.check = lowered, forest, check
        self.flats, self.lds, self.transposed = flats, lds, transposed
        self.hosts = hosts   # index buffer -> its host array (flats holds the device's copy)
        self.scratch_buf = scratch_buf
        self.regs: list = [None] * max(1, lowered.nregs)   # (buffer, element offset, ld, transposed)
        self.task = None
        self.objects: dict = {}   # register -> the tuple it holds (ops/registry.holds_tuple)
        self.context = None   # the run context (seed, step, training) an APPLY of an op that reads it gets
        self.pc = -1
        self.begin = -1   # the first of the running template's instructions (a loop's end goes back no further)
        self.lt = [0] * MAX_DEPTH    # per loop depth: its counter (LOOP, LOOPN, ENDLOOP, STEPCOLS)
        self.lim = [0] * MAX_DEPTH   # and its trip count (a LOOPN's: read where the loop runs)
        self.end = -1   # the end of the running template's instructions (a branch's target lands before it)
        self.preds: dict = {}   # buffer -> a cond's pred, read once (BRANCH)
        self.task_index = -1
        self.active = None   # a loop's active rows (ROWS; None: the task's)
        self.stream = "main"   # or "eager": the machine of the eager stream's table (a test hook reads it)

    # --- the task row's fields ----------------------------------------------------------------------------
    @property
    def task_row(self) -> int:
        return int(self.task[1])

    @property
    def bs(self) -> int:
        """The rows an instruction runs over: a loop's active rows (ROWS), else the task's."""
        return int(self.task[2]) if self.active is None else self.active

    @property
    def task_bs(self) -> int:
        return int(self.task[2])

    @property
    def scatter_row(self) -> int:
        return int(self.task[3])

    @property
    def catfirst(self) -> int:
        return int(self.task[4])

    def view_of_slot(self, slot: int) -> tuple[int, int]:
        """(first row, step) of gather slot ``slot``'s strided view of the children (step -1: none)."""
        return int(self.task[5 + 2 * slot]), int(self.task[6 + 2 * slot])

    def dim(self, d: int) -> int:
        """An instruction's dimension: -k means k times the task's rows (-1: the task's rows)."""
        return -int(d) * self.bs if d < 0 else int(d)

    # --- registers and views ------------------------------------------------------------------------------
    def fail(self, what: str):
        stream = "eager stream " if self.stream == "eager" else ""
        raise CheckError(f"reference {self.lowered.title}: {stream}task {self.task_index}, instruction {self.pc} "
                         f"({self.lowered.text(self.pc)}): {what}")

    def set(self, r: int, buf: int, offset: int, ld: int, transposed: int = 0) -> None:
        if not 0 <= r < len(self.regs):
            self.fail(f"register {r} out of range")
        if not 0 <= buf < len(self.flats):
            self.fail(f"buffer {buf} out of range")
        self.regs[r] = (buf, int(offset), int(ld), int(transposed))

    def at(self, buf: int, offset: int) -> int:
        """``offset`` after checking that a task with rows starts its view inside buffer ``buf``."""
        if self.bs > 0 and not 0 <= offset < self.flats[buf].size:
            self.fail(f"element {offset} of a buffer of {self.flats[buf].size}")
        return offset

    def reg(self, r: int) -> tuple:
        if not 0 <= r < len(self.regs) or self.regs[r] is None:
            self.fail(f"register {r} is not bound")
        return self.regs[r]

    def strided(self, buf: int, offset: int, rows: int, cols: int, ld: int):
        """Rows x cols of buffer ``buf`` from element ``offset``, ``ld`` elements apart: a view."""
        flat = self.flats[buf]
        if rows <= 0 or cols <= 0:
            return self.xp.zeros((max(rows, 0), max(cols, 0)), flat.dtype)
        if offset < 0 or ld < 0 or offset + (rows - 1) * ld + cols > flat.size:
            self.fail(f"{rows} x {cols} at element {offset} (row stride {ld}) of a buffer of {flat.size}")
        item = flat.itemsize
        return self.xp.lib.stride_tricks.as_strided(flat[offset:], (rows, cols), (ld * item, item))

    def matrix(self, r: int, rows: int, cols: int):
        """Register ``r`` as a rows x cols matrix (a transposed register: the transpose of what it points at)."""
        buf, offset, ld, transposed = self.reg(r)
        if transposed:
            return self.strided(buf, offset, cols, rows, ld).T
        return self.strided(buf, offset, rows, cols, ld)

    def value(self, r: int, node):
        """Register ``r`` as ``node``'s value: its matrix (codegen/machine.matrix_shape) in the node's shape, the
        row axis the task's rows (a view where the register's rows are contiguous, as a written output's are)."""
        rows, cols = matrix_shape(node)
        rows = self.bs if rows < 0 else rows
        shape = ((rows,) + tuple(node.vshape)) if node.has_rows else tuple(node.shape)
        view = self.matrix(r, rows, cols)
        return view.reshape(shape)

    def per_row(self, r: int, rows: int, cols: int):
        """Register ``r`` as one rows x cols matrix per task row (each row's flat numbers, row-major): a
        (bs, rows, cols) view. A per-row value's register is never transposed."""
        buf, offset, ld, transposed = self.reg(r)
        if transposed:
            self.fail(f"register {r} is transposed (a per-row operand)")
        rows2d = self.strided(buf, offset, self.bs, rows * cols, ld)   # (bounds-checked)
        if rows2d.size == 0:
            return self.xp.zeros((self.bs, rows, cols), self.flats[buf].dtype)
        item = rows2d.itemsize
        return self.xp.lib.stride_tricks.as_strided(self.flats[buf][offset:], (self.bs, rows, cols),
                                                    (ld * item, cols * item, item))

    def rows_of(self, buf: int, width: int):
        """Buffer ``buf`` as its rows of ``width`` elements."""
        flat = self.flats[buf]
        return self.strided(buf, 0, flat.size // width, width, width) if width else flat.reshape(0, 0)

    def index(self, buf: int, host: bool = False):
        """The task's rows of index buffer ``buf`` (row numbers, -1: a zero row): the device's (``host``: the
        host's copy, to check or to sort by)."""
        flat = self.hosts[buf] if host else self.flats[buf]
        if self.task_row < 0 or self.task_row + self.bs > flat.size:
            self.fail(f"rows {self.task_row}:{self.task_row + self.bs} of an index buffer of {flat.size}")
        return flat[self.task_row:self.task_row + self.bs]

    def checked(self, buf: int, rows: int, allow_missing: bool = False):
        """The task's rows of index buffer ``buf`` after (in check mode: on the host's copy) making sure each
        is a row of a buffer of ``rows`` rows."""
        idx = self.index(buf)
        if self.check and idx.size:
            low, values = -1 if allow_missing else 0, self.index(buf, host=True)
            if values.min() < low or values.max() >= rows:
                self.fail(f"row index out of range ({values.min()}..{values.max()} of {rows} rows)")
        return idx

    def take_rows(self, buf: int, width: int, index_buf: int, col: int, cols: int):
        """The rows of buffer ``buf`` (rows of ``width``) that the task's rows of ``index_buf`` name, columns
        col:col + cols; -1: a zero row."""
        xp = self.xp
        src = self.rows_of(buf, width)
        if col < 0 or col + cols > width:
            self.fail(f"columns {col}:{col + cols} of rows of {width}")
        idx = self.checked(index_buf, src.shape[0], allow_missing=True)
        if xp is not np and src.shape[0] and idx.size and self.index(index_buf, host=True).min() >= 0:
            return self.device.rows(src.dtype).take(src[:, col:col + cols], idx)   # (one launch on a device)
        if src.shape[0] == 0:
            return xp.zeros((idx.size, cols), self.flats[buf].dtype)
        picked = src[xp.maximum(idx, 0), col:col + cols]
        picked[idx < 0] = 0
        return picked

    def put_rows(self, buf: int, width: int, index_buf: int, col: int, cols: int, values) -> None:
        """Rows of buffer ``buf`` (rows of ``width``) that the task's rows of ``index_buf`` name, columns
        col:col + cols, = ``values`` (distinct rows)."""
        rows = self.rows_of(buf, width)
        idx = self.checked(index_buf, rows.shape[0])
        if self.xp is not np:   # (one launch on a device)
            if col < 0 or col + cols > width:
                self.fail(f"columns {col}:{col + cols} of rows of {width}")
            if idx.size and cols:
                self.device.rows(rows.dtype).put(rows[:, col:col + cols], idx, values)
            return
        rows[idx, col:col + cols] = values

    def scratch(self, off: int, cols: int) -> tuple:
        """The scratch region of ``cols`` columns at column ``off`` (x the task's rows)."""
        return self.scratch_buf, off * self.task_bs, cols

    # --- what an instruction touches: the opcode table's spans, checked as every C loop checks them ----------
    def check_spans(self, name: str, operands: list) -> None:
        """Check mode: every span opcode ``name`` touches (codegen/opcodes.SPANS) before it runs, so a wrong
        instruction fails here on the same condition as in the C loops, naming the operand they name."""
        table = OPCODE_TABLE[name]
        scope = {operand: self.dim(v) if kind == "dim" else v for (operand, kind), v in zip(table, operands)}
        scope.update(bs=self.bs, task_row=self.task_row, scatter_row=self.scatter_row,
                     step=lambda slot: self.view_of_slot(slot)[1], start=lambda slot: self.view_of_slot(slot)[0],
                     base_row=lambda mode: {1: self.task_row, 2: self.scatter_row}.get(mode, 0))
        for operand, kind in table:   # (BUFOK's check of a "buf" operand, REGOK's of an "in", as the C loops
            value = scope[operand]    # decode them)
            if kind == "buf" and not 0 <= value < len(self.flats):
                self.fail(f"operand {operand}: buffer {value} out of range")
            if kind == "in" and not (0 <= value < len(self.regs) and self.regs[value] is not None):
                self.fail(f"operand {operand}: register {value} is not bound")
        for span in SPANS[name]:
            applies, args = span_values(name, span, scope)
            if not applies:
                continue
            value, kind = scope[span.operand], dict(table)[span.operand]
            if kind == "later" and span.kind in BUFFER_SPANS and not 0 <= value < len(self.flats):
                self.fail(f"operand {span.operand}: buffer {value} out of range")
            problem = SPAN_CHECKS[span.kind](self, value, *args)
            if problem:
                self.fail(f"operand {span.report or span.operand} ({span.kind}): {problem}")

    def span_problem(self, r: int, rows: int, cols: int, untransposed: bool = False) -> str:
        """Why register ``r`` does not span rows x cols inside its buffer ('' when it does)."""
        buf, offset, ld, transposed = self.reg(r)
        if untransposed and transposed:
            return f"register {r} is transposed"
        if transposed:
            rows, cols = cols, rows
        return _elements_problem(self.flats[buf].size, offset, rows, cols, ld)

    def dense_problem(self, r: int, rows: int, cols: int) -> str:
        """Why register ``r`` read as rows x cols has overlapping rows (a product's operand; '' when not)."""
        _, _, ld, transposed = self.reg(r)
        length, count = (rows, cols) if transposed else (cols, rows)
        return f"register {r}'s rows are {ld} apart, under a row of {length}" if ld < length and count > 1 else ""

    def index_problem(self, i: int, of: int, width: int, col: int, cols: int, missing: int,
                      of_rows: int | None = None) -> str:
        """Why the task's rows of index buffer ``i`` do not name rows of buffer ``of`` ('' when they do;
        ``of_rows``: rows of that many, the task's own)."""
        if col < 0 or cols < 0 or col + cols > width:
            return f"columns {col}:{col + cols} of rows of {width}"
        if self.task_row < 0 or self.task_row + self.bs > self.flats[i].size:
            return f"rows {self.task_row}:{self.task_row + self.bs} of an index buffer of {self.flats[i].size}"
        if not self.bs:
            return ""
        if i not in self.hosts:
            return f"index buffer {i} has no host copy"
        values = self.hosts[i][self.task_row:self.task_row + self.bs]
        allowed = (values == -1) & bool(missing)   # (a zero row)
        size = self.flats[of].size if of_rows is None else of_rows * width
        if (~allowed & ((values < 0) | (values * width + col + cols > size))).any():
            return f"row index out of range ({values.min()}..{values.max()} of {size // max(width, 1)} rows)"
        return ""

    def args_problem(self, pool: int, nargs: int, rows: int, cols: int) -> str:
        """Why a fused kernel's arguments (pool[pool:], nargs of them) do not span their kinds' rows x cols."""
        args = self.lowered.pool[pool:pool + 2 * nargs].tolist()
        for i, (r, kind) in enumerate(zip(args[::2], args[1::2])):
            name = KIND_OF_ARG[kind]
            problem = self.span_problem(r, rows if name in ("full", "col") else 1, cols if name in ("full", "row") else 1,
                                        untransposed=True)
            if problem:
                return f"argument {i}: {problem}"
        return ""


def _elements_problem(size: int, at: int, rows: int, cols: int, ld: int) -> str:
    """Why rows x cols from element ``at``, ``ld`` apart, is not inside ``size`` elements ('' when it is)."""
    if rows <= 0 or cols <= 0 or (at >= 0 and ld >= 0 and at + (rows - 1) * ld + cols <= size):
        return ""
    return f"{rows} x {cols} at element {at} (row stride {ld}) of a buffer of {size}"


# kind -> (machine, the span's operand value, its argument values) -> what is wrong ('' when nothing)
SPAN_CHECKS = {
    "matrix": lambda m, r, rows, cols: m.span_problem(r, rows, cols),
    "rows": lambda m, r, rows, cols: m.span_problem(r, rows, cols, untransposed=True),
    "elements": lambda m, b, at, rows, cols, ld: _elements_problem(m.flats[b].size, at, rows, cols, ld),
    "first": lambda m, b, at: (f"element {at} of a buffer of {m.flats[b].size}"
                               if m.bs > 0 and not 0 <= at < m.flats[b].size else ""),
    "index": lambda m, i, of, width, col, cols, missing: m.index_problem(i, of, width, col, cols, missing),
    "keys": lambda m, b: (f"rows {m.task_row}:{m.task_row + m.bs} of a buffer of {m.flats[b].size}"
                          if m.task_row < 0 or m.task_row + m.bs > m.flats[b].size else ""),
    "scratch": lambda m, off, cols: _elements_problem(m.flats[m.scratch_buf].size, off * m.task_bs, m.bs, cols,
                                                      cols),
    "columns": lambda m, _, col, cols, width: (f"columns {col}:{col + cols} of rows of {width}"
                                               if col < 0 or cols < 0 or col + cols > width else ""),
    "nonneg": lambda m, v: f"{v} < 0" if v < 0 else "",
    "dense": lambda m, r, rows, cols: m.dense_problem(r, rows, cols),
    "kernel": lambda m, k: "" if 0 <= k < len(m.lowered.fused) else f"kernel {k} of {len(m.lowered.fused)}",
    "args": lambda m, pool, nargs, rows, cols: m.args_problem(pool, nargs, rows, cols),
    "scalar": lambda m, b: "" if m.flats[b].size == 1 else f"a buffer of {m.flats[b].size} elements, not one value",
    "perm": lambda m, i: m.index_problem(i, i, 1, 0, 1, 0, of_rows=m.bs),
    "trips": lambda m, b: ("" if m.flats[b].size == 1 and m.flats[b].dtype == np.int64
                           else f"a buffer of {m.flats[b].size} {m.flats[b].dtype} elements, not one int64"),
    "target": lambda m, n: (f"skipping {n} lands outside the template (instruction {m.pc + 1 + n} of end {m.end})"
                            if n < 0 or m.pc + 1 + n > m.end else ""),
    "back": lambda m, n: (f"going back {n} lands outside the template (instruction {m.pc - n} of begin {m.begin})"
                          if n < 1 or m.pc - n < m.begin else ""),
}


# --- one function per opcode: ``op(m, *operands)`` ----------------------------------------------------------

def op_nop(m: Machine) -> None:
    """Nothing (the dispatch cost alone)."""


def op_bind(m: Machine, dst, buf, mode, col, ld) -> None:
    """dst = rows of ``buf`` at row (0, the kind offset or the scatter offset) x ld + col."""
    row = {0: 0, 1: m.task_row, 2: m.scatter_row}[mode]
    m.set(dst, buf, m.at(buf, row * ld + col), ld)


def op_static(m: Machine, dst, buf) -> None:
    """dst = the whole buffer (a parameter, say), with its own row stride and transposed flag."""
    m.set(dst, buf, 0, m.lds[buf], m.transposed[buf])


def op_scratch(m: Machine, dst, off, cols) -> None:
    """dst = the scratch region at column ``off`` (rows x cols, contiguous)."""
    m.set(dst, *m.scratch(off, cols))


def op_gather(m: Machine, dst, buf, width, idx, slot, elide, off) -> None:
    """dst = child ``slot`` of each row: a strided view when the task's children are evenly spaced rows
    (gather elision), else their rows copied into scratch."""
    start, step = m.view_of_slot(slot)
    if elide and step >= 1:
        m.set(dst, buf, start * width, step * width)
        return
    rows = m.take_rows(buf, width, idx, 0, width)
    m.set(dst, *m.scratch(off, width))
    m.matrix(dst, m.bs, width)[...] = rows


def op_catview(m: Machine, dst, buf, width, k, forest) -> None:
    """dst = [child 0, ..., child k-1] side by side, as one view, when the task's children are adjacent rows
    (``forest``: only in a forest, where a gradient row is written once, not added)."""
    if m.catfirst >= 0 and (not forest or m.forest):
        m.set(dst, buf, m.catfirst * width, k * width)


def op_skip_if_cat(m: Machine, n, forest) -> int:
    """Skip the next ``n`` instructions when CATVIEW bound its view."""
    return n if m.catfirst >= 0 and (not forest or m.forest) else 0


def op_take(m: Machine, dst, buf, width, idx, cols, off) -> None:
    """dst (scratch) = rows idx of ``buf`` (first ``cols`` columns; -1: zeros): a pull, a push gradient. (The C
    runner points dst at whole rows that follow one another instead: the same numbers, no copy.)"""
    rows = m.take_rows(buf, width, idx, 0, cols)
    m.set(dst, *m.scratch(off, cols))
    m.matrix(dst, m.bs, cols)[...] = rows


def op_taketo(m: Machine, dst, buf, width, idx, cols, col) -> None:
    """dst[r] = row idx[r] of ``buf``, columns col:col + cols (-1: zeros), into dst's own rows."""
    m.matrix(dst, m.bs, cols)[...] = m.take_rows(buf, width, idx, col, cols)


def op_srows(m: Machine, dst, buf, col, ld, idx, cols, off, load) -> None:
    """A block's rows of a scatter tensor: a view at the scatter offset, or (offset -1: the kind's rows are
    not one block) its rows by the kind's row index copied into scratch (``load`` 0: scratch only)."""
    if m.scatter_row >= 0:
        m.set(dst, buf, m.at(buf, m.scatter_row * ld + col), ld)
        return
    m.set(dst, *m.scratch(off, cols))
    if load:
        m.matrix(dst, m.bs, cols)[...] = m.take_rows(buf, ld, idx, col, cols)


def op_sput(m: Machine, buf, col, ld, idx, src, cols, always) -> None:
    """After SROWS: the rows computed in scratch put back by the kind's row index; at an offset, nothing (the
    view was written in place) unless ``always`` (then a copy to the offset's rows)."""
    if m.scatter_row >= 0 and not always:
        return
    values = m.matrix(src, m.bs, cols)
    if m.scatter_row >= 0:
        m.strided(buf, m.scatter_row * ld + col, m.bs, cols, ld)[...] = values.copy()
        return
    m.put_rows(buf, ld, idx, col, cols, values)


def op_cols(m: Machine, dst, src, col) -> None:
    """dst = src's columns from ``col``: same rows, same row stride."""
    buf, offset, ld, transposed = m.reg(src)
    m.set(dst, buf, offset + col, ld, transposed)


def op_alias(m: Machine, dst, src) -> None:
    """dst = src."""
    m.set(dst, *m.reg(src))


def op_transpose(m: Machine, dst, src) -> None:
    """dst = src transposed (a flag: no data moves)."""
    buf, offset, ld, transposed = m.reg(src)
    m.set(dst, buf, offset, ld, 1 - transposed)


def op_flat(m: Machine, dst, src, cols, k) -> None:
    """dst = src's rows of k blocks of ``cols`` read as k x rows rows of ``cols`` (a stacked value's steps as rows:
    a view; refused unless src's row stride is k x cols)."""
    buf, offset, ld, transposed = m.reg(src)
    if transposed or ld != cols * k:
        m.fail(f"operand k: rows {ld} apart{' transposed' if transposed else ''} are not {k} blocks of {cols}")
    m.set(dst, buf, offset, cols, 0)


def op_gemm(m: Machine, c, a, b, rows, n, k, bias) -> None:
    """c = a · b (+ the bias row); bias -2: c += a · b."""
    rows, n, k = m.dim(rows), m.dim(n), m.dim(k)
    if rows == 0 or n == 0:
        return
    if m.reg(c)[3]:
        m.fail("a product's result register is transposed")
    out = m.matrix(c, rows, n)
    if bias == -2:   # (c += a · b)
        out[...] += m.matrix(a, rows, k) @ m.matrix(b, k, n) if k else 0
        return
    out[...] = m.matrix(a, rows, k) @ m.matrix(b, k, n) if k else 0
    if bias >= 0:
        out += m.matrix(bias, 1, n)


def op_fused(m: Machine, kernel, nargs, rows, cols, pool) -> None:
    """A fused elementwise group over rows x cols: its inputs (each full, one row, one column or a scalar)
    and outputs are registers listed in the pool."""
    kernel, ins, outs = fused_operands(m, kernel, nargs, rows, cols, pool)
    if m.xp is not np:   # on a device: the group's generated kernel (the expression op by op: a launch an op)
        if outs:
            kernel(ins, list(outs))
        return
    group = kernel.group
    for out, expr in zip(outs, group.exprs()):
        out[...] = S.evaluate(expr, ins, dtype=group.output.dtype.np)


def fused_operands(m: Machine, kernel, nargs, rows, cols, pool) -> tuple:
    """(the device's kernel of the group, its input views, its output views) of a FUSED instruction; no
    inputs and outputs when it has no rows or columns."""
    rows = m.dim(rows)
    fused = m.lowered.fused[kernel]
    if rows == 0 or cols == 0:
        return fused, [], []
    args = m.lowered.pool[pool:pool + 2 * nargs].tolist()
    shapes = {"full": (rows, cols), "row": (1, cols), "col": (rows, 1), "scalar": (1, 1)}
    views = [m.matrix(r, *shapes[KIND_OF_ARG[kind]]) for r, kind in zip(args[::2], args[1::2])]
    return fused, views[:len(fused.group.inputs)], views[len(fused.group.inputs):]


def op_copy(m: Machine, dst, src, rows, cols) -> None:
    """dst = src (as memmove: the two may overlap)."""
    rows = m.dim(rows)
    m.matrix(dst, rows, cols)[...] = m.matrix(src, rows, cols).copy()


def op_rowperm(m: Machine, dst, src, idx, cols) -> None:
    """dst[r] = src[idx[r]] over the rows (a per-row loop's rows put longest first, or back)."""
    m.matrix(dst, m.bs, cols)[...] = m.matrix(src, m.bs, cols)[m.checked(idx, m.bs)]


def op_zero(m: Machine, dst, rows, cols) -> None:
    """dst = 0."""
    m.matrix(dst, m.dim(rows), cols)[...] = 0


def op_add(m: Machine, dst, src, rows, cols) -> None:
    """dst += src."""
    rows = m.dim(rows)
    m.matrix(dst, rows, cols)[...] += m.matrix(src, rows, cols)


def op_sumrows(m: Machine, dst, src, rows, cols) -> None:
    """dst (one row) = the sum of src's rows."""
    m.matrix(dst, 1, cols)[...] = m.matrix(src, m.dim(rows), cols).sum(axis=0, keepdims=True)


def op_put(m: Machine, buf, width, idx, src, cols) -> None:
    """Rows idx of ``buf`` (first ``cols`` columns) = src's rows (a push, a pull's gradient in a forest)."""
    m.put_rows(buf, width, idx, 0, cols, m.matrix(src, m.bs, cols))


def op_adj(m: Machine, buf, width, idx, slot, elide, src, cols) -> None:
    """Gather's adjoint: src's rows added into the children's rows of the scatter gradient (in a forest each
    such row is written once: set, not added); by the slot's strided view when it has one."""
    xp = m.xp
    values = m.matrix(src, m.bs, cols)
    start, step = m.view_of_slot(slot)
    if elide and step >= 0:
        if step == 0:   # only the sentinel row: its gradient is discarded
            return
        dst = m.strided(buf, start * width, m.bs, cols, step * width)
        if m.forest:
            dst[...] = values
        else:
            dst[...] += values
        return
    if m.forest:
        m.put_rows(buf, width, idx, 0, cols, values)
        return
    rows = m.rows_of(buf, width)   # (a DAG vertex may be the child of several rows of one task: every one adds)
    if xp is not np:   # the device's scatter-add (atomics, or a deterministic device's segment sums)
        m.checked(idx, rows.shape[0])
        m.device.rows(rows.dtype).scatter_add(rows[:, :cols], m.index(idx, host=True), values)
        return
    xp.add.at(rows[:, :cols], m.checked(idx, rows.shape[0]), values)


def op_gacc(m: Machine, buf, src, rows, cols) -> None:
    """A parameter's gradient accumulator (rows x cols, contiguous) += src."""
    rows = m.dim(rows)
    m.strided(buf, 0, rows, cols, cols)[...] += m.matrix(src, rows, cols)


def op_dropout(m: Machine, dst, src, cols, keys, table, entry) -> None:
    """dst = src x the dropout mask of the task's rows: per row key and column random.py's hash continued
    from the entry's hash word, kept (x the scale) where its top 24 bits reach the threshold, else 0."""
    xp, entries = m.xp, m.hosts[table].reshape(-1, 3)
    if not 0 <= entry < len(entries):
        m.fail(f"dropout entry {entry} of {len(entries)}")
    h, threshold, scale_bits = (np.uint64(v) for v in entries[entry].view(np.uint64))
    x = m.matrix(src, m.bs, cols)
    hr = mix(m.index(keys) ^ h) + GOLDEN
    z = mix(hr[:, None] ^ xp.arange(cols, dtype=np.uint64)[None, :]) + GOLDEN
    scale = x.dtype.type(scale_bits.view(np.float64))
    m.matrix(dst, m.bs, cols)[...] = x * ((z >> np.uint64(40)) >= threshold).astype(x.dtype) * scale


def op_bmm(m: Machine, c, a, b, rows, n, k, a_rows, b_rows) -> None:
    """Per task row: c's matrix (rows x n) = a's · b's; an operand with ``*_rows`` 1 has one matrix per row
    (its flat row), with 0 one for all rows (a static, with its own row stride and transposed flag)."""
    left = m.per_row(a, rows, k) if a_rows else m.matrix(a, rows, k)
    right = m.per_row(b, k, n) if b_rows else m.matrix(b, k, n)
    out = m.per_row(c, rows, n)
    if out.size:
        out[...] = m.xp.matmul(left, right) if k else 0


def op_transrows(m: Machine, dst, src, rows, cols) -> None:
    """Per task row: dst's matrix (cols x rows) = src's (rows x cols) transposed, a new flat row."""
    m.per_row(dst, cols, rows)[...] = m.per_row(src, rows, cols).transpose(0, 2, 1)


def op_apply(m: Machine, step, pool, keys) -> None:
    """The outputs of a step no other opcode expresses = its op's own implementation (the registry's; a fused
    group's expressions) over its inputs, each register read as its node's shape (the row axis: the task's
    rows); an op that reads the run context gets the runner's, with the task's row keys."""
    if not 0 <= step < len(m.lowered.steps):
        m.fail(f"step {step} of {len(m.lowered.steps)}")
    step = m.lowered.steps[step]
    regs = m.lowered.pool[pool:pool + len(step.inputs) + len(step.outputs)].tolist()
    args = [m.objects[r] if holds_tuple(x) else m.value(r, x) for r, x in zip(regs, step.inputs)]
    if step.fused:
        group = step.run.group
        values = [S.evaluate(expr, args, dtype=group.output.dtype.np) for expr in group.exprs()]
    elif step.needs_ctx:
        ctx = m.context
        ctx.row_keys = m.index(keys) if keys >= 0 else None
        values = [step.run(m.xp, *args, ctx=ctx, **step.attrs)]
        ctx.row_keys = None
    else:
        values = [step.run(m.xp, *args, **step.attrs)]
    for r, y, v in zip(regs[len(step.inputs):], step.outputs, values):
        if holds_tuple(y):   # (a tuple: held as it is, for the APPLYs of its items)
            m.objects[r] = v
            continue
        rows, cols = matrix_shape(y)
        rows = m.bs if rows < 0 else rows
        m.matrix(r, rows, cols)[...] = m.xp.broadcast_to(v, m.value(r, y).shape).reshape(rows, cols)


def op_rowop(m: Machine, fn, dst, src, g, labels, cols, lreg) -> None:
    """Per task row over its ``cols`` numbers: fn 0 softmax, 1 the cross-entropy of the row's label (one number),
    2 its gradient x g's row, 3 src's one row (a broadcast); a label outside 0..cols - 1 fails (as in C).
    ``lreg``: the labels are register ``labels``, one whole number a row in the float type."""
    if fn == 3:
        m.matrix(dst, m.bs, cols)[...] = m.matrix(src, 1, cols)
        return
    if fn not in (0, 1, 2):
        m.fail(f"operand fn: {fn} is no row function")
    xp, x = m.xp, m.matrix(src, m.bs, cols)
    lse = None
    if x.size:
        top = x.max(axis=1, keepdims=True)
        lse = top + xp.log(xp.exp(x - top).sum(axis=1, keepdims=True))
    if fn == 0:
        m.matrix(dst, m.bs, cols)[...] = xp.exp(x - lse) if x.size else x
        return
    picked, idx = _labels(m, labels, lreg, cols)
    rows = xp.arange(m.bs)
    if fn == 1:
        m.matrix(dst, m.bs, 1)[...] = (lse[:, 0] - x[rows, idx])[:, None] if x.size else 0
        return
    scale = m.matrix(g, m.bs, 1)
    out = xp.exp(x - lse) * scale if x.size else x.copy()
    out[rows, idx] -= scale[:, 0]
    m.matrix(dst, m.bs, cols)[...] = out


def _labels(m: Machine, labels, lreg, cols) -> tuple:
    """ROWOP's labels (on the host, checked; on the device) from an int64 buffer or a float register."""
    if lreg:
        value = m.matrix(labels, m.bs, 1)[:, 0]
        picked = np.asarray(to_host(value))
        whole = picked.size == 0 or bool(np.all(picked == np.floor(picked)))
        if not whole or (picked.size and (picked.min() < 0 or picked.max() >= cols)):
            m.fail(f"operand labels: a label that is no class of {cols}")
        return picked.astype(np.int64), m.xp.asarray(picked.astype(np.int64))
    picked = m.index(labels, host=True)
    if picked.size and (picked.min() < 0 or picked.max() >= cols):
        m.fail(f"operand labels: a label out of range ({picked.min()}..{picked.max()} of {cols} classes)")
    return picked, m.index(labels)


OPERATIONS = {
    "NOP": op_nop, "BIND": op_bind, "STATIC": op_static, "SCRATCH": op_scratch, "GATHER": op_gather,
    "CATVIEW": op_catview, "SKIP_IF_CAT": op_skip_if_cat, "BRANCH": op_branch, "JUMP": op_jump,
    "LOOP": op_loop, "LOOPN": op_loopn, "ENDLOOP": op_endloop, "STEPCOLS": op_stepcols, "WHILE": op_while,
    "STEPS": op_steps, "LOOPR": op_loopr, "IF": op_if, "TAKE": op_take, "TAKETO": op_taketo, "SROWS": op_srows,
    "SPUT": op_sput, "COLS": op_cols, "ALIAS": op_alias, "TRANSPOSE": op_transpose, "FLAT": op_flat,
    "GEMM": op_gemm, "FUSED": op_fused, "COPY": op_copy, "ZERO": op_zero, "ADD": op_add,
    "SUMROWS": op_sumrows, "PUT": op_put, "ADJ": op_adj, "GACC": op_gacc, "DROPOUT": op_dropout, "BMM": op_bmm,
    "TRANSROWS": op_transrows, "APPLY": op_apply, "ROWOP": op_rowop, "ROWS": op_rows,
    "ROWPERM": op_rowperm,
}
BY_ID = [OPERATIONS[name] for name in OPCODES]
ARITY = [len(operands) for operands in OPCODES.values()]
NAMES = list(OPCODES)


# --- a run ---------------------------------------------------------------------------------------------------

def run(program, device=None) -> None:
    """Run a bound program (program.BatchProgram) as the C runner does, over its operands on ``device`` (its array
    module, its row and fused kernels where its arrays are not numpy's; None: numpy), adding into the program's
    accumulators. Streaming, the eager stream's table runs on a machine of its own (the eager operands: its
    scratch and fixed arenas and accumulators) on the device's second stream (Backend.second_stream) or a host
    thread (:class:`ThreadStream`); row t of the table runs after eager chunk t."""
    lowered, table, eager = program.lowered, program.table, program.eager
    code, ranges = lowered.code.tolist(), lowered.ranges.tolist()
    operands = program.operands
    m = _machine(program, device, operands)
    if eager is None or not len(eager):
        _loop(m, table, code, ranges)
        return
    mine = list(operands)
    for i, operand in program.bound.eager_operands.items():
        mine[i] = operand
    em = _machine(program, device, mine)
    em.stream = "eager"
    second = (device.second_stream(len(eager)) if device is not None else None) or ThreadStream(len(eager))
    second.start(lambda done: _loop(em, eager, code, ranges, after=done))
    try:
        _loop(m, table, code, ranges, before=second.wait)
    finally:
        second.join()


def _machine(program, device, operands: list) -> Machine:
    """A machine over ``operands`` (an unbound one: an empty buffer)."""
    xp = np if device is None else device.xp
    flats, lds, transposed, hosts = [], [], [], {}
    for i, operand in enumerate(operands):
        if operand is None:
            flats.append(xp.zeros(0, program.dtype))
            lds.append(1)
            transposed.append(0)
            continue
        flats.append(operand.array.reshape(-1)[:operand.elements])
        lds.append(operand.ld)
        transposed.append(operand.transposed)
        if operand.host is not None:
            hosts[i] = operand.host
    m = Machine(device, program.lowered, flats, lds, transposed, hosts, len(operands) - 1, program.forest,
                program.check)
    m.context = getattr(program.buffers, "ctx", None)
    return m


def _loop(m: Machine, table: np.ndarray, code: list, ranges: list, before=None, after=None) -> None:
    """Run every row of ``table`` on ``m`` (``before(t)``/``after(t)``: the streams' wait and record)."""
    for t, task in enumerate(table.tolist()):
        if before is not None:
            before(t)
        m.task, m.task_index, m.active = task, t, None
        begin, end = ranges[task[0]]
        m.begin, m.end = begin, end
        pc = begin
        while pc < end:
            op, *operands = code[pc]
            m.pc = pc
            if m.check:
                m.check_spans(NAMES[op], operands[:ARITY[op]])
            skip = BY_ID[op](m, *operands[:ARITY[op]])
            pc += 1 + (skip or 0)
        if after is not None:
            after(t)


class ThreadStream:
    """The reference runner's eager stream: a Python thread runs the eager table's chunks in order; row t of
    the main table waits (a condition) until chunk t is done, rows past the chunks until all are. The eager
    thread's error is raised by the main one (at its wait, else after the join)."""

    def __init__(self, chunks: int):
        self.chunks, self.done, self.error = chunks, 0, None
        self.cond = threading.Condition()
        self.thread = None

    def start(self, work) -> None:
        """Run ``work(after)`` on the thread; it calls ``after(t)`` when chunk t is done."""
        def body():
            try:
                work(self.finished)
            except BaseException as e:   # (handed to the main stream)
                with self.cond:
                    self.error = e
                    self.cond.notify_all()
        self.thread = threading.Thread(target=body, name="minicavs-reference-eager", daemon=True)
        self.thread.start()

    def finished(self, t: int) -> None:
        with self.cond:
            self.done = t + 1
            self.cond.notify_all()

    def wait(self, t: int) -> None:
        need = min(t + 1, self.chunks)
        if self.done >= need:
            return
        with self.cond:
            while self.done < need and self.error is None:
                self.cond.wait()
        if self.error is not None:
            raise self.error

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error
