"""Where a training step's time goes, part by part, and how fast its products run against numpy at the very
same shapes (``minicavs bench --step-breakdown``).

Parts (CPU time, per step; they add up to the step, ``glue`` being the rest):

- **products**: the C runner's GEMM (and BMM) instructions, clocked by the device's ``opcode_clock``;
- **fused kernels**: its FUSED instructions (the generated elementwise kernels);
- **row moves**: its instructions that copy rows (breakdown.ROW_MOVES: gathers, takes, puts, scatters, copies,
  the gathers' adjoints);
- **small loops**: its other loops (bias-gradient row sums, gradient adds, zeroing, dropout, row transposes);
- **dispatch**: the rest of the C call (register-only instructions and the interpreter's own loop);
- **runner (Python)**: the runner call less its C call (the buffer table, the transposed statics' copies);
- **bind** (linking and binding the batch's programs), **schedule** (the batch's graphs and feeds, planning:
  ``task.batch``, ``Model._plan``), **static graphs** (the model's static part: pulls, loss, F's and ∂F's
  parameter-only nodes: their Python, the runner's and binding's time for their programs counted as those
  parts), **optimizer**; each part exclusive of the other parts' calls inside it, so the parts do not overlap;
- **glue**: the step less all of the above (the engine's Python between them).

The products' rate: every GEMM of the step's programs is read off the program (per task row its template's
GEMMs, -1 dimensions as the task's rows, each operand's transposed flag as its register has it), and numpy
times each distinct shape (``a @ b`` into a preallocated output, operands laid out the same) in this process:
the products' FLOPs over that time is the machine's rate at the same shapes.
CPU time throughout (``process_time``; the C runner's clock, a wall clock, scaled per call), so that a loaded
machine slows the parts without charging them its other work; the result gives the wall time per step too.
"""
from __future__ import annotations

import time
from collections import Counter

import numpy as np

from ..engine import alg1, program as binding
from ..engine.codegen.machine import OPS
from .breakdown import ROW_MOVES

PRODUCTS = ("GEMM", "BMM")
SMALL_LOOPS = ("ADD", "ZERO", "SUMROWS", "GACC", "DROPOUT", "TRANSROWS")
PARTS = ("products", "fused kernels", "row moves", "small loops", "dispatch", "runner (Python)", "bind",
         "schedule", "static graphs", "optimizer", "glue")
_CLOCKED = {"products": PRODUCTS, "fused kernels": ("FUSED",), "row moves": ROW_MOVES, "small loops": SMALL_LOOPS}
_POINTING = {OPS[name] for name in ("BIND", "STATIC", "SCRATCH", "GATHER", "CATVIEW", "TAKE", "SROWS")}
_SAME = {OPS["COLS"], OPS["ALIAS"]}


class _Timers:
    """CPU seconds spent in wrapped callables, by part, each exclusive of the timed calls inside it (a static
    graph's program bound and run by the runner is bind and runner time, not the static graph's); wrappers
    set on objects and taken off again."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self._saved: list = []
        self._inner: list = []   # per active wrapped call, the seconds of the timed calls inside it

    def wrap(self, obj, name: str, part: str) -> None:
        fn, seconds = getattr(obj, name), self.seconds

        def timed(*args, **kwargs):
            self._inner.append(0.0)
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.process_time() - start
                seconds[part] += elapsed - self._inner.pop()
                self.charge(elapsed)
        self.replace(obj, name, timed)

    def charge(self, elapsed: float) -> None:
        """Counts ``elapsed`` seconds, timed apart, as inside the active wrapped call (if any)."""
        if self._inner:
            self._inner[-1] += elapsed

    def replace(self, obj, name: str, fn) -> None:
        self._saved.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, fn)

    def restore(self) -> None:
        for obj, name, before in reversed(self._saved):
            if before is None:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
        self._saved.clear()


class _RunnerClock:
    """The runner's calls, timed: CPU seconds per call, its C call's per-opcode nanoseconds (the device's
    ``opcode_clock``, a wall clock) scaled by the call's CPU/wall ratio, so that on a busy machine the C
    parts are CPU time like the rest (a call descheduled for a while is charged pro rata); and the GEMM
    shapes of each program run (read after the call, outside the timed part)."""

    def __init__(self, device, timers: _Timers):
        self.clock = np.zeros(len(OPS) + 1)   # CPU-scaled ns per opcode, and the C calls' in all (last)
        self.cpu = 0.0
        self.probe = (0.0, 0.0)   # (CPU, wall) seconds spent reading the programs' shapes: not the step's
        self.gemms: Counter = Counter()
        run = device.run

        def timed(program):
            clock = device.clock
            before = clock.copy()
            start, start_cpu = time.perf_counter(), time.process_time()
            try:
                return run(program)
            finally:
                cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
                self.cpu += cpu
                self.clock += (clock - before) * (cpu / wall if wall > 0 else 1.0)
                start, start_cpu = time.perf_counter(), time.process_time()
                self.gemms.update(gemm_shapes(program))
                probe = time.process_time() - start_cpu
                self.probe = (self.probe[0] + probe, self.probe[1] + time.perf_counter() - start)
                timers.charge(cpu + probe)
        timers.replace(device, "run", timed)


def gemm_shapes(program) -> Counter:
    """{(m, n, k, a transposed, b transposed): count} of every GEMM the bound ``program`` runs (each task row
    of its table, and of its eager stream's), transposed flags as its registers have them."""
    per_template: dict = {}
    shapes: Counter = Counter()
    for table in (program.table, program.eager):
        if table is None:
            continue
        for tid, bs in zip(table[:, 0].tolist(), table[:, 2].tolist()):
            if tid not in per_template:
                per_template[tid] = _template_gemms(program.lowered, tid)
            for m, n, k, ta, tb in per_template[tid]:
                m, n, k = (bs if d < 0 else d for d in (m, n, k))
                if m and n and k:
                    shapes[(m, n, k, ta, tb)] += 1
    return shapes


def _template_gemms(lowered, tid: int) -> list:
    """The GEMMs of template ``tid``: (m, n, k, a transposed, b transposed), -1 for the task's rows. Registers'
    flags follow the instructions: TRANSPOSE flips one, COLS and ALIAS copy one, the rest point at rows or at
    a static read contiguous (a runner's choice: the C runner copies a transposed static, ∂F's Wᵀ, for
    multi-row tasks; numpy is timed with the layout it multiplies by there)."""
    trans: dict = {}
    out = []
    begin, end = lowered.ranges[tid]
    for row in lowered.code[begin:end].tolist():
        op, a = row[0], row[1:]
        if op in _POINTING:
            trans[a[0]] = 0
        elif op in _SAME:
            trans[a[0]] = trans.get(a[1], 0)
        elif op == OPS["TRANSPOSE"]:
            trans[a[0]] = 1 - trans.get(a[1], 0)
        elif op == OPS["GEMM"]:
            out.append((a[3], a[4], a[5], trans.get(a[1], 0), trans.get(a[2], 0)))
    return out


def numpy_seconds(shape: tuple, dtype=np.float32, repeats: int = 3) -> float:
    """Median CPU seconds of numpy's ``a @ b`` (into a preallocated output) at one GEMM shape, operands laid out as
    the flags say (a transposed operand is the .T of a C-contiguous array)."""
    m, n, k, ta, tb = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
    a, b = (a.T if ta else a), (b.T if tb else b)
    c = np.empty((m, n), dtype)
    np.matmul(a, b, out=c)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        np.matmul(a, b, out=c)
        times.append(time.process_time() - start)
    return float(np.median(times))


def instrumented_steps(t, n: int, batch: int) -> dict:
    """Train on the first ``n`` training samples batch by batch, as the trainer's steps do (``train_step``:
    outputs the loss does not need skipped; serially, no prefetch), with every part timed (see the module
    doc): {"cpu_s" (CPU seconds of all steps), "wall_s", "steps", "parts": {part: CPU seconds}, "gemm_s" (the
    GEMM instructions'), "gemms": Counter of GEMM shapes, "opcodes": {opcode: CPU seconds}}. Plans are
    forgotten before each step, so scheduling is paid as in training, which reshuffles."""
    model, task, device = t.model, t.task, t.device
    timers = _Timers()
    for obj, name, part in ((task, "batch", "schedule"), (model, "_plan", "schedule"),
                            (model, "_evaluate", "static graphs"), (alg1, "evaluate", "static graphs"),
                            (alg1, "_link", "bind"), (binding, "bind", "bind"), (t.optimizer, "step", "optimizer")):
        timers.wrap(obj, name, part)
    runner = _RunnerClock(device, timers)
    steps, wall, cpu = 0, 0.0, 0.0
    try:
        with device.opcode_clock():
            for i in range(0, n, batch):
                model.forget_plans()
                start, start_cpu = time.perf_counter(), time.process_time()
                t.train_step(np.arange(i, min(i + batch, n)))
                wall += time.perf_counter() - start
                cpu += time.process_time() - start_cpu
                steps += 1
    finally:
        timers.restore()
    cpu, wall = cpu - runner.probe[0], wall - runner.probe[1]
    return {"cpu_s": cpu, "wall_s": wall, "steps": steps, "parts": _parts(timers.seconds, runner, cpu),
            "gemm_s": runner.clock[OPS["GEMM"]] / 1e9, "gemms": runner.gemms,
            "opcodes": {name: runner.clock[i] / 1e9 for name, i in OPS.items() if runner.clock[i]}}


def _parts(seconds: Counter, runner: _RunnerClock, cpu: float) -> dict:
    """CPU seconds per part of PARTS from the wrapped callables' times and the runner's clock."""
    ns = {name: float(runner.clock[i]) for name, i in OPS.items()}
    c_call = float(runner.clock[-1]) / 1e9
    parts = {part: sum(ns[op] for op in ops) / 1e9 for part, ops in _CLOCKED.items()}
    parts["dispatch"] = c_call - sum(parts.values())
    parts["runner (Python)"] = runner.cpu - c_call
    for part in ("bind", "schedule", "static graphs", "optimizer"):
        parts[part] = seconds[part]
    parts["glue"] = cpu - sum(parts.values())
    return {part: parts[part] for part in PARTS}


LARGE = 2048   # the large GEMM, n x n x n, that the products are also compared with
ROW_CLASSES = ((1, 1), (2, 8), (9, 32), (33, 128), (129, 1 << 62))   # a product's rows (m), for the table


def product_rates(gemms: Counter, gemm_s: float, dtype=np.float32) -> dict:
    """The products' FLOPs, the C runner's GFLOP/s over its GEMM seconds ``gemm_s``, numpy's seconds and
    GFLOP/s at the very same shapes (:func:`numpy_seconds` per distinct shape, times its count), and numpy's
    seconds and FLOPs per class of rows (ROW_CLASSES): where the machine's own time at these shapes goes;
    ``each``: per shape [m, n, k, a transposed, b transposed, count, numpy's seconds for all of them]."""
    flops = sum(2 * m * n * k * count for (m, n, k, _, _), count in gemms.items())
    classes = {f"{lo}-{hi}" if hi < 1 << 62 else f">{lo - 1}": [0.0, 0.0] for lo, hi in ROW_CLASSES}
    numpy_s = 0.0
    each = []
    for shape, count in sorted(gemms.items()):
        seconds = numpy_seconds(shape, dtype) * count
        each.append([*shape, count, seconds])
        numpy_s += seconds
        m = shape[0]
        name = next(c for c, (lo, hi) in zip(classes, ROW_CLASSES) if lo <= m <= hi)
        classes[name][0] += seconds
        classes[name][1] += 2 * m * shape[1] * shape[2] * count
    return {"flops": flops, "gemm_s": gemm_s, "numpy_s": numpy_s, "shapes": len(gemms),
            "gflops": flops / gemm_s / 1e9 if gemm_s else 0.0,
            "numpy_gflops": flops / numpy_s / 1e9 if numpy_s else 0.0,
            "classes": {c: {"numpy_s": s, "flops": f} for c, (s, f) in classes.items() if f},
            "each": each}


# --- the mode: one measurement in a child process, the table -----------------------------------------------

def measure(spec: dict) -> dict:
    """The spec's point (``hidden``, ``batch``, ``data``: workloads.Data fields, ``repeats``, ``engine``):
    a warm-up epoch, then ``repeats`` instrumented epochs (parts per step of each), then the products' rates
    over the first epoch's shapes and numpy's large-GEMM rate, in this process."""
    from ..engine.compile import EngineOptions
    from . import machine_facts as machine
    from .sweeps import Point
    from .workloads import Data, build
    point = Point("tree_lstm", spec["hidden"], spec["batch"])
    t = build(point, Data(**spec["data"]), EngineOptions(**spec.get("engine", {})))
    n, B = len(t.task.data["train"]), point.batch
    instrumented_steps(t, n, B)   # (compiles kernels, sizes the workspace)
    rounds = [instrumented_steps(t, n, B) for _ in range(spec["repeats"])]
    steps = rounds[0]["steps"]
    parts = {p: float(np.median([r["parts"][p] for r in rounds])) / steps for p in PARTS}
    out = {"point": point.as_dict(), "trees": n, "steps": steps, "repeats": len(rounds),
           "opcodes_ms": {op: float(np.median([r["opcodes"].get(op, 0.0) for r in rounds])) / steps * 1e3
                          for op in rounds[0]["opcodes"]},
           "step_cpu_s": float(np.median([r["cpu_s"] for r in rounds])) / steps,
           "step_wall_s": float(np.median([r["wall_s"] for r in rounds])) / steps, "parts": parts,
           "machine": machine.facts()}
    best = min(rounds, key=lambda r: r["gemm_s"])   # (the one least disturbed by the machine's other work)
    rates = product_rates(best["gemms"], best["gemm_s"])
    rates["flops"] /= steps
    out["products"] = rates
    out["large_gemm_gflops"] = 2 * LARGE ** 3 / min(numpy_seconds((LARGE,) * 3 + (0, 0)) for _ in range(3)) / 1e9
    return out


def table(res: dict) -> str:
    """The breakdown as markdown: the parts (ms per step, % of the step), then the products against numpy."""
    step = res["step_cpu_s"]
    p = res["point"]
    lines = [f"Tree-LSTM hidden {p['hidden']}, batch {p['batch']}: {res['trees']} trees, {res['steps']} steps "
             f"a round, medians of {res['repeats']} rounds; CPU time per step {step * 1e3:.1f} ms (wall "
             f"{res['step_wall_s'] * 1e3:.1f} ms)", "", "| part | ms per step | % of step |", "|---|---:|---:|"]
    for part, seconds in res["parts"].items():
        lines.append(f"| {part} | {seconds * 1e3:.2f} | {100 * seconds / step:.1f} |")
    outside = step - res["parts"]["products"]
    lines += [f"| **outside the products** | {outside * 1e3:.2f} | {100 * outside / step:.1f} |", ""]
    r = res["products"]
    lines += ["| products | GFLOP per step | GFLOP/s | % of numpy at the same shapes |", "|---|---:|---:|---:|",
              f"| C runner (its GEMM instructions) | {r['flops'] / 1e9:.2f} | {r['gflops']:.1f} | "
              f"{100 * r['gflops'] / r['numpy_gflops']:.1f} |",
              f"| numpy at the same {r['shapes']} shapes | | {r['numpy_gflops']:.1f} | 100 |",
              f"| numpy, {LARGE}^3 (a large GEMM) | | {res['large_gemm_gflops']:.1f} | |", "",
              "| product rows | share of numpy's time at these shapes | its GFLOP/s there |", "|---|---:|---:|"]
    for name, c in r["classes"].items():
        lines.append(f"| {name} | {100 * c['numpy_s'] / r['numpy_s']:.1f}% | {c['flops'] / c['numpy_s'] / 1e9:.1f} |")
    from .machine_facts import describe
    return "\n".join(lines + ["", describe(res["machine"])])


def run_step_breakdown(hidden: int, batch: int, data, repeats: int, engine: dict, out) -> str:
    """Measure in a child process with the CPU's own kernels on one BLAS thread (every ``OPENBLAS_*``,
    ``OMP_*``, ``MKL_*`` variable unset, then one thread set: the per-core measurement); write
    ``step_breakdown.json`` and ``.md`` into ``out``; return the table."""
    import json
    import subprocess
    import sys
    from dataclasses import asdict
    from pathlib import Path
    from . import machine_facts as machine
    from .point import ONE_THREAD
    spec = {"hidden": hidden, "batch": batch, "data": asdict(data), "repeats": repeats, "engine": engine}
    done = subprocess.run([sys.executable, "-m", "minicavs.bench.step_breakdown", "-"], input=json.dumps(spec),
                          text=True, capture_output=True, env={**machine.user_env(), **ONE_THREAD})
    if done.returncode:
        raise RuntimeError(f"the step breakdown failed:\n{done.stderr[-2000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_breakdown.json").write_text(json.dumps(res, indent=1))
    text = table(res)
    (out / "step_breakdown.md").write_text(text + "\n")
    return text


def main() -> int:
    import json
    import sys
    res = measure(json.load(sys.stdin))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
