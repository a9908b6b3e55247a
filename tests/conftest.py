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
    """What runs a generated CUDA kernel: ``emulated`` (the source compiled as C++ and run on the CPU, on the
    arrays of the device stand-in, which refuse every crossing CuPy refuses: always, with g++) or ``cupy`` (a
    real GPU, marked gpu: skipped without one, never mocked)."""
    if request.param == "cupy":
        return mcuda.CuPyLauncher()
    from minicavs.cuda.emulation import Launcher
    return Launcher(emulation_dir)


@pytest.fixture(scope="session")
def _standin_launcher(emulation_dir):
    from minicavs.cuda.emulation import Launcher
    return Launcher(emulation_dir)


@pytest.fixture
def cuda_standin(_standin_launcher, monkeypatch):
    """``device: cuda`` (the config key, ``get_device("cuda")``, ``Cuda()``) is the emulated device for this
    test: the generated kernels on the CPU over the device stand-in's arrays. The only place the stand-in is
    selected; crossings are counted from zero."""
    from minicavs.cuda import kernels, standin
    if shutil.which("g++") is None:
        pytest.skip("the CUDA emulation needs g++")
    monkeypatch.setattr(kernels, "default_launcher", lambda: _standin_launcher)
    standin.reset()
    return _standin_launcher
