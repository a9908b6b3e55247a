"""A while_loop inside a vertex function as a loop of the instruction program (engine/loops.py: the condition's
instructions and WHILE at the top of LOOP ... ENDLOOP), and ∂F's reverse foreach over the steps it ran as a loop
whose trip count is read where it runs (LOOPN over the one-value static the gradient computes): no runner
declines F or ∂F, every runner (reference, C runner, the emulated CUDA issuing loop) equals F written with
Python loops and the APPLY path, loss and gradients, for 0, 1, several and the most iterations; gradients
match float64 central finite differences; a cond inside the while is a branch inside the loop (NaN in its
untaken branch reaches nothing), a while inside a foreach a loop inside a loop; a wrong trip count, condition or
depth is refused by every loop's checks naming the operand; on the device each condition is one counted read
per test, each run-time trip count one per pass."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs import ops
from minicavs.core.dtypes import float64 as F64
from minicavs.core.errors import CheckError
from minicavs.cuda import Cuda, issue, standin
from minicavs.engine import instructions
from minicavs.engine.codegen.opcodes import MAX_DEPTH
from minicavs.engine.lowered import OPCODES_BY_ID
from minicavs.engine.model import Model, Structure
from minicavs.ops import control as C
from minicavs.runtime.inputs import InputGraph
from minicavs.runtime.vertex import VertexFunction

from .test_backend import close
from .test_branches import _corrupted, _refused_by_every_runner, _run

GRAPHS = [InputGraph.chain(n) for n in (3, 1, 2)]
H, MOST = 3, 6
# the limit and the iterations it runs: 0, 1, several, the most (the condition still true)
LIMITS = {0: -0.5, 1: 0.5, 3: 2.5, MOST: 9.0}


def _cell(v, h, Wh, pred=None, sign: float = 1.0):
    """One step: the state mixed with the vertex's input, the counter + 1; ``pred`` given (a static computed
    outside the loop): a cond on it picks the step's state, the branch ``sign`` does not take NaN for every
    row (the log of a negative number)."""
    new = ops.tanh(v[0] @ Wh + h)
    if pred is not None:
        def fine():
            return new * 0.5

        def nan():
            return ops.log(-1.0 - ops.square(new))
        new = C.cond(pred, fine, nan) if sign > 0 else C.cond(pred, nan, fine)
    return [new, v[1] + 1.0]


def _chain(steps: int | None, with_cond: bool = False, sign: float = 1.0) -> Model:
    """F runs ``_cell`` while a step counter (a state without the row axis) is below the parameter ``lim``, at
    most MOST times (``steps`` None), or ``steps`` times in Python; with a cond in the step (the finite branch,
    on the sign of ``s``, taken in Python when unrolled)."""
    Wh, lim, s = ops.param_node("Wh", (H, H), F64), ops.param_node("lim", (), F64), ops.param_node("s", (), F64)
    F = VertexFunction("v", arity=1, message=(H,), dtype=F64)
    with F:
        h, pred = F.gather(0) + F.pull((H,)), ops.step(s) if with_cond else None
        v = [h, ops.constant(0.0, F64)]
        if steps is None:
            _, v, _ = C.while_loop(lambda v: ops.step(lim - v[1]), lambda v: ([], _cell(v, h, Wh, pred, sign)),
                                   v, MOST)
        else:
            for _ in range(steps):
                v = _cell(v, h, Wh)
                v[0] = v[0] * 0.5 if with_cond else v[0]
        F.scatter(v[0])
        F.push(v[0])
    st = Structure(F, pulls={"x": ops.input((None, H), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def _values(steps: int, sign: float = 1.0) -> tuple[dict, dict]:
    rng = np.random.default_rng(5)
    vals = {"Wh": rng.uniform(-0.5, 0.5, (H, H)), "lim": np.float64(LIMITS[steps]), "s": np.float64(sign)}
    return vals, {"xs": rng.standard_normal((6, H))}


def _loops_on(result, runner: str, *opcodes: str) -> None:
    """Both passes ran on ``runner``, declined by no C loop, with ``opcodes`` in their programs (F's first)."""
    for state in result.states.values():
        for program, opcode in zip((state.program, state.backward_program), opcodes):
            assert program.lowered.c_refusal is None, program.lowered.c_refusal
            assert program.declined is None and program.runner == runner, (program.runner, program.declined)
            assert opcode in [OPCODES_BY_ID[op] for op in program.lowered.code[:, 0]], opcode


def _same(got, want, what: str) -> None:
    close(got.loss, want.loss, "float64", what)
    for k in want.grads:
        close(got.grads[k], want.grads[k], "float64", f"{what} d{k}")


RUNNERS = [("reference", False, "reference runner"), ("device", False, "C runner"), ("device", True, "cuda runner")]


@pytest.mark.parametrize("steps", sorted(LIMITS))
def test_a_while_in_f_is_a_loop_every_runner_runs_equal_to_python_and_the_apply_path(cuda_standin, monkeypatch,
                                                                                   steps):
    """F: WHILE at the top of a LOOP; ∂F: the replay saving states a WHILE loop too, the reverse foreach over
    the steps run a LOOPN."""
    vals, feeds = _values(steps)
    python = _run(_chain(steps), vals, feeds, "reference")
    model = _chain(None)
    for runner, on_cuda, name in RUNNERS:
        got = _run(model, vals, feeds, runner, Cuda(cuda_standin) if on_cuda else None, check=True)
        _loops_on(got, name, "WHILE", "LOOPN")
        _same(got, python, name)
    monkeypatch.setattr(instructions, "loops", lambda t, step: False)   # (the loops APPLYs of their ops)
    applied = _run(_chain(None), vals, feeds, "reference")
    assert next(iter(applied.states.values())).program.lowered.c_refusal is not None
    _same(applied, python, "APPLY path")


@pytest.mark.parametrize("steps", sorted(LIMITS))
def test_the_while_loops_gradients_match_central_finite_differences(steps):
    """float64 on the C runner (the default), each parameter along random directions (train.testing)."""
    from minicavs.train.testing import check_model_grads
    vals, feeds = _values(steps)
    model = _chain(None)
    _loops_on(_run(model, vals, feeds, "device"), "C runner", "WHILE", "LOOPN")
    check_model_grads(model, GRAPHS, feeds, vals, directions=2)


@pytest.mark.parametrize("steps", [1, 3, MOST])
def test_a_while_in_f_saves_what_its_gradient_reads_so_its_body_runs_once_per_step(monkeypatch, steps):
    """The forward while keeps its per-step states and the values its gradient reads (ops/loop_grad.py), so
    the whole pass (the loops APPLYs of their ops on the reference runner: each run of a body is a call) runs F's
    body once per step and task and never again in ∂F (no replay of the loop: ∂F's program tests no condition);
    ∂F's loop body re-applies no forward op (no tanh); the values equal F in Python."""
    from minicavs.ops.flow import flow, is_loop
    from minicavs.ops.subgraph import Subgraph
    vals, feeds = _values(steps)
    model = _chain(None)
    got = _run(model, vals, feeds, "device")
    backward = next(iter(got.states.values())).backward_program.lowered
    assert "WHILE" not in [OPCODES_BY_ID[op] for op in backward.code[:, 0]], "\n".join(backward.lines())
    fn = model.structures[0].compiled["v"]
    for node in [n for n in list(fn.row_bwd) + list(fn.static_bwd) if is_loop(n)]:
        assert "tanh" not in {n.op for _, body in flow(node).bodies for n in body.computed}, node.label()
    model = _chain(None)   # (a fresh one: lowered with the loops as APPLYs)
    bodies = {id(flow(n).bodies[0][1]) for n in model.structures[0].compiled["v"].row_fwd if is_loop(n)}
    runs = []
    real = Subgraph.run
    monkeypatch.setattr(Subgraph, "run",
                        lambda self, xp, values: (runs.append(id(self)), real(self, xp, values))[1])
    monkeypatch.setattr(instructions, "loops", lambda t, step: False)
    applied = _run(model, vals, feeds, "reference")
    program = next(iter(applied.states.values())).program
    tasks = int((program.table[:, 0] < program.lowered.n_kinds).sum())
    assert sum(r in bodies for r in runs) == tasks * steps, (tasks, steps)
    _same(applied, _run(_chain(steps), vals, feeds, "reference"), "APPLY path")


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_cond_inside_a_while_is_a_branch_inside_the_loop(cuda_standin, sign):
    """The untaken branch is NaN (log of a negative number) for every row: never computed, nor its gradient."""
    vals, feeds = _values(3, sign)
    want = _run(_chain(3, True, sign), vals, feeds, "reference")
    model = _chain(None, True, sign)
    for runner, on_cuda, name in RUNNERS:
        got = _run(model, vals, feeds, runner, Cuda(cuda_standin) if on_cuda else None)
        _loops_on(got, name, "BRANCH", "BRANCH")
        _loops_on(got, name, "WHILE", "LOOPN")
        _same(got, want, name)


def _nested(steps: int | None) -> Model:
    """F runs a foreach over the vertex's (4, H) sequence whose body runs a while_loop (a step counter below
    ``lim``, at most 3 times; ``steps`` of them written in Python)."""
    Wh, Wx, lim = ops.param_node("Wh", (H, H), F64), ops.param_node("Wx", (H, H), F64), ops.param_node("lim", (), F64)
    F = VertexFunction("seq", arity=1, message=(H,), dtype=F64)
    with F:
        xs, h = F.pull((4, H)), F.gather(0)

        def body(x, s):
            u = x @ Wx
            v = [s, ops.constant(0.0, F64)]
            if steps is None:
                _, (s2, _), _ = C.while_loop(lambda v: ops.step(lim - v[1]),
                                             lambda v: ([], [ops.tanh(v[0] @ Wh + u), v[1] + 1.0]), v, 3)
            else:
                for _ in range(steps):
                    v = [ops.tanh(v[0] @ Wh + u), v[1] + 1.0]
                s2 = v[0]
            return [], s2
        _, h = C.foreach(body, xs, h)
        F.scatter(h)
        F.push(h)
    st = Structure(F, pulls={"x": ops.input((None, 4, H), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


@pytest.mark.parametrize("steps", [0, 2, 3])
def test_a_while_inside_a_foreach_is_a_loop_inside_a_loop(cuda_standin, steps):
    """F: the while a loop at depth 1. ∂F: its gradient replays it inside the outer backward body, where its
    count of steps run is computed per outer step: STEPS writes it after the replay's ENDLOOP, and the reverse
    loop over those steps reads it where it runs (LOOPR). Every runner, both passes, equal to Python loops."""
    rng = np.random.default_rng(9)
    vals = {"Wh": rng.uniform(-0.5, 0.5, (H, H)), "Wx": rng.uniform(-0.5, 0.5, (H, H)),
            "lim": np.float64({0: -1.0, 2: 1.5, 3: 7.0}[steps])}
    feeds = {"xs": rng.standard_normal((6, 4, H))}
    want = _run(_nested(steps), vals, feeds, "reference")
    model = _nested(None)
    for runner, on_cuda, name in RUNNERS:
        got = _run(model, vals, feeds, runner, Cuda(cuda_standin) if on_cuda else None, check=True)
        _loops_on(got, name, "WHILE", "LOOPR")
        _loops_on(got, name, "LOOP", "STEPS")
        state = next(iter(got.states.values()))
        code = [OPCODES_BY_ID[op] for op in state.program.lowered.code[:, 0]]
        assert code.count("LOOP") == 2   # (the while at depth 1)
        _same(got, want, name)


def test_the_nested_whiles_gradients_match_central_finite_differences():
    """float64 on the C runner, both passes its loops (the default runner)."""
    from minicavs.train.testing import check_model_grads
    rng = np.random.default_rng(9)
    vals = {"Wh": rng.uniform(-0.5, 0.5, (H, H)), "Wx": rng.uniform(-0.5, 0.5, (H, H)), "lim": np.float64(1.5)}
    feeds = {"xs": rng.standard_normal((6, 4, H))}
    model = _nested(None)
    _loops_on(_run(model, vals, feeds, "device"), "C runner", "WHILE", "LOOPR")   # (what the differences check)
    check_model_grads(model, GRAPHS, feeds, vals, directions=1)


def _foreach_in_foreach(unrolled: bool) -> Model:
    """F runs a foreach over the vertex's (4, H) sequence whose body runs a foreach of 3 steps over the state
    (or those 3 steps in Python)."""
    Wh, Wx = ops.param_node("Wh", (H, H), F64), ops.param_node("Wx", (H, H), F64)
    F = VertexFunction("seq", arity=1, message=(H,), dtype=F64)
    with F:
        xs, h = F.pull((4, H)), F.gather(0)

        def body(x, s):
            u = x @ Wx

            def inner(_, v):
                return [ops.sigmoid(v)], ops.tanh(v @ Wh + u)
            if unrolled:
                for _ in range(3):
                    s = inner(None, s)[1]
                return [], s
            return [], C.foreach(inner, None, s, length=3)[1]
        _, h = C.foreach(body, xs, h)
        F.scatter(h)
        F.push(h)
    st = Structure(F, pulls={"x": ops.input((None, 4, H), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def test_a_foreach_inside_a_foreach_is_a_loop_inside_a_loop_in_both_passes(cuda_standin):
    """Both passes on every runner, nested LOOPs (depths 0 and 1) in F and ∂F, equal to Python loops."""
    rng = np.random.default_rng(8)
    vals = {"Wh": rng.uniform(-0.5, 0.5, (H, H)), "Wx": rng.uniform(-0.5, 0.5, (H, H))}
    feeds = {"xs": rng.standard_normal((6, 4, H))}
    want = _run(_foreach_in_foreach(True), vals, feeds, "reference")
    model = _foreach_in_foreach(False)
    for runner, on_cuda, name in RUNNERS:
        got = _run(model, vals, feeds, runner, Cuda(cuda_standin) if on_cuda else None, check=True)
        _loops_on(got, name, "LOOP", "LOOP")
        for program in (next(iter(got.states.values())).program, next(iter(got.states.values())).backward_program):
            code = program.lowered.code
            depths = set(code[code[:, 0] == OPCODES_BY_ID.index("LOOP"), 3].tolist())
            assert depths == {0, 1}, (program.title, depths)
        _same(got, want, name)


@pytest.mark.parametrize("opcode, operand, value, name, backward", [
    ("LOOPN", 1, 0, "count", True), ("LOOPN", 1, -1, "most", True), ("LOOPN", 3, MAX_DEPTH, "depth", True),
    ("WHILE", 1, 10**4, "cond", False), ("WHILE", 0, 10**6, "n", False), ("WHILE", 0, -1, "n", False),
    ("LOOP", 2, -1, "depth", False), ("ENDLOOP", 2, MAX_DEPTH, "depth", False)])
def test_a_wrong_trip_count_condition_or_depth_is_refused_by_every_runners_checks(cuda_standin, opcode, operand,
                                                                                  value, name, backward):
    """A loop over fewer steps than its run-time count (``most`` 0: the count, 3, is refused, naming it), a
    negative most, a depth outside the counters, a condition register outside the file, a WHILE target outside
    the template: each loop refuses the instruction, naming the operand, before moving pc or reading."""
    vals, feeds = _values(3)
    model = _chain(None)
    _refused_by_every_runner(model, vals, feeds, cuda_standin, opcode, operand, value, name, backward)


def test_a_trip_count_that_is_not_one_int64_value_is_refused(cuda_standin):
    """LOOPN's count pointed at the static Wh (9 float values): refused by every loop, naming ``count``."""
    vals, feeds = _values(3)
    model = _chain(None)
    got = _run(model, vals, feeds, "device")
    lowered = got.states[next(iter(got.states))].backward_program.lowered
    wh = next(i for i, key in enumerate(lowered.keys) if key[0] == "static" and getattr(key[1], "name", "") == "Wh")
    for runner, device in [("reference", None), ("device", None), ("device", Cuda(cuda_standin))]:
        with pytest.raises(CheckError, match=r"\(LOOPN .*\): operand count"):
            _corrupted(model, vals, feeds, runner, device, "LOOPN", 0, wh, backward=True)


@pytest.mark.parametrize("steps", [0, 3, MOST])
def test_each_condition_is_one_read_per_test_and_each_trip_count_one_per_pass_on_the_device(cuda_standin, steps):
    """On the device the condition is a device value: the issuing loop reads it (one counted device-to-host
    read) each time WHILE tests it, in every task that runs the loop (F's task template: the loop saves what
    its gradient reads, so ∂F runs no replay of it, ops/loop_grad.py), and a run-time trip count once a pass
    (LOOPN's static, as a cond's pred); the reference runner over the device's arrays reads the same. Against F
    unrolled in Python: tests x F's tasks more, + 1 trip count, + the tests of the static replay giving ∂F its
    count (run in Python, outside the program: one read per test)."""
    vals, feeds = _values(steps)
    tests = min(steps + 1, MOST)   # (the last test reads 0, unless the loop ran its most)
    for device in (Cuda(cuda_standin), Cuda(cuda_standin, issue_from_c=False)):
        reads, issued = [], []
        for model in (_chain(steps), _chain(None)):
            _run(model, vals, feeds, "device", device)   # (compiled and warm: only the runs are counted)
            standin.reset()
            before = int(issue.stats(device)[issue.STATS.index("reads")])
            got = _run(model, vals, feeds, "device", device)
            reads.append(standin.crossings["d2h"])
            issued.append(int(issue.stats(device)[issue.STATS.index("reads")]) - before)
        program = next(iter(got.states.values())).program
        tasks = int((program.table[:, 0] < program.lowered.n_kinds).sum())   # (rows of the task template)
        assert reads[1] - reads[0] == tests * tasks + 1 + tests, (device.issue_from_c, reads, tasks)
        # (the issuing loop's own reads, counted apart: the conditions' alone)
        assert issued == [0, tests * tasks if device.issue_from_c else 0], (device.issue_from_c, issued)


def test_explain_shows_the_loops_and_branches_of_each_pass():
    """Per loop its pass, depth, trip count (a while_loop's most and the register WHILE tests; a run-time
    count with this batch's value) and body; per branch its pred and value."""
    from minicavs.engine.explain import explain
    vals, feeds = _values(3)
    text = str(explain(_chain(None, True), GRAPHS, feeds, vals))
    lines = [line.strip() for line in text.splitlines()]
    assert any(line.startswith("F kind 'v' task, instruction") and f"loop at depth 0: at most {MOST} steps, while r"
               in line and "is not 0 (WHILE at" in line for line in lines), text
    assert any(line.startswith("∂F kind 'v'") and f"loop at depth 0: 3 steps of at most {MOST}, the trip count read "
               "where it runs from static[" in line for line in lines), text
    assert any(line.startswith("F kind 'v' task") and "branch on static[" in line and "= 1.0: then" in line
               for line in lines), text


def _counted_foreach(ran: int | None) -> Model:
    """F runs an RNN over the vertex's pulled (5, H) sequence for ``n`` steps, ``n`` the count of a while_loop
    over values without the row axis (a computed one-value int64 static: the steps while a counter is below
    ``lim``), its per-step outputs stacked (zero past ``n``) and read; or ``ran`` steps unrolled in Python."""
    L = 5
    Wx, Wh, lim = ops.param_node("Wx", (H, H), F64), ops.param_node("Wh", (H, H), F64), ops.param_node("lim", (), F64)
    F = VertexFunction("seq", arity=1, message=(H,), dtype=F64)
    with F:
        xs, h = F.pull((L, H)), F.gather(0)

        def body(x, s):
            s2 = ops.tanh(x @ Wx + s @ Wh)
            return [s2 * 0.5], s2
        if ran is None:
            _, _, n = C.while_loop(lambda k: ops.step(lim - k), lambda k: ([], k + 1.0), ops.constant(0.0, F64), L)
            (ys,), h = C.foreach(body, xs, h, steps=n)
            ys = ops.reshape(ys, (L * H,))
        else:
            parts = []
            for t in range(ran):
                (y,), h = body(ops.reshape(ops.slice_(xs, t, t + 1, axis=0), (H,)), h)
                parts.append(y)
            ys = ops.concat(parts + [ops.reshape(ops.slice_(xs, 0, L - ran, axis=0), ((L - ran) * H,)) * 0.0],
                            axis=0) if ran < L else ops.concat(parts, axis=0)
        F.scatter(h)
        F.push(h + ys @ ops.constant(np.linspace(-1.0, 1.0, L * H * H).reshape(L * H, H)))
    st = Structure(F, pulls={"x": ops.input((None, L, H), F64, name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


@pytest.mark.parametrize("ran", [0, 1, 3, 5])
def test_a_foreach_over_a_computed_trip_count_is_a_loop_reading_it_where_it_runs(cuda_standin, ran):
    """steps= a one-value int64 static computed in F (a while_loop's count over values without the row axis):
    LOOPN in F and ∂F, every runner equal to the steps unrolled in Python (the outputs past them zero), and
    float64 finite differences."""
    from minicavs.train.testing import check_model_grads
    rng = np.random.default_rng(4)
    vals = {"Wx": rng.uniform(-0.5, 0.5, (H, H)), "Wh": rng.uniform(-0.5, 0.5, (H, H)), "lim": np.float64(ran - 0.5)}
    feeds = {"xs": rng.standard_normal((6, 5, H))}
    want = _run(_counted_foreach(ran), vals, feeds, "reference")
    model = _counted_foreach(None)
    for runner, on_cuda, name in RUNNERS:
        got = _run(model, vals, feeds, runner, Cuda(cuda_standin) if on_cuda else None, check=True)
        _loops_on(got, name, "LOOPN", "LOOPN")
        _same(got, want, name)
    check_model_grads(model, GRAPHS, feeds, vals, directions=1)


@pytest.mark.parametrize("opcode, operand, value, name", [
    ("LOOPR", 0, 1, "cond"), ("LOOPR", 3, 10**4, "cond"), ("LOOPR", 2, MAX_DEPTH, "depth"),
    ("STEPS", 0, 10**4, "dst"), ("STEPS", 1, -1, "depth")])
def test_a_wrong_count_in_a_loops_body_is_refused_by_every_runners_checks(cuda_standin, opcode, operand, value,
                                                                           name):
    """The nested while's ∂F: a loop over fewer steps than the count STEPS wrote (``most`` 1, the count 2:
    refused naming the register holding it), a count register or STEPS's destination that is not bound, a depth
    outside the counters: each loop refuses the instruction, naming the operand."""
    rng = np.random.default_rng(9)
    vals = {"Wh": rng.uniform(-0.5, 0.5, (H, H)), "Wx": rng.uniform(-0.5, 0.5, (H, H)), "lim": np.float64(1.5)}
    feeds = {"xs": rng.standard_normal((6, 4, H))}
    _refused_by_every_runner(_nested(None), vals, feeds, cuda_standin, opcode, operand, value, name, True)
