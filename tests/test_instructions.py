"""The native executor (instructions.py over codegen/native.py's interpreter) against the Python interpreter:
every bundled model and random trees, chains and DAGs under every engine switch, forward values and all
gradients (float64: DESIGN.md's "equal"; float32: 1e-5); the Python work of a native step does not grow with
the number of tasks; a corrupted instruction is caught by the debug mode, not by a crash; without a compiler
the Python interpreter trains, with one warning."""
from __future__ import annotations

import collections
import gc
import itertools
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs import instructions, ops
from minicavs.cpu import CPU, runner as c_runner
from minicavs.engine import EngineOptions
from minicavs.executor import RunContext
from minicavs.inputs import InputGraph
from minicavs.training import Trainer
from minicavs.vertex import VertexFunction

from . import cells
from .models.test_models import MODELS, TINY
from .test_engine import CASES, dense, equal, random_dag, random_tree

pytestmark = pytest.mark.skipif(c_runner.available(np.float64) is not None,
                                reason="no C compiler or BLAS: the native executor cannot run here")

REPO = Path(__file__).resolve().parents[1]
SWITCHES = [EngineOptions(lazy_batching=lazy, eager_batching=eager, fusion=fusion, gather_elision=elision)
            for lazy, eager, fusion, elision in itertools.product((True, False), repeat=4)]


def close(a, b, dtype):
    a, b = np.asarray(dense(a), np.float64), np.asarray(dense(b), np.float64)
    if dtype == "float64":
        equal(a, b)
    else:
        assert a.shape == b.shape and np.max(np.abs(a - b), initial=0) <= 1e-5 * max(1.0, np.max(np.abs(a))), \
            np.max(np.abs(a - b))


# Bundled models whose task programs the lowering cannot express, and why (they run in Python, same numbers):
# none today (MV-RNN's per-vertex matrices, values of three axes, lower as flat rows: BMM, TRANSROWS).
PYTHON_ONLY: dict = {}


def assert_native_equals_python(run, options, dtype, python_only: str | None = None) -> None:
    """``run(options)`` -> Result; the native executor must have run the task loop of both passes and the
    blocks before and after it in the same call (kinds whose scatter rows are no one block of rows, 2Type's
    and the lattice's, included: SROWS and SPUT move them by index), or, for a model in PYTHON_ONLY, said why
    it could not."""
    python = run(replace(options, executor="python"))   # (the switches default to the native executor)
    native = run(replace(options, executor="native"))
    for state in native.states.values():
        for program in (state.program, state.backward_program):
            if python_only is None:
                assert program.native is not None and not program.tasks, program.native_why
                assert program.native_table is not None, program.native_why
                assert not program.before and not program.after and program.native_why is None
                assert len(program.native_table) > len(program.task_table) or not program.native.blocks
            else:
                assert program.native is None and python_only in program.native_why
    results_equal(python, native, dtype)


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
def test_bundled_models_native_equals_python_under_every_switch(name, tmp_path):
    for dtype, switches in (("float64", SWITCHES), ("float32", SWITCHES[:1] + SWITCHES[-1:])):
        extra = ["model.variant=child_sum"] if "child_sum" in name else []
        t = Trainer(MODELS / f"{name.replace('_child_sum', '')}.yaml", TINY[name] + extra + [f"train.dtype={dtype}"],
                    run_dir=tmp_path / dtype)
        samples = t.task.data["train"][:10]

        def run(options):
            t.model.options = options
            return t.loss_and_grads(samples)
        for options in switches:
            assert_native_equals_python(run, options, dtype, PYTHON_ONLY.get(name))


@pytest.mark.parametrize("name", sorted(TINY))
def test_one_sample_batches_native_equals_python(name, tmp_path):
    """A batch of one sample: tasks of one row, whose products the executor runs as gemv (numpy's matmul does
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
                assert_native_equals_python(run, options, dtype, PYTHON_ONLY.get(name))


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5), size=st.integers(1, 6), switch=st.integers(0, 15))
def test_random_graphs_native_equals_python(name, seed, k, size, switch):
    build, make_graph = CASES[name]
    rng = np.random.default_rng(seed)
    case = build(rng)
    graphs = [make_graph(rng, int(rng.integers(1, size + 1))) for _ in range(k)]
    per = [case.data(rng, g) for g in graphs]
    feeds = cells.batch_feeds(case, graphs, per)

    def run(options):
        case.model.options = options
        return case.model.forward_backward(graphs, feeds, case.params, RunContext())
    assert_native_equals_python(run, SWITCHES[switch], "float64")


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
            lowered = program.native
            split = {row[0] for row in program.native_table.tolist() if row[3] == -1}
            for b in lowered.blocks:
                if b.tid in split and b.scatter_rows:
                    ops = [(instructions.OPCODES_BY_ID[row[0]], row[8]) for row in lowered.code[slice(*lowered.ranges[b.tid])]]
                    moved |= {"in" for op, load in ops if op == "SROWS" and load} | {"out" for op, _ in ops if op == "SPUT"}
    return moved


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 4), size=st.integers(1, 8), switch=st.integers(0, 15),
       dag=st.booleans(), serial=st.booleans())
def test_interleaved_kinds_native_equals_python(seed, k, size, switch, dag, serial):
    """Random trees and DAGs whose vertices have random kinds (each kind's rows of the scatter tensor
    interleaved with the other's), scheduled by height or one vertex per task: the blocks before and after
    the task loop run natively (by the kinds' row indices) and equal the Python interpreter."""
    rng = np.random.default_rng(seed)
    case = cells.typed_child_sum_tree_lstm(rng)
    shape = (lambda n: random_dag(rng, n, 3)) if dag else (lambda n: random_tree(rng, n, 3))
    graphs = [_typed(rng, shape(2 * int(rng.integers(1, size + 1)))) for _ in range(k)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options,
                                           policy="serial" if serial else None)
    assert_native_equals_python(run, SWITCHES[switch], "float64")


def test_blocks_move_interleaved_rows_by_index_with_the_bounds_checks_on(monkeypatch):
    """Both directions of the row moves by index, checked: the typed child-sum's lazy push reads each kind's
    h back from its interleaved scatter rows (SROWS); one vertex per task (the serial schedule) interleaves the
    Tree-LSTM's leaves with internal vertices, so the leaves' eager block computes [h; c] into scratch and
    puts it into their rows (SPUT). The same numbers as the Python interpreter."""
    monkeypatch.setenv("MINICAVS_NATIVE_CHECK", "1")
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
        assert_native_equals_python(run, EngineOptions(), "float64")
        assert moved <= _moved_by_index(run(EngineOptions(executor="native")))


def _interleaved(name: str):
    """(case, graphs, policy) whose blocks move rows by index: 'typed' reads them in (SROWS), 'serial' also
    puts them (SPUT)."""
    rng = np.random.default_rng(7)
    if name == "typed":
        return cells.typed_child_sum_tree_lstm(rng), [_typed(rng, random_tree(rng, 9, 3)) for _ in range(3)], None
    return cells.binary_tree_lstm(rng), [CASES["binary_tree_lstm"][1](rng, n) for n in (3, 5)], "serial"


def _split_block_instruction(program, opcode: str) -> int:
    """The index of the first ``opcode`` instruction of a block that this batch runs over rows by index."""
    lowered = program.native
    split = {row[0] for row in program.native_table.tolist() if row[3] == -1}
    return next(pc for b in lowered.blocks if b.tid in split for pc in range(*lowered.ranges[b.tid])
                if instructions.OPCODES_BY_ID[lowered.code[pc][0]] == opcode)


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
def test_a_wrong_row_move_by_index_makes_native_differ_from_python(name, backward, opcode, field, change):
    """The row moves by index compute what the blocks read and write: one perturbed SROWS or SPUT (a wrong
    row index array, a column short or off) and the equality with the Python interpreter fails."""
    case, graphs, policy = _interleaved(name)
    feeds = cells.batch_feeds(case, graphs, [case.data(np.random.default_rng(1), g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options, policy=policy)
    python = EngineOptions(executor="python")
    assert_native_equals_python(run, python, "float64")
    state = next(iter(run(EngineOptions(executor="native")).states.values()))
    program = state.backward_program if backward else state.program
    pc = _split_block_instruction(program, opcode)
    code, lowered = program.native.code, program.native
    if change == "child":   # (the same kind's first child index: as many rows, each a valid row)
        key = lowered.keys[code[pc][field]]
        code[pc][field] = lowered.keys.index(("child", 0, key[-1]))
    elif field is None:
        change(code[pc])
    else:
        code[pc][field] = change(int(code[pc][field]))
    with pytest.raises(AssertionError):
        assert_native_equals_python(run, python, "float64")


def test_a_bad_row_index_of_a_block_is_caught_by_the_debug_mode():
    """A kind's row index with a row far outside the scatter tensor: the debug mode's bounds checks catch it
    in SROWS (rows read in) and in SPUT (rows put), instead of a crash."""
    result = _run_script("""
        import numpy as np
        from minicavs import instructions
        from minicavs.cpu import runner as c_runner
        from minicavs.engine import EngineOptions
        from minicavs.executor import RunContext
        from minicavs.memory import MemoryPlan
        from tests import cells
        from tests.test_instructions import _interleaved
        real = MemoryPlan.scatter_rows
        for name in ("typed", "serial"):
            case, graphs, policy = _interleaved(name)
            feeds = cells.batch_feeds(case, graphs, [case.data(np.random.default_rng(1), g) for g in graphs])
            MemoryPlan.scatter_rows = real
            case.model.forward_backward(graphs, feeds, case.params, RunContext(), policy=policy)
            MemoryPlan.scatter_rows = lambda plan, kid: np.append(real(plan, kid)[:-1], 10**9)
            try:
                case.model.forward_backward(graphs, feeds, case.params, RunContext(),
                                            options=EngineOptions(executor="native"), policy=policy)
                print("not caught", name)
            except c_runner.NativeCheckError as e:
                print("caught:", e)
        """, MINICAVS_NATIVE_CHECK="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"caught: native F: task \d+, instruction \d+ \(SROWS dst=r\d+\(.*\) buf=scatter.*\): "
                     r"operand idx is out of bounds", result.stdout), result.stdout
    assert re.search(r"caught: native F: task \d+, instruction \d+ \(SPUT buf=scatter.*\): "
                     r"operand idx is out of bounds", result.stdout), result.stdout


@pytest.mark.parametrize("name", sorted(CASES))
def test_streaming_runs_the_program_natively(name):
    """Streaming is the Python interpreter's way to run the eager blocks task by task on a second thread; the
    native executor runs the same pass's eager blocks batched in its one call (nothing left to overlap), and
    the numbers are the interpreter's, streaming or not."""
    build, make_graph = CASES[name]
    rng = np.random.default_rng(1)
    case = build(rng)
    graphs = [make_graph(rng, n) for n in (5, 2, 7)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    for options in (EngineOptions(streaming=True), EngineOptions(streaming=True, eager_batching=False)):
        assert_native_equals_python(run, options, "float64")
    python = run(EngineOptions(streaming=True, executor="python")).states["G"].program
    assert python.native is None and any(block.stream == "eager" for block in python.before)


@pytest.mark.parametrize("eager", [True, False])
def test_dropout_runs_natively_with_the_python_interpreters_masks(eager):
    """Dropout (DROPOUT: the mask of the task's row keys and a per-run table entry) in the leaves' block
    before the task loop, or (eager batching off) in the task loop: both passes run natively and equal the
    Python interpreter (the same mask bits); the mask changes with the step and is gone outside training."""
    rng = np.random.default_rng(2)
    case = cells.binary_tree_lstm(rng, p_drop=0.3)
    graphs = [InputGraph([[1, 2], [], []]), InputGraph([[1, 2], [3, 4], [], [], []])]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    options = EngineOptions(eager_batching=eager)
    losses = {}
    for ctx in (RunContext(seed=3, step=1), RunContext(seed=3, step=2), RunContext(seed=3, training=False)):
        def run(options):
            return case.model.forward_backward(graphs, feeds, case.params, replace(ctx), options=options)
        assert_native_equals_python(run, options, "float64")
        native = run(options)
        program = native.states["G"].program
        assert "DROPOUT" in "\n".join(program.native.lines())
        losses[(ctx.step, ctx.training)] = float(native.loss)
    assert len(set(losses.values())) == 3, losses


def test_an_op_without_a_native_lowering_leaves_its_pass_to_python():
    """A sum over a vertex axis of a per-row value of two axes (no native lowering: only sums over the rows
    have one): that pass runs in Python, says why, and gives the Python interpreter's numbers."""
    rng = np.random.default_rng(1)
    H, D, C = 3, 2, 4
    p, vals = cells._params(rng, W=(D, H), U=(H, H), b=(H,), Wo=(H, C), bo=(C,))
    F = VertexFunction("f", arity=1, message=(H,), dtype="float64")
    with F:
        h = ops.tanh(ops.linear(F.pull((D,)), p["W"], p["b"]) + F.gather(0) @ p["U"])
        z = ops.sum(ops.reshape(h, (1, H)), axis=0)
        F.scatter(z)
        F.push(z)
    case = cells._one_kind_classifier(F, p, vals, H, D, C)
    graphs = [InputGraph.chain(n) for n in (3, 5)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    native = run(EngineOptions(executor="native"))
    program = native.states["G"].program
    assert program.native is None and "op 'sum' has no native lowering" in program.native_why, program.native_why
    results_equal(run(EngineOptions(executor="python")), native, "float64")


def test_dump_shows_the_instructions():
    rng = np.random.default_rng(0)
    case = cells.binary_tree_lstm(rng, H=2)
    trees = [InputGraph([[1, 2], [], []]), InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, trees, [case.data(rng, g) for g in trees])
    case.model.options = EngineOptions(executor="native")
    state = case.model.forward_backward(trees, feeds, case.params, RunContext()).states["G"]
    text = state.program.dump()
    assert "one native call: the blocks before the task loop, tasks 0:2, the blocks after it" in text
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
        if event == "call" and frame.f_code.co_name in ("run_block", "emit_gradients"):
            counts[frame.f_code.co_name] += 1
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
    native = EngineOptions(executor="native")
    calls = _step_calls(case, short, native)
    assert calls == _step_calls(case, long, native)
    # the blocks before and after the task loop (x·W over all rows; the parameter gradients) run in the same
    # native call: no block is interpreted in Python
    assert calls["run_block"] == calls["emit_gradients"] == 0, calls
    python = EngineOptions(executor="python")
    assert sum(_step_calls(case, long, python).values()) > sum(_step_calls(case, short, python).values())
    assert _step_calls(case, short, replace(python, streaming=True))["run_block"] > 0


def _run_script(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_corrupted_offset_is_caught_by_the_debug_mode_not_a_crash():
    result = _run_script("""
        import numpy as np
        from minicavs import instructions
        from minicavs.cpu import runner as c_runner
        from minicavs.engine import EngineOptions
        from minicavs.executor import RunContext
        from minicavs.inputs import InputGraph
        from tests import cells
        rng = np.random.default_rng(0)
        case = cells.binary_tree_lstm(rng)
        trees = [InputGraph([[1, 2], [], []])] * 3
        feeds = cells.batch_feeds(case, trees, [case.data(rng, g) for g in trees])
        case.model.options = EngineOptions(executor="native")
        state = case.model.forward_backward(trees, feeds, case.params, RunContext()).states["G"]
        code = state.program.native.code
        pc = next(i for i in range(len(code)) if instructions.OPCODES_BY_ID[code[i][0]] == "BIND"
                  and code[i][3] == instructions.SCATTER_ROWS)
        code[pc][4] += 10**9   # the column offset: far outside the scatter tensor
        try:
            case.model.forward_backward(trees, feeds, case.params, RunContext())
        except c_runner.NativeCheckError as e:
            print("caught:", e)
        """, MINICAVS_NATIVE_CHECK="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"caught: native F: task \d+, instruction \d+ \(BIND dst=r\d+\(.*\) buf=scatter.* "
                     r"col=1000000000.*\): operand \w+ is out of bounds", result.stdout), result.stdout


def test_without_a_compiler_the_python_interpreter_trains_with_one_warning(tmp_path):
    result = _run_script(f"""
        import warnings
        warnings.simplefilter("always")
        from minicavs.training import Trainer
        from tests.models.test_models import MODELS, TINY
        with warnings.catch_warnings(record=True) as caught:
            t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + ["train.engine.executor=native",
                        "train.epochs=1"], run_dir={str(tmp_path / 'run')!r})
            for step in range(3):
                loss, _ = t.train_step(list(range(8 * step, 8 * step + 8)))
        native = [str(w.message) for w in caught if "native executor" in str(w.message)]
        print(len(native), native[0] if native else "")
        state = t.loss_and_grads(t.task.data["train"][:4]).states
        print("tasks in python:", all(s.program.tasks for s in state.values()), "loss", loss)
        """, CC="/nonexistent", MINICAVS_CACHE=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-2000:]
    count, rest = result.stdout.split(" ", 1)
    assert count == "1" and "no C compiler (/nonexistent)" in rest, result.stdout
    assert "tasks in python: True loss" in result.stdout


def test_dispatch_overhead_is_measured():
    ns = instructions.dispatch_ns(CPU, count=10_000, tasks=2, repeats=1)
    assert 0 < ns < 1e6


def test_inference_native_equals_python():
    """Forward only (no backward state kept): the template of an inference pass stores less."""
    rng = np.random.default_rng(3)
    case = cells.child_sum_tree_lstm(rng)
    graphs = [CASES["child_sum"][1](rng, 5) for _ in range(4)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    python = case.model.infer(graphs, feeds, case.params, options=EngineOptions(executor="python"))
    native = case.model.infer(graphs, feeds, case.params, options=EngineOptions(executor="native"))
    assert native.states["G"].program.native is not None if native.states else True
    for name in python.pushes["G"]:
        equal(python.pushes["G"][name], native.pushes["G"][name])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_one_tree_inference_native_equals_python_and_the_batched_pass(dtype, tmp_path):
    """The path ``bench.point`` times at batch 1 (the bundled Tree-LSTM, forward only, one tree per pass): the
    native pass equals the Python interpreter's (loss, every vertex's class probabilities, the pushed states)
    and each tree alone equals its rows of a batch of all of them (serial per-sample evaluation)."""
    t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + [f"train.dtype={dtype}"], run_dir=tmp_path)
    trees = t.task.data["train"][:6]

    def infer(samples, executor):
        t.model.options = EngineOptions(executor=executor)
        graphs, feeds = t.task.batch(samples)
        return t.model.infer(graphs, feeds, t.params, t.context(training=False))

    alone = []
    for tree in trees:
        python, native = infer([tree], "python"), infer([tree], "native")
        program = native.states["tree"].program
        assert program.native_table is not None and not program.blocks(), program.native_why
        close(python.loss, native.loss, dtype)
        close(python.outputs["probs"], native.outputs["probs"], dtype)
        close(python.pushes["tree"]["h"], native.pushes["tree"]["h"], dtype)
        alone.append(native)
    batched = infer(trees, "native")
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
    """∂F's W_h^T is read as a contiguous copy when multi-row tasks multiply by it enough (cpu/runner.py):
    the same loss and gradients as multiplying by the transposed view and as Python's, up to rounding (BLAS
    may sum in another order for another layout)."""
    t = Trainer(MODELS / "var_lstm.yaml", TINY["var_lstm"] + [f"train.dtype={dtype}"], run_dir=tmp_path)
    samples = t.task.data["train"][:10]
    copied = record_contiguous_copies(monkeypatch)
    runs = {}
    for threshold in (1, 10 ** 9):
        monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", threshold)
        t.model.options = EngineOptions(executor="native")
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
    assert_native_equals_python(lambda o: (setattr(t.model, "options", o), t.loss_and_grads(samples))[1],
                                EngineOptions(), dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_few_row_products_by_a_wide_static_run_transposed_with_the_same_numbers(dtype, tmp_path, monkeypatch):
    """A task of at most SMALL_M_ROWS rows multiplies by F's W_h (hidden x 4 hidden) as C^T = W_h^T·A^T on
    the static's transposed copy (cpu/runner.py, codegen/native.py), and (TWIN_ELEMENTS lowered so that
    this small model takes it) ∂F's dgates·W_h^T on W_h itself: the same loss and gradients as the plain
    products (the path switched off) and as the Python interpreter, at tasks of 1 to 40 rows (one row takes
    the GEMV; more than SMALL_M_ROWS the plain GEMM), with the debug mode's bounds checks on."""
    monkeypatch.setenv("MINICAVS_NATIVE_CHECK", "1")
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
            t.model.options = EngineOptions(executor="native")
            runs[rows] = t.loss_and_grads(samples)
            assert (20, 5) in twins                     # F's W_h^T made for the task loop (and ∂F's W_h^T)
        a, b = runs.values()
        close(a.loss, b.loss, dtype)
        assert set(a.grads) == set(b.grads)
        for k in a.grads:
            close(a.grads[k], b.grads[k], dtype)
        monkeypatch.setattr(c_runner, "SMALL_M_ROWS", 32)
        assert_native_equals_python(lambda o: (setattr(t.model, "options", o), t.loss_and_grads(samples))[1],
                                    EngineOptions(), dtype)


def test_a_wide_static_only_the_blocks_read_gets_no_transposed_copy(tmp_path, monkeypatch):
    """The Tree-LSTM's leaf W (embed x 3 hidden: twice as wide as deep) is read only by F's block of all the
    leaves: no transposed copy of it is made per forward pass (it would serve that one product; the task
    loop's statics keep theirs: the Var-LSTM test above), and training equals the Python interpreter's."""
    monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", 1)
    t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + ["train.dtype=float64"], run_dir=tmp_path)
    samples = t.task.data["train"][:8]
    shape = t.params["W"].value.shape
    assert shape[1] >= 2 * shape[0]
    copies = record_contiguous_copies(monkeypatch)
    t.model.options = EngineOptions(executor="native")
    graphs, feeds = t.task.batch(samples)
    program = t.model.infer(graphs, feeds, t.params, t.context(training=False)).states["tree"].program
    assert program.native_table is not None and shape[::-1] not in copies, copies   # (the old rule made it)
    assert_native_equals_python(lambda o: (setattr(t.model, "options", o), t.loss_and_grads(samples))[1],
                                EngineOptions(), "float64")


def test_tree_fc_task_loop_moves_no_rows_when_siblings_are_side_by_side(monkeypatch):
    """Complete trees (siblings adjacent, a forest): F's loop reads [h_l; h_r] as a view and writes h into
    the scatter tensor in place; ∂F's product dY·Wᵀ is written straight into the children's rows of the
    scatter gradient, so no COPY or ADJ runs (a skipped instruction adds nothing to the per-opcode clock).
    Irregular trees still take the adjoints; both equal the Python interpreter."""
    from minicavs.data.trees import complete_binary_tree
    rng = np.random.default_rng(5)
    case = cells.tree_fc(rng, H=4)
    complete = [complete_binary_tree(8).to_graph()] * 3
    irregular = [CASES["tree_fc"][1](rng, n) for n in (5, 7, 6)]
    moved = {}
    for label, graphs in (("complete", complete), ("irregular", irregular)):
        feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
        prof = np.zeros(len(instructions.OPCODES) + 1, np.int64)
        monkeypatch.setattr(c_runner, "PROFILE", prof)

        def run(options):
            return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
        assert_native_equals_python(run, EngineOptions(executor="python"), "float64")
        moved[label] = {op: int(prof[i]) for i, op in enumerate(instructions.OPCODES) if op in ("COPY", "ADJ")}
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
    lowered = program.native
    tid = next(tid for tid, t in zip(lowered.kids, lowered.templates)
               if f"kind '{t.kind}' {instructions.PHASE_WORDS[t.phase]} block" == template)
    begin, end = lowered.ranges[tid]
    return next(pc for pc in range(begin, end) if instructions.OPCODES_BY_ID[lowered.code[pc][0]] == opcode)


@pytest.mark.parametrize("backward, template, opcode, field, change", [
    (False, "kind 'leaf' before tasks block", "GEMM", 6, lambda v: v - 1),   # x·W without x's last column
    (False, "kind 'internal' after tasks block", "PUT", 5, lambda v: v - 1),   # push one column short
    (True, "kind 'leaf' after tasks block", "SUMROWS", 4, lambda v: v - 1),    # the bias sum one column short
    (True, "kind 'internal' after tasks block", "GEMM", 3, lambda v: v - 1),   # dU one row short
])
def test_a_wrong_block_instruction_makes_native_differ_from_python(backward, template, opcode, field, change):
    """The blocks the native executor runs are what computes those values: one perturbed instruction of a
    block template (the linked program is cached with the model, so the next run uses it) and the equality
    with the Python interpreter fails."""
    rng = np.random.default_rng(4)
    case = cells.binary_tree_lstm(rng)
    graphs = [InputGraph([[1, 2], [], [3, 4], [], []]), InputGraph([[1, 2], [], []])]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    python = EngineOptions(executor="python")
    assert_native_equals_python(run, python, "float64")
    state = run(EngineOptions(executor="native")).states["G"]
    program = state.backward_program if backward else state.program
    pc = _block_instruction(program, template, opcode)
    program.native.code[pc][field] = change(int(program.native.code[pc][field]))
    with pytest.raises(AssertionError):
        assert_native_equals_python(run, python, "float64")


def test_a_bad_offset_in_a_block_instruction_is_caught_by_the_debug_mode():
    """The debug mode's bounds checks cover the blocks' instructions: a block's BIND of a tensor's rows, and
    TAKETO (Tree-FC's lazy ∂F gathers [h_l; h_r] again, row by row where the children are not side by
    side), each given a column offset far outside its buffer."""
    result = _run_script("""
        import numpy as np
        from minicavs import instructions
        from minicavs.cpu import runner as c_runner
        from minicavs.engine import EngineOptions
        from minicavs.executor import RunContext
        from minicavs.inputs import InputGraph
        from tests import cells
        from tests.test_engine import CASES
        from tests.test_instructions import _block_instruction
        rng = np.random.default_rng(5)
        for name, make, backward, template, opcode, field in (
                ("binary_tree_lstm", lambda: [InputGraph([[1, 2], [], []])] * 3, False,
                 "kind 'leaf' before tasks block", "BIND", 4),
                ("tree_fc", lambda: [CASES["tree_fc"][1](rng, n) for n in (5, 7, 6)], True,
                 "kind 'internal' after tasks block", "TAKETO", 6)):
            case = getattr(cells, name)(rng)
            graphs = make()
            feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
            case.model.options = EngineOptions(executor="native")
            state = case.model.forward_backward(graphs, feeds, case.params, RunContext()).states["G"]
            program = state.backward_program if backward else state.program
            pc = _block_instruction(program, template, opcode)
            program.native.code[pc][field] += 10**9
            try:
                case.model.forward_backward(graphs, feeds, case.params, RunContext())
                print("not caught", opcode)
            except c_runner.NativeCheckError as e:
                print("caught:", e)
        """, MINICAVS_NATIVE_CHECK="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"caught: native F: task \d+, instruction \d+ \(BIND dst=r\d+\(.*\) buf=tensor.* "
                     r"col=1000000000.*\): operand \w+ is out of bounds", result.stdout), result.stdout
    assert re.search(r"caught: native ∂F: task \d+, instruction \d+ \(TAKETO dst=r\d+\(.*\) buf=scatter.* "
                     r"col=1000000000\): operand \w+ is out of bounds", result.stdout), result.stdout


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), H=st.integers(1, 5), k=st.integers(1, 3), size=st.integers(1, 6),
       switch=st.integers(0, 15))
def test_per_row_matrices_native_equals_python(seed, H, k, size, switch):
    """Per-row values of three axes (cells.per_row_matrices: static · M · static, Mᵀ · X, elementwise over the
    flat rows) lower natively, BMM and all, and give the Python interpreter's numbers."""
    rng = np.random.default_rng(seed)
    case = cells.per_row_matrices(rng, H)
    graphs = [InputGraph.chain(int(rng.integers(1, size + 1))) for _ in range(k)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    assert_native_equals_python(run, SWITCHES[switch], "float64")
    native = run(replace(SWITCHES[switch], executor="native")).states["G"]
    assert "BMM" in "\n".join(native.program.native.lines() + native.backward_program.native.lines())


def test_a_fused_input_broadcast_along_the_last_axis_of_a_per_row_matrix_leaves_its_pass_to_python():
    """A per-row (H, 1) vector scaling an (H, H) matrix row by row reads one number per row of the matrix, not
    per flat row: the kernel over flat rows cannot express it, so that pass runs in Python and says why."""
    rng = np.random.default_rng(5)
    case = cells.per_row_matrices(rng, 3, col_factor=True)
    graphs = [InputGraph.chain(n) for n in (2, 4)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])

    def run(options):
        return case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=options)
    native = run(EngineOptions(executor="native"))
    why = native.states["G"].program.native_why
    assert native.states["G"].program.native is None and "broadcast as a col" in why, why
    results_equal(run(EngineOptions(executor="python")), native, "float64")
