"""The package's text (code, comments, docstrings, bundled model configs) speaks about the software, never
about the tracker's issues that led to it: "issue 17's targets" means nothing to a user."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_readme import ISSUE_REF

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("minicavs", "models", "examples") for p in (ROOT / d).rglob("*")
                 if p.is_file() and p.suffix in (".py", ".yaml", ".md", ".txt", ".c", ".h", ".cu", ".cfg", ".toml"))


def test_sources_are_found():
    assert len(SOURCES) > 100 and ROOT / "minicavs" / "bench" / "targets.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_reference(path):
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        assert not ISSUE_REF.search(line), f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
