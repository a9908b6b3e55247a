"""The compiler's fused kernels (minicavs/engine/compile.py lowers each fused group to a kernel): what fuses in the
Tree-LSTM's F and ∂F, float32 runs equal the unfused ones, and without a C compiler everything still runs (unfused)
after one warning."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from minicavs.cpu import compiler as ccomp
from minicavs.engine.compile import POST, PRE, TASK, EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.engine.passes.fusion import fusible

from .. import cells
from .test_alg1 import dense, random_tree

ON = EngineOptions()
OFF = replace(ON, fusion=False)


def fused_steps(program):
    return [st for st in program if st.fused]


def test_tree_lstm_internal_task_runs_one_kernel_forward_and_one_backward():
    case = cells.binary_tree_lstm(np.random.default_rng(0))
    internal = case.model.structures[0].compiled["internal"]
    fwd, bwd = internal.phases(ON)
    # Per task, F's elementwise work (σ(i), σ(o), σ(f1), σ(f2), tanh(u), the cell sum, tanh(c), h) is
    # all directly linked: one kernel, which writes the values ∂F reads as extra outputs.
    elementwise = [n for n in internal.row_fwd if fusible(n)]
    (step,) = fused_steps(fwd.programs[TASK])
    assert len(elementwise) == 12 and set(step.run.group.nodes) == set(elementwise)
    assert {"sigmoid", "tanh", "mul", "add"} == {n.op for n in elementwise}
    unfused, _ = internal.phases(OFF)
    # The scattered [h, c] is not copied: the kernel writes h and c into the scatter tensor's rows.
    assert [c for c, _ in fwd.concats[TASK]] == [internal.scatter_source] == [internal.scattered.inputs[0]]
    assert len(fwd.programs[TASK]) == len(unfused.programs[TASK]) - len(elementwise) + 1 - 1
    # ∂F per task: the gradients through the gates and the cell are one kernel too.
    (bstep,) = fused_steps(bwd.programs[TASK])
    assert len(bstep.run.group.nodes) >= 10
    assert all(len(st.run.group.nodes) >= 2 for p in (PRE, TASK, POST)
               for st in fused_steps(fwd.programs[p]) + fused_steps(bwd.programs[p]))
    assert "fused[" in internal.dump()


@pytest.mark.parametrize("seed", range(3))
def test_float32_fused_equals_unfused(seed):
    rng = np.random.default_rng(seed)
    case = cells.binary_tree_lstm(rng, H=5, dtype="float32", p_drop=0.2)
    graphs = [random_tree(rng, int(n), 2, full_binary=True) for n in rng.integers(1, 9, size=6)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
    on, off = (case.model.forward_backward(graphs, feeds, case.params, RunContext(seed=1), options=o)
               for o in (ON, OFF))
    assert on.grads["U"].dtype == np.float32
    assert abs(on.loss - off.loss) <= 1e-5 * max(1.0, abs(off.loss))
    for k in off.grads:
        a, b = dense(on.grads[k]), dense(off.grads[k])
        assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, float(np.max(np.abs(b)))), k


def test_no_compiler_runs_unfused_after_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(ccomp, "_warned", False)
    rng = np.random.default_rng(4)
    with pytest.warns(RuntimeWarning, match="no C compiler") as record:   # F and ∂F compile at model build
        case = cells.binary_tree_lstm(rng)
        graphs = [random_tree(rng, n, 2, full_binary=True) for n in (3, 5)]
        feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
        res = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=ON)
    assert len([w for w in record if "no C compiler" in str(w.message)]) == 1
    internal = case.model.structures[0].compiled["internal"]
    assert not any(fused_steps(prog) for ph in internal.phases(ON) for prog in ph.programs)
    ref = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=OFF)
    assert res.loss == ref.loss


def test_linear_bias_joins_the_kernel_of_its_consumer():
    """Tree-FC's h = tanh([h_l; h_r]·W + b): the linear step only multiplies, one kernel adds b and takes
    tanh, and the results equal the unfused run."""
    rng = np.random.default_rng(9)
    case = cells.tree_fc(rng)
    internal = case.model.structures[0].compiled["internal"]
    fwd, _ = internal.phases(ON)
    (step,) = fused_steps(fwd.programs[TASK])
    (lin,) = [n for n in internal.row_fwd if n.op == "linear"]
    assert step.run.group.biased == {lin: lin.inputs[2]} and [n.op for n in step.run.group.nodes] == ["tanh"]
    assert [st for st in fwd.programs[TASK] if st.outputs[0] is lin][0].inputs == tuple(lin.inputs[:2])
    graphs = [random_tree(rng, n, 2, full_binary=True) for n in (4, 7, 2)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    on, off = (case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=o) for o in (ON, OFF))
    assert abs(on.loss - off.loss) <= 1e-10 * max(1.0, abs(off.loss))
    for k in off.grads:
        assert np.max(np.abs(dense(on.grads[k]) - dense(off.grads[k]))) <= 1e-10 * max(
            1.0, float(np.max(np.abs(dense(off.grads[k]))))), k


def test_eager_elementwise_work_joins_the_task_kernel():
    """σ'(x) = s(1 - s) of ∂F depends only on forward values (eager), but a pass of its own over the whole
    kind would write and read back five arrays: with fusion it is computed inside the per-task kernel."""
    case = cells.binary_tree_lstm(np.random.default_rng(0))
    internal = case.model.structures[0].compiled["internal"]
    _, bwd = internal.phases(ON)
    _, unfused = internal.phases(OFF)
    assert not fused_steps(bwd.programs[PRE]) and len(unfused.programs[PRE]) >= 5
    (step,) = fused_steps(bwd.programs[TASK])
    assert {n.op for n in step.run.group.nodes} >= {"sub", "mul", "accum"}
