"""Per-step time with and without GEMM merging (issue 17 item 3, EngineOptions.merge_gemms).

One trainer per workload; each batch is timed with merging off and on back to back, the order flipped every
time (the machine is shared: alternate, take medians), all other switches at their defaults.
Prints the median milliseconds per training step (forward, backward, Adam) of each setting, wall-clock and
process CPU time (on a loaded machine wall time mostly measures waiting; with ``OPENBLAS_NUM_THREADS=1``
CPU time is the work done), their ratios, the products each vertex kind merged, and the load average.

    python tools/bench_merge_gemms.py [--models tree_lstm,var_lstm,tree_gru] [--hidden 64,128,512]
                                      [--batch 64] [--batches 4] [--repeats 7] [--sst PATH] [--pad-limit N]
                                      [--weight-limit N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minicavs.bench.workloads import _trainer  # noqa: E402
from minicavs.engine.compile import EngineOptions  # noqa: E402
from minicavs.engine.passes import gemm  # noqa: E402

SST = "/work/shared/data/sst/train.txt"


def per_gate_lstm_cell(p, H: int, D: int, dropout: float, dtype):
    """var_lstm's cell written one GEMM per gate and operand (column blocks of the same parameters): eight
    products where the bundled cell has two."""
    from minicavs import ops
    from minicavs.runtime.vertex import VertexFunction
    F = VertexFunction("lstm", arity=1, message=(2 * H,), dtype=dtype)
    with F:
        h0, c0 = ops.split(F.gather(0), 2)
        x = F.pull((D,), "x")

        def gate(k):
            cols = slice(k * H, (k + 1) * H)
            return (ops.linear(x, ops.slice_(p["W_x"].node, cols.start, cols.stop, axis=1),
                               ops.slice_(p["b"].node, cols.start, cols.stop))
                    + h0 @ ops.slice_(p["W_h"].node, cols.start, cols.stop, axis=1))
        i, f, o, u = (gate(k) for k in range(4))
        c = ops.sigmoid(f) * c0 + ops.sigmoid(i) * ops.tanh(u)
        h = ops.sigmoid(o) * ops.tanh(c)
        F.scatter(ops.concat([h, c]))
        F.push(h)
    return F


def trainer(model: str, hidden: int, batch: int, samples: int, sst: str | None):
    if model == "var_lstm_per_gate":
        from minicavs.train.config import load_model_module
        module = load_model_module("var_lstm")
        declared, module.lstm_cell = module.lstm_cell, per_gate_lstm_cell
        try:
            return trainer("var_lstm", hidden, batch, samples, sst)
        finally:
            module.lstm_cell = declared
    common = [f"model.hidden={hidden}", "model.dropout=0.0", f"train.batch_size={batch}", "data.dev=null",
              "data.test=null"]
    if model in ("tree_lstm", "tree_gru", "tree_lstm_2type"):
        data = [f"data.train={sst}", f"data.limit={samples}"] if sst else [f"data.synthetic.train={samples}"]
        extra = ["model.embed=128", "train.optimizer=adam", "train.lr=0.001", "train.weight_decay=0.0",
                 "train.sparse_updates=true"]
    elif model == "var_lstm":
        data, extra = [f"data.synthetic.train={samples}"], ["model.embed=256", "train.lr=0.001"]
    else:
        data, extra = [f"data.synthetic.train={samples}"], []
    return _trainer(f"{model}.yaml", common + data + extra, EngineOptions())


def step_times(t, opts: EngineOptions, batches: list) -> list[tuple[float, float]]:
    """(wall seconds, process CPU seconds) of each step."""
    t.model.options = opts
    out = []
    for b in batches:
        start, cpu = time.perf_counter(), time.process_time()
        res = t.loss_and_grads(b)
        t.optimizer.step(res.grads, loss=res.loss)
        out.append((time.perf_counter() - start, time.process_time() - cpu))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tree_lstm,var_lstm,tree_gru",
                    help="bundled models, or var_lstm_per_gate (its cell written one GEMM per gate)")
    ap.add_argument("--hidden", default="64,128,512")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sst", default=SST if os.path.exists(SST) else None)
    ap.add_argument("--pad-limit", type=int, default=None,
                    help=f"zero entries a merged weight may hold (default {gemm.PAD_LIMIT}; large: always pad)")
    ap.add_argument("--weight-limit", type=int, default=None,
                    help=f"entries a merged weight may hold (default {gemm.WEIGHT_LIMIT})")
    args = ap.parse_args(argv)
    if args.pad_limit is not None:
        gemm.PAD_LIMIT = args.pad_limit
    if args.weight_limit is not None:
        gemm.WEIGHT_LIMIT = args.weight_limit
    on, off = EngineOptions(merge_gemms=True), EngineOptions(merge_gemms=False)
    for model in args.models.split(","):
        for hidden in [int(h) for h in args.hidden.split(",")]:
            t = trainer(model, hidden, args.batch, args.batch * args.batches, args.sst)
            data = t.task.data["train"]
            batches = [data[i:i + args.batch] for i in range(0, len(data), args.batch)][:args.batches]
            merged = {k: [m.text() for m in fn.variant(on).merges]
                      for s in t.model.structures for k, fn in s.compiled.items()}
            load = os.getloadavg()[0]
            times = {"off": [], "on": []}
            step_times(t, off, batches), step_times(t, on, batches)   # warm-up: compile, caches
            for r in range(args.repeats):   # step by step: off, on / on, off, so both see the same load
                for i, b in enumerate(batches):
                    for name in (("off", "on") if (r + i) % 2 == 0 else ("on", "off")):
                        times[name] += step_times(t, on if name == "on" else off, [b])
            med = {k: 1e3 * np.median(np.array(v), axis=0) for k, v in times.items()}
            print(f"{model} hidden {hidden} batch {args.batch}: per step wall off {med['off'][0]:.2f} ms, on "
                  f"{med['on'][0]:.2f} ms, off/on {med['off'][0] / med['on'][0]:.3f}; CPU off "
                  f"{med['off'][1]:.2f} ms, on {med['on'][1]:.2f} ms, off/on {med['off'][1] / med['on'][1]:.3f} "
                  f"({len(times['on'])} steps each; load {load:.2f} -> {os.getloadavg()[0]:.2f})", flush=True)
            for k, texts in merged.items():
                for text in texts or ["nothing merged"]:
                    print(f"    {k}: {text}")


if __name__ == "__main__":
    main()
