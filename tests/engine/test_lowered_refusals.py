"""No bundled model's pass is declined: for every model in models/*.py with its default configuration (sizes
and data made small; everything else, dropout included, as shipped), F and ∂F of each structure run on the C
runner and on the emulated CUDA issuing loop, neither declining them (``c_refusal`` None, no APPLY). A model
whose pass is declined is listed in KNOWN with the reason, a strict expected failure (never a skip).

Static graphs (a loss, a classifier, seq2seq, which is made of static graphs only) run as static programs
(engine/static_program.py): each is run by the same runner, never declined, and no loop of one is left to the
step runner (program.run_steps)."""
from __future__ import annotations

from pathlib import Path

import pytest

from minicavs.cpu import CPU
from minicavs.cuda import Cuda
from minicavs.engine.executor import RunContext
from minicavs.ops.flow import is_loop
from minicavs.train.config import REPO_ROOT
from minicavs.train.trainer import Trainer

from ..models.test_models import TINY

NAMES = sorted(p.stem for p in (REPO_ROOT / "models").glob("*.py"))
SIZES = {name: [o for o in TINY[name] if not o.startswith("model.dropout")] for name in TINY}
SIZES["seq2seq"] = ["model.embed=4", "model.hidden=5", "data.synthetic.train=8", "data.synthetic.dev=4",
                    "data.synthetic.test=4"]
KNOWN: dict = {}   # model -> why a pass of it is declined (none today)


def _passes(t: Trainer, device) -> dict:
    """{structure and pass: (runner, why a C loop declines it, why the runner declined it)} of one step of four
    samples on ``device`` (the trainer's parameters copied there)."""
    graphs, feeds = t.task.batch(t.task.data["train"][:4])
    params = t.params if device is CPU else {k: device.asarray(p.value) for k, p in t.params.items()}
    t.model.device = device
    try:
        result = t.model.forward_backward(graphs, feeds, params, RunContext(seed=3, step=1))
    finally:
        t.model.device = CPU
    passes = {f"{s} {p.title}": (p.runner, p.lowered.c_refusal, p.declined) for s, state in result.states.items()
              for p in (state.program, state.backward_program) if p is not None}
    for run in result.static:
        if run.program is not None:
            passes[f"static {run.title}"] = (run.program.runner, run.program.lowered.c_refusal, run.program.declined)
        loops = [n for n in (run.left or {}) if is_loop(n)]
        passes.update({f"static {run.title}: {n.label()} left": ("step runner", run.left[n], None) for n in loops})
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
