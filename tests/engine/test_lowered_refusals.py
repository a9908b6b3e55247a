"""No bundled model's pass is declined: for every model in models/*.py with its default configuration (sizes
and data made small; everything else, dropout included, as shipped), F and ∂F of each structure run on the C
runner and on the emulated CUDA issuing loop, neither declining them (``c_refusal`` None, no APPLY). A model
whose pass is declined is listed in KNOWN with the reason, a strict expected failure (never a skip).

Static graphs (a loss, a classifier, seq2seq, which is made of static graphs only) run as static programs
(engine/static_program.py): each is run by the same runner, never declined, and no loop of one is left to the
step runner (program.run_steps). The same holds for predict's pass (the outputs a model exports, no loss:
seq2seq's greedy decoding, a while_loop)."""
from __future__ import annotations

from pathlib import Path

import pytest

from minicavs.cpu import CPU
from minicavs.cuda import Cuda
from minicavs.engine.executor import RunContext
from minicavs.engine.model import Model
from minicavs.ops.flow import is_loop
from minicavs.train.config import REPO_ROOT
from minicavs.train.predict import predict_lines
from minicavs.train.trainer import Trainer

from ..models.test_models import TINY

NAMES = sorted(p.stem for p in (REPO_ROOT / "models").glob("*.py"))
SIZES = {name: [o for o in TINY[name] if not o.startswith("model.dropout")] for name in TINY}
SIZES["seq2seq"] = ["model.embed=4", "model.hidden=5", "data.synthetic.train=8", "data.synthetic.dev=4",
                    "data.synthetic.test=4"]
KNOWN: dict = {}   # model -> why a pass of it is declined (none today)
# input lines of ``minicavs predict`` per reader (Task.parse_input's class): trees, sentences, digit strings
LINES = {"TreeLSTM": ["((a b) c)", "(d (e f))", "g"], "LanguageModel": ["w0 w1 w2", "w3"], "BiLSTM": ["w0 w1 w2", "w3"],
         "Reverse": ["1 2 3", "4", "5 6 7 8"]}


def _passes(t: Trainer, device) -> dict:
    """{structure and pass: (runner, why a C loop declines it, why the runner declined it)} of one step of four
    samples on ``device`` (the trainer's parameters copied there), and of predict's pass over them (the outputs
    the model exports: seq2seq's greedy decoding) where the model predicts."""
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    params = t.params if device is CPU else {k: device.asarray(p.value) for k, p in t.params.items()}
    t.model.device = device
    try:
        result = t.model.forward_backward(graphs, feeds, params, RunContext(seed=3, step=1))
        predicted = _predicted(t, device) if t.task.predicts else []
    finally:
        t.model.device = CPU
    passes = _ran(result, "")
    for got in predicted:
        passes.update(_ran(got, "predict "))
    return passes


def _predicted(t: Trainer, device) -> list:
    """The results of the inference passes ``minicavs predict`` runs (Task.predict, its own outputs and feeds)
    over a few input lines, the parameters on ``device``."""
    results, infer, kept = [], Model.infer, {k: p.value for k, p in t.params.items()}

    def recorded(model, *args, **kwargs):
        results.append(infer(model, *args, **kwargs))
        return results[-1]
    Model.infer = recorded
    try:
        for p in t.params.values():
            p.value = device.asarray(p.value)
        predict_lines(t.task, LINES[t.task.parse_input.__func__.__qualname__.split(".")[0]], 4)
    finally:
        Model.infer = infer
        for k, p in t.params.items():
            p.value = kept[k]
    assert results, "predict ran no pass"
    return results


def _ran(result, what: str) -> dict:
    """The passes of ``result`` as :func:`_passes` lists them, each named after ``what``."""
    passes = {f"{what}{s} {p.title}": (p.runner, p.lowered.c_refusal, p.declined)
              for s, state in result.states.items() for p in (state.program, state.backward_program) if p is not None}
    for run in result.static:
        if run.program is not None:
            passes[f"{what}static {run.title}"] = (run.program.runner, run.program.lowered.c_refusal,
                                                   run.program.declined)
        loops = [n for n in (run.left or {}) if is_loop(n)]
        passes.update({f"{what}static {run.title}: {n.label()} left": ("step runner", run.left[n], None)
                       for n in loops})
    return passes


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN[n]))
                                  if n in KNOWN else n for n in NAMES])
def test_no_bundled_models_pass_is_declined_by_the_c_runner_or_the_cuda_issuing_loop(cuda_standin, name,
                                                                                      tmp_path: Path):
    t = Trainer(REPO_ROOT / "models" / f"{name}.yaml", SIZES.get(name, []), run_dir=tmp_path / name)
    for device, runner in ((CPU, "C runner"), (Cuda(cuda_standin), "cuda runner")):
        passes = _passes(t, device)
        assert passes or name == "seq2seq", (name, "no vertex function")   # (static graphs only)
        for what, got in passes.items():
            assert got == (runner, None, None), (name, what, got)


@pytest.mark.parametrize("name", NAMES)
def test_no_bundled_models_static_graph_leaves_a_node_to_the_step_runner(name, tmp_path: Path):
    """Every node of a training step's static graphs is the program's or the host's (a pull stage's gather, a
    row-sparse gradient paired from rows and ids: static_sparse.py), none run by program.run_steps."""
    t = Trainer(REPO_ROOT / "models" / f"{name}.yaml", SIZES.get(name, []), run_dir=tmp_path / name)
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    result = t.model.forward_backward(graphs, feeds, t.params, RunContext(seed=3, step=1))
    left = [(run.title, n.op, why) for run in result.static for n, why in (run.left or {}).items()]
    assert not left and not [run.title for run in result.static if run.steps], (name, left)
