"""``minicavs predict``: a trained model applied to new input, one output line per non-blank input line.

    minicavs predict runs/tree_lstm trees.txt                  # the run dir's config and best checkpoint
    minicavs predict models/tree_lstm.yaml --checkpoint runs/tree_lstm/best.npz - < trees.txt

What a line holds and what the model writes for it is the model's business (``Task.parse_input``,
``Task.predict``, ``Task.predicts`` says it in words): a bundled Tree-LSTM reads a bracketed tree and writes
it back with a predicted label at every node; a language model reads a sentence and writes its perplexity,
log-likelihood and likeliest next words.

Input is read as strict UTF-8, from a file or standard input alike. Blank lines are skipped, as the data set
readers skip them (``--json`` rows carry each line's number). Every line is parsed before anything runs, so a
bad line (not UTF-8, or not what the model reads) is an error naming ``FILE:LINE`` and nothing is written;
with ``--skip-bad`` each bad line is reported on stderr and the rest are predicted. An input with no line to
predict is a warning, not an error (exit 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Any, Callable, Iterable, Sequence

from ..core.atomic import write_text
from ..core.errors import DataError, MinicavsError
from ..data.text import decode_lines, is_blank


class PredictError(MinicavsError):
    """What the user asked for cannot be predicted (no checkpoint, a model without text input)."""


def read_lines(source: IO[bytes] | IO[str], name: str,
               on_bad: Callable[[DataError], None] | None = None) -> list[tuple[int, str]]:
    """(line number, text without its newline) of every line of ``source`` (a binary stream, or a text one
    whose lines must encode back to UTF-8); a line that is not UTF-8 is a DataError naming ``name:line``,
    or with ``on_bad`` is passed to it and left out."""
    return [(lineno, line.rstrip("\r\n")) for lineno, line in decode_lines(source, name, on_bad)]


def parse_lines(task, lines: Iterable[tuple[int, str]], name: str,
                on_bad: Callable[[DataError], None] | None = None) -> list[tuple[int, Any]]:
    """(line number, sample) of every non-blank line; a line the model cannot read is a DataError naming
    ``name:line``, or with ``on_bad`` is passed to it and left out."""
    if not task.predicts:
        raise PredictError(f"model {type(task).__name__} does not predict from text input "
                           "(its inputs are not text: see its module docstring)")
    samples = []
    for lineno, line in lines:
        if is_blank(line):
            continue
        try:
            samples.append((lineno, task.parse_input(line, f"{name}:{lineno}")))
        except DataError as e:
            if on_bad is None:
                raise
            on_bad(e)
    return samples


def predict_samples(task, numbered: Sequence[tuple[int, Any]], batch_size: int = 64) -> list[dict]:
    """Predict in batches: one dict per sample, with ``line``, its line number."""
    rows = task.predict([sample for _, sample in numbered], batch_size) if numbered else []
    return [{**row, "line": lineno} for (lineno, _), row in zip(numbered, rows)]


def predict_lines(task, lines: Iterable[str], name: str = "<input>", batch_size: int = 64,
                  on_bad: Callable[[DataError], None] | None = None) -> list[dict]:
    """Parse every line (numbered from 1; blank ones skipped; errors name ``name:line``, or with ``on_bad``
    are passed to it and the line left out), then predict in batches: one dict per predicted line, with
    ``line``, its number."""
    return predict_samples(task, parse_lines(task, enumerate(lines, 1), name, on_bad), batch_size)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="RUN_DIR|CONFIG",
                   help="a run dir written by minicavs train (its config.yaml and best.npz), a YAML config "
                        "with --checkpoint, or a model file written by minicavs export (.mcav)")
    p.add_argument("input", metavar="FILE|-", help="input lines, '-' for standard input")
    p.add_argument("--checkpoint", default=None, help="the weights (default: RUN_DIR/best.npz)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.eval_batch_size=8 (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per line, with the numbers behind it")
    p.add_argument("--output", "-o", default=None, help="write here instead of standard output")
    p.add_argument("--skip-bad", action="store_true", help="report each bad input line on stderr and predict the "
                   "rest (default: a bad line is an error and nothing is predicted)")
    p.epilog = ("What each bundled model predicts: tree_lstm: the input tree with a sentiment label (0-4) at every "
                "node; var_lstm, fixed_lstm: per sentence its perplexity, log-likelihood and the 3 likeliest next "
                "words; tree_fc: nothing (random vector inputs).")


def _predictor(args: argparse.Namespace) -> tuple[Any, int, str, Any, bool]:
    """(what parses and predicts, the batch size, a note for stderr or "", the MPI communicator or None, whether
    this rank writes the output): a model file (.mcav) loaded without its Python module, on rank 0 alone under
    mpirun (None on the others), or the trainer of a run dir or config, whose ranks predict a shard each."""
    from .artifact import SUFFIX, load
    from .distributed import alone_on_rank_0
    if args.target.endswith(SUFFIX):
        if args.checkpoint or args.overrides:
            raise PredictError(f"{args.target} is an exported model: it holds its weights and config "
                               "(--checkpoint and --set apply to a run dir or config)")
        if not alone_on_rank_0():
            return None, 0, "", None, False
        loaded = load(args.target)
        return loaded, loaded.config["train"]["eval_batch_size"], "", None, True
    from .trainer import Trainer
    trainer, _ = Trainer.for_target(args.target, args.checkpoint, args.overrides)
    note = "" if trainer.device.name == "cpu" else f"predicted on device {trainer.device.description}"
    comm = trainer.parallel.comm if trainer.parallel else None
    return trainer.task, trainer.cfg["train"]["eval_batch_size"], note, comm, trainer.is_root


def run(args: argparse.Namespace) -> int:
    """Under mpirun rank 0 reads the input (standard input reaches rank 0 alone), every rank predicts a
    contiguous shard of it, and rank 0 writes the rows in input order: one output, one writer."""
    from .distributed import gather_to_root, scatter_from_root
    task, batch_size, note, comm, writes = _predictor(args)
    if task is None:
        return 0
    name = "<stdin>" if args.input == "-" else args.input
    bad: list = []
    samples = scatter_from_root(comm, lambda: _read_input(task, args.input, name, bad, args.skip_bad))
    rows = gather_to_root(comm, lambda: predict_samples(task, samples, batch_size))
    if not writes:
        return 0
    if note:   # (on stderr: standard output holds the predictions only)
        print(note, file=sys.stderr)
    text = "".join((json.dumps(r) if args.json else r["text"]) + "\n" for r in rows)
    if args.output:
        write_text(args.output, text)
    else:
        write_stdout(text)
    if bad and rows:
        print(f"minicavs predict: skipped {len(bad)} bad line{'s' * (len(bad) != 1)}, predicted {len(rows)}",
              file=sys.stderr)
    return 0


def _read_input(task, source: str, name: str, bad: list, skip_bad: bool) -> list[tuple[int, Any]]:
    """(line number, sample) of every line to predict in ``source`` (a file, or - for standard input); each
    bad line skipped is reported and added to ``bad`` (with ``skip_bad``, else it is an error)."""
    def skipped(e: DataError) -> None:
        bad.append(e)
        print(f"minicavs predict: skipped {e}", file=sys.stderr)
    on_bad = skipped if skip_bad else None
    if source == "-":   # the bytes, decoded strictly as a file is (not the locale's surrogate escapes)
        lines = read_lines(getattr(sys.stdin, "buffer", sys.stdin), name, on_bad)
    else:
        _check_input_file(source)
        with open(source, "rb") as f:
            lines = read_lines(f, name, on_bad)
    samples = parse_lines(task, lines, name, on_bad)
    if not samples:
        why = f"{len(bad)} bad line{'s' * (len(bad) != 1)} skipped, the others blank" if bad else \
            "it is empty or blank"
        print(f"minicavs predict: warning: {name} holds no line to predict ({why})", file=sys.stderr)
    return samples


def write_stdout(text: str) -> None:
    """``text`` on standard output as UTF-8, as ``-o FILE`` writes it, whatever the locale's encoding (an ASCII
    terminal would otherwise fail on the first accented word read back)."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:      # replaced by a text-only stream
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    buffer.write(text.encode("utf-8"))
    buffer.flush()


def _check_input_file(path: str) -> None:
    if os.path.isdir(path):
        raise PredictError(f"input {path} is a directory, not a file")
    if not os.path.isfile(path):
        raise PredictError(f"input file not found: {path}")
