"""ED-Batch's workloads that have DyNet peers here (BiLSTM tagger, LSTM-NMT, lattice GRU) under minicavs'
batching policies against DyNet's autobatching on the same model, weights and samples: training and
inference throughput, medians of rounds that alternate the systems. Each round times one training epoch
and one forward-only pass per policy (after one untimed warm-up epoch per policy, FSMs learned before it),
then runs the DyNet peer once (its own warm-up epoch, then one timed epoch of each), which first computes
minicavs' loss of the first samples with the weights as handed over (checked to 1e-4, or the tool stops).
The paper's baseline is DyNet with Cavs's optimizations ("Cavs DyNet"); this one is DyNet's own
autobatching, so the ratios are not the paper's.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python tools/ed_batch_dynet.py DYNET_PYTHON \
        [--hidden 64] [--samples 256] [--rounds 3] [--models bilstm_tagger lstm_nmt lattice_gru]

Prints a markdown table: units per second of each system (words for the tagger, sequences for LSTM-NMT,
lattices for the lattice GRU) and minicavs' best policy over DyNet.
"""
from __future__ import annotations

import argparse
import statistics
import time


from minicavs.bench import peers
from minicavs.bench.policies import trainer_for

MODELS = ("bilstm_tagger", "lstm_nmt", "lattice_gru")
POLICIES = ("cavs", "agenda", "fsm:S3")
PAPER = {"bilstm_tagger": "1.20x", "lstm_nmt": "1.11x", "lattice_gru": "1.32-2.97x (both lattice models)"}


def epoch_rate(t, samples, training: bool) -> float:
    """Units per second of one pass over ``samples`` in batches of the trainer's size."""
    bs = t.cfg["train"]["batch_size"]
    start = time.perf_counter()
    for i in range(0, len(samples), bs):
        if training:
            res = t.loss_and_grads(samples[i:i + bs])
            t.optimizer.step(res.grads, loss=res.loss)
        else:
            graphs, feeds = t.task.batch(samples[i:i + bs])
            t.model.infer(graphs, feeds, t.params, t.context(training=False))
    return t.task.units(samples) / (time.perf_counter() - start)


def measure(model: str, python: str, hidden: int, count: int, rounds: int) -> dict:
    trainers = {}
    for name in POLICIES:
        t = trainers[name] = trainer_for(model, hidden=hidden, policy=name)
        t.task.data["train"] = t.task.data["train"][:count]
        t.prepare_policy()
        epoch_rate(t, t.task.data["train"], True)          # warm-up: kernels, plans
    rates = {f"{name} {mode}": [] for name in POLICIES + ("dynet",) for mode in ("train", "infer")}
    for _ in range(rounds):
        for name, t in trainers.items():
            rates[f"{name} train"].append(epoch_rate(t, t.task.data["train"], True))
            rates[f"{name} infer"].append(epoch_rate(t, t.task.data["train"], False))
        t = trainers["cavs"]
        ours = peers.check_loss(t, 8)
        out = peers.run(python, "dynet", t, epochs=1, check=8, inference=True)
        if not peers.same_loss(ours, out["check_loss"]):
            raise SystemExit(f"{model}: DyNet's loss {out['check_loss']} is not minicavs' {ours}")
        rates["dynet train"] += out["rates"]
        rates["dynet infer"] += out["infer_rates"]
    return {k: statistics.median(v) for k, v in rates.items()}


def table(results: dict, hidden: int, count: int) -> str:
    head = ["model"] + [f"{p} {m}" for p in POLICIES + ("dynet",) for m in ("train", "infer")]
    lines = [f"Units per second, hidden {hidden}, batch 64, {count} samples; medians.", "",
             "| " + " | ".join(head + ["best policy / DyNet (train, infer)",
                                       "paper (CPU inference, vs Cavs DyNet)"]) + " |",
             "|" + "---|" * (len(head) + 2)]
    for model, r in results.items():
        best = [max(r[f"{p} {m}"] for p in POLICIES) / r[f"dynet {m}"] for m in ("train", "infer")]
        lines.append("| " + " | ".join([model] + [f"{r[k]:,.0f}" for k in head[1:]]
                                       + [f"{best[0]:.2f}x, {best[1]:.2f}x", PAPER[model]]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dynet_python")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = ap.parse_args()
    results = {m: measure(m, args.dynet_python, args.hidden, args.samples, args.rounds) for m in args.models}
    print(table(results, args.hidden, args.samples))


if __name__ == "__main__":
    main()
