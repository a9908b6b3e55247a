"""The static graph on top of a structure linked into F's forward program (minicavs/engine/linked_head.py): for the
bundled tree models' TINY configs it gives, in float64 on every runner (reference, C runner, emulated CUDA
issuing loop), the loss, outputs and every gradient of its own program and of the step runner; its gradients
match finite differences; a batch is one bind and one runner call per pass; explain() says where it ran."""
from __future__ import annotations

import pytest

from minicavs.cuda import Cuda
from minicavs.engine import linked_head, program as binding
from minicavs.engine.explain import explain
from minicavs.train.testing import check_model_grads

from .test_static_program import _equal, _model, _run, _steps_only

TREES = ["tree_fc", "tree_gru", "tree_lstm", "tree_lstm_2type", "tree_lstm_child_sum"]
RUNNERS = [("reference", False, "reference runner"), ("device", False, "C runner"), ("device", True, "cuda runner")]


def _apart(t, graphs, feeds, runner: str, device=None, **switches):
    """The same step with the head as a program of its own (linking refused: what ran before)."""
    keep = linked_head.refusal
    linked_head.refusal = lambda *args: "a program of its own, for comparison"
    t.model._static.programs.clear()   # (each program keeps why it is not linked)
    try:
        return _run(t, graphs, feeds, runner, device, check=True, **switches)
    finally:
        linked_head.refusal = keep
        t.model._static.programs.clear()


def _linked(result) -> list:
    return [run for run in result.static if run.linked.startswith("linked")]


@pytest.mark.parametrize("name", TREES)
def test_the_linked_head_equals_its_own_program_and_the_step_runner_on_every_runner(cuda_standin, name, tmp_path):
    t, graphs, feeds = _model(name, tmp_path)
    steps = _steps_only(t, graphs, feeds)
    for runner, emulated, who in RUNNERS:
        device = Cuda(cuda_standin) if emulated else None
        apart = _apart(t, graphs, feeds, runner, device)
        got = _run(t, graphs, feeds, runner, device, check=True)
        assert not _linked(apart) and len(_linked(got)) == 1, (name, who)
        assert _linked(got)[0].program.runner == who
        _equal(got, apart, f"{who}: linked against its own program")
        _equal(got, steps, f"{who}: linked against the step runner")
        inference = t.model.infer(graphs, feeds, {k: p.value for k, p in t.params.items()}) if device is None \
            else None
        if inference is not None:
            assert _linked(inference) and abs(inference.loss - steps.loss) <= 1e-12 * max(1.0, abs(steps.loss))


@pytest.mark.parametrize("name", ["tree_fc", "tree_lstm"])
def test_the_linked_heads_gradients_match_finite_differences(name, tmp_path):
    t, graphs, feeds = _model(name, tmp_path)
    params = {k: p.value for k, p in t.params.items()}
    report = check_model_grads(t.model, graphs, feeds, params, directions=2, ctx=t.context(training=False))
    assert set(report) == set(params)
    assert _linked(t.model.forward_backward(graphs, feeds, params, t.context(training=False)))


def _counted(monkeypatch) -> dict:
    """Count the binds (F's and ∂F's, a static program's) and the device runner's calls."""
    counts = {"bind": 0, "run": 0}

    def counting(what, fn):
        def wrapper(*args, **kwargs):
            counts[what] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(binding, "bind", counting("bind", binding.bind))
    monkeypatch.setattr(binding.BatchProgram, "of", classmethod(counting("bind", binding.BatchProgram.of.__func__)))
    return counts


@pytest.mark.parametrize("name", ["tree_lstm", "tree_fc"])
def test_a_batch_is_one_bind_and_one_runner_call_per_pass(name, tmp_path, monkeypatch):
    t, graphs, feeds = _model(name, tmp_path)
    params = {k: p.value for k, p in t.params.items()}
    t.model.forward_backward(graphs, feeds, params)   # (compiled and linked before counting)
    counts = _counted(monkeypatch)
    device = t.model.device
    monkeypatch.setattr(device, "run", lambda program, run=device.run: (counts.__setitem__("run", counts["run"] + 1),
                                                                          run(program))[1])
    t.model.infer(graphs, feeds, params)
    assert counts == {"bind": 1, "run": 1}, counts
    t.model.forward_backward(graphs, feeds, params)
    assert counts == {"bind": 3, "run": 3}, counts   # (forward and backward: one each)


def test_explain_says_where_the_head_ran_and_why_not_linked(tmp_path, monkeypatch):
    t, graphs, feeds = _model("tree_lstm", tmp_path)
    params = {k: p.value for k, p in t.params.items()}
    text = str(explain(t.model, graphs, feeds, params))
    assert "linked into the forward program of structure" in text
    monkeypatch.setattr(linked_head, "refusal", lambda *args: "refused for this test")
    t.model._static.programs.clear()
    text = str(explain(t.model, graphs, feeds, params))
    assert "apart from the structure's program: refused for this test" in text


@pytest.mark.parametrize("name", ["tree_lstm", "lstm_nmt"])   # (lstm_nmt: two structures, linked into the last)
def test_the_linked_head_equals_its_own_program_under_streaming_and_every_switch_off(name, tmp_path):
    t, graphs, feeds = _model(name, tmp_path)
    for switches in ({"streaming": True}, {"lazy_batching": False, "eager_batching": False, "fusion": False,
                                           "gather_elision": False, "merge_gemms": False}):
        got = _run(t, graphs, feeds, "device", **switches)
        assert len(_linked(got)) == 1, switches
        _equal(got, _apart(t, graphs, feeds, "device", **switches), f"{name} {switches}")
