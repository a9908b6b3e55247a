"""Run generated CUDA source on the CPU: the same text compiled as C++ behind a small shim.

:class:`Launcher` runs a kernel on the arrays of the device stand-in (:mod:`.standin`): together they are the
emulated CUDA device the tests train on. :class:`Emulator` alone calls kernels on numpy arrays (the codegen
tests compare kernels with numpy that way).

The shim defines ``blockIdx``/``threadIdx``/``blockDim``/``gridDim`` as globals, ``__global__`` and
``__device__`` as nothing and ``atomicAdd`` as a plain add; for every ``extern "C" __global__`` kernel a
launcher loops over the grid, block by block and thread by thread, calling the kernel body once per thread.
That checks what a compile check cannot: indexing, bounds, broadcasting and math of every kernel, grid-stride
loops included. Threads run one after another, so races are not modelled (atomics are exact; a real GPU's
atomic order varies).

A kernel that synchronizes its block (``__syncthreads``, in its body or in a ``__device__`` function it calls)
runs its block's threads as fibers (``ucontext``, a stack each): each runs until it reaches a barrier or ends,
and the block goes on past the barrier once every thread has reached it, so what a thread wrote to
``__shared__`` memory (one static array, shared by the block's threads) before a barrier is what the others
read after it. A barrier that some threads of a block reach while others have ended is a fault (on a GPU it
hangs or corrupts): the launch returns its code (:data:`FAULTS`) and :meth:`Emulator.launch` raises. Warp
shuffles are not modelled: kernels reduce through shared memory.

Every launch through a ``call_`` wrapper (the issuing loop's) is logged with its grid and block
(:meth:`Emulator.take_log`), so the tests see the geometry the loop chose.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .standin import check_scalar

SHIM = """
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <ucontext.h>
struct mc_dim3 { unsigned x, y, z; };
static mc_dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
template <class T> static inline T atomicAdd(T *a, T v) { T old = *a; *a = old + v; return old; }

/* a block's threads as fibers, for kernels that synchronize (see emulation.py) */
enum { MC_RUNS, MC_WAITS, MC_ENDED };
enum { MC_DIVERGED = -11, MC_UNSCHEDULED = -12, MC_NO_MEMORY = -13 };   /* (FAULTS; beside the issuing loop's own) */
#define MC_STACK 65536
static struct {
    ucontext_t main, *ctx;
    int *state;
    char *stacks;
    unsigned cap, cur;
    int inside;
    void (*body)(void *);
    void *arg;
} mc_blk;
static int mc_fault;
static void __syncthreads(void) {
    if (!mc_blk.inside) { mc_fault = MC_UNSCHEDULED; return; }
    mc_blk.state[mc_blk.cur] = MC_WAITS;
    swapcontext(&mc_blk.ctx[mc_blk.cur], &mc_blk.main);
}
static void mc_fiber(void) { mc_blk.body(mc_blk.arg); mc_blk.state[mc_blk.cur] = MC_ENDED; }
static int mc_reserve(unsigned n) {
    if (n <= mc_blk.cap) return 0;
    free(mc_blk.ctx); free(mc_blk.state); free(mc_blk.stacks);
    mc_blk.ctx = (ucontext_t *)malloc(n * sizeof(ucontext_t));
    mc_blk.state = (int *)malloc(n * sizeof(int));
    mc_blk.stacks = (char *)malloc((size_t)n * MC_STACK);
    mc_blk.cap = mc_blk.ctx && mc_blk.state && mc_blk.stacks ? n : 0;
    return mc_blk.cap ? 0 : MC_NO_MEMORY;
}
/* one block: every thread runs to its next barrier or its end, round after round */
static int mc_block(unsigned block) {
    for (unsigned t = 0; t < block; t++) {
        getcontext(&mc_blk.ctx[t]);
        mc_blk.ctx[t].uc_stack.ss_sp = mc_blk.stacks + (size_t)t * MC_STACK;
        mc_blk.ctx[t].uc_stack.ss_size = MC_STACK;
        mc_blk.ctx[t].uc_link = &mc_blk.main;
        makecontext(&mc_blk.ctx[t], mc_fiber, 0);
        mc_blk.state[t] = MC_RUNS;
    }
    for (;;) {
        unsigned waiting = 0, ended = 0;
        for (unsigned t = 0; t < block; t++) {
            if (mc_blk.state[t] != MC_RUNS) continue;
            threadIdx.x = mc_blk.cur = t;
            swapcontext(&mc_blk.main, &mc_blk.ctx[t]);
        }
        for (unsigned t = 0; t < block; t++) {
            waiting += mc_blk.state[t] == MC_WAITS;
            ended += mc_blk.state[t] == MC_ENDED;
        }
        if (ended == block) return 0;
        if (waiting != block) return MC_DIVERGED;
        for (unsigned t = 0; t < block; t++) mc_blk.state[t] = MC_RUNS;
    }
}
static int mc_fibers(unsigned grid, unsigned block, void (*body)(void *), void *arg) {
    if (mc_reserve(block)) return MC_NO_MEMORY;
    mc_blk.body = body; mc_blk.arg = arg; mc_blk.inside = 1;
    int rc = 0;
    for (unsigned b = 0; b < grid && !rc; b++) { blockIdx.x = b; rc = mc_block(block); }
    mc_blk.inside = 0;
    return rc;
}
template <class F> static void mc_thunk(void *f) { (*(F *)f)(); }

/* the log of launches through call_ wrappers: (kernel, grid, block) triples */
static int64_t *mc_log_, mc_logged_, mc_log_cap_;
static void mc_note(int64_t kernel, unsigned grid, unsigned block) {
    if (mc_logged_ == mc_log_cap_) {
        int64_t cap = mc_log_cap_ ? 2 * mc_log_cap_ : 1024, *grown = (int64_t *)realloc(mc_log_, 3 * cap * 8);
        if (!grown) return;
        mc_log_ = grown; mc_log_cap_ = cap;
    }
    int64_t *e = mc_log_ + 3 * mc_logged_++;
    e[0] = kernel; e[1] = grid; e[2] = block;
}
extern "C" int64_t mc_take_log(int64_t *out, int64_t n) {
    const int64_t k = n < mc_logged_ ? n : mc_logged_;
    for (int64_t i = 0; i < 3 * k; i++) out[i] = mc_log_[i];
    mc_logged_ = 0;
    return k;
}
extern "C" int64_t mc_log_length(void) { return mc_logged_; }
"""

#: what a nonzero result of an emulated launch means
FAULTS = {-11: "a __syncthreads that some threads of a block reached while others had ended (on a GPU: a hang or "
             "corrupt shared memory)",
          -12: "a __syncthreads in a kernel the emulation ran thread after thread (it did not see the barrier)",
          -13: "no memory for the block's thread stacks"}

POINTEE = {"float": np.dtype(np.float32), "double": np.dtype(np.float64), "long": np.dtype(np.int64),
           "unsigned long long": np.dtype(np.uint64)}
SCALARS = ("long", "int", "unsigned", "float", "double", "unsigned long long", "unsigned long")
SIGNATURE = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)', re.S)


def kernels_in(source: str) -> list[tuple[str, list[str]]]:
    """(name, parameter declarations) of every ``extern "C" __global__`` kernel in ``source``."""
    return [(m.group(1), [p.strip() for p in m.group(2).replace("\n", " ").split(",")])
            for m in SIGNATURE.finditer(source)]


def functions_in(source: str) -> dict[str, str]:
    """name -> body of every top-level function defined in ``source`` (comments removed; braces counted)."""
    text = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", source, flags=re.S))
    found, depth, head_start, opened = {}, 0, 0, None
    for m in re.finditer(r"[{};]", text):
        if m.group() == ";" and depth == 0:
            head_start = m.end()
        elif m.group() == "{":
            if depth == 0:
                name = re.search(r"(\w+)\s*\([^()]*\)\s*$", text[head_start:m.start()])
                opened = (name.group(1) if name else None, m.end())
            depth += 1
        elif m.group() == "}":
            depth -= 1
            if depth == 0:
                if opened[0]:
                    found[opened[0]] = text[opened[1]:m.start()]
                head_start = m.end()
    return found


def synchronizing(source: str) -> set[str]:
    """The functions of ``source`` that reach a ``__syncthreads``: in their body or through a function they
    call. Their kernels run their blocks' threads as fibers."""
    bodies = functions_in(source)
    found = {name for name, body in bodies.items() if "__syncthreads" in body}
    while True:
        more = {name for name, body in bodies.items() if name not in found
                and any(re.search(rf"\b{re.escape(f)}\s*\(", body) for f in found)}
        if not more:
            return found
        found |= more


def _launcher(name: str, params: list[str], index: int, fibers: bool) -> tuple[str, str]:
    """``launch_<kernel>(grid, block, args...)`` (its result 0, or a fault of :data:`FAULTS`), the
    ``call_<kernel>`` wrapper, and their cffi declarations. ``fibers``: the kernel synchronizes its blocks."""
    args = ", ".join(p.split()[-1].lstrip("*") for p in params)
    plist = ", ".join(["unsigned grid_", "unsigned block_"] + params)
    head = (f'extern "C" int launch_{name}({plist}) {{\n'
            "    gridDim.x = grid_; gridDim.y = gridDim.z = 1; blockDim.x = block_; blockDim.y = blockDim.z = 1;\n"
            "    blockIdx.y = blockIdx.z = threadIdx.y = threadIdx.z = 0;\n")
    if fibers:
        run = (f"    auto run_ = [&]() {{ {name}({args}); }};\n"
               "    return mc_fibers(grid_, block_, mc_thunk<decltype(run_)>, &run_);\n}\n")
    else:
        run = ("    mc_fault = 0;\n    for (unsigned b_ = 0; b_ < grid_; b_++)\n"
               "        for (unsigned t_ = 0; t_ < block_; t_++) {\n"
               f"            blockIdx.x = b_; threadIdx.x = t_;\n            {name}({args});\n        }}\n"
               "    return mc_fault;\n}\n")
    decl = f"int launch_{name}({plist.replace('__restrict__', '')});"
    if not all("*" in p or p.rsplit(None, 1)[0] in SCALARS for p in params):   # (a struct by value: C callers only)
        decl = ""
    return head + run + _caller(name, params, index), decl + f"\nint call_{name}(unsigned, unsigned, void **);"


def _caller(name: str, params: list[str], index: int) -> str:
    """``call_<kernel>(grid, block, params)``: the kernel's launcher with its arguments read as
    ``cuLaunchKernel`` passes them (params[i] points to argument i), so C code (the issuing loop, codegen/issue_source.py)
    launches an emulated kernel through the same function-pointer interface as a real one; logged as kernel
    ``index`` of its library."""
    reads = []
    for i, p in enumerate(params):
        ctype = p.replace("__restrict__", "").rsplit(None, 1)[0].strip() if "*" not in p else \
            p.replace("__restrict__", "").split("*")[0].strip() + " *"
        reads.append(f"*({ctype} *)params_[{i}]")
    return (f'extern "C" int call_{name}(unsigned grid_, unsigned block_, void **params_) {{\n'
            f"    mc_note({index}, grid_, block_);\n"
            f"    return launch_{name}(grid_, block_, {', '.join(reads)});\n}}\n")


class Emulator:
    """Kernels of one or more CUDA sources, callable on numpy arrays: ``emu.launch(name, grid, block,
    *args)`` with arrays (or None: a null pointer) for pointer parameters and ints for the rest, in the
    kernel's parameter order."""

    def __init__(self, sources: list[str], workdir: str | Path | None = None):
        import cffi
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if cxx is None:
            raise RuntimeError("CUDA emulation needs a C++ compiler (g++)")
        self.params: dict[str, list[str]] = {}
        launchers, decls = [], ["int64_t mc_take_log(int64_t *out, int64_t n);", "int64_t mc_log_length(void);"]
        for source in sources:
            fibers = synchronizing(source)
            for name, params in kernels_in(source):
                self.params[name] = params
                body, decl = _launcher(name, params, len(self.params) - 1, name in fibers)
                launchers.append(body)
                decls.append(decl)
        text = SHIM + "\n".join(sources) + "\n" + "\n".join(launchers)
        work = Path(workdir or tempfile.mkdtemp(prefix="minicavs-cuda-emu-"))
        work.mkdir(parents=True, exist_ok=True)
        flags = ["-O1", "-shared", "-fPIC", "-std=c++14", *os.environ.get("MINICAVS_CFLAGS", "").split()]  # as c.py
        key = hashlib.sha256((text + " ".join(flags)).encode()).hexdigest()[:16]
        so = work / f"emu-{key}.so"
        if not so.exists():
            src = work / f"emu-{key}.cpp"
            src.write_text(text)
            tmp = work / f"emu-{key}.{os.getpid()}.so"
            res = subprocess.run([cxx, *flags, str(src), "-o", str(tmp)],
                                 capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"emulation build failed ({src}):\n{res.stderr[-3000:]}")
            os.replace(tmp, so)
        self.ffi = cffi.FFI()
        self.ffi.cdef("\n".join(decls))
        self.lib = self.ffi.dlopen(str(so))

    def handle(self, name: str) -> int:
        """The address of kernel ``name``'s ``call_`` wrapper: the function handle the issuing loop launches
        through the stand-in's ``cuLaunchKernel`` (codegen/issue_source.py's mc_standin_launch)."""
        return int(self.ffi.cast("uintptr_t", getattr(self.lib, f"call_{name}")))

    def launch(self, name: str, grid: int, block: int, *args) -> None:
        params = self.params[name]
        if len(args) != len(params):
            raise TypeError(f"{name} takes {len(params)} arguments, got {len(args)}")
        conv = []
        for p, a in zip(params, args):
            if "*" in p and a is None:   # (a null pointer: an operand the kernel does not read)
                conv.append(self.ffi.NULL)
            elif "*" in p:
                ctype = p.replace("__restrict__", "").replace("const", "").split("*")[0].strip()
                if not isinstance(a, np.ndarray) or a.dtype != POINTEE[ctype]:
                    raise TypeError(f"{name}: {p} needs a {POINTEE[ctype]} array, got {type(a).__name__} "
                                    f"{getattr(a, 'dtype', '')}")
                if "const" not in p and not a.flags.writeable:
                    raise TypeError(f"{name}: {p} is written, got a read-only array")
                # a view's first element; the kernel's ld arguments give the strides
                conv.append(self.ffi.cast(f"{ctype} *", a.ctypes.data))
            elif p.split()[0] in ("float", "double"):
                if not isinstance(a, (float, np.floating)):
                    raise TypeError(f"{name}: {p} needs a float, got {type(a).__name__}")
                conv.append(float(a))
            else:
                if not isinstance(a, (int, np.integer)):
                    raise TypeError(f"{name}: {p} needs an integer, got {type(a).__name__}")
                conv.append(int(a))
        fault = getattr(self.lib, f"launch_{name}")(grid, block, *conv)
        if fault:
            raise RuntimeError(f"emulated kernel {name} (grid {grid}, block {block}): {FAULTS[fault]}")

    def take_log(self) -> list[tuple[str, int, int]]:
        """(kernel, grid, block) of every launch through a ``call_`` wrapper since the last call, in order."""
        n = self.lib.mc_log_length()
        out = np.zeros(3 * max(n, 1), np.int64)
        n = self.lib.mc_take_log(self.ffi.cast("int64_t *", out.ctypes.data), n)
        names = list(self.params)
        return [(names[k], int(g), int(b)) for k, g, b in out[:3 * n].reshape(-1, 3).tolist()]


class Launcher:
    """A launcher (see :mod:`minicavs.cuda`) that runs kernels through the emulation, on the device stand-in's
    arrays: ``Cuda(Launcher())`` is the emulated CUDA device, whose arrays refuse every host/device crossing
    CuPy refuses (:mod:`.standin`). A host array as a pointer argument raises CuPy's error. One emulation
    library per source, built on first use."""

    emulated = True

    def __init__(self, workdir: str | Path | None = None):
        from . import standin
        self.xp = standin
        self.workdir = workdir
        self.emulators: dict[str, Emulator] = {}
        self.launches: list[tuple[str, int, int]] = []   # (kernel, grid, block) of every launch, in order

    def emulator(self, source: str) -> Emulator:
        """The emulation of ``source`` (built on first use)."""
        emu = self.emulators.get(source)
        if emu is None:
            emu = self.emulators[source] = Emulator([source], self.workdir)
        return emu

    def __call__(self, source: str, name: str, grid: int, block: int, args, stream=None) -> None:
        emu = self.emulator(source)
        host = []
        for a in args:
            if isinstance(a, np.ndarray):
                raise TypeError(f"You are trying to pass a numpy.ndarray of shape {a.shape} as a kernel parameter. "
                                "Only numpy.ndarrays of size one can be passed by value. If you meant to pass a "
                                "pointer to __global__ memory, you need to pass a cupy.ndarray instead.")
            host.append(a._a if isinstance(a, self.xp.ndarray) else a)
        for param, a in zip(emu.params[name], args):
            if "*" not in param:
                check_scalar(name, param, a)
        self.launches.append((name, grid, block))
        emu.launch(name, grid, block, *host)
