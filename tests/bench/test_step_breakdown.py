"""`minicavs bench --step-breakdown`: the parts of a training step are named and add up to it, the products
counted off the programs are the model's equations, and the mode writes its table (tiny sizes: seconds)."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from minicavs.bench import step_breakdown as sb
from minicavs.bench.sweeps import Point
from minicavs.bench.workloads import Data, build
from minicavs.engine import alg1, program
from minicavs.train.config import ConfigError

H, B, E = 16, 8, 128   # (Data.tree_embed)


@pytest.fixture(scope="module")
def measured():
    t = build(Point("tree_lstm", H, B), Data(trees=24))
    samples = t.task.data["train"]
    sb.instrumented_steps(t, len(samples), B)   # (compiles, sizes the workspace)
    return t, samples, sb.instrumented_steps(t, len(samples), B)


def test_parts_are_named_and_add_up_to_the_step(measured):
    t, samples, r = measured
    parts, cpu = r["parts"], r["cpu_s"]
    assert list(parts) == list(sb.PARTS) and r["steps"] == 3
    assert sum(parts.values()) == pytest.approx(cpu, rel=1e-9)   # glue is the rest ...
    # ... and small: the timed parts do not overlap (their sum is within the step, 2% for clock reads) and
    # leave at most a third of a tiny step's CPU time unnamed (Python between them; ~1% at hidden 512)
    assert -0.02 * cpu <= parts["glue"] <= cpu / 3
    assert all(parts[p] > 0 for p in ("products", "fused kernels", "row moves", "runner (Python)", "bind",
                                      "schedule", "static graphs", "optimizer"))
    assert all(parts[p] >= 0 for p in sb.PARTS if p != "glue")


def _spin(seconds: float) -> None:
    import time
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_part_is_timed_exclusive_of_the_timed_calls_inside_it():
    """A static graph's program run by the runner inside Model._evaluate is the runner's time, not also the
    static graphs' (the parts overlapped once static graphs became programs: glue was -55% of a Var-LSTM step)."""
    from types import SimpleNamespace
    timers = sb._Timers()
    box = SimpleNamespace(inner=lambda: _spin(0.05), runner=lambda: _spin(0.03))
    box.outer = lambda: (_spin(0.02), box.inner(), box.runner())
    timers.wrap(box, "inner", "bind")
    timers.wrap(box, "outer", "static graphs")
    run = box.runner

    def runner():   # as _RunnerClock's: timed apart, then charged to the call it ran inside
        import time
        start = time.process_time()
        run()
        timers.charge(time.process_time() - start)
    box.runner = runner
    box.outer()
    assert timers.seconds["bind"] == pytest.approx(0.05, abs=0.01)
    assert timers.seconds["static graphs"] == pytest.approx(0.02, abs=0.01)


def test_the_wrappers_are_gone_afterwards(measured):
    t = measured[0]
    assert not {"batch"} & set(vars(t.task)) and not {"_plan", "_evaluate"} & set(vars(t.model))
    assert "run" not in vars(t.device) and "step" not in vars(t.optimizer) and t.device.clock is None
    assert alg1.evaluate is program.evaluate and alg1.binding.bind.__module__ == program.__name__


def test_products_counted_off_the_programs_are_the_equations(measured):
    """Forward per leaf x·W (E x 3H), per internal vertex [h1; h2]·U (2H x 3H) and h_k·U_fk (H x H, twice);
    backward twice that (the inputs' and the weights' gradients); the classifier at every vertex (H x 5 classes)
    runs in the C runner too (the static graph on top, a program), forward and its two gradients."""
    _, samples, r = measured
    vertices = sum(len(s.children) for s in samples)
    leaves = sum(sum(1 for ch in s.children if not ch) for s in samples)
    internal = vertices - leaves
    forward = 2 * (leaves * E * 3 * H + internal * (2 * H * 3 * H + 2 * H * H))
    classifier = 2 * vertices * H * 5
    assert sum(2 * m * n * k * c for (m, n, k, _, _), c in r["gemms"].items()) == 3 * forward + 3 * classifier


def test_product_rates_time_each_shape_with_numpy():
    gemms = Counter({(1, 64, 32, 0, 0): 3, (40, 64, 32, 1, 0): 2, (200, 32, 64, 0, 1): 1})
    rates = sb.product_rates(gemms, gemm_s=1e-3)
    flops = 2 * 64 * 32 * (3 * 1 + 2 * 40 + 200)
    assert rates["flops"] == flops and rates["gflops"] == pytest.approx(flops / 1e-3 / 1e9)
    assert rates["shapes"] == 3 and rates["numpy_s"] > 0
    assert set(rates["classes"]) == {"1-1", "33-128", ">128"}
    assert sum(c["numpy_s"] for c in rates["classes"].values()) == pytest.approx(rates["numpy_s"])


def test_the_mode_writes_its_table(tmp_path):
    text = sb.run_step_breakdown(H, B, Data(trees=16), 1, {}, tmp_path)
    for part in sb.PARTS + ("outside the products", "numpy at the same", "kernel"):
        assert part in text
    res = json.loads((tmp_path / "step_breakdown.json").read_text())
    assert res["machine"]["env"] == {"MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    assert (tmp_path / "step_breakdown.md").read_text().strip() == text


def test_a_bad_size_is_one_line():
    from types import SimpleNamespace
    from minicavs.bench import _step_breakdown
    args = SimpleNamespace(step_breakdown=0, trees=None, repeats=None)
    with pytest.raises(ConfigError, match="--step-breakdown must be positive, got 0"):
        _step_breakdown(args)
