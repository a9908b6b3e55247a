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
struct mc_dim3 { unsigned x, y, z; };
static mc_dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
template <class T> static inline T atomicAdd(T *a, T v) { T old = *a; *a = old + v; return old; }
"""

POINTEE = {"float": np.dtype(np.float32), "double": np.dtype(np.float64), "long": np.dtype(np.int64),
           "unsigned long long": np.dtype(np.uint64)}
SCALARS = ("long", "int", "unsigned", "float", "double", "unsigned long long", "unsigned long")
SIGNATURE = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)', re.S)


def kernels_in(source: str) -> list[tuple[str, list[str]]]:
    """(name, parameter declarations) of every ``extern "C" __global__`` kernel in ``source``."""
    return [(m.group(1), [p.strip() for p in m.group(2).replace("\n", " ").split(",")])
            for m in SIGNATURE.finditer(source)]


def _launcher(name: str, params: list[str]) -> tuple[str, str]:
    args = ", ".join(p.split()[-1].lstrip("*") for p in params)
    plist = ", ".join(["unsigned grid_", "unsigned block_"] + params)
    body = (f'extern "C" void launch_{name}({plist}) {{\n'
            "    gridDim.x = grid_; gridDim.y = gridDim.z = 1; blockDim.x = block_; blockDim.y = blockDim.z = 1;\n"
            "    blockIdx.y = blockIdx.z = threadIdx.y = threadIdx.z = 0;\n"
            "    for (unsigned b_ = 0; b_ < grid_; b_++)\n        for (unsigned t_ = 0; t_ < block_; t_++) {\n"
            f"            blockIdx.x = b_; threadIdx.x = t_;\n            {name}({args});\n        }}\n}}\n")
    decl = f"void launch_{name}({plist.replace('__restrict__', '')});"
    if not all("*" in p or p.rsplit(None, 1)[0] in SCALARS for p in params):   # (a struct by value: C callers only)
        decl = ""
    return body + _caller(name, params), decl + f"\nvoid call_{name}(unsigned, unsigned, void **);"


def _caller(name: str, params: list[str]) -> str:
    """``call_<kernel>(grid, block, params)``: the kernel's launcher with its arguments read as
    ``cuLaunchKernel`` passes them (params[i] points to argument i), so C code (the issuing loop, codegen/issue_source.py)
    launches an emulated kernel through the same function-pointer interface as a real one."""
    reads = []
    for i, p in enumerate(params):
        ctype = p.replace("__restrict__", "").rsplit(None, 1)[0].strip() if "*" not in p else \
            p.replace("__restrict__", "").split("*")[0].strip() + " *"
        reads.append(f"*({ctype} *)params_[{i}]")
    return (f'extern "C" void call_{name}(unsigned grid_, unsigned block_, void **params_) {{\n'
            f"    launch_{name}(grid_, block_, {', '.join(reads)});\n}}\n")


class Emulator:
    """Kernels of one or more CUDA sources, callable on numpy arrays: ``emu.launch(name, grid, block,
    *args)`` with arrays for pointer parameters and ints for the rest, in the kernel's parameter order."""

    def __init__(self, sources: list[str], workdir: str | Path | None = None):
        import cffi
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if cxx is None:
            raise RuntimeError("CUDA emulation needs a C++ compiler (g++)")
        self.params: dict[str, list[str]] = {}
        launchers, decls = [], []
        for source in sources:
            for name, params in kernels_in(source):
                self.params[name] = params
                body, decl = _launcher(name, params)
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
            if "*" in p:
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
        getattr(self.lib, f"launch_{name}")(grid, block, *conv)


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
