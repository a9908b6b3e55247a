"""The CPU backend's part of the native planner: codegen/planner_source.py's C source compiled with the system compiler,
its entry point's own checks, and the library provided to minicavs.engine.planner (which unpacks what it makes: its
tests, against the reference path, are tests/engine/test_planner.py)."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.engine import planner
from minicavs.cpu import planner_library as cpu_planner
from minicavs.runtime.inputs import InputGraph

from .. import cells

pytestmark = pytest.mark.skipif(cpu_planner.planner() is None, reason="no C compiler: the reference path plans")


def test_importing_minicavs_provides_the_cpu_library_to_the_planner():
    """minicavs.engine.planner plans with the library this backend compiled (minicavs/cpu/__init__.py provides it)."""
    assert planner.library() is cpu_planner.planner()


def test_the_c_entry_point_refuses_a_buffer_too_small():
    """mc_prepare checks the buffer it is handed against what the batch needs before it writes the outputs."""
    from minicavs.engine.codegen.planner_source import capacity
    rng = np.random.default_rng(4)
    spec = cells.binary_tree_lstm(rng).model.structures[0]._planner_spec()
    ffi, lib, I64, U8, _ = cpu_planner.planner()
    g = InputGraph([[], [], [0, 1]])
    need = capacity(1, 3, 2, len(spec.kind_names), int(spec.arity.max()), len(spec.uses))
    for size, ok in ((need, True), (40, False), (4, False)):
        buf = np.full(need + 8, -7, np.int64)
        buf[0], buf[1] = 3, 2
        rc = lib.mc_prepare(1, 3, 2, ffi.from_buffer(I64, g.child_ptr), ffi.from_buffer(I64, g.child_idx),
                            ffi.from_buffer(I64, spec.ints), ffi.from_buffer(U8, spec.uses), ffi.NULL,
                            ffi.from_buffer(I64, buf), size)
        assert (rc == 0) == ok
        assert (buf[size:] == -7).all()   # nothing written past the size given
