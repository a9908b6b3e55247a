"""What issuing a training batch costs the host on a CUDA device that does no work: the CUDA runner issuing
each pass from Python (op by op, per task: before) and from one C call (minicavs/cuda/issue.py: after).

    python tools/bench_issue.py [--sst ../shared/data/sst/train.txt] [--trees 1024] [--batch 64] [--hidden 512]
                                [--batches 4] [--repeat 3] [--dtype float32] [--streaming]

The device is the stand-in's arrays (host memory) with a launcher and products that do nothing: launches and
products are counted, not run, so the times are the host's alone (the Python path still moves a few rows
with numpy on the stand-in's arrays, and its products are stubbed to return unset arrays). Printed per
training batch (the forward and backward passes of Tree-LSTM on SST, the engine's binding included; the
optimizer not, which is another part of the step): the passes' kernel launches, products and events, the
host time inside the passes (alg1._run: the runner's one call) and in the whole forward and backward, medians over the batches
and repeats, and the issue's target: passes' host time + (launches + products) x 3 us <= 1.5 ms.

A benchmark, not a test: nothing is asserted. The numbers are not GPU numbers.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minicavs.bench import SST, workloads  # noqa: E402
from minicavs.cuda import issue, kernels, standin  # noqa: E402
from minicavs.engine import alg1, reference  # noqa: E402
from minicavs.engine.codegen.machine import OPCODES  # noqa: E402
from minicavs.engine.compile import EngineOptions  # noqa: E402

# the Python runner's opcodes that are a CuPy kernel each on a GPU (a product: GEMM, BMM)
ONE_LAUNCH = ("COPY", "ZERO", "ADD", "SUMROWS", "GACC", "TRANSROWS")
DROPOUT_LAUNCHES = 6   # (its mask: hash, compare, cast, multiplies: a handful of CuPy elementwise kernels)


class NoWork:
    """A launcher whose launches do nothing (counted); the issuing loop's function pointers do nothing too."""

    emulated = True
    no_work = True

    def __init__(self):
        self.xp = standin
        self.calls = 0

    def __call__(self, source, name, grid, block, args, stream=None) -> None:
        self.calls += 1


def _stub_products() -> None:
    """The stand-in's matmul returns an unset array of the product's shape (no arithmetic)."""
    def empty(a, b, **kw):
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
        return np.empty(shape, np.result_type(a, b))
    standin.matmul._f = empty


def _counted_operations() -> collections.Counter:
    """Count the reference runner's opcode calls on the device (products, one-launch ops, dropouts, biases)."""
    counts = collections.Counter()
    names = list(OPCODES)
    wrapped = []
    for name, fn in zip(names, reference.BY_ID):
        def counted(m, *operands, _fn=fn, _name=name):
            counts[_name] += 1
            if _name == "GEMM" and operands[6] >= 0:
                counts["bias"] += 1
            return _fn(m, *operands)
        wrapped.append(counted)
    reference.BY_ID[:] = wrapped
    return counts


def measure(args, from_c: bool) -> dict:
    launcher = NoWork()
    kernels.default_launcher = lambda: launcher
    t = workloads.tree_lstm(args.sst, args.hidden, args.embed, args.batch, args.trees,
                            EngineOptions(streaming=args.streaming),
                            extra=["train.device=cuda", f"train.dtype={args.dtype}"])
    device = t.model.device
    device.issue_from_c = from_c
    inside = [0.0]
    run_pass = alg1._run

    def timed(*a, **kw):
        start = time.perf_counter()
        try:
            return run_pass(*a, **kw)
        finally:
            inside[0] += time.perf_counter() - start
    alg1._run = timed
    batches = t.epoch_batches(1)[:args.batches]
    prepared = [t.prepare_step(b) for b in batches]
    t.prepare_policy()

    def step(p):
        return t.model.forward_backward(p.batch, p.feeds, t.params, t.context(True), outputs=False)
    for p in prepared:   # (compiles, links, allocates)
        step(p)
    passes, whole = [], []
    for _ in range(args.repeat):
        for p in prepared:
            inside[0] = 0.0
            start = time.perf_counter()
            step(p)
            whole.append(time.perf_counter() - start)
            passes.append(inside[0])
    # counts (a separate run: counting costs time)
    before_stats = issue.stats(device).copy()
    calls_before = launcher.calls
    saved = list(reference.BY_ID)
    ops = _counted_operations() if not from_c else collections.Counter()
    try:
        results = [step(p) for p in prepared]
    finally:
        reference.BY_ID[:] = saved
    n = len(prepared)
    c_stats = (issue.stats(device) - before_stats) / n
    python_launches = (launcher.calls - calls_before) / n
    if from_c:
        launches, products, events = c_stats[0] + python_launches, c_stats[1], c_stats[2]
    else:
        launches = python_launches + (sum(ops[o] for o in ONE_LAUNCH) + ops["bias"]
                                      + DROPOUT_LAUNCHES * ops["DROPOUT"]) / n
        products, events = (ops["GEMM"] + ops["BMM"]) / n, float("nan")
    tasks = statistics.mean(len(s.program.table) for r in results for s in r.states.values())
    return {"launches": launches, "products": products, "events": events, "passes_ms": 1e3 * statistics.median(passes),
            "whole_ms": 1e3 * statistics.median(whole), "tasks": tasks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sst", default=SST, help=f"SST train file (default {SST}, as minicavs bench)")
    p.add_argument("--trees", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--embed", type=int, default=workloads.Data.tree_embed)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--streaming", action="store_true", help="train.engine.streaming (eager chunks on a second stream)")
    args = p.parse_args(argv)
    if not Path(args.sst).exists():
        p.error(f"--sst {args.sst}: no such file")
    warnings.simplefilter("ignore")   # (unset arrays: the engine's own numpy work may overflow on them)
    np.seterr(all="ignore")
    _stub_products()
    print(f"Tree-LSTM h{args.hidden} e{args.embed} b{args.batch}, first {args.trees} SST trees, {args.dtype}; "
          f"{args.batches} batches x {args.repeat}{', streaming' if args.streaming else ''}; a CUDA device that does "
          "no work (the stand-in's arrays)")
    print(f"{'issued':<12} {'tasks/pass':>10} {'launches':>9} {'products':>9} {'events':>7} {'passes ms':>10} "
          f"{'fwd+bwd ms':>11} {'target ms':>10}")
    for name, from_c in (("from Python", False), ("from C", True)):
        r = measure(args, from_c)
        target = r["passes_ms"] + (r["launches"] + r["products"]) * 3e-3
        print(f"{name:<12} {r['tasks']:>10.0f} {r['launches']:>9.0f} {r['products']:>9.0f} {r['events']:>7.0f} "
              f"{r['passes_ms']:>10.2f} {r['whole_ms']:>11.2f} {target:>10.2f}")
    print("target: passes' host time + (launches + products) x 3 us <= 1.5 ms per training batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
