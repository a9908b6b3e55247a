"""The batch program as data: the Tree-LSTM's F and ∂F bound to a two-tree batch, read back with dump() and
checked step by step against a list counted by hand, with where each output is written; and the one
interpreter that runs static graphs."""
from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from minicavs import ops
from minicavs.engine.compile import PRE, EngineOptions
from minicavs.engine.executor import Executor
from minicavs.runtime.inputs import InputGraph
from minicavs.engine.program import RunContext

from .. import cells

def test_executor_runs_static_graphs_with_the_same_interpreter():
    x = ops.input((None, 3), "float64", name="x")
    y = ops.sum(ops.tanh(x) * 2.0)
    ex = Executor([y])
    assert [s.text() for s in ex.steps][0].startswith("%") and all(not s.fused for s in ex.steps)
    v = np.random.default_rng(0).normal(size=(4, 3))
    assert abs(ex.run({x: v})[0] - 2 * np.tanh(v).sum()) <= 1e-12


def test_row_sparse_push_gradient_is_put_into_zeros_not_densified():
    """Tree-FC's loss reads the roots' rows of the push buffer, so its gradient is row-sparse. The phase
    before ∂F's loop reads it (dh): its rows are put into zeros where ∂F keeps dh, without a dense gradient
    of the whole push buffer and a take of every row of it: the kinds' push rows are mapped onto its rows
    (-1: a zero row). Same numbers as the serial policy."""
    from minicavs.engine import alg1 as engine
    rng = np.random.default_rng(7)
    case = cells.tree_fc(rng)
    graphs = [InputGraph([[1, 2], [3, 4], [], [], []]), InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    densified = []
    real = engine.densify
    for runner in ("device", "reference"):
        engine.densify = lambda xp, x: densified.append(x) or real(xp, x)
        try:
            res = case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                              options=EngineOptions(runner=runner))
        finally:
            engine.densify = real
        program = res.states["G"].backward_program
        assert not densified and "h" in program.buffers._sparse   # (the TAKEs read its coalesced rows)
        rows, where = program.buffers._sparse["h"]
        assert len(rows) == len(graphs) and (where >= 0).sum() == len(graphs)   # one row per root
        serial = case.model.forward_backward(graphs, feeds, case.params, RunContext(), policy="serial")
        for k in serial.grads:
            np.testing.assert_allclose(res.grads[k], serial.grads[k], rtol=1e-12, atol=1e-14)



# --- feeds and parameters in every memory layout -------------------------------------------------------------

def _strided(a, order="C"):
    """``a``'s values in every other element of a larger array of that ``order`` and ``a``'s dtype (positive
    strides, none of them the natural ones)."""
    wide = np.zeros(tuple(2 * d + 1 for d in a.shape), a.dtype, order=order)
    view = wide[tuple(slice(1, None, 2) for _ in a.shape)]
    view[...] = a
    return view


def _negative(a):
    """``a``'s values read backwards on every axis (negative strides)."""
    flip = tuple(slice(None, None, -1) for _ in a.shape)
    return np.ascontiguousarray(a[flip])[flip]


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _big_endian(a):
    return a.astype(a.dtype.newbyteorder(">"))


# Every layout numpy makes, as a function of a C-order array. The reference reads the layout's values from a
# C-order copy (a broadcast repeats the first row: other values, the same in the reference). 0-size arrays
# come from a batch with no vertex that pulls a buffer (the "custom 0-size" case below).
LAYOUTS = {
    "c": lambda a: a.copy(),
    "fortran": np.asfortranarray,
    "strided": _strided,
    "negative strides": _negative,
    "read-only": _read_only,
    "big-endian": _big_endian,
    "broadcast (stride 0)": lambda a: np.broadcast_to(a[:1], a.shape),
    "fortran, strided, big-endian": lambda a: _strided(_big_endian(a), order="F"),
}
RUNNERS = ["device", "device checked", "reference"]   # device checked: EngineOptions(check=True)


def _c_order(a):
    """The reference's copy of ``a``: its values, C order, native byte order."""
    a = np.asarray(a)
    return np.array(a, order="C", dtype=a.dtype.newbyteorder("="))


def _custom_model():
    """Two kinds, each pulling rows of a feed (the internal kind: a column slice of one, a strided view), the
    internal kind multiplying by a column slice of a parameter (a strided static). Returns the model, its
    parameters and ``feeds(graphs)``."""
    from minicavs.engine.model import Model, Structure, leaf_internal
    from minicavs.nn import Parameter, ParameterSet
    from minicavs.runtime.vertex import VertexFunction
    D, H, f64 = 3, 4, "float64"
    rng = np.random.default_rng(5)
    p = ParameterSet([Parameter(n, s, init=rng.standard_normal(s), dtype=f64)
                      for n, s in (("Wl", (D, H)), ("Wi", (2 * H, H)), ("Wy", (D, 2 * H)), ("Wo", (H, 2)))])
    leaf = VertexFunction("leaf", message=(H,), dtype=f64)
    with leaf:
        h = ops.tanh(ops.matmul(leaf.pull((D,), "x"), p["Wl"].node))
        leaf.scatter(h)
        leaf.push(h)
    internal = VertexFunction("internal", arity=2, message=(H,), dtype=f64)
    with internal:
        children = ops.matmul(ops.concat([internal.gather(0), internal.gather(1)]), p["Wi"].node)
        h = ops.tanh(children + ops.matmul(internal.pull((D,), "y"), ops.slice_(p["Wy"].node, 0, H)))
        internal.scatter(h)
        internal.push(h)
    ys = ops.input((None, 2 * D), f64, name="ys")
    s = Structure({"leaf": leaf, "internal": internal}, pulls={"x": ops.input((None, D), f64, name="xs"),
                                                              "y": ops.slice_(ys, D, 2 * D)}, kinds=leaf_internal)
    labels = ops.input((None,), "int64", name="labels")
    model = Model(s, loss=ops.sum(ops.softmax_cross_entropy(ops.matmul(s.pushed("h"), p["Wo"].node), labels)))

    def feeds(graphs):
        n = sum(g.num_vertices for g in graphs)
        inner = sum(int(np.sum(g.num_children() > 0)) for g in graphs)
        return {"xs": rng.standard_normal((n - inner, D)), "ys": rng.standard_normal((inner, 2 * D)),
                "labels": rng.integers(0, 2, n)}
    return model, p, feeds


@pytest.fixture(scope="module")
def layout_cases(tmp_path_factory):
    """Per case: (model, parameters, graphs, feeds, the feeds laid out in each layout, the parameters laid out
    so): two bundled models' pull feeds (Tree-LSTM's word ids, Tree-FC's leaf inputs, fed straight from an
    input), the custom model's feeds and parameters on a two-tree batch and on a batch of lone leaves (no
    internal vertex: ``ys`` has 0 rows)."""
    from minicavs.train.trainer import Trainer
    from ..models.test_models import MODELS, TINY
    cases = {}
    for name, feed in (("tree_lstm", "words"), ("tree_fc", "xs")):
        t = Trainer(MODELS / f"{name}.yaml", TINY[name] + ["train.dtype=float64"],
                    run_dir=tmp_path_factory.mktemp(name) / "run")
        graphs, feeds = t.task.batch(t.task.data["train"][:3])
        cases[name] = (t.model, t.task.params, graphs, feeds, [feed], [])
    model, params, feeds = _custom_model()
    two_trees = [InputGraph([[1, 2], [], []]), InputGraph([[1, 2], [3, 4], [], [], []])]
    lone_leaves = [InputGraph([[]]), InputGraph([[]])]
    for name, graphs in (("custom two trees", two_trees), ("custom 0-size", lone_leaves)):
        cases[name] = (model, params, graphs, feeds(graphs), ["xs", "ys", "labels"], list(params))
    return cases


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", ["tree_lstm", "tree_fc", "custom two trees", "custom 0-size"])
def test_every_feed_and_parameter_layout_gives_the_c_order_numbers(layout_cases, case, layout, runner,
                                                                    monkeypatch):
    """Feeds and parameters enter a run through program.host_layout: whatever their layout, every runner
    computes the loss and gradients that the reference runner computes from the same values in C order, and
    the caller's arrays are left as they were. A parameter's layout is that of a ``Parameter.value`` set from
    the array."""
    from minicavs.cpu import CPU
    from minicavs.nn import Parameter, ParameterSet
    from .test_alg1 import dense, equal
    if runner != "reference" and CPU.runner_missing(np.float64) is not None:
        pytest.skip("no C compiler or BLAS: the C runner cannot run here")
    model, params, graphs, feeds, laid_feeds, laid_params = layout_cases[case]
    make = LAYOUTS[layout]
    given = {k: make(np.asarray(feeds[k])) for k in laid_feeds} | {p: make(params[p].value) for p in laid_params}
    odd_feeds = dict(feeds, **{k: given[k] for k in laid_feeds})
    odd_params = ParameterSet([params[p] for p in params if p not in laid_params])
    for name in laid_params:
        param = odd_params.add(Parameter(name, params[name].shape, init="zeros", dtype="float64"))
        param.value = given[name]
    # (the node a graph holds is its parameter's by name: the new Parameter objects stand for the same nodes)
    reference = model.forward_backward(graphs, {k: _c_order(v) for k, v in odd_feeds.items()},
                                       {p: _c_order(odd_params[p].value) for p in odd_params},
                                       options=EngineOptions(runner="reference"))
    before = {k: np.array(v, copy=True) for k, v in given.items()}
    result = model.forward_backward(graphs, odd_feeds, odd_params, options=EngineOptions(
        runner=runner.split()[0], check=runner == "device checked"))
    for state in result.states.values():   # (the runner asked for ran both passes: no silent fallback)
        for program in (state.program, state.backward_program):
            assert program.runner == ("reference runner" if runner == "reference" else "C runner")
            assert program.declined is None, program.declined
    equal(result.loss, reference.loss)
    assert set(result.grads) == set(reference.grads)
    for k in reference.grads:
        equal(dense(result.grads[k]), dense(reference.grads[k]))
    for k, v in given.items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"the caller's {k} was written to")


# bytes a training step may leave allocated, per step, at the least-squares slope over the steps measured: what
# Python's free lists keep in the first few hundred steps (they saturate: ~0.3 KB a step for Tree-LSTM, ~0.9
# KB for seq2seq); a batch's state, plan and buffers left in a reference cycle were 20-57 KB a step here
STEP_BYTES = 2048


@pytest.mark.parametrize("name", ["tree_lstm", "tree_lstm_2type", "var_lstm", "seq2seq"])
def test_a_training_step_frees_its_memory_without_the_cycle_collector(name):
    """Issue 44: RSS grew while training because each step's RunState, memory plan and buffers formed a
    reference cycle, freed only when the cyclic collector ran, long after the step, while later steps
    allocated around them. A step must free by reference counting what it does not keep: with the collector
    off, the bytes allocated (tracemalloc traces numpy's buffers as well as Python's objects) stay flat."""
    from minicavs.train.trainer import Trainer
    from ..models.test_models import MODELS, TINY
    tiny = TINY.get(name, ["model.embed=6", "model.hidden=5"])   # (seq2seq: its own data is small)
    trainer = Trainer(MODELS / f"{name}.yaml", tiny + ["data.dev=null", "data.test=null"], run_dir=None)
    samples = np.arange(8)
    for _ in range(10):   # warm-up: kernels, the FSM, the workspace's buffers, the optimizer's state
        trainer.train_step(samples)
    gc.collect()
    used, tracing = [], tracemalloc.is_tracing()
    gc.disable()
    tracemalloc.start() if not tracing else None
    try:
        for _ in range(20):
            trainer.train_step(samples)
            used.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop() if not tracing else None
        gc.enable()
    per_step = np.polyfit(np.arange(len(used)), used, 1)[0]
    assert per_step < STEP_BYTES, f"{name}: {per_step:.0f} bytes a step stay allocated ({used[0]} -> {used[-1]})"


# --- a batch's table: the blocks' rows ------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["cavs", "serial"])
def test_a_blocks_scatter_offset_is_read_off_its_kinds_tasks(policy, monkeypatch):
    """A block's scatter offset (table column 3) is its kind's first scatter row when those rows are one block
    of rows, else -1 (its SROWS and SPUT then move them by the kind's row index): read off the kind's first and
    last task number, never by building and comparing that row index (microseconds at a batch of one). Equal
    to that definition on random trees, planned natively and by the reference, by cavs (each kind's tasks
    adjacent) and serial (kinds interleaved)."""
    from minicavs.engine import program as binding
    from minicavs.ops.message import as_slice
    from minicavs.runtime.memory import MemoryPlan
    from minicavs.runtime.scheduler import get_policy
    from .test_alg1 import random_tree
    rng = np.random.default_rng(5)
    case = cells.binary_tree_lstm(rng)
    structure, opts = case.model.structures[0], EngineOptions()
    seen = set()
    for k in (1, 2, 4):
        graphs = [random_tree(rng, int(rng.integers(1, 8)), 2, full_binary=True) for _ in range(k)]
        feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
        lowered = case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                              policy=policy).states["G"].program.lowered
        for native in (True, False):
            batch, plan = structure.prepare(graphs, get_policy(policy), native=native)
            compiled = structure.compiled_for(batch, opts)
            want = {}
            for kind_plan in plan.kinds:
                if kind_plan is not None:
                    rows = as_slice(plan.scatter_rows(kind_plan.kind_id))
                    want[kind_plan.kind_id] = rows.start if isinstance(rows, slice) else -1
            seen.update(v >= 0 for v in want.values())
            monkeypatch.setattr(MemoryPlan, "scatter_rows", lambda *a: pytest.fail("built a row index"))
            pre, post = binding.block_rows(lowered, compiled, plan, opts)
            monkeypatch.undo()
            in_order = [b for b in lowered.blocks if b.phase == PRE] + [b for b in lowered.blocks if b.phase != PRE]
            for b, row in zip(in_order, [*pre, *post]):
                if b.scatter_rows and plan.kinds[b.kind_id] is not None and plan.kinds[b.kind_id].n:
                    assert row[3] == want[b.kind_id], (policy, native, b.kind_id)
    assert seen == ({True} if policy == "cavs" else {True, False})


def test_a_static_graph_finds_its_steps_once_not_at_every_run(monkeypatch):
    """A model's static graphs (the pulls' stage, the loss and outputs) and F's statics are StaticNodes: what
    evaluate reads of each node (fed, its step, a concat) is found on the first run and kept with them, so a
    later run makes no step lookups (a weak dictionary's, microseconds a node at a batch of one). The numbers
    are the same as a plain node list's, evaluated the old way."""
    from minicavs.engine import program as binding
    rng = np.random.default_rng(2)
    case = cells.binary_tree_lstm(rng)
    graphs = [InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    first = case.model.infer(graphs, feeds, case.params)
    looked_up = []

    class Counting(dict):
        def get(self, key, default=None):
            looked_up.append(key)
            return super().get(key, default)
    monkeypatch.setattr(binding, "_STEPS", Counting(binding._STEPS))
    again = case.model.infer(graphs, feeds, case.params)
    assert not looked_up and again.loss == first.loss
    for stage in case.model.stages + [case.model.final_stage]:   # the old way: a plain list, every lookup made
        env, plain = {}, {}
        for name, node in case.model.structures[0]._pushed.items():
            env[node] = plain[node] = first.pushes["G"][name]
        binding.evaluate(stage, env, feeds, case.params, RunContext(training=False))
        binding.evaluate(list(stage), plain, feeds, case.params, RunContext(training=False))
        assert env.keys() == plain.keys() and all(np.array_equal(env[n], plain[n]) for n in env)
    assert looked_up


def test_a_c_ordered_parameter_is_read_in_one_test(monkeypatch):
    """A parameter stored as most are (C order, native bytes, its declared dtype and shape) is read as it is in
    one test, at every run of every static graph and F's statics; any other layout or a wrong dtype or shape
    still goes through check_value (test_every_feed_and_parameter_layout_gives_the_c_order_numbers; here:
    the error)."""
    from minicavs.core.errors import FeedError
    from minicavs.engine import program as binding
    rng = np.random.default_rng(4)
    case = cells.binary_tree_lstm(rng)
    graphs = [InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    checked = []
    real = binding.check_value
    monkeypatch.setattr(binding, "check_value", lambda n, v, what: checked.append(n.op) or real(n, v, what))
    case.model.infer(graphs, feeds, case.params)
    assert checked and "param" not in checked   # (the feeds are still checked)
    name = next(iter(case.params))
    bad = dict(case.params)
    bad[name] = np.zeros(bad[name].shape[:-1] + (bad[name].shape[-1] + 1,))
    with pytest.raises(FeedError, match=rf"^parameter param#\d+ '{name}': got shape"):
        case.model.infer(graphs, feeds, bad)
