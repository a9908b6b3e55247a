"""minicavs/engine/explain.py on models of static graphs: ``explain`` shows the static graphs a run ran (the
seq2seq model, the foreach Var-LSTM, the loss on top of a structure), their control-flow ops with their trip
counts and bodies, what was fused and who ran them. Each fact is checked against what spies saw run (the step
interpreter, the device's runner, the control-flow bodies) and against the model's own graph, never against
explain's output captured once."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from minicavs.engine import alg1, program, static_program
from minicavs.engine.explain import explain
from minicavs.ops import control
from minicavs.ir.graph import Graph
from minicavs.train.trainer import Trainer

MODELS = Path(__file__).resolve().parents[2] / "models"
# (the sizes and dtype of tests/models' tiny models: the kernels they compile are the session cache's already)
SEQ2SEQ = ["model.hidden=8", "model.embed=4", "model.max_len=4", "data.synthetic.train=12",
           "data.synthetic.dev=2", "data.synthetic.test=2", "train.dtype=float64"]
VAR_LSTM = ["model.embed=6", "model.hidden=5", "data.synthetic.train=12", "data.synthetic.dev=2",
            "data.synthetic.test=2", "data.synthetic.vocab=30", "model.dropout=0.0", "train.dtype=float64"]


@pytest.fixture
def spies(monkeypatch) -> dict:
    """What ran, seen from outside explain: every step the step runner ran, every program the device's
    runner (or the reference runner standing in) ran, and how often each control-flow body ran."""
    seen = {"steps": [], "programs": [], "bodies": Counter()}
    run_steps, run_program, run_body = program.run_steps, alg1._run, control.Subgraph.run

    def steps_spy(steps, env, xp, ctx, outs=None):
        seen["steps"] += list(steps)
        return run_steps(steps, env, xp, ctx, outs)

    def program_spy(prog, state):
        seen["programs"].append(prog)
        return run_program(prog, state)

    def body_spy(self, xp, values):
        seen["bodies"][self.name] += 1
        return run_body(self, xp, values)

    monkeypatch.setattr(program, "run_steps", steps_spy)
    monkeypatch.setattr(alg1, "_run", program_spy)
    monkeypatch.setattr(control.Subgraph, "run", body_spy)
    return seen


@pytest.fixture
def step_runner(monkeypatch) -> None:
    """Static graphs on the step runner alone (no node lowered): the path these tests describe, which a graph
    the static programs decline still takes (a static program's loops: tests/engine/test_static_loops.py)."""
    monkeypatch.setattr(static_program, "refusal", lambda node: "the step runner's path, for this test")


def _trainer(config: str, overrides: list, tmp_path) -> tuple:
    t = Trainer(MODELS / config, overrides, run_dir=tmp_path / "run")
    graphs, feeds = t.task.batch(t.task.data["train"][:5])
    return t, graphs, feeds


def _loops(report) -> dict:
    """Control-flow node label -> its LoopReport, over every static graph of an explanation."""
    return {loop.label: loop for r in report.static for loop in r.loops}


def _check_static_facts(report, seen: dict) -> None:
    """The static graphs explain lists are the steps the interpreter ran, none fused, no device runner."""
    listed = [r.steps for r in report.static]
    assert sum(listed) == len(seen["steps"]) > 0
    ran_ops = Counter(s.outputs[0].op for s in seen["steps"] if not s.fused)
    assert sum((Counter(r.ops) for r in report.static), Counter()) == ran_ops
    assert sum(r.fused for r in report.static) == sum(s.fused for s in seen["steps"]) == 0
    text = str(report)
    assert "program.run_steps" in text and "no fused kernel" in text and "fused kernels 0" in text
    assert "C runner runs only vertex functions' programs" in text


def _check_loops_ran(report, seen: dict) -> None:
    """Each loop's steps are the times its body ran; each body's size is its graph's computed nodes."""
    by_body = Counter()
    for loop in _loops(report).values():
        by_body[loop.name] += loop.ran
        for role, body in loop.bodies:
            sub = dict(loop.flow.bodies)[role]
            computed = [n for n in Graph(sub.outputs).nodes if n not in set(sub.args)]
            assert body.nodes == len(computed) and sum(body.ops.values()) == len(computed)
    for name, runs in by_body.items():
        assert seen["bodies"][name] == runs, name
    text = str(report)
    for label, loop in _loops(report).items():
        assert f"{label} '{loop.name}'" in text and f"{loop.ran} of {loop.flow.length} steps ran" in text


def test_seq2seq_shows_its_loops_their_bodies_and_the_interpreter_that_ran_them(spies, step_runner, tmp_path):
    t, graphs, feeds = _trainer("seq2seq.yaml", SEQ2SEQ, tmp_path)
    report = explain(t.model, graphs, feeds, t.params)
    assert report.structures == [] and str(report)
    _check_static_facts(report, spies)
    assert spies["programs"] == []   # nothing of this model reached a vertex function's runner
    forward = [n for n in Graph([t.model.loss]).nodes if n.op == "foreach"]
    backward = [s.outputs[0] for s in spies["steps"] if s.outputs[0].op == "foreach" and s.outputs[0] not in forward]
    assert len(forward) == 2 and len(backward) == 2
    loops = _loops(report)
    assert set(loops) == {n.label() for n in forward + backward}
    L = t.task.max_len
    assert {loops[n.label()].name: loops[n.label()].flow.length for n in forward} == {"encoder": L, "decoder": L + 1}
    _check_loops_ran(report, spies)


def test_seq2seq_decoder_shows_its_while_loop_and_the_steps_it_ran(spies, step_runner, tmp_path):
    t, graphs, feeds = _trainer("seq2seq.yaml", SEQ2SEQ, tmp_path)
    decoder = t.task.decoder
    report = explain(decoder, graphs, feeds, t.params)
    (greedy,) = [loop for loop in _loops(report).values() if loop.label.startswith("while_loop")]
    steps = int(decoder.infer(graphs, feeds, t.params).outputs["steps"])   # the loop's own count output
    assert greedy.name == "greedy" and greedy.flow.length == t.task.max_len + 1 and greedy.ran == steps
    assert [role for role, _ in greedy.bodies] == ["body", "cond"]
    assert spies["bodies"]["greedy"] == 2 * steps   # explain's run and the infer above
    _check_loops_ran(report, {"bodies": Counter({k: v // 2 for k, v in spies["bodies"].items()})})


def test_foreach_var_lstm_shows_the_steps_its_batch_ran(spies, step_runner, tmp_path):
    t, graphs, feeds = _trainer("var_lstm.yaml", VAR_LSTM + ["model.graph=foreach"], tmp_path)
    report = explain(t.model, graphs, feeds, t.params)
    _check_static_facts(report, spies)
    assert spies["programs"] == []
    loops = _loops(report)
    assert len(loops) == sum(s.outputs[0].op == "foreach" for s in spies["steps"]) == 2   # forward, backward
    longest = max(len(x) for x, _ in t.task.data["train"][:5])
    assert int(feeds["lengths"].max()) == longest < t.task.length   # (a trip count per sentence: the longest's)
    assert all(loop.ran == longest and loop.flow.length == t.task.length for loop in loops.values())
    _check_loops_ran(report, spies)


def test_a_structure_with_static_graphs_on_top_shows_both(spies, tmp_path):
    t, graphs, feeds = _trainer("var_lstm.yaml", VAR_LSTM, tmp_path)
    report = explain(t.model, graphs, feeds, t.params)
    (structure,) = report.structures
    assert [p.runner for p in structure.programs] == [p.runner for p in spies["programs"]] == ["C runner"] * 2
    f_statics = {n for s in t.model.structures for fn in s.compiled.values() for n in fn.static_fwd + fn.static_bwd}
    static_steps = [s for s in spies["steps"] if s.outputs[0] not in f_statics]
    assert sum(r.steps for r in report.static) == len(static_steps)
    ops = sum((Counter(r.ops) for r in report.static), Counter())
    assert ops == Counter(s.outputs[0].op for s in static_steps)
    on_top = {n.op for n in Graph([t.model.loss]).nodes} - {"input", "param"}
    # the graph on top of the structure runs as programs of the C runner (static_program.py), not step by step
    programs = [r.program for r in report.static if r.program is not None]
    assert programs and all(p.runner == "C runner" and p.declined is None for p in programs)
    lowered = {n.op for p in programs for n in p.lowered.templates[0].regs}
    assert on_top <= lowered and not on_top & set(ops) and "softmax_cross_entropy" in on_top
    pushes = sum(g.num_vertices for g in graphs)   # every vertex of a chain pushes its h
    assert any(int(p.table[0, 2]) == pushes for p in programs)   # the loss's rows: one per pushing vertex
    assert "backward, the gradient of push 'chain.h'" in str(report)
    assert str(report).count("one call of the C runner") >= len(programs)
    assert str(report).index("structure 'chain'") < str(report).index("static graphs:")


def test_on_a_device_explain_names_its_array_module_and_reads_the_steps_run(cuda_standin, tmp_path):
    """``train.device=cuda`` on the device stand-in: the static graphs run over the device's module, and the
    steps a loop ran (a count the run left on the device) are read back for the report: the CPU's."""
    cpu, graphs, feeds = _trainer("var_lstm.yaml", VAR_LSTM + ["model.graph=foreach"], tmp_path / "cpu")
    dev, _, _ = _trainer("var_lstm.yaml", VAR_LSTM + ["model.graph=foreach", "train.device=cuda"], tmp_path / "dev")
    on_cpu, on_dev = explain(cpu.model, graphs, feeds, cpu.params), explain(dev.model, graphs, feeds, dev.params)
    module = dev.model.device.xp.__name__
    assert module != "numpy" and all(module in r.runner for r in on_dev.static)
    assert [loop.ran for loop in _loops(on_dev).values()] == [loop.ran for loop in _loops(on_cpu).values()]
    assert [r.nbytes for r in on_dev.static] == [r.nbytes for r in on_cpu.static]
