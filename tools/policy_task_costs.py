"""What a task saved is worth (issue 18's throughput target): per batching policy, the training step split into
prepare (input graphs, schedule, memory plan), forward, backward and update, and the marginal cost per task
saved against the first policy: (step time difference) / (tasks saved), forward and backward apart, with what
a 1.1x speedup would need per task saved. A policy named ``split:NAME`` is NAME's schedule with every task cut
in two (the same FLOPs in more tasks): against NAME it measures what one more task costs.

Every policy computes the same vertices (the same FLOPs); a policy with fewer tasks saves only per-task costs
(dispatch, a GEMM's packing of its weight, a kernel launch) and gains from larger GEMMs. One trainer per
policy, the same batches; passes alternate (the machine is shared), medians are reported, in wall-clock and
process CPU milliseconds per batch (with ``OPENBLAS_NUM_THREADS=1`` CPU time is the work done; on a loaded
machine wall time mostly measures waiting). ``--gemm`` also times one sgemm (rows x hidden) @ (hidden x
4 hidden), the shape of an LSTM cell's product, against its rows: its intercept is the per-call cost.

    OPENBLAS_NUM_THREADS=1 python tools/policy_task_costs.py [--models tree_lstm_2type,lattice_lstm]
        [--policies cavs,fsm:S3,agenda] [--batches 8] [--repeats 5] [--hidden 256] [--gemm]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import minicavs.engine.model as model_module  # noqa: E402
from minicavs.bench.policies import trainer_for  # noqa: E402
from minicavs.runtime.scheduler import Policy, Schedule, get_policy  # noqa: E402

PARTS = ("prepare", "forward", "backward", "update", "step")


class SplitPolicy(Policy):
    """A policy's schedule with every task of two or more vertices cut in two halves (the same vertices in
    the same order: a valid schedule, since the vertices of a task never depend on each other): the same
    FLOPs in more tasks, so the step time difference per extra task is the marginal cost of a task."""

    def __init__(self, inner: str):
        self.inner, self.name = get_policy(inner), f"split:{inner}"

    def schedule(self, batch):
        s = self.inner.schedule(batch)
        sizes = s.sizes()
        cut = s.task_ptr[:-1] + sizes // 2
        keep = sizes >= 2
        ptr = np.sort(np.concatenate((s.task_ptr, cut[keep])))
        kinds = np.repeat(s.task_kind, np.where(keep, 2, 1))
        return Schedule(s.order, ptr, kinds, s.row)


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
            t = trainer_for(model, hidden=hidden, policy=name.split(":", 1)[1] if name.startswith("split:") else name)
            if name.startswith("split:"):
                t.policy = SplitPolicy(name.split(":", 1)[1])
            t.prepare_policy()
            runs[name] = (t, {k: [] for k in PARTS})
        data = next(iter(runs.values()))[0].task.data["train"][:64 * batches]
        tasks = {}
        for name, (t, _) in runs.items():
            graphs = [t.task.batch(data[i:i + 64])[0] for i in range(0, len(data), 64)]
            tasks[name] = float(np.mean([sum(t.policy.schedule(b).num_tasks for b in t.model.batches(g).values())
                                         for g in graphs]))
        batches_of = [data[i:i + 64] for i in range(0, len(data), 64)]
        for rep in range(repeats + 1):       # batch by batch, the policies back to back, the order flipped
            for b, samples in enumerate(batches_of):
                for name in (policies if (rep + b) % 2 else policies[::-1]):
                    t, record = runs[name]
                    clock["forward"][:] = clock["backward"][:] = 0
                    s0, c0 = time.perf_counter(), time.process_time()
                    t.model.forget_plans()    # training's batches are new: no plan cached for them
                    graphs, feeds = t.task.batch(samples)
                    prepared = t.model.prepare(graphs, t.policy)
                    s1, c1 = time.perf_counter(), time.process_time()
                    res = t.model.run(prepared, feeds, t.params, t.context(True))
                    s2, c2 = time.perf_counter(), time.process_time()
                    t.optimizer.step(res.grads, loss=res.loss)
                    s3, c3 = time.perf_counter(), time.process_time()
                    if rep:                    # the first pass warms up
                        for k, v in (("prepare", (s1 - s0, c1 - c0)), ("forward", clock["forward"]),
                                     ("backward", clock["backward"]), ("update", (s3 - s2, c3 - c2)),
                                     ("step", (s3 - s0, c3 - c0))):
                            record[k].append(1e3 * np.asarray(v, float))
    finally:
        model_module.forward, model_module.backward = engine_forward, engine_backward
    # per batch and pass, paired with the first policy's step on the same batch in the same pass
    first = runs[policies[0]][1]
    out = {}
    for name, (_, rec) in runs.items():
        out[name] = {"tasks": tasks[name], **{k: np.median(np.array(v), axis=0).tolist() for k, v in rec.items()}}
        out[name]["paired"] = {k: np.median(np.array(first[k])[:, 1] - np.array(v)[:, 1]).item() for k, v in rec.items()}
        ratio = np.array(first["step"])[:, 1] / np.array(rec["step"])[:, 1]
        out[name]["speedup_quartiles"] = np.percentile(ratio, [25, 50, 75]).tolist()
    return out


def report(model: str, res: dict, repeats: int) -> None:
    names = list(res)
    print(f"== {model}: ms per batch of 64, median over {repeats} passes x batches, each policy's step on a batch "
          "right after the others' (wall / CPU)")
    for name in names:
        r = res[name]
        print(f"  {name:8s} tasks {r['tasks']:6.1f}  " + "  ".join(f"{k} {r[k][0]:6.2f}/{r[k][1]:6.2f}" for k in PARTS))
    base = res[names[0]]
    for name in names[1:]:
        r = res[name]
        saved = base["tasks"] - r["tasks"]
        q = r["speedup_quartiles"]
        line = (f"  {name} vs {names[0]}: {saved:.1f} tasks saved; CPU step speedup (paired per batch) {q[1]:.3f} "
                f"[quartiles {q[0]:.3f}-{q[2]:.3f}]")
        if saved:
            per = {k: 1e3 * r["paired"][k] / saved for k in ("forward", "backward", "step")}
            need = 1e3 * base["step"][1] * (1 - 1 / 1.1) / saved
            line += (f"; CPU per task saved (median paired difference / tasks saved; a negative count: per task added): forward {per['forward']:.0f} us, "
                     f"backward {per['backward']:.0f} us, step {per['step']:.0f} us; 1.1x would need {need:.0f} us")
        print(line)


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
    p.add_argument("--repeats", type=int, default=5)
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
