"""Generated kernels compile into a cache private to the test session, never the user's."""
from __future__ import annotations

import pytest


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
