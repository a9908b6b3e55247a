"""Advice templates: Python arguments in ``str(error)``, flags for the command line, other text kept."""
from __future__ import annotations

import pickle

import pytest

from minicavs.core import wording
from minicavs.core.errors import RunDirError


@pytest.mark.parametrize("template, python, cli", [
    ("continue it with {resume}", "continue it with resume=True", "continue it with --resume"),
    ("{force} or {run_dir}", "force=True or another run_dir", "--force or another --run-dir"),
    ("{set[train.epochs=12]}", "overrides=['train.epochs=12']", "--set train.epochs=12"),
    ("{alt[minicavs train R --resume|Trainer.resuming('R')]}", "Trainer.resuming('R')", "minicavs train R --resume"),
    ("run dir /tmp/{x}/{resume}[1] {unknown} {set}", "run dir /tmp/{x}/resume=True[1] {unknown} {set}",
     "run dir /tmp/{x}/--resume[1] {unknown} {set}"),     # a path's braces and unknown fields are kept
])
def test_each_interface_gets_its_words(template, python, cli):
    assert wording.PYTHON.say(template) == python
    assert wording.CLI.say(template) == cli
    e = wording.error(RunDirError, template)
    assert isinstance(e, RunDirError) and str(e) == python and wording.cli_text(e) == cli
    again = pickle.loads(pickle.dumps(e))     # as MPI rank 0 broadcasts it
    assert str(again) == python and wording.cli_text(again) == cli


def test_an_error_without_cli_words_prints_as_it_is():
    assert wording.cli_text(ValueError("plain")) == "plain"
