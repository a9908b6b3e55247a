"""``minicavs bench --ed-batch``: ED-Batch's headline comparison (its §5.2) on this machine: the throughput of
every ED-Batch workload under each of minicavs' batching policies against DyNet's own autobatching on the same
model, weights and samples, for training and inference, per core and on the machine.

Per model, two minicavs processes (:func:`child`) hold one trainer per policy: one computes with one BLAS
thread (``OPENBLAS/OMP_NUM_THREADS=1``: per core), one with BLAS free on every core (machine). Each learns its
FSMs on the training data and warms every policy up (one training and one forward-only pass) before any timing.
Then every round runs the three systems in an order that rotates from round to round (:func:`alternation`):
each minicavs process times one training pass and one forward-only pass per policy over the same samples (in
batches of 64, the policies' order reversed every other round, plans forgotten before every batch as DyNet
re-analyses every graph), and the DyNet peer (tools/dynet_*.py; one thread, as dynet38 is built) times one
training and one inference epoch after its own warm-up epoch, having first computed minicavs' loss of the
first samples for the weights as handed over (it must agree to 1e-4, or the run stops). Reported: medians
over the rounds, units per second (the model's unit: words, sequences, trees, sentences), of the first 256
training samples (4 batches; ``--quick``: one batch, three policies), hidden 64 (MV-RNN 16).

The paper's ratios (CPU, inference) are ED-Batch over DyNet *with Cavs's optimizations*; this table's are
minicavs over DyNet's own autobatching, a different (weaker) baseline: the output says so.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import peers
from .point import ONE_THREAD, blas_threads
from .policies import POLICIES, WORKLOADS as CONFIGS
from .workloads import models_dir

# model -> the paper's speedup over Cavs DyNet on CPU, inference (ED-Batch §5.2)
PAPER = {"bilstm_tagger": "1.20x", "lstm_nmt": "1.11x", "tree_lstm": "1.63x", "tree_gru": "1.46x",
         "mv_rnn": "close to 1 (no number)", "tree_lstm_2type": "none given (trees 1.46-1.63x)",
         "lattice_lstm": "1.32-2.97x (both lattices)", "lattice_gru": "1.32-2.97x (both lattices)"}
MODELS = tuple(PAPER)
SETTINGS = ("per core", "machine")   # minicavs' two processes; DyNet computes on one thread in both
SYSTEMS = SETTINGS + ("dynet",)
QUICK_POLICIES = ("cavs", "agenda", "fsm:S3")
BATCH, CHECK = 64, 8
HIDDEN = {"mv_rnn": 16}   # its vertices carry H x H matrices; every other model: DEFAULT_HIDDEN
DEFAULT_HIDDEN = 64


def trainer(model: str, policy: str = "cavs", hidden: int | None = None, samples: int = 128,
            overrides: tuple = ()):
    """A trainer of ``model`` as ``bench --policies`` builds it (its data, no dropout), with the settings the
    DyNet peers share (no weight decay) and its first ``samples`` training samples."""
    from ..train.config import load_config
    from ..train.trainer import Trainer
    config, extra = CONFIGS[model]
    sets = ["data.dev=null", "data.test=null", f"train.batch_size={BATCH}", f"train.policy={policy}",
            "train.weight_decay=0.0", f"model.hidden={hidden or HIDDEN.get(model, DEFAULT_HIDDEN)}"]
    t = Trainer(load_config(models_dir() / config, sets + extra() + list(overrides)), run_dir=None)
    t.prepare_policy()   # an FSM learns on the training data, as the trainer does, before the cut
    t.task.data["train"] = t.task.data["train"][:samples]
    return t


def pass_rate(t, training: bool) -> float:
    """Units per second of one pass over the trainer's samples (training: loss, gradients, update)."""
    samples = t.task.data["train"]
    start = time.perf_counter()
    for i in range(0, len(samples), BATCH):
        t.model.forget_plans()   # a new batch every time, as in training (and for DyNet)
        if training:
            res = t.loss_and_grads(samples[i:i + BATCH])
            t.optimizer.step(res.grads, loss=res.loss)
        else:
            graphs, feeds = t.task.batch(samples[i:i + BATCH])
            t.model.infer(graphs, feeds, t.params, t.context(training=False))
    return t.task.units(samples) / (time.perf_counter() - start)


def child(spec: dict) -> None:
    """A minicavs process of the comparison: builds and warms up a trainer per policy, prints ``ready``,
    then for every line on stdin (the policies in the order to time them) prints one JSON line of rates."""
    trainers = {p: trainer(spec["model"], p, spec["hidden"], spec["samples"], tuple(spec.get("overrides", ())))
                for p in spec["policies"]}
    for t in trainers.values():
        pass_rate(t, True)
        pass_rate(t, False)
    print(json.dumps({"ready": True, "blas_threads": blas_threads()}), flush=True)
    for line in sys.stdin:
        print(json.dumps({p: {"train": pass_rate(trainers[p], True), "infer": pass_rate(trainers[p], False)}
                          for p in json.loads(line)}), flush=True)


class Child:
    """One :func:`child` process, per core (one BLAS thread) or free on the machine."""

    def __init__(self, spec: dict, one_thread: bool):
        env = {k: v for k, v in os.environ.items() if k not in ONE_THREAD}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                            + [x for x in [os.environ.get("PYTHONPATH")] if x])   # this minicavs
        self.errors = tempfile.TemporaryFile("w+")   # a file, not a pipe: a full pipe would block the child
        self.proc = subprocess.Popen([sys.executable, "-m", "minicavs.bench.ed_batch", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                     text=True, env={**env, **ONE_THREAD} if one_thread else env)
        self.blas_threads = self._read()["blas_threads"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.errors.seek(0)
            raise RuntimeError(f"a minicavs process of the comparison failed:\n{self.errors.read()[-2000:]}")
        return json.loads(line)

    def round(self, policies: list) -> dict:
        self.proc.stdin.write(json.dumps(policies) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()   # the child's loop over stdin ends
        self.proc.wait(timeout=60)
        self.proc.stdout.close()
        self.errors.close()


def alternation(systems, rounds: int) -> list[list]:
    """The systems' order in each round: the list and its reverse in turn, each rotated by one more every
    two rounds, so that over 2·len(systems) rounds each system runs twice in every position and follows
    different systems (none always runs right after the same one)."""
    systems, n = list(systems), len(systems)
    orders = []
    for r in range(rounds):
        base = systems if r % 2 == 0 else systems[::-1]
        k = (r // 2) % n
        orders.append(base[k:] + base[:k])
    return orders


def compare(model: str, python: str, policies, rounds: int, samples: int, log=print) -> dict:
    """The rates of one model: ``{"per core"|"machine": {policy: {"train"|"infer": [per round]}},
    "dynet": {"train"|"infer": [...]}}`` plus the loss check and what each system computed with."""
    ref = trainer(model, samples=samples)
    ours = peers.check_loss(ref, CHECK)
    spec = {"model": model, "hidden": None, "samples": samples, "policies": list(policies)}
    children = {s: Child(spec, one_thread=s == "per core") for s in SETTINGS}
    rates = {s: {p: {"train": [], "infer": []} for p in policies} for s in SETTINGS}
    rates["dynet"] = {"train": [], "infer": []}
    try:
        for r, order in enumerate(alternation(SYSTEMS, rounds)):
            for system in order:
                if system == "dynet":
                    out = peers.run(python, "dynet", ref, epochs=1, check=CHECK, inference=True, samples=samples,
                                    timeout=900)
                    if not peers.same_loss(ours, out["check_loss"]):
                        raise RuntimeError(f"{model}: DyNet's loss {out['check_loss']} is not minicavs' {ours}")
                    rates["dynet"]["train"] += out["rates"]
                    rates["dynet"]["infer"] += out["infer_rates"]
                    continue
                got = children[system].round(list(policies)[::-1 if r % 2 else 1])
                for p, both in got.items():
                    for mode, rate in both.items():
                        rates[system][p][mode].append(rate)
            log(f"  {model}: round {r + 1}/{rounds} done")
    finally:
        for c in children.values():
            c.close()
    return {"rates": rates, "unit": getattr(ref.task, "unit", "samples"), "check_loss": ours,
            "hidden": HIDDEN.get(model, DEFAULT_HIDDEN), "samples": len(ref.task.data["train"]),
            "blas_threads": {s: c.blas_threads for s, c in children.items()}}


def _median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(results: dict, policies, rounds: int, load: tuple) -> str:
    """The markdown table: one row per model, pass and setting; minicavs' worst and best policy over DyNet
    (the best of several noisy medians is biased up: the worst bounds it) beside the paper's ratio (on the
    inference rows: the paper's are inference)."""
    cores = os.cpu_count() or 1
    lines = [f"# ED-Batch's workloads: minicavs' policies against DyNet's own autobatching", "",
             f"Units per second (the model's unit), medians of {rounds} rounds; systems alternate every round; "
             f"batch {BATCH}, hidden {DEFAULT_HIDDEN} (MV-RNN {HIDDEN['mv_rnn']}), float32, no weight decay. "
             f"Per core: minicavs on one BLAS thread; machine: minicavs' BLAS on the machine's {cores} cores; "
             "DyNet (dynet38, autobatch=1) computes on one thread in both. Every round DyNet first computed "
             "minicavs' loss for minicavs' weights (relative 1e-4).", "",
             "**Baselines differ:** the paper's ratios are ED-Batch over DyNet *with Cavs's optimizations* "
             "(CPU, inference); ours are minicavs over DyNet's own autobatching.", "",
             f"Machine load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end "
             "(a shared machine: other work ran beside this).", "",
             "| model | unit | pass | threads | " + " | ".join(policies)
             + " | DyNet | policies / DyNet (worst-best) | paper (vs Cavs DyNet) |",
             "|---" * (len(policies) + 7) + "|"]
    for model, res in results.items():
        r = res["rates"]
        for mode in ("infer", "train"):
            dynet = _median(r["dynet"][mode])
            for s in SETTINGS:
                ours = {p: _median(r[s][p][mode]) for p in policies}
                best, worst = max(ours, key=ours.get), min(ours, key=ours.get)
                lines.append(f"| {model} | {res['unit']} | {'inference' if mode == 'infer' else 'training'} | "
                             f"{s} | " + " | ".join(f"{ours[p]:,.0f}" for p in policies)
                             + f" | {dynet:,.0f} | {ours[worst] / dynet:.2f}-{ours[best] / dynet:.2f}x (best {best}) | "
                             + (PAPER[model] if mode == "infer" else "") + " |")
    return "\n".join(lines)


def run_ed_batch(models, python: str, out: Path, quick: bool, rounds: int, log=print) -> str:
    """The whole comparison, its table (markdown) and its record (JSON) written into ``out``; returns the
    table."""
    policies = QUICK_POLICIES if quick else POLICIES
    samples = BATCH if quick else 4 * BATCH
    load = [os.getloadavg()[0]]
    results = {}
    for model in models:
        log(f"ED-Batch comparison: {model}")
        results[model] = compare(model, python, policies, rounds, samples, log)
    load.append(os.getloadavg()[0])
    text = table(results, policies, rounds, tuple(load))
    out.mkdir(parents=True, exist_ok=True)
    (out / "ed_batch.md").write_text(text + "\n")
    (out / "ed_batch.json").write_text(json.dumps({"policies": list(policies), "rounds": rounds, "load": load,
                                                   "results": results}, indent=1))
    return text


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
