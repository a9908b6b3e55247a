"""docs/ runs as written: docs/writing-a-model.md's model module and config, saved as the page says, train,
predict and evaluate through the command line and from Python; and no page refers to an issue number."""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARK = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->\s*\n```\w*\n(.*?)\n```", re.S)


def marked(page: Path) -> list[tuple[str, str]]:
    """(mark, code) of every fenced block right after a ``<!-- docs-test: ... -->`` line, in order."""
    return MARK.findall(page.read_text(encoding="utf-8"))


def test_writing_a_model_runs_as_written(tmp_path, monkeypatch):
    blocks = marked(DOCS / "writing-a-model.md")
    assert [m for m, _ in blocks] == ["file my_tree_rnn.py", "file my_tree_rnn.yaml", "commands", "python"]
    for mark, code in blocks:
        if mark.startswith("file "):
            (tmp_path / mark.split()[1]).write_text(code + "\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    outs = []
    for line in dict(blocks)["commands"].splitlines():
        line = line.replace("minicavs ", f"{sys.executable} -m minicavs ")
        done = subprocess.run(["bash", "-c", "set -o pipefail; " + line], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        outs.append(done.stdout)
    train, predict, evaluate = outs
    best = [float(x) for x in re.findall(r"dev acc ([\d.]+)%", train)]
    assert len(best) == 8 and max(best) >= 80            # it learned the rule (a guess is 50-60%)
    assert re.fullmatch(r"positive 0\.\d{3}\n", predict)   # "very good movie" has more good than bad words
    assert re.search(r"dev_acc\s+[\d.]+%", evaluate)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(dict(blocks)["python"], "docs/writing-a-model.md", "exec"), {"__name__": "__docs__"})
    lines = printed.getvalue().splitlines()
    assert "'test_acc'" in lines[-3]
    assert lines[-2].startswith("positive ") and lines[-1].startswith("negative ")   # good film / bad bad plot


def test_no_page_refers_to_an_issue_number():
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        assert not re.search(r"\bissues?\s*#?\d", text, re.I), page.name
