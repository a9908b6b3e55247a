"""The layout pass (passes/layout.py): the consecutive-ones order against brute force, the fallback with the
fewest copies where no order serves every group, and random gate cells whose merged products read views of
planned parameter buffers, equal to the unmerged products (float64)."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs import ops
from minicavs.cpu import c_runner
from minicavs.core.arrays import is_planned
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.model import Model, Structure
from minicavs.engine.passes.layout import order, solve
from minicavs.engine.program import evaluate
from minicavs.nn import Parameter, ParameterSet
from minicavs.runtime.inputs import InputGraph
from minicavs.runtime.vertex import VertexFunction

from ..test_alg1 import assert_same

F64 = "float64"
ON, OFF = EngineOptions(plan_layout=True), EngineOptions(merge_gemms=False)


def _consecutive(seq, group) -> bool:
    at = sorted(seq.index(e) for e in group)
    return at[-1] - at[0] == len(group) - 1


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.sets(st.integers(0, n - 1), min_size=2, max_size=n), max_size=5))))
def test_order_finds_an_order_exactly_when_one_exists(case):
    n, sets = case
    groups = [frozenset(s) for s in sets]
    found = order(range(n), groups)
    exists = any(all(_consecutive(list(p), g) for g in groups) for p in itertools.permutations(range(n)))
    assert (found is not None) == exists
    if found is not None:
        assert sorted(found) == list(range(n)) and all(_consecutive(found, g) for g in groups)


@settings(max_examples=100, deadline=None)
@given(st.permutations(list(range(8))), st.lists(st.tuples(st.integers(0, 7), st.integers(2, 5)), max_size=6))
def test_intervals_of_a_hidden_order_are_all_served(hidden, cuts):
    groups = [(tuple(hidden[a:a + k]), 8 * k) for a, k in cuts if a + k <= 8]
    layout = solve(groups)
    assert not layout.copied and len(layout.served) == len({frozenset(g) for g, _ in groups})
    for names, _ in groups:
        buffer = next(b for b in layout.buffers if names[0] in b)
        assert _consecutive(buffer, names)


def test_no_order_serves_a_triangle_so_the_smallest_group_copies():
    layout = solve([(("A", "B"), 300), (("B", "C"), 200), (("A", "C"), 100)])
    assert layout.copied == [frozenset("AC")] and set(layout.served) == {frozenset("AB"), frozenset("BC")}
    assert layout.buffers == [["A", "B", "C"]]


def _gate_model(rng, H, D, gates, shared_bias, conflict):
    """A cell written one product per gate and operand (x·Wx_g + h·Wh_g + b_g); with ``conflict``, three pairs
    of products, each pair over one left operand (y·A + y·B, z·B + z·C, t·A + t·C): no order serves all."""
    ps = ParameterSet()
    for g in range(gates):
        ps.new(f"Wx{g}", (D, H), init=rng.uniform(-0.5, 0.5, (D, H)), dtype=F64)
        ps.new(f"Wh{g}", (H, H), init=rng.uniform(-0.5, 0.5, (H, H)), dtype=F64)
        if g == 0 or not shared_bias:
            ps.new(f"b{g}", (H,), init=rng.uniform(-0.5, 0.5, H), dtype=F64)
    for name in "ABC":
        ps.new(name, (H, H), init=rng.uniform(-0.5, 0.5, (H, H)), dtype=F64)
    ps.new("Wo", (H, 3), init=rng.uniform(-0.5, 0.5, (H, 3)), dtype=F64)
    p = {k: v.node for k, v in ps.items()}
    F = VertexFunction("cell", arity=1, message=(H,), dtype=F64)
    with F:
        h = F.gather(0)
        x = F.pull((D,))
        pre = [ops.linear(x, p[f"Wx{g}"], p["b0" if shared_bias else f"b{g}"]) + h @ p[f"Wh{g}"]
               for g in range(gates)]
        out = ops.sigmoid(pre[0])
        for v in pre[1:]:
            out = out * ops.tanh(v)
        if conflict:
            y, z, t = ops.sigmoid(h), ops.tanh(h), ops.tanh(out)
            out = out + ops.tanh(y @ p["A"] + y @ p["B"]) * ops.sigmoid(z @ p["B"] + z @ p["C"]) \
                + t @ p["A"] + t @ p["C"]
        F.scatter(out)
        F.push(out)
    s = Structure(F, pulls={"x": ops.input((None, D), F64, name="xs")})
    labels = ops.input((None,), "int64", name="labels")
    loss = ops.sum(ops.softmax_cross_entropy(ops.matmul(s.pushed(next(iter(F.pushes))), p["Wo"]), labels))
    return Model(s, loss=loss), ps


def _run(model, ps, rng_seed, options):
    model.plan_buffers(ps, options)   # (laid out up front, as a Trainer does: a run moves no storage)
    return _forward(model, ps, rng_seed, options)


def _forward(model, ps, rng_seed, options):
    rng = np.random.default_rng(rng_seed)
    graphs = [InputGraph.chain(n) for n in (3, 1, 4)]
    D = model.structures[0].pulls["x"].shape[1]
    feeds = {"xs": rng.standard_normal((8, D)), "labels": rng.integers(0, 3, 8)}
    return model.forward_backward(graphs, feeds, ps, RunContext(), options=options)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(2, 4), st.booleans(), st.booleans(), st.integers(0, 99))
def test_random_gate_cells_merged_over_views_equal_the_unmerged_products(H, D, gates, shared_bias, conflict, seed):
    model, ps = _gate_model(np.random.default_rng(seed), H, D, gates, shared_bias, conflict)
    fn = model.structures[0].compiled["cell"].variant(ON)
    views = [m for m in fn.merges if m.buffer is not None]
    assert len(views) >= 2                                   # x's and h's gate products, each over a view
    off = _run(model, ParameterSet([Parameter(k, p.shape, init=p.value.copy(), dtype=F64) for k, p in ps.items()]),
               seed, OFF)
    on = _run(model, ps, seed, ON)
    assert_same(off, on)
    for m in views:                                         # the parameters are column blocks of one buffer
        base = ps[m.buffer[0]].value.base
        assert base is not None and all(ps[n].value.base is base for n in m.buffer)
    for state in on.states.values():                        # the C runner read them in place
        assert state.program.declined is None and state.backward_program.declined is None
    assert "weight a view of the planned buffer" in model.structures[0].compiled["cell"].dump(ON)
    for opts in (replace(ON, runner="reference"), replace(ON, fusion=False)):
        assert_same(off, _run(model, ps, seed, opts))
    if conflict:                                             # one of the three A/B/C groups copies, named so
        assert len(model.planned.copied) == 1
        assert "weight copied per batch" in model.structures[0].compiled["cell"].dump(ON)


def test_parameter_storage_moves_once_when_laid_out_and_never_in_a_run():
    """An array taken from a parameter stays its value: a run lays nothing out (its merged weights read a
    copy until the parameters are), Model.plan_buffers moves each parameter once (called again, or after
    a parameter was given a new array, it moves none of the others), and writes to the arrays taken after
    it are what the merged products read."""
    model, ps = _gate_model(np.random.default_rng(1), 3, 2, 3, False, False)
    unplanned = ParameterSet([Parameter(k, p.shape, init=p.value.copy(), dtype=F64) for k, p in ps.items()])
    taken = {n: p.value for n, p in ps.items()}
    assert_same(_forward(model, unplanned, 1, OFF), _forward(model, ps, 1, ON))
    assert all(ps[n].value is a for n, a in taken.items())           # the run moved nothing
    model.plan_buffers(ps, ON)
    taken = {n: p.value for n, p in ps.items()}
    assert any(is_planned(a.base) for a in taken.values())
    ps["Wx0"].value = ps["Wx0"].value.copy()                        # (a new array: its buffer is left as is)
    taken["Wx0"] = ps["Wx0"].value
    model.plan_buffers(ps, ON)
    assert all(ps[n].value is a for n, a in taken.items())
    for name, a in taken.items():                                   # writes through the arrays are read
        a += 0.25
        unplanned[name].value += 0.25
    assert_same(_forward(model, unplanned, 1, OFF), _forward(model, ps, 1, ON))
    assert all(ps[n].value is a for n, a in taken.items())


@pytest.mark.parametrize("H, D, gates", [(4, 3, 3), (3, 8, 2), (5, 5, 4)])
def test_the_c_runner_copies_and_twins_planned_views_as_it_does_parameters(H, D, gates, monkeypatch):
    """With many task rows the C runner reads a transposed static through a contiguous copy and a wide or
    deep one also through its transposed twin; a planned view (a strided block of a buffer) gets the same,
    made by the library's tiled transpose from the buffer's rows."""
    monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", 1)
    monkeypatch.setattr(c_runner, "TWIN_ELEMENTS", 1)
    made = []
    transposed = c_runner._transposed
    monkeypatch.setattr(c_runner, "_transposed", lambda *a: made.append(a[2:]) or transposed(*a))
    model, ps = _gate_model(np.random.default_rng(H), H, D, gates, False, True)
    off = _run(model, ParameterSet([Parameter(k, p.shape, init=p.value.copy(), dtype=F64) for k, p in ps.items()]),
               H, OFF)
    on = _run(model, ps, H, ON)
    assert any(ps[n].value.base is not None for n in ps) and made   # (the runner made copies of views)
    assert_same(off, on)


def test_a_concat_is_a_view_of_planned_parameter_buffers_only():
    """Adjacent blocks of a planned buffer concatenate to a read-only view of it; adjacent blocks of any other
    array (a workspace tensor a later run overwrites, say) to a copy of their own."""
    ps = ParameterSet([Parameter(n, (3, 2), rng=k, dtype=F64) for k, n in enumerate("abc")])
    buffer = ps.plan_buffer(["a", "b", "c"])
    viewed = ops.shape.adjacent_blocks([ps["a"].value, ps["b"].value], 1)
    assert viewed is not None and not viewed.flags.writeable and np.shares_memory(viewed, buffer)
    np.testing.assert_array_equal(viewed, buffer[:, :4])
    assert ops.shape.adjacent_blocks([ps["b"].value, ps["a"].value], 1) is None     # not in the buffer's order
    plain = np.arange(12.0).reshape(3, 4)
    assert ops.shape.adjacent_blocks([plain[:, :2], plain[:, 2:]], 1) is None
    assert not is_planned(None) and not is_planned(plain) and is_planned(buffer)   # (None: no buffer at all)
    vectors = ParameterSet([Parameter(n, (3,), rng=k, dtype=F64) for k, n in enumerate("uvw")])
    biases = vectors.plan_buffer(["u", "v", "w"])
    whole = ops.shape.adjacent_blocks([vectors[n].value for n in "uvw"], 0)
    assert whole is not None and not whole.flags.writeable and np.shares_memory(whole, biases)
    np.testing.assert_array_equal(whole, biases)
    assert ops.shape.adjacent_blocks([vectors["u"].value, vectors["w"].value], 0) is None   # not adjacent


def test_a_planned_concat_is_the_same_view_batch_after_batch_while_its_parameters_stay():
    """Static evaluation keeps a merged weight's view (one object, so a runner finds the array it addressed),
    which follows its parameters' values written in place; a parameter given a new array is read anew."""
    ps = ParameterSet([Parameter(n, (3, 2), rng=k, dtype=F64) for k, n in enumerate("ab")])
    ps.plan_buffer(["a", "b"])
    merged = ops.concat([ps["a"].node, ps["b"].node], axis=1)
    nodes = [ps["a"].node, ps["b"].node, merged]

    def value():
        env: dict = {}
        evaluate(nodes, env, {}, ps, RunContext())
        return env[merged]
    first = value()
    assert value() is first
    ps["a"].value[...] = 7.0                                 # (an optimizer step: in place)
    np.testing.assert_array_equal(value()[:, :2], np.full((3, 2), 7.0))
    ps["b"].value = np.ones((3, 2))                          # (a new array: the blocks are no longer adjacent)
    again = value()
    assert again is not first and not np.shares_memory(again, first)
    np.testing.assert_array_equal(again, np.concatenate([np.full((3, 2), 7.0), np.ones((3, 2))], axis=1))
