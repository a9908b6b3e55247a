"""Kinds with their own messages: each kind scatters its own shape, each gather names the kinds it reads.

The reference is a per-sample numpy recursion written from the equations below, independent of the engine.
Two kinds on alternating chains and trees: 'a' vertices pull x (2,) and gather their child 0, a 'b' vertex,
whose message is (2,); 'b' vertices gather up to two 'a' children, whose message is (3,):
    a:  m_a = tanh(x·W_a + m_b(child 0)·V_a)          scatters (3,), pushes m_a
    b:  m_b = tanh(m_a(child 0)·W_b + m_a(child 1)·U_b)   scatters (2,)
loss = sum over 'a' vertices of (m_a · w_o)^2
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs import ops
from minicavs.engine.compile import EngineOptions
from minicavs.core.errors import InputGraphError, ShapeError
from minicavs.engine.explain import check
from minicavs.runtime.inputs import InputGraph
from minicavs.engine.model import Model, Structure
from minicavs.nn import ParameterSet
from minicavs.train.testing import check_model_grads
from minicavs.runtime.vertex import VertexFunction

F64 = "float64"


def build(rng):
    p = ParameterSet()
    for name, shape in (("W_a", (2, 3)), ("V_a", (2, 3)), ("W_b", (3, 2)), ("U_b", (3, 2)), ("w_o", (3, 1))):
        p.new(name, shape, dtype=F64, rng=int(rng.integers(1 << 30)))
    a = VertexFunction("a", arity=1, message=(3,), dtype=F64)
    with a:
        m = ops.tanh(a.pull((2,)) @ p["W_a"].node
                     + a.gather(0, kinds="b", message=(2,)) @ p["V_a"].node)
        a.scatter(m)
        a.push(m)
    b = VertexFunction("b", arity=2, message=(2,), dtype=F64)
    with b:
        g0, g1 = b.gather(0, kinds="a", message=(3,)), b.gather(1, kinds=("a",), message=(3,))
        b.scatter(ops.tanh(g0 @ p["W_b"].node + g1 @ p["U_b"].node))
    x = ops.input((None, 2), F64, name="x")
    s = Structure({"a": a, "b": b}, pulls={"x": x}, name="g")
    loss = ops.sum(ops.square(s.pushed("h") @ p["w_o"].node))
    return p, Model(s, loss=loss)


def random_graph(rng, n):
    """Alternating kinds: every 'a' vertex has at most one child, a 'b'; every 'b' up to two 'a's."""
    children, kinds = [], []
    pending_a, pending_b = [], []
    for _ in range(n):
        if pending_a and (rng.random() < 0.5 or not pending_b):
            k = int(rng.integers(1, min(2, len(pending_a)) + 1))
            children.append([pending_a.pop(0) for _ in range(k)])
            kinds.append("b")
            pending_b.append(len(kinds) - 1)
        else:
            children.append([pending_b.pop(0)] if pending_b and rng.random() < 0.7 else [])
            kinds.append("a")
            pending_a.append(len(kinds) - 1)
    return InputGraph(children, kinds)


def reference_loss(p, g, x):
    """The equations above, vertex by vertex (ids are topological here)."""
    P = {k: v.value for k, v in p.items()}
    msg, loss, row = {}, 0.0, 0
    for v in range(g.num_vertices):
        ch = g.children(v).tolist()
        if g.kinds[v] == "a":
            below = msg[ch[0]] if ch else np.zeros(2)
            msg[v] = np.tanh(x[row] @ P["W_a"] + below @ P["V_a"])
            row += 1
            loss += float(np.sum((msg[v] @ P["w_o"]) ** 2))
        else:
            a0 = msg[ch[0]]
            a1 = msg[ch[1]] if len(ch) > 1 else np.zeros(3)
            msg[v] = np.tanh(a0 @ P["W_b"] + a1 @ P["U_b"])
    return loss


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 4))
def test_two_message_shapes_match_the_reference_serial_and_fd(seed, k):
    rng = np.random.default_rng(seed)
    p, model = build(rng)
    graphs = [random_graph(rng, int(rng.integers(1, 9))) for _ in range(k)]
    xs = [rng.standard_normal((sum(kd == "a" for kd in g.kinds), 2)) for g in graphs]
    feeds = {"x": np.concatenate(xs)}
    params = {name: q.value for name, q in p.items()}
    res = model.forward_backward(graphs, feeds, params)
    want = sum(reference_loss(p, g, x) for g, x in zip(graphs, xs))
    assert abs(res.loss - want) <= 1e-10 * max(1.0, abs(want))
    for policy in ("cavs", "agenda", "greedy"):
        model.policy = __import__("minicavs.runtime.scheduler", fromlist=["get_policy"]).get_policy(policy)
        assert check(model, graphs, feeds, params)["max"] <= 1e-10 * max(1.0, abs(want))
    if seed % 4 == 0:
        check_model_grads(model, graphs, feeds, params, directions=1)


def test_declaration_errors_name_the_gather_and_the_kinds():
    p, model = build(np.random.default_rng(0))
    a, b = (model.structures[0].functions[k] for k in ("a", "b"))
    x = ops.input((None, 2), F64, name="x")
    with pytest.raises(ShapeError, match=r"gather\(0\) of 'a' names kind 'b', which has no vertex function"):
        Structure({"a": a}, pulls={"x": x})
    c = VertexFunction("c", arity=1, message=(3,), dtype=F64)
    with c:
        c.scatter(ops.tanh(c.gather(0, kinds="b", message=(3,))))
    with pytest.raises(ShapeError, match=r"gather\(0\) of 'c' reads \(3,\) but 'b' scatters \(2,\)"):
        Structure({"a": a, "b": b, "c": c}, pulls={"x": x})
    d = VertexFunction("d", arity=1, message=(3,), dtype=F64)
    with d:
        d.push(d.gather(0, kinds="e", message=(3,)))
    e = VertexFunction("e", dtype=F64)
    with e:
        e.push(e.pull((2,)))
    with pytest.raises(ShapeError, match=r"gather\(0\) of 'd' reads kind 'e', which scatters nothing"):
        Structure({"d": d, "e": e}, pulls={"x": x})
    f = VertexFunction("f", arity=1, message=(3,), dtype=F64)
    with pytest.raises(ShapeError, match=r"gather\(0\) declared twice"):
        with f:
            f.gather(0, kinds="a")
            f.gather(0, kinds="b")


def test_a_child_of_a_kind_the_gather_does_not_read_is_an_input_error():
    p, model = build(np.random.default_rng(0))
    g = InputGraph([[], [0]], ["a", "a"])      # an 'a' vertex whose child 0 is an 'a', not a 'b'
    with pytest.raises(InputGraphError, match=r"sample 0, vertex 1: child 0 \(vertex 0\) is a 'a' vertex, but "
                                              r"gather\(0\) of 'a' reads only 'b'"):
        model.forward_backward([g], {"x": np.zeros((2, 2))}, {k: q.value for k, q in p.items()})


def test_each_gather_and_scatter_is_bound_to_the_tensor_of_its_shape():
    """The alias pass decides at compile time which scatter tensor a kind writes and each gather reads; the
    bound program's views are rows of that tensor, and the model's workspace keeps one tensor (and one
    gradient) per shape, reused by the next batch."""
    rng = np.random.default_rng(5)
    p, model = build(rng)
    s = model.structures[0]
    assert s.message_shapes == [(2,), (3,)]
    assert s.compiled["a"].scatter_message == (3,) and s.compiled["a"].gather_messages == {0: (2,)}
    assert s.compiled["b"].scatter_message == (2,) and s.compiled["b"].gather_messages == {0: (3,), 1: (3,)}
    graphs = [InputGraph([[], [0], [1], [], [3, 2]], ["a", "b", "a", "a", "b"])] * 2
    feeds = {"x": rng.standard_normal((6, 2))}
    params = {name: q.value for name, q in p.items()}
    result = model.forward_backward(graphs, feeds, params, options=EngineOptions(runner="reference"))
    state = result.states["g"]
    assert sorted(state.scatters) == [(2,), (3,)] and state.scatter is None
    # every gather reads, and every scatter writes, the scatter tensor of its own shape (the program's keys)
    reads = {k for k in state.program.lowered.keys if k[0] == "scatter"}
    assert reads == {("scatter", (2,)), ("scatter", (3,))}
    for kind_id, kind_plan in enumerate(state.plan.kinds):
        fn = s.compiled[kind_plan.name]
        for j, message in fn.gather_messages.items():
            assert np.shares_memory(state.program.buffers[("scatter", message)][0], state.scatters[message])
    text = state.program.dump() + state.backward_program.dump()
    assert "buf=scatter[(2,)]" in text and "buf=scatter[(3,)]" in text and "buf=sgrad[(3,)]" in text
    workspace = model.workspace("g")
    buffers = [t.buffer for t in list(workspace.scatters.values()) + list(workspace.scatter_grads.values())]
    assert len(buffers) == 4
    again = model.forward_backward(graphs, feeds, params, options=EngineOptions(runner="reference"))
    assert again.loss == result.loss
    assert all(a is b for a, b in zip(
        [t.buffer for t in list(workspace.scatters.values()) + list(workspace.scatter_grads.values())], buffers))
