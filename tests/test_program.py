"""The batch program as data: the Tree-LSTM's F and ∂F bound to a two-tree batch, read back with dump() and
checked step by step against a list counted by hand, with where each output is written; and the one
interpreter that runs static graphs."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from minicavs import ops
from minicavs.engine import EngineOptions
from minicavs.executor import Executor
from minicavs.inputs import InputGraph
from minicavs.program import RunContext

from . import cells

# Two trees, each a root (global ids 0 and 3) with two leaves (1, 2 and 4, 5). H = 2, so a message [h, c]
# has 4 columns: h in 0:2, c in 2:4. The schedule puts the four leaves in task 0 (scatter rows 0:4, children
# of one root side by side: 1, 2, 4, 5) and the two roots in task 1 (scatter rows 4:6). Pull rows of x: one
# per leaf in global id order (0..3); push rows of h: one per vertex in global id order (leaves 1, 2, 4, 5;
# roots 0, 3). Node ids (%N) are left out: they depend on creation order.
LEAF_F = ["x = take pull x[[0, 1, 2, 3]]",                  # 4 rows, too few for a slice: one row gather
          "% = linear x W bl",
          "% = slice %", "% = slice %", "% = slice %",        # i, o, u
          # σ(i), tanh(u), c, σ(o), tanh(c), h: one kernel; c and h straight into the scatter tensor's
          # column blocks, the four values ∂F reads into their tensors
          "%, %, %, %, %, % = fused[sigmoid tanh mul sigmoid tanh mul] % % %  -> tensor %[0:4], "
          "tensor %[0:4], scatter[0:4][:, 2:4], tensor %[0:4], tensor %[0:4], scatter[0:4][:, 0:2]",
          "scatter = scatter %",                              # the identity marking F's output
          "h = push %", "push h[[1, 2, 4, 5]] = h"]
ROOT_F = ["gather0 = view scatter[0:3:2]",                    # children in slot 0: rows 0 and 2, a view
          "gather1 = view scatter[1:4:2]",                    # slot 1: rows 1 and 3
          "% = slice gather0", "% = slice gather0",           # h1, c1
          "% = slice gather1", "% = slice gather1",           # h2, c2
          "% = concat % %", "% = linear % U bi",
          "% = slice %", "% = slice %", "% = slice %",        # i, o, u
          "% = linear (bias added by its kernel) % Uf1", "% = linear (bias added by its kernel) % Uf2",
          # σ(f1), σ(f2), σ(i), tanh(u), the cell sum c, σ(o), tanh(c), h: one kernel that also adds bf
          "%, %, %, %, %, %, %, % = fused[sigmoid sigmoid sigmoid tanh mul mul add mul add sigmoid tanh mul] "
          "% % % % % % % bf  -> tensor %[0:2], tensor %[0:2], tensor %[0:2], tensor %[0:2], "
          "scatter[4:6][:, 2:4], tensor %[0:2], tensor %[0:2], scatter[4:6][:, 0:2]",
          "scatter = scatter %"]
ROOT_F += ["tensor %[0:2] = %"] * 5                           # h1, c1, h2, c2, [h1; h2] kept for ∂F
# lazy: pushes after the task loop, reading h back from the scatter tensor (no tensor keeps a copy of it)
ROOT_PUSH = ["% = view scatter[4:6][:, 0:2]", "h = push %", "push h[[0, 3]] = h"]

FORWARD = (["F:", "  before tasks: kind 'leaf' rows 0:4"] + [f"    {x}" for x in LEAF_F]
           + ["  task 0: kind 'leaf' rows 0:4",                # all of the leaves' F ran before the loop
              "  task 1: kind 'internal' rows 0:2"] + [f"    {x}" for x in ROOT_F]
           + ["  after tasks: kind 'internal' rows 0:2"] + [f"    {x}" for x in ROOT_PUSH])


def _two_tree_program(options=EngineOptions(merge_gemms=False)):
    """The batch's run state; by default F as declared (three products), which the lists above count."""
    rng = np.random.default_rng(0)
    case = cells.binary_tree_lstm(rng, H=2)
    trees = [InputGraph([[1, 2], [], []]), InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, trees, [case.data(rng, g) for g in trees])
    # the Python interpreter's bound blocks (the native executor's instructions: tests/test_instructions.py)
    result = case.model.forward_backward(trees, feeds, case.params, RunContext(),
                                         options=replace(options, executor="python"))
    return case, trees, feeds, result.states[case.model.structures[0].name]


def _lines(program) -> list[str]:
    return re.sub(r"%\d+", "%", program.dump()).splitlines()


def test_tree_lstm_forward_program_of_a_two_tree_batch():
    _, _, _, state = _two_tree_program()
    assert _lines(state.program) == FORWARD


def test_tree_lstm_backward_program_of_a_two_tree_batch():
    """∂F pops the task stack: task 1 (the roots) first, then task 0; gradients are added into the
    children's rows of the scatter gradient through the same strided views the forward gathers read."""
    _, _, _, state = _two_tree_program()
    lines = _lines(state.backward_program)
    headers = [x.strip() for x in lines if not x.startswith("    ")]
    assert headers == ["∂F:", "before tasks: kind 'leaf' rows 0:4", "before tasks: kind 'internal' rows 0:2",
                       "task 1: kind 'internal' rows 0:2", "task 0: kind 'leaf' rows 0:4",
                       "after tasks: kind 'leaf' rows 0:4", "after tasks: kind 'internal' rows 0:2"]
    blocks = state.backward_program.blocks()
    # before the loop: the push cotangents taken at the push rows, kept for the lazy phase
    assert [b.lines() for b in blocks[:2]] == [["dh = take push grad h[[1, 2, 4, 5]]", "tensor dh[0:4] = dh"],
                                               ["dh = take push grad h[[0, 3]]", "tensor dh[0:2] = dh"]]
    roots, leaves, leaves_after, roots_after = blocks[2:]
    root_lines = [re.sub(r"%\d+", "%", x) for x in roots.lines()]
    assert root_lines[:10] == ["% = tensor %[0:2]"] * 8 + ["dh = tensor dh[0:2]",
                                                          "dscatter = view scatter grad[4:6]"]
    assert [s.outputs[0].op if not s.fused else "fused" for s in roots.steps] == [
        "slice", "slice", "fused", "matmul", "matmul", "matmul", "slice", "slice", "accum", "concat", "accum",
        "concat"]
    assert root_lines[-2:] == ["scatter grad[0:3:2] += %", "scatter grad[1:4:2] += %"]
    assert leaves.lines() == []   # the leaves' ∂F is all lazy: it reads dscatter after the loop, from its rows
    assert "dscatter = view scatter grad[0:4][:, 0:4]" in leaves_after.lines()
    assert [re.sub(r"%\d+", "%", x) for x in leaves_after.lines()[-3:]] == [
        "pull grad x[[0, 1, 2, 3]] += %", "grad 'W' += %", "grad 'bl' += %"]
    assert [name for name, _ in roots_after.param_grads] == ["U", "bi", "Uf1", "Uf2", "bf"]
    assert not any(b.takes for b in (roots, leaves))   # the task loop copies no rows in


def test_bound_views_are_rows_of_the_scatter_tensor():
    """A bound gather is a strided view of the scatter tensor itself (no copy): the children's rows."""
    _, _, _, state = _two_tree_program()
    task = state.program.tasks[1]
    assert [(n.name, w) for n, _, w in task.views] == [("gather0", ("view scatter[{}]", slice(0, 3, 2))),
                                                      ("gather1", ("view scatter[{}]", slice(1, 4, 2)))]
    for (_, view, _), rows in zip(task.views, ([0, 2], [1, 3])):
        assert np.shares_memory(view, state.scatter)
        np.testing.assert_array_equal(view, state.scatter[rows])


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
    of the whole push buffer and a take of every row of it. Same numbers as the serial policy."""
    from minicavs import engine
    from minicavs.program import _sparse_rows
    from minicavs.sparse import RowSparse
    dst = np.full((3, 2), 7.0)
    grad = RowSparse(np.array([2, 9, 2, 7]), np.arange(8.0).reshape(4, 2), (10, 2))
    _sparse_rows(dst, grad, np.array([5, 2, 7]))    # rows 2 (twice) and 7 land; row 9 is not among them
    np.testing.assert_array_equal(dst, [[0, 0], [0 + 4, 1 + 5], [6, 7]])
    rng = np.random.default_rng(7)
    case = cells.tree_fc(rng)
    graphs = [InputGraph([[1, 2], [3, 4], [], [], []]), InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    densified = []
    real = engine.densify
    for executor in ("native", "python"):
        engine.densify = lambda xp, x: densified.append(x) or real(xp, x)
        try:
            res = case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                              options=EngineOptions(executor=executor))
        finally:
            engine.densify = real
        assert not densified and "take push grad" not in res.states["G"].backward_program.dump()
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
EXECUTORS = ["python", "native", "native checked", "reference"]   # native checked: MINICAVS_NATIVE_CHECK=1


def _c_order(a):
    """The reference's copy of ``a``: its values, C order, native byte order."""
    a = np.asarray(a)
    return np.array(a, order="C", dtype=a.dtype.newbyteorder("="))


def _custom_model():
    """Two kinds, each pulling rows of a feed (the internal kind: a column slice of one, a strided view), the
    internal kind multiplying by a column slice of a parameter (a strided static). Returns the model, its
    parameters and ``feeds(graphs)``."""
    from minicavs.model import Model, Structure, leaf_internal
    from minicavs.nn import Parameter, ParameterSet
    from minicavs.vertex import VertexFunction
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
    from minicavs.training import Trainer
    from .models.test_models import MODELS, TINY
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


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", ["tree_lstm", "tree_fc", "custom two trees", "custom 0-size"])
def test_every_feed_and_parameter_layout_gives_the_c_order_numbers(layout_cases, case, layout, executor,
                                                                    monkeypatch):
    """Feeds and parameters enter a run through program.host_layout: whatever their layout, every executor
    computes the loss and gradients that the Python interpreter computes from the same values in C order, and
    the caller's arrays are left as they were. A parameter's layout is that of a ``Parameter.value`` set from
    the array."""
    from minicavs.cpu import CPU
    from minicavs.nn import Parameter, ParameterSet
    from .test_engine import dense, equal
    if executor != "python" and CPU.runner_missing(np.float64) is not None:
        pytest.skip("no C compiler or BLAS: the native executor cannot run here")
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
                                       options=EngineOptions(executor="python"))
    before = {k: np.array(v, copy=True) for k, v in given.items()}
    if executor == "native checked":
        monkeypatch.setenv("MINICAVS_NATIVE_CHECK", "1")
    result = model.forward_backward(graphs, odd_feeds, odd_params, options=EngineOptions(executor=executor.split()[0]))
    if executor != "python":   # (the native executor ran both passes: no silent fallback to Python)
        for state in result.states.values():
            assert state.program.native is not None and state.backward_program.native is not None, \
                state.program.native_why
    equal(result.loss, reference.loss)
    assert set(result.grads) == set(reference.grads)
    for k in reference.grads:
        equal(dense(result.grads[k]), dense(reference.grads[k]))
    for k, v in given.items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"the caller's {k} was written to")
