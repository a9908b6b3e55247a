"""``minicavs export``: a trained model as one ``.mcav`` file that runs without its Python module.

    minicavs export runs/tree_lstm -o tree_lstm.mcav             # the run dir's config and best checkpoint
    minicavs export models/tree_lstm.yaml --checkpoint ck.npz -o m.mcav
    minicavs predict tree_lstm.mcav trees.txt                     # no models/ needed any more

What the file holds and how it is checked: :mod:`minicavs.train.artifact`. A config without ``--checkpoint``
exports the freshly initialised model (said on stderr): useful to check that a model exports at all.
"""
from __future__ import annotations

import argparse
import os
import sys

from .artifact import SUFFIX, export


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="RUN_DIR|CONFIG", help="a run dir written by minicavs train (its config and "
                   "best checkpoint), or a YAML config (with --checkpoint for trained weights)")
    p.add_argument("--checkpoint", default=None, help="the weights (default: RUN_DIR/best.npz)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable)")
    p.add_argument("--output", "-o", required=True, help=f"the model file to write (e.g. model{SUFFIX})")


def run(args: argparse.Namespace) -> int:
    from .trainer import Trainer
    if os.path.isdir(args.target) or args.checkpoint:
        trainer, ck = Trainer.for_target(args.target, args.checkpoint, args.overrides)
        source = str(ck)
    else:
        trainer = Trainer(args.target, args.overrides)
        source = "untrained parameters"
    meta = export(args.output, trainer.task, trainer.cfg)
    if source == "untrained parameters":   # (said once the export is done: an error stays one line)
        print(f"minicavs export: warning: no --checkpoint: exported the initial (untrained) parameters of "
              f"{args.target}", file=sys.stderr)
    size = os.path.getsize(args.output)
    print(f"wrote {args.output} ({size / 1e6:.2f} MB): {len(meta['nodes'])} IR nodes, "
          f"{len(meta['params'])} parameters from {source}, format {meta['format']} version {meta['version']}")
    return 0
