"""CUDA kernels verified without a GPU: every source the backend can generate for the bundled models
compiles for sm_80 and sm_90 (NVRTC, or nvcc), and the same text, compiled as C++ behind an emulation shim,
computes what numpy computes (float32 1e-5, float64 1e-12 relative to max(1, max|ref|))."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from minicavs.codegen import cuda
from minicavs.codegen.cuda_emulation import Emulator, kernels_in
from minicavs.config import REPO_ROOT, load_config, load_model_module
from minicavs.graph import Graph
from minicavs.passes.fusion import fuse

from .test_c import random_group

TOL = {"float32": 1e-5, "float64": 1e-12}
MODELS = {"tree_lstm": ["model.hidden=6", "model.embed=4", "data.synthetic.train=4", "data.synthetic.dev=2",
                        "data.synthetic.test=2"],
          "var_lstm": ["model.hidden=6", "model.embed=4"],
          "fixed_lstm": ["model.hidden=6", "model.embed=4"],
          "tree_fc": ["model.hidden=6", "model.leaves=4", "data.synthetic.train=2", "data.synthetic.dev=1"]}

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="CUDA emulation needs g++")


def close(got, want, dtype):
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= TOL[dtype] * max(1.0, float(np.max(np.abs(want))))


def model_groups(name: str, dtype: str) -> list:
    cfg = load_config(REPO_ROOT / "models" / f"{name}.yaml", MODELS[name] + [f"train.dtype={dtype}"])
    task = load_model_module(name, REPO_ROOT / "models").build(cfg)
    return [g for s in task.model.structures for fn in s.compiled.values() for g in fn.fusion_groups()]


@pytest.fixture(scope="module")
def every_source():
    """{model: [(name, source), ...]} for float32 and float64: exactly what FusedKernel/RowKernels compile."""
    return {m: cuda.kernel_sources(model_groups(m, "float32") + model_groups(m, "float64")) for m in MODELS}


def test_every_model_has_fused_kernels(every_source):
    for m, sources in every_source.items():
        fused = [n for n, _ in sources if n.startswith("fused_")]
        assert len(fused) >= 2, m     # F and ∂F of at least one kind, per dtype
        assert {"rows_float", "rows_double"} <= {n for n, _ in sources}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_generated_kernel_compiles(every_source, arch):
    if cuda.compiler_available() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must compile the CUDA kernels: install minicavs[cudacheck] (NVRTC from PyPI)")
        pytest.skip("no NVRTC (pip install 'minicavs[cudacheck]') and no nvcc")
    seen = set()
    for m, sources in every_source.items():
        for name, source in sources:
            if source not in seen:
                seen.add(source)
                assert cuda.compile_source(source, arch, name), (m, name)
    assert len(seen) >= 10


@needs_cxx
def test_model_kernels_run_on_the_cpu_emulation(every_source, tmp_path_factory):
    """Every fused kernel of the bundled models, through the emulation shim, equals the group's numpy
    evaluation, with row-strided inputs and outputs and a grid smaller than the work (grid-stride loop)."""
    groups = {cuda.render(g)[0]: g for m in MODELS for dt in ("float32", "float64") for g in model_groups(m, dt)
              if "other" not in g.broadcast}
    emu = Emulator([cuda.render(g)[1] for g in groups.values()], tmp_path_factory.mktemp("emu"))
    rng = np.random.default_rng(0)
    for name, g in groups.items():
        dtype = g.output.dtype.name
        for rows in (1, 7):
            cols = 5
            arrays, args = [], []
            for x, kind in zip(g.inputs, g.broadcast):
                shape = {"full": (rows, cols), "row": (cols,), "col": (rows, 1), "scalar": ()}[kind]
                base = rng.uniform(-2, 2, (rows, cols + 3) if kind == "full" else shape).astype(dtype)
                a = base[:, 1:cols + 1] if kind == "full" else base   # a view with row stride cols + 3
                arrays.append(a)
                args += [a, cols + 3 if kind == "full" else (1 if kind == "col" else 0)]
            outs = [np.full((rows, cols + 2), np.nan, dtype) for _ in g.outputs]
            for o in outs:
                args += [o, cols + 2]
            emu.launch(name, 2, 4, rows, cols, *args)   # 8 threads for up to 35 elements
            for o, want in zip(outs, g.evaluate_all(arrays)):
                close(o[:, :cols], np.broadcast_to(want, (rows, cols)), dtype)
                assert np.isnan(o[:, cols:]).all()        # nothing written past the row


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("seed", range(4))
def test_random_fused_dags_on_the_cpu_emulation(dtype, seed, tmp_path_factory):
    rng = np.random.default_rng(seed)
    x, y, b, out = random_group(rng, dtype)
    groups = fuse(list(Graph([out]).nodes), [out])
    emu = Emulator([cuda.render(g)[1] for g in groups], tmp_path_factory.mktemp("emu"))
    env = {x: rng.standard_normal((9, 5)).astype(dtype), y: rng.standard_normal((9, 5)).astype(dtype),
           b: rng.standard_normal(5).astype(dtype)}
    for g in groups:
        name, _ = cuda.render(g)
        rows = 9 if g.output.shape[0] is None else 1      # a group over the bias alone has one row
        args = []
        for inp, kind in zip(g.inputs, g.broadcast):
            args += [env[inp], 5 if kind == "full" else 0]
        ys = [np.empty((rows, 5), dtype) for _ in g.outputs]
        for o in ys:
            args += [o, 5]
        emu.launch(name, 1, 3, rows, 5, *args)
        for o, want, node in zip(ys, g.evaluate_all([env[i] for i in g.inputs]), g.outputs):
            close(o, np.broadcast_to(want, (rows, 5)), dtype)
            env[node] = o.reshape(np.shape(want))


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("grid, block", [(1, 1), (2, 3), (64, 256)])
def test_row_kernels_on_the_cpu_emulation(dtype, grid, block, tmp_path_factory):
    name, source = cuda.row_kernels(dtype)
    T = "float" if dtype == "float32" else "double"
    emu = Emulator([source], tmp_path_factory.mktemp("emu"))
    assert {n for n, _ in kernels_in(source)} == {f"{k}_{T}" for k in cuda.ROW_KERNEL_NAMES}
    rng = np.random.default_rng(1)
    src = rng.standard_normal((6, 4)).astype(dtype)
    idx = np.array([5, 0, 5, 2, 5, 1], np.int64)   # repeats: parents sharing a child
    out = np.zeros((6, 4), dtype)
    emu.launch(f"gather_rows_{T}", grid, block, 6, 4, src, 4, idx, out, 4)
    assert np.array_equal(out, src[idx])
    one = np.zeros((1, 4), dtype)
    emu.launch(f"gather_rows_{T}", grid, block, 1, 4, src, 4, idx[3:4], one, 4)   # a task of one row
    assert np.array_equal(one[0], src[2])
    dst = np.zeros((7, 4), dtype)
    emu.launch(f"scatter_rows_{T}", grid, block, 3, 4, src, 4, np.array([6, 0, 3]), dst, 4)
    assert np.array_equal(dst[[6, 0, 3]], src[:3]) and not dst[[1, 2, 4, 5]].any()
    want = np.zeros((7, 4), dtype)
    np.add.at(want, idx, src)
    atomic = np.zeros((7, 4), dtype)
    emu.launch(f"scatter_add_rows_{T}", grid, block, 6, 4, src, 4, idx, atomic, 4)
    close(atomic, want, dtype)
    order, ptr, target = cuda.segments(idx)
    seg = np.zeros((7, 4), dtype)
    emu.launch(f"segment_sum_rows_{T}", grid, block, len(target), 4, src, 4, order, ptr, target, seg, 4)
    close(seg, want, dtype)


def test_grid_is_bounded():
    assert cuda.grid(1) == 1 and cuda.grid(257) == 2 and cuda.grid(10 ** 9) == cuda.MAX_BLOCKS
