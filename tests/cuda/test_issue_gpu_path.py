"""The C issuing loop on the path it takes on a GPU (minicavs/cuda/issue.py's ``_Gpu``), without one: a fake of
CuPy's runtime objects over the device stand-in, and stub ``libcuda.so.1`` / ``libcublas.so.13`` (tests/cuda/
gpu_stubs.py) found through ``/proc/self/maps`` and ``dlsym`` as the real ones are, running the launches and
products on the emulation and refusing what the driver and cuBLAS would. Also: every device array whose address
the loop holds stays alive until the pass is issued."""
from __future__ import annotations

import gc
import sys
import weakref

import numpy as np
import pytest

from minicavs.core import arrays
from minicavs.cuda import Cuda, issue, kernels, standin
from minicavs.engine import static_program
from minicavs.engine.compile import EngineOptions
from minicavs.runtime.inputs import InputGraph

from .. import cells
from ..engine.test_backend import close
from .gpu_stubs import Stubs, fake_cupy, has_real_cupy
from .test_issue import _run

TREES = [InputGraph([[1, 2], [3, 4], [], [], []]), InputGraph([[1, 2], [], []])] * 2


@pytest.fixture(scope="session")
def stubs(tmp_path_factory):
    if has_real_cupy():
        pytest.skip("a real CuPy is installed: the gpu-marked tests run the real path")
    try:
        return Stubs(tmp_path_factory.mktemp("gpu-stubs"))
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.fixture
def gpu(stubs, cuda_standin, emulation_dir, monkeypatch):
    """``gpu(owner)``: a ``Cuda()`` device on the fake CuPy, whose own cuBLAS handle comes from the copy of
    libcublas the loop picks (``owner="loop's"``) or from the other one (``"other"``)."""
    picked = issue._loaded("libcublas.so")
    loops = next(k for k, lib in stubs.cublas.items() if lib._name == picked)

    def make(owner: str = "loop's") -> Cuda:
        which = loops if owner == "loop's" else next(k for k in stubs.cublas if k != loops)
        for name, module in fake_cupy(stubs, which, emulation_dir).items():
            monkeypatch.setitem(sys.modules, name, module)
        kernels._module.cache_clear()
        return Cuda(kernels.CuPyLauncher())
    errors = stubs.errors()
    yield make
    kernels._module.cache_clear()
    arrays.register(standin.ndarray, standin)
    assert stubs.errors() == errors, "a stub refused a call the test did not expect"


def _issued(result) -> None:
    for program in (result.states["G"].program, result.states["G"].backward_program):
        assert program.declined is None


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_pass_is_issued_through_the_driver_and_cublas_of_the_process(gpu, stubs, cuda_standin, dtype):
    """The loop's setup on the GPU's path (the kernels' handles from ``RawKernel.kernel.ptr``, the entry points
    from the mapped libraries) issues a binary Tree-LSTM pass through the stub driver and cuBLAS, equal to the
    stand-in's pass; no stub refused anything."""
    case = cells.binary_tree_lstm(np.random.default_rng(4), dtype=dtype)
    want = _run(case, Cuda(cuda_standin), TREES)
    launches, products = stubs.cuda.stub_launches(), stubs.products()
    got = _run(case, gpu(), TREES)
    _issued(got)
    close(got.loss, want.loss, dtype)
    for k in want.grads:
        close(got.grads[k], want.grads[k], dtype, k)
    assert stubs.cuda.stub_launches() > launches and stubs.products() > products


def test_products_use_handles_of_the_library_they_call(gpu, stubs, cuda_standin):
    """Two libcublas mapped, CuPy's handle made by the one the loop does not call: the loop's products run on
    handles made by the library it calls (the stub refuses a handle of the other)."""
    case = cells.binary_tree_lstm(np.random.default_rng(5))
    want = _run(case, Cuda(cuda_standin), TREES)
    got = _run(case, gpu(owner="other"), TREES)
    _issued(got)
    close(got.loss, want.loss, "float64")


def test_streaming_products_never_switch_a_handles_stream(gpu, stubs, cuda_standin):
    """Streaming, products go to the main and the eager stream within one pass, nothing synchronized between:
    each stream has its own handle (the stub refuses a handle's stream switch while a product of the other
    stream is outstanding), and the pass equals the stand-in's."""
    case = cells.binary_tree_lstm(np.random.default_rng(6))
    want = _run(case, Cuda(cuda_standin), TREES)
    for lib in stubs.cublas.values():
        lib.stub_forget_streams()
    got = _run(case, gpu(), TREES, EngineOptions(streaming=True))
    _issued(got)
    assert len(got.states["G"].program.eager), "the forward pass did not stream"
    close(got.loss, want.loss, "float64")
    for k in want.grads:
        close(got.grads[k], want.grads[k], "float64", k)
    assert sum(lib.stub_streams_used() for lib in stubs.cublas.values()) == 2   # (main and eager)


def test_the_loops_handles_are_one_per_stream_and_go_with_the_device(gpu, stubs):
    """The loop makes one cuBLAS handle per stream it issues on (main and eager), with the library it calls,
    and destroys them when the device goes (not at exit)."""
    gc.collect()   # (earlier devices' handles destroyed)
    live = sum(lib.stub_live_handles() for lib in stubs.cublas.values())
    device = gpu()
    handles = issue.functions(device, "float64")
    handles.streams()
    handles.streams()
    assert sum(lib.stub_live_handles() for lib in stubs.cublas.values()) == live + 2
    assert handles.ctx.handle[0] != handles.ctx.handle[1] and handles.ctx.stream[0] != handles.ctx.stream[1]
    del device, handles
    gc.collect()
    assert sum(lib.stub_live_handles() for lib in stubs.cublas.values()) == live


def test_a_kernel_without_a_handle_is_refused_before_the_driver(gpu, stubs):
    """A row kernel whose function handle is 0: the loop refuses the launch, naming it, and never hands the
    driver a null function."""
    case = cells.binary_tree_lstm(np.random.default_rng(7))
    device = gpu()
    handles = issue.functions(device, "float64")
    handles.rk[:] = 0
    errors = stubs.cuda.stub_errors()
    with pytest.raises(issue.IssueCheckError, match="a launch of a kernel without a function handle"):
        _run(case, device, TREES)
    assert stubs.cuda.stub_errors() == errors


def test_a_product_above_cublas_int_is_refused_not_wrapped(gpu, stubs):
    """m = 2^32 + 2 would reach cublasGemmEx as 2 through an (int) cast: the shim refuses it, calling nothing."""
    device = gpu()
    handles = issue.functions(device, "float64")
    handles.streams()
    ffi, lib = issue.library()
    a, b, c = np.ones((2, 2)), np.ones((2, 2)), np.zeros((2, 2))
    products = stubs.products()

    def at(x):
        return ffi.cast("void *", x.ctypes.data)
    for m, ld in ((2**32 + 2, 2), (2, 2**31)):
        rc = lib.mc_cublas_gemm_double(handles.ctx, ffi.cast("void *", int(handles.dev[5])), 0, 0, m, 2, 2, at(a),
                                       ld, 0, at(b), 2, 0, at(c), 2, 0, 1, 0)
        assert rc == -9, (m, ld, rc)
    assert stubs.products() == products and not c.any()


@pytest.mark.parametrize("how", ["uncached", "cache cleared"])
def test_index_copies_stay_alive_until_the_pass_is_issued(cuda_standin, monkeypatch, how):
    """Every index array the loop addresses is alive (its memory's owner) when the C call issues the pass:
    a copy ``Cuda.index`` does not cache (an index that is not a 1-D plan's slice), and one its cache drops
    when it clears itself past 256 plans within the pass."""
    case = cells.binary_tree_lstm(np.random.default_rng(8))
    device = Cuda(cuda_standin)
    owners, dead, passes = [], [], []
    real_index = Cuda.index

    def index(self, rows):
        if how == "uncached":
            rows = np.stack([rows, rows])[0]   # (a row of a 2-D array: no plan slice)
        else:
            self._index.update({-i: (None, None) for i in range(1, 258)})   # (a full cache: cleared now)
        out = real_index(self, rows)
        owners.append(weakref.ref(out if out.base is None else out.base))
        return out
    monkeypatch.setattr(Cuda, "index", index)
    ffi, lib = issue.library()

    class Lib:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            if not name.startswith("issue_"):
                return fn

            def issued(*args):   # (the owners bound for this pass)
                dead.extend(i for i, owner in enumerate(owners) if owner() is None)
                passes.append(len(owners))
                owners.clear()
                return fn(*args)
            return issued
    monkeypatch.setattr(issue, "library", lambda: (ffi, Lib()))
    # (the loss on top on the step runner: F's and ∂F's passes alone, each with index arrays to keep alive)
    monkeypatch.setattr(static_program, "refusal", lambda node: "F's passes alone")
    _run(case, device, TREES)
    assert len(passes) >= 2 and all(passes) and not dead, (passes, dead)
