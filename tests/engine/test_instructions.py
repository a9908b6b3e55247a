"""The C runner (instructions.py's lowered program over codegen/machine.py's interpreter) against the reference
runner (tests/engine/test_reference.py compares the two on every bundled model, random graphs and every engine
switch): one-sample batches, blocks moving rows by index, dropout, streaming, inference; a step no opcode
expresses (APPLY) leaves its pass to the reference runner; the Python work of a native step does not grow
with the number of tasks; a corrupted instruction is caught by the debug mode, not by a crash; without a
compiler the reference runner trains, with one warning."""
from __future__ import annotations

import collections
import gc
import itertools
import os
import re
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.engine import instructions, static_program
from minicavs.engine.lowered import OPCODES_BY_ID, PHASE_WORDS
from minicavs.engine.compile import PRE
from minicavs.cpu import CPU, c_runner
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.runtime.inputs import InputGraph
from minicavs.train.trainer import Trainer

from .. import cells
from ..models.test_models import MODELS, TINY
from .test_alg1 import CASES, dense, equal, random_dag, random_tree

pytestmark = pytest.mark.skipif(c_runner.available(np.float64) is not None,
                                reason="no C compiler or BLAS: the C runner cannot run here")

REPO = Path(__file__).resolve().parents[2]
SWITCHES = [EngineOptions(lazy_batching=lazy, eager_batching=eager, fusion=fusion, gather_elision=elision)
            for lazy, eager, fusion, elision in itertools.product((True, False), repeat=4)]


def close(a, b, dtype):
    a, b = np.asarray(dense(a), np.float64), np.asarray(dense(b), np.float64)
    if dtype == "float64":
        equal(a, b)
    else:
        assert a.shape == b.shape and np.max(np.abs(a - b), initial=0) <= 1e-5 * max(1.0, np.max(np.abs(a))), \
            np.max(np.abs(a - b))


# Bundled models the C runner declines, and why (the reference runner on the CPU runs them, same numbers):
# none today (MV-RNN's per-vertex matrices, values of three axes, lower as flat rows: BMM, TRANSROWS).
DECLINED: dict = {}


def assert_native_equals_reference(run, options, dtype, declined: str | None = None) -> None:
    """``run(options)`` -> Result; the C runner must have run both passes, the blocks before and after the
    task loop in the same call (kinds whose scatter rows are no one block of rows, 2Type's and the lattice's,
    included: SROWS and SPUT move them by index), or, for a model in DECLINED, said why it declined; the
    numbers equal the reference runner's."""
    reference = run(replace(options, runner="reference"))
    native = run(replace(options, runner="device"))
    for state in native.states.values():
        for program in (state.program, state.backward_program):
            if declined is None:
                assert program.runner == "C runner" and program.declined is None, program.declined
                assert len(program.table) > len(program.task_table) or not program.lowered.blocks
            else:
                assert program.runner == "reference runner" and declined in program.declined
    results_equal(reference, native, dtype)


def results_equal(want, got, dtype) -> None:
    """Two runs of one batch agree: loss, every push buffer, every gradient (DESIGN.md's tolerance)."""
    close(want.loss, got.loss, dtype)
    for s in want.pushes:
        for name in want.pushes[s]:
            close(want.pushes[s][name], got.pushes[s][name], dtype)
    assert set(want.grads) == set(got.grads)
    for k in want.grads:
        close(want.grads[k], got.grads[k], dtype)


@pytest.mark.parametrize("name", sorted(TINY))
def test_one_sample_batches_native_equals_reference(name, tmp_path):
    """A batch of one sample: tasks of one row, whose products the C runner runs as gemv (numpy's matmul does
    the same; OpenBLAS's gemm at m = 1 is several times slower)."""
    for dtype in ("float64", "float32"):
        extra = ["model.variant=child_sum"] if "child_sum" in name else []
        t = Trainer(MODELS / f"{name.replace('_child_sum', '')}.yaml", TINY[name] + extra + [f"train.dtype={dtype}"],
                    run_dir=tmp_path / dtype)
        for sample in t.task.data["train"][:2]:
            def run(options):
                t.model.options = options
                return t.loss_and_grads([sample])
            for options in (SWITCHES[0], SWITCHES[-1]):
                assert_native_equals_reference(run, options, dtype, DECLINED.get(name))


def _typed(rng, graph: InputGraph) -> InputGraph:
    """``graph`` with a random kind, t0 or t1, per vertex (cells.typed_child_sum_tree_lstm's)."""
    return InputGraph([graph.children(v).tolist() for v in range(graph.num_vertices)],
                      [f"t{k}" for k in rng.integers(0, 2, graph.num_vertices).tolist()])


def _moved_by_index(result) -> set:
    """What the native blocks of ``result``'s passes moved by the kind's row index, its scatter rows being no
    one block of rows (task-table scatter offset -1): 'in' (SROWS copied rows in), 'out' (SPUT put rows)."""
    moved = set()
    for state in result.states.values():
        for program in (state.program, state.backward_program):
            lowered = program.lowered
            split = {row[0] for row in program.table.tolist() if row[3] == -1}
            for b in lowered.blocks:
                if b.tid in split and b.scatter_rows:
                    ops = [(OPCODES_BY_ID[row[0]], row[8]) for row in lowered.code[slice(*lowered.ranges[b.tid])]]
                    moved |= {"in" for op, load in ops if op == "SROWS" and load} | {"out" for op, _ in ops if op == "SPUT"}
    return moved


def test_blocks_move_interleaved_rows_by_index_with_the_bounds_checks_on(monkeypatch):
    """Both directions of the row moves by index, checked: the typed child-sum's lazy push reads each kind's
    h back from its interleaved scatter rows (SROWS); one vertex per task (the serial schedule) interleaves the
    Tree-LSTM's leaves with internal vertices, so the leaves' eager block computes [h; c] into scratch and
    puts it into their rows (SPUT). The same numbers as the reference runner."""
    rng = np.random.default_rng(7)
    typed = cells.typed_child_sum_tree_lstm(rng)
    typed_graphs = [_typed(rng, random_tree(rng, 9, 3)) for _ in range(3)]
    tree = cells.binary_tree_lstm(rng)
    trees = [CASES["binary_tree_lstm"][1](rng, n) for n in (3, 5)]
    for case, graphs, policy, moved in ((typed, typed_graphs, None, {"in"}), (tree, trees, "serial", {"in", "out"})):
        feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

        def run(options):
            return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options,
                                               policy=policy)
        assert_native_equals_reference(run, EngineOptions(check=True), "float64")
        assert moved <= _moved_by_index(run(EngineOptions(runner="device", check=True)))


def _interleaved(name: str):
    """(case, graphs, policy) whose blocks move rows by index: 'typed' reads them in (SROWS), 'serial' also
    puts them (SPUT)."""
    rng = np.random.default_rng(7)
    if name == "typed":
        return cells.typed_child_sum_tree_lstm(rng), [_typed(rng, random_tree(rng, 9, 3)) for _ in range(3)], None
    return cells.binary_tree_lstm(rng), [CASES["binary_tree_lstm"][1](rng, n) for n in (3, 5)], "serial"


def _split_block_instruction(program, opcode: str) -> int:
    """The index of the first ``opcode`` instruction of a block that this batch runs over rows by index."""
    lowered = program.lowered
    split = {row[0] for row in program.table.tolist() if row[3] == -1}
    return next(pc for b in lowered.blocks if b.tid in split for pc in range(*lowered.ranges[b.tid])
                if OPCODES_BY_ID[lowered.code[pc][0]] == opcode)


def _shifted(row) -> None:
    """SPUT's columns one to the right (one fewer): a column short alone would leave the last run's values."""
    row[2] += 1
    row[6] -= 1


@pytest.mark.parametrize("name, backward, opcode, field, change", [
    ("typed", False, "SROWS", 5, "child"),           # the lazy push's h read by the children's rows instead
    ("typed", False, "SROWS", 6, lambda v: v - 1),   # h one column short
    ("serial", False, "SPUT", None, _shifted),       # the leaves' [h; c] put one column off
    ("serial", True, "SROWS", 3, lambda v: v + 1),   # ∂F's leaves read their cotangents one column off
])
def test_a_wrong_row_move_by_index_makes_native_differ_from_reference(name, backward, opcode, field, change):
    """The row moves by index compute what the blocks read and write: one perturbed SROWS or SPUT (a wrong
    row index array, a column short or off) and the equality with the reference runner's numbers fails."""
    case, graphs, policy = _interleaved(name)
    feeds = cells.batch_feeds(case, graphs, [case.data(np.random.default_rng(1), g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options, policy=policy)
    reference = EngineOptions(runner="reference")
    assert_native_equals_reference(run, reference, "float64")
    want = run(reference)   # (before the change: both runners run the one program the change is made to)
    state = next(iter(run(EngineOptions(runner="device")).states.values()))
    program = state.backward_program if backward else state.program
    pc = _split_block_instruction(program, opcode)
    code, lowered = program.lowered.code, program.lowered
    if change == "child":   # (the same kind's first child index: as many rows, each a valid row)
        key = lowered.keys[code[pc][field]]
        code[pc][field] = lowered.keys.index(("child", 0, key[-1]))
    elif field is None:
        change(code[pc])
    else:
        code[pc][field] = change(int(code[pc][field]))
    with pytest.raises(AssertionError):
        results_equal(want, run(EngineOptions(runner="device")), "float64")


def test_a_bad_row_index_of_a_block_is_caught_by_the_debug_mode():
    """A kind's row index with a row far outside the scatter tensor: the debug mode's bounds checks catch it
    in SROWS (rows read in) and in SPUT (rows put), instead of a crash."""
    result = _run_script("""
        import numpy as np
        from minicavs.engine import instructions
        from minicavs.cpu import c_runner
        from minicavs.engine.compile import EngineOptions
        from minicavs.engine.executor import RunContext
        from minicavs.runtime.memory import MemoryPlan
        from tests import cells
        from tests.engine.test_instructions import _interleaved
        real = MemoryPlan.scatter_rows
        for name in ("typed", "serial"):
            case, graphs, policy = _interleaved(name)
            feeds = cells.batch_feeds(case, graphs, [case.data(np.random.default_rng(1), g) for g in graphs])
            MemoryPlan.scatter_rows = real
            case.model.forward_backward(graphs, feeds, case.params, RunContext(), policy=policy,
                                        options=EngineOptions(check=True))
            MemoryPlan.scatter_rows = lambda plan, kind_id: np.append(real(plan, kind_id)[:-1], 10**9)
            try:
                case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                            options=EngineOptions(runner="device", check=True), policy=policy)
                print("not caught", name)
            except c_runner.CRunnerCheckError as e:
                print("caught:", e)
        """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"caught: C runner F: task \d+, instruction \d+ \(SROWS dst=r\d+\(.*\) buf=scatter.*\): "
                     r"operand idx is out of bounds", result.stdout), result.stdout
    assert re.search(r"caught: C runner F: task \d+, instruction \d+ \(SPUT buf=scatter.*\): "
                     r"operand idx is out of bounds", result.stdout), result.stdout


# --- streaming: the blocks before the task loop as the eager stream's chunks, one per task -----------------

def assert_streamed(result) -> None:
    """Each pass of ``result`` ran its blocks before the task loop as the eager stream's table (one chunk per
    task, program.eager_rows) beside a main table of the tasks and the blocks after them, and its dump says
    so."""
    for state in result.states.values():
        for program in (state.program, state.backward_program):
            assert program.eager is not None, program.eager_why
            assert len(program.eager) == len(program.task_table)
            n_kinds = len(program.lowered.ranges) // 3
            assert program.table[:, 0].min() >= 0 and not (
                (program.table[:, 0] >= n_kinds) & (program.table[:, 0] < 2 * n_kinds)).any()
            dump = program.dump()
            assert f"eager stream ({program.runner}): chunks 0:{len(program.task_table)}" in dump
            assert f"main stream ({program.runner}): tasks 0:{len(program.task_table)}, task t after eager " \
                   "chunk t" in dump


def assert_streaming_equals_one_stream(run, options, dtype) -> None:
    """``run(options)`` -> Result: streaming, the runner of ``options.runner`` ran each pass on two streams
    and computed the numbers it computes on one."""
    one = run(replace(options, streaming=False))
    two = run(replace(options, streaming=True))
    assert_streamed(two)
    results_equal(one, two, dtype)


@pytest.mark.parametrize("name", sorted(TINY))
def test_bundled_models_streaming_equals_one_stream(name, tmp_path):
    """The C runner, streaming: its eager call on the worker thread, the main call waiting chunk by chunk."""
    extra = ["model.variant=child_sum"] if "child_sum" in name else []
    t = Trainer(MODELS / f"{name.replace('_child_sum', '')}.yaml", TINY[name] + extra + ["train.dtype=float64"],
                run_dir=tmp_path)
    samples = t.task.data["train"][:6]

    def run(options):
        t.model.options = options
        return t.loss_and_grads(samples)
    for options in SWITCHES[::5]:
        assert_streaming_equals_one_stream(run, options, "float64")


def binary_dag(rng, n: int) -> InputGraph:
    """A DAG of leaves and two-child vertices (each child an earlier vertex: several parents share some)."""
    children = [[] for _ in range(n)]
    for v in range(2, n):
        if rng.random() < 0.6:
            children[v] = [int(c) for c in rng.choice(v, size=2, replace=False)]
    return InputGraph(children)


STREAM_CASES = dict(CASES, pushed_outputs=(cells.pushed_outputs, lambda rng, n: random_tree(rng, n, 2, True)),
                    pushed_outputs_dag=(cells.pushed_outputs, binary_dag),
                    unshared_outputs=(lambda rng: cells.pushed_outputs(rng, share=False),
                                      lambda rng, n: random_tree(rng, n, 2, True)),
                    eager_child=(lambda rng: cells.pushed_outputs(rng, eager_child=True),
                                 lambda rng, n: random_tree(rng, n, 2, True)))


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 4), size=st.integers(1, 7), switch=st.integers(0, 15))
def test_random_graphs_streaming_equals_one_stream(name, seed, k, size, switch):
    """Random trees, chains and DAGs, every switch; pushed_outputs's eager phase of ∂F computes parameter
    gradients (one kind's alone: no longer straight into the accumulator, chunk by chunk; Wo's, which the task
    loop adds into too without lazy batching: into the eager stream's own accumulator)."""
    build, make_graph = STREAM_CASES[name]
    rng = np.random.default_rng(seed)
    case = build(rng)
    graphs = [make_graph(rng, int(rng.integers(1, size + 1))) for _ in range(k)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    assert_streaming_equals_one_stream(run, SWITCHES[switch], "float64")


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 4), size=st.integers(1, 8), switch=st.integers(0, 15),
       dag=st.booleans(), serial=st.booleans())
def test_interleaved_kinds_streaming_equals_one_stream(seed, k, size, switch, dag, serial):
    """Kinds whose scatter rows interleave (one stream: their blocks move them by the kinds' row indices; the
    eager stream's chunks: a view at the task's scatter offset)."""
    rng = np.random.default_rng(seed)
    case = cells.typed_child_sum_tree_lstm(rng)
    shape = (lambda n: random_dag(rng, n, 3)) if dag else (lambda n: random_tree(rng, n, 3))
    graphs = [_typed(rng, shape(2 * int(rng.integers(1, size + 1)))) for _ in range(k)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options,
                                           policy="serial" if serial else None)
    assert_streaming_equals_one_stream(run, SWITCHES[switch], "float64")


@pytest.mark.parametrize("runner", ["device", "reference"])
def test_eager_chunks_move_scatter_rows_by_index_when_given_no_offset(runner, tmp_path, monkeypatch):
    """A chunk's scatter rows are its task's, one block (a view at the task's scatter offset); given none
    (offset -1, as a block of a kind whose rows interleave), its SROWS and SPUT move them by the kind's row
    index from the chunk's kind offset: the same numbers (2Type's leaf block reads and writes scatter rows)."""
    from minicavs.engine import program as binding
    real = binding.eager_rows

    def without_offsets(lowered, table, forest):
        rows, why = real(lowered, table, forest)
        if rows is not None:
            rows[:, 3] = -1
        return rows, why
    t = Trainer(MODELS / "tree_lstm_2type.yaml", TINY["tree_lstm_2type"] + ["train.dtype=float64"],
                run_dir=tmp_path)
    samples = t.task.data["train"][:6]

    def run(options):
        t.model.options = replace(options, runner=runner)
        return t.loss_and_grads(samples)
    one = run(EngineOptions())
    monkeypatch.setattr(binding, "eager_rows", without_offsets)
    two = run(EngineOptions(streaming=True))
    assert_streamed(two)
    lowered = two.states["tree"].program.lowered
    pre = [b for b in lowered.blocks if b.phase == PRE]
    assert any(OPCODES_BY_ID[op] == "SROWS" for b in pre
               for op in lowered.code[lowered.ranges[b.tid][0]:lowered.ranges[b.tid][1], 0])
    assert (two.states["tree"].program.eager[:, 3] == -1).all()
    results_equal(one, two, "float64")


def _pushed_outputs_run(dag: bool, eager_child: bool = False, share: bool = True, seed: int = 3):
    rng = np.random.default_rng(seed)
    case = cells.pushed_outputs(rng, eager_child=eager_child, share=share)
    graphs = [binary_dag(rng, 9) if dag else random_tree(rng, 5, 2, True) for _ in range(3)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    return lambda options: case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)


def test_streaming_eager_parameter_gradients_are_accumulated_chunk_by_chunk():
    """A parameter gradient only one kind's block before the task loop computes is computed straight into
    its accumulator on one stream ("set"); streaming, that block runs per task, so it is accumulated (GACC)
    instead, and one the task loop adds into too gets the eager stream's own accumulator."""
    run = _pushed_outputs_run(dag=False, share=False)
    one = run(EngineOptions()).states["G"].backward_program.lowered
    two = run(EngineOptions(streaming=True)).states["G"].backward_program.lowered
    assert ("pgrad", "Wlo", "set") in one.keys and ("pgrad", "Wlo", "set") not in two.keys
    assert ("pgrad", "Wlo") in two.keys
    run = _pushed_outputs_run(dag=False)
    shared = run(EngineOptions(streaming=True, lazy_batching=False)).states["G"].backward_program.lowered
    assert [shared.keys[i] for i in shared.eager_accumulators] == [("pgrad", "Wo")]


def test_streaming_a_dag_whose_eager_blocks_add_gather_gradients_runs_one_stream():
    """In a DAG the eager stream would add a child's gradient rows while a task adds into the same rows: that
    pass runs on one stream (its dump says why), with the same numbers; F and a tree still stream."""
    run = _pushed_outputs_run(dag=True, eager_child=True)
    for options in SWITCHES[::5]:
        one, two = run(options), run(replace(options, streaming=True))
        results_equal(one, two, "float64")
        backward = two.states["G"].backward_program
        assert backward.eager is None and "adds gather gradients" in backward.eager_why
        assert "(no eager stream: kind 'internal' (before tasks) adds gather gradients" in backward.dump()
        assert two.states["G"].program.eager is not None
    tree = _pushed_outputs_run(dag=False, eager_child=True)(EngineOptions(streaming=True))
    assert tree.states["G"].backward_program.eager is not None


def test_eager_rows_are_the_task_rows_with_their_kinds_eager_templates():
    """Chunk t: task t's row (kind offset, rows, scatter offset, views) with its kind's template id before the
    task loop; a kind without such a block gets that id too (a template of no instructions)."""
    run = _pushed_outputs_run(dag=False)
    for program_ in (run(EngineOptions(streaming=True)).states["G"].program,
                     run(EngineOptions(streaming=True)).states["G"].backward_program):
        lowered, tasks, eager = program_.lowered, program_.task_table, program_.eager
        n_kinds = len(lowered.ranges) // 3
        np.testing.assert_array_equal(eager[:, 1:], tasks[:, 1:])
        np.testing.assert_array_equal(eager[:, 0], tasks[:, 0] + n_kinds)
        assert {b.tid for b in lowered.blocks if b.phase == PRE} <= set(eager[:, 0].tolist())


def test_eager_chunks_run_on_the_worker_thread(monkeypatch):
    """The C runner calls its interpreter twice per streamed pass: the eager call (role 2) over the eager table
    on a thread other than the caller's, the main call (role 1) on the caller's, waiting for as many chunks."""
    from minicavs.cpu import interpreter as c_interpreter
    calls = []
    load = c_interpreter.interpreter
    for ex in {load(np.float64), load(np.dtype(np.float64))}:   # (cached by key)
        def recorded(*args, _real=ex.run):
            calls.append((args[-2], args[-1], args[5], threading.get_ident()))   # role, chunks waited for, rows
            return _real(*args)
        monkeypatch.setattr(ex, "run", recorded)
    result = _pushed_outputs_run(dag=False)(EngineOptions(streaming=True))
    assert_streamed(result)
    me = threading.get_ident()
    for program_ in (result.states["G"].program, result.states["G"].backward_program):
        eager = [c for c in calls if c[0] == 2 and c[2] == len(program_.eager)]
        main = [c for c in calls if c[0] == 1 and c[1] == len(program_.eager)
                and c[2] == len(program_.table)]
        assert eager and main
        assert all(c[3] != me for c in eager) and all(c[3] == me for c in main)
    # (role 0: the static graphs' programs, one unstreamed call each; a head linked into F's runs in F's call)
    assert {c[0] for c in calls} - {0} == {1, 2}
    assert len([c for c in calls if c[0] == 0]) == sum(run.program is not None and not run.linked.startswith("linked")
                                                       for run in result.static)


def _one_kind_program(ex, table: np.ndarray, a: np.ndarray, sync: np.ndarray, role: int, nwait: int):
    """The C interpreter over a template that zeroes the task's rows of ``a`` (4 columns): returns (rc, err)."""
    code = np.zeros((2, instructions.WIDTH), np.int64)
    code[0, :6] = [instructions.OPCODE["BIND"], 0, 0, instructions.KIND_ROWS, 0, 4]
    code[1, :4] = [instructions.OPCODE["ZERO"], 0, -1, 4]
    ranges = np.array([[0, 2], [2, 2], [2, 2]], np.int64)
    scratch = np.zeros(1, np.float64)
    info = np.array([[a.ctypes.data, scratch.ctypes.data], [a.size, 1], [4, 1], [0, 0], [0, 0]], np.int64)
    err, p = np.zeros(4, np.int64), ex.ptr
    rc = ex.run(p(code), p(np.zeros(1, np.int64)), p(ranges), 3, p(table), len(table), table.shape[1],
                p(info[0]), p(info[1]), p(info[2]), p(info[3]), 2, 1, 1, 1, p(np.zeros(1, np.int64)), 0, ex.gemm,
                ex.gemv, int(ex.ilp64), 1, 1, p(err), ex.ffi.NULL, p(info[4]),
                p(np.zeros(6, np.int64)), 0, 0, 0, p(sync), role, nwait)
    return rc, err


@pytest.mark.parametrize("done, nwait", [(0, 4), (2, 4), (3, 4), (1, 2), (4, 4)])
def test_the_main_call_runs_row_t_only_after_eager_chunk_t(done, nwait):
    """The C interpreter's wait, without a second thread: ``done`` chunks finished and the eager call failed; the
    main call runs exactly the rows whose chunks are done (rows past the ``nwait`` chunks wait for all) and
    stops with the eager stream's failure at the first other one (every row after ``nwait`` waits for all)."""
    ex = c_interpreter_library()
    a = np.ones((4, 4))
    table = np.array([[0, t, 1, 0, -1] for t in range(4)], np.int64)
    rc, err = _one_kind_program(ex, table, a, np.array([done, 1], np.int64), 1, nwait)
    ran = 4 if done >= nwait else done
    assert (a[:ran] == 0).all() and (a[ran:] == 1).all()
    if ran < 4:
        assert rc == 1 and err[1] == ran and err[3] == -4
    else:
        assert rc == 0


def test_the_eager_call_publishes_each_chunk():
    ex = c_interpreter_library()
    a = np.ones((4, 4))
    sync = np.zeros(2, np.int64)
    rc, _ = _one_kind_program(ex, np.array([[0, t, 1, 0, -1] for t in range(3)], np.int64), a, sync, 2, 0)
    assert rc == 0 and sync.tolist() == [3, 0] and (a[:3] == 0).all() and (a[3] == 1).all()


def c_interpreter_library():
    from minicavs.cpu import interpreter as c_interpreter
    return c_interpreter.interpreter(np.float64)


def test_a_bad_eager_instruction_is_caught_on_the_eager_stream(monkeypatch):
    """With the debug mode on, an eager template's instruction addressing outside its buffer fails the eager
    call; the main call, waiting for that chunk, stops too, and the error names the eager stream."""
    run = _pushed_outputs_run(dag=False)
    lowered = run(EngineOptions(streaming=True, check=True)).states["G"].program.lowered
    block = next(b for b in lowered.blocks if b.phase == PRE)
    begin, end = lowered.ranges[block.tid]
    pc = next(pc for pc in range(begin, end) if OPCODES_BY_ID[lowered.code[pc][0]] == "GEMM")
    original = int(lowered.code[pc][4])
    lowered.code[pc][4] = 10**9   # (its rows)
    try:
        with pytest.raises(c_runner.CRunnerCheckError, match=rf"C runner F: eager stream task \d+, instruction {pc} "):
            run(EngineOptions(streaming=True, check=True))
    finally:
        lowered.code[pc][4] = original
    results_equal(run(EngineOptions(check=True)), run(EngineOptions(streaming=True, check=True)), "float64")


@pytest.mark.parametrize("eager", [True, False])
def test_dropout_runs_natively_with_the_reference_runners_masks(eager):
    """Dropout (DROPOUT: the mask of the task's row keys and a per-run table entry) in the leaves' block
    before the task loop, or (eager batching off) in the task loop: both passes run natively and equal the
    reference runner (the same mask bits); the mask changes with the step and is gone outside training."""
    rng = np.random.default_rng(2)
    case = cells.binary_tree_lstm(rng, p_drop=0.3)
    graphs = [InputGraph([[1, 2], [], []]), InputGraph([[1, 2], [3, 4], [], [], []])]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    options = EngineOptions(eager_batching=eager)
    losses = {}
    for ctx in (RunContext(seed=3, step=1), RunContext(seed=3, step=2), RunContext(seed=3, training=False)):
        def run(options):
            return case.model.forward_backward(graphs, feeds, case.params, replace(ctx), options=options)
        assert_native_equals_reference(run, options, "float64")
        native = run(options)
        program = native.states["G"].program
        assert "DROPOUT" in "\n".join(program.lowered.lines())
        losses[(ctx.step, ctx.training)] = float(native.loss)
    assert len(set(losses.values())) == 3, losses


def test_an_op_without_an_opcode_runs_as_apply_on_the_reference_runner():
    """A step no opcode expresses (here a softmax over each vertex's row) is an APPLY of its op's own
    implementation: the C runner declines that pass and says why (dump()), the reference runner on the CPU
    runs it; the loss equals plain numpy's, the gradients finite differences."""
    from minicavs import ops
    from minicavs.engine.model import Model, Structure
    from minicavs.train.testing import check_model_grads
    from minicavs.runtime.vertex import VertexFunction
    rng = np.random.default_rng(4)
    W = ops.param_node("W", (3, 3), "float64")
    F = VertexFunction("v", arity=1, message=(3,), dtype="float64")
    with F:
        h = ops.tanh(ops.softmax(F.pull((3,)) @ W) + F.gather(0))
        F.scatter(h)
        F.push(h)
    s = Structure(F, pulls={"x": ops.input((None, 3), "float64", name="xs")})
    model = Model(s, loss=ops.sum(ops.square(s.pushed("h"))))
    sizes = (3, 2)
    graphs = [InputGraph.chain(n) for n in sizes]
    feeds, vals = {"xs": rng.standard_normal((5, 3))}, {"W": rng.standard_normal((3, 3))}
    got = model.forward_backward(graphs, feeds, vals, options=EngineOptions(runner="device"))
    for program in (got.states["G"].program, got.states["G"].backward_program):
        assert program.runner == "reference runner" and "APPLY" in program.declined, program.declined
        assert "the device's runner declined this pass" in program.dump()
    want, row = 0.0, 0
    for n in sizes:   # (vertex i's child is i - 1)
        h = np.zeros(3)
        for _ in range(n):
            z = feeds["xs"][row] @ vals["W"]
            h = np.tanh(np.exp(z - z.max()) / np.exp(z - z.max()).sum() + h)
            want += np.sum(h ** 2)
            row += 1
    equal(got.loss, want)
    model.options = EngineOptions(runner="device")
    check_model_grads(model, graphs, feeds, vals, directions=3)


def test_dump_shows_the_instructions():
    rng = np.random.default_rng(0)
    case = cells.binary_tree_lstm(rng, H=2)
    trees = [InputGraph([[1, 2], [], []]), InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, trees, [case.data(rng, g) for g in trees])
    case.model.options = EngineOptions(runner="device")
    state = case.model.forward_backward(trees, feeds, case.params, RunContext()).states["G"]
    text = state.program.dump()
    assert "F: one call of the C runner runs the blocks before the task loop (1 rows), tasks 0:2 and " \
        "the blocks after it (1 rows)" in text
    lines = text.splitlines()
    # the blocks' templates: the leaves' x·W over all leaf rows (eager batching), the roots' h pushed after
    # the loop (lazy batching), read back from the scatter tensor's rows (a view of them when they are one
    # block of rows, else copied in by the kind's row index: SROWS)
    leaf = text[text.index("kind 'leaf' before tasks block template"):]
    assert re.search(r"TAKE dst=r\d+\(x\) buf=pull\[x\]", leaf) and re.search(r"GEMM c=\S+ a=r\d+\(x\) b=r\d+\(W\)", leaf)
    root = text[text.index("kind 'internal' after tasks block template"):]
    assert re.search(r"SROWS dst=r\d+\(\S+\) buf=scatter\[\(4,\)\] col=0 ld=4 idx=srows\[1\] cols=2 off=\d+ load=1",
                     root) and "PUT buf=push[h]" in root, root
    assert "before tasks: kind" not in text and "after tasks: kind" not in text   # no Python block
    # the internal kind's gathers read the scatter tensor by child index (or a strided view), the linear
    # over [h1; h2] is a GEMM, the cell one fused kernel writing straight into the scatter tensor's rows
    assert any(re.search(r"GATHER dst=r\d+\(gather0\) buf=scatter\[\(4,\)\] width=4 idx=child\[0,\d+\]", x)
               for x in lines), text
    assert any(x.strip().split(": ", 1)[-1].startswith("GEMM") for x in lines)
    assert any("FUSED" in x and "args=" in x for x in lines)
    assert any("BIND" in x and "mode=scatter rows" in x for x in lines)
    back = state.backward_program.dump()
    assert "ADJ buf=scatter grad" not in back and "ADJ buf=sgrad[(4,)]" in back
    # ∂F's lazy block: the parameter gradients over all rows (Xᵀ·dY products, bias sums) computed straight
    # into their accumulators (no other block or task adds to them), the leaves' dx put into the pull
    # buffer's gradient
    lazy = back[back.index("kind 'leaf' after tasks block template"):]
    assert re.search(r"BIND dst=r(\d+)\(%\d+\) buf=pgrad\[W,set\].*\n.*GEMM c=r\1\(", lazy)
    assert re.search(r"BIND dst=r(\d+)\(%\d+\) buf=pgrad\[bl,set\].*\n.*SUMROWS dst=r\1\(", lazy)
    assert "PUT buf=pullgrad[x]" in lazy and "GACC" not in back[back.index("before tasks block template"):]


def _step_calls(case, graphs, options) -> collections.Counter:
    """Python calls (sys.setprofile 'call' and 'c_call' events) of one forward and backward pass: making the
    batch, scheduling, planning memory, binding, running, gradients."""
    rng = np.random.default_rng(0)
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    case.model.options = options
    case.model.forward_backward(graphs, feeds, case.params, RunContext())   # compiled, cached
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            counts[event] += 1
        if event == "call" and frame.f_code.co_filename.endswith("reference.py") \
                and frame.f_code.co_name.startswith("op_"):   # (an opcode interpreted in Python)
            counts["reference"] += 1
    gc.collect()   # (a collection during the step would add its weakref callbacks to the count)
    gc.disable()
    sys.setprofile(profile)
    try:
        case.model.forward_backward(graphs, feeds, case.params, RunContext())
    finally:
        sys.setprofile(None)
        gc.enable()
    return counts


def test_python_calls_of_a_native_step_do_not_grow_with_the_tasks():
    case = cells.chain_lstm(np.random.default_rng(0))
    short = [InputGraph.chain(4) for _ in range(40)]      # 4 tasks of 40 rows
    long = [InputGraph.chain(16) for _ in range(40)]      # 16 tasks of 40 rows
    native = EngineOptions(runner="device")
    calls = _step_calls(case, short, native)
    assert calls == _step_calls(case, long, native)
    # the blocks before and after the task loop (x·W over all rows; the parameter gradients) run in the same
    # native call: no instruction is interpreted in Python
    assert calls["reference"] == 0, calls
    reference = EngineOptions(runner="reference")   # (which does run one Python call per instruction)
    assert _step_calls(case, long, reference)["reference"] > _step_calls(case, short, reference)["reference"] > 0


def _run_script(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_corrupted_offset_is_caught_by_the_debug_mode_not_a_crash():
    result = _run_script("""
        import numpy as np
        from minicavs.engine import instructions
        from minicavs.cpu import c_runner
        from minicavs.engine.compile import EngineOptions
        from minicavs.engine.executor import RunContext
        from minicavs.engine.lowered import OPCODES_BY_ID
        from minicavs.runtime.inputs import InputGraph
        from tests import cells
        rng = np.random.default_rng(0)
        case = cells.binary_tree_lstm(rng)
        trees = [InputGraph([[1, 2], [], []])] * 3
        feeds = cells.batch_feeds(case, trees, [case.data(rng, g) for g in trees])
        case.model.options = EngineOptions(runner="device", check=True)
        state = case.model.forward_backward(trees, feeds, case.params, RunContext()).states["G"]
        code = state.program.lowered.code
        pc = next(i for i in range(len(code)) if OPCODES_BY_ID[code[i][0]] == "BIND"
                  and code[i][3] == instructions.SCATTER_ROWS)
        code[pc][4] += 10**9   # the column offset: far outside the scatter tensor
        try:
            case.model.forward_backward(trees, feeds, case.params, RunContext())
        except c_runner.CRunnerCheckError as e:
            print("caught:", e)
        """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"caught: C runner F: task \d+, instruction \d+ \(BIND dst=r\d+\(.*\) buf=scatter.* "
                     r"col=1000000000.*\): operand \w+ is out of bounds", result.stdout), result.stdout


def test_without_a_compiler_the_reference_runner_trains_with_one_warning(tmp_path):
    result = _run_script(f"""
        import warnings
        warnings.simplefilter("always")
        from minicavs.train.trainer import Trainer
        from tests.models.test_models import MODELS, TINY
        with warnings.catch_warnings(record=True) as caught:
            t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + ["train.engine.runner=device",
                        "train.epochs=1"], run_dir={str(tmp_path / 'run')!r})
            for step in range(3):
                loss, _ = t.train_step(list(range(8 * step, 8 * step + 8)))
        native = [str(w.message) for w in caught if "C runner" in str(w.message)]
        print(len(native), native[0] if native else "")
        state = t.loss_and_grads(t.task.data["train"][:4]).states
        programs = [p for s in state.values() for p in (s.program, s.backward_program)]
        print("runners:", set(p.runner for p in programs), "loss", loss)
        """, CC="/nonexistent", MINICAVS_CACHE=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-2000:]
    count, rest = result.stdout.split(" ", 1)
    assert count == "1" and "no C compiler (/nonexistent)" in rest, result.stdout
    assert "runners: {'reference runner'} loss" in result.stdout


def test_dispatch_overhead_is_measured():
    from minicavs.bench.dispatch import dispatch_ns
    ns = dispatch_ns(CPU, count=10_000, tasks=2, repeats=1)
    assert 0 < ns < 1e6


def test_inference_native_equals_python():
    """Forward only (no backward state kept): the template of an inference pass stores less."""
    rng = np.random.default_rng(3)
    case = cells.child_sum_tree_lstm(rng)
    graphs = [CASES["child_sum"][1](rng, 5) for _ in range(4)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    python = case.model.infer(graphs, feeds, case.params, options=EngineOptions(runner="reference"))
    native = case.model.infer(graphs, feeds, case.params, options=EngineOptions(runner="device"))
    assert native.states["G"].program.lowered is not None if native.states else True
    for name in python.pushes["G"]:
        equal(python.pushes["G"][name], native.pushes["G"][name])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_one_tree_inference_native_equals_reference_and_the_batched_pass(dtype, tmp_path):
    """The path ``bench.point`` times at batch 1 (the bundled Tree-LSTM, forward only, one tree per pass): the
    native pass equals the reference runner's (loss, every vertex's class probabilities, the pushed states)
    and each tree alone equals its rows of a batch of all of them (serial per-sample evaluation)."""
    t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + [f"train.dtype={dtype}"], run_dir=tmp_path)
    trees = t.task.data["train"][:6]

    def infer(samples, runner):
        t.model.options = EngineOptions(runner=runner)
        graphs, feeds = t.task.batch(samples)
        return t.model.infer(graphs, feeds, t.params, t.context(training=False))

    alone = []
    for tree in trees:
        reference, native = infer([tree], "reference"), infer([tree], "device")
        program = native.states["tree"].program
        assert program.runner == "C runner" and program.declined is None, program.declined
        close(reference.loss, native.loss, dtype)
        close(reference.outputs["probs"], native.outputs["probs"], dtype)
        close(reference.pushes["tree"]["h"], native.pushes["tree"]["h"], dtype)
        alone.append(native)
    batched = infer(trees, "device")
    close(np.concatenate([r.outputs["probs"] for r in alone]), batched.outputs["probs"], dtype)
    for r, rows in zip(alone, batched.per_sample("tree", "h")):
        close(r.per_sample("tree", "h")[0], rows, dtype)
    close(np.mean([r.loss for r in alone]), batched.loss, dtype)


def record_contiguous_copies(monkeypatch) -> list:
    """The shapes of the statics the C runner copies (cpu/library.py contiguous), appended as it runs."""
    shapes = []
    real = c_runner.library

    def counting(d):
        lib = real(d)
        monkeypatch.setattr(lib, "contiguous", lambda a, f=type(lib).contiguous: shapes.append(a.shape) or f(lib, a),
                            raising=False)
        return lib

    monkeypatch.setattr(c_runner, "library", counting)
    return shapes


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_transposed_statics_copied_for_the_task_loop_give_the_same_numbers(dtype, tmp_path, monkeypatch):
    """∂F's W_h^T is read as a contiguous copy when multi-row tasks multiply by it enough (cpu/c_runner.py):
    the same loss and gradients as multiplying by the transposed view and as Python's, up to rounding (BLAS
    may sum in another order for another layout)."""
    monkeypatch.setattr(c_runner, "_product_statics", lambda lowered: frozenset())   # (float32 packs instead)
    t = Trainer(MODELS / "var_lstm.yaml", TINY["var_lstm"] + [f"train.dtype={dtype}"], run_dir=tmp_path)
    samples = t.task.data["train"][:10]
    copied = record_contiguous_copies(monkeypatch)
    runs = {}
    for threshold in (1, 10 ** 9):
        monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", threshold)
        t.model.options = EngineOptions(runner="device")
        runs[threshold] = t.loss_and_grads(samples)
        if threshold == 1:
            assert (20, 5) in copied           # W_h^T (4 hidden x hidden)
            copied.clear()
    assert not copied
    a, b = runs[1], runs[10 ** 9]
    close(a.loss, b.loss, dtype)
    assert set(a.grads) == set(b.grads)
    for k in a.grads:
        close(a.grads[k], b.grads[k], dtype)
    t.model.options = EngineOptions()
    monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", 1)
    assert_native_equals_reference(lambda o: (setattr(t.model, "options", o), t.loss_and_grads(samples))[1],
                                EngineOptions(), dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_few_row_products_by_a_wide_static_run_transposed_with_the_same_numbers(dtype, tmp_path, monkeypatch):
    """A task of at most SMALL_M_ROWS rows multiplies by F's W_h (hidden x 4 hidden) as C^T = W_h^T·A^T on
    the static's transposed copy (cpu/c_runner.py, codegen/machine.py), and (TWIN_ELEMENTS lowered so that
    this small model takes it) ∂F's dgates·W_h^T on W_h itself: the same loss and gradients as the plain
    products (the path switched off) and as the reference runner, at tasks of 1 to 40 rows (one row takes
    the GEMV; more than SMALL_M_ROWS the plain GEMM), with the debug mode's bounds checks on."""
    monkeypatch.setattr(c_runner, "_product_statics", lambda lowered: frozenset())   # (float32 packs instead)
    monkeypatch.setattr(c_runner, "TWIN_ELEMENTS", 1)
    monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", 1)
    t = Trainer(MODELS / "var_lstm.yaml", TINY["var_lstm"] + [f"train.dtype={dtype}", "data.synthetic.train=120"],
                run_dir=tmp_path)
    twins = record_contiguous_copies(monkeypatch)
    for size in (2, 3, 17, 40):
        samples = t.task.data["train"][:size]
        runs = {}
        for rows in (c_runner.SMALL_M_ROWS, 0):
            monkeypatch.setattr(c_runner, "SMALL_M_ROWS", rows)
            twins.clear()
            t.model.options = EngineOptions(runner="device", check=True)
            runs[rows] = t.loss_and_grads(samples)
            assert (20, 5) in twins                     # F's W_h^T made for the task loop (and ∂F's W_h^T)
        a, b = runs.values()
        close(a.loss, b.loss, dtype)
        assert set(a.grads) == set(b.grads)
        for k in a.grads:
            close(a.grads[k], b.grads[k], dtype)
        monkeypatch.setattr(c_runner, "SMALL_M_ROWS", 32)
        assert_native_equals_reference(lambda o: (setattr(t.model, "options", o), t.loss_and_grads(samples))[1],
                                    EngineOptions(check=True), dtype)


def test_a_wide_static_only_the_blocks_read_gets_no_transposed_copy(tmp_path, monkeypatch):
    """The Tree-LSTM's leaf W (embed x 3 hidden: twice as wide as deep) is read only by F's block of all the
    leaves: no transposed copy of it is made per forward pass (it would serve that one product; the task
    loop's statics keep theirs: the Var-LSTM test above), and training equals the reference runner's."""
    monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", 1)
    t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + ["train.dtype=float64"], run_dir=tmp_path)
    samples = t.task.data["train"][:8]
    shape = t.params["W"].value.shape
    assert shape[1] >= 2 * shape[0]
    copies = record_contiguous_copies(monkeypatch)
    t.model.options = EngineOptions(runner="device")
    graphs, feeds = t.task.batch(samples)
    program = t.model.infer(graphs, feeds, t.params, t.context(training=False)).states["tree"].program
    assert program.table is not None and shape[::-1] not in copies, copies   # (the old rule made it)
    assert_native_equals_reference(lambda o: (setattr(t.model, "options", o), t.loss_and_grads(samples))[1],
                                EngineOptions(), "float64")


def test_tree_fc_task_loop_moves_no_rows_when_siblings_are_side_by_side(monkeypatch):
    """Complete trees (siblings adjacent, a forest): F's loop reads [h_l; h_r] as a view and writes h into
    the scatter tensor in place; ∂F's product dY·Wᵀ is written straight into the children's rows of the
    scatter gradient, so no COPY or ADJ runs (a skipped instruction adds nothing to the per-opcode clock).
    Irregular trees still take the adjoints; both equal the reference runner."""
    from minicavs.data.trees import complete_binary_tree
    rng = np.random.default_rng(5)
    case = cells.tree_fc(rng, H=4)
    complete = [complete_binary_tree(8).to_graph()] * 3
    irregular = [CASES["tree_fc"][1](rng, n) for n in (5, 7, 6)]
    moved = {}
    # (the loss on top runs on the step runner here: the clock counts F's and ∂F's instructions alone)
    monkeypatch.setattr(static_program, "refusal", lambda node: "F's instructions counted alone")
    for label, graphs in (("complete", complete), ("irregular", irregular)):
        feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
        def run(options):
            return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
        with CPU.opcode_clock() as clock:
            assert_native_equals_reference(run, EngineOptions(runner="reference"), "float64")
        moved[label] = {op: int(clock[i]) for i, op in enumerate(instructions.OPCODES) if op in ("COPY", "ADJ")}
    assert moved["complete"] == {"COPY": 0, "ADJ": 0}
    assert moved["irregular"]["ADJ"] > 0


def test_backward_task_table_is_the_forward_one_reversed():
    """∂F reuses F's task table (the stack popped) instead of building it again; it is what task_table
    builds for backward."""
    rng = np.random.default_rng(8)
    case = cells.tree_fc(rng)
    from minicavs.data.trees import complete_binary_tree
    graphs = [complete_binary_tree(4).to_graph(), complete_binary_tree(8).to_graph()]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    res = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=EngineOptions())
    state = res.states["G"]
    forward, backward = state.program.task_table, state.backward_program.task_table
    np.testing.assert_array_equal(backward, forward[::-1])
    assert backward.flags.c_contiguous and (backward[:, 4] >= 0).any()   # some task has its children side by side


def _block_instruction(program, template: str, opcode: str) -> int:
    """The index of the first ``opcode`` instruction of the block template named ``template`` (dump()'s
    'kind ... template' line) of a native program."""
    lowered = program.lowered
    tid = next(tid for tid, t in zip(lowered.template_ids, lowered.templates)
               if f"kind '{t.kind}' {PHASE_WORDS[t.phase]} block" == template)
    begin, end = lowered.ranges[tid]
    return next(pc for pc in range(begin, end) if OPCODES_BY_ID[lowered.code[pc][0]] == opcode)


@pytest.mark.parametrize("backward, template, opcode, field, change", [
    (False, "kind 'leaf' before tasks block", "GEMM", 6, lambda v: v - 1),   # x·W without x's last column
    (False, "kind 'internal' after tasks block", "PUT", 5, lambda v: v - 1),   # push one column short
    (True, "kind 'leaf' after tasks block", "SUMROWS", 4, lambda v: v - 1),    # the bias sum one column short
    (True, "kind 'internal' after tasks block", "GEMM", 3, lambda v: v - 1),   # dU one row short
])
def test_a_wrong_block_instruction_makes_native_differ_from_reference(backward, template, opcode, field, change):
    """The blocks the C runner runs are what computes those values: one perturbed instruction of a
    block template (the linked program is cached with the model, so the next run uses it) and the numbers
    differ from the reference runner's before the change."""
    rng = np.random.default_rng(4)
    case = cells.binary_tree_lstm(rng)
    graphs = [InputGraph([[1, 2], [], [3, 4], [], []]), InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    reference = EngineOptions(runner="reference")
    assert_native_equals_reference(run, reference, "float64")
    want = run(reference)   # (before the change: both runners run the one program the change is made to)
    state = run(EngineOptions(runner="device")).states["G"]
    program = state.backward_program if backward else state.program
    pc = _block_instruction(program, template, opcode)
    program.lowered.code[pc][field] = change(int(program.lowered.code[pc][field]))
    with pytest.raises(AssertionError):
        results_equal(want, run(EngineOptions(runner="device")), "float64")


def test_a_bad_offset_in_a_block_instruction_is_caught_by_the_debug_mode():
    """The debug mode's bounds checks cover the blocks' instructions: a block's BIND of a tensor's rows, and
    TAKETO (Tree-FC's lazy ∂F gathers [h_l; h_r] again, row by row where the children are not side by
    side), each given a column offset far outside its buffer."""
    result = _run_script("""
        import numpy as np
        from minicavs.engine import instructions
        from minicavs.cpu import c_runner
        from minicavs.engine.compile import EngineOptions
        from minicavs.engine.executor import RunContext
        from minicavs.runtime.inputs import InputGraph
        from tests import cells
        from tests.engine.test_alg1 import CASES
        from tests.engine.test_instructions import _block_instruction
        rng = np.random.default_rng(5)
        for name, make, backward, template, opcode, field in (
                ("binary_tree_lstm", lambda: [InputGraph([[1, 2], [], []])] * 3, False,
                 "kind 'leaf' before tasks block", "BIND", 4),
                ("tree_fc", lambda: [CASES["tree_fc"][1](rng, n) for n in (5, 7, 6)], True,
                 "kind 'internal' after tasks block", "TAKETO", 6)):
            case = getattr(cells, name)(rng)
            graphs = make()
            feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
            case.model.options = EngineOptions(runner="device", check=True)
            state = case.model.forward_backward(graphs, feeds, case.params, RunContext()).states["G"]
            program = state.backward_program if backward else state.program
            pc = _block_instruction(program, template, opcode)
            program.lowered.code[pc][field] += 10**9
            try:
                case.model.forward_backward(graphs, feeds, case.params, RunContext())
                print("not caught", opcode)
            except c_runner.CRunnerCheckError as e:
                print("caught:", e)
        """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"caught: C runner F: task \d+, instruction \d+ \(BIND dst=r\d+\(.*\) buf=tensor.* "
                     r"col=1000000000.*\): operand \w+ is out of bounds", result.stdout), result.stdout
    assert re.search(r"caught: C runner ∂F: task \d+, instruction \d+ \(TAKETO dst=r\d+\(.*\) buf=scatter.* "
                     r"col=1000000000\): operand \w+ is out of bounds", result.stdout), result.stdout


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), H=st.integers(1, 5), k=st.integers(1, 3), size=st.integers(1, 6),
       switch=st.integers(0, 15))
def test_per_row_matrices_native_equals_reference(seed, H, k, size, switch):
    """Per-row values of three axes (cells.per_row_matrices: static · M · static, Mᵀ · X, elementwise over the
    flat rows) lower natively, BMM and all, and give the reference runner's numbers."""
    rng = np.random.default_rng(seed)
    case = cells.per_row_matrices(rng, H)
    graphs = [InputGraph.chain(int(rng.integers(1, size + 1))) for _ in range(k)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    assert_native_equals_reference(run, SWITCHES[switch], "float64")
    native = run(replace(SWITCHES[switch], runner="device")).states["G"]
    assert "BMM" in "\n".join(native.program.lowered.lines() + native.backward_program.lowered.lines())


def test_a_fused_input_broadcast_along_the_last_axis_of_a_per_row_matrix_is_an_apply():
    """A per-row (H, 1) vector scaling an (H, H) matrix row by row reads one number per row of the matrix, not
    per flat row: the kernel over flat rows cannot express it, so the group is an APPLY, that pass runs on the
    reference runner and says why; its gradients agree with finite differences."""
    from minicavs.train.testing import check_model_grads
    rng = np.random.default_rng(5)
    case = cells.per_row_matrices(rng, 3, col_factor=True)
    graphs = [InputGraph.chain(n) for n in (2, 4)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    native = run(EngineOptions(runner="device"))
    why = native.states["G"].program.declined
    assert native.states["G"].program.runner == "reference runner" and "APPLY" in why, why
    results_equal(run(EngineOptions(runner="reference")), native, "float64")
    case.model.options = EngineOptions(runner="device")
    check_model_grads(case.model, graphs, feeds, case.params, directions=3)
