"""What a task saved is worth (issue 18's throughput target): per batching policy, the training step split into
prepare (input graphs, schedule, memory plan), forward, backward and update, and the marginal cost per task
saved against the first policy: (step time difference) / (tasks saved), forward and backward apart, with what
a 1.1x speedup would need per task saved.

Every policy computes the same vertices (the same FLOPs); a policy with fewer tasks saves only per-task costs
(dispatch, a GEMM's packing of its weight, a kernel launch) and gains from larger GEMMs. One trainer per
policy, the same batches; passes alternate (the machine is shared), medians are reported, in wall-clock and
process CPU milliseconds per batch (with ``OPENBLAS_NUM_THREADS=1`` CPU time is the work done; on a loaded
machine wall time mostly measures waiting). ``--gemm`` also times one sgemm (rows x hidden) @ (hidden x
4 hidden), the shape of an LSTM cell's product, against its rows: its intercept is the per-call cost.

    OPENBLAS_NUM_THREADS=1 python tools/policy_task_costs.py [--models tree_lstm_2type,lattice_lstm]
        [--policies cavs,fsm:S3,agenda] [--batches 8] [--repeats 9] [--hidden 256] [--gemm]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import minicavs.model as model_module  # noqa: E402
from minicavs.bench.policies import trainer_for  # noqa: E402

PARTS = ("prepare", "forward", "backward", "update", "step")


def clocked(fn, clock: dict, key: str):
    """``fn`` adding its wall and CPU seconds to ``clock[key]``."""
    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[key] += (time.perf_counter() - wall, time.process_time() - cpu)
    return timed


def task_costs(model: str, policies: list, batches: int, repeats: int, hidden: int) -> dict:
    clock = {"forward": np.zeros(2), "backward": np.zeros(2)}
    engine_forward, engine_backward = model_module.forward, model_module.backward
    model_module.forward = clocked(engine_forward, clock, "forward")      # the engine's two passes, as
    model_module.backward = clocked(engine_backward, clock, "backward")   # Model.run calls them
    try:
        runs = {}
        for name in policies:
            t = trainer_for(model, hidden=hidden, policy=name)
            t.prepare_policy()
            runs[name] = (t, {k: [] for k in PARTS})
        data = next(iter(runs.values()))[0].task.data["train"][:64 * batches]
        tasks = {}
        for name, (t, _) in runs.items():
            graphs = [t.task.batch(data[i:i + 64])[0] for i in range(0, len(data), 64)]
            tasks[name] = float(np.mean([sum(t.policy.schedule(b).num_tasks for b in t.model.batches(g).values())
                                         for g in graphs]))
        for rep in range(repeats + 1):
            for name in (policies if rep % 2 else policies[::-1]):
                t, record = runs[name]
                total = {k: np.zeros(2) for k in PARTS}
                for i in range(0, len(data), 64):
                    clock["forward"][:] = clock["backward"][:] = 0
                    s0, c0 = time.perf_counter(), time.process_time()
                    graphs, feeds = t.task.batch(data[i:i + 64])
                    prepared = t.model.prepare(graphs, t.policy)
                    s1, c1 = time.perf_counter(), time.process_time()
                    res = t.model.run(prepared, feeds, t.params, t.context(True))
                    s2, c2 = time.perf_counter(), time.process_time()
                    t.optimizer.step(res.grads, loss=res.loss)
                    s3, c3 = time.perf_counter(), time.process_time()
                    total["prepare"] += (s1 - s0, c1 - c0)
                    total["forward"] += clock["forward"]
                    total["backward"] += clock["backward"]
                    total["update"] += (s3 - s2, c3 - c2)
                    total["step"] += (s3 - s0, c3 - c0)
                if rep:                        # the first pass warms up
                    for k in PARTS:
                        record[k].append(1e3 * total[k] / (len(data) // 64))
    finally:
        model_module.forward, model_module.backward = engine_forward, engine_backward
    return {name: {"tasks": tasks[name], **{k: np.median(np.array(v), axis=0).tolist() for k, v in rec.items()},
                   "step_cpu_range": [min(v[1] for v in rec["step"]), max(v[1] for v in rec["step"])]}
            for name, (_, rec) in runs.items()}


def report(model: str, res: dict, repeats: int) -> None:
    names = list(res)
    print(f"== {model}: ms per batch of 64, median of {repeats} alternating passes (wall / CPU)")
    for name in names:
        r = res[name]
        print(f"  {name:8s} tasks {r['tasks']:6.1f}  " + "  ".join(f"{k} {r[k][0]:6.2f}/{r[k][1]:6.2f}" for k in PARTS)
              + f"  (step CPU {r['step_cpu_range'][0]:.1f}-{r['step_cpu_range'][1]:.1f})")
    base = res[names[0]]
    for name in names[1:]:
        r = res[name]
        saved = base["tasks"] - r["tasks"]
        if saved <= 0:
            continue
        per = {k: 1e3 * (base[k][1] - r[k][1]) / saved for k in ("forward", "backward", "step")}
        need = 1e3 * base["step"][1] * (1 - 1 / 1.1) / saved
        print(f"  {name} vs {names[0]}: {saved:.1f} tasks saved; CPU per task saved: forward {per['forward']:.0f} us, "
              f"backward {per['backward']:.0f} us, step {per['step']:.0f} us; step CPU speedup "
              f"{base['step'][1] / r['step'][1]:.3f}; 1.1x would need {need:.0f} us per task saved")


def gemm_curve(hidden: int, repeats: int = 200) -> None:
    """Median microseconds of one float32 (rows x hidden) @ (hidden x 4 hidden) and of its backward pair."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((hidden, 4 * hidden)).astype(np.float32)
    print(f"== sgemm (rows x {hidden}) @ ({hidden} x {4 * hidden}), median us of {repeats} (CPU), "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        x = rng.standard_normal((rows, hidden)).astype(np.float32)
        g = rng.standard_normal((rows, 4 * hidden)).astype(np.float32)
        times = {"x@W": [], "g@W^T": [], "x^T@g": []}
        for _ in range(repeats):
            for k, f in (("x@W", lambda: x @ w), ("g@W^T", lambda: g @ w.T), ("x^T@g", lambda: x.T @ g)):
                c = time.process_time()
                f()
                times[k].append(time.process_time() - c)
        print(f"  rows {rows:4d}: " + "  ".join(f"{k} {1e6 * np.median(v):7.1f}" for k, v in times.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tree_lstm_2type,lattice_lstm")
    p.add_argument("--policies", default="cavs,fsm:S3,agenda")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--gemm", action="store_true", help="also time the LSTM cell's GEMM against its rows")
    args = p.parse_args()
    print("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    for m in args.models.split(","):
        report(m, task_costs(m, args.policies.split(","), args.batches, args.repeats, args.hidden), args.repeats)
    if args.gemm:
        gemm_curve(args.hidden)
    print("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
