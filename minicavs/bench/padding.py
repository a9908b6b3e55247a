"""``minicavs bench --padding``: what padding costs a static graph. The Var-LSTM written as one static graph
(``model.graph: foreach``: sentences padded, each row run for its own length) against the chain-graph Var-LSTM
(one chain per sentence, the Cavs way), each with the batches shuffled and bucketed by length
(``train.order``), on the PTB recipe's sizes (embed 128, hidden 256, batch 64, no dropout).

Measure: training time per real word (the words and <eos> of the sentences, never the padded positions), one
epoch over the same sentences per system per round, the systems' order rotated every round, medians over the
rounds; the ratio to the chain graph's shuffled epochs (the target for the bucketed foreach: <= 1.3x).
Also per system the padding its batches hold: rows x the batch's longest sentence over the real words (what a
loop that runs every row to the batch's end computes; the per-row trip counts skip it).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ..engine.compile import EngineOptions
from .point import blas_threads
from .sweeps import Point
from .workloads import Data, build

HIDDEN, EMBED, BATCH = 256, 128, 64
BASELINE = "chain graph, shuffled"
SYSTEMS = {BASELINE: ["model.graph=chain"],
           "chain graph, bucketed": ["model.graph=chain", "train.order=bucket"],
           "foreach, bucketed": ["model.graph=foreach", "train.order=bucket"],
           "foreach, shuffled": ["model.graph=foreach"]}


def _epoch_seconds(t, epoch: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one training epoch (the trainer's batches of ``epoch``, in its ``train.order``).
    CPU time is this process's, all its threads: on a shared machine the steadier of the two."""
    batches = t.epoch_batches(epoch)
    start, cpu = time.perf_counter(), time.process_time()
    t.train_batches(batches)
    return time.perf_counter() - start, time.process_time() - cpu


def _padding(t) -> float:
    """Rows x longest sentence per batch over the real steps, for the trainer's first epoch's batches."""
    lengths = t.task.sample_lengths(t.task.data["train"])
    batches = t.epoch_batches(1)
    return sum(len(b) * int(lengths[b].max()) for b in batches) / float(lengths.sum())


def measure(text: str | None, sentences: int, repeats: int) -> dict:
    """Per system: the epochs' seconds, the medians per real word, the padding; the systems alternating."""
    data = Data(ptb=text, sentences=sentences, lm_embed=EMBED)
    trainers = {name: build(Point("var_lstm", HIDDEN, BATCH), data, EngineOptions(), extra)
                for name, extra in SYSTEMS.items()}
    for t in trainers.values():
        _epoch_seconds(t, 0)     # compiles kernels, sizes the buffers
    seconds: dict = {name: [] for name in trainers}
    names = list(trainers)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds[name].append(_epoch_seconds(trainers[name], r + 1))
    any_t = next(iter(trainers.values()))
    words = any_t.task.units(any_t.task.data["train"])
    rows = {}
    for name, s in seconds.items():
        wall, cpu = (1e6 * statistics.median(x) / words for x in zip(*s))
        rows[name] = {"seconds": s, "us_per_word": wall, "cpu_us_per_word": cpu, "padding": _padding(trainers[name])}
    for row in rows.values():
        row["ratio"] = row["us_per_word"] / rows[BASELINE]["us_per_word"]
        row["cpu_ratio"] = row["cpu_us_per_word"] / rows[BASELINE]["cpu_us_per_word"]
    return {"sentences": len(any_t.task.data["train"]), "words": words, "repeats": repeats,
            "blas_threads": blas_threads(), "text": text or "synthetic", "systems": rows}


def table(result: dict) -> str:
    lines = [f"Var-LSTM, embed {EMBED}, hidden {HIDDEN}, batch {BATCH}: {result['sentences']} sentences of "
             f"{result['text']} ({result['words']} real words), training, medians of {result['repeats']} "
             f"alternating epochs, {result['blas_threads']} BLAS thread(s)", "",
             "| system | us per real word | x chain graph (shuffled) | CPU us per real word | x chain graph (CPU) "
             "| padded steps / real steps |", "| --- | --- | --- | --- | --- | --- |"]
    for name, row in result["systems"].items():
        lines.append(f"| {name} | {row['us_per_word']:.1f} | {row['ratio']:.2f} | {row['cpu_us_per_word']:.1f} | "
                     f"{row['cpu_ratio']:.2f} | {row['padding']:.2f} |")
    ours = result["systems"]["foreach, bucketed"]
    lines += ["", f"foreach with bucketing / chain graph: {ours['ratio']:.2f}x wall, {ours['cpu_ratio']:.2f}x CPU "
                  "(target: <= 1.3x)"]
    return "\n".join(lines)


def run_padding(out: Path, text: str | None, sentences: int, repeats: int) -> str:
    """Measure, write padding.md and padding.json into ``out``, return the table."""
    result = measure(text, sentences, repeats)
    out.mkdir(parents=True, exist_ok=True)
    text_table = table(result)
    (out / "padding.md").write_text(text_table + "\n")
    (out / "padding.json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    return text_table

