"""Batch-1 Tree-LSTM (SST, hidden 128) against a base commit and DyNet, alternating fresh processes round by round,
each on one BLAS thread with every OPENBLAS_*/OMP_*/MKL_* variable unset but the thread counts (as a user's
machine runs them), timed in CPU time (the machine may be shared): batch-1 inference µs per tree, batch-1 training
trees/s, and the batch-64 training rate (which must not drop); DyNet's batch-1 inference and training rates over the
same trees (tools/dynet_tree_lstm.py, its clock read as CPU time). Medians of the rounds, with the load averages.

    python tools/bench_batch1.py --base /path/to/base/checkout --sst data/sst/train.txt [--rounds 9] [--trees 256]
        [--dynet-python /tmp/dyvenv/bin/python] [--out results.json]

The base is a checkout of another commit (``git worktree add /tmp/base <commit>``); each system runs from its
own tree (``PYTHONPATH``), so both import their own minicavs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(sst: str, trees: int) -> dict:
    """This process's rates (run inside a fresh process by :func:`main`)."""
    import numpy as np
    from minicavs.bench.sweeps import Point
    from minicavs.bench.workloads import Data, build
    data = Data(sst=sst, trees=max(trees, 1024))

    def infer(t, samples) -> None:
        ctx = t.context(training=False)
        for i in range(len(samples)):
            graphs, feeds = t.task.batch(samples[i:i + 1])
            t.model.infer(graphs, feeds, t.params, ctx)

    def train(t, n: int, batch: int) -> None:
        t.train_batches([np.arange(i, min(i + batch, n)) for i in range(0, n, batch)])

    out = {}
    t = build(Point("tree_lstm", 128, 1), data)
    samples = t.task.data["train"][:trees]
    infer(t, samples)   # (the warm-up: kernels compiled, buffers sized)
    start = time.process_time()
    infer(t, samples)
    out["infer_us"] = (time.process_time() - start) / trees * 1e6
    train(t, trees, 1)
    start = time.process_time()
    train(t, trees, 1)
    out["train1_rate"] = trees / (time.process_time() - start)
    t = build(Point("tree_lstm", 128, 64), data)
    train(t, 1024, 64)
    start = time.process_time()
    train(t, 1024, 64)
    out["train64_rate"] = 1024 / (time.process_time() - start)
    return out


def dynet(sst: str, trees: int, python: str) -> dict:
    """DyNet's batch-1 rates over the same trees, its peer's clock (time.perf_counter) replaced by CPU time."""
    from minicavs.bench import peers
    from minicavs.bench.sweeps import Point
    from minicavs.bench.workloads import Data, build
    t = build(Point("tree_lstm", 128, 1), Data(sst=sst, trees=max(trees, 1024)))
    with tempfile.TemporaryDirectory() as d:
        clock = Path(d) / "cpu_clock.py"
        clock.write_text("import os, runpy, sys, time\ntime.perf_counter = time.process_time\nsys.argv = sys.argv[1:]\n"
                         "sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
                         "runpy.run_path(sys.argv[0], run_name='__main__')\n")
        wrapper = Path(d) / "python"
        wrapper.write_text(f'#!/bin/sh\nexec {python} {clock} "$@"\n')
        wrapper.chmod(0o755)
        got = peers.run(str(wrapper), "dynet", t, epochs=1, inference=True, samples=trees, check=4)
    return {"infer_rate": got["infer_rates"][0], "train1_rate": got["rates"][0]}


def _environment() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "OMP_", "MKL_"))}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _one(system: str, tree: str, args) -> dict:
    """One fresh process measuring ``system`` with the minicavs of ``tree`` (this script, from there)."""
    argv = [sys.executable, str(HERE / "bench_batch1.py"), f"--{'dynet' if system == 'dynet' else 'child'}-run",
            "--sst", str(Path(args.sst).resolve()), "--trees", str(args.trees), "--dynet-python", args.dynet_python]
    out = subprocess.run(argv, cwd=tree, env={**_environment(), "PYTHONPATH": tree}, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{system} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="a checkout of the commit to compare with")
    p.add_argument("--sst", required=True)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--trees", type=int, default=256)
    p.add_argument("--dynet-python", default="/tmp/dyvenv/bin/python")
    p.add_argument("--out")
    p.add_argument("--child-run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dynet-run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_run or args.dynet_run:
        got = child(args.sst, args.trees) if args.child_run else dynet(args.sst, args.trees, args.dynet_python)
        print(json.dumps(got))
        return 0
    trees = {"new": str(HERE.parent)} | ({"base": args.base} if args.base else {}) | {"dynet": str(HERE.parent)}
    names = list(trees)
    results: dict = {name: [] for name in names}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(_one(name, trees[name], args))
        print(f"round {r + 1}/{args.rounds} (load {loads[-1]:.1f}): " + json.dumps({n: results[n][-1] for n in names}),
              file=sys.stderr, flush=True)
    medians = {n: {k: statistics.median(x[k] for x in results[n]) for k in results[n][0]} for n in names}
    print(json.dumps({"medians": medians, "loads": loads}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "medians": medians, "loads": loads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
