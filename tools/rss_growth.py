"""Does memory grow while training? Trains bundled models for N steps on varied batches (random samples, a
random batch size up to the config's) and prints the process's RSS and malloc's heap every k steps, then the
slope after warm-up (least squares, MB per 1000 steps) and the range (max - min) there.

    python tools/rss_growth.py [--models tree_lstm tree_lstm_2type var_lstm seq2seq] [--steps 5500]
                               [--warmup 500] [--every 250] [--seed 0] [--largest-first] [--set KEY=VALUE ...]

Columns: step, RSS (MB), malloc's heap (glibc's mallinfo2: bytes the heap holds from the system, MB; "-"
elsewhere), bytes in use in it (MB), the workspaces' buffers (MB; they grow x1.5 when a batch needs more
rows than any before and never shrink: bounded by the largest batch) and how many such buffers were
allocated so far, objects the cyclic garbage collector has freed so far (a training step should free
everything by reference counting: a count that grows is a reference cycle per step, whose arrays live
until a collection and make the heap grow around them). The models run one after another in
this process: give one model per run to see its RSS alone.

The workspaces grow whenever a batch needs more rows than any before, so on random batches RSS steps up at
each new largest batch, rarer and rarer; ``--largest-first`` trains the first step on the batch size's
largest samples (by vertices), so that they reach their size during warm-up.

A benchmark, not a test: nothing is asserted (tests/engine/test_program.py checks a step's memory slope).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minicavs.runtime.memory import allocations  # noqa: E402
from minicavs.train.trainer import Trainer  # noqa: E402

MODELS = ("tree_lstm", "tree_lstm_2type", "var_lstm", "seq2seq")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _mallinfo():
    """glibc's mallinfo2 (None elsewhere): (MB the heap holds, MB in use)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def read() -> tuple[float, float]:
        info = fn()
        return (info.arena + info.hblkhd) / 2**20, (info.uordblks + info.hblkhd) / 2**20
    return read


def rss_mb() -> float:
    """The process's resident set (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def workspace_mb(trainer: Trainer) -> float:
    """The model's workspaces' buffers (runtime/memory.py), MB."""
    spaces = getattr(trainer.model, "_workspaces", {}).values()
    return sum(t.buffer.nbytes for w in spaces for pool in (w.forward, w.backward, w.scatters, w.scatter_grads,
                                                             w.arenas) for t in pool.values()) / 2**20


def slope(steps: list, values: list) -> float:
    """Least-squares slope of values over steps, per 1000 steps."""
    return float(np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0] * 1000) \
        if len(steps) > 1 else float("nan")


def largest(trainer: Trainer, count: int) -> np.ndarray:
    """The ids of the ``count`` training samples with the most vertices (all samples' graphs: ties by id)."""
    data = trainer.task.data["train"]
    sizes = [sum(g.num_vertices for g in trainer.task.batch([sample])[0]) for sample in data]
    return np.argsort(-np.asarray(sizes), kind="stable")[:count]


def measure(model: str, steps: int, warmup: int, every: int, seed: int, overrides: list,
            largest_first: bool = False) -> dict:
    """Train ``model`` for ``steps`` steps, printing a row every ``every``; its slope and range after warm-up."""
    trainer = Trainer(ROOT / "models" / f"{model}.yaml",
                      ["data.dev=null", "data.test=null", "train.epochs=1", *overrides], run_dir=None)
    n, batch = len(trainer.task.data["train"]), trainer.cfg["train"]["batch_size"]
    rng, heap = np.random.default_rng(seed), _mallinfo()
    if largest_first:
        trainer.train_step(largest(trainer, batch))
    after, start = ([], []), time.perf_counter()
    print(f"{model}: step  RSS MB  heap MB  in use MB  workspace MB  buffers  cyclic garbage freed", flush=True)
    for step in range(1, steps + 1):
        trainer.train_step(rng.choice(n, size=int(rng.integers(1, batch + 1)), replace=False))
        if step % every == 0:
            rss = rss_mb()
            held, used = heap() if heap else (float("nan"),) * 2
            freed = sum(s["collected"] for s in gc.get_stats())
            print(f"{model}: {step:5d}  {rss:6.1f}  {held:7.1f}  {used:9.1f}  {workspace_mb(trainer):12.1f}  "
                  f"{allocations():7d}  {freed:8d}   "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            if step > warmup:
                after[0].append(step)
                after[1].append(rss)
    rss_after = after[1] or [float("nan")]
    row = {"model": model, "slope": slope(*after), "range": max(rss_after) - min(rss_after)}
    print(f"{model}: after step {warmup}: RSS slope {row['slope']:+.2f} MB per 1000 steps, range "
          f"{row['range']:.2f} MB ({min(rss_after):.1f} .. {max(rss_after):.1f})", flush=True)
    return row


def main(argv: list | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--steps", type=int, default=5500)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--largest-first", action="store_true",
                    help="train the first step on the batch size's largest samples")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    rows = [measure(m, args.steps, args.warmup, args.every, args.seed, args.set, args.largest_first)
            for m in args.models]
    for row in rows:
        print(f"{row['model']:16s} slope {row['slope']:+6.2f} MB/1000 steps   range {row['range']:5.2f} MB")


if __name__ == "__main__":
    main()
