"""``minicavs predict``: a trained model applied to new input, one output line per input line.

    minicavs predict runs/tree_lstm trees.txt                  # the run dir's config and best checkpoint
    minicavs predict models/tree_lstm.yaml --checkpoint runs/tree_lstm/best.npz - < trees.txt

What a line holds and what the model writes for it is the model's business (``Task.parse_input``,
``Task.predict``, ``Task.predicts`` says it in words): a bundled Tree-LSTM reads a bracketed tree and writes
it back with a predicted label at every node; a language model reads a sentence and writes its perplexity,
log-likelihood and likeliest next words. Every line is parsed before anything runs, so a bad line is an error
naming its line number and nothing is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Iterable

from .atomic import write_text
from .errors import MinicavsError


class PredictError(MinicavsError):
    """What the user asked for cannot be predicted (no checkpoint, a model without text input)."""


def read_lines(source: IO[str], name: str) -> list[str]:
    """Every line of ``source`` without its newline; undecodable text is an error naming the line."""
    lines = []
    lineno = 0
    try:
        for lineno, line in enumerate(source, 1):
            lines.append(line.rstrip("\r\n"))
    except UnicodeDecodeError as e:
        raise PredictError(f"{name}:{lineno + 1}: not UTF-8 ({e.reason})") from None
    return lines


def predict_lines(task, lines: Iterable[str], name: str = "<input>", batch_size: int = 64) -> list[dict]:
    """Parse every line (errors name ``name:line``), then predict in batches: one dict per line."""
    if not task.predicts:
        raise PredictError(f"model {type(task).__name__} does not predict from text input "
                           "(its inputs are not text: see its module docstring)")
    samples = [task.parse_input(line, f"{name}:{i}") for i, line in enumerate(lines, 1)]
    return task.predict(samples, batch_size) if samples else []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="RUN_DIR|CONFIG",
                   help="a run dir written by minicavs train (its config.yaml and best.npz), or a YAML config "
                        "with --checkpoint")
    p.add_argument("input", metavar="FILE|-", help="input lines, '-' for standard input")
    p.add_argument("--checkpoint", default=None, help="the weights (default: RUN_DIR/best.npz)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.eval_batch_size=8 (repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per line, with the numbers behind it")
    p.add_argument("--output", "-o", default=None, help="write here instead of standard output")
    p.epilog = ("What each bundled model predicts: tree_lstm: the input tree with a sentiment label (0-4) at every "
                "node; var_lstm, fixed_lstm: per sentence its perplexity, log-likelihood and the 3 likeliest next "
                "words; tree_fc: nothing (random vector inputs).")


def run(args: argparse.Namespace) -> int:
    from .training import Trainer
    trainer, _ = Trainer.for_target(args.target, args.checkpoint, args.overrides)
    if args.input == "-":
        lines = read_lines(sys.stdin, "<stdin>")
    else:
        if not os.path.isfile(args.input):
            raise PredictError(f"input file not found: {args.input}")
        with open(args.input, encoding="utf-8") as f:
            lines = read_lines(f, args.input)
    rows = predict_lines(trainer.task, lines, "<stdin>" if args.input == "-" else args.input,
                         trainer.cfg["train"]["eval_batch_size"])
    if trainer.device.name != "cpu":   # (on stderr: standard output holds the predictions only)
        print(f"predicted on device {trainer.device.description}", file=sys.stderr)
    text = "".join((json.dumps(r) if args.json else r["text"]) + "\n" for r in rows)
    if args.output:
        write_text(args.output, text)
    else:
        sys.stdout.write(text)
    return 0
