"""One system of one ``minicavs bench --control`` row, timed in a process of its own (:mod:`.control_flow`).

    python minicavs/bench/control_child.py < SPEC.json    # prints one JSON line (the last line of stdout)

Run as a file, not as a module, with ``PYTHONPATH`` naming the tree to time: a row that names a base commit runs
this same file against that commit's checkout, so the only workload defined here (seq2seq) uses nothing newer
than the trainer's API of a065f3c; the others come from :mod:`minicavs.bench.control_models` of the tree timed.

The spec: ``workload``, ``system``, the workload's sizes, ``passes`` (timed passes after one untimed warm-up
pass). Reported: per timed pass the wall and CPU seconds per unit, the units of a pass, what the process ran on
(BLAS, CPU, variables) and which minicavs it imported.
"""
import json
import os
import sys
import tempfile
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]   # (run as a file: its folder is not a place to import from)


def seq2seq_trainer(spec: dict):
    """The bundled seq2seq model on ``spec["sequences"]`` synthetic sequences."""
    from minicavs.train.config import bundled_models_dir, load_config
    from minicavs.train.trainer import Trainer
    cfg = load_config(bundled_models_dir() / "seq2seq.yaml", [f"data.synthetic.train={spec['sequences']}"])
    return Trainer(cfg, run_dir=tempfile.mkdtemp(prefix="minicavs-control-"))


def seq2seq(spec: dict):
    """seq2seq training: one pass = one epoch's batches (forward, backward, Adam), counting sequences."""
    t = seq2seq_trainer(spec)
    batches = t.epoch_batches(1)
    units = float(len(t.task.data["train"]))

    def run() -> float:
        t.train_batches(batches)
        return units
    return run


def _step(spec: dict):
    """The timed pass of the spec's workload: a function returning the units it covered."""
    if spec["workload"] == "seq2seq":
        return seq2seq(spec)
    from minicavs.bench.control_models import WORKLOADS
    return WORKLOADS[spec["workload"]](spec, spec["system"]).run


def measure(spec: dict) -> dict:
    """One untimed pass (compiles kernels, sizes buffers), then ``passes`` timed ones."""
    import minicavs
    from minicavs.bench import machine_facts
    run = _step(spec)
    start = time.perf_counter()
    units = run()
    out = {"units": units, "warmup_s": time.perf_counter() - start, "wall": [], "cpu": [],
           "machine": machine_facts.facts(), "minicavs": os.path.dirname(os.path.abspath(minicavs.__file__))}
    for _ in range(spec["passes"]):
        wall, cpu = time.perf_counter(), time.process_time()
        units = run()
        out["wall"].append((time.perf_counter() - wall) / units)
        out["cpu"].append((time.process_time() - cpu) / units)
    return out


if __name__ == "__main__":
    print(json.dumps(measure(json.load(sys.stdin))))
