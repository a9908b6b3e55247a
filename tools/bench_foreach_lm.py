"""The foreach Var-LSTM (``model.graph: foreach``, one static graph: a loop with a trip count per row) against the
chain-graph Var-LSTM on sentences of one length: CPU ms per training step (forward and backward, no optimizer),
one process per (tree, system) and round, one BLAS thread, trees and systems alternating; medians.

    python tools/bench_foreach_lm.py --repo /path/before --repo /path/after --rounds 5 --hidden 128
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SYSTEMS = ("chain", "foreach")


def _sentences(count: int, length: int, vocab: int, seed: int) -> list:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [[f"w{i}" for i in rng.integers(0, vocab, length)] for _ in range(count)]


def _step_ms(system: str, hidden: int, length: int, batch: int, steps: int) -> float:
    from pathlib import Path
    from minicavs.train.trainer import Trainer
    repo = Path(os.environ["MC_REPO"])
    overrides = [f"model.graph={system}", "model.dropout=0", f"model.hidden={hidden}", "model.embed=128",
                 f"train.batch_size={batch}"]
    text = Path(f"/tmp/bench_foreach_lm_{length}.txt")
    if not text.exists():
        text.write_text("\n".join(" ".join(s) for s in _sentences(batch * 4, length, 2000, 1)) + "\n")
    overrides += [f"data.train={text}", f"data.dev={text}", f"data.test={text}"]
    t = Trainer(repo / "models" / "var_lstm.yaml", overrides, run_dir=Path(f"/tmp/bench_foreach_lm_{system}"))
    data = t.task.data["train"]
    batches = [t.task.batch(data[i:i + batch]) for i in range(0, len(data), batch)]
    times = []
    for k in range(steps + 2):
        graphs, feeds = batches[k % len(batches)]
        start = time.process_time_ns()
        t.model.forward_backward(graphs, feeds, t.params)
        times.append((time.process_time_ns() - start) / 1e6)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", action="append", required=True)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--one", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        import minicavs
        minicavs.set_blas_threads(1)
        print(json.dumps({"ms": _step_ms(args.one, args.hidden, args.length, args.batch, args.steps)}))
        return
    found: dict = {(repo, s): [] for repo in args.repo for s in SYSTEMS}
    for r in range(args.rounds):
        for repo in (args.repo if r % 2 == 0 else args.repo[::-1]):
            for system in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
                env = dict(os.environ, PYTHONPATH=repo, MC_REPO=repo, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
                cmd = [sys.executable, __file__, "--one", system, "--repo", repo, "--hidden", str(args.hidden),
                       "--length", str(args.length), "--batch", str(args.batch), "--steps", str(args.steps)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=repo).stdout
                found[(repo, system)].append(json.loads(out.splitlines()[-1])["ms"])
    for repo in args.repo:
        chain, loop = (statistics.median(found[(repo, s)]) for s in SYSTEMS)
        print(f"hidden {args.hidden}, {args.length} words x {args.batch} rows, {repo}: chain {chain:.2f} ms, "
              f"foreach {loop:.2f} ms per step: {loop / chain:.2f}x  (rounds: chain "
              f"{[round(v, 2) for v in found[(repo, 'chain')]]}, foreach {[round(v, 2) for v in found[(repo, 'foreach')]]})")


if __name__ == "__main__":
    main()
