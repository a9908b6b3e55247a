"""``minicavs bench --layout``: ED-Batch's Table 2 analogue. Per cell, written naive (one product and one
bias per gate: ``model.cell: naive``) without the layout pass, naive with it, and fused by hand: the merged
products and the weights still copied per batch (bytes), the C runner's row-moving instructions (ROW_MOVES:
ns per batch), the training time per batch (forward, backward and optimizer step; the variants alternate
batch by batch, medians) and the planning time (the GEMM-merging and layout passes over every function)."""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..engine.codegen.machine import OPS
from ..engine.compile import EngineOptions
from ..engine.passes import gemm, layout
from .breakdown import ROW_MOVES

MODELS = Path(__file__).resolve().parents[2] / "models"
CELLS = {   # cell -> (model config, overrides)
    "Tree-LSTM (leaf + internal)": ("tree_lstm", ["model.dropout=0.0", "data.synthetic.train=256"]),
    "LSTM cell (Var-LSTM)": ("var_lstm", ["model.dropout=0.0", "data.synthetic.train=256"]),
    "Lattice cells (char, char+words, word)": ("lattice_lstm", ["data.synthetic.train=256"]),
}
VARIANTS = {   # (the trainer lays the parameters out when built: the switch is the config's)
    "naive, no layout": ["model.cell=naive", "train.engine.plan_layout=false"],
    "naive + layout": ["model.cell=naive", "train.engine.plan_layout=true"],
    "fused": ["train.engine.plan_layout=false"]}


def _trainer(config: str, overrides: list, hidden: int, batch: int, run_dir: Path):
    from ..train.trainer import Trainer
    return Trainer(MODELS / f"{config}.yaml", overrides + [f"model.hidden={hidden}", f"train.batch_size={batch}"],
                   run_dir=run_dir)


def _copies(t, opts: EngineOptions) -> tuple[int, int, int]:
    """(merges over views, merges copying their weight, bytes those weights copy per batch: the merged
    weight's concat; its gradient is computed into the parameters' accumulators either way)."""
    views = copied = nbytes = 0
    for s in t.model.structures:
        for fn in s.compiled.values():
            for m in fn.variant(opts).merges:
                if m.buffer is not None:
                    views += 1
                else:
                    K, N = m.merged.inputs[1].shape
                    copied += 1
                    nbytes += K * N * m.merged.dtype.np.itemsize
    return views, copied, nbytes


def _instructions(result) -> tuple[int, int]:
    """(row-moving instructions, gradient accumulations) in the F and ∂F programs that ran (their templates:
    what program.dump() lists)."""
    moves = accumulations = 0
    for state in result.states.values():
        for program in (state.program, state.backward_program):
            for line in program.lowered.lines():
                words = line.split()
                op = words[1] if len(words) > 1 else ""
                moves += op in ROW_MOVES
                accumulations += op == "GACC"
    return moves, accumulations


def _planning_ms(t) -> float:
    """The passes' time over every function of the model, compiled afresh (merging and layout)."""
    start = time.perf_counter()
    functions = [fn for s in t.model.structures for fn in s.compiled.values()]
    planned = layout.solve([g for fn in functions for g in gemm.layout_groups(fn.F)])
    for fn in functions:
        gemm.merge_products(fn.F, plan_layout=True, planned=planned)
    return (time.perf_counter() - start) * 1e3


def _batch(run: dict, samples: list) -> None:
    """One training step of ``run`` on ``samples``, its times added to the run's round (``run["round"]``:
    step seconds, update seconds) and its row moves to the run's per-opcode clock."""
    t = run["t"]
    with t.device.opcode_clock() as clock:
        graphs, feeds = t.task.batch(samples)
        start = time.process_time()
        res = t.model.forward_backward(graphs, feeds, t.params, t.context(training=True), options=run["opts"])
        middle = time.process_time()
        t.optimizer.step(res.grads, loss=res.loss)
        run["round"][0] += middle - start
        run["round"][1] += time.process_time() - middle
    run["profile"] += clock
    run["last"] = res


def _round(runs: dict, batch: int, batches: int) -> None:
    """One pass over the samples, the variants taking turns batch by batch (so that each variant's batch i
    runs under the same load from the rest of the machine); per run, its (step seconds, update seconds,
    row-move ns) per batch appended to ``run["rounds"]``."""
    for run in runs.values():
        run["round"] = [0.0, 0.0]
        run["profile"] = np.zeros(len(OPS) + 1, np.int64)
    for i in range(0, batch * batches, batch):
        for run in runs.values():
            _batch(run, run["samples"][i:i + batch])
    for run in runs.values():
        step, update = run["round"]
        moves = sum(int(run["profile"][OPS[op]]) for op in ROW_MOVES)
        run["rounds"].append((step / batches, update / batches, moves / batches))


def measure(hidden: int = 128, batch: int = 64, batches: int = 4, repeats: int = 5) -> list[dict]:
    """The table's rows: per cell and variant, medians over ``repeats`` rounds of ``batches`` batches, the
    variants alternating batch by batch (process CPU time; OPENBLAS_NUM_THREADS=1 is the caller's)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cell, (config, overrides) in CELLS.items():
            runs = {}
            for name, extra in VARIANTS.items():
                t = _trainer(config, overrides + extra, hidden, batch, Path(tmp) / f"{config}-{len(runs)}")
                runs[name] = {"t": t, "opts": t.model.options, "rounds": [],
                              "samples": t.task.data["train"][:batch * batches]}
            for r in range(repeats + 1):   # round 0 warms up (compiles, lays out)
                _round(runs, batch, batches)
            for run in runs.values():
                run["times"] = run["rounds"][1:]
            fused = statistics.median(s + u for s, u, _ in runs["fused"]["times"])
            for name, run in runs.items():
                views, copied, nbytes = _copies(run["t"], run["opts"])
                moves, accumulations = _instructions(run["last"])
                step, update, ns = (statistics.median(x[k] for x in run["times"]) for k in range(3))
                total = statistics.median(s + u for s, u, _ in run["times"])
                rows.append({"cell": cell, "variant": name, "merged_views": views, "merged_copied": copied,
                             "row_move_instructions": moves, "gradient_accumulations": accumulations,
                             "weight_bytes_copied": nbytes, "row_moves_us": ns / 1e3,
                             "step_ms": step * 1e3, "update_ms": update * 1e3, "ms_per_batch": total * 1e3,
                             "vs_fused": total / fused, "planning_ms": _planning_ms(run["t"])})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| cell | variant | merged GEMMs (views / weight copied) | row-move instructions | GACC | "
            "weight bytes copied per batch | row moves µs per batch | F+∂F ms | update ms | ms per batch | "
            "vs fused | planning ms |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['cell']} | {r['variant']} | {r['merged_views']} / {r['merged_copied']} | "
                     f"{r['row_move_instructions']} | {r['gradient_accumulations']} | "
                     f"{r['weight_bytes_copied']:,} | {r['row_moves_us']:.0f} | {r['step_ms']:.2f} | "
                     f"{r['update_ms']:.2f} | {r['ms_per_batch']:.2f} | {r['vs_fused']:.3f} | "
                     f"{r['planning_ms']:.1f} |")
    return "\n".join(lines)


def run_layout(out: Path, hidden: int, batch: int, batches: int, repeats: int) -> str:
    rows = measure(hidden, batch, batches, repeats)
    text = table(rows)
    out.mkdir(parents=True, exist_ok=True)
    from ..core.atomic import write_text
    write_text(out / "layout.md", text + "\n")
    return text
