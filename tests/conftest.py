"""Generated kernels compile into a cache private to the test session, never the user's; the CUDA tests run
their bodies on two launchers."""
from __future__ import annotations

import shutil

import pytest

from minicavs import cuda as mcuda


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MINICAVS_CACHE", str(tmp_path_factory.mktemp("kernel-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def emulation_dir(tmp_path_factory):
    """Where CUDA emulation libraries are built, shared by the session (a library is keyed by its source)."""
    return tmp_path_factory.mktemp("cuda-emulation")


@pytest.fixture(params=[
    pytest.param("emulated", marks=pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")),
    pytest.param("cupy", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not mcuda.available(), reason="no CuPy or no CUDA device")]),
])
def launcher(request, emulation_dir):
    """What runs a generated CUDA kernel: ``emulated`` (the source compiled as C++ and run on the CPU with numpy
    arrays: always, with g++) or ``cupy`` (a real GPU, marked gpu: skipped without one, never mocked)."""
    if request.param == "cupy":
        return mcuda.CuPyLauncher()
    from minicavs.cuda.emulation import Launcher
    return Launcher(emulation_dir)
