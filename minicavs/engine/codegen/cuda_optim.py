"""CUDA C++ for the fused optimizer step: every parameter's update in a few launches, whatever their number.

The parameters of a step are *segments* of one index space: a table (int64, on the device) holds the running
element offsets ``off[0..K]`` (``off[K]`` = every element) and per segment its addresses and layout, so one
grid-stride loop covers all of them (each thread finds its segment by walking ``off`` forward). A segment's
row of the table (``table_width(slots)`` entries) is::

    parameter address, gradient address, row index address, columns, weight decay?, mode, index count,
    slot addresses...

and its mode says how its elements map to the gradient's (:data:`DENSE`, :data:`LAZY`, :data:`ROWS`):

- dense: element ``e`` of the parameter, gradient element ``e``;
- lazy (lazy sparse updates): the coalesced rows of a row-sparse gradient, element ``e`` being column
  ``e % cols`` of gradient row ``e / cols``, written at parameter row ``idx[e / cols]`` (unique indices: one
  thread per element); rows not looked up are not touched;
- rows (a row-sparse gradient with dense semantics): every element of the parameter, its gradient the
  matching element of the coalesced rows, found by bisection in the sorted indices, or 0 on a row not
  looked up (as the C library's ``_rows`` kernels: no dense gradient is built).

The kernels of a step, in launch order (codegen/library_source.py's RULES give the update arithmetic, so the CPU's C
kernels and these compute the same expressions):

1. ``optim_sumsq_T`` (with clipping): per thread a float64 sum of squares of its gradient elements, one partial
   per thread; ``optim_partials`` folds them to ``PARTIALS`` sums in a fixed order (no atomics, no shared
   memory: the result is the same bits on every run, and the CPU emulation runs it as it is);
2. ``optim_finish_T`` (one thread): the report ``[loss, squared norm, flags...]``, flags zeroed;
3. ``optim_RULE_T`` with ``apply = 0``: the update computed and not written; a non-finite gradient element of
   segment k sets ``report[2 + 2k]``, a non-finite result (value or slot) ``report[3 + 2k]``;
4. the host reads the report (the step's one device-to-host copy) and, all finite, launches
   ``optim_RULE_T`` with ``apply = 1``: the same arithmetic, written in place. The clipping scale is computed
   on the device from the report's norm in both passes, so the checked and the applied values are the same.

Pure strings, like codegen/cuda.py: CI compiles them with NVRTC and runs them through the CPU emulation.
"""
from __future__ import annotations

from ...core.dtypes import as_dtype
from .cuda import LOOP
from .library_source import RULES

VALUE, GRAD, INDEX, COLUMNS, DECAY, MODE, COUNT, SLOT0 = range(8)   # a segment's entries in the table
DENSE, LAZY, ROWS = range(3)   # a segment's modes
PARTIALS = 256          # threads of optim_partials: the sums optim_finish adds up
REDUCE_BLOCKS = 512     # at most this many blocks of optim_sumsq (threads x blocks partial sums)

SEGMENT = """
#ifndef MC_OPTIM_ELEMENT
#define MC_OPTIM_ELEMENT
/* Element e of the segment whose table row is s: the index of its gradient element (-1: a zero, on a row that
   a dense-semantics row-sparse gradient does not hold); *at: the parameter element it updates. */
__device__ __forceinline__ long mc_optim_element(const long *s, long e, long *at)
{{
    const long mode = s[{MODE}], cols = s[{COLUMNS}];
    const long *idx = (const long *)s[{INDEX}];
    if (mode == {DENSE}) {{ *at = e; return e; }}
    const long r = e / cols, c = e - r * cols;
    if (mode == {LAZY}) {{ *at = idx[r] * cols + c; return e; }}
    long lo = 0, hi = s[{COUNT}];
    while (lo < hi) {{
        const long mid = (lo + hi) / 2;
        if (idx[mid] < r) lo = mid + 1; else hi = mid;
    }}
    *at = e;
    return lo < s[{COUNT}] && idx[lo] == r ? lo * cols + c : -1;
}}
#endif
"""

REDUCE = """
extern "C" __global__ void optim_sumsq_{T}(long total, long K, long width, const long *__restrict__ table,
                                           double *__restrict__ partial)
{{
    const long n = total, *off = table, *seg = table + K + 1;
    double s = 0;
    long k = 0, at;
    {LOOP} {{
        while (i >= off[k + 1]) k++;
        const long *row = seg + k * width;
        const long j = mc_optim_element(row, i - off[k], &at);
        const double x = j < 0 ? 0.0 : (double)((const {T} *)row[{GRAD}])[j];
        s += x * x;
    }}
    partial[blockIdx.x * (long)blockDim.x + threadIdx.x] = s;
}}
extern "C" __global__ void optim_partials_{T}(long n, const double *__restrict__ in, double *__restrict__ out)
{{
    const long t = blockIdx.x * (long)blockDim.x + threadIdx.x, threads = (long)blockDim.x * gridDim.x;
    double s = 0;
    for (long i = t; i < n; i += threads) s += in[i];
    out[t] = s;
}}
/* loss_kind: 0 the host's loss_host, 1 the device's loss (the element type), 2 the device's loss64 */
extern "C" __global__ void optim_finish_{T}(long n, const double *__restrict__ sums, long flags, long loss_kind,
                                            const {T} *__restrict__ loss, const double *__restrict__ loss64,
                                            double loss_host, double *__restrict__ report)
{{
    if (blockIdx.x || threadIdx.x) return;
    double s = 0;
    for (long i = 0; i < n; i++) s += sums[i];
    report[0] = loss_kind == 1 ? (double)loss[0] : loss_kind == 2 ? loss64[0] : loss_host;
    report[1] = s;
    for (long i = 0; i < flags; i++) report[2 + i] = 0;
}}
"""

UPDATE = """
extern "C" __global__ void optim_{RULE}_{T}(long total, long K, const long *__restrict__ table,
                                           double *__restrict__ report, double clip, {HYPER}, {T} weight_decay,
                                           long apply)
{{
    const long n = total, *off = table, *seg = table + K + 1;
    const double norm = clip > 0 ? sqrt(report[1]) : 0;
    const {T} scale = clip > 0 && norm > clip ? ({T})(clip / norm) : ({T})1;
    long k = 0, at;
    {LOOP} {{
        while (i >= off[k + 1]) k++;
        const long *s = seg + k * {W};
        const long j = mc_optim_element(s, i - off[k], &at);
        const {T} graw = j < 0 ? ({T})0 : ((const {T} *)s[{GRAD}])[j];
        const {T} wd = s[{DECAY}] ? weight_decay : ({T})0;
        {T} *p = ({T} *)s[{VALUE}] + at;
        {SLOTS}
        {STEP}
        if (apply) {{
            {WRITE} p[0] = pi;
        }} else {{
            if (!((graw - graw) == 0)) report[2 + 2 * k] = 1;
            if (!(({FINITE}) == 0)) report[3 + 2 * k] = 1;
        }}
    }}
}}
"""


def rule_slots(rule: str) -> list[str]:
    """The slot arrays of a rule, in RULES' order (the table's slot addresses follow it)."""
    return [a.strip() for a in RULES[rule][0].split(",") if a.strip()]


def rule_hyper(rule: str) -> list[str]:
    """The scalar hyperparameters of a rule's update kernel, in order, without the weight decay."""
    return [h.strip() for h in RULES[rule][1].split(",") if h.strip() != "wd"]


def table_width(slots: int) -> int:
    """Entries per segment in the table: its addresses, layout and flags (:data:`SLOT0` of them), the slots."""
    return SLOT0 + slots


def _segment() -> str:
    return SEGMENT.format(MODE=MODE, COLUMNS=COLUMNS, INDEX=INDEX, COUNT=COUNT, DENSE=DENSE, LAZY=LAZY)


def reduce_kernels(dtype) -> tuple[str, str]:
    """(module name, CUDA source) of the step's reduction kernels for ``dtype`` (names end in ``_float`` or
    ``_double``); the table's width is an argument, so one source serves every rule."""
    T = as_dtype(dtype).c_type
    return f"optim_reduce_{T}", _segment() + REDUCE.format(T=T, LOOP=LOOP, GRAD=GRAD)


def update_kernel(rule: str, dtype) -> tuple[str, str]:
    """(kernel name, CUDA source) of one optimizer rule's update over a segment table, for ``dtype``: its
    arguments are ``(total, K, table, report, clip, hyper..., weight_decay, apply)``, the hyperparameters in
    :func:`rule_hyper`'s order, in the element type."""
    T = as_dtype(dtype).c_type
    slots = rule_slots(rule)
    _, _, step, write, finite = RULES[rule]
    # RULES index every array at [i]: here each is a pointer already at the element
    for a in ["p"] + slots:
        step, write = step.replace(f"{a}[i]", f"{a}[0]"), write.replace(f"{a}[i]", f"{a}[0]")
    sqrt = "sqrtf" if T == "float" else "sqrt"
    step = step.replace("GRAD", "(graw * scale)").replace("{T}", T).replace("{SQRT}", sqrt)
    w = table_width(len(slots))
    name = f"optim_{rule}_{T}"
    source = UPDATE.format(
        RULE=rule, T=T, LOOP=LOOP, W=w, GRAD=GRAD, DECAY=DECAY, VALUE=VALUE,
        HYPER=", ".join(f"{T} {h}" for h in rule_hyper(rule)),
        SLOTS=" ".join(f"{T} *{a} = ({T} *)s[{SLOT0 + j}] + at;" for j, a in enumerate(slots)),
        STEP=step, WRITE=write, FINITE=" + ".join(f"({x} - {x})" for x in finite.split()))
    return name, _segment() + source


def optimizer_sources(dtypes=("float32", "float64")) -> list[tuple[str, str]]:
    """Every (name, source) the fused optimizer step can hand to CuPy: each rule's update kernel and the
    reduction kernels, per dtype (what the compile check covers)."""
    out = []
    for dt in dtypes:
        for rule in RULES:
            out.append(update_kernel(rule, dt))
        out.append(reduce_kernels(dt))
    return out
