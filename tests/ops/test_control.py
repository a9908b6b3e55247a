"""Control flow as operators (minicavs/ops/control.py): each op forward against a plain Python loop over numpy,
gradients against central finite differences in float64 (DESIGN.md's rule, via minicavs.train.testing.check_grads),
the edge cases (zero and one iteration, max_iterations reached), nesting, and the untaken branch of a cond; and
the op table's control-flow family (tests/ops/specs.py): forward vs tests/reference.py's Python loops, gradients
vs finite differences, backward value types."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minicavs.ops as ops
from minicavs import control as C
from minicavs.ops.autodiff import grad
from minicavs.core.errors import ShapeError
from minicavs.engine.executor import Executor, run
from minicavs.ir.graph import Graph
from minicavs.train.testing import check_grads

from .specs import check_backward_types, check_forward, check_gradient, params_for

F64 = "float64"


def close(a, b, tol=1e-10):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.max(np.abs(a - b), initial=0.0) <= tol * max(1.0, float(np.max(np.abs(b), initial=0.0)))


def rnn_body(W, U):
    """h' = tanh(x W + h U); the output is h' and h' * x[..., :1] (two outputs)."""
    def body(x, h):
        h2 = ops.tanh(ops.matmul(x, W) + ops.matmul(h, U))
        return [h2, h2 * ops.slice_(x, 0, 1)], h2
    return body


def rnn_reference(X, H, Wv, Uv, rows):
    """The same recurrence as a Python loop over numpy (X: (T, R, E) or (R, T, E) when ``rows``)."""
    steps = X.shape[1] if rows else X.shape[0]
    h, outs1, outs2 = H, [], []
    for t in range(steps):
        x = X[:, t] if rows else X[t]
        h = np.tanh(x @ Wv + h @ Uv)
        outs1.append(h)
        outs2.append(h * x[..., :1])
    ax = 1 if rows else 0
    stack = (lambda o: np.stack(o, axis=ax)) if steps else (
        lambda o: np.zeros((H.shape[0], 0, H.shape[-1]) if rows else (0,) + H.shape))
    return stack(outs1), stack(outs2), h


def _rnn_graph(steps, rows):
    E, Hd = 3, 4
    xs = ops.input((None, steps, E) if rows else (steps, 2, E), F64, name="xs")
    h0 = ops.input((None, Hd) if rows else (2, Hd), F64, name="h0")
    W = ops.param_node("W", (E, Hd), F64)
    U = ops.param_node("U", (Hd, Hd), F64)
    (y1, y2), hT = C.foreach(rnn_body(W, U), xs, h0)
    return xs, h0, W, U, y1, y2, hT


def _rnn_values(steps, rows, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((2, steps, 3) if rows else (steps, 2, 3))
    return X, rng.standard_normal((2, 4)), 0.5 * rng.standard_normal((3, 4)), 0.5 * rng.standard_normal((4, 4))


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_foreach_equals_a_python_loop(steps, rows):
    xs, h0, W, U, y1, y2, hT = _rnn_graph(steps, rows)
    X, H, Wv, Uv = _rnn_values(steps, rows)
    got = run([y1, y2, hT], {xs: X, h0: H}, {"W": Wv, "U": Uv})
    for g, want in zip(got, rnn_reference(X, H, Wv, Uv, rows)):
        close(g, want)


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("steps", [0, 1, 4])
def test_foreach_gradients_match_finite_differences(steps, rows):
    xs, h0, W, U, y1, y2, hT = _rnn_graph(steps, rows)
    X, H, Wv, Uv = _rnn_values(steps, rows, seed=1)
    check_grads([y1, y2, hT], [xs, h0, W, U], {xs: X, h0: H}, {"W": Wv, "U": Uv})


def test_foreach_reverse_and_several_inputs_and_states():
    """Two inputs and two states (one of them an int64 counter carried along), run from the last step."""
    a = ops.input((4, 3), F64, name="a")
    b = ops.input((4, 3), F64, name="b")
    s0 = ops.input((3,), F64, name="s0")
    k0 = ops.input((), "int64", name="k0")

    def body(xs, states):
        x, y = xs
        s, k = states
        s2 = s * x + ops.tanh(y)
        return s2 * 2.0, [s2, k + ops.constant(1, "int64")]

    out, (sT, kT) = C.foreach(body, [a, b], [s0, k0], reverse=True)
    rng = np.random.default_rng(2)
    A, B, S = rng.standard_normal((4, 3)), rng.standard_normal((4, 3)), rng.standard_normal(3)
    got_out, got_s, got_k = run([out[0], sT, kT], {a: A, b: B, s0: S, k0: np.int64(7)})
    s, want = S, np.zeros((4, 3))
    for t in reversed(range(4)):
        s = s * A[t] + np.tanh(B[t])
        want[t] = 2.0 * s
    close(got_out, want)
    close(got_s, s)
    assert int(got_k) == 11
    check_grads([out[0], sT], [a, b, s0], {a: A, b: B, s0: S, k0: np.int64(7)})


def test_foreach_errors_name_what_is_wrong():
    xs = ops.input((4, 3), F64, name="xs")
    ys = ops.input((5, 3), F64, name="ys")
    h = ops.input((3,), F64, name="h")
    with pytest.raises(ShapeError, match=r"different lengths \[4, 5\]"):
        C.foreach(lambda x, s: ([], s), [xs, ys], [h])
    with pytest.raises(ShapeError, match=r"state 0 enters as float64\(3,\) but the body returns float64\(1,\)"):
        C.foreach(lambda x, s: ([], ops.sum(s, keepdims=True)), xs, h)
    with pytest.raises(TypeError, match="pair"):
        C.foreach(lambda x, s: s, xs, h)
    with pytest.raises(ShapeError, match="length="):
        C.foreach(lambda x, s: ([], s), [], h)


# --- while_loop ----------------------------------------------------------------------------------------

def _while_graph(max_iterations):
    """x <- x * a + 0.1 while sum(x) < limit; outputs x and x*x each step."""
    x0 = ops.input((3,), F64, name="x0")
    a = ops.param_node("a", (3,), F64)
    limit = ops.input((), F64, name="limit")
    outs, xT, count = C.while_loop(lambda x: ops.step(limit - ops.sum(x)),
                                   lambda x: ([x * a, ops.square(x)], x * a + 0.1), x0, max_iterations)
    return x0, a, limit, outs, xT, count


def _while_reference(X, A, limit, max_iterations):
    x, o1, o2 = X, [], []
    while len(o1) < max_iterations and limit - x.sum() > 0:
        o1.append(x * A)
        o2.append(x * x)
        x = x * A + 0.1
    pad = [np.zeros(3)] * (max_iterations - len(o1))
    return np.array(o1 + pad).reshape(max_iterations, 3), np.array(o2 + pad).reshape(max_iterations, 3), x, len(o1)


@pytest.mark.parametrize("limit,expect", [(-5.0, 0), (2.5, 1), (6.0, None), (1e9, 6)])
def test_while_loop_equals_a_python_loop(limit, expect):
    """Zero iterations (false at once), one, some, and max_iterations reached (6)."""
    x0, a, lim, (o1, o2), xT, count = _while_graph(6)
    X, A = np.array([0.5, 0.8, 0.9]), np.array([1.3, 1.1, 1.2])
    got = run([o1, o2, xT, count], {x0: X, lim: limit}, {"a": A})
    w1, w2, wx, wn = _while_reference(X, A, limit, 6)
    assert int(got[3]) == wn and (expect is None or wn == expect)
    close(got[0], w1)
    close(got[1], w2)
    close(got[2], wx)


@pytest.mark.parametrize("limit", [-5.0, 2.5, 6.0, 1e9])
def test_while_loop_gradients_match_finite_differences(limit):
    x0, a, lim, (o1, o2), xT, count = _while_graph(6)
    X, A = np.array([0.5, 0.8, 0.9]), np.array([1.3, 1.1, 1.2])
    # (limit keeps the trip count fixed under the small perturbations of finite differences)
    check_grads([o1, o2, xT], [x0, a], {x0: X, lim: limit}, {"a": A})


def test_while_loop_condition_must_be_one_value():
    x = ops.input((None, 3), F64, name="x")
    with pytest.raises(ShapeError, match=r"condition returns shape \(\?, 3\)"):
        C.while_loop(lambda v: v, lambda v: ([], v), x, 3)


# --- cond ----------------------------------------------------------------------------------------------

def _cond_graph():
    p = ops.input((), F64, name="p")
    x = ops.input((None, 3), F64, name="x")
    w = ops.param_node("w", (3,), F64)
    # the else branch reads log(-x): NaN (and a numpy warning, an error under this suite's filterwarnings)
    # wherever x > 0, and its gradient 1/x would be inf at 0
    y = C.cond(p, lambda v: ops.tanh(v * w), lambda v: ops.log(ops.neg(v)) * w, x)
    return p, x, w, y


def test_cond_runs_only_the_taken_branch():
    p, x, w, y = _cond_graph()
    X, Wv = np.abs(np.random.default_rng(3).standard_normal((2, 3))) + 0.1, np.array([0.5, -1.0, 2.0])
    close(run(y, {p: 1.0, x: X}, {"w": Wv}), np.tanh(X * Wv))   # else would warn: it never runs
    close(run(y, {p: 0.0, x: -X}, {"w": Wv}), np.log(X) * Wv)


def test_cond_untaken_nan_branch_adds_exactly_zero_to_every_gradient():
    p, x, w, y = _cond_graph()
    X, Wv = np.abs(np.random.default_rng(4).standard_normal((2, 3))) + 0.1, np.array([0.5, -1.0, 2.0])
    X[0, 0] = 0.0   # log(-0) = -inf and its slope inf in the untaken branch
    gx, gw = grad(ops.sum(y), [x, w])
    got_x, got_w = run([gx, gw], {p: 1.0, x: X}, {"w": Wv})
    d = 1.0 - np.tanh(X * Wv) ** 2
    close(got_x, d * Wv)
    close(got_w, (d * X).sum(0))
    check_grads(y, [x, w], {p: 1.0, x: X + 0.5}, {"w": Wv})
    check_grads(y, [x, w], {p: 0.0, x: -X - 0.5}, {"w": Wv})


def test_cond_branches_must_agree_and_the_error_names_both():
    p = ops.input((), F64, name="p")
    x = ops.input((None, 3), F64, name="x")

    def widen(v):
        return ops.concat([v, v])

    def keep(v):
        return v
    with pytest.raises(ShapeError, match=r"output 0 is float64\(\?, 6\) in widen but float64\(\?, 3\) in keep"):
        C.cond(p, widen, keep, x)
    with pytest.raises(ShapeError, match="a per-row choice is an elementwise where"):
        C.cond(x, keep, keep, x)


def test_cond_with_several_outputs_and_closures():
    p = ops.input((1,), F64, name="p")
    a = ops.input((2,), F64, name="a")
    b = ops.input((2,), F64, name="b")
    u, v = C.cond(p, lambda: [a * b, a + 1.0], lambda: [a - b, b * b])
    A, B = np.array([1.5, -0.5]), np.array([2.0, 3.0])
    for pv, want in ((1.0, [A * B, A + 1.0]), (0.0, [A - B, B * B])):
        got = run([u, v], {p: np.array([pv]), a: A, b: B})
        close(got[0], want[0])
        close(got[1], want[1])
        check_grads([u, v], [a, b], {p: np.array([pv]), a: A, b: B})


# --- nesting -------------------------------------------------------------------------------------------

def test_nested_foreach_and_a_cond_inside_a_foreach():
    """An outer loop over rows of a matrix, an inner loop over its entries, and a cond on each entry's sign
    that picks sqrt (NaN for a negative entry) or square; gradients of everything by finite differences."""
    m = ops.input((3, 4), F64, name="m")
    s0 = ops.input((), F64, name="s0")
    c = ops.param_node("c", (), F64)

    def inner(e, s):
        picked = C.cond(ops.step(e), lambda: ops.sqrt(e) * c, lambda: ops.square(e) + c)
        return picked, s * 0.5 + picked

    def outer(row, s):
        outs, s2 = C.foreach(inner, row, s)
        return outs, s2

    (stack,), sT = C.foreach(outer, m, s0)
    M = np.array([[0.5, -1.2, 2.0, -0.3], [1.1, 0.7, -2.2, 0.4], [-0.9, 1.6, 0.25, -1.4]])
    got_stack, got_s = run([stack, sT], {m: M, s0: 0.3}, {"c": 1.7})
    s, want = 0.3, np.zeros((3, 4))
    for i in range(3):
        for j in range(4):
            e = M[i, j]
            want[i, j] = np.sqrt(e) * 1.7 if e > 0 else e * e + 1.7
            s = s * 0.5 + want[i, j]
    close(got_stack, want)
    close(got_s, s)
    check_grads([stack, sT], [m, s0, c], {m: M, s0: 0.3}, {"c": 1.7})


def test_a_nan_branch_inside_a_loop_trains_like_python_control_flow():
    """200 SGD steps of a model whose loop body holds a cond on the sign of a score, each branch taking the
    square root of the score's magnitude as it would be if its side were taken, so the untaken branch is NaN
    at every step; against the same model written with Python control flow (the branch picked in Python,
    only it built): loss and gradient equal at every step, never NaN."""
    T = 5
    xs = ops.input((T, 3), F64, name="xs")
    w = ops.param_node("w", (3,), F64)

    def body(x, h):
        score = ops.sum(x * w)
        h2 = C.cond(ops.step(score), lambda: ops.tanh(h + x * w) * ops.sqrt(score),
                    lambda: ops.tanh(h - x * w) * ops.sqrt(ops.neg(score)))
        return [], h2
    _, hT = C.foreach(body, xs, ops.constant(np.zeros(3)))
    loss = ops.sum(ops.square(hT - 0.3))
    (gw,) = grad(loss, [w])
    step_graph = Executor([loss, gw])

    def python_model(X, W):
        wn = ops.input((3,), F64, name="w_python")
        h = ops.constant(np.zeros(3))
        for t in range(T):
            x = ops.constant(X[t])
            score = ops.sum(x * wn)
            if float(X[t] @ W) > 0:   # chosen in Python: the other branch is never built
                h = ops.tanh(h + x * wn) * ops.sqrt(score)
            else:
                h = ops.tanh(h - x * wn) * ops.sqrt(ops.neg(score))
        lo = ops.sum(ops.square(h - 0.3))
        (g,) = grad(lo, [wn])
        return run([lo, g], {wn: W})

    rng = np.random.default_rng(5)
    Wv = np.array([0.3, -0.2, 0.1])
    Wp = Wv.copy()
    for step in range(200):
        X = rng.standard_normal((T, 3))
        lv, gv = step_graph.run({xs: X}, {"w": Wv})
        lp, gp = python_model(X, Wp)
        assert np.isfinite(lv) and np.all(np.isfinite(gv)), step
        close(lv, lp)
        close(gv, gp)
        Wv = Wv - 0.05 * gv
        Wp = Wp - 0.05 * gp


def test_dump_prints_bodies_indented():
    p, x, w, y = _cond_graph()
    text = Graph([y]).dump()
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if " = cond " in line)
    assert lines[head + 1] == "    then = {" and "else_ = {" in text
    body = lines[head + 2:lines.index("    }", head)]
    assert body and all(line.startswith("      %") or line.startswith("      return") for line in body)
    assert any("tanh" in line for line in body)
    assert any("captured:w" in line for line in body)


# --- on the device stand-in ------------------------------------------------------------------------------

def test_control_flow_on_the_device_standin_equals_the_cpu_and_reads_only_predicates(cuda_standin):
    """Forward and backward of a while_loop, a foreach and a cond with the stand-in's arrays (which refuse
    every implicit crossing, as CuPy does): equal to the CPU run, and the only device-to-host copies are the
    predicates (one per while_loop test, the cond's in the forward and in its backward cond, the backward
    loop's trip count); host-to-device copies are the constants', once (none in a second run)."""
    from minicavs.cuda import standin
    x0, a, lim, (o1, o2), xT, count = _while_graph(6)
    p = ops.input((), F64, name="p")
    y = C.cond(p, lambda: ops.tanh(xT * a), lambda: ops.log(ops.neg(xT)))
    (z,), zT = C.foreach(lambda x, s: ([x * s], s + x), o1, ops.constant(np.ones(3)))
    loss = ops.sum(y * zT) + ops.sum(ops.square(z)) + ops.sum(o2)
    gx, ga = grad(loss, [x0, a])
    X, A = np.array([0.5, 0.8, 0.9]), np.array([1.3, 1.1, 1.2])
    nodes = [loss, gx, ga, count]
    want = Executor(nodes).run({x0: X, lim: 6.0, p: 1.0}, {"a": A})
    feeds = {x0: standin.asarray(X), lim: standin.asarray(np.float64(6.0)), p: standin.asarray(np.float64(1.0))}
    params = {"a": standin.asarray(A)}
    Executor(nodes).run(feeds, params, xp=standin)   # (copies the constants over, once)
    standin.reset()
    got = Executor(nodes).run(feeds, params, xp=standin)
    n = int(want[3])
    assert n == 4 and dict(standin.crossings) == {"d2h": (n + 1) + 2 + 1}, dict(standin.crossings)
    for g, w in zip(got, want):
        assert isinstance(g, standin.ndarray)
        close(g.get(), w)


# --- inside a vertex function ----------------------------------------------------------------------------

def _sequence_chain(tuple_valued: bool):
    """A chain whose vertex function pulls a (T, D) sequence per vertex and runs an RNN over it with a
    foreach of fixed trip count T, starting from the child's message. ``tuple_valued``: the foreach also
    stacks its per-step states (a result with two values), which F pushes summed over the steps."""
    from minicavs.engine.model import Model, Structure
    from minicavs.runtime.vertex import VertexFunction
    T, D, H = 3, 2, 4
    rng = np.random.default_rng(11)
    Wx, Wh = ops.param_node("Wx", (D, H), F64), ops.param_node("Wh", (H, H), F64)
    vals = {"Wx": rng.uniform(-0.5, 0.5, (D, H)), "Wh": rng.uniform(-0.5, 0.5, (H, H))}
    F = VertexFunction("seq", arity=1, message=(H,), dtype=F64)
    with F:
        def body(x, h):
            h2 = ops.tanh(x @ Wx + h @ Wh)
            return ([h2] if tuple_valued else []), h2
        outs, hT = C.foreach(body, F.pull((T, D)), F.gather(0))
        F.scatter(hT)
        F.push(hT + ops.sum(outs[0], axis=0) if tuple_valued else hT)
    s = Structure(F, pulls={"x": ops.input((None, T, D), F64, name="xs")})
    model = Model(s, loss=ops.sum(ops.square(s.pushed("h"))))
    return model, vals, T


def _sequence_chain_reference(X, sizes, Wx, Wh, T, tuple_valued):
    total, r = 0.0, 0
    for n in sizes:
        h = np.zeros(Wh.shape[0])
        for _ in range(n):
            acc = np.zeros_like(h)
            for t in range(T):
                h = np.tanh(X[r, t] @ Wx + h @ Wh)
                acc += h
            total += np.sum((h + acc) ** 2 if tuple_valued else h ** 2)
            r += 1
    return total


@pytest.mark.parametrize("tuple_valued", [False, True])
def test_a_vertex_function_with_a_foreach_trains_on_both_executors(tuple_valued):
    """F with a foreach over each vertex's sequence: the loss equals a Python loop over the chain, the
    gradients finite differences; the C runner runs the loop (LOOP ... ENDLOOP, engine/loops.py) in both
    passes; with the outputs summed over the steps (a sum along an axis: APPLY) it declines that op, not the
    loop, leaving both passes to the reference runner on the CPU (same numbers)."""
    from minicavs.engine.compile import EngineOptions
    from minicavs.runtime.inputs import InputGraph
    from minicavs.train.testing import check_model_grads
    model, vals, T = _sequence_chain(tuple_valued)
    sizes = (3, 1, 2)
    graphs = [InputGraph.chain(n) for n in sizes]
    X = np.random.default_rng(12).standard_normal((sum(sizes), T, 2))
    reference = model.forward_backward(graphs, {"xs": X}, vals, options=EngineOptions(runner="reference"))
    native = model.forward_backward(graphs, {"xs": X}, vals, options=EngineOptions(runner="device"))
    close(reference.loss, _sequence_chain_reference(X, sizes, vals["Wx"], vals["Wh"], T, tuple_valued))
    close(native.loss, reference.loss)
    for k in vals:
        close(native.grads[k], reference.grads[k])
    for state in native.states.values():
        for program in (state.program, state.backward_program):
            if tuple_valued:
                assert program.runner == "reference runner" and "foreach" not in program.declined, program.declined
            else:
                assert program.runner == "C runner" and program.declined is None, program.declined
    check_model_grads(model, graphs, {"xs": X}, vals, directions=2)


@pytest.mark.parametrize("ran", [0, 1, 3, 5])
def test_foreach_with_a_run_time_trip_count(ran):
    """``steps``: only the first ``ran`` of the 5 steps run; outputs stay 5 long, zero after; gradients of
    the inputs' unread steps are zero (finite differences agree)."""
    xs, h0, W, U = (ops.input((None, 5, 3), F64, name="xs"), ops.input((None, 4), F64, name="h0"),
                    ops.param_node("W", (3, 4), F64), ops.param_node("U", (4, 4), F64))
    n = ops.input((), "int64", name="n")
    (y1, y2), hT = C.foreach(rnn_body(W, U), xs, h0, steps=n)
    X, H, Wv, Uv = _rnn_values(5, True, seed=7)
    got = run([y1, y2, hT], {xs: X, h0: H, n: np.int64(ran)}, {"W": Wv, "U": Uv})
    w1, w2, wh = rnn_reference(X[:, :ran], H, Wv, Uv, True)
    close(got[0][:, :ran], w1)
    close(got[1][:, :ran], w2)
    assert not np.any(got[0][:, ran:]) and not np.any(got[1][:, ran:])
    close(got[2], wh)
    check_grads([y1, y2, hT], [xs, h0, W, U], {xs: X, h0: H, n: np.int64(ran)}, {"W": Wv, "U": Uv})


def test_foreach_refuses_more_run_time_steps_than_its_length():
    from minicavs.core.errors import FeedError
    xs = ops.input((4, 3), F64, name="xs")
    n = ops.input((), "int64", name="n")
    _, s = C.foreach(lambda x, s: ([], s + x), xs, ops.constant(np.zeros(3)), steps=n)
    with pytest.raises(FeedError, match="5 steps asked of a loop over 4"):
        run(s, {xs: np.ones((4, 3)), n: np.int64(5)})
    with pytest.raises(ShapeError, match="steps must be one integer value"):
        C.foreach(lambda x, s: ([], s + x), xs, ops.constant(np.zeros(3)), steps=ops.input((), F64))


def _cond_chain(choice):
    """A chain whose F picks its cell by the sign of a parameter: with a cond (``choice=None``), or with
    Python control flow (``choice`` True or False: that branch alone)."""
    from minicavs.engine.model import Model, Structure
    from minicavs.runtime.vertex import VertexFunction
    D, H = 2, 4
    Wx, s = ops.param_node("Wx", (D, H), F64), ops.param_node("s", (), F64)
    F = VertexFunction("v", arity=1, message=(H,), dtype=F64)
    with F:
        h0, x = F.gather(0), F.pull((D,))

        def smooth():
            return [ops.tanh(x @ Wx + h0), h0 * 0.5]

        def other():
            return [ops.sigmoid(x @ Wx) + ops.log(ops.abs(h0) + 1.0), ops.tanh(h0)]
        h, extra = (C.cond(ops.step(s), smooth, other) if choice is None else (smooth() if choice else other()))
        F.scatter(h)
        F.push(h + extra)
    st = Structure(F, pulls={"x": ops.input((None, D), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_cond_in_a_vertex_function_equals_python_control_flow(sign):
    """A cond with two results in F (a node per result there), on both executors, equal to F written with
    the branch chosen in Python: loss and gradients."""
    from minicavs.engine.compile import EngineOptions
    from minicavs.runtime.inputs import InputGraph
    rng = np.random.default_rng(13)
    vals = {"Wx": rng.uniform(-0.5, 0.5, (2, 4)), "s": np.float64(sign)}
    graphs = [InputGraph.chain(n) for n in (3, 1, 2)]
    feeds = {"xs": rng.standard_normal((6, 2))}
    want = _cond_chain(sign > 0).forward_backward(graphs, feeds, vals)
    model = _cond_chain(None)
    for runner in ("reference", "device"):
        got = model.forward_backward(graphs, feeds, vals, options=EngineOptions(runner=runner))
        close(got.loss, want.loss)
        close(got.grads["Wx"], want.grads["Wx"])


def test_a_while_loop_inside_a_foreach():
    """Per step of a foreach, a while_loop halving a value until it is below a threshold (a different trip
    count per step); forward against Python loops, gradients by finite differences."""
    xs = ops.input((4,), F64, name="xs")
    k = ops.param_node("k", (), F64)

    def body(x, s):
        _, y, count = C.while_loop(lambda v: ops.step(v - 1.0), lambda v: ([], v * 0.5 + k), x, 6)
        return [y], s + y * x
    (ys,), total = C.foreach(body, xs, ops.constant(0.0, F64))
    X = np.array([0.7, 3.3, 9.1, 40.0])
    got_ys, got_total = run([ys, total], {xs: X}, {"k": 0.1})
    want = []
    for x in X:
        v, n = x, 0
        while n < 6 and v - 1.0 > 0:
            v, n = v * 0.5 + 0.1, n + 1
        want.append(v)
    close(got_ys, want)
    close(got_total, float(np.dot(want, X)))
    check_grads([ys, total], [xs, k], {xs: X}, {"k": 0.1})


@settings(deadline=None, max_examples=15)
@given(steps=st.integers(0, 4), rows=st.booleans(), width=st.integers(1, 3), reverse=st.booleans(),
       seed=st.integers(0, 2**16))
def test_foreach_of_any_size_and_direction_equals_a_python_loop(steps, rows, width, reverse, seed):
    """s' = tanh(x * a + s * b), output s' * x, over random lengths (zero included), widths, directions."""
    lead = (None,) if rows else ()
    xs = ops.input(lead + (steps, width) if rows else (steps, width), F64, name="xs")
    s0 = ops.input(lead + (width,), F64, name="s0")
    a, b = ops.param_node("a", (width,), F64), ops.param_node("b", (width,), F64)
    (ys,), sT = C.foreach(lambda x, s: ([ops.tanh(x * a + s * b) * x], ops.tanh(x * a + s * b)), xs, s0,
                          reverse=reverse)
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((2, steps, width) if rows else (steps, width))
    S, A, B = rng.standard_normal((2, width) if rows else (width,)), rng.standard_normal(width), \
        rng.standard_normal(width)
    got_y, got_s = run([ys, sT], {xs: X, s0: S}, {"a": A, "b": B})
    s, want = S, np.zeros_like(X)
    for t in (reversed(range(steps)) if reverse else range(steps)):
        x = X[:, t] if rows else X[t]
        s = np.tanh(x * A + s * B)
        if rows:
            want[:, t] = s * x
        else:
            want[t] = s * x
    close(got_y, want)
    close(got_s, s)
    check_grads([ys, sT], [xs, s0, a, b], {xs: X, s0: S}, {"a": A, "b": B})


# --- one node in several slots of a control-flow op ----------------------------------------------------
# A node that fills two or more input slots (iterated input, state, value read from outside, cond operand)
# must receive the sum of every slot's gradient; a value read from outside that is computed from another
# one read from outside (x and 2x) must not be differentiated twice. Every pairing of slot roles, nested,
# in a static graph and inside a vertex function: float64 finite differences over every element.

T_STEPS, WIDTH = 3, 2
FOREACH_ROLES = ("input", "input2", "state", "state2", "closure", "derived")


def _foreach_with_roles(roles: tuple):
    """A foreach whose slots are filled by ``a`` (a computed node, so its gradient also flows on to its
    input ``a0``) in ``roles`` and by independent inputs elsewhere. ``derived``: the body also reads
    ``2 a + b`` from outside, beside whatever else it reads."""
    a0 = ops.input((T_STEPS, WIDTH), F64, name="a0")
    a = ops.tanh(a0)
    others = {r: ops.input((T_STEPS, WIDTH), F64, name=f"b_{r}") for r in FOREACH_ROLES}
    fill = {r: a if r in roles else others[r] for r in FOREACH_ROLES}
    closure, derived = fill["closure"], fill["derived"] * 2.0 + others["closure"]

    def body(x, s):
        mix = x[0] * 0.5 + x[1] * x[1]
        new = [ops.tanh(s[0] * 0.7 + mix + closure * s[1]), s[1] * 0.9 + ops.sigmoid(s[0]) * derived]
        return [ops.sum(new[0] * closure, axis=0)], new
    (ys,), finals = C.foreach(body, [fill["input"], fill["input2"]], [fill["state"], fill["state2"]])
    wrt = [a0] + list(others.values())
    return [ys] + finals, wrt


@pytest.mark.parametrize("roles", [r for k in (1, 2, 3) for r in itertools.combinations(
    FOREACH_ROLES, k)], ids="+".join)
def test_foreach_gradient_sums_every_slot_a_node_fills(roles):
    outputs, wrt = _foreach_with_roles(roles)
    rng = np.random.default_rng(len(roles))
    feeds = {w: rng.uniform(-1.0, 1.0, (T_STEPS, WIDTH)) for w in wrt}
    check_grads(outputs, wrt, feeds)


WHILE_ROLES = ("state", "state2", "closure", "cond_closure", "derived")


@pytest.mark.parametrize("roles", [r for k in (1, 2, 3) for r in itertools.combinations(
    WHILE_ROLES, k)], ids="+".join)
def test_while_loop_gradient_sums_every_slot_a_node_fills(roles):
    """The issue's reproduction is ``state+closure``: ``v <- v / 2 + x`` from ``v = x``, two steps."""
    a0 = ops.input((WIDTH,), F64, name="a0")
    a = ops.tanh(a0)
    others = {r: ops.input((WIDTH,), F64, name=f"b_{r}") for r in WHILE_ROLES}
    fill = {r: a if r in roles else others[r] for r in WHILE_ROLES}
    derived = fill["derived"] * 2.0 + others["closure"]
    k0 = ops.constant(0.0, F64)

    def keep_going(v):   # three steps; reads a value from outside that the body may read too
        return ops.step(3.0 - v[2] + ops.sum(fill["cond_closure"]) * 0.0)

    def body(v):
        s, s2, k = v
        new = [s * 0.5 + fill["closure"] * s2, ops.tanh(s2 + ops.sigmoid(s) * derived), k + 1.0]
        return [s * s2], new
    (ys,), (sT, s2T, _), count = C.while_loop(keep_going, body, [fill["state"], fill["state2"], k0], 5)
    wrt = [a0] + list(others.values())
    rng = np.random.default_rng(len(roles) + 7)
    feeds = {w: rng.uniform(-1.0, 1.0, (WIDTH,)) for w in wrt}
    assert int(run(count, feeds)) == 3
    check_grads([ys, sT, s2T], wrt, feeds)


def test_while_loop_state_read_from_outside_the_issues_numbers():
    """``v <- v / 2 + x`` twice from ``v = x``: v2 = 1.75 x, so the gradient of sum(v2) is 1.75 (was 1.5)."""
    x = ops.input((3,), F64, name="x")
    _, vT, _ = C.while_loop(lambda v: ops.sum(ops.ones_like(v)), lambda v: ([], v * 0.5 + x), x, 2)
    (g,) = grad(ops.sum(vT), [x])
    close(run(g, {x: np.ones(3)}), np.full(3, 1.75))


COND_ROLES = ("operand", "operand2", "then_closure", "else_closure")


@pytest.mark.parametrize("taken", [1.0, -1.0])
@pytest.mark.parametrize("roles", [r for k in (1, 2, 3, 4) for r in itertools.combinations(
    COND_ROLES, k)], ids="+".join)
def test_cond_gradient_sums_every_slot_a_node_fills(roles, taken):
    a0 = ops.input((WIDTH,), F64, name="a0")
    a = ops.tanh(a0)
    others = {r: ops.input((WIDTH,), F64, name=f"b_{r}") for r in COND_ROLES}
    fill = {r: a if r in roles else others[r] for r in COND_ROLES}
    p = ops.input((), F64, name="p")
    y = C.cond(p, lambda u, v: u * v + ops.sigmoid(fill["then_closure"]) * u,
               lambda u, v: ops.tanh(u - v) * fill["else_closure"] * (fill["else_closure"] * 2.0 + u),
               [fill["operand"], fill["operand2"]])
    wrt = [a0] + list(others.values())
    rng = np.random.default_rng(len(roles))
    feeds = {w: rng.uniform(-1.0, 1.0, (WIDTH,)) for w in wrt}
    check_grads(y, wrt, {**feeds, p: taken})


def test_nested_loops_with_a_node_in_several_slots_at_each_level():
    """An outer foreach over the rows of ``a`` that also carries ``a`` as a state and reads it from outside;
    its body runs a while_loop whose state is the row and which reads the row, the outer state and ``a``
    itself from outside (captured through two levels), and a cond on the row with the row twice."""
    a0 = ops.input((T_STEPS, WIDTH), F64, name="a0")
    a = ops.tanh(a0)
    p = ops.input((), F64, name="p")

    def outer(x, s):
        def inner(v):
            return [], [v[0] * 0.5 + x * ops.sum(s, axis=0) + ops.sum(a, axis=0), v[1] + 1.0]
        _, (vT, _), _ = C.while_loop(lambda v: ops.step(2.0 - v[1]), inner, [x, ops.constant(0.0, F64)], 4)
        z = C.cond(p, lambda u, w: u * w + x, lambda u, w: u - w, [vT, vT])
        return [z], ops.tanh(s * 0.5 + a * ops.sum(z))
    (zs,), sT = C.foreach(outer, a, a)
    rng = np.random.default_rng(5)
    A0 = rng.uniform(-1.0, 1.0, (T_STEPS, WIDTH))
    for taken in (1.0, -1.0):
        check_grads([zs, sT], [a0], {a0: A0, p: taken})


def _aliasing_chain(op: str):
    """A chain whose F runs ``op`` with the gathered message ``h`` (and the pulled sequence ``xs``) in
    several slots at once: state and value read from outside, iterated input and value read from outside,
    both cond operands; the parameters reach every slot, so finite differences of the loss in the
    parameters see any slot's gradient that goes missing."""
    from minicavs.engine.model import Model, Structure
    from minicavs.runtime.vertex import VertexFunction
    D, H = 2, 3
    Wx, Wh = ops.param_node("Wx", (D, H), F64), ops.param_node("Wh", (H, H), F64)
    F = VertexFunction("v", arity=1, message=(H,), dtype=F64)
    with F:
        h, xs = F.gather(0), F.pull((T_STEPS, D))
        if op == "foreach":
            (ys,), hT = C.foreach(lambda x, s: ([x * ops.sum(xs, axis=0)], ops.tanh(x @ Wx + s @ Wh + h * 0.5)),
                                  xs, h)
            out = hT + ops.sum(ys @ Wx, axis=0) * 0.1
        elif op == "while_loop":
            # (the predicate is one value for the batch: here a parameter's, true, so max_iterations runs)
            _, out, _ = C.while_loop(lambda v: ops.sum(ops.abs(Wh)), lambda v: (
                [], ops.tanh(v @ Wh + h + ops.sum(xs, axis=0) @ Wx)), h, 2)
        else:
            s = ops.param_node("s", (), F64)
            out = C.cond(ops.step(s), lambda u, w: ops.tanh(u @ Wh + w + ops.sum(xs, axis=0) @ Wx), lambda u, w: u * w - h, [h, h])
        F.scatter(out)
        F.push(out)
    st = Structure(F, pulls={"x": ops.input((None, T_STEPS, D), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


@pytest.mark.parametrize("op", ["foreach", "while_loop", "cond"])
def test_a_node_in_several_slots_inside_a_vertex_function(op):
    from minicavs.engine.compile import EngineOptions
    from minicavs.runtime.inputs import InputGraph
    from minicavs.train.testing import check_model_grads
    rng = np.random.default_rng(21)
    model = _aliasing_chain(op)
    vals = {"Wx": rng.uniform(-0.5, 0.5, (2, 3)), "Wh": rng.uniform(-0.5, 0.5, (3, 3)), "s": np.float64(-1.0)}
    graphs = [InputGraph.chain(n) for n in (3, 1, 2)]
    feeds = {"xs": rng.standard_normal((6, T_STEPS, 2))}
    for runner in ("reference", "device"):
        check_model_grads(model, graphs, feeds, vals, directions=3, ctx=None) if runner == "reference" else None
        got = model.forward_backward(graphs, feeds, vals, options=EngineOptions(runner=runner))
        want = model.forward_backward(graphs, feeds, vals, options=EngineOptions(runner="reference"))
        for k in ("Wx", "Wh"):
            close(got.grads[k], want.grads[k])


# --- predicates: any nonzero value is true, NaN included (C, MXNet, NumPy, JAX's cond) ------------------

@pytest.mark.parametrize("value,taken", [(-1.0, True), (np.nan, True), (np.inf, True), (2.0, True),
                                         (0.0, False), (-0.0, False)])
def test_cond_takes_any_nonzero_predicate_as_true(value, taken):
    p = ops.input((), F64, name="p")
    x = ops.input((2,), F64, name="x")
    y = C.cond(p, lambda v: v * 2.0, lambda v: v - 1.0, x)
    (g,) = grad(ops.sum(y), [x])
    got, got_g = run([y, g], {p: value, x: np.array([1.0, 3.0])})
    close(got, [2.0, 6.0] if taken else [0.0, 2.0])
    close(got_g, [2.0, 2.0] if taken else [1.0, 1.0])


@pytest.mark.parametrize("value,steps", [(-1.0, 4), (np.nan, 4), (0.0, 0), (-0.0, 0)])
def test_while_loop_takes_any_nonzero_predicate_as_true(value, steps):
    """The condition returns ``value`` while the counter is below 4 (then 0): -1 and NaN keep going."""
    c = ops.input((), F64, name="c")
    k0 = ops.constant(0.0, F64)
    _, kT, count = C.while_loop(lambda k: ops.where(ops.step(4.0 - k), c, 0.0), lambda k: ([], k + 1.0), k0, 9)
    got_k, got_n = run([kT, count], {c: value})
    assert int(got_n) == steps and float(got_k) == steps


def test_a_while_loop_condition_per_vertex_is_refused_with_what_works_there():
    from minicavs.runtime.vertex import VertexFunction
    F = VertexFunction("v", arity=1, message=(3,), dtype=F64)
    with F:
        h = F.gather(0)
        with pytest.raises(ShapeError, match=r"inside a vertex function .*\(a step counter\)"):
            C.while_loop(lambda v: ops.sum(v, axis=0), lambda v: ([], v * 0.5), h, 3)
        F.scatter(h)
    x = ops.input((None, 3), F64, name="x")
    with pytest.raises(ShapeError, match=r"reduce to one value with sum\(\.\.\.\) over every axis"):
        C.while_loop(lambda v: ops.sum(v, axis=1), lambda v: ([], v * 0.5), x, 3)


def _counted_chain(limit: float):
    """A chain whose F halves-and-mixes its message while a step counter (a loop state without the row
    axis) is below ``limit`` (a parameter): the trip count is one for the batch, set by a parameter."""
    from minicavs.engine.model import Model, Structure
    from minicavs.runtime.vertex import VertexFunction
    H = 3
    Wh, lim = ops.param_node("Wh", (H, H), F64), ops.param_node("lim", (), F64)
    F = VertexFunction("v", arity=1, message=(H,), dtype=F64)
    with F:
        h = F.gather(0) + F.pull((H,))
        _, (out, _), count = C.while_loop(lambda v: ops.step(lim - v[1]), lambda v: (
            [], [ops.tanh(v[0] @ Wh + h), v[1] + 1.0]), [h, ops.constant(0.0, F64)], 6)
        F.scatter(out)
        F.push(out)
    st = Structure(F, pulls={"x": ops.input((None, H), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


@pytest.mark.parametrize("limit,steps", [(0.5, 1), (2.5, 3), (9.0, 6)])
def test_a_while_loop_with_a_step_counter_in_a_vertex_function_trains(limit, steps):
    """The documented way to a predicate in F: a state without the row axis. Loss against a Python loop
    over the chains, gradients against finite differences, on both runners."""
    from minicavs.engine.compile import EngineOptions
    from minicavs.runtime.inputs import InputGraph
    from minicavs.train.testing import check_model_grads
    rng = np.random.default_rng(17)
    Wh, X = rng.uniform(-0.5, 0.5, (3, 3)), rng.standard_normal((6, 3))
    vals = {"Wh": Wh, "lim": np.float64(limit)}
    sizes = (3, 1, 2)
    want, r = 0.0, 0
    for n in sizes:
        msg = np.zeros(3)
        for _ in range(n):
            h = msg + X[r]
            v = h
            for _ in range(steps):
                v = np.tanh(v @ Wh + h)
            msg, r = v, r + 1
            want += np.sum(v ** 2)
    model = _counted_chain(limit)
    graphs = [InputGraph.chain(n) for n in sizes]
    for runner in ("reference", "device"):
        got = model.forward_backward(graphs, {"xs": X}, vals, options=EngineOptions(runner=runner))
        close(got.loss, want)
    check_model_grads(model, graphs, {"xs": X}, {"Wh": Wh, "lim": np.float64(limit)}, directions=3)


# --- the op table's control-flow family (tests/ops/specs.py) ---

@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("control"))
def test_forward_matches_reference(spec, case, dtype, rows):
    check_forward(spec, case, dtype, rows)


@pytest.mark.parametrize("spec,case", params_for("control", gradient=True))
def test_gradient_matches_finite_differences(spec, case):
    check_gradient(spec, case)


@pytest.mark.parametrize("rows", [3, 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec,case", params_for("control", gradient=True))
def test_backward_values_have_declared_types(spec, case, dtype, rows):
    check_backward_types(spec, case, dtype, rows)
