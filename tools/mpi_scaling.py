"""Data-parallel scaling, measured and on paper (issue 19).

measure: optimizer steps of one config, on one process or under mpirun; rank 0 prints one JSON line with the
median step time, trees (or words) per second, and the time per step in the gradient reduction:

    OPENBLAS_NUM_THREADS=2 python tools/mpi_scaling.py measure models/tree_lstm.yaml --steps 40
    OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe -n 2 python tools/mpi_scaling.py measure models/tree_lstm.yaml

project: per bundled config, the bytes one step reduces (dense buffer; embedding rows by whichever path moves
fewer bytes) and, from the measured single-process step time and a ring-allreduce cost model, the projected
step time, throughput and efficiency at 2, 8 and 64 ranks:

    python tools/mpi_scaling.py project [--bandwidth-gbs 1.25 --latency-us 30]

Ring allreduce of S bytes over N ranks (Patarasuk & Yuan 2009; what Open MPI and NCCL do for large buffers): 2
(N-1) steps, each sending S/N bytes and paying the latency a, so t = 2 (N-1) a + 2 (N-1)/N S / W at link
bandwidth W. An allgather of rows totalling R bytes (indices and rows: two calls): t = 2 (N-1) a + (N-1)/N R /
W. The per-step header allgather is counted as (N-1) a. Compute splits by samples: with the config's global
batch of b samples (strong scaling, what ``mpirun -n N minicavs train`` does) a rank's forward/backward takes T1
ceil(b/N)/b; with a global batch grown to N b (weak scaling: --set train.batch_size=...) it takes T1. Efficiency
= T1 / (N x step time) strong, T1 / step time weak.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minicavs.core.sparse import RowSparse  # noqa: E402
from minicavs.train.trainer import Trainer  # noqa: E402

DATA = Path("/work/shared/data")
CONFIGS = {   # the bundled configs; the real-data ones with absolute data paths
    "tree_lstm": ("tree_lstm.yaml", []),
    "tree_lstm_sst": ("tree_lstm_sst.yaml", [f"data.train={DATA}/sst/train.txt", f"data.dev={DATA}/sst/dev.txt",
                                             f"data.test={DATA}/sst/test.txt"]),
    "var_lstm": ("var_lstm.yaml", []),
    "var_lstm_ptb": ("var_lstm_ptb.yaml", [f"data.train={DATA}/ptb/ptb.valid.txt",
                                           f"data.test={DATA}/ptb/ptb.test.txt"]),
    "fixed_lstm": ("fixed_lstm.yaml", []),
    "tree_fc": ("tree_fc.yaml", []),
}


def steps(t: Trainer, n: int, warmup: int) -> dict:
    """Time ``n`` optimizer steps (after ``warmup``) over the epoch's first batches, as train_epoch runs them."""
    data = t.task.data["train"]
    bs = t.cfg["train"]["batch_size"]
    order = t.epoch_order(1)
    batches = [order[i:i + bs] for i in range(0, len(order) - bs + 1, bs)]
    batches = (batches * (1 + (n + warmup) // max(len(batches), 1)))[:n + warmup]
    times, units, reduce_s, wait_s = [], 0, 0.0, 0.0
    for k, idx in enumerate(batches):
        if k == warmup and t.parallel:
            stats = t.parallel.reducer.stats
            reduce_s, wait_s = stats.seconds, stats.wait_seconds
        start = time.perf_counter()
        if t.parallel:
            res, u = t.parallel.loss_and_grads(idx)
        else:
            samples = [data[i] for i in idx]
            res, u = t.loss_and_grads(samples, sample_ids=idx), t.task.units(samples)
        t.optimizer.step(res.grads, loss=res.loss)
        if k >= warmup:
            times.append(time.perf_counter() - start)
            units += u
    out = {"step_ms": 1e3 * statistics.median(times), "units_per_s": units / sum(times), "unit": t.task.unit,
           "ranks": t.parallel.comm.size if t.parallel else 1, "steps": n}
    if t.parallel:
        stats = t.parallel.reducer.stats
        out["reduce_ms_per_step"] = 1e3 * (stats.seconds - reduce_s) / n
        out["wait_ms_per_step"] = 1e3 * (stats.wait_seconds - wait_s) / n
        out["transfer_ms_per_step"] = out["reduce_ms_per_step"] - out["wait_ms_per_step"]
    return out


def bytes_per_step(t: Trainer, n_ranks: int) -> dict:
    """Dense bytes allreduced and, per row-sparse gradient, the bytes of each path, from one real batch."""
    data = t.task.data["train"]
    idx = t.epoch_order(1)[:t.cfg["train"]["batch_size"]]
    res = t.loss_and_grads([data[i] for i in idx], sample_ids=idx)
    dense, sparse = 0, {}
    for name, g in res.grads.items():
        value = t.params[name].value
        if isinstance(g, RowSparse):
            row = value.dtype.itemsize * int(np.prod(value.shape[1:]))
            g = g.coalesce()   # as the reducer sends it
            sparse[name] = {"rows": int(len(g.indices)), "gather_bytes": int(len(g.indices) * (row + 8)),
                            "dense_bytes": int(value.shape[0] * (row + value.dtype.itemsize))}
        else:
            dense += value.nbytes
    return {"dense_bytes": dense, "sparse": sparse}


def ring_seconds(n: int, dense: int, sparse: dict, bandwidth: float, latency: float) -> tuple[float, int]:
    """Modelled reduction time of one step at ``n`` ranks and the bytes each rank sends."""
    if n == 1:
        return 0.0, 0
    t = (n - 1) * latency   # header allgather
    sent = 0
    buf = dense
    for s in sparse.values():   # the reducer's choice: allgather iff it moves fewer bytes than the dense buffer
        gather = s["gather_bytes"] * (n - 1) / n
        if gather < 2 * (n - 1) / n * s["dense_bytes"]:
            t += 2 * (n - 1) * latency + gather / bandwidth   # two allgathers: indices, rows
            sent += s["gather_bytes"] / n
        else:
            buf += s["dense_bytes"]
    t += 2 * (n - 1) * latency + 2 * (n - 1) / n * buf / bandwidth
    sent += 2 * (n - 1) / n * buf
    return t, int(sent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("config")
    m.add_argument("--set", dest="overrides", action="append", default=[])
    m.add_argument("--steps", type=int, default=30)
    m.add_argument("--warmup", type=int, default=3)
    p = sub.add_parser("project")
    p.add_argument("--bandwidth-gbs", type=float, default=1.25, help="GB/s per link (default 10 GbE)")
    p.add_argument("--latency-us", type=float, default=30.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--models", nargs="*", default=list(CONFIGS))
    p.add_argument("--t1-ms", action="append", default=[], metavar="CONFIG=MS",
                   help="use this single-process step time instead of measuring (e.g. one from a quiet machine)")
    args = ap.parse_args()
    if args.cmd == "measure":
        t = Trainer(args.config, args.overrides, run_dir="/tmp/minicavs-mpi-scaling")
        out = steps(t, args.steps, args.warmup)
        if t.is_root:
            print(json.dumps(out))
        return
    bw, lat = args.bandwidth_gbs * 1e9, args.latency_us * 1e-6
    print(f"ring allreduce model: {args.bandwidth_gbs} GB/s, {args.latency_us} us latency; T1 measured here "
          f"(1 process, median of {args.steps} steps)")
    print(f"{'config':15} {'batch':>5} {'T1 ms':>8} {'dense MB':>9} {'sparse (rows; path at 8)':>28} "
          + " ".join(f"{'N=' + str(n) + ' strong':>18} {'weak':>6}" for n in (2, 8, 64)))
    for name in args.models:
        path, overrides = CONFIGS[name]
        try:
            t = Trainer(ROOT / "models" / path, overrides, run_dir="/tmp/minicavs-mpi-scaling", comm=None)
        except (FileNotFoundError, OSError) as e:
            print(f"{name:15} skipped: {e}")
            continue
        given = dict(item.split("=") for item in args.t1_ms)
        t1 = float(given[name]) / 1e3 if name in given else steps(t, args.steps, 2)["step_ms"] / 1e3
        b = bytes_per_step(t, 2)
        cells = []
        for n in (2, 8, 64):
            comm, _ = ring_seconds(n, b["dense_bytes"], b["sparse"], bw, lat)
            batch = t.cfg["train"]["batch_size"]   # a rank's share: its largest shard (none below 1 sample)
            strong = t1 / (n * (t1 * -(-batch // n) / batch + comm))
            weak = t1 / (t1 + comm)
            cells.append(f"{1e3 * comm:7.2f}ms eff {strong:4.0%} {weak:6.0%}")
        sp = "; ".join(f"{k} {v['rows']} rows {v['gather_bytes'] / 1e6:.2f}/{v['dense_bytes'] / 1e6:.2f} MB"
                       for k, v in b["sparse"].items())
        print(f"{name:15} {t.cfg['train']['batch_size']:5d} {1e3 * t1:8.1f} {b['dense_bytes'] / 1e6:9.2f} "
              f"{sp:>28} " + " ".join(cells))
        print(json.dumps({"config": name, "t1_s": t1, **b}))


if __name__ == "__main__":
    main()
