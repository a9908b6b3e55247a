"""The ``minicavs`` command. Each subcommand is (add_arguments, run); run returns the exit status.

Exit status: 0 done, 2 a user error (bad config, data, checkpoint or run dir; a missing or unwritable file; a
model or batch too large for memory: one line on stderr, no traceback), 130 interrupted (Ctrl-C), 141 standard
output closed early (``minicavs train ... | head -1``: quietly, as Unix tools end on SIGPIPE). A traceback means
a bug in minicavs."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from .. import __version__
from ..core.errors import MinicavsError
from ..core.wording import CLI, cli_text
from .config import ConfigError
from .distributed import abort_peers, alone_on_rank_0, launched_rank, raised_on_every_rank, says_error


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
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=0.1 (repeatable)")


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a YAML config (models/tree_lstm.yaml), a bundled model's name (tree_lstm), or "
                                  "with --resume a run dir")
    _config_args(p)
    p.add_argument("--run-dir", default=None, help="where the run's files go (default runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue the run in the run dir from its last.npz, "
                   "with its recorded config (--set may change only train.epochs, early stopping's patience and "
                   "how to run); a run stopped before its first checkpoint starts over")
    p.add_argument("--force", action="store_true", help="replace the run the run dir holds")
    p.add_argument("--epochs", type=int, default=None, help="train to this epoch (default: the config's)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")


def _is_dir(path: str) -> bool:
    """Whether ``path`` is a directory as MPI rank 0 sees it (a run dir need exist on rank 0 alone): every
    rank takes the same branch, and so makes the same collective calls."""
    from .distributed import on_root, world
    return on_root(world(), lambda: Path(path).is_dir())


def _run_dir_of(target: str, run_dir: str | None) -> Path:
    """--run-dir, else the target itself if it is a directory, else runs/<config name>."""
    if run_dir:
        return Path(run_dir)
    if _is_dir(target):
        return Path(target)
    from .config import find_config
    return Path("runs") / find_config(target).stem


def _train(args: argparse.Namespace) -> int:
    from ..core import onetime
    from .distributed import world
    from .trainer import Trainer
    if args.epochs is not None and args.epochs < 1:
        raise ConfigError(f"--epochs {args.epochs}: must be an integer >= 1")
    comm = world()
    # one-time work while the model is built (reading pretrained vectors) is said as it starts, by rank 0
    with onetime.announcing(print if comm is None or comm.rank == 0 else lambda _: None):
        if args.resume:   # a config named as well must describe the run (its model, what is trained)
            named = None if _is_dir(args.config) else args.config
            trainer = Trainer.resuming(_run_dir_of(args.config, args.run_dir), args.overrides, config=named)
        else:
            if _is_dir(args.config):
                raise ConfigError(f"{args.config} is a directory: give a config to start a run, or --resume it")
            trainer = Trainer(args.config, args.overrides, _run_dir_of(args.config, args.run_dir))
    trainer.words = CLI   # advice in what it prints names flags
    trainer.fit(args.epochs, resume=args.resume, progress=not args.no_progress, force=args.force)
    trainer.final_results()
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="a run dir (its best checkpoint and recorded config), or a config whose data "
                                  "to evaluate a --checkpoint on")
    _config_args(p)
    p.add_argument("--checkpoint", default=None, help="a checkpoint written by minicavs train (default, for a run "
                   "dir: its best)")
    p.add_argument("--split", default="test", choices=("train", "dev", "test"))


def _eval(args: argparse.Namespace) -> int:
    from .trainer import Trainer, format_metrics
    trainer, ck = Trainer.for_target(args.target, args.checkpoint, args.overrides)
    metrics = trainer.evaluate(args.split)
    timing = metrics.pop("timing")
    if trainer.is_root:   # under mpirun: rank 0 speaks
        oov = _unknown_words(trainer.task, args.split)
        print(f"{ck}: {format_metrics(metrics)}{oov}  ({timing[args.split + '_seconds']:.1f} s){trainer.device_note()}")
    return 0


UNKNOWN_WORDS_WARNING = 0.10   # eval warns above this out-of-vocabulary rate (the real SST's test set: 6.0%)


def _unknown_words(task, split: str) -> str:
    """The split's out-of-vocabulary rate for eval's line (empty for a model without a vocabulary), and a
    warning on stderr when it is high: such a test set measures mostly the <unk> embedding."""
    counts = task.unknown_words(split)
    if not counts or not counts[1]:
        return ""
    unknown, words = counts
    if unknown / words > UNKNOWN_WORDS_WARNING:
        print(f"minicavs eval: warning: {unknown / words:.1%} of the {split} words ({unknown:,} of {words:,}) are "
              "not in the model's vocabulary (each reads as <unk>): is it the kind of data the model was trained on?",
              file=sys.stderr)
    return f"  {split}_oov_rate {unknown / words:.1%}"


def _module(name: str) -> tuple[Callable, Callable]:
    """A command that lives in a module of its own, as (add_arguments, run): its ``add_arguments(parser)`` and
    ``run(args)``, the module imported when the parser is built."""
    def add(p: argparse.ArgumentParser) -> None:
        importlib.import_module(name, __package__).add_arguments(p)

    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(name, __package__).run(args)
    return add, run


COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "train": ("train a model from a YAML config", _train_args, _train),
    "eval": ("evaluate a checkpoint on a data split", _eval_args, _eval),
    "predict": ("apply a trained model to new input: one output line per non-blank input line (FILE or - for stdin)",
                *_module(".predict")),
    "export": ("write a trained model as one .mcav file that predicts without its Python module",
               *_module(".export")),
    "serve": ("serve a model over HTTP on 127.0.0.1, batching requests that arrive within a few ms through one "
              "schedule", *_module(".serve")),
    "plot": ("training curves of a run dir as a PNG (needs matplotlib: pip install 'minicavs[plot]')",
             *_module(".plot")),
    "show": ("draw F and ∂F of every vertex function: DOT (and SVG/PNG with Graphviz), nodes colored by class "
             "(eager / lazy / recurrent / static), fused kernels as boxes, gradients named", *_module(".show")),
    "prepare": ("check a downloaded data set (sha256, format) and put it where the configs look: "
                "minicavs prepare sst ../shared/data/sst", *_module(".datasets")),
    "bench": ("the paper's sweeps (Fig. 8, 9a) for Tree-LSTM, Tree-FC, Var-LSTM and Fixed-LSTM against DyNet and "
              "PyTorch if given: training and inference rates, time split, peak memory, tables, plots, ablation",
              *_module("..bench")),
    "demo": ("train a small MLP on a synthetic spiral (a smoke test of the core)", _demo_args, _demo),
}


# the commands that share their work among the ranks of an MPI job (rank 0 prints and writes); any other
# runs on rank 0 alone (distributed.alone_on_rank_0)
DATA_PARALLEL = ("train", "eval", "predict")


class _Parser(argparse.ArgumentParser):
    """Under mpirun every rank parses the same command line: help, --version and usage errors are printed by
    rank 0 alone, whose exit status is the job's; the others exit 0 at once (a non-zero status would have the
    launcher end rank 0 before it has printed). ``_print_message`` is where argparse prints."""

    def _print_message(self, message: str, file=None) -> None:
        if launched_rank() == 0:
            super()._print_message(message, file)

    def exit(self, status: int = 0, message: str | None = None):
        super().exit(_status(status), message)


def _status(status: int) -> int:
    """The exit status of an error every rank meets: rank 0's, 0 on the others (see :class:`_Parser`)."""
    return status if launched_rank() == 0 else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="minicavs", description="Cavs: a vertex-centric runtime for "
                                     "dynamic neural networks, from scratch.")
    parser.add_argument("--version", action="version", version=f"minicavs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return _status(2)
    if args.command not in DATA_PARALLEL and not alone_on_rank_0():
        return 0   # under mpirun: a rank other than 0, with nothing to do
    try:
        return COMMANDS[args.command][2](args)
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt:
        hint = ": resume with --resume" if args.command == "train" else ""
        print(f"\nminicavs {args.command}: interrupted{hint}", file=sys.stderr)
        return 130
    except (MinicavsError, OSError) as e:  # ConfigError, DataError, CheckpointError, a missing file, a full disk
        return _failed(args.command, _one_line(e), e)
    except MemoryError as e:
        return _failed(args.command, _out_of_memory(e, args.command), e)


def _failed(command: str, message: str, error: BaseException) -> int:
    """The error's one line on stderr, exit status 2. Under mpirun an error every rank raised together is
    said by rank 0 alone, which exits 2 (the others 0, so that the launcher does not end rank 0 while it
    exits); any other error ends the whole job (the other ranks may be waiting for this one)."""
    if says_error(error):
        print(f"minicavs {command}: error: {message}", file=sys.stderr)
    if not raised_on_every_rank(error):
        abort_peers(2)
    return 2 if says_error(error) else 0   # the job's status is rank 0's; the others end quietly


SIGPIPE_STATUS = 141   # 128 + SIGPIPE: what a shell reports for a tool that a closed pipe ended


def _stdout_closed() -> int:
    """The reader of standard output went away (``| head -1``): end quietly, as Unix tools do. Standard output
    is pointed at /dev/null first, so the interpreter's last flush at exit cannot fail and print a second
    error (the recipe in Python's ``signal`` documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):   # stdout is no file descriptor (replaced in-process)
        pass
    return SIGPIPE_STATUS


def _out_of_memory(e: MemoryError, command: str) -> str:
    """One line for a MemoryError: what did not fit (numpy's message names the array's size, shape and dtype)
    and which settings make a run smaller."""
    what = " ".join(str(e).split()) or "an allocation failed"
    batch = "train.batch_size" if command == "train" else "train.eval_batch_size"
    return (f"out of memory: {what}; lower {batch} or the model's size (model.hidden, model.embed) with --set, "
            "or free memory")


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and not isinstance(e, MinicavsError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return " ".join(cli_text(e).split("\n"))


if __name__ == "__main__":
    sys.exit(main())
