"""Advice in the words of the interface in use: the Python API's arguments, or the command line's flags.

An error raised from the library says what to do in Python terms (``resume=True``); the ``minicavs`` command
prints the same advice with its flags (``--resume``). A message is written once, as a template whose fields
name the advice (``{resume}``, ``{force}``, ``{run_dir}``, ``{checkpoint}``, ``{set[train.epochs=12]}``,
``{alt[command line text|Python text]}``; other text is kept as it is, so paths need no escaping);
:func:`error` builds an exception whose ``str()`` is the Python wording and which carries the command line's
wording beside it (:func:`cli_text` reads it back)."""
from __future__ import annotations

import re
from typing import Callable, TypeVar

E = TypeVar("E", bound=BaseException)
_FIELD = re.compile(r"\{(\w+)(?:\[([^\]]*)\])?\}")


class _Overrides:
    """``{set[KEY=VALUE]}`` in a template: one config override in the interface's words."""

    def __init__(self, form: Callable[[str], str]):
        self.form = form

    def __getitem__(self, item: str) -> str:
        return self.form(item)


class Words:
    """One interface's vocabulary for advice (see the module docstring)."""

    def __init__(self, name: str, **fields):
        self.name = name
        self.fields = fields

    def say(self, template: str) -> str:
        """``template`` with each known field replaced; any other text, braces in paths included, is kept."""
        def field(m: re.Match) -> str:
            value = self.fields.get(m.group(1))
            if value is None or (m.group(2) is None) != isinstance(value, str):
                return m.group(0)
            return value if m.group(2) is None else value[m.group(2)]
        return _FIELD.sub(field, template)


PYTHON = Words("python", resume="resume=True", resuming="resuming (Trainer.resuming)", force="force=True",
               run_dir="another run_dir", new_run_dir="run_dir=...", checkpoint="checkpoint=",
               set=_Overrides(lambda item: f"overrides=[{item!r}]"), alt=_Overrides(lambda item: item.split("|")[-1]))
CLI = Words("cli", resume="--resume", resuming="--resume", force="--force", run_dir="another --run-dir",
            new_run_dir="--run-dir", checkpoint="--checkpoint", set=_Overrides(lambda item: f"--set {item}"),
            alt=_Overrides(lambda item: item.split("|")[0]))


def error(kind: type[E], template: str) -> E:
    """``kind`` with the Python wording of ``template`` as its message, the command line's as ``cli_message``
    (kept when the error is pickled, e.g. broadcast from MPI rank 0)."""
    e = kind(PYTHON.say(template))
    e.cli_message = CLI.say(template)
    return e


def cli_text(e: BaseException) -> str:
    """What the command line prints for ``e``: its flags wording where it has one."""
    return getattr(e, "cli_message", None) or str(e)


__all__ = ["Words", "PYTHON", "CLI", "error", "cli_text"]
