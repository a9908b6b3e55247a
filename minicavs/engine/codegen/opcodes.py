"""The opcode table: every opcode of the machine (minicavs/engine/instructions.py lowers to it) with its
operands, their kinds and the memory each instruction touches, written once as data. Both C loops (the C runner's
interpreter, codegen/machine.py; the CUDA issuing loop, codegen/issue_source.py) render their checks from it,
each with its own macros (``@CHECKS NAME@`` markers, :func:`checked`), and the reference runner
(engine/reference.py) evaluates the same spans in check mode (:func:`span_values`), so a bounds check is never
written per device. Strings and data only.

A new opcode is one entry in OPCODE_TABLE (its operands), one in SPANS (what it touches), one function in the
reference runner, and one case body per C loop: what it does on that device (docs/internals.md).
"""
from __future__ import annotations

import re
import textwrap
from typing import NamedTuple

# The opcode table: per opcode its operands (a0, a1, ...) as (name, kind). A kind says how every C loop decodes
# the operand before the instruction runs (``decode``: the checks are rendered from here into the C runner's
# interpreter and the CUDA issuing loop alike) and what the reference runner's function takes:
#   "reg"   a register the instruction points (its index checked; what it points at is checked where used)
#   "in"    a register it reads or writes through (its index checked; the CUDA loop also checks that it points
#           into a buffer; the memory it spans is checked where the rows and columns are known)
#   "buf"   a buffer id (checked against the buffer table)
#   "later" a register, buffer or kernel id that may be -1 or is used on one path only: checked where used
#   "dim"   rows or columns (-k: k times the task's rows, -1 the task's rows); "int" any other number (offset,
#           width, mode, flag, pool)
OPCODE_TABLE = {
    "NOP": (),
    # dst = buf + (base(mode) * ld + col); mode 0 none, 1 kind rows, 2 scatter rows
    "BIND": (("dst", "reg"), ("buf", "buf"), ("mode", "int"), ("col", "int"), ("ld", "int")),
    "STATIC": (("dst", "reg"), ("buf", "buf")),        # dst = the whole buffer (its ld and transposed flag)
    "SCRATCH": (("dst", "reg"), ("off", "int"), ("cols", "int")),   # dst = scratch + off * rows, ld cols
    # children's rows: a strided view or a copy
    "GATHER": (("dst", "reg"), ("buf", "buf"), ("width", "int"), ("idx", "buf"), ("slot", "int"), ("elide", "int"),
               ("off", "int")),
    # [gather0; ...] as a view when the task's children are side by side
    "CATVIEW": (("dst", "reg"), ("buf", "buf"), ("width", "int"), ("k", "int"), ("forest", "int")),
    # skip the next n instructions when the task has the concat view (forest = 1: only in a forest, where each
    # child's gradient row is written once, not added)
    "SKIP_IF_CAT": (("n", "int"), ("forest", "int")),
    # a cond in F (engine/branches.py): skip the next n instructions (its then-branch and the JUMP that ends it)
    # when the one value of the static buffer ``pred`` is 0 (NaN is true, as C reads it); JUMP: skip n always
    "BRANCH": (("pred", "buf"), ("n", "int")),
    "JUMP": (("n", "int"),),
    # a loop in F (engine/loops.py), at nesting ``depth`` (a counter and a trip count per depth, MAX_DEPTH of
    # them): LOOP sets the depth's counter to 0 and its trip count to ``trips``, and skips the next n
    # instructions (the body and its ENDLOOP) when that is 0; LOOPN does the same with the trip count read
    # where it runs from ``count``, a one-value int64 static (refused, naming it, when outside [0, most]: the
    # loop's memory holds most steps); ENDLOOP adds 1 to the counter and, while it is below the trip count (and
    # ``trips``, the most the loop runs), goes back n instructions (to the instruction after the LOOP);
    # STEPCOLS: dst = src's columns from (first + stride x counter) x width (a per-step block; a negative
    # first counts from the trip count: -1, a reverse loop's last step run); WHILE: a while_loop's test, after
    # its condition's instructions: when the one value of register ``cond`` is 0 (NaN is true), skip n (the
    # rest of the body and its ENDLOOP); on a device one read of that value per iteration
    "LOOP": (("trips", "int"), ("n", "int"), ("depth", "int")),
    "LOOPN": (("count", "buf"), ("most", "int"), ("n", "int"), ("depth", "int")),
    "ENDLOOP": (("trips", "int"), ("n", "int"), ("depth", "int")),
    "STEPCOLS": (("dst", "reg"), ("src", "in"), ("width", "int"), ("first", "int"), ("stride", "int"),
                 ("depth", "int")),
    "WHILE": (("n", "int"), ("cond", "in")),   # (a register read, not pointed: not the first operand)
    # a while_loop's count of steps run, where F reads it inside a loop's body (a nested while's gradient):
    # STEPS writes the depth's counter, after its ENDLOOP, into the one value of register ``dst`` (the program's
    # float type; on a device one host-to-device write); LOOPR is LOOPN with the trip count read from register
    # ``cond`` (on a device one read), refused, naming it, when not a whole number in [0, most]
    "STEPS": (("dst", "in"), ("depth", "int")),
    "LOOPR": (("most", "int"), ("n", "int"), ("depth", "int"), ("cond", "in")),
    # a cond of a static graph on a pred the program computes (engine/static_branches.py): BRANCH with the pred
    # in register ``pred`` (its one value; on a device one read per IF run)
    "IF": (("n", "int"), ("pred", "in")),   # (a register read, not pointed: not the first operand)
    # rows buf[idx[task_row + r]] into scratch (-1: zeros)
    "TAKE": (("dst", "reg"), ("buf", "buf"), ("width", "int"), ("idx", "buf"), ("cols", "int"), ("off", "int")),
    # dst[r] = buf[idx[task_row + r]][col:col + cols]; -1: 0
    "TAKETO": (("dst", "reg"), ("buf", "buf"), ("width", "int"), ("idx", "buf"), ("cols", "int"), ("col", "int")),
    # a block's rows of a scatter tensor: a view at the scatter offset, or (offset -1: the kind's rows are not one
    # block) rows buf[idx[task_row + r]][col:col + cols] copied into scratch (load 0: scratch only, for SPUT to put)
    "SROWS": (("dst", "reg"), ("buf", "buf"), ("col", "int"), ("ld", "int"), ("idx", "later"), ("cols", "int"),
              ("off", "int"), ("load", "int")),
    # after SROWS (offset -1): buf[idx[task_row + r]][col:col + cols] = src[r]; at an offset (a view) nothing, or
    # (always) the rows copied to the offset's
    "SPUT": (("buf", "buf"), ("col", "int"), ("ld", "int"), ("idx", "later"), ("src", "later"), ("cols", "int"),
             ("always", "int")),
    "COLS": (("dst", "reg"), ("src", "in"), ("col", "int")),   # a column slice: same rows, same ld
    "ALIAS": (("dst", "reg"), ("src", "in")),
    "TRANSPOSE": (("dst", "reg"), ("src", "in")),
    # dst = src's rows, each k blocks of cols numbers side by side (src's row stride k x cols: a per-row value
    # stacked over k steps), read as k x rows rows of cols (row r's block t is row r x k + t): a view, so that
    # one product over every row and step (its "dim" -k) sums a loop's per-step terms; src's rows must span k x cols
    "FLAT": (("dst", "reg"), ("src", "in"), ("cols", "int"), ("k", "int")),
    # c = a . b (+ bias row, reg or -1); bias -2: c += a . b (a loop's sum of a product per step, in place)
    "GEMM": (("c", "in"), ("a", "in"), ("b", "in"), ("rows", "dim"), ("n", "dim"), ("k", "dim"), ("bias", "later")),
    # args: pool[2i] register, pool[2i+1] rows kind
    "FUSED": (("kernel", "later"), ("nargs", "int"), ("rows", "dim"), ("cols", "int"), ("pool", "int")),
    "COPY": (("dst", "in"), ("src", "in"), ("rows", "dim"), ("cols", "int")),
    "ZERO": (("dst", "in"), ("rows", "dim"), ("cols", "int")),
    "ADD": (("dst", "in"), ("src", "in"), ("rows", "dim"), ("cols", "int")),
    # dst[c] = sum over rows of src[r, c]
    "SUMROWS": (("dst", "in"), ("src", "in"), ("rows", "dim"), ("cols", "int")),
    # buf[idx[task_row + r]] = src[r]
    "PUT": (("buf", "buf"), ("width", "int"), ("idx", "buf"), ("src", "in"), ("cols", "int")),
    # gather's adjoint into the scatter gradient
    "ADJ": (("buf", "buf"), ("width", "int"), ("idx", "buf"), ("slot", "int"), ("elide", "int"), ("src", "in"),
            ("cols", "int")),
    "GACC": (("buf", "buf"), ("src", "in"), ("rows", "dim"), ("cols", "int")),   # a parameter gradient += src
    # dst = src * the dropout mask of the task's rows: row keys keys[task_row + r] (uint64), the hash word, threshold
    # and scale (a double's bits) in row ``entry`` of the int64 table ``table`` (minicavs/core/random.py's hash)
    "DROPOUT": (("dst", "in"), ("src", "in"), ("cols", "int"), ("keys", "buf"), ("table", "buf"), ("entry", "int")),
    # per task row r: c[r] (rows x n, its flat row) = a[r] . b[r]; an operand with *_rows 1 is one matrix per row
    # (its flat row, rows x k or k x n), with 0 one matrix for all rows (a static: its register's ld and flag)
    "BMM": (("c", "in"), ("a", "in"), ("b", "in"), ("rows", "int"), ("n", "int"), ("k", "int"), ("a_rows", "int"),
            ("b_rows", "int")),
    # per task row: dst[r] (cols x rows) = src[r] (rows x cols) transposed
    "TRANSROWS": (("dst", "in"), ("src", "in"), ("rows", "int"), ("cols", "int")),
    # the outputs of a step no other opcode expresses = its op's own implementation (the registry's) over its
    # inputs' values: steps[step]'s input registers, then its output registers, from pool[pool]; keys: the row
    # keys buffer (-1: none) of an op that reads the run context. Only a runner that can call Python runs it
    # (the reference runner); the C loops decline a program that has one.
    "APPLY": (("step", "int"), ("pool", "int"), ("keys", "later")),
    # per task row r, over its cols numbers (a static graph's row functions, engine/static_program.py): fn 0
    # dst[r] = softmax(src[r]); 1 dst[r] (one number) = logsumexp(src[r]) - src[r][labels[task_row + r]]; 2
    # dst[r] = (softmax(src[r]) - onehot(labels[task_row + r])) * g[r] (g: one number a row); 3 dst[r] = src's
    # one row (a broadcast). A label outside 0..cols - 1 fails the instruction (operand labels). ``lreg`` 0: labels
    # is an int64 buffer (labels[task_row + r]); 1: a register of one whole number per row in the program's float
    # type (a loop's step of an int value a static program iterates over: engine/static_loops.py)
    "ROWOP": (("fn", "int"), ("dst", "in"), ("src", "in"), ("g", "later"), ("labels", "later"), ("cols", "int"),
              ("lreg", "int")),
    # a loop with a trip count per row over rows sorted longest first (engine/row_trips.py): the instructions after
    # it run over the active rows alone, table[step] of the task's (step: first + stride x counter, a negative
    # first counted from the trip count, as STEPCOLS); table -1: over the task's rows again (after the ENDLOOP).
    # At the loop's first step the table's trip-count entries are checked, refused naming ``table`` unless each
    # is in [0, the task's rows] and none is above the one before (the active rows of a step are a prefix of the
    # previous step's); ``table`` is an int64 buffer (on a device: its host copy)
    "ROWS": (("table", "later"), ("first", "int"), ("stride", "int"), ("depth", "int")),
    # dst[r] = src[idx[task_row + r]] over the rows, cols numbers each (registers, untransposed, not overlapping):
    # a per-row loop's values put longest row first and its results back in the rows' order (engine/row_trips.py)
    "ROWPERM": (("dst", "in"), ("src", "in"), ("idx", "buf"), ("cols", "int")),
}
OPERAND_KINDS = ("reg", "in", "buf", "later", "dim", "int")
# name -> operand names (a0, a1, ...): the dump in lowered.py and the reference runner's functions' parameters
OPCODES = {name: tuple(operand for operand, _ in operands) for name, operands in OPCODE_TABLE.items()}
OPS = {name: i for i, name in enumerate(OPCODES)}


class Span(NamedTuple):
    """What one instruction touches, checked before it runs (every loop: before its body; the reference runner:
    in check mode). ``kind`` and its ``args`` (expressions over the opcode's operand names, ``bs``, ``task_row``,
    ``scatter_row`` and three functions: step and start of a gather slot's view, base_row of a BIND mode; a
    "dim" operand reads as its rows):
      "matrix"   register ``operand`` spans (rows, cols) inside its buffer, either orientation
      "rows"     the same, and the register is not transposed (its rows are read ld apart)
      "elements" buffer ``operand`` holds (at, rows, cols, ld): rows x cols from element at, ld apart
      "first"    buffer ``operand`` holds element (at,) when the task has rows (a view's first element)
      "index"    index buffer ``operand`` has the task's rows, and (in check mode) each row number names a row of
                 buffer (of, width, col, cols, missing): columns col:col + cols of rows of width; -1 allowed when
                 ``missing`` is 1 (a zero row)
      "keys"     buffer ``operand`` has the task's rows (dropout's row keys)
      "scratch"  the scratch region at column ``operand`` (x the task's rows) holds (cols,) columns of the rows
      "columns"  columns (col, cols, width): col:col + cols lie in rows of width elements (a failure names
                 ``operand``)
      "nonneg"   operand ``operand`` is not negative
      "kernel"   operand ``operand`` is one of the program's fused kernels (each loop's KERNELOK: the CUDA loop also
                 wants its handle)
      "dense"    register ``operand`` read as (rows, cols) has rows at least a row apart (a product's operand: BLAS
                 and cuBLAS take no overlapping rows; one row may have any stride)
      "scalar"   buffer ``operand`` is one value the loop reads where it runs (a one-element static; the CUDA loop:
                 with its host copy)
      "target"   skipping ``operand`` instructions lands inside the template (0 <= n, pc + 1 + n <= end)
      "back"     going back ``operand`` instructions lands inside the template, behind pc (1 <= n, begin <= pc - n)
      "perm"     index buffer ``operand`` has the task's rows, and (in check mode) each names one of them
      "trips"    buffer ``operand`` is one int64 value the loop reads where it runs (a run-time trip count; the
                 CUDA loop: with its host copy); its value in [0, most] is checked always, where it is read
      "args"     the fused kernel's (nargs, rows, cols) arguments listed from pool ``operand``: each a bound
                 register spanning its argument kind's rows and columns, not transposed
    ``when``: only when this holds (a path of the instruction); ``report``: the operand a failure names (default
    ``operand``)."""
    kind: str
    operand: str
    args: tuple = ()
    when: str = ""
    report: str = ""


SPAN_KINDS = {"matrix": 2, "rows": 2, "elements": 4, "first": 1, "index": 5, "keys": 0, "scratch": 1,
              "columns": 3, "nonneg": 0, "dense": 2, "kernel": 0, "args": 3, "scalar": 0, "target": 0,
              "back": 0, "trips": 0, "perm": 0}
# their operand is a buffer (a "later" one: BUFOK first)
BUFFER_SPANS = ("elements", "first", "index", "keys", "scalar", "trips", "perm")
REGISTER_SPANS = ("matrix", "rows", "dense")             # a register (a "later" one: REGOK first)

_NOT_ELIDED = "not (elide and step(slot) >= 1)"
MAX_DEPTH = 4   # loops nested in a template (each depth's counter and trip count: the C loops' lt[] and lim[])
_DEPTH = Span("columns", "depth", ("depth", "1", str(MAX_DEPTH)))
SPANS = {
    "NOP": (),
    "BIND": (Span("first", "buf", ("base_row(mode) * ld + col",), report="col"),),
    "STATIC": (),
    "SCRATCH": (),
    "GATHER": (Span("index", "idx", ("buf", "width", "0", "width", "0"), _NOT_ELIDED),
               Span("scratch", "off", ("width",), _NOT_ELIDED)),
    "CATVIEW": (),
    "SKIP_IF_CAT": (),
    "BRANCH": (Span("scalar", "pred"), Span("target", "n")),
    "JUMP": (Span("target", "n"),),
    "LOOP": (Span("nonneg", "trips"), Span("target", "n"), _DEPTH),
    "LOOPN": (Span("trips", "count"), Span("nonneg", "most"), Span("target", "n"), _DEPTH),
    "ENDLOOP": (Span("nonneg", "trips"), Span("back", "n"), _DEPTH),
    "STEPCOLS": (Span("nonneg", "width"), _DEPTH),
    "WHILE": (Span("matrix", "cond", ("1", "1")), Span("target", "n")),
    "STEPS": (Span("rows", "dst", ("1", "1")), _DEPTH),
    "LOOPR": (Span("matrix", "cond", ("1", "1")), Span("nonneg", "most"), Span("target", "n"), _DEPTH),
    "IF": (Span("matrix", "pred", ("1", "1")), Span("target", "n")),
    "TAKE": (Span("index", "idx", ("buf", "width", "0", "cols", "1")), Span("scratch", "off", ("cols",))),
    "TAKETO": (Span("rows", "dst", ("bs", "cols")), Span("index", "idx", ("buf", "width", "col", "cols", "1"))),
    "SROWS": (Span("first", "buf", ("scatter_row * ld + col",), "scatter_row >= 0", report="col"),
              Span("scratch", "off", ("cols",), "scatter_row < 0"),
              Span("index", "idx", ("buf", "ld", "col", "cols", "0"), "scatter_row < 0 and load")),
    "SPUT": (Span("columns", "col", ("col", "cols", "ld")),
             Span("rows", "src", ("bs", "cols"), "scatter_row < 0 or always"),
             Span("elements", "buf", ("scatter_row * ld + col", "bs", "cols", "ld"), "scatter_row >= 0 and always"),
             Span("index", "idx", ("buf", "ld", "col", "cols", "0"), "scatter_row < 0")),
    "COLS": (),
    "ALIAS": (),
    "TRANSPOSE": (),
    "FLAT": (Span("nonneg", "cols"), Span("nonneg", "k"), Span("rows", "src", ("bs", "k * cols"))),
    "GEMM": (Span("rows", "c", ("rows", "n")), Span("matrix", "a", ("rows", "k")), Span("matrix", "b", ("k", "n")),
             Span("matrix", "bias", ("1", "n"), "bias >= 0"), Span("dense", "c", ("rows", "n")),
             Span("dense", "a", ("rows", "k")), Span("dense", "b", ("k", "n"))),
    "FUSED": (Span("kernel", "kernel"), Span("args", "pool", ("nargs", "rows", "cols"))),
    "COPY": (Span("rows", "dst", ("rows", "cols")), Span("rows", "src", ("rows", "cols"))),
    "ZERO": (Span("rows", "dst", ("rows", "cols")),),
    "ADD": (Span("rows", "dst", ("rows", "cols")), Span("rows", "src", ("rows", "cols"))),
    "SUMROWS": (Span("rows", "dst", ("1", "cols")), Span("rows", "src", ("rows", "cols"))),
    "PUT": (Span("rows", "src", ("bs", "cols")), Span("index", "idx", ("buf", "width", "0", "cols", "0"))),
    "ADJ": (Span("columns", "cols", ("0", "cols", "width")), Span("rows", "src", ("bs", "cols")),
            Span("elements", "buf", ("start(slot) * width", "bs", "cols", "step(slot) * width"),
                 "elide and step(slot) >= 1"),
            Span("index", "idx", ("buf", "width", "0", "cols", "0"), "not (elide and step(slot) >= 0)")),
    "GACC": (Span("elements", "buf", ("0", "rows", "cols", "cols")), Span("rows", "src", ("rows", "cols"))),
    "DROPOUT": (Span("rows", "dst", ("bs", "cols")), Span("rows", "src", ("bs", "cols")), Span("keys", "keys"),
                Span("elements", "table", ("3 * entry", "1", "3", "3"), report="entry")),
    "BMM": (Span("nonneg", "rows"), Span("nonneg", "n", report="rows"), Span("nonneg", "k", report="rows"),
            Span("rows", "c", ("bs", "rows * n")),
            Span("rows", "a", ("bs", "rows * k"), "a_rows"), Span("matrix", "a", ("rows", "k"), "not a_rows"),
            Span("rows", "b", ("bs", "k * n"), "b_rows"), Span("matrix", "b", ("k", "n"), "not b_rows")),
    "TRANSROWS": (Span("nonneg", "rows"), Span("nonneg", "cols", report="rows"),
                  Span("rows", "dst", ("bs", "rows * cols")), Span("rows", "src", ("bs", "rows * cols"))),
    "APPLY": (),
    "ROWOP": (Span("nonneg", "cols"), Span("rows", "dst", ("bs", "1"), "fn == 1"),
              Span("rows", "dst", ("bs", "cols"), "fn != 1"), Span("rows", "src", ("1", "cols"), "fn == 3"),
              Span("rows", "src", ("bs", "cols"), "fn != 3"), Span("rows", "g", ("bs", "1"), "fn == 2"),
              Span("keys", "labels", (), "(fn == 1 or fn == 2) and not lreg"),
              Span("rows", "labels", ("bs", "1"), "(fn == 1 or fn == 2) and lreg")),
    "ROWS": (_DEPTH,),
    "ROWPERM": (Span("rows", "dst", ("bs", "cols")), Span("rows", "src", ("bs", "cols")), Span("perm", "idx")),
}


# --- C: each loop's checks rendered from the table -------------------------------------------------------------

# What both loops' checks read: the task's fields and the span helpers (element arithmetic, no pointers).
SPAN_HELPERS = r"""
#define BASEROW(m) ((m) == 1 ? task_row : (m) == 2 ? scatter_row : 0)
#define START(s) (task[5 + 2 * (s)])
#define STEP(s) (task[6 + 2 * (s)])
/* is rows x cols from element at, ld apart, outside a buffer of size elements? */
static inline int span_out(int64_t size, int64_t at, int64_t rows, int64_t cols, int64_t ld) {
    if (rows <= 0 || cols <= 0) return 0;
    return at < 0 || ld < 0 || at + (rows - 1) * ld + cols > size;
}
/* the task's rows of an index buffer of isize numbers: outside it, or (values not NULL) a row number that is not
   a row of width elements of a buffer of bsize, its columns col:col + cols (-1 allowed when lo < 0); the row
   numbers are read (``want``) from ``values``, a host copy (none: a failure) */
static inline int index_out(int64_t isize, const int64_t *values, int64_t want, int64_t bsize, int64_t task_row,
                            int64_t bs, int64_t width, int64_t col, int64_t cols, int64_t lo) {
    if (col < 0 || cols < 0 || col + cols > width || task_row < 0 || bs < 0 || task_row + bs > isize) return 1;
    if (!want || bs == 0) return 0;
    if (!values) return 1;
    for (int64_t r = 0; r < bs; r++) {
        const int64_t v = values[task_row + r];
        if (v == -1 && lo < 0) continue;
        if (v < 0 || v * width + col + cols > bsize) return 1;
    }
    return 0;
}
/* the checks SPANS renders, over each loop's FAIL, CHECKR (a register inside its buffer), BSIZE (a buffer's
   elements), IVALUES / IWANT (an index buffer's host copy, whether to read it), SCRATCH_BUF, PRED and COUNTS
   (where the loop reads a one-value static, T or int64: its memory, or the CUDA loop's host copy), pc and end
   (the template's) */
#define SPAN(r, rows, cols, operand) CHECKR(r, rows, cols, operand)
#define ROWSPAN(r, rows, cols, operand) do { if (R[r].trans) FAIL(operand); CHECKR(r, rows, cols, operand); } while (0)
#define ELEMENTS(b, at, rows, cols, ld_, operand) do { \
    if (span_out(BSIZE(b), at, rows, cols, ld_)) FAIL(operand); } while (0)
#define FIRST(b, at, operand) do { if (bs > 0 && ((at) < 0 || (at) >= BSIZE(b))) FAIL(operand); } while (0)
#define INDEX(i, b, width, col, cols, lo, operand) do { if (index_out(BSIZE(i), IVALUES(i), IWANT, BSIZE(b), \
    task_row, bs, width, col, cols, lo)) FAIL(operand); } while (0)
#define PERM(i, operand) do { if (index_out(BSIZE(i), IVALUES(i), IWANT, bs, task_row, bs, 1, 0, 1, 0)) \
    FAIL(operand); } while (0)
#define KEYS(b, operand) do { if (task_row < 0 || task_row + bs > BSIZE(b)) FAIL(operand); } while (0)
#define SCRATCHSPAN(off, cols, operand) ELEMENTS(SCRATCH_BUF, (off) * task_bs, bs, cols, cols, operand)
#define COLUMNS(col, cols, width, operand) do { \
    if ((col) < 0 || (cols) < 0 || (col) + (cols) > (width)) FAIL(operand); } while (0)
#define SCALAR(b, operand) do { if (BSIZE(b) != 1 || !PRED(b)) FAIL(operand); } while (0)
#define TRIPS(b, operand) do { if (BSIZE(b) != 1 || !COUNTS(b)) FAIL(operand); } while (0)
#define TARGET(n, operand) do { if ((n) < 0 || pc + 1 + (n) > end) FAIL(operand); } while (0)
#define BACK(n, operand) do { if ((n) < 1 || pc - (n) < begin) FAIL(operand); } while (0)
#define NONNEG(x, operand) do { if ((x) < 0) FAIL(operand); } while (0)
#define DENSE(r, rows, cols, operand) do { if (R[r].ld < (R[r].trans ? (rows) : (cols)) \
    && (R[r].trans ? (cols) : (rows)) > 1) FAIL(operand); } while (0)
"""

SPAN_HELPERS += f"#define MAXDEPTH {MAX_DEPTH}\n"

_C_FUNCTIONS = {"base_row": "BASEROW", "step": "STEP", "start": "START"}
_C_WORDS = {"and": "&&", "or": "||", "not": "!"}


def c_expr(name: str, expr: str) -> str:
    """Expression ``expr`` of opcode ``name``'s span in C: an operand as a[i] (a "dim" one as DIM(a[i]))."""
    index = {operand: i for i, (operand, _) in enumerate(OPCODE_TABLE[name])}
    kinds = dict(OPCODE_TABLE[name])

    def word(match: re.Match) -> str:
        w = match.group(0)
        if w in index:
            return f"DIM(a[{index[w]}])" if kinds[w] == "dim" else f"a[{index[w]}]"
        return _C_FUNCTIONS.get(w) or _C_WORDS.get(w) or w

    return re.sub(r"[A-Za-z_]\w*", word, expr).replace("! ", "!")


def span_c(name: str, span: Span) -> str:
    """One span's check in C, over the loop's macros (SPAN, ROWSPAN, ELEMENTS, FIRST, INDEX, KEYS, SCRATCHSPAN,
    COLUMNS, NONNEG, SCALAR, TRIPS, TARGET, BACK; REGOK and BUFOK first for a "later" operand)."""
    index = {operand: i for i, (operand, _) in enumerate(OPCODE_TABLE[name])}
    kinds = dict(OPCODE_TABLE[name])
    at, report = index[span.operand], index[span.report or span.operand]
    args = [c_expr(name, a) for a in span.args]
    first = ""
    if kinds[span.operand] == "later" and span.kind in BUFFER_SPANS + REGISTER_SPANS:
        first = f"{'BUFOK' if span.kind in BUFFER_SPANS else 'REGOK'}(a[{at}], {at}); "
    if span.kind == "index":
        of, width, col, cols, missing = args
        check = f"INDEX(a[{at}], {of}, {width}, {col}, {cols}, {-1 if span.args[4] == '1' else 0}, {report});"
    elif span.kind == "args":
        nargs, rows, cols = args
        check = (f"for (int64_t i_ = 0; i_ < {nargs}; i_++) {{ const int64_t r_ = pool[a[{at}] + 2 * i_], "
                 f"k_ = pool[a[{at}] + 2 * i_ + 1]; REGOK(r_, 10 + i_); ROWSPAN(r_, k_ == 0 || k_ == 2 ? {rows} "
                 f": 1, k_ <= 1 ? {cols} : 1, 10 + i_); }}")
    elif span.kind == "columns":
        check = f"COLUMNS({', '.join(args)}, {report});"
    elif span.kind in ("scratch", "nonneg"):
        check = f"{'SCRATCHSPAN' if span.kind == 'scratch' else 'NONNEG'}({', '.join([f'a[{at}]'] + args)}, {report});"
    else:
        macro = {"matrix": "SPAN", "rows": "ROWSPAN", "elements": "ELEMENTS", "first": "FIRST", "keys": "KEYS",
                 "dense": "DENSE", "kernel": "KERNELOK", "scalar": "SCALAR", "target": "TARGET",
                 "back": "BACK", "trips": "TRIPS", "perm": "PERM"}
        check = f"{macro[span.kind]}({', '.join([f'a[{at}]'] + args)}, {report});"
    check = first + check
    return f"if ({c_expr(name, span.when)}) {{ {check} }}" if span.when else check


def checks(name: str, point_ok: str) -> str:
    """Everything a loop checks before running opcode ``name``: its operands (:func:`decode`) and what it touches
    (SPANS), inside ``if (CHECKING)`` (the interpreter's check mode; the CUDA loop: always); '' for none."""
    lines = [decode(name, point_ok)] + [span_c(name, span) for span in SPANS[name]]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    return "if (CHECKING) {\n" + textwrap.indent("\n".join(lines), "    ") + "\n}"


def checked(source: str, point_ok: str) -> str:
    """``source`` with each ``@CHECKS name@`` marker replaced by the opcode's checks (:func:`checks`), indented
    as the marker is."""
    def render(match: re.Match) -> str:
        text = checks(match.group(2), point_ok)
        return textwrap.indent(text, match.group(1)) + "\n" if text else ""
    return re.sub(r"^( *)@CHECKS (\w+)@\n", render, source, flags=re.M)


def decode(name: str, point_ok: str, through_ok: str = "REGOK", buffer_ok: str = "BUFOK") -> str:
    """The operand checks of opcode ``name`` (OPCODE_TABLE): each "reg" operand through the loop's ``point_ok``
    macro, each "in" through ``through_ok``, each "buf" through ``buffer_ok``: each macro takes the operand's
    value and index, and fails the instruction naming that index."""
    macros = {"reg": point_ok, "in": through_ok, "buf": buffer_ok}
    return " ".join(f"{macros[kind]}(a[{i}], {i});" for i, (_, kind) in enumerate(OPCODE_TABLE[name])
                    if kind in macros)


# --- Python: the same spans for the reference runner ------------------------------------------------------------

_PY_CODE: dict = {}


def span_values(name: str, span: Span, scope: dict) -> tuple:
    """(whether the span applies, its argument values) under ``scope`` (the operands by name, a "dim" one as
    its rows, and the task's fields and functions): what the reference runner checks."""
    def value(expr: str):
        code = _PY_CODE.get(expr)
        if code is None:
            code = _PY_CODE[expr] = compile(expr, f"<{name} span>", "eval")
        return eval(code, {"__builtins__": {}}, scope)   # (the table's own expressions: no input reaches them)
    if span.when and not value(span.when):
        return False, ()
    return True, tuple(value(a) for a in span.args)
