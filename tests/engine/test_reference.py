"""The reference runner (minicavs/engine/reference.py: one Python function per opcode) runs the lowered program the C
runner runs and computes the same numbers: every bundled model and random trees, chains and DAGs under the
engine switches, forward values, inference and all gradients (float64: DESIGN.md's "equal"; float32: 1e-5);
every opcode has a reference implementation of its operands; a wrong instruction raises instead of writing
outside its buffer."""
from __future__ import annotations

import inspect
import re
import threading
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.engine import instructions, reference
from minicavs.engine.lowered import OPCODES_BY_ID
from minicavs.engine.codegen.machine import OPCODES
from minicavs.engine.compile import PRE
from minicavs.cpu import CPU, c_runner
from minicavs.engine.program import BatchProgram
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.runtime.inputs import InputGraph
from minicavs.train.trainer import Trainer

from .. import cells
from ..models.test_models import MODELS, TINY
from ..ops.test_control import _cond_chain, _counted_chain, _sequence_chain
from .test_loops_while import _nested
from .test_static_branches import _cond_model, _values
from .test_static_loops import _lm, _values as _lm_values
from .test_alg1 import CASES, random_dag, random_tree
from .test_instructions import (DECLINED, STREAM_CASES, SWITCHES, _run_script, _typed,
                                assert_native_equals_reference, assert_streamed,
                                assert_streaming_equals_one_stream, close)

pytestmark = pytest.mark.skipif(c_runner.available(np.float64) is not None,
                                reason="no C compiler or BLAS: the C runner to compare with cannot run here")


def test_every_opcode_has_a_reference_implementation_of_its_operands():
    assert list(reference.OPERATIONS) == list(OPCODES)
    for name, operands in OPCODES.items():
        params = list(inspect.signature(reference.OPERATIONS[name]).parameters)[1:]
        assert len(params) == len(operands), (name, params, operands)
        assert reference.OPERATIONS[name].__doc__, name


def test_every_runner_implements_or_declines_every_opcode():
    """The C runner's switch and the CUDA issuing loop's have a case per opcode but those they decline (a program
    with one runs on the reference runner: APPLY, a step only Python runs), and fail any other (their default
    case); the reference runner, which runs on every device, has a function for each."""
    from minicavs.engine.codegen.issue_source import issue_source
    from minicavs.engine.codegen.machine import interpreter_source
    for source in (interpreter_source("double"), issue_source()):
        for name in OPCODES:
            assert (f"case {name}:" in source) != (list(OPCODES).index(name) == c_runner.APPLY), name
        assert "FAIL(-3);" in source[source.index("default:"):]
    assert len(reference.BY_ID) == len(OPCODES)
    for name, fn in zip(OPCODES, reference.BY_ID):
        assert fn is reference.OPERATIONS[name], name


class Opcodes:
    """Counts the opcodes the reference runner executes (to see that a test exercised them)."""

    def __init__(self, monkeypatch):
        self.seen: set = set()
        wrapped = []
        for name, fn in zip(OPCODES, reference.BY_ID):
            def counted(m, *operands, _fn=fn, _name=name):
                self.seen.add(_name)
                return _fn(m, *operands)
            wrapped.append(counted)
        monkeypatch.setattr(reference, "BY_ID", wrapped)


@pytest.mark.parametrize("name", sorted(TINY))
def test_bundled_models_reference_equals_native_under_every_switch(name, tmp_path, monkeypatch):
    seen = Opcodes(monkeypatch).seen
    for dtype, switches in (("float64", SWITCHES), ("float32", SWITCHES[:1] + SWITCHES[-1:])):
        t = Trainer(MODELS / f"{name.replace('_child_sum', '')}.yaml", TINY[name] + [f"train.dtype={dtype}"],
                    run_dir=tmp_path / dtype)
        samples = t.task.data["train"][:6]

        def run(options):
            t.model.options = options
            return t.loss_and_grads(samples)
        for options in switches:
            assert_native_equals_reference(run, options, dtype, DECLINED.get(name))
        # inference: forward only, the template of a pass that keeps nothing for backward
        graphs, feeds = t.task.batch(samples)
        passes = {}
        for runner in ("device", "reference"):
            t.model.options = EngineOptions(runner=runner)
            passes[runner] = t.model.infer(graphs, feeds, t.params, t.context(training=False))
        close(passes["device"].loss, passes["reference"].loss, dtype)
        for s in passes["device"].pushes:
            for push in passes["device"].pushes[s]:
                close(passes["device"].pushes[s][push], passes["reference"].pushes[s][push], dtype)
    if name not in DECLINED:
        assert {"BIND", "GEMM", "FUSED", "GACC"} <= seen, seen


def test_the_bundled_models_and_cases_exercise_every_opcode(tmp_path, monkeypatch):
    """Each opcode's reference function runs in some test above (NOP: only the dispatch benchmark's)."""
    seen = Opcodes(monkeypatch).seen
    rng = np.random.default_rng(2)
    for name, (build, make) in CASES.items():
        case = build(rng)
        for graphs in ([make(rng, 4) for _ in range(3)], [make(rng, 1)]):
            feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
            for options in SWITCHES[:1] + SWITCHES[-1:]:
                case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                            options=replace(options, runner="reference"))
    typed = cells.typed_child_sum_tree_lstm(rng)
    graphs = [_typed(rng, random_tree(rng, 9, 3)) for _ in range(3)]
    feeds = cells.batch_feeds(typed, graphs, [typed.data(rng, g) for g in graphs])
    typed.model.forward_backward(graphs, feeds, typed.params, RunContext(),
                                 options=EngineOptions(runner="reference"), policy="serial")
    t = Trainer(MODELS / "tree_lstm.yaml", with_dropout("tree_lstm") + ["train.dtype=float64"], run_dir=tmp_path)
    t.model.options = EngineOptions(runner="reference")
    t.loss_and_grads(t.task.data["train"][:6])
    t = Trainer(MODELS / "mv_rnn.yaml", TINY["mv_rnn"] + ["train.dtype=float64"], run_dir=tmp_path / "mv_rnn")
    t.model.options = EngineOptions(runner="reference")   # (per-row matrices: BMM, TRANSROWS)
    t.loss_and_grads(t.task.data["train"][:6])
    # (a cond in F: BRANCH, and the JUMP ending the then-branch it takes)
    _cond_chain(None).forward_backward([InputGraph.chain(3)], {"xs": rng.standard_normal((3, 2))},
                                       {"Wx": rng.standard_normal((2, 4)), "s": np.float64(1.0)}, RunContext(),
                                       options=EngineOptions(runner="reference"))
    # (a foreach in F: LOOP, the ENDLOOP ending its body, STEPCOLS for its step blocks)
    loop, vals, steps = _sequence_chain(False)
    loop.forward_backward([InputGraph.chain(2)], {"xs": rng.standard_normal((2, steps, 2))}, vals, RunContext(),
                          options=EngineOptions(runner="reference"))
    # (a while_loop in F: WHILE; ∂F's loop over the steps it ran: LOOPN)
    _counted_chain(2.5).forward_backward([InputGraph.chain(2)], {"xs": rng.standard_normal((2, 3))},
                                         {"Wh": rng.uniform(-0.5, 0.5, (3, 3)), "lim": np.float64(2.5)},
                                         RunContext(), options=EngineOptions(runner="reference"))
    # (a while_loop inside a foreach: in ∂F its count of steps run written (STEPS) and read by a loop (LOOPR))
    _nested(None).forward_backward([InputGraph.chain(2)], {"xs": rng.standard_normal((2, 4, 3))},
                                   {"Wh": rng.uniform(-0.5, 0.5, (3, 3)), "Wx": rng.uniform(-0.5, 0.5, (3, 3)),
                                    "lim": np.float64(1.5)}, RunContext(), options=EngineOptions(runner="reference"))
    # (a static graph's cond on a pred its program computes: IF)
    cond, (params, feeds) = _cond_model("computed"), _values(1.0)
    cond.forward_backward({}, feeds, params, RunContext(), options=EngineOptions(runner="reference"))
    # (a static graph's foreach with a trip count per row: its parameters' gradients summed in its reverse loop,
    # a product adding into its sum (GEMM's bias -2), a column sum by ADD; FLAT: the foreach in F's above)
    params, feeds = _lm_values([2, 0, 1, 1])
    _lm(per_row=True).forward_backward({}, feeds, params, RunContext(), options=EngineOptions(runner="reference"))
    # (NOP: the dispatch benchmark's; APPLY, which no bundled model needs: test_instructions' softmax in F)
    assert set(OPCODES) - seen == {"NOP", "APPLY"}, sorted(set(OPCODES) - seen)


def _hand_written(code: list, nregs: int) -> instructions.Lowered:
    """A one-kind program of ``code`` ((opcode, operands...) rows) over buffers 0 (A), 1 (B), 2 (scratch)."""
    rows = np.zeros((len(code), instructions.WIDTH), np.int64)
    for i, (op, *operands) in enumerate(code):
        rows[i, :1 + len(operands)] = [instructions.OPCODE[op]] + operands
    ranges = np.array([[0, len(code)], [0, 0], [0, 0]], np.int64)
    return instructions.Lowered("hand", [0], [instructions.Template("k")], rows, np.zeros(1, np.int64), ranges,
                                [("tensor", "A", 0), ("tensor", "B", 0), ("scratch",)], np.zeros(1, np.int64),
                                nregs, 4)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_hand_written_programs_give_the_same_buffers_on_both_runners(dtype):
    """ADD, ZERO, COPY, SUMROWS, TRANSPOSE and a product by a transposed register, in a program written by
    hand over two 3 x 4 buffers (rows 1:3 of the task: kind offset 1): both runners leave the buffers numpy
    says they should hold."""
    rng = np.random.default_rng(0)
    a0, b0 = rng.standard_normal((4, 4)).astype(dtype), rng.standard_normal((4, 4)).astype(dtype)
    program = _hand_written([
        ("BIND", 0, 0, 1, 0, 4), ("BIND", 1, 1, 1, 0, 4),   # r0 = A[1:], r1 = B[1:]
        ("ADD", 0, 1, -1, 4),                               # A[1:] += B[1:]
        ("COLS", 2, 1, 2), ("ZERO", 2, -1, 2),              # B[1:, 2:] = 0
        ("BIND", 3, 0, 0, 0, 4), ("SUMROWS", 3, 1, -1, 4),   # A[0] = the sum of B[1:]
        ("TRANSPOSE", 4, 1), ("SCRATCH", 5, 0, 3),           # r4 = B[1:]ᵀ (4 x 3)
        ("GEMM", 5, 0, 4, -1, 3, 4, -1),                    # scratch (3 x 3) = A[1:] · B[1:]ᵀ
        ("COLS", 6, 1, 1), ("COPY", 6, 5, -1, 3),           # B[1:, 1:] = that product
    ], nregs=7)
    a, b = a0.copy(), b0.copy()
    a[1:] += b[1:]
    b[1:, 2:] = 0
    a[0] = b[1:].sum(axis=0)
    b[1:, 1:] = a[1:] @ b[1:].T
    table = np.array([[0, 1, 3, 0, -1]], np.int64)
    for run in (c_runner.run, reference.run):
        buffers = Arenas({("tensor", "A", 0): a0.copy(), ("tensor", "B", 0): b0.copy()}, dtype)
        run(BatchProgram.of(program, table, buffers, dtype, CPU))
        tol = (1e-12 if dtype == np.float64 else 1e-5) * max(1.0, np.abs(b).max())
        np.testing.assert_allclose(buffers[("tensor", "A", 0)], a, rtol=0, atol=tol, err_msg=run.__module__)
        np.testing.assert_allclose(buffers[("tensor", "B", 0)], b, rtol=0, atol=tol, err_msg=run.__module__)


class Arenas(dict):
    """A hand-written program's buffers: its own, and fresh arenas."""

    def __init__(self, buffers: dict, dtype):
        super().__init__(buffers)
        self.dtype = dtype

    def __missing__(self, key):
        assert key[0] == "arena", key
        return np.zeros(max(1, key[2]), self.dtype)


def with_dropout(name: str, p: float = 0.4) -> list:
    """The model's tiny overrides with dropout ``p`` instead of 0."""
    return [o for o in TINY[name] if not o.startswith("model.dropout")] + [f"model.dropout={p}"]


@pytest.mark.parametrize("name", sorted(n for n in TINY if "model.dropout=0.0" in TINY[n] and n not in DECLINED))
def test_dropout_reference_equals_native(name, tmp_path):
    """Bundled models with dropout on: both runners run DROPOUT with the same masks (training; their losses
    differ from inference's, so the masks did something)."""
    for dtype in ("float64", "float32"):
        t = Trainer(MODELS / f"{name.replace('_child_sum', '')}.yaml", with_dropout(name) + [f"train.dtype={dtype}"],
                    run_dir=tmp_path / dtype)
        samples = t.task.data["train"][:6]

        def run(options):
            t.model.options = options
            return t.loss_and_grads(samples)
        for options in SWITCHES[:1] + SWITCHES[-1:]:
            assert_native_equals_reference(run, options, dtype)
        t.model.options = EngineOptions(runner="reference")
        graphs, feeds = t.task.batch(samples)
        inferred = t.model.infer(graphs, feeds, t.params, t.context(training=False))
        assert abs(float(inferred.loss) - float(run(EngineOptions(runner="reference")).loss)) > 1e-6


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5), size=st.integers(1, 6), switch=st.integers(0, 15))
def test_random_graphs_reference_equals_native(name, seed, k, size, switch):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(seed)
    case = build(rng)
    graphs = [make_graph(rng, int(rng.integers(1, size + 1))) for _ in range(k)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    assert_native_equals_reference(run, SWITCHES[switch], "float64")


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 4), size=st.integers(1, 8), switch=st.integers(0, 15),
       dag=st.booleans(), serial=st.booleans())
def test_interleaved_kinds_reference_equals_native(seed, k, size, switch, dag, serial):
    """Kinds whose scatter rows interleave (the blocks move them by the kinds' row indices: SROWS, SPUT)."""
    rng = np.random.default_rng(seed)
    case = cells.typed_child_sum_tree_lstm(rng)
    shape = (lambda n: random_dag(rng, n, 3)) if dag else (lambda n: random_tree(rng, n, 3))
    graphs = [_typed(rng, shape(2 * int(rng.integers(1, size + 1)))) for _ in range(k)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options,
                                           policy="serial" if serial else None)
    assert_native_equals_reference(run, SWITCHES[switch], "float64")


@pytest.mark.parametrize("opcode, field", [("GEMM", 4), ("BIND", 4), ("FUSED", 3)])
def test_an_instruction_reaching_outside_its_buffer_raises(opcode, field):
    """The reference runner checks every view it makes against its buffer: an instruction given a dimension
    or column far outside raises CheckError naming the pass, task and instruction."""
    rng = np.random.default_rng(4)
    case = cells.binary_tree_lstm(rng)
    graphs = [CASES["binary_tree_lstm"][1](rng, n) for n in (3, 4)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    options = EngineOptions(runner="reference")
    state = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options).states["G"]
    lowered = state.program.lowered
    pc = next(pc for pc, row in enumerate(lowered.code.tolist()) if OPCODES_BY_ID[row[0]] == opcode)
    original = int(lowered.code[pc][field])
    lowered.code[pc][field] = 10**9
    try:
        with pytest.raises(reference.CheckError, match=rf"reference F: task \d+, instruction {pc} \({opcode} "):
            case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    finally:
        lowered.code[pc][field] = original


@pytest.mark.parametrize("opcode, field", [("BMM", 4), ("BMM", 6), ("TRANSROWS", 3)])
def test_a_per_row_product_reaching_outside_its_buffer_raises(opcode, field):
    """Per-row matrices (cells.per_row_matrices): a BMM or TRANSROWS given a dimension far outside its operands
    raises CheckError naming the instruction, in the reference runner and in the C runner's check mode (run
    in a child process: without the check, such an instruction would write outside its buffer)."""
    rng = np.random.default_rng(4)
    case = cells.per_row_matrices(rng, 3)
    graphs = [InputGraph.chain(n) for n in (3, 4)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    options = EngineOptions(runner="reference")
    lowered = case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                          options=options).states["G"].program.lowered
    pc = next(pc for pc, row in enumerate(lowered.code.tolist()) if OPCODES_BY_ID[row[0]] == opcode)
    original = int(lowered.code[pc][field])
    lowered.code[pc][field] = 10**6
    try:
        with pytest.raises(reference.CheckError, match=rf"reference F: task \d+, instruction {pc} \({opcode} "):
            case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    finally:
        lowered.code[pc][field] = original
    result = _run_script(f"""
        import numpy as np
        from minicavs.engine import instructions
        from minicavs.cpu import c_runner
        from minicavs.engine.compile import EngineOptions
        from minicavs.engine.executor import RunContext
        from minicavs.runtime.inputs import InputGraph
        from tests import cells
        rng = np.random.default_rng(4)
        case = cells.per_row_matrices(rng, 3)
        graphs = [InputGraph.chain(n) for n in (3, 4)]
        feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
        case.model.options = EngineOptions(runner="device", check=True)
        code = case.model.forward_backward(graphs, feeds, case.params, RunContext()).states["G"].program.lowered.code
        code[{pc}][{field}] = 10**6
        try:
            case.model.forward_backward(graphs, feeds, case.params, RunContext())
        except c_runner.CRunnerCheckError as e:
            print("caught:", e)
        """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(rf"caught: C runner F: task \d+, instruction {pc} \({opcode} .*\): operand \w+ is out of "
                     "bounds", result.stdout), result.stdout


def test_a_gathered_row_number_out_of_range_raises_in_check_mode(monkeypatch):
    """With the debug mode on, an index array's values are checked too (a gather past the scatter tensor)."""
    rng = np.random.default_rng(4)
    case = cells.child_sum_tree_lstm(rng)
    graphs = [CASES["child_sum"][1](rng, 4) for _ in range(2)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    real = reference.Machine.index

    def shifted(m, buf, host=False):
        idx = real(m, buf, host)
        return idx + 10**6 if m.lowered.keys[buf][0] == "child" else idx
    monkeypatch.setattr(reference.Machine, "index", shifted)
    with pytest.raises(reference.CheckError, match="row index out of range"):
        case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                    options=EngineOptions(runner="reference", gather_elision=False, check=True))


def _program(code: list, keys: list, nregs: int) -> instructions.Lowered:
    """A one-kind program of ``code`` ((opcode, operands...) rows) over the buffers ``keys`` (scratch last)."""
    rows = np.zeros((len(code), instructions.WIDTH), np.int64)
    for i, (op, *operands) in enumerate(code):
        rows[i, :1 + len(operands)] = [instructions.OPCODE[op]] + operands
    ranges = np.array([[0, len(code)], [0, 0], [0, 0]], np.int64)
    return instructions.Lowered("hand", [0], [instructions.Template("k")], rows, np.zeros(1, np.int64), ranges,
                                keys + [("scratch",)], np.zeros(1, np.int64), nregs, 1)


def _on_every_runner(program, table, buffers: dict, dtype) -> list:
    """The buffers after ``program`` ran over ``table`` on the C runner (with and without its check mode) and
    on the reference runner: one dict of copies per run."""
    out = []
    for run, check in ((c_runner.run, False), (c_runner.run, True), (reference.run, False)):
        copies = Arenas({key: a.copy() for key, a in buffers.items()}, dtype)
        run(BatchProgram.of(program, table, copies, dtype, CPU, check=check))
        out.append(dict(copies))
    return out


def _operand(rng, per_row: bool, transposed: bool, rows: int, cols: int, task_row: int, bs: int, dtype,
             left: int, right: int) -> tuple:
    """A BMM operand of rows x cols, with padding around it: per row (each task row's matrix its flat row, at a
    column offset of a wider row), or one static matrix (stored transposed: read through the flag). Returns
    (buffer, its row stride, its first column, the task's matrices as (bs, rows, cols))."""
    if per_row:
        ld = max(1, left + rows * cols + right)   # (a column at least: k = 0 has no numbers)
        buf = rng.standard_normal((task_row + bs + 1, ld)).astype(dtype)
        mats = buf[task_row:task_row + bs, left:left + rows * cols].reshape(bs, rows, cols)
        return buf, ld, left, mats
    stored = (cols, rows) if transposed else (rows, cols)
    ld = max(1, left + stored[1] + right)
    buf = rng.standard_normal((stored[0] + 1, ld)).astype(dtype)   # (a row more: a k = 0 static has none)
    mat = buf[:stored[0], left:left + stored[1]]
    return buf, ld, left, np.broadcast_to((mat.T if transposed else mat)[None], (bs, rows, cols))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bs=st.integers(0, 5), task_row=st.integers(0, 2),
       dims=st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(0, 20)) | st.tuples(
           st.integers(1, 4), st.integers(1, 4), st.integers(0, 4)),
       a_rows=st.booleans(), b_rows=st.booleans(), a_trans=st.booleans(), b_trans=st.booleans(),
       pads=st.tuples(*[st.integers(0, 2)] * 5))
def test_bmm_is_a_product_per_row_on_both_runners(dtype, seed, bs, task_row, dims, a_rows, b_rows, a_trans, b_trans,
                                                  pads):
    """BMM over random shapes (products small enough for the C runner's loop and large enough for its BLAS
    calls, k = 0 included) and operand kinds (each one matrix per row at a column offset of a wider row, or a
    static, stored transposed or not), into rows of a wider result: the C runner (check mode on and off) and
    the reference runner write what numpy's matmul of the operands says, and nothing else."""
    m, n, k = dims
    rng = np.random.default_rng(seed)
    a, lda, cola, want_a = _operand(rng, a_rows, a_trans, m, k, task_row, bs, dtype, *pads[:2])
    b, ldb, colb, want_b = _operand(rng, b_rows, b_trans, k, n, task_row, bs, dtype, *pads[2:4])
    ldc = m * n + pads[4]
    c0 = rng.standard_normal((task_row + bs + 1, ldc)).astype(dtype)
    code = []
    for r, (per_row, trans, ld, col) in enumerate(((a_rows, a_trans, lda, cola), (b_rows, b_trans, ldb, colb))):
        code.append(("BIND", r, r, 1 if per_row else 0, col, ld))
        if not per_row and trans:
            code.append(("TRANSPOSE", r, r))
    code += [("BIND", 2, 2, 1, 0, ldc), ("BMM", 2, 0, 1, m, n, k, int(a_rows), int(b_rows))]
    keys = [("tensor", "A", 0), ("tensor", "B", 0), ("tensor", "C", 0)]
    program = _program(code, keys, nregs=3)
    table = np.array([[0, task_row, bs, 0, -1]], np.int64)
    want = c0.copy()
    product = np.matmul(want_a.astype(np.float64), want_b.astype(np.float64))
    want[task_row:task_row + bs, :m * n] = product.reshape(bs, m * n)
    tol = (1e-10 if dtype == np.float64 else 1e-5) * max(1.0, np.abs(want).max())
    for got in _on_every_runner(program, table, dict(zip(keys, (a, b, c0))), dtype):
        np.testing.assert_allclose(got[keys[2]], want, rtol=0, atol=tol)
        assert np.array_equal(got[keys[0]], a) and np.array_equal(got[keys[1]], b)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bs=st.integers(0, 5), task_row=st.integers(0, 2), m=st.integers(1, 6),
       n=st.integers(1, 6), pad=st.integers(0, 2))
def test_transrows_transposes_each_rows_matrix_on_both_runners(dtype, seed, bs, task_row, m, n, pad):
    """TRANSROWS: each task row's m x n matrix (its flat row, at a column offset) written transposed as the
    destination's flat row; the rows outside the task stay as they were."""
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((task_row + bs + 1, pad + m * n)).astype(dtype)
    dst0 = rng.standard_normal((task_row + bs + 1, m * n + pad)).astype(dtype)
    keys = [("tensor", "A", 0), ("tensor", "B", 0)]
    program = _program([("BIND", 0, 0, 1, pad, pad + m * n), ("BIND", 1, 1, 1, 0, m * n + pad),
                        ("TRANSROWS", 1, 0, m, n)], keys, nregs=2)
    want = dst0.copy()
    rows = src[task_row:task_row + bs, pad:].reshape(bs, m, n)
    want[task_row:task_row + bs, :m * n] = rows.transpose(0, 2, 1).reshape(bs, m * n)
    for got in _on_every_runner(program, np.array([[0, task_row, bs, 0, -1]], np.int64), dict(zip(keys, (src, dst0))),
                                dtype):
        assert np.array_equal(got[keys[1]], want) and np.array_equal(got[keys[0]], src)


# --- streaming: the reference runner's eager stream is a Python thread --------------------------------------

@pytest.mark.parametrize("name", sorted(TINY))
def test_bundled_models_reference_streaming_equals_one_stream(name, tmp_path):
    t = Trainer(MODELS / f"{name.replace('_child_sum', '')}.yaml", TINY[name] + ["train.dtype=float64"],
                run_dir=tmp_path)
    samples = t.task.data["train"][:6]

    def run(options):
        t.model.options = options
        return t.loss_and_grads(samples)
    for options in SWITCHES[::5]:
        assert_streaming_equals_one_stream(run, replace(options, runner="reference"), "float64")


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 4), size=st.integers(1, 7), switch=st.integers(0, 15))
def test_random_graphs_reference_streaming_equals_one_stream(name, seed, k, size, switch):
    build, make_graph = STREAM_CASES[name]
    rng = np.random.default_rng(seed)
    case = build(rng)
    graphs = [make_graph(rng, int(rng.integers(1, size + 1))) for _ in range(k)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    assert_streaming_equals_one_stream(run, replace(SWITCHES[switch], runner="reference"), "float64")


def test_reference_eager_chunks_run_on_their_thread_before_their_tasks(monkeypatch):
    """Every instruction of the eager table runs on the eager machine, on a thread other than the caller's;
    every main-table row t runs after the last instruction of eager chunk t (rows past the chunks after all)."""
    log, lock = [], threading.Lock()
    wrapped = []
    for fn in reference.BY_ID:
        def logged(m, *operands, _fn=fn):
            with lock:
                log.append((m.stream, m.task_index, threading.get_ident(), id(m.lowered)))
            return _fn(m, *operands)
        wrapped.append(logged)
    monkeypatch.setattr(reference, "BY_ID", wrapped)
    rng = np.random.default_rng(5)
    case = cells.pushed_outputs(rng)
    graphs = [random_tree(rng, 7, 2, True) for _ in range(3)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    result = case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                         options=EngineOptions(runner="reference", streaming=True))
    assert_streamed(result)
    me = threading.get_ident()
    for program in (result.states["G"].program, result.states["G"].backward_program):
        mine = [entry for entry in log if entry[3] == id(program.lowered)]
        eager = [(i, t) for i, (stream, t, thread, _) in enumerate(mine) if stream == "eager"]
        main = [(i, t) for i, (stream, t, thread, _) in enumerate(mine) if stream == "main"]
        assert eager and main
        assert {thread for stream, _, thread, _ in mine if stream == "eager"} - {me}
        assert {thread for stream, _, thread, _ in mine if stream == "main"} == {me}
        chunks = len(program.eager)
        last_of_chunk = {t: i for i, t in eager}
        first_of_row = {}
        for i, t in main:
            first_of_row.setdefault(t, i)
        for t, i in first_of_row.items():
            done = [last_of_chunk[c] for c in range(min(t + 1, chunks)) if c in last_of_chunk]
            assert all(j < i for j in done), (program.title, t)


def test_a_failing_eager_chunk_raises_in_the_caller():
    """An eager instruction reaching outside its buffer: the reference runner's CheckError, naming the eager
    stream, reaches the caller (the main stream stops at its wait; nothing hangs)."""
    rng = np.random.default_rng(4)
    case = cells.pushed_outputs(rng)
    graphs = [random_tree(rng, 5, 2, True) for _ in range(2)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    options = EngineOptions(runner="reference", streaming=True)
    lowered = case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                          options=options).states["G"].program.lowered
    block = next(b for b in lowered.blocks if b.phase == PRE)
    begin, end = lowered.ranges[block.tid]
    pc = next(pc for pc in range(begin, end) if OPCODES_BY_ID[lowered.code[pc][0]] == "GEMM")
    original = int(lowered.code[pc][4])
    lowered.code[pc][4] = 10**9
    try:
        with pytest.raises(reference.CheckError, match=rf"reference F: eager stream task \d+, instruction {pc} "):
            case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    finally:
        lowered.code[pc][4] = original
