"""The GPU's own path without a GPU: stub ``libcuda.so.1`` and ``libcublas.so.13`` built by the test suite, and a
fake of the few CuPy objects the C issuing loop's setup (minicavs/cuda/issue.py's ``_Gpu``) touches.

The stubs are compiled here (cc, into a temporary folder) under the real sonames and loaded into this process,
so the loop finds them exactly as on a GPU: in ``/proc/self/maps``, then by ``dlopen(RTLD_NOLOAD)`` and
``dlsym``. They run what they are handed on the CUDA emulation (a kernel handle is an emulated kernel's
``call_`` wrapper, memory is the device stand-in's host memory) and check their arguments as the driver and
cuBLAS would, failing loudly (stderr, a count, the last message, a nonzero result) on: a null or unknown
function, an unknown stream or event, a handle this copy of cuBLAS did not create, a stream switch while a
product of the handle's other stream is outstanding (not yet synchronized: their workspace is shared), a
negative size or a leading dimension smaller than cuBLAS allows, mixed data types.

The fake CuPy is the device stand-in's arrays (cuda/standin.py) plus the runtime objects, each modelled on CuPy
14.2's source (tag v14.2.0):

- ``RawModule(code=..., options=...)`` (cupy/_core/raw.pyx:306, keyword-only ``__init__`` at :364);
  ``RawModule.get_function(name)`` returns a ``RawKernel`` (raw.pyx:439-470), which has no ``ptr``: its
  ``kernel`` property (raw.pyx:106-108) is the ``cupy.cuda.function.Function`` whose ``ptr`` is the
  ``CUfunction`` (cupy/cuda/function.pxd:9-13, ``public intptr_t ptr``; set by ``moduleGetFunction`` in
  function.pyx:138-140); ``RawKernel.__call__(grid, block, args, **kwargs)`` calls it (raw.pyx:86-104,
  function.pyx:142); a numpy.ndarray argument raises (function.pyx:66-79);
- ``cuda.Event(block=False, disable_timing=False, interprocess=False)`` with ``ptr`` (cupy/cuda/stream.pyx:101-140);
  ``cuda.Stream(null=False, non_blocking=False, ptds=False)`` with ``ptr`` (stream.pyx:194-215, :459-494),
  ``cuda.get_current_stream()`` (stream.pyx:88, re-exported by cupy/cuda/__init__.py:154);
- ``cuda.device.get_cublas_handle()`` (cupy/cuda/device.pyx:62-63: the current device's handle, made by
  ``cublas.create`` of the libcublas CuPy links), ``cuda.Device().synchronize()`` (device.pyx:199).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

COMMON = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int64_t errors_;
static char last_[512];
static int fail(int code, const char *what) {
    errors_++;
    snprintf(last_, sizeof last_, "%s", what);
    fprintf(stderr, "stub %s: %s\n", LIBRARY, what);
    return code;
}
int64_t stub_errors(void) { return errors_; }
const char *stub_last_error(void) { return last_; }
#define MAXK 8192
static int known(void *const *table, int64_t n, const void *p) {
    for (int64_t i = 0; i < n; i++) if (table[i] == p) return 1;
    return 0;
}
"""

DRIVER = COMMON + r"""
typedef int (*call_t)(unsigned, unsigned, void **);   /* 0, or the emulation's fault */
static void *functions_[MAXK], *streams_[MAXK], *events_[MAXK];
static int64_t nfunctions_, nstreams_, nevents_, launches_, records_, waits_;
/* cuModuleGetFunction's part: an emulated kernel's call_ wrapper becomes a function of a loaded module */
void stub_load_function(void *f) { if (nfunctions_ < MAXK) functions_[nfunctions_++] = f; }
int cuStreamCreate(void **stream, unsigned flags) {
    *stream = malloc(1); streams_[nstreams_++] = *stream; return 0;
}
int cuEventCreate(void **event, unsigned flags) {
    *event = malloc(1); events_[nevents_++] = *event; return 0;
}
/* a stream this driver made, or 0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD */
static int stream_ok(void *s) { return (uintptr_t)s <= 2 || known(streams_, nstreams_, s); }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shmem, void *stream, void **params, void **extra) {
    if (!f) return fail(400, "cuLaunchKernel: a null function (CUDA_ERROR_INVALID_HANDLE)");
    if (!known(functions_, nfunctions_, f)) return fail(400, "cuLaunchKernel: not a function of a loaded module");
    if (!stream_ok(stream)) return fail(400, "cuLaunchKernel: an unknown stream");
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return fail(1, "cuLaunchKernel: an invalid grid or block (CUDA_ERROR_INVALID_VALUE)");
    if (gy != 1 || gz != 1 || by != 1 || bz != 1) return fail(1, "cuLaunchKernel: the emulation runs 1-D grids");
    if (!params || extra) return fail(1, "cuLaunchKernel: arguments must come as kernelParams");
    launches_++;
    if (((call_t)f)(gx, bx, params))
        return fail(719, "cuLaunchKernel: the kernel faulted (CUDA_ERROR_LAUNCH_FAILED)");
    return 0;
}
int cuEventRecord(void *event, void *stream) {
    if (!known(events_, nevents_, event)) return fail(400, "cuEventRecord: an unknown event");
    if (!stream_ok(stream)) return fail(400, "cuEventRecord: an unknown stream");
    records_++;
    return 0;
}
int cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
    if (!known(events_, nevents_, event)) return fail(400, "cuStreamWaitEvent: an unknown event");
    if (!stream_ok(stream)) return fail(400, "cuStreamWaitEvent: an unknown stream");
    if (flags) return fail(1, "cuStreamWaitEvent: flags must be 0");
    waits_++;
    return 0;
}
int64_t stub_launches(void) { return launches_; }
int64_t stub_records(void) { return records_; }
int64_t stub_waits(void) { return waits_; }
"""

CUBLAS = COMMON + r"""
#define MAXH 256
static void *handles_[MAXH], *stream_[MAXH], *pending_[MAXH], *streams_used_[MAXK];
static int has_pending_[MAXH], mode_[MAXH];
static int64_t nhandles_, products_, nstreams_used_;
static int64_t slot(void *h) {
    for (int64_t i = 0; i < nhandles_; i++) if (handles_[i] && handles_[i] == h) return i;
    return -1;
}
int cublasCreate_v2(void **handle) {
    if (nhandles_ >= MAXH) return fail(3, "cublasCreate_v2: out of handles");
    *handle = handles_[nhandles_] = malloc(1);
    stream_[nhandles_] = 0; has_pending_[nhandles_] = 0; mode_[nhandles_] = 0;
    nhandles_++;
    return 0;
}
int cublasDestroy_v2(void *handle) {
    const int64_t i = slot(handle);
    if (i < 0) return fail(1, "cublasDestroy_v2: a handle this library did not create");
    handles_[i] = 0;
    return 0;
}
int cublasSetStream_v2(void *handle, void *stream) {
    const int64_t i = slot(handle);
    if (i < 0) return fail(1, "cublasSetStream_v2: a handle this library did not create");
    if (has_pending_[i] && pending_[i] != stream)
        return fail(14, "cublasSetStream_v2: the handle's stream switched while a product of its other stream "
                        "is outstanding (cublasSetStream resets the workspace both would share)");
    stream_[i] = stream;
    return 0;
}
int cublasSetPointerMode_v2(void *handle, int mode) {
    const int64_t i = slot(handle);
    if (i < 0) return fail(1, "cublasSetPointerMode_v2: a handle this library did not create");
    mode_[i] = mode;
    return 0;
}
/* the device synchronized (or ``stream`` did; NULL: all): no product is outstanding there any more */
void stub_synchronize(void *stream, int all) {
    for (int64_t i = 0; i < nhandles_; i++) if (all || pending_[i] == stream) has_pending_[i] = 0;
}
int64_t stub_products(void) { return products_; }
int64_t stub_streams_used(void) { return nstreams_used_; }
void stub_forget_streams(void) { nstreams_used_ = 0; }
int64_t stub_live_handles(void) {
    int64_t n = 0;
    for (int64_t i = 0; i < nhandles_; i++) n += handles_[i] != 0;
    return n;
}

static float tf32(float x) {
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    memcpy(&x, &u, 4); return x;
}
#define GEMM(T, NAME) \
static void NAME(int ta, int tb, int m, int n, int k, T alpha, const T *A, int lda, const T *B, int ldb, T beta, \
                 T *C, int ldc, int round) { \
    for (int64_t j = 0; j < n; j++) for (int64_t i = 0; i < m; i++) { \
        double s = 0; \
        for (int64_t l = 0; l < k; l++) { \
            T a = ta ? A[l + i * lda] : A[i + l * lda], b = tb ? B[j + l * ldb] : B[l + j * ldb]; \
            if (round) { a = (T)tf32((float)a); b = (T)tf32((float)b); } \
            s += (double)a * (double)b; \
        } \
        C[i + j * ldc] = (T)(alpha * s + (beta != 0 ? (double)beta * C[i + j * ldc] : 0.0)); \
    } \
}
GEMM(float, gemm_f)
GEMM(double, gemm_d)

/* cuBLAS's argument rules (cublasGemmEx / cublasGemmStridedBatchedEx), then the product in column-major terms */
static int product(const char *fn, void *handle, int ta, int tb, int m, int n, int k, const void *alpha,
                   const void *A, int at, int lda, long long sa, const void *B, int bt, int ldb, long long sb,
                   const void *beta, void *C, int ct, int ldc, long long sc, int count, int compute) {
    static char what[256];
    const int64_t i = slot(handle);
    snprintf(what, sizeof what, "%s: ", fn);
#define REFUSE(code, why) return fail(code, strncat(what, why, sizeof what - strlen(what) - 1))
    if (i < 0) REFUSE(1, "a handle this library did not create (CUBLAS_STATUS_NOT_INITIALIZED)");
    if (mode_[i] != 0) REFUSE(7, "alpha and beta are host numbers, the handle is in device pointer mode");
    if ((ta != 0 && ta != 1) || (tb != 0 && tb != 1)) REFUSE(7, "an unknown transpose");
    if (m < 0 || n < 0 || k < 0 || count < 0) REFUSE(7, "a negative size (CUBLAS_STATUS_INVALID_VALUE)");
    if (lda < (ta ? (k > 1 ? k : 1) : (m > 1 ? m : 1)) || ldb < (tb ? (n > 1 ? n : 1) : (k > 1 ? k : 1))
        || ldc < (m > 1 ? m : 1)) REFUSE(7, "a leading dimension smaller than its matrix's rows");
    if (at != bt || bt != ct || (at != 0 && at != 1)) REFUSE(7, "mixed or unknown data types");
    if ((at == 0 && compute != 68 && compute != 77) || (at == 1 && compute != 70)) REFUSE(7, "a wrong compute type");
    if (m && n && (!C || (k && (!A || !B)))) REFUSE(7, "a null matrix");
#undef REFUSE
    for (int b = 0; b < count; b++) {
        if (at == 0)
            gemm_f(ta, tb, m, n, k, *(const float *)alpha, (const float *)A + b * sa, lda, (const float *)B + b * sb,
                   ldb, *(const float *)beta, (float *)C + b * sc, ldc, compute == 77);
        else
            gemm_d(ta, tb, m, n, k, *(const double *)alpha, (const double *)A + b * sa, lda,
                   (const double *)B + b * sb, ldb, *(const double *)beta, (double *)C + b * sc, ldc, 0);
    }
    has_pending_[i] = 1; pending_[i] = stream_[i];
    if (!known(streams_used_, nstreams_used_, stream_[i]) && nstreams_used_ < MAXK)
        streams_used_[nstreams_used_++] = stream_[i];
    products_++;
    return 0;
}
int cublasGemmEx(void *handle, int ta, int tb, int m, int n, int k, const void *alpha, const void *A, int at,
                 int lda, const void *B, int bt, int ldb, const void *beta, void *C, int ct, int ldc, int compute,
                 int algo) {
    return product("cublasGemmEx", handle, ta, tb, m, n, k, alpha, A, at, lda, 0, B, bt, ldb, 0, beta, C, ct, ldc,
                   0, 1, compute);
}
int cublasGemmStridedBatchedEx(void *handle, int ta, int tb, int m, int n, int k, const void *alpha, const void *A,
                               int at, int lda, long long sa, const void *B, int bt, int ldb, long long sb,
                               const void *beta, void *C, int ct, int ldc, long long sc, int count, int compute,
                               int algo) {
    return product("cublasGemmStridedBatchedEx", handle, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb,
                   beta, C, ct, ldc, sc, count, compute);
}
"""

CUBLAS_SONAME = "libcublas.so.13"   # (CuPy 14 for CUDA 13: cupy-cuda13x)


def _library(cc: str, source: str, name: str, soname: str, folder: Path):
    """``source`` built as ``folder/soname`` with that soname, loaded into this process (ctypes)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f"{name}.c"
    src.write_text(f'#define LIBRARY "{soname} ({name})"\n' + source)
    so = folder / soname
    res = subprocess.run([cc, "-O1", "-shared", "-fPIC", f"-Wl,-soname,{soname}", str(src), "-o", str(so)],
                         capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"stub {soname} did not build:\n{res.stderr[-2000:]}")
    lib = ctypes.CDLL(str(so))
    for fn in ("stub_errors", "stub_launches", "stub_records", "stub_waits", "stub_products", "stub_streams_used",
               "stub_live_handles"):
        if hasattr(lib, fn):
            getattr(lib, fn).restype = ctypes.c_int64
    lib.stub_last_error.restype = ctypes.c_char_p
    return lib


class Stubs:
    """The stub driver and two copies of the stub cuBLAS (``cupy``: the one CuPy links; ``wheel``: another
    package's), built under ``folder`` and loaded into this process for good (a library cannot be unmapped
    safely): build once per test session."""

    def __init__(self, folder: Path):
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("the GPU path's stubs need a C compiler")
        self.cuda = _library(cc, DRIVER, "driver", "libcuda.so.1", folder / "driver")
        self.cublas = {which: _library(cc, CUBLAS, which, CUBLAS_SONAME, folder / which) for which in ("cupy", "wheel")}

    def errors(self) -> list[str]:
        """The stubs' refusals so far (their last messages), one per library that refused."""
        return [f"{lib._name}: {lib.stub_errors()} refusals, last: {lib.stub_last_error().decode()}"
                for lib in (self.cuda, *self.cublas.values()) if lib.stub_errors()]

    def products(self) -> int:
        return sum(lib.stub_products() for lib in self.cublas.values())


def fake_cupy(stubs: Stubs, owner: str, emulation_dir) -> dict:
    """The modules ``cupy``, ``cupy.cuda``, ``cupy.cuda.cublas``, ``cupy.cuda.device`` of a fake CuPy whose
    arrays are the stand-in's, whose kernels run on the emulation and are launched through the stub driver,
    and whose cuBLAS handle comes from ``stubs.cublas[owner]``."""
    from minicavs.cuda import standin
    from minicavs.cuda.emulation import Emulator
    driver, blas = stubs.cuda, stubs.cublas[owner]

    def new(create) -> int:
        ptr = ctypes.c_void_p()
        assert create(ctypes.byref(ptr), 0) == 0
        return ptr.value

    def synchronize(stream, all_: bool) -> None:
        for lib in stubs.cublas.values():
            lib.stub_synchronize(ctypes.c_void_p(stream), int(all_))

    class Function:   # cupy/cuda/function.pyx:134
        def __init__(self, emulator, name: str):
            self.emulator, self.name = emulator, name
            self.ptr = emulator.handle(name)
            driver.stub_load_function(ctypes.c_void_p(self.ptr))

        def __call__(self, grid: tuple, block: tuple, args, shared_mem=0, stream=None,
                     enable_cooperative_groups=False) -> None:
            host = []
            for a in args:
                if isinstance(a, np.ndarray):   # function.pyx:66-79
                    raise TypeError(f"You are trying to pass a numpy.ndarray of shape {a.shape} as a kernel "
                                    "parameter. Only numpy.ndarrays of size one can be passed by value. If you meant "
                                    "to pass a pointer to __global__ memory, you need to pass a cupy.ndarray instead.")
                host.append(a._a if isinstance(a, standin.ndarray) else a)
            self.emulator.launch(self.name, grid[0], block[0], *host)

    class RawKernel:   # cupy/_core/raw.pyx:10 (no ``ptr``: the handle is ``kernel.ptr``)
        def __init__(self, module, name: str):
            self._module, self.name = module, name
            self._function = None

        @property
        def kernel(self) -> Function:
            if self._function is None:
                self._function = Function(self._module.emulator, self.name)
            return self._function

        def __call__(self, grid, block, args, **kwargs) -> None:
            self.kernel(grid, block, args, **kwargs)

    class RawModule:   # cupy/_core/raw.pyx:306
        def __init__(self, *, code=None, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                     enable_cooperative_groups=False, name_expressions=None, jitify=False):
            self.code, self.options = code, options
            self.emulator = Emulator([code], emulation_dir)

        def get_function(self, name: str) -> RawKernel:
            return RawKernel(self, name)

    class Event:   # cupy/cuda/stream.pyx:101
        def __init__(self, block=False, disable_timing=False, interprocess=False):
            self.ptr = new(driver.cuEventCreate)

        done = property(lambda self: True)

        def record(self, stream=None) -> None:
            pass

        def synchronize(self) -> None:
            synchronize(None, True)

    class Stream:   # cupy/cuda/stream.pyx:459
        def __init__(self, null=False, non_blocking=False, ptds=False):
            self.ptr = 0 if null else new(driver.cuStreamCreate)

        def record(self, event=None):
            return event or Event()

        def wait_event(self, event) -> None:
            pass

        def synchronize(self) -> None:
            synchronize(self.ptr, False)

        def __enter__(self):
            current.append(self)
            return self

        def __exit__(self, *exc) -> None:
            current.pop()

    class Device:   # cupy/cuda/device.pyx:125
        def __init__(self, device=None):
            self.id = 0

        def synchronize(self) -> None:
            synchronize(None, True)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    current = [Stream(null=True)]
    handle = []

    def get_cublas_handle() -> int:   # cupy/cuda/device.pyx:62
        if not handle:
            ptr = ctypes.c_void_p()
            assert blas.cublasCreate_v2(ctypes.byref(ptr)) == 0
            handle.append(ptr.value)
        return handle[0]

    cupy = types.ModuleType("cupy")
    cupy.__getattr__ = lambda name: getattr(standin, name)   # (arrays and array functions: the stand-in's)
    cuda = types.ModuleType("cupy.cuda")
    cublas = types.ModuleType("cupy.cuda.cublas")
    device = types.ModuleType("cupy.cuda.device")
    device.get_cublas_handle, device.Device = get_cublas_handle, Device
    cuda.__dict__.update(Stream=Stream, Event=Event, Device=Device, get_current_stream=lambda: current[-1],
                         runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0),
                         cublas=cublas, device=device)
    cupy.cuda, cupy.RawModule, cupy.RawKernel = cuda, RawModule, RawKernel
    cupy.get_array_module = lambda *a: cupy if any(isinstance(x, standin.ndarray) for x in a) else np
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.cublas": cublas, "cupy.cuda.device": device}


def has_real_cupy() -> bool:
    """Is a real CuPy importable here? (Then the gpu-marked tests run the real path; the stubs stay out.)"""
    import importlib.util
    if "cupy" in sys.modules:
        return getattr(sys.modules["cupy"], "__file__", None) is not None
    return importlib.util.find_spec("cupy") is not None
