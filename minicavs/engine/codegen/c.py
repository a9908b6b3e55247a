"""C source for fused groups and row movement: strings only (minicavs/cpu compiles, loads and caches them).

Every group becomes ``void k(long rows, long cols, const T *x0, long ld0, ..., T *y, long ldy)`` (and
``k_u(rows, cols, ptrs, lds)``, the same behind one signature for the C runner): a row loop
around a ``#pragma omp simd`` column loop, so a group reads strided views (the ``h`` half of a gathered
``[h, c]``) and writes straight into a dynamic tensor's rows without copies. float32 groups use
:mod:`.vecmath`'s branch-free ``exp``/``tanh`` so the column loop vectorizes; float64 groups call libm.
All groups of one vertex function share one translation unit (one compiler run, not one per group).
"""
from __future__ import annotations

import hashlib
from typing import Sequence

from ..passes.fusion import FusedGroup
from .cstyle import render_body
from .vecmath import FUNCS_F32, PRELUDE_F32

CODEGEN_VERSION = 2


def render(group: FusedGroup) -> tuple[str, str, str]:
    """(kernel name, C declaration, C function) of a group: y_k[r, c] = expr_k(x0[...], x1[...], ...)."""
    dt = group.output.dtype
    T = dt.c_type
    reads, hoisted = [], []
    for i, kind in enumerate(group.broadcast):
        if kind == "full":
            reads.append(f"x{i}[r * ld{i} + c]")
        elif kind == "row":
            reads.append(f"x{i}[c]")
        elif kind == "col":
            hoisted.append(f"const {T} v{i} = x{i}[r * ld{i}];")
            reads.append(f"v{i}")
        else:
            hoisted.append(f"const {T} v{i} = x{i}[0];")
            reads.append(f"v{i}")
    nout = len(group.outputs)
    body = render_body(group.exprs(), reads, dt, [f"y{k}[r * ldy{k} + c]" for k in range(nout)],
                       FUNCS_F32 if dt.name == "float32" else None)
    params = ", ".join([f"const {T} *restrict x{i}, long ld{i}" for i in range(len(group.inputs))]
                       + [f"{T} *restrict y{k}, long ldy{k}" for k in range(nout)])
    text = "\n".join(hoisted + body)
    name = "fused_" + hashlib.sha1(f"{params}\n{text}".encode()).hexdigest()[:12]
    decl = f"void {name}(long rows, long cols, {params});"
    inner = "\n            ".join(body)
    outer = "".join(f"\n        {h}" for h in hoisted)
    source = (f"{decl[:-1]}\n{{\n    for (long r = 0; r < rows; r++) {{{outer}\n"
              f"        #pragma omp simd\n        for (long c = 0; c < cols; c++) {{\n            {inner}\n"
              f"        }}\n    }}\n}}\n")
    return name, decl, source + _uniform(name, T, len(group.inputs), nout)


def _uniform(name: str, T: str, nin: int, nout: int) -> str:
    """``name_u(rows, cols, ptrs, lds)``: the kernel behind one signature, so the C runner
    (codegen/machine.py) can call any group through one function pointer type."""
    args = ", ".join([f"(const {T} *)p[{i}], ld[{i}]" for i in range(nin)]
                     + [f"({T} *)p[{nin + k}], ld[{nin + k}]" for k in range(nout)])
    return (f"void {name}_u(long rows, long cols, void *const *p, const long *ld)\n"
            f"{{\n    {name}(rows, cols, {args});\n}}\n")


def uniform_decl(name: str) -> str:
    return f"void {name}_u(long rows, long cols, void *const *p, const long *ld);"


def translation_unit(groups: Sequence[FusedGroup]) -> tuple[str, str, list]:
    """One library's C source, its cffi declarations, and each group's rendering (name, decl, function)."""
    rendered = [render(g) for g in groups]
    f32 = any(g.output.dtype.name == "float32" for g in groups)
    source = "#include <math.h>\n" + (PRELUDE_F32 if f32 else "") + "\n".join(sorted({s for _, _, s in rendered}))
    decls = sorted({d for _, d, _ in rendered} | {uniform_decl(name) for name, _, _ in rendered})
    return source, "\n".join(decls), rendered


ROWS_SOURCE = """
#include <string.h>
void gather_rows_{T}(long n, long cols, const {T} *restrict src, long lds, const long *restrict idx,
                     {T} *restrict dst, long ldd) {{
    for (long r = 0; r < n; r++)
        memcpy(dst + r * ldd, src + idx[r] * lds, (size_t)cols * sizeof({T}));
}}
void scatter_add_rows_{T}(long n, long cols, const {T} *restrict src, long lds, const long *restrict idx,
                          {T} *restrict dst, long ldd) {{
    for (long r = 0; r < n; r++) {{
        {T} *d = dst + idx[r] * ldd;
        const {T} *s = src + r * lds;
        #pragma omp simd
        for (long c = 0; c < cols; c++)
            d[c] += s[c];
    }}
}}
"""


def row_decls(T: str) -> str:
    args = f"long n, long cols, const {T} *src, long lds, const long *idx, {T} *dst, long ldd"
    return f"void gather_rows_{T}({args});\nvoid scatter_add_rows_{T}({args});"
