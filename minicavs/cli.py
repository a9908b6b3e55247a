"""The ``minicavs`` command. Each subcommand is (add_arguments, run); run returns the exit status."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from . import __version__
from .errors import MinicavsError


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


COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
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
    except (MinicavsError, FileNotFoundError) as e:
        print(f"minicavs {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
