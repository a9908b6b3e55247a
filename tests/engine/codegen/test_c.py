"""Generated C for fused groups equals the numpy evaluation of the same group (float32 and float64)."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from minicavs import ops
from minicavs.engine.codegen import c as cgen
from minicavs.cpu import compiler as ccomp
from minicavs.ir.graph import Graph
from minicavs.engine.passes.fusion import fuse

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINICAVS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


UNARY = [ops.neg, ops.exp, ops.tanh, ops.sigmoid, ops.relu, ops.square, ops.abs, ops.step, ops.sign]
BINARY = [ops.add, ops.sub, ops.mul, ops.maximum, ops.ge]


def random_group(rng, dtype):
    x = ops.input((None, 5), dtype, name="x")
    y = ops.input((None, 5), dtype, name="y")
    b = ops.input((5,), dtype, name="b")
    pool = [x, y, b]
    for _ in range(int(rng.integers(3, 9))):
        r = rng.random()
        if r < 0.45:
            pool.append(UNARY[int(rng.integers(len(UNARY)))](pool[int(rng.integers(len(pool)))]))
        elif r < 0.6:   # a select: its predicate, chosen and unchosen sides from the pool
            p, a, c = (pool[int(i)] for i in rng.integers(len(pool), size=3))
            pool.append(ops.where(p, a, c))
        else:
            a, c = (pool[int(i)] for i in rng.integers(len(pool), size=2))
            pool.append(BINARY[int(rng.integers(len(BINARY)))](a, c))
    out = pool[-1] if pool[-1].shape == (None, 5) else ops.add(pool[-1], x)
    out = ops.div(ops.log(ops.square(out) + 1.5), ops.sqrt(ops.abs(y) + 0.5)) * 0.25
    return x, y, b, out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("seed", range(6))
def test_random_fused_dags_match_numpy(dtype, seed):
    """Every group's kernel equals the group's numpy evaluation, and the chained kernels equal the
    unfused graph run op by op."""
    from minicavs.engine.executor import Executor
    rng = np.random.default_rng(seed)
    x, y, b, out = random_group(rng, dtype)
    vals = {x: rng.standard_normal((7, 5)).astype(dtype), y: rng.standard_normal((7, 5)).astype(dtype),
            b: rng.standard_normal(5).astype(dtype)}
    want_out = Executor([out]).run(vals)[0]
    tol = 1e-12 if dtype == "float64" else 2e-6
    env = dict(vals)
    for group in fuse(list(Graph([out]).nodes), [out]):
        arrays = [env[i] for i in group.inputs]
        want = group.evaluate(arrays)
        got = ccomp.build(group)(arrays)
        assert got.dtype == np.dtype(dtype) and got.shape == np.shape(want)
        assert np.max(np.abs(got - want)) <= tol * max(1.0, float(np.max(np.abs(want))))
        env[group.output] = got
    assert np.max(np.abs(env[out] - want_out)) <= 10 * tol * max(1.0, float(np.max(np.abs(want_out))))


def test_float32_constants_are_typed(cache):
    x = ops.input((None, 3), "float32", name="x")
    out = ops.sigmoid(x) * 0.5
    (g,) = fuse(list(Graph([out]).nodes), [out])
    _, _, source = cgen.render(g)
    assert "0.5f" in source and "mc_tanhf(" in source and "double" not in source


def test_cache_is_reused_and_denormals_survive(cache):
    x = ops.input((None, 3), name="x")
    out = ops.tanh(x) + 1.0
    (g,) = fuse(list(Graph([out]).nodes), [out])
    ccomp.build(g)
    files = sorted(p.name for p in cache.iterdir())
    ccomp.build(g)
    assert sorted(p.name for p in cache.iterdir()) == files and len(files) == 1
    assert np.array([1e-310]) * 1.0 != 0.0   # loading kernels must not turn on flush-to-zero


def test_no_compiler(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    x = ops.input((None, 3), name="x")
    out = ops.exp(x) * 2.0
    (g,) = fuse(list(Graph([out]).nodes), [out])
    monkeypatch.setattr(ccomp, "_warned", False)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert ccomp.build(g) is None
    assert ccomp.build([g, g]) == [None, None]   # warned once per process


@pytest.mark.parametrize("shape, kind", [((None, 4), "full"), ((4,), "row"), ((1, 4), "row"),
                                          ((None, 1), "col"), ((), "scalar"), ((1, 1), "scalar")])
def test_broadcast_kinds(shape, kind):
    rng = np.random.default_rng(3)
    x = ops.input((None, 4), "float64", name="x")
    z = ops.input(shape, "float64", name="z")
    out = ops.tanh(x) * z - ops.exp(x) / (x * x + 1.0) + z
    (g,) = fuse(list(Graph([out]).nodes), [out])
    assert g.broadcast[g.inputs.index(z)] == kind
    vals = {x: rng.standard_normal((6, 4)), z: rng.standard_normal(tuple(6 if d is None else d for d in shape))}
    arrays = [vals[i] for i in g.inputs]
    assert np.max(np.abs(ccomp.build(g)(arrays) - g.evaluate(arrays))) <= 1e-12


def test_unindexable_broadcast_falls_back():
    x = ops.input((2, 3, 4), "float64", name="x")
    z = ops.input((3, 1), "float64", name="z")
    out = ops.tanh(x) * z
    (g,) = fuse(list(Graph([out]).nodes), [out])
    assert "other" in g.broadcast and ccomp.build(g) is None


def test_concurrent_builds_of_one_library(cache):
    """Four processes build the same kernels at once: all succeed, and one library is left in the cache."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import numpy as np
        from minicavs import ops
        from minicavs.cpu import compiler as ccomp
        from minicavs.ir.graph import Graph
        from minicavs.engine.passes.fusion import fuse
        x = ops.input((None, 8), "float32", name="x")
        out = ops.tanh(x) * ops.sigmoid(x) + 0.25
        (g,) = fuse(list(Graph([out]).nodes), [out])
        v = np.linspace(-3, 3, 32, dtype=np.float32).reshape(4, 8)
        got = ccomp.build(g)([v])
        assert np.max(np.abs(got - g.evaluate([v]))) <= 1e-6
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    errors = [p.communicate()[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    assert len([p for p in cache.iterdir() if p.suffix == ".so"]) == 1
    assert not [p for p in cache.iterdir() if p.is_dir()]   # no temporary build directory left behind


@pytest.mark.parametrize("op, ref", [(ops.tanh, np.tanh), (ops.exp, np.exp)])
def test_float32_vector_math_accuracy_and_special_values(op, ref):
    """The kernels' own exp/tanh (vecmath.py) against float64 numpy: a few ULP over the whole range,
    NaN and infinities kept, overflow to inf and underflow to 0 where float32 does."""
    x = ops.input((None, 64), "float32", name="x")
    out = op(x) * 1.0 + 0.0   # a group of more than one node, as the engine builds them
    (g,) = fuse(list(Graph([out]).nodes), [out])
    v = np.concatenate([np.linspace(-110, 110, 64 * 400), np.geomspace(1e-30, 20, 64 * 100),
                        -np.geomspace(1e-30, 20, 64 * 100)]).astype(np.float32).reshape(-1, 64)
    got = ccomp.build(g)([v]).astype(np.float64)
    with np.errstate(over="ignore"):
        want = ref(v.astype(np.float64))
    representable = (np.abs(want) < np.finfo(np.float32).max) & (np.abs(want) > np.finfo(np.float32).tiny)
    ulps = np.abs(got - want)[representable] / np.spacing(np.abs(want[representable]).astype(np.float32))
    assert ulps.max() <= 8, ulps.max()
    special = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, 100.0, -200.0, 1e-40] * 8], np.float32)
    s = ccomp.build(g)([special])[0, :8]
    with np.errstate(over="ignore"):
        want_s = ref(special[0, :8])   # numpy's float32 result: exp(100) overflows to inf
    assert np.isnan(s[0]) and np.array_equal(s[1:7], want_s[1:7])
    assert abs(float(s[7]) - float(want_s[7])) <= 1e-44


def _is_gcc(cc: str) -> bool:
    return "Free Software Foundation" in subprocess.run([cc, "--version"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("model", ["tree_lstm", "tree_lstm_child_sum", "var_lstm", "tree_fc"])
def test_every_float32_kernel_of_the_bundled_models_vectorizes(model, tmp_path):
    """Under the build flags gcc vectorizes the column loop of every float32 fused kernel the bundled models
    use, vecmath's exp/tanh selects and all (without -fno-trapping-math gcc 12 on AVX2 kept them scalar:
    6x slower, found only by profiling). gcc's own vectorizer report is the evidence; other compilers are
    skipped."""
    from .test_cuda import model_groups
    cc = ccomp.compiler()
    if "Free Software Foundation" not in subprocess.run([cc, "--version"], capture_output=True, text=True).stdout:
        pytest.skip(f"{cc} is not gcc: no -fopt-info report")
    source, _, _ = cgen.translation_unit(model_groups(model, "float32"))
    (tmp_path / "k.c").write_text(source)
    flags = [f for f in ccomp.FLAGS if f != "-shared"]
    res = subprocess.run([cc, *flags, "-fopt-info-vec-optimized", "-c", str(tmp_path / "k.c"), "-o",
                          str(tmp_path / "k.o")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    lines = source.splitlines()
    loops = [i + 1 for i, line in enumerate(lines) if "#pragma omp simd" in line]  # 1-based, one per kernel
    vectorized = [int(n) for n in re.findall(r"k\.c:(\d+):\d+: optimized: loop vectorized", res.stderr)]
    for start, stop in zip(loops, loops[1:] + [len(lines) + 1]):
        assert any(start < n < stop for n in vectorized), f"loop at line {start} not vectorized:\n{res.stderr}"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_kernels_equal_numpy(dtype):
    rng = np.random.default_rng(7)
    rows = ccomp.RowKernels(dtype)
    src = rng.standard_normal((9, 6)).astype(dtype)
    idx = np.array([3, 0, 3, 8, 8, 8, 1], np.int64)   # repeated rows: parents sharing a child
    assert np.array_equal(rows.gather(src, idx), src[idx])
    assert np.array_equal(rows.gather(src[:, 2:5], idx), src[idx, 2:5])   # strided rows
    g = rng.standard_normal((7, 6)).astype(dtype)
    want, got = np.zeros((9, 6), dtype), np.zeros((9, 6), dtype)
    np.add.at(want, idx, g)
    rows.scatter_add(got, idx, g)
    assert np.allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-15)
    got[:] = 0
    rows.scatter_add(got, idx[:1], g[:1])    # a task of one row
    assert np.array_equal(got[3], g[0]) and not got[np.arange(9) != 3].any()
    half = np.zeros((9, 3), dtype)
    rows.scatter_add(half, idx, g[:, ::2])  # a source with a column stride goes through numpy
    want_half = np.zeros((9, 3), dtype)
    np.add.at(want_half, idx, g[:, ::2])
    assert np.allclose(half, want_half)


def test_a_built_library_is_kept_and_a_missing_one_asked_again_per_cc_setting(monkeypatch):
    """cpu/compiler.kept_once_built (library() and the planner): no library while CC names no compiler,
    built once CC names one, and that one kept whatever CC says later."""
    calls = []

    def build(name, cc_setting):
        calls.append((name, cc_setting))
        return None if cc_setting == "no-such-cc" else f"{name} built with {cc_setting}"

    loaded = ccomp.kept_once_built(build)
    monkeypatch.setenv("CC", "no-such-cc")
    assert loaded("x") is None and loaded("x") is None
    monkeypatch.setenv("CC", "cc")
    assert loaded("x") == "x built with cc"
    monkeypatch.setenv("CC", "no-such-cc")
    assert loaded("x") == "x built with cc" and loaded("y") is None
    assert calls == [("x", "no-such-cc"), ("x", "no-such-cc"), ("x", "cc"), ("y", "no-such-cc")]


def test_deep_expressions_render_and_evaluate_without_recursion(depth=600):
    """A fused group as deep as the user makes it (a chain of 600 elementwise steps: an expression 1800 deep,
    past Python's recursion limit when walked recursively) renders to C, evaluates with numpy, and its kernel
    equals the graph run op by op."""
    from minicavs.engine.executor import Executor
    x = ops.input((None, 4), "float64", name="x")
    h = x
    for _ in range(depth):
        h = ops.tanh(h) * 0.5 + x
    groups = fuse(list(Graph([h]).nodes), [h])
    assert len(groups) == 1 and len(groups[0].nodes) == 3 * depth
    vals = np.random.default_rng(depth).standard_normal((3, 4))
    want = Executor([h]).run({x: vals})[0]
    assert np.max(np.abs(groups[0].evaluate([vals]) - want)) <= 1e-12
    assert np.max(np.abs(ccomp.build(groups[0])([vals]) - want)) <= 1e-12


@pytest.mark.parametrize("terms", [63, 64, 65, 200])
def test_a_long_sum_becomes_kernels_of_at_most_the_executors_arguments(terms):
    """Fusion never makes a kernel of more operands than the C runner passes (inputs and outputs), for a
    chain of ``+`` and for one ``accum``, and the kernels chained equal the graph run op by op."""
    from minicavs.engine.codegen.machine import MAX_ARGS
    from minicavs.engine.executor import Executor
    xs = [ops.input((None, 2), "float64", name=f"x{i}") for i in range(terms)]
    chain = xs[0]
    for x in xs[1:]:
        chain = chain + x
    vals = {x: np.random.default_rng(i).standard_normal((3, 2)) for i, x in enumerate(xs)}
    for out in (chain, ops.accum(*xs)):
        env = dict(vals)
        for group in fuse(list(Graph([out]).nodes), [out]):
            assert len(group.inputs) + len(group.outputs) <= MAX_ARGS
            env[group.output] = ccomp.build(group)([env[i] for i in group.inputs])
        assert np.max(np.abs(env[out] - Executor([out]).run(vals)[0])) <= 1e-12
