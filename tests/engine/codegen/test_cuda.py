"""CUDA kernels verified without a GPU: every source the backend can generate for the bundled models
compiles for sm_80 and sm_90 (NVRTC per source, as CuPy compiles them; nvcc too when on PATH), and the same
text, compiled as C++ behind an emulation shim, computes what numpy computes (float32 1e-5, float64 1e-12
relative to max(1, max|ref|))."""
from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest

from minicavs import ops
from minicavs.engine.codegen import cuda
from minicavs.cuda.nvrtc import compile_source, compilers_available
from minicavs.cuda.emulation import Emulator, kernels_in
from minicavs.train.config import REPO_ROOT, load_config, load_model_module
from minicavs.engine.compile import EngineOptions
from minicavs.ir.graph import Graph
from minicavs.engine.passes.fusion import fuse

from .test_c import random_group

TOL = {"float32": 1e-5, "float64": 1e-12}
SMALL = ["model.hidden=6", "model.embed=4"]
TREES = ["data.synthetic.train=4", "data.synthetic.dev=2", "data.synthetic.test=2"]
MODELS = {"tree_lstm": ("tree_lstm", SMALL + TREES),
          "tree_lstm_child_sum": ("tree_lstm", SMALL + TREES + ["model.variant=child_sum"]),
          "var_lstm": ("var_lstm", SMALL),
          "fixed_lstm": ("fixed_lstm", SMALL),
          "tree_fc": ("tree_fc", ["model.hidden=6", "model.leaves=4", "data.synthetic.train=2",
                                  "data.synthetic.dev=1"])}
# Every engine configuration that fuses: the switches change which nodes share a phase, so the groups.
FUSING = [EngineOptions(lazy, eager, streaming, True, elision)
          for lazy, eager, streaming, elision in itertools.product([False, True], repeat=4)]

needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                               reason="CUDA emulation needs g++")


def close(got, want, dtype):
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= TOL[dtype] * max(1.0, float(np.max(np.abs(want))))


def model_groups(model: str, dtype: str) -> list:
    """The fused groups of a bundled model's vertex functions (F and ∂F of every kind) under each fusing
    configuration: ``fusion_groups()``, the groups a device lowers to kernels."""
    module, overrides = MODELS[model]
    cfg = load_config(REPO_ROOT / "models" / f"{module}.yaml", overrides + [f"train.dtype={dtype}"])
    task = load_model_module(module, REPO_ROOT / "models").build(cfg)
    groups = {}
    for s in task.model.structures:
        for fn in s.compiled.values():
            for g in (g for opts in FUSING for g in fn.fusion_groups(opts)):
                if "other" not in g.broadcast:
                    groups.setdefault(cuda.render(g)[1], g)
    return list(groups.values())


@pytest.fixture(scope="module")
def groups_of():
    """{model: [group, ...]} over float32 and float64."""
    return {m: model_groups(m, "float32") + model_groups(m, "float64") for m in MODELS}


@pytest.fixture(scope="module")
def every_source(groups_of):
    """{model: [(name, source), ...]}: exactly the strings FusedKernel and RowKernels hand to CuPy."""
    return {m: cuda.kernel_sources(gs) for m, gs in groups_of.items()}


def unique_sources(every_source) -> dict:
    return {src: (m, name) for m, sources in every_source.items() for name, src in sources}


def test_every_model_has_fused_kernels(every_source):
    for m, sources in every_source.items():
        fused = [n for n, _ in sources if n.startswith("fused_")]
        assert len(fused) >= 4, m     # F and ∂F of at least one kind, per dtype
        assert {"rows_float", "rows_double"} <= {n for n, _ in sources}


@pytest.mark.parametrize("opts", [EngineOptions(), EngineOptions(streaming=True)], ids=["default", "streaming"])
def test_the_groups_a_cuda_device_lowers_are_all_checked(groups_of, opts, emulation_dir):
    """The compile and emulation checks cover every kernel source the CUDA device builds for the engine."""
    from minicavs.cuda.emulation import Launcher
    from minicavs.cuda import Cuda
    device = Cuda(Launcher(emulation_dir))
    module, overrides = MODELS["tree_lstm"]
    cfg = load_config(REPO_ROOT / "models" / f"{module}.yaml", overrides)
    task = load_model_module(module, REPO_ROOT / "models").build(cfg)
    checked = {cuda.render(g)[1] for g in groups_of["tree_lstm"]}
    for fn in task.model.structures[0].compiled.values():
        fwd, bwd = fn.phases(opts, device)
        sources = [st.run.kernel.source for ph in (fwd, bwd) for prog in ph.programs for st in prog
                   if st.fused]
        assert sources and set(sources) <= checked


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_generated_kernel_compiles_with_nvrtc(every_source, arch):
    """Each source on its own, with the options CuPy's RawModule gets: what a GPU run would compile."""
    if "nvrtc" not in compilers_available():
        if os.environ.get("CI") == "true":
            pytest.fail("CI must compile the CUDA kernels: pip install '.[cudacheck]' (NVRTC from PyPI)")
        pytest.skip("no NVRTC: pip install 'minicavs[cudacheck]'")
    sources = unique_sources(every_source)
    for source, (m, name) in sources.items():
        assert compile_source(source, arch, name, compiler="nvrtc"), (m, name)
    assert len(sources) >= 20


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_generated_kernel_compiles_with_nvcc(every_source, arch):
    """The same strings through nvcc, all in one translation unit (one nvcc run per architecture)."""
    assert compile_source("\n".join(unique_sources(every_source)), arch, "all", compiler="nvcc")


def test_compile_errors_carry_the_log():
    if not compilers_available():
        pytest.skip("no CUDA compiler")
    with pytest.raises(RuntimeError, match="(?s)could not compile.*undefined"):
        compile_source('extern "C" __global__ void k(float *y) { y[0] = undefined_name; }', "sm_80")


@pytest.fixture(scope="module")
def model_emulator(groups_of, emulation_dir):
    """One emulation library for every fused kernel of the bundled models."""
    sources = {cuda.render(g)[1] for gs in groups_of.values() for g in gs}
    return Emulator(sorted(sources), emulation_dir)


@needs_cxx
def test_model_kernels_run_on_the_cpu_emulation(groups_of, model_emulator):
    """Every fused kernel of the bundled models, through the emulation shim, equals the group's numpy
    evaluation, with row-strided inputs and outputs, a grid smaller than the work (grid-stride loop) and
    tasks of one row; nothing is written past a row."""
    rng = np.random.default_rng(0)
    for g in {cuda.render(g)[0]: g for gs in groups_of.values() for g in gs}.values():
        name = cuda.render(g)[0]
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
            model_emulator.launch(name, 2, 4, rows, cols, *args)   # 8 threads for up to 35 elements
            for o, want in zip(outs, g.evaluate_all(arrays)):
                close(o[:, :cols], np.broadcast_to(want, (rows, cols)), dtype)
                assert np.isnan(o[:, cols:]).all()        # nothing written past the row


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("seed", range(4))
def test_random_fused_dags_on_the_cpu_emulation(dtype, seed, emulation_dir):
    rng = np.random.default_rng(seed)
    x, y, b, out = random_group(rng, dtype)
    groups = fuse(list(Graph([out]).nodes), [out])
    emu = Emulator([cuda.render(g)[1] for g in groups], emulation_dir)
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
def test_every_broadcast_kind_on_the_cpu_emulation(dtype, emulation_dir):
    """full (i), row (a bias: i % cols), col (one value per row: i / cols) and scalar (0), in one kernel."""
    x = ops.input((None, 6), dtype, name="x")
    b = ops.input((6,), dtype, name="b")
    s = ops.input((None, 1), dtype, name="s")
    k = ops.input((), dtype, name="k")
    out = ops.tanh(x * s + b) * k + ops.sigmoid(x - s)
    (g,) = fuse(list(Graph([out]).nodes), [out])
    assert sorted(set(g.broadcast)) == ["col", "full", "row", "scalar"]
    name, source = cuda.render(g)
    emu = Emulator([source], emulation_dir)
    rng = np.random.default_rng(3)
    for rows, grid, block in [(1, 1, 1), (1, 4, 32), (11, 1, 5), (11, 3, 7)]:
        env = {x: rng.standard_normal((rows, 6)), b: rng.standard_normal(6), s: rng.standard_normal((rows, 1)),
               k: np.asarray(rng.standard_normal())}
        arrays = [env[i].astype(dtype) for i in g.inputs]
        args = []
        for a, kind in zip(arrays, g.broadcast):
            args += [a, {"full": 6, "col": 1}.get(kind, 0)]
        y = np.full((rows, 6), np.nan, dtype)
        emu.launch(name, grid, block, rows, 6, *args, y, 6)
        close(y, g.evaluate(arrays), dtype)


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("grid, block", [(1, 1), (2, 3), (64, 256)])
def test_row_kernels_on_the_cpu_emulation(dtype, grid, block, emulation_dir):
    name, source = cuda.row_kernels(dtype)
    T = "float" if dtype == "float32" else "double"
    emu = Emulator([source], emulation_dir)
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
    assert list(target) == [0, 1, 2, 5] and list(ptr) == [0, 1, 2, 3, 6]
    seg = np.zeros((7, 4), dtype)
    emu.launch(f"segment_sum_rows_{T}", grid, block, len(target), 4, src, 4, order, ptr, target, seg, 4)
    # The emulation adds atomically in row order, the segment sum in row order too: the same bits.
    assert np.array_equal(seg, atomic)
    base = rng.standard_normal((7, 4)).astype(dtype)   # both add to what the destination holds
    seg, atomic = base.copy(), base.copy()
    emu.launch(f"segment_sum_rows_{T}", grid, block, len(target), 4, src, 4, order, ptr, target, seg, 4)
    emu.launch(f"scatter_add_rows_{T}", grid, block, 6, 4, src, 4, idx, atomic, 4)
    close(seg, base + want, dtype)
    close(atomic, base + want, dtype)


def test_segments_plan():
    order, ptr, target = cuda.segments(np.array([3, 1, 3, 3, 0], np.int64))
    assert list(order) == [4, 1, 0, 2, 3] and list(ptr) == [0, 1, 2, 5] and list(target) == [0, 1, 3]
    order, ptr, target = cuda.segments(np.zeros(0, np.int64))
    assert len(order) == 0 and list(ptr) == [0] and len(target) == 0


def test_grid_is_bounded():
    assert cuda.grid(0) == 1 and cuda.grid(1) == 1 and cuda.grid(257) == 2
    assert cuda.grid(10 ** 9) == cuda.MAX_BLOCKS


def test_kernel_sources_lists_row_kernels_per_dtype():
    x = ops.input((None, 3), "float32", name="x")
    out = ops.tanh(x) * 2.0
    (g,) = fuse(list(Graph([out]).nodes), [out])
    names = [n for n, _ in cuda.kernel_sources([g, g], ["float32", "float64"])]
    assert names == [cuda.render(g)[0], "rows_float", "rows_double"]


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_where_takes_any_nonzero_predicate_as_true_on_the_cpu_emulation(dtype, emulation_dir):
    """A fused where's CUDA kernel reads its predicate as numpy's where does: NaN, inf and -1 choose ``a``,
    0 and -0 choose ``b``."""
    p, a, b = (ops.input((None, 8), dtype, name=n) for n in "pab")
    out = ops.where(p, a, b) * 1.0
    (g,) = fuse(list(Graph([out]).nodes), [out])
    name, source = cuda.render(g)
    emu = Emulator([source], emulation_dir)
    preds = np.array([[np.nan, 0.0, -0.0, -1.0, 2.0, np.inf, -np.inf, -1e-30]], dtype)
    values = {p: preds, a: np.full((1, 8), 3.0, dtype), b: np.full((1, 8), -5.0, dtype)}
    args = []
    for inp, kind in zip(g.inputs, g.broadcast):
        args += [values[inp], 8 if kind == "full" else 0]
    y = np.full((1, 8), 7.0, dtype)
    emu.launch(name, 1, 4, 1, 8, *args, y, 8)
    assert np.array_equal(y, np.where(preds != 0, 3.0, -5.0).astype(dtype)), y
