"""CUDA C++ for fused groups and row movement: plain strings, no CUDA import, so CI can compile them with NVRTC
or nvcc and run the very same text on the CPU (minicavs/cuda/emulation.py).

A fused kernel has the C kernels' contract (codegen/c.py): ``(long rows, long cols, const T *x0, long ld0,
..., T *y0, long ldy0, ...)``, input i read at ``r * ld_i + c`` (full), ``c`` (row), ``r * ld_i`` (col) or
``0`` (scalar); the body comes from the same renderer (cstyle.py), with CUDA's own ``tanhf``/``expf``. One
thread per element in a grid-stride loop, so any grid covers any size. Row kernels move all rows of a task in
one launch: gather (dst[r] = src[idx[r]]), scatter (dst[idx[r]] = src[r], pushes), scatter-add with
``atomicAdd`` (parents sharing a child in a DAG: fast, not bit-reproducible, since the order of atomic adds
varies), and a deterministic segment sum (rows sorted by destination, each (segment, column) summed by one
thread in a fixed order).
"""
from __future__ import annotations

import hashlib

from ...core.dtypes import as_dtype
from ..passes.fusion import FusedGroup
from .cstyle import render_body

BLOCK = 256
OPTIONS = ("-std=c++14",)   # NVRTC options: the CuPy launchers (minicavs/cuda) and the compile check use these
MAX_BLOCKS = 4096   # the grid-stride loop covers the rest; enough blocks to fill any current GPU

LOOP = "for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)blockDim.x * gridDim.x)"


def grid(n: int, block: int = BLOCK) -> int:
    """Blocks for ``n`` threads' worth of work, at least one, at most MAX_BLOCKS."""
    return max(1, min(MAX_BLOCKS, (n + block - 1) // block))


def render(group: FusedGroup) -> tuple[str, str]:
    """(kernel name, CUDA source) of a fused group; every output is written where the C kernel writes it."""
    dt = group.output.dtype
    T = dt.c_type
    reads = []
    for i, kind in enumerate(group.broadcast):
        if kind == "other":
            raise ValueError("a flat (rows, cols) index cannot express this group's broadcasting")
        reads.append({"full": f"x{i}[r * ld{i} + c]", "row": f"x{i}[c]", "col": f"x{i}[r * ld{i}]",
                      "scalar": f"x{i}[0]"}[kind])
    nout = len(group.outputs)
    body = render_body(group.exprs(), reads, dt, [f"y{k}[r * ldy{k} + c]" for k in range(nout)])
    params = ", ".join(["long rows", "long cols"]
                       + [f"const {T} *__restrict__ x{i}, long ld{i}" for i in range(len(group.inputs))]
                       + [f"{T} *__restrict__ y{k}, long ldy{k}" for k in range(nout)])
    text = "\n".join(body)
    name = "fused_" + hashlib.sha1(f"{params}\n{text}".encode()).hexdigest()[:12]
    inner = "\n        ".join(body)
    source = (f'extern "C" __global__ void {name}({params})\n{{\n    const long n = rows * cols;\n    {LOOP} {{\n'
              f"        const long r = i / cols, c = i - r * cols;\n        {inner}\n    }}\n}}\n")
    return name, source


ROW_KERNELS = """
extern "C" __global__ void gather_rows_{T}(long rows, long cols, const {T} *__restrict__ src, long lds,
                                           const long *__restrict__ idx, {T} *__restrict__ dst, long ldd)
{{
    const long n = rows * cols;
    {LOOP} {{
        const long r = i / cols, c = i - r * cols;
        dst[r * ldd + c] = src[idx[r] * lds + c];
    }}
}}
extern "C" __global__ void scatter_rows_{T}(long rows, long cols, const {T} *__restrict__ src, long lds,
                                            const long *__restrict__ idx, {T} *__restrict__ dst, long ldd)
{{
    const long n = rows * cols;
    {LOOP} {{
        const long r = i / cols, c = i - r * cols;
        dst[idx[r] * ldd + c] = src[r * lds + c];
    }}
}}
extern "C" __global__ void scatter_add_rows_{T}(long rows, long cols, const {T} *__restrict__ src, long lds,
                                                const long *__restrict__ idx, {T} *__restrict__ dst, long ldd)
{{
    const long n = rows * cols;
    {LOOP} {{
        const long r = i / cols, c = i - r * cols;
        atomicAdd(&dst[idx[r] * ldd + c], src[r * lds + c]);
    }}
}}
extern "C" __global__ void segment_sum_rows_{T}(long segments, long cols, const {T} *__restrict__ src, long lds,
                                                const long *__restrict__ order, const long *__restrict__ ptr,
                                                const long *__restrict__ target, {T} *__restrict__ dst, long ldd)
{{
    const long n = segments * cols;
    {LOOP} {{
        const long s = i / cols, c = i - s * cols;
        {T} acc = 0;
        for (long k = ptr[s]; k < ptr[s + 1]; k++)
            acc += src[order[k] * lds + c];
        dst[target[s] * ldd + c] += acc;
    }}
}}
#ifndef MC_MIX
#define MC_MIX
__device__ __forceinline__ unsigned long long mc_mix(unsigned long long z)
{{
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ULL; z ^= z >> 27; z *= 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}}
#endif
/* y = x * dropout mask: minicavs/core/random.py's hash word for word (h: after seed, step, site; then the row
   key, then the column), kept where (hash >> 40) >= t = ceil(p * 2^24), as the C library's mask */
extern "C" __global__ void dropout_rows_{T}(long rows, long cols, unsigned long long h,
                                            const unsigned long long *__restrict__ keys, unsigned long long t,
                                            {T} scale, const {T} *__restrict__ x, long ldx,
                                            {T} *__restrict__ y, long ldy)
{{
    const unsigned long long golden = 0x9E3779B97F4A7C15ULL;
    const long n = rows * cols;
    {LOOP} {{
        const long r = i / cols, c = i - r * cols;
        const unsigned long long hr = mc_mix(h ^ keys[r]) + golden;
        const unsigned long long z = mc_mix(hr ^ (unsigned long long)c) + golden;
        y[r * ldy + c] = x[r * ldx + c] * ((z >> 40) >= t ? scale : ({T})0);
    }}
}}
"""

ROW_KERNEL_NAMES = ("gather_rows", "scatter_rows", "scatter_add_rows", "segment_sum_rows", "dropout_rows")


def row_kernels(dtype) -> tuple[str, str]:
    """(module name, CUDA source) of the row kernels (ROW_KERNEL_NAMES: row movement and dropout) for
    ``dtype``; kernel names end in ``_float`` or ``_double``."""
    T = as_dtype(dtype).c_type
    return f"rows_{T}", ROW_KERNELS.format(T=T, LOOP=LOOP)


def segments(idx) -> tuple:
    """The deterministic scatter-add's plan for destination rows ``idx``: (order, ptr, target) with rows
    ``order[ptr[s]:ptr[s+1]]`` summed, in that fixed order, into row ``target[s]``."""
    import numpy as np
    idx = np.asarray(idx, np.int64)
    order = np.argsort(idx, kind="stable")
    sidx = idx[order]
    starts = np.flatnonzero(np.concatenate(([True], sidx[1:] != sidx[:-1]))) if len(idx) else np.zeros(0, int)
    ptr = np.concatenate((starts, [len(idx)])).astype(np.int64)
    return order.astype(np.int64), ptr, sidx[starts].astype(np.int64)


def kernel_sources(groups, dtypes=("float32", "float64")) -> list[tuple[str, str]]:
    """Every (name, source) the backend hands to CuPy for these fused groups and dtypes: one per group
    (groups a flat index cannot express are left to the unfused path), and the row kernels per dtype."""
    out = [render(g) for g in groups if "other" not in g.broadcast]
    out += [row_kernels(dt) for dt in dtypes]
    return list(dict(out).items())
