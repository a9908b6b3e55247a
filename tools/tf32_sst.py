"""TF32's effect on SST accuracy, measured without a GPU: the same short Tree-LSTM training run on the
emulated CUDA device (the generated kernels on the CPU, minicavs/cuda/emulation.py), float32, with and without
``train.engine.tf32`` (the stand-in's products then read their inputs rounded to TF32's 10-bit mantissa, as
tensor cores do; sums stay float32).

    python tools/tf32_sst.py [--sst-dir ../shared/data/sst] [--trees 512] [--dev 300] [--epochs 2]
                             [--hidden 64] [--embed 64] [--batch 25]

Prints per run the training loss of each epoch and the dev accuracies (all vertices, roots), then the
differences. A measurement, not a test.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minicavs.train.config import bundled_models_dir, load_config  # noqa: E402
from minicavs.cuda import kernels  # noqa: E402
from minicavs.cuda.emulation import Launcher  # noqa: E402
from minicavs.train.trainer import Trainer  # noqa: E402


def run(args, tf32: bool) -> dict:
    d = Path(args.sst_dir)
    cfg = load_config(bundled_models_dir() / "tree_lstm.yaml", [
        f"data.train={d / 'train.txt'}", f"data.dev={d / 'dev.txt'}", "data.test=null", f"data.limit={args.trees}",
        f"model.hidden={args.hidden}", f"model.embed={args.embed}", "model.dropout=0.0", "train.optimizer=adam",
        "train.lr=0.01", f"train.batch_size={args.batch}", "train.device=cuda", "train.dtype=float32",
        f"train.engine.tf32={'true' if tf32 else 'false'}", f"train.seed={args.seed}"])
    t = Trainer(cfg, run_dir=tempfile.mkdtemp(prefix="minicavs-tf32-"))
    t.task.data["dev"] = t.task.data["dev"][:args.dev]
    losses = [t.train_epoch(progress=False)["train_loss"] for _ in range(args.epochs)]
    metrics = {k: v for k, v in t.evaluate("dev").items() if k != "timing"}
    return {"losses": losses, **metrics}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sst-dir", default="../shared/data/sst")
    p.add_argument("--trees", type=int, default=512)
    p.add_argument("--dev", type=int, default=300)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--embed", type=int, default=64)
    p.add_argument("--batch", type=int, default=25)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    launcher = Launcher()
    kernels.default_launcher = lambda: launcher   # (train.device: cuda is the emulated device)
    results = {tf32: run(args, tf32) for tf32 in (False, True)}
    for tf32, r in results.items():
        print(f"tf32={tf32!s:<5} " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in r.items() if k != "losses")
              + "  train_loss per epoch: " + ", ".join(f"{x:.4f}" for x in r["losses"]))
    for k, v in results[True].items():
        if isinstance(v, float):
            print(f"difference (tf32 - float32) {k}: {v - results[False][k]:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
