"""``minicavs bench --layout``: ED-Batch's Table 2 analogue. Per cell, written naive (one product and one
bias per gate: ``model.cell: naive``) without the layout pass, naive with it, and fused by hand: the merged
products and the weights still copied per batch (bytes), the C runner's row-moving instructions (ROW_MOVES:
ns per batch), the training time per batch (forward, backward and optimizer step; the variants alternate
batch by batch, medians) and the planning time (the GEMM-merging and layout passes over every function)."""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from .. import instructions
from ..cpu import runner as c_runner
from ..engine import EngineOptions
from ..passes import gemm, layout
from .breakdown import ROW_MOVES

MODELS = Path(__file__).resolve().parents[2] / "models"
CELLS = {   # cell -> (model config, overrides)
    "Tree-LSTM (leaf + internal)": ("tree_lstm", ["model.dropout=0.0", "data.synthetic.train=256"]),
    "LSTM cell (Var-LSTM)": ("var_lstm", ["model.dropout=0.0", "data.synthetic.train=256"]),
    "Lattice cells (char, char+words, word)": ("lattice_lstm", ["data.synthetic.train=256"]),
}
VARIANTS = {"naive, no layout": (["model.cell=naive"], {"plan_layout": False}),
            "naive + layout": (["model.cell=naive"], {}),
            "fused": ([], {})}


def _trainer(config: str, overrides: list, hidden: int, batch: int, run_dir: Path):
    from ..training import Trainer
    return Trainer(MODELS / f"{config}.yaml", overrides + [f"model.hidden={hidden}", f"train.batch_size={batch}"],
                   run_dir=run_dir)


def _copies(t, opts: EngineOptions) -> tuple[int, int, int]:
    """(merges over views, merges copying their weight, bytes those weights and their gradients copy per batch)."""
    views = copied = nbytes = 0
    for s in t.model.structures:
        for fn in s.compiled.values():
            for m in fn.variant(opts).merges:
                if m.buffer is not None:
                    views += 1
                else:
                    K, N = m.merged.inputs[1].shape
                    copied += 1
                    nbytes += 2 * K * N * m.merged.dtype.np.itemsize   # the concat, and its gradient's split
    return views, copied, nbytes


def _planning_ms(t) -> float:
    """The passes' time over every function of the model, compiled afresh (merging and layout)."""
    start = time.perf_counter()
    fns = [fn for s in t.model.structures for fn in s.compiled.values()]
    planned = layout.solve([g for fn in fns for g in gemm.layout_groups(fn.F)])
    for fn in fns:
        gemm.merge_products(fn.F, plan_layout=True, planned=planned)
    return (time.perf_counter() - start) * 1e3


def measure(hidden: int = 128, batch: int = 64, batches: int = 4, repeats: int = 5) -> list[dict]:
    """The table's rows: per cell and variant, medians over ``repeats`` rounds of ``batches`` batches."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cell, (config, overrides) in CELLS.items():
            runs = {}
            for name, (extra, engine) in VARIANTS.items():
                t = _trainer(config, overrides + extra, hidden, batch, Path(tmp) / f"{config}-{len(runs)}")
                opts = replace(t.model.options, **engine)
                samples = t.task.data["train"][:batch * batches]
                runs[name] = {"t": t, "opts": opts, "samples": samples, "times": [], "moves": []}
            for r in range(repeats + 1):   # round 0 warms up (compiles, lays out); the variants alternate
                for name, run in runs.items():
                    t = run["t"]
                    c_runner.PROFILE = profile = np.zeros(len(instructions.OPCODES) + 1, np.int64)
                    start = time.process_time()
                    for i in range(0, len(run["samples"]), batch):
                        res = t.model.forward_backward(*t.task.batch(run["samples"][i:i + batch]), t.params,
                                                       t.context(training=True), options=run["opts"])
                        t.optimizer.step(res.grads, loss=res.loss)
                    elapsed = (time.process_time() - start) / batches
                    c_runner.PROFILE = None
                    if r:
                        ops = list(instructions.OPCODES)
                        run["times"].append(elapsed)
                        run["moves"].append(sum(int(profile[ops.index(op)]) for op in ROW_MOVES) / batches)
            fused = statistics.median(runs["fused"]["times"])
            for name, run in runs.items():
                views, copied, nbytes = _copies(run["t"], run["opts"])
                ms = statistics.median(run["times"]) * 1e3
                rows.append({"cell": cell, "variant": name, "merged_views": views, "merged_copied": copied,
                             "weight_bytes_copied": nbytes, "row_moves_us": statistics.median(run["moves"]) / 1e3,
                             "ms_per_batch": ms, "vs_fused": ms / (fused * 1e3),
                             "planning_ms": _planning_ms(run["t"])})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| cell | variant | merged GEMMs (views / weight copied) | weight bytes copied per batch | "
            "row moves (µs per batch) | ms per batch | vs fused | planning ms |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['cell']} | {r['variant']} | {r['merged_views']} / {r['merged_copied']} | "
                     f"{r['weight_bytes_copied']:,} | {r['row_moves_us']:.0f} | {r['ms_per_batch']:.2f} | "
                     f"{r['vs_fused']:.3f} | {r['planning_ms']:.1f} |")
    return "\n".join(lines)


def run_layout(out: Path, hidden: int, batch: int, batches: int, repeats: int) -> str:
    rows = measure(hidden, batch, batches, repeats)
    text = table(rows)
    out.mkdir(parents=True, exist_ok=True)
    from ..atomic import write_text
    write_text(out / "layout.md", text + "\n")
    return text
