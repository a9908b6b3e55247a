"""The CUDA emulation (minicavs/cuda/emulation.py) runs a kernel that synchronizes its block as a GPU does: what
a thread wrote to ``__shared__`` memory before a ``__syncthreads`` is what the others read after it, a barrier
that some threads of a block miss is a fault, and the launches the issuing loop makes through ``call_`` wrappers
are logged with their geometry."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulation needs g++")

# each block reverses its chunk of x through shared memory: thread t writes slot t, then reads slot n-1-t
# (written by another thread, after the barrier); the helper's barrier is found through the call
REVERSE = """
__device__ static inline void sync_block() { __syncthreads(); }
extern "C" __global__ void reverse_blocks(long n, const double *__restrict__ x, double *__restrict__ y)
{
    __shared__ double slot[64];
    const long t = threadIdx.x, base = blockIdx.x * (long)blockDim.x;
    slot[t] = base + t < n ? x[base + t] : -1.0;
    sync_block();
    const long mirror = blockDim.x - 1 - t;
    if (base + t < n) y[base + t] = slot[mirror];
}
"""

# thread 0 leaves before the others reach their barrier: undefined on a GPU
DIVERGED = """
extern "C" __global__ void diverged(long n, double *__restrict__ y)
{
    if (threadIdx.x == 0) return;
    __syncthreads();
    y[threadIdx.x] = n;
}
"""


def test_shared_memory_written_before_a_barrier_is_read_after_it(emulation_dir):
    from minicavs.cuda.emulation import Emulator, synchronizing
    assert synchronizing(REVERSE) == {"sync_block", "reverse_blocks"}
    x = np.random.default_rng(0).standard_normal(3 * 16)
    y = np.zeros_like(x)
    Emulator([REVERSE], emulation_dir).launch("reverse_blocks", 3, 16, x.size, x, y)
    np.testing.assert_array_equal(y, x.reshape(3, 16)[:, ::-1].reshape(-1))


def test_a_barrier_some_threads_miss_is_a_fault(emulation_dir):
    from minicavs.cuda.emulation import Emulator
    y = np.zeros(8)
    with pytest.raises(RuntimeError, match=r"emulated kernel diverged \(grid 1, block 8\): a __syncthreads that "
                                           r"some threads of a block reached while others had ended"):
        Emulator([DIVERGED], emulation_dir).launch("diverged", 1, 8, 5, y)


def test_launches_through_call_wrappers_are_logged_with_their_geometry(emulation_dir):
    """The issuing loop's way in (cuLaunchKernel's argument passing): each launch logged once, in order."""
    import cffi
    from minicavs.cuda.emulation import Emulator
    emu = Emulator([REVERSE], emulation_dir)
    emu.take_log()
    ffi = cffi.FFI()
    x = np.arange(8.0)
    y = np.zeros_like(x)
    n, xp, yp = ffi.new("long *", 8), ffi.new("void **", ffi.cast("void *", x.ctypes.data)), \
        ffi.new("void **", ffi.cast("void *", y.ctypes.data))
    params = ffi.new("void *[3]", [n, xp, yp])
    call = emu.ffi.cast("int (*)(unsigned, unsigned, void **)", emu.handle("reverse_blocks"))
    for grid, block in ((2, 4), (1, 8)):
        assert call(grid, block, emu.ffi.cast("void **", int(ffi.cast("uintptr_t", params)))) == 0
    np.testing.assert_array_equal(y, x[::-1])
    assert emu.take_log() == [("reverse_blocks", 2, 4), ("reverse_blocks", 1, 8)]
    assert emu.take_log() == []
