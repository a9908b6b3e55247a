"""Scheduling cost per vertex (issue 3): make_batch, the Cavs policy and the memory plan, vectorised.

Prints, for 64 complete binary trees of 511 vertices and for 64 SST-sized random binary trees, the median
microseconds per vertex of each stage, the buffer allocation of a binary Tree-LSTM (hidden 150) reported
separately, and the function calls per task in the engine's forward and backward passes (counted with
sys.setprofile: every Python and C function call, divided by the number of tasks).

    python tools/bench_schedule.py [--repeats 9]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minicavs.data.synthetic import sentence_lengths  # noqa: E402
from minicavs.engine.compile import EngineOptions  # noqa: E402
from minicavs.engine.executor import RunContext  # noqa: E402
from minicavs.runtime.inputs import InputGraph, make_batch  # noqa: E402
from minicavs.runtime.memory import plan_memory  # noqa: E402
from minicavs.engine.model import leaf_internal  # noqa: E402
from minicavs.runtime.scheduler import CavsPolicy  # noqa: E402


def random_binary(rng, leaves):
    children = [[] for _ in range(leaves)]
    nodes = list(range(leaves))
    while len(nodes) > 1:
        i = int(rng.integers(0, len(nodes) - 1))
        children.append([nodes[i], nodes[i + 1]])
        nodes[i:i + 2] = [len(children) - 1]
    return InputGraph(children)


def workloads(seed=0):
    rng = np.random.default_rng(seed)
    sst = [random_binary(rng, int(n)) for n in sentence_lengths(rng, 64)]
    return {"64 complete binary trees (511 vertices)": [InputGraph.complete_binary_tree(256)] * 64,
            "64 SST-sized random binary trees": sst}


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def tree_lstm(hidden=150, embed=300):
    from tests import cells
    case = cells.binary_tree_lstm(np.random.default_rng(0), H=hidden, D=embed, V=1000, C=5, dtype="float32")
    return case


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    case = tree_lstm()
    s = case.model.structures[0]
    arity = {k: f.arity for k, f in s.functions.items()}
    pulls = {k: tuple(f.pulls) for k, f in s.functions.items()}
    pushes = {k: tuple(f.pushes) for k, f in s.functions.items()}
    print(f"{'workload':<42} {'vertices':>8} {'batch':>7} {'policy':>7} {'plan':>7} {'total':>7}  "
          f"{'alloc':>8}   (microseconds per vertex, median of {args.repeats})")
    for name, graphs in workloads().items():
        n = sum(g.num_vertices for g in graphs)

        def batch():
            b = make_batch(graphs)
            return b.with_kinds(*leaf_internal(b))
        tb, b = median_time(batch, args.repeats)
        ts, sched = median_time(lambda: CavsPolicy().schedule(b), args.repeats)
        tp, plan = median_time(lambda: plan_memory(b, sched, arity, pulls, pushes), args.repeats)

        def alloc():
            blocks = []
            for kind_id, kname in enumerate(b.kind_names):
                fn = s.compiled[kname]
                crossing = [x for r in fn.phases(EngineOptions()).backward.reads for x in r]
                blocks += [np.empty((plan.kinds[kind_id].n,) + node.vshape, np.float32)
                           for node in fn.fwd_tensors + crossing]
            return sum(x.nbytes for x in blocks)
        ta, nbytes = median_time(alloc, args.repeats)
        print(f"{name:<42} {n:>8} {tb / n * 1e6:>7.3f} {ts / n * 1e6:>7.3f} {tp / n * 1e6:>7.3f} "
              f"{(tb + ts + tp) / n * 1e6:>7.3f}  {ta / n * 1e6:>8.3f}   ({nbytes / 2**20:.0f} MiB of tensors)")
    print()
    graphs = workloads()["64 SST-sized random binary trees"]
    leaves = sum(int(np.sum(g.num_children() == 0)) for g in graphs)
    rng = np.random.default_rng(1)
    feeds = {"words": rng.integers(0, 1000, leaves),
             "labels": rng.integers(0, 5, sum(g.num_vertices for g in graphs))}
    import minicavs.engine.model as model_module
    for opts in (EngineOptions(False, False), EngineOptions(True, True)):
        counts = {}

        def counted(fn):
            def wrapper(*a, **k):
                n = [0]

                def tracer(frame, event, arg):
                    if event in ("call", "c_call"):
                        n[0] += 1
                sys.setprofile(tracer)
                try:
                    return fn(*a, **k)
                finally:
                    sys.setprofile(None)
                    counts[fn.__name__] = n[0]
            return wrapper
        saved = model_module.forward, model_module.backward
        model_module.forward, model_module.backward = counted(saved[0]), counted(saved[1])
        try:
            res = case.model.forward_backward(graphs, feeds, case.params, RunContext(), options=opts)
        finally:
            model_module.forward, model_module.backward = saved
        tasks = len(res.batches["G"][1].tasks)
        print(f"function calls per task, Python and C ({tasks} tasks; lazy batching {opts.lazy_batching}, "
              f"eager batching {opts.eager_batching}): forward {counts['forward'] / tasks:.0f}, "
              f"backward {counts['backward'] / tasks:.0f}")


if __name__ == "__main__":
    main()
