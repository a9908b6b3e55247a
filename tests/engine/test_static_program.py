"""Static graphs as instruction programs (minicavs/engine/static_program.py): for every bundled model with static
graphs, every runner (the reference runner, the C runner, the emulated CUDA issuing loop) gives the loss, outputs
and gradients of the step runner (program.run_steps, the path before) in float64; the C runner declines none of the
head-and-loss programs; the lowered graph's gradients match finite differences; a corrupted ROWOP is refused by
every runner naming the operand; a bad label or row index is a FeedError naming the op."""
from __future__ import annotations

import re

import numpy as np
import pytest

from minicavs.core.errors import CheckError, FeedError
from minicavs.cuda import Cuda, issue
from minicavs.engine import linked_head, static_program
from minicavs.engine.backend import to_host
from minicavs.engine.compile import EngineOptions
from minicavs.engine.lowered import OPCODES_BY_ID
from minicavs.train.testing import check_model_grads

from ..models.test_models import TINY, trainer

FOREACH = {"var_lstm_foreach": ("var_lstm", TINY["var_lstm"] + ["model.graph=foreach"]),
           "seq2seq": ("seq2seq", ["model.hidden=8", "model.embed=4", "model.max_len=4", "data.synthetic.train=12",
                                   "data.synthetic.dev=2", "data.synthetic.test=2"])}
# the ops of the graph on top of a structure that must run in a program, not on the step runner
HEAD = {"tree_lstm": {"linear", "softmax_cross_entropy", "softmax", "sum", "mul", "xent_grad", "broadcast_like"},
        "tree_fc": {"lookup", "linear", "sum", "mul"},
        "var_lstm": {"linear", "softmax_cross_entropy", "sum", "mul", "xent_grad", "broadcast_like"}}


def _model(name: str, tmp_path):
    if name in FOREACH:
        from minicavs.train.trainer import Trainer
        from ..models.test_models import MODELS
        config, overrides = FOREACH[name]
        t = Trainer(MODELS / f"{config}.yaml", overrides + ["train.dtype=float64"], run_dir=tmp_path / name)
    else:
        t = trainer(name, tmp_path, "train.dtype=float64")
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    return t, graphs, feeds


def _run(t, graphs, feeds, runner: str, device=None, **switches):
    """A training step's forward and backward on ``runner`` (``device``: the emulated CUDA device)."""
    params = {k: p.value for k, p in t.params.items()}
    model, options = t.model, EngineOptions(runner=runner, **switches)
    if device is None:
        return model.forward_backward(graphs, feeds, params, t.context(training=False), options=options)
    cpu, model.device = model.device, device
    try:
        return model.forward_backward(graphs, feeds, {k: device.asarray(v) for k, v in params.items()},
                                      t.context(training=False), options=options)
    finally:
        model.device = cpu


def _steps_only(t, graphs, feeds):
    """The same step with every static graph on the step runner (no node lowered, no row-sparse gradient paired on
    the host: what ran before)."""
    keep = static_program.refusal, static_program._assembled
    static_program.refusal = lambda node: "the step runner's run, for comparison"
    static_program._assembled = lambda node, where: False
    try:
        t.model._static.programs.clear()
        return _run(t, graphs, feeds, "device")
    finally:
        static_program.refusal, static_program._assembled = keep
        t.model._static.programs.clear()


def _dense(value) -> np.ndarray:
    value = value.to_dense() if hasattr(value, "to_dense") else value
    return np.asarray(to_host(value))


def _equal(got, want, what: str) -> None:
    assert got.loss is not None and abs(float(to_host(got.loss)) - want.loss) <= 1e-12 * max(1.0, abs(want.loss)), \
        (what, got.loss, want.loss)
    for kind, gots, wants in (("gradient", got.grads, want.grads), ("output", got.outputs, want.outputs)):
        assert set(gots) == set(wants), (what, kind)
        for k in wants:
            a, b = _dense(gots[k]), _dense(wants[k])
            assert a.shape == b.shape and np.abs(a - b).max(initial=0) <= 1e-12 * max(1.0, np.abs(b).max(initial=0)), \
                (what, kind, k, np.abs(a - b).max())


def _programs(result) -> list:
    return [run.program for run in result.static if run.program is not None]


@pytest.mark.parametrize("name", sorted(TINY) + sorted(FOREACH))
def test_every_runner_gives_the_step_runners_loss_outputs_and_gradients(cuda_standin, name, tmp_path):
    t, graphs, feeds = _model(name, tmp_path)
    want = _steps_only(t, graphs, feeds)
    assert not _programs(want)
    for runner, device, who in [("reference", None, "reference runner"), ("device", None, "C runner"),
                                ("device", Cuda(cuda_standin), "cuda runner")]:
        got = _run(t, graphs, feeds, runner, device, check=True)   # (every instruction's spans checked)
        _equal(got, want, who)
        assert _programs(got) or name in FOREACH, name
        for program in _programs(got):
            assert program.runner == who and program.declined is None, (program.runner, program.declined)


@pytest.mark.parametrize("name", sorted(HEAD))
def test_the_c_runner_runs_the_head_and_loss_of_a_structure_and_declines_nothing(name, tmp_path):
    t, graphs, feeds = _model(name, tmp_path)
    got = _run(t, graphs, feeds, "device")
    lowered = {n.op for p in _programs(got) for n in p.lowered.templates[0].regs}
    left = {n.op for run in got.static for n in (run.left or {})}
    assert HEAD[name] <= lowered and not HEAD[name] & left, (HEAD[name] - lowered, left)
    for program in _programs(got):
        assert program.lowered.c_refusal is None and program.declined is None and program.runner == "C runner"
    # (row-sparse gradients, literals; a pull's lookup alone only moves rows: no program for it)
    assert left <= {"lookup_grad", "ones_like", "constant", "lookup"}


@pytest.mark.parametrize("name", ["tree_fc", "tree_lstm"])
def test_the_lowered_static_graphs_gradients_match_finite_differences(name, tmp_path):
    t, graphs, feeds = _model(name, tmp_path)
    params = {k: p.value for k, p in t.params.items()}
    report = check_model_grads(t.model, graphs, feeds, params, directions=2, ctx=t.context(training=False))
    assert set(report) == set(params)
    assert _programs(t.model.forward_backward(graphs, feeds, params, t.context(training=False)))


def _corrupted(t, graphs, feeds, runner: str, device, operand: int, value: int):
    """Run, set ``operand`` of the first ROWOP of the forward head's program to ``value``, run again (check
    mode)."""
    got = _run(t, graphs, feeds, runner, device, check=True)
    code = next(p for p in _programs(got) if "ROWOP" in [OPCODES_BY_ID[op] for op in p.lowered.code[:, 0]])
    code = code.lowered.code
    pc = int(np.flatnonzero([OPCODES_BY_ID[op] == "ROWOP" for op in code[:, 0]])[0])
    old = int(code[pc][1 + operand])
    code[pc][1 + operand] = value
    try:
        _run(t, graphs, feeds, runner, device, check=True)
    finally:
        code[pc][1 + operand] = old


@pytest.mark.parametrize("operand, value, name", [   # (the first span that fails: cols past the rows' is src's)
    (1, 10**6, "dst"), (2, -1, "src"), (5, 10**6, "src"), (5, -2, "cols"), (4, 10**6, "labels"), (4, -1, "labels"),
    (0, 9, "fn")])
def test_a_wrong_rowop_is_refused_by_all_three_naming_the_operand(cuda_standin, operand, value, name,
                                                                     tmp_path, monkeypatch):
    monkeypatch.setattr(linked_head, "refusal", lambda *args: "a program of its own, for this test")
    t, graphs, feeds = _model("tree_lstm", tmp_path)
    expected = [("reference", None, CheckError, r"reference static graph: task 0, instruction \d+ \(ROWOP .*\): "
                                                rf"(operand {name}|register|buffer)"),
                ("device", None, CheckError, r"C runner static graph: task 0, instruction \d+ \(ROWOP .*\): operand "
                                             rf"{name} is out of bounds"),
                ("device", Cuda(cuda_standin), issue.IssueCheckError,
                 rf"cuda static graph: task 0, instruction \d+ \(ROWOP .*\): operand {name} is out of bounds")]
    for runner, device, error, message in expected:
        with pytest.raises(error, match=message):
            _corrupted(t, graphs, feeds, runner, device, operand, value)


def test_a_bad_label_or_root_row_is_a_feed_error_naming_the_op_and_changes_nothing(tmp_path):
    for name, key, op in [("tree_lstm", "labels", "softmax_cross_entropy"), ("tree_fc", "roots", "lookup")]:
        t, graphs, feeds = _model(name, tmp_path)
        bad = dict(feeds)
        bad[key] = np.array(feeds[key], copy=True)
        bad[key][-1] = 10**6
        before = {k: p.value.copy() for k, p in t.params.items()}
        for runner in ("device", "reference"):
            with pytest.raises(FeedError, match=rf"{op}.*out of range|{op}.*10+"):
                _run(t, graphs, bad, runner)
        assert all(np.array_equal(p.value, before[k]) for k, p in t.params.items())


def test_a_row_value_of_another_length_is_a_feed_error_not_a_read_past_its_end(tmp_path):
    """Tree-FC's targets (one per root) one longer than its roots: the program reads its rows by the roots' count,
    so the binder refuses the feed, naming it, on every runner."""
    t, graphs, feeds = _model("tree_fc", tmp_path)
    bad = dict(feeds, target=np.append(feeds["target"], 0.5))
    for runner in ("device", "reference"):
        with pytest.raises(FeedError, match=r"'target' .*has \d+ rows where the static graph's other values have"):
            _run(t, graphs, bad, runner)


def test_the_c_runners_softmax_over_a_wide_vocabulary_equals_the_step_runners_in_float32(tmp_path):
    """ROWOP's row functions over 300+ columns (vector blocks of 256 and a tail, rows at the program's stride)
    against the step runner's library kernels and numpy's cross-entropy, float32."""
    from minicavs.train.trainer import Trainer
    from ..models.test_models import MODELS
    rng = np.random.default_rng(3)
    words = [f"w{i}" for i in range(330)]
    text = tmp_path / "wide.txt"
    order = rng.permutation(words * 2)   # every word twice, sentences of 6
    text.write_text("\n".join(" ".join(order[i:i + 6]) for i in range(0, len(order), 6)) + "\n")
    t = Trainer(MODELS / "var_lstm.yaml", TINY["var_lstm"] + [f"data.train={text}", f"data.dev={text}",
                                                             f"data.test={text}", "train.dtype=float32"],
                run_dir=tmp_path / "run")
    assert t.params["W_o"].value.shape[1] > 300
    graphs, feeds = t.task.batch(t.task.data["train"][:8])
    want = _steps_only(t, graphs, feeds)
    got = _run(t, graphs, feeds, "device", check=True)
    assert [p.runner for p in _programs(got)] and all(p.runner == "C runner" for p in _programs(got))
    assert abs(float(to_host(got.loss)) - want.loss) <= 1e-5 * abs(want.loss)
    assert set(got.grads) == set(want.grads) and set(got.outputs) == set(want.outputs)
    for k, b in [*want.grads.items(), *want.outputs.items()]:
        a, b = _dense({**got.grads, **got.outputs}[k]), _dense(b)
        assert np.abs(a - b).max(initial=0) <= 1e-5 * max(1.0, np.abs(b).max(initial=0)), k


def test_literals_and_parameter_transposes_are_kept_from_run_to_run(tmp_path):
    """A static program's literals (the zeros its loops' gradient sums start from) are made once, read-only,
    and a parameter's transpose (∂'s Wᵀ) is the same view while the parameter is the same array (updated in
    place), a new one when the array is replaced: the same operands run after run, which the binder and the
    C runner's table keep. Each run gives the step runner's numbers."""
    t, graphs, feeds = _model("seq2seq", tmp_path)
    seen = []
    real = static_program.StaticProgram.prepare

    def prepare(self, env, *args):
        real(self, env, *args)
        if self.lowered is not None:
            seen.append({n: v for n, v in env.items() if not n.has_rows and n.op not in ("input", "param")})
    static_program.StaticProgram.prepare = prepare
    try:
        runs = [_run(t, graphs, feeds, "device") for _ in range(2)]
        t.params["dec_Wh"].value = t.params["dec_Wh"].value * 0.5
        runs.append(_run(t, graphs, feeds, "device"))
    finally:
        static_program.StaticProgram.prepare = real
    first, second, third = seen
    views = {n for n in first if n.op == "transpose"}
    assert views and len(first) > len(views), first   # (both kinds there: the check is not vacuous)
    assert all(second[n] is first[n] for n in first)
    assert all(not first[n].flags.writeable for n in first if n not in views)
    replaced = {n for n in views if n.inputs[0].name == "dec_Wh"}
    assert replaced and all((third[n] is first[n]) == (n not in replaced) for n in first)
    for got in runs[1:]:
        _equal(got, _steps_only(t, graphs, feeds) if got is runs[-1] else runs[0], "a later run")


def test_int_values_given_as_floats_are_checked_exact_and_in_range():
    """A loop's int input given to the program in its float type (static_program._as_float, checked by its
    extremes): whole numbers past what the float holds exactly are refused naming the input, a label outside
    the classes naming the entry; the rest is given exactly."""
    from minicavs import ops
    node = ops.input((None, 3), "int64", name="tgt")
    ok = np.array([[0, 11, 5], [2 ** 24, 3, 1]])
    np.testing.assert_array_equal(static_program._as_float(ok, np.float32, node, np, None), ok)
    with pytest.raises(FeedError, match=r"'tgt': int values past what the program's float32 holds exactly"):
        static_program._as_float(ok + 1, np.float32, node, np, None)
    assert static_program._as_float(ok + 1, np.float64, node, np, None)[1, 0] == 2 ** 24 + 1
    for bad, at in ((-1, "[1, 2] = -1"), (12, "[1, 2] = 12")):
        labels = np.array([[0, 11, 5], [3, 3, bad]])
        with pytest.raises(FeedError, match=re.escape(f"'tgt'{at}: a label of a loop's step must be a class")):
            static_program._as_float(labels, np.float32, node, np, 12)
    assert static_program._as_float(np.zeros((0, 3), np.int64), np.float32, node, np, 12).shape == (0, 3)
