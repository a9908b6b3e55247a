"""The ``minicavs`` command. Each subcommand is (add_arguments, run); run returns the exit status."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from . import __version__
from .distributed import abort_peers
from .errors import MinicavsError


def _quiet(*_, **__) -> None:
    pass


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--optimizer", choices=("sgd", "adagrad", "adam"), default="adam")
    p.add_argument("--hidden", type=int, default=32, help="hidden units (default 32)")
    p.add_argument("--seed", type=int, default=0)


def _demo(args: argparse.Namespace) -> int:
    from .demo import train_mlp
    res = train_mlp(steps=args.steps, optimizer=args.optimizer, hidden=args.hidden, seed=args.seed)
    print(f"final loss {res['loss']:.4f}, accuracy {res['accuracy']:.1%} "
          f"(untrained {res['initial_accuracy']:.1%}) in {res['seconds']:.2f} s")
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a YAML config, e.g. models/tree_lstm.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=0.1 (repeatable)")
    p.add_argument("--run-dir", default=None, help="where metrics and checkpoints go (default runs/<config>)")


def _train_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR/last.npz")
    p.add_argument("--epochs", type=int, default=None, help="train to this epoch (default: the config's)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")


def _train(args: argparse.Namespace) -> int:
    from .training import Trainer
    trainer = Trainer(args.config, args.overrides, args.run_dir)
    say = print if trainer.is_root else _quiet   # under mpirun: rank 0 speaks
    say(f"training {trainer.cfg['model']['name']} ({sum(p.value.size for p in trainer.params.values()):,} "
        f"parameters) on {len(trainer.task.data['train'])} samples; run dir {trainer.run_dir}"
        + (f"; {trainer.parallel.comm.size} ranks" if trainer.parallel else ""))
    trainer.fit(args.epochs, resume=args.resume, progress=not args.no_progress)
    best = trainer.run_dir / "best.npz"
    trainer.load(best, optimizer=False)
    for split in ("dev", "test"):
        if trainer.task.data.get(split):
            metrics = trainer.evaluate(split)
            metrics.pop("timing")
            say(f"best checkpoint ({best}) on {split}: "
                + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by minicavs train")
    p.add_argument("--split", default="test", choices=("train", "dev", "test"))


def _eval(args: argparse.Namespace) -> int:
    from .training import Trainer
    trainer = Trainer(args.config, args.overrides, args.run_dir)
    trainer.load(args.checkpoint, optimizer=False)
    metrics = trainer.evaluate(args.split)
    timing = metrics.pop("timing")
    say = print if trainer.is_root else _quiet
    say("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f"  ({timing[args.split + '_seconds']:.1f} s)")
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    from .bench import add_arguments
    add_arguments(p)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run
    return run(args)


COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "train": ("train a model from a YAML config", _train_args, _train),
    "eval": ("evaluate a checkpoint on a data split", _eval_args, _eval),
    "bench": ("the paper's sweeps (Fig. 8, 9a) for Tree-LSTM, Tree-FC, Var-LSTM and Fixed-LSTM against DyNet and "
              "PyTorch if given: training and inference rates, time split, peak memory, tables, plots, ablation",
              _bench_args, _bench),
    "demo": ("train a small MLP on a synthetic spiral (a smoke test of the core)", _demo_args, _demo),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minicavs", description="Cavs: a vertex-centric runtime for "
                                     "dynamic neural networks, from scratch.")
    parser.add_argument("--version", action="version", version=f"minicavs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command][2](args)
    except (MinicavsError, FileNotFoundError) as e:  # ConfigError, DataError, CheckpointError, ...
        print(f"minicavs {args.command}: error: {e}", file=sys.stderr)
        abort_peers(2)   # under mpirun: the other ranks may be waiting for this one
        return 2


if __name__ == "__main__":
    sys.exit(main())
