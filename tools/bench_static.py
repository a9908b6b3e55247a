"""Static graphs as programs against the step runner: CPU time of one process, one BLAS thread, for a tree of the
repository at ``--repo`` (run it once per tree, alternating trees, and compare the medians; ``--rounds`` does the
alternating itself for two trees given as ``--repo A --repo B``).

Points:
  infer   batch-1 inference of the SST Tree-LSTM (hidden 128, ``Model.infer`` one tree at a time): µs per tree
  train   Tree-LSTM forward and backward on SST, batch 64, hidden 128: trees per second
  train1  the same at batch 1
  predict seq2seq's greedy decoding (``minicavs predict``'s pass, the bundled config, batch 64): sequences per
          second
(seq2seq's training throughput against a base commit: ``minicavs bench --control``'s row ``seq2seq``.)

    python tools/bench_static.py --repo /path/before --repo /path/after --rounds 5 --point infer
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SST = "/work/shared/data/sst/train.txt"


def _infer(trees: int) -> float:
    from minicavs.bench import workloads
    from minicavs.engine.compile import EngineOptions
    t = workloads.tree_lstm(SST, 128, 128, 1, trees, EngineOptions())
    data = t.task.data["train"]
    batches = [t.task.batch(data[i:i + 1]) for i in range(len(data))]
    ctx = t.context(training=False)
    times = []
    for _ in range(4):
        start = time.process_time_ns()
        for graphs, feeds in batches:
            t.model.infer(graphs, feeds, t.params, ctx)
        times.append((time.process_time_ns() - start) / len(batches) / 1e3)
    return sorted(times[1:])[1]   # (the first pass warms up; the second best of the rest)


def _training_rate(t, batches: list, samples: int) -> float:
    """Samples per CPU second of a training pass over ``batches``: the median of the 2nd and 3rd passes."""
    rates = []
    for _ in range(3):
        start = time.process_time_ns()
        for graphs, feeds in batches:
            t.model.forward_backward(graphs, feeds, t.params)
        rates.append(samples / ((time.process_time_ns() - start) / 1e9))
    return statistics.median(rates[1:])


def _train(trees: int, batch: int = 64) -> float:
    from minicavs.bench import workloads
    from minicavs.engine.compile import EngineOptions
    t = workloads.tree_lstm(SST, 128, 128, batch, trees, EngineOptions())
    data = t.task.data["train"]
    batches = [t.task.batch(data[i:i + batch]) for i in range(0, len(data), batch)]
    return _training_rate(t, batches, len(data))


def _predict(sequences: int) -> float:
    """seq2seq's greedy decoding of ``sequences`` generated sequences (the bundled config, untrained: every
    batch decodes its most steps), sequences per CPU second: the median of passes 2 to 4."""
    import tempfile
    from minicavs.train.config import bundled_models_dir, load_config
    from minicavs.train.trainer import Trainer
    cfg = load_config(bundled_models_dir() / "seq2seq.yaml", [f"data.synthetic.dev={sequences}"])
    t = Trainer(cfg, run_dir=tempfile.mkdtemp(prefix="minicavs-bench-static-"))
    samples = t.task.data["dev"]
    rates = []
    for _ in range(4):
        start = time.process_time_ns()
        t.task.predict(samples, 64)
        rates.append(len(samples) / ((time.process_time_ns() - start) / 1e9))
    return statistics.median(rates[1:])


POINTS = {"infer": (_infer, 512), "train": (_train, 1024), "train1": (lambda n: _train(n, 1), 256),
          "predict": (_predict, 2048)}


def _one(point: str) -> None:
    import minicavs
    minicavs.set_blas_threads(1)
    fn, size = POINTS[point]
    print(json.dumps({"point": point, "value": fn(size), "repo": os.environ["MC_REPO"]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", action="append", required=True)
    ap.add_argument("--point", choices=sorted(POINTS), default="infer")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        _one(args.point)
        return
    found: dict = {repo: [] for repo in args.repo}
    for _ in range(args.rounds):
        for repo in args.repo:   # (fresh processes, the trees alternating)
            env = dict(os.environ, PYTHONPATH=repo, MC_REPO=repo, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            out = subprocess.run([sys.executable, __file__, "--one", "--point", args.point, "--repo", repo],
                                 env=env, capture_output=True, text=True, check=True, cwd=repo).stdout
            found[repo].append(json.loads(out.splitlines()[-1])["value"])
    for repo, values in found.items():
        print(f"{args.point} {repo}: median {statistics.median(values):.1f} of {[round(v, 1) for v in values]}")


if __name__ == "__main__":
    main()
