"""The program: :class:`Lowered`, one pass's templates linked into one code array (instructions.link makes it; the
binder and every runner read it: the opcode rows, the buffer keys, the task table's width, the blocks before and
after the task loop), and its parts, the :class:`Template` of each kind and phase (F or ∂F as instructions over
local registers and buffer keys), made only while linking and kept only in their program."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from ..core.limits import MAX_REGISTERS
from ..ir.graph import Node
from .codegen.machine import OPCODES, OPS as OPCODE, WIDTH, matrix_shape
from .compile import POST, PRE, TASK

OPCODES_BY_ID = list(OPCODES)
NONE, KIND_ROWS, SCATTER_ROWS = 0, 1, 2
MODE_NAMES = {NONE: "0", KIND_ROWS: "task rows", SCATTER_ROWS: "scatter rows"}
PHASE_WORDS = {PRE: "before tasks", TASK: "task", POST: "after tasks"}
# operands that name a buffer (linked to global ids)
BUFFER_OPERANDS = ("buf", "idx", "keys", "table", "pred", "count", "labels")


def buffer_operands(op: str, args) -> list[bool]:
    """Per operand of one ``op`` instruction (its ``args``), whether it names a buffer: ROWOP's labels are a
    register instead when its ``lreg`` is set (a loop's step of an int value: engine/static_loops.py)."""
    names = OPCODES[op]
    at = names.index("lreg") if "lreg" in names else len(args)
    register_labels = at < len(args) and args[at]
    return [n in BUFFER_OPERANDS and not (n == "labels" and register_labels) for n in names]
TASK_COLUMNS = 5   # kind, kind offset, rows, scatter offset, first row of the sibling-concat view (-1: none)


def _cols(node: Node) -> int:
    """Columns of a node as the registers' matrix (codegen/machine.matrix_shape: values of any shape are flat
    rows)."""
    return matrix_shape(node)[1]


def _rows(node: Node) -> int:
    """Rows as an instruction dimension: -1 for the task's rows."""
    return matrix_shape(node)[0]


class Template:
    """One kind's steps of one phase of F or ∂F as instructions over local registers and buffer keys: a part of
    one program (Lowered.templates), which the linking made it for and which gives it its place (template id,
    kind id; a block's regather and row moves, which a batch's table needs)."""

    def __init__(self, kind: str, phase: int = TASK):
        self.kind, self.phase = kind, phase
        self.tid = self.kind_id = -1      # its template id and kind id in its program (set when linked)
        self.regather = 0               # a block: the children per row it gathers again (0: none)
        self.moves = (0, 0, 0)          # a block of F: F's rows it moves per vertex (gathers, pulls, pushes)
        self.scatter_rows = False       # binds rows of a scatter tensor (or its gradient) at the scatter offset
        self.regathers = False          # (POST of ∂F) gathers the children's concat again: a view when side by side
        self.code: list = []            # (opcode name, operands...)
        self.pool: list = []            # fused kernels' argument lists
        self.regs: dict = {}            # node -> register
        self.reg_names: list = []
        self.buffers: dict = {}         # buffer key -> local id
        self.kernels: list = []         # Kernel objects (their uniform addresses)
        self.scratch = 0                # scratch columns (per row) used
        self.fixed = 0                  # elements of values without a row axis (a task's partial gradients)
        self.param_grads: list = []     # parameter names accumulated per task
        self.overlays: dict = {}        # node -> an instruction (its register first) re-pointing its scratch
        self.direct: dict = {}          # node -> the parameter whose gradient accumulator it is computed into
        self.direct_blocks: dict = {}   # node -> ((parameter, first column, end), ...): computed into one
        # buffer whose column blocks are those parameters' gradients (a merged GEMM's ∂W', passes/gemm.py)
        self.puts_back: list = []       # a block's values computed where SROWS bound the scatter rows (SPUT's)
        self.dropouts: list = []        # per DROPOUT entry: (p, site)
        self.steps: list = []           # per APPLY: the step it runs (compile.Step)
        self.literals: dict = {}        # node -> its step: a body's literal, lowered only where read as a value
        self.origins: dict = {}         # a body's placeholder -> the value outside every body it stands for
        self.guard: tuple = ()          # the branches being lowered: ((pred buffer, side), ...) (a cond's body)
        self.computed: dict = {}        # guard -> {a body value's key: its register}: computed under that guard
        self.tuples: dict = {}          # a loop's tuple node -> its results' registers (engine/loops.py)
        self.items: set = set()         # (tuple node, index) of each item the steps lowered here read
        self.sorted: dict = {}          # (guard, order buffer, register) -> a copy, rows sorted (row_trips.py)

    def reg(self, node: Node | None = None, name: str = "") -> int:
        if node is not None and node in self.regs:
            return self.regs[node]
        r = len(self.reg_names)
        self.reg_names.append(name or (node.name or f"%{node.id}" if node is not None else f"t{r}"))
        if node is not None:
            self.regs[node] = r
        return r

    def buf(self, key: tuple) -> int:
        return self.buffers.setdefault(key, len(self.buffers))

    def emit(self, op: str, *args: int) -> None:
        assert len(args) == len(OPCODES[op]) and len(args) < WIDTH, (op, args)
        if (op == "BIND" and args[2] == SCATTER_ROWS) or op in ("SROWS", "SPUT"):
            self.scatter_rows = True
        self.code.append((op,) + tuple(int(a) for a in args))

    def has_memory(self, node: Node) -> bool:
        """Must ``node``'s value land in memory of its own (a stored tensor, a column block, an accumulator), so
        that a value computed elsewhere is copied there, not aliased (the results of a cond's branch, a loop's)?"""
        return node in self.regs or node in self.direct or node in self.direct_blocks or node in self.overlays

    def scratch_reg(self, node: Node) -> int:
        cols = _cols(node)
        r = self.reg(node)
        if node.has_rows:
            self.emit("SCRATCH", r, self.scratch, cols)
            self.scratch += cols
            if node in self.overlays:   # e.g. the scatter gradient's rows, when the task's layout allows
                op, *args = self.overlays[node]
                self.emit(op, r, *args)
        elif node in self.direct:   # a block's parameter gradient: computed straight into its accumulator
            self.emit("BIND", r, self.buf(("pgrad", self.direct[node], "set")), NONE, 0, cols)
        elif node in self.direct_blocks:   # several, side by side: their column blocks are the gradients
            self.emit("BIND", r, self.buf(("pgrad", self.direct_blocks[node], "block")), NONE, 0, cols)
        else:   # a fixed-size value: its own region of the fixed arena
            self.emit("BIND", r, self.buf(("fixed",)), NONE, self.fixed, cols)
            self.fixed += _rows(node) * cols
        return r

    def take(self, node: Node, key: tuple, width: int, index_key: tuple) -> None:
        cols = _cols(node)
        self.emit("TAKE", self.reg(node), self.buf(key), width, self.buf(index_key), cols, self.scratch)
        self.scratch += cols

    def bind(self, node: Node, key: tuple, mode: int, col: int, ld: int) -> int:
        r = self.reg(node) if node is not None else self.reg(name=f"{key[0]} {key[-1]}")
        self.emit("BIND", r, self.buf(key), mode, col, ld)
        return r

    def scatter_view(self, node: Node, key: tuple, col: int, ld: int, write: bool = False) -> int:
        """Bind ``node`` to columns ``col``.. of the kind's rows of a scatter tensor (or its gradient) ``key``
        (``ld`` its row): a task's rows are contiguous (a view, BIND); a block's (all the kind's rows)
        are one when the schedule lays them out so (then a view too, no copy), else SROWS copies them in by
        the kind's row index, or, ``write`` (a value the block computes there), gives it scratch rows that
        :meth:`put_back` puts after the steps."""
        if self.phase == TASK:
            return self.bind(node, key, SCATTER_ROWS, col, ld)
        cols = _cols(node)
        r = self.reg(node)
        self.emit("SROWS", r, self.buf(key), col, ld, self.buf(("srows",)), cols, self.scratch, int(not write))
        self.scratch += cols
        if write:
            self.puts_back.append((key, col, ld, r, cols))
        return r

    def put_back(self) -> None:
        """A block's values computed into scratch rows for SROWS's split case: put into the kind's rows."""
        for key, col, ld, r, cols in self.puts_back:
            self.emit("SPUT", self.buf(key), col, ld, self.buf(("srows",)), r, cols, 0)

    def copy_to(self, key: tuple, mode: int, ld: int, node: Node) -> None:
        if mode == SCATTER_ROWS and self.phase != TASK:   # (a block's: one SPUT, a view or the rows by index)
            self.emit("SPUT", self.buf(key), 0, ld, self.buf(("srows",)), self.regs[node], _cols(node), 1)
            return
        dst = self.reg(name=f"dst {_key_text(key)}")
        self.emit("BIND", dst, self.buf(key), mode, 0, ld)
        self.emit("COPY", dst, self.regs[node], -1, _cols(node))


@dataclass(eq=False)   # (identity: runners keep their state per program, keyed weakly by it)
class Lowered:
    """The templates of one pass, linked: one code array for all kinds (instructions per kind range)."""

    title: str
    template_ids: list   # per template: its id (a task's: its kind id; a block's: kinds + kind id before the
    # task loop, 2 x kinds + kind id after it)
    templates: list
    code: np.ndarray
    pool: np.ndarray
    ranges: np.ndarray          # per template id: [begin, end) of its instructions
    keys: list                  # global buffer keys (index = buffer id); the scratch arena is last
    kernels: np.ndarray
    nregs: int
    scratch_cols: int           # scratch columns per row of the task templates (a block's: its own)
    fixed_size: int = 0
    blocks: list = field(default_factory=list)   # the blocks' templates (of ``templates``), in run order
    task_keys: int | None = None    # the buffers the task templates name are keys[:task_keys] (None: all)
    table_width: int = TASK_COLUMNS   # columns of a task-table row
    fused: list = field(default_factory=list)   # per kernel id: the device's kernel of a fused group (its .group)
    dropouts: list = field(default_factory=list)   # per DROPOUT entry: (p, site) (program.dropout_table makes its row)
    steps: list = field(default_factory=list)      # per APPLY: the step (compile.Step) it runs
    tail: dict = field(default_factory=dict)       # template id -> scratch columns of a template run after the
    # blocks (a static graph linked into the pass: linked_head.py), past the kinds' template ids

    @functools.cached_property
    def block_scratch(self) -> dict:
        """{block template id: its scratch columns per row}."""
        return {**{b.tid: b.scratch for b in self.blocks}, **self.tail}

    @functools.cached_property
    def c_refusal(self) -> str | None:
        """Why no C loop (the C runner's interpreter, the CUDA issuing loop) can run this program: an APPLY (a step
        only Python runs), or more registers in a template than their register file; None: they can."""
        ops = self.code[:, 0] if len(self.code) else self.code
        if (ops == OPCODE["APPLY"]).any():
            pc = int(np.flatnonzero(ops == OPCODE["APPLY"])[0])
            return f"instruction {pc} ({self.text(pc)}) runs an op only Python runs"
        if self.nregs > MAX_REGISTERS:
            return f"{self.nregs} registers in a template (a C loop has {MAX_REGISTERS})"
        return None

    @property
    def n_kinds(self) -> int:
        """Kinds linked: the template ids are the kinds' task templates, then their blocks before and after."""
        return len(self.ranges) // 3

    def operand_name(self, pc: int, operand: int) -> str:
        """The operand a runner's failed check reports (its index among instruction ``pc``'s operands; -2: the
        task row, -3: the opcode, 10 + i: a fused kernel's argument i), by name, for the error message."""
        if operand == -2:
            return "task row (kind or rows)"
        if operand == -3:
            return "opcode"
        if not 0 <= pc < len(self.code):
            return str(operand)
        names = OPCODES[list(OPCODES)[int(self.code[pc][0])]]
        if 0 <= operand < len(names):
            return names[operand]
        return f"argument {operand - 10}" if operand >= 10 else str(operand)

    def writes(self, opcode: str, phase: int, tid: int | None = None) -> set:
        """The buffer ids (the first operand) of ``opcode``'s instructions in the templates of ``phase`` (or
        the one template ``tid``)."""
        n_kinds = self.n_kinds
        first = {TASK: 0, PRE: n_kinds, POST: 2 * n_kinds}[phase]
        found = set()
        for t in range(first, first + n_kinds) if tid is None else [tid]:
            code = self.code[slice(*self.ranges[t])]
            found.update(code[code[:, 0] == OPCODE[opcode], 1].tolist())
        return found

    @functools.cached_property
    def eager_accumulators(self) -> list:
        """Buffer ids of the parameter-gradient accumulators that both the blocks before the task loop and the
        tasks add into: streaming, a runner gives the eager stream its own (zeros) and adds it after the pass,
        so the two streams never add into one buffer at once (the binder makes them)."""
        return sorted(self.writes("GACC", PRE) & self.writes("GACC", TASK))

    def lines(self, blocks: bool = True) -> list[str]:
        """The templates, one instruction a line: opcode and named operands (``blocks``: also those of the
        blocks before and after the task loop)."""
        out = []
        for tid, t in zip(self.template_ids, self.templates):
            if t.phase != TASK and not blocks:
                continue
            begin, end = self.ranges[tid]
            what = "linked static graph" if tid in self.tail else "task" if t.phase == TASK else \
                PHASE_WORDS[t.phase] + " block"
            out.append(f"kind '{t.kind}' {what} template (instructions {begin}:{end}):")
            out += [f"  {pc}: {self.text(pc, t)}" for pc in range(begin, end)]
        return out

    def text(self, pc: int, template: Template | None = None) -> str:
        if template is None:
            template = next(t for tid, t in zip(self.template_ids, self.templates) if self.ranges[tid][0] <= pc
                            < self.ranges[tid][1])
        row = self.code[pc]
        name = list(OPCODES)[int(row[0])]
        parts = []
        values = row[1:].tolist()
        for field_name, value, is_buffer in zip(OPCODES[name], values, buffer_operands(name, values)):
            if field_name in ("dst", "src", "a", "b", "c", "cond") or (field_name == "bias" and value >= 0) \
                    or (field_name == "labels" and not is_buffer):
                v = f"r{value}({template.reg_names[value]})" if 0 <= value < len(template.reg_names) \
                    else f"r{value}"
            elif is_buffer:
                v = _key_text(self.keys[value]) if 0 <= value < len(self.keys) else f"#{value}"
            elif field_name == "mode":
                v = MODE_NAMES.get(value, str(value))
            else:
                v = str(value)
            parts.append(f"{field_name}={v}")
        if name == "FUSED":
            off, n = int(row[5]), int(row[2])
            regs = self.pool[off:off + 2 * n:2].tolist()
            parts.append("args=" + ",".join(f"r{r}({template.reg_names[r]})" for r in regs))
        if name == "APPLY":
            step = self.steps[int(row[1])]
            parts.insert(0, step.text(lambda n: n.name or f"%{n.id}"))
        return f"{name} " + " ".join(parts)


def _key_text(key: tuple) -> str:
    what, *rest = key
    names = [x.name or f"%{x.id}" if isinstance(x, Node) else str(x) for x in rest]
    return f"{what}[{','.join(names)}]" if names else what
