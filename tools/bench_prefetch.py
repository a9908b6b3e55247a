"""What preparing and binding a batch costs in a training step, and whether ``train.prefetch`` pays .

``--profile``: per part, milliseconds of the step's thread's CPU time per step (``time.thread_time``: the same
on a loaded machine as on a quiet one; run it with ``OPENBLAS_NUM_THREADS=1`` so that the GEMMs are in that
thread too): the task's feeds (``task.batch``), flattening and kinds (``Structure.batch``), the schedule, the
memory plan (these four are what prefetching moves off the step) and binding the forward and backward batch
programs (``program.bind``, which it does not). ``--overlap``: steps per second of training
epochs with prefetching off, on, and on with a 0.1 ms GIL switch interval, alternating round by round; the
medians of the per-round ratios to off, with their quartiles.

    OPENBLAS_NUM_THREADS=1 python tools/bench_prefetch.py tree_lstm --hidden 128 --profile
    python tools/bench_prefetch.py tree_lstm --hidden 64 --overlap --rounds 20
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minicavs.engine import alg1 as engine, model
from minicavs.runtime import scheduler  # noqa: E402
from minicavs.bench import workloads  # noqa: E402
from minicavs.engine.compile import EngineOptions  # noqa: E402

SST = "../shared/data/sst/train.txt"
PTB = "../shared/data/ptb/ptb.valid.txt"


def trainer(name: str, hidden: int, batch: int, samples: int):
    opts = EngineOptions()
    if name == "tree_lstm":
        return workloads.tree_lstm(SST if os.path.isfile(SST) else "synthetic", hidden, 128, batch, samples, opts)
    if name == "tree_fc":
        return workloads.tree_fc(hidden, 256, batch, samples, opts)
    if name == "var_lstm":
        return workloads.var_lstm(PTB if os.path.isfile(PTB) else "synthetic", samples, hidden, 256, batch, opts)
    raise SystemExit(f"unknown workload {name!r}: tree_lstm, tree_fc, var_lstm")


def profile(t, batches) -> None:
    spent: collections.Counter = collections.Counter()

    def timed(key, fn):
        def run(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.thread_time() - start
        return run
    patches = [(engine.binding, "bind"), (model, "plan_memory"),
               (model.Structure, "batch"), (scheduler.CavsPolicy, "schedule")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    for obj, name, fn in saved:
        setattr(obj, name, timed(name, fn))
    t.task.batch = timed("task.batch", t.task.batch)
    t.cfg["train"]["prefetch"] = False   # every part in this thread, where thread_time counts it
    try:
        t.train_batches(batches)   # warm: kernels compiled, buffers sized
        spent.clear()
        start = time.thread_time()
        t.train_batches(batches)
        total = time.thread_time() - start
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        del t.task.batch
    steps = len(batches)
    print(f"{steps} steps, {1e3 * total / steps:.1f} ms CPU per step (OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, load {os.getloadavg()[0]:.1f})")
    for key, seconds in spent.most_common():
        print(f"  {key:<14} {1e3 * seconds / steps:7.2f} ms  {100 * seconds / total:5.1f}%")
    prep = sum(spent[k] for k in ("task.batch", "batch", "schedule", "plan_memory"))
    bind = spent["bind"]
    print(f"  prefetched (feeds, batch, schedule, memory plan) {100 * prep / total:.1f}%; binding "
          f"{100 * bind / total:.1f}%")


def overlap(t, batches, rounds: int) -> None:
    default = sys.getswitchinterval()

    def rate(mode: str) -> float:
        t.cfg["train"]["prefetch"] = mode != "off"
        sys.setswitchinterval(1e-4 if mode == "on, 0.1 ms switch" else default)
        try:
            start = time.perf_counter()
            t.train_batches(batches)
            return len(batches) / (time.perf_counter() - start)
        finally:
            sys.setswitchinterval(default)
    modes = ["off", "on", "on, 0.1 ms switch"]
    for m in modes:
        rate(m)
    rates: dict = {m: [] for m in modes}
    for r in range(rounds):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            rates[m].append(rate(m))
    off = np.array(rates["off"])
    print(f"{len(batches)} steps x {rounds} rounds, load {os.getloadavg()[0]:.1f}: off {np.median(off):.3f} steps/s")
    for m in modes[1:]:
        ratio = np.array(rates[m]) / off
        print(f"  {m:<18} {np.median(rates[m]):.3f} steps/s, on/off {np.median(ratio):.3f}x "
              f"(quartiles {np.percentile(ratio, 25):.2f}-{np.percentile(ratio, 75):.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", choices=("tree_lstm", "tree_fc", "var_lstm"))
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=256, help="samples per epoch (default 256)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--overlap", action="store_true")
    args = p.parse_args()
    t = trainer(args.workload, args.hidden, args.batch, args.samples)
    n = min(args.samples, len(t.task.data["train"]))
    batches = [np.arange(i, min(i + args.batch, n)) for i in range(0, n, args.batch)]
    print(f"{args.workload} hidden {args.hidden} batch {args.batch}")
    if args.profile or not args.overlap:
        profile(t, batches)
    if args.overlap:
        overlap(t, batches, args.rounds)


if __name__ == "__main__":
    main()
