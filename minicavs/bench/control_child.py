"""One system of one ``minicavs bench --control`` row, timed in a process of its own (:mod:`.control_flow`).

    python minicavs/bench/control_child.py < SPEC.json    # prints one JSON line (the last line of stdout)

Run as a file, not as a module, with ``PYTHONPATH`` naming the tree to time: a row that names a base commit runs
this same file against that commit's checkout, so the workloads defined here (:data:`CHILD_WORKLOADS`: seq2seq
training and greedy decoding, the SST Tree-LSTM's batch-1 inference and its training) use nothing newer than the
trainer's and the benchmark's API of a065f3c; the others come from :mod:`minicavs.bench.control_models` of the
tree timed.

The spec: ``workload``, ``system``, the workload's sizes, ``passes`` (timed passes after one untimed warm-up
pass). Reported: per timed pass the wall and CPU seconds per unit, the units of a pass, what the process ran on
(BLAS, CPU, variables), which minicavs it imported and the process's id.
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


def seq2seq_predict(spec: dict):
    """seq2seq's greedy decoding (``minicavs predict``'s pass, batch 64) of ``spec["sequences"]`` generated
    sequences, untrained: every batch decodes its most steps; counting sequences."""
    from minicavs.train.config import bundled_models_dir, load_config
    from minicavs.train.trainer import Trainer
    cfg = load_config(bundled_models_dir() / "seq2seq.yaml", [f"data.synthetic.dev={spec['sequences']}"])
    t = Trainer(cfg, run_dir=tempfile.mkdtemp(prefix="minicavs-control-"))
    samples = t.task.data["dev"]

    def run() -> float:
        t.task.predict(samples, 64)
        return float(len(samples))
    return run


def _tree_lstm(spec: dict, batch: int):
    """The sweep's Tree-LSTM trainer (hidden ``spec["hidden"]``, embed 128, Adam) on the first
    ``spec["data_trees"]`` trees of ``spec["sst"]`` (None: minicavs' synthetic treebank), at ``batch``."""
    from minicavs.bench.sweeps import Point
    from minicavs.bench.workloads import Data, build
    return build(Point("tree_lstm", spec["hidden"], batch), Data(sst=spec["sst"], trees=spec["data_trees"]))


def batch1_infer(spec: dict):
    """One request at a time: the first ``spec["trees"]`` trees each batched and inferred on its own (the task's
    batch and ``Model.infer``, as ``minicavs serve`` answers one); counting trees."""
    t = _tree_lstm(spec, 1)
    samples = t.task.data["train"][:spec["trees"]]
    ctx = t.context(training=False)

    def run() -> float:
        for i in range(len(samples)):
            graphs, feeds = t.task.batch(samples[i:i + 1])
            t.model.infer(graphs, feeds, t.params, ctx)
        return float(len(samples))
    return run


def tree_train(spec: dict):
    """Training (forward, backward, Adam) on the first ``spec["trees"]`` trees in batches of ``spec["batch"]``;
    counting trees."""
    import numpy as np
    t = _tree_lstm(spec, spec["batch"])
    n, size = spec["trees"], spec["batch"]
    batches = [np.arange(i, min(i + size, n)) for i in range(0, n, size)]

    def run() -> float:
        t.train_batches(batches)
        return float(n)
    return run


CHILD_WORKLOADS = {"seq2seq": seq2seq, "seq2seq_predict": seq2seq_predict, "batch1_infer": batch1_infer,
                   "tree_train": tree_train}


def _step(spec: dict):
    """The timed pass of the spec's workload: a function returning the units it covered."""
    if spec["workload"] in CHILD_WORKLOADS:
        return CHILD_WORKLOADS[spec["workload"]](spec)
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
           "machine": machine_facts.facts(), "minicavs": os.path.dirname(os.path.abspath(minicavs.__file__)),
           "pid": os.getpid()}
    for _ in range(spec["passes"]):
        wall, cpu = time.perf_counter(), time.process_time()
        units = run()
        out["wall"].append((time.perf_counter() - wall) / units)
        out["cpu"].append((time.process_time() - cpu) / units)
    return out


if __name__ == "__main__":
    print(json.dumps(measure(json.load(sys.stdin))))
