"""One sweep point of minicavs, measured in a process of its own so that its peak resident memory is its own.

    python -m minicavs.bench.point SPEC.json     # prints one JSON line (the last line of stdout)

The spec holds the point (``sweeps.Point`` fields), the data settings (``workloads.Data`` fields), the engine
switches, ``repeats``, ``epoch_cap`` (seconds an epoch may take: the epoch is the longest prefix of whole
batches that the warm-up's rate says fits; or ``samples``, a given number), ``inference``, ``breakdown``.
Reported: the prefix's size, the seconds of one whole untimed warm-up epoch over it (the peers run the same),
units per second of each timed training (and forward-only) epoch, FLOPs per unit, the BLAS threads, what the
process ran on (``machine``: :func:`minicavs.bench.machine_facts.facts`), the breakdown of one more instrumented
epoch, and the process's peak RSS; then the same on one BLAS thread (``per_core``, the thread count set at run
time) over the same samples, in the same process: one start-up and one trainer for both.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np

from .. import set_blas_threads   # the public setter (cpu/blas_threads.py), as `minicavs serve` uses it
from ..engine.compile import EngineOptions
from . import machine_facts as machine
from .breakdown import instrumented_epoch
from .sweeps import Point
from .workloads import Data, build, flops_per_unit


def _epoch(t, samples, batch: int, training: bool) -> float:
    """Seconds to train on (or infer) ``samples``, the first ones of the trainer's training data, as the
    trainer's epochs do (``train.prefetch`` included)."""
    start = time.perf_counter()
    if training:
        t.train_batches([np.arange(i, min(i + batch, len(samples))) for i in range(0, len(samples), batch)])
        return time.perf_counter() - start
    for i in range(0, len(samples), batch):
        graphs, feeds = t.task.batch(samples[i:i + batch])
        t.model.infer(graphs, feeds, t.params, t.context(training=False))
    return time.perf_counter() - start


def prefix_size(n: int, batch: int, seconds_per_batch: float, epoch_cap: float) -> int:
    """Whole batches that fit into ``epoch_cap`` at the measured rate: at least one, at most all ``n``."""
    fit = int(epoch_cap / max(seconds_per_batch, 1e-9))
    return min(n, max(1, fit) * batch)


def _prepared(spec: dict, t=None):
    """(trainer, samples to time) of the spec's point: ``spec["samples"]``, or the longest prefix of whole
    batches that two warm-up batches' rate says fits ``epoch_cap``. Tree-FC's inputs are large: its trees are
    generated as many as are timed."""
    point = Point(**spec["point"])
    opts = EngineOptions(**spec.get("options", {}))
    data_spec = Data(**spec["data"])
    B, n = point.batch, spec.get("samples")
    tree_fc = t is None and point.model == "tree_fc"
    if t is None:
        t = build(point, replace(data_spec, fc_trees=min(n or B, data_spec.fc_trees)) if tree_fc else data_spec,
                  opts)
    t.model.options = opts
    if not n:
        warm = t.task.data["train"][:B]
        _epoch(t, warm, B, True)                       # compiles kernels, sizes the dynamic tensors
        per_batch = _epoch(t, warm, B, True)
        n = prefix_size(data_spec.fc_trees if tree_fc else len(t.task.data["train"]), B, per_batch,
                        spec["epoch_cap"])
    if tree_fc and n > len(t.task.data["train"]):
        del t
        t = build(point, replace(data_spec, fc_trees=n), opts)   # n random trees, as many as fit
    return t, n


def _timed(t, spec: dict, n: int) -> dict:
    """The protocol on the first ``n`` samples: one whole untimed warm-up epoch (compiling what is not yet),
    ``repeats`` timed epochs, then forward-only alike and the breakdown epoch, as the spec asks."""
    point = Point(**spec["point"])
    B, R = point.batch, spec["repeats"]
    samples = t.task.data["train"][:n]
    units = t.task.units(samples)
    out = {"samples": len(samples), "units": units, "flops_per_unit": flops_per_unit(t, samples, point),
           "threads": blas_threads(), "machine": machine.facts()}
    out["warmup_s"] = _epoch(t, samples, B, True)   # a whole untimed epoch over the timed samples, as the peers
    out["rates"] = [units / _epoch(t, samples, B, True) for _ in range(R)]
    if spec.get("inference", True):
        _epoch(t, samples, B, False)
        out["infer_rates"] = [units / _epoch(t, samples, B, False) for _ in range(R)]
    if spec.get("breakdown", True):
        out["breakdown"] = instrumented_epoch(t, samples, B)
    return out


def measure(spec: dict, t=None) -> dict:
    """Run the spec's point (on trainer ``t`` if given: its engine switches are set to the spec's)."""
    t, n = _prepared(spec, t)
    return _timed(t, spec, n)


def measure_both(spec: dict) -> dict:
    """The spec's point free to use the machine, then (``per_core``) on one BLAS thread over the same samples,
    in this one process (the BLAS's thread count set at run time: one start-up and one trainer for both)."""
    t, n = _prepared(spec)
    out = _timed(t, spec, n)
    before = blas_threads()
    set_blas_threads(1)
    try:
        out["per_core"] = _timed(t, {**spec, "breakdown": False}, n)
    finally:
        set_blas_threads(before)
    return out


def blas_threads() -> int:
    """The threads numpy's BLAS computes with now: threadpoolctl's count (the per-core measurement sets it at
    run time), else ``OPENBLAS_NUM_THREADS`` (``OMP_NUM_THREADS``) when set, else OpenBLAS's default, one per
    core."""
    counts = [b["threads"] for b in machine.blas() if b.get("threads")]
    if counts:
        return int(counts[0])
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(name, "").strip().isdigit():
            return int(os.environ[name])
    return os.cpu_count() or 1


def peak_rss_mb() -> float:
    """This process's peak resident memory. On Linux VmHWM of /proc/self/status: ru_maxrss is not it, since
    Linux carries the forking parent's peak over exec into the child's ru_maxrss (a child of a 400 MB
    benchmark process would report at least 400 MB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024      # kB
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2 ** 20 if sys.platform == "darwin" else r / 1024   # bytes on macOS, KiB on Linux


ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_in_child(spec: dict, python: str = sys.executable, timeout: float | None = None,
                 env: dict | None = None) -> dict:
    """:func:`measure_both` in a fresh process (``env``: its environment, default this one's); its JSON result
    plus ``peak_rss_mb`` of that process (over both thread settings, the same samples)."""
    try:
        out = subprocess.run([python, "-m", "minicavs.bench.point", "-"], input=json.dumps(spec), text=True,
                             capture_output=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"minicavs point {spec['point']} ran longer than {timeout:.0f} s") from None
    if out.returncode:
        raise RuntimeError(f"minicavs point {spec['point']} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def core_rate(n: int, python: str = sys.executable) -> float:
    """FLOP/s of numpy's float32 n^3 GEMM on one BLAS thread, in a child set up as the per-core points are
    (the variables set before numpy loads): what the per-core rates are judged against."""
    code = f"from minicavs.bench.workloads import machine_rate; print(machine_rate(n={int(n)}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env={**os.environ, **ONE_THREAD})
    if out.returncode:
        raise RuntimeError(f"the one-thread GEMM measurement failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m minicavs.bench.point SPEC.json|-", file=sys.stderr)
        return 2
    spec = json.load(sys.stdin if argv[0] == "-" else open(argv[0]))
    res = measure_both(spec)
    res["peak_rss_mb"] = res["per_core"]["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
