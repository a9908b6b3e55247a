"""The README runs as written: every fenced block, in order, in a copy of the checkout.

- ```python blocks run in one namespace (a block may use what an earlier one defined), from the copy's root.
- Other blocks are shell commands, one a line, each in bash from the copy's root, where ``minicavs`` and
  ``python`` are this interpreter on this checkout; a command must exit 0. ``pip install ... &&`` in front of
  a command is dropped: the package and its test extra are installed already (CI installs them before the
  suite; here the checkout is on PYTHONPATH).
- Reduced: every ``minicavs train`` gets ``--set train.epochs=1``, and every command that builds a model from a
  config (``train``, ``eval``, ``predict``, ``show`` of a ``.yaml``) a smaller synthetic data set (REDUCED),
  the same for all so that vocabularies agree.
- An HTML comment on the line before a block marks it: ``<!-- readme-test: skip (why) -->`` (not run),
  ``<!-- readme-test: needs matplotlib -->`` (without matplotlib its commands must fail with one line saying
  so and status 2), ``<!-- readme-test: needs ../shared/data -->`` (run by its own test, skipped where the
  workspace's data is not beside the checkout). An unmarked block that is neither Python nor commands of
  ``minicavs``, ``python``, ``pip install``, ``echo`` fails the test.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->")
PROGRAMS = ("minicavs", "python", "pip", "echo")
REDUCED = ("data.synthetic.train=300", "data.synthetic.dev=60", "data.synthetic.test=60")
SHARED = Path(os.environ.get("MINICAVS_SHARED_DATA", ROOT.parent / "shared" / "data"))


@dataclass
class Block:
    line: int          # README line of the opening fence
    lang: str
    code: str
    mark: str          # the readme-test comment before it, or ""

    @property
    def where(self) -> str:
        return f"README.md:{self.line}"


def blocks(text: str) -> list[Block]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.search(before)
        out.append(Block(i + 1, fence.group(1), "\n".join(lines[i + 1:j]), mark.group(1) if mark else ""))
        i = j + 1
    return out


def commands(block: Block) -> list[str]:
    """The block's command lines, reduced; an unknown program fails the test."""
    out = []
    for raw in block.code.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"\s+#\s.*$", "", line)                   # a trailing comment
        line = re.sub(r"^pip install [^&]*&&\s*", "", line)      # installed already
        program = line.split()[0]
        if program not in PROGRAMS:
            pytest.fail(f"{block.where}: cannot run {line!r}: mark the block <!-- readme-test: skip (why) -->")
        if program == "pip":
            continue
        # appended at the end: the minicavs command is the last of a line (``echo ... | minicavs predict ...``)
        if re.search(r"\bminicavs train\b", line):
            line += " --set train.epochs=1"
        if re.search(r"\bminicavs (train|eval|predict|show) \S+\.yaml\b", line):
            line += "".join(f" --set {r}" for r in REDUCED)
        out.append(line)
    return out


def checkout_copy(tmp_path: Path) -> Path:
    """The files a clone would have (tracked and new, not ignored), copied: the README's paths are relative to
    the repository root and its commands write run dirs and prepared data there."""
    dest = tmp_path / "repo"
    if (ROOT / ".git").exists() and shutil.which("git"):
        files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split("\0")
    else:   # a source tree without git: everything but caches and outputs
        skip = {".git", "runs", "graphs", "__pycache__", ".pytest_cache", ".hypothesis", "bench-results"}
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not skip & set(p.relative_to(ROOT).parts)]
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def run_commands(block: Block, repo: Path, expect_fail: str | None = None) -> None:
    prelude = f'set -o pipefail; minicavs() {{ "{sys.executable}" -m minicavs "$@"; }}; ' \
              f'python() {{ "{sys.executable}" "$@"; }}; '
    env = {**os.environ, "PYTHONPATH": str(repo)}
    for line in commands(block):
        start = time.perf_counter()
        done = subprocess.run(["bash", "-c", prelude + line], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=600)
        if expect_fail:
            assert done.returncode == 2 and done.stderr.strip().splitlines()[-1:] and \
                expect_fail in done.stderr, f"{block.where}: {line}\n{done.stdout}\n{done.stderr}"
        else:
            assert done.returncode == 0, f"{block.where}: `{line}` exited {done.returncode}\n" \
                                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        print(f"{time.perf_counter() - start:6.1f} s  {line}")


def run_python(block: Block, namespace: dict, repo: Path, monkeypatch) -> None:
    monkeypatch.chdir(repo)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            exec(compile(block.code, block.where, "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{block.where}: the Python block raised {type(e).__name__}: {e}") from e
    print(f"{time.perf_counter() - start:6.1f} s  Python block at {block.where}")


def test_blocks_are_found_and_marked():
    found = blocks(README.read_text(encoding="utf-8"))
    assert sum(b.lang == "python" for b in found) >= 3
    assert any("minicavs predict" in b.code for b in found) and any("minicavs plot" in b.code for b in found)
    for b in found:
        assert b.lang in ("", "python", "sh", "bash", "console") or b.mark.startswith("skip"), b.where
        assert not b.mark or re.match(r"skip \(.+\)|needs (matplotlib|\.\./shared/data)$", b.mark), b.where


def test_readme_runs(tmp_path, monkeypatch):
    repo = checkout_copy(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    try:
        import matplotlib  # noqa: F401
        have_plot = True
    except ImportError:
        have_plot = False
    for block in blocks((repo / "README.md").read_text(encoding="utf-8")):
        if block.mark.startswith("skip") or block.mark == "needs ../shared/data":
            continue
        if block.lang == "python":
            run_python(block, namespace, repo, monkeypatch)
        elif block.mark == "needs matplotlib" and not have_plot:
            run_commands(block, repo, expect_fail="matplotlib is not installed")
        else:
            run_commands(block, repo)
    assert (repo / "runs" / "tree_lstm" / "metrics.jsonl").is_file()


def test_readme_data_commands(tmp_path):
    if not (SHARED / "sst").is_dir():
        pytest.skip("the workspace's ../shared/data is not beside this checkout")
    repo = checkout_copy(tmp_path)
    (tmp_path / "shared").symlink_to(SHARED.parent, target_is_directory=True)   # ../shared from the copy
    data_blocks = [b for b in blocks(README.read_text(encoding="utf-8")) if b.mark == "needs ../shared/data"]
    assert data_blocks
    for block in data_blocks:
        run_commands(block, repo)
    assert (repo / "data" / "sst" / "train.txt").is_file() and (repo / "data" / "ptb" / "ptb.test.txt").is_file()


# --- a user's guide: short, and about the software, not about how it was built -----------------------------

ISSUE_REF = re.compile(r"\bissues?\s*(no\.?\s*|#\s*)?\d+|\bthe issue'?s?\b(?! (of|with))", re.I)


def test_readme_is_a_guide_of_at_most_450_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 450


@pytest.mark.parametrize("text, refers", [("issue 17's targets", True), ("Issue #20", True), ("issues 3 and 4", True),
                                          ("the issue's 1.1x", True), ("(issue 17)", True),
                                          ("kernels issued so far", False), ("tissue 3", False),
                                          ("the issue of memory", False)])
def test_issue_reference_pattern(text, refers):
    assert bool(ISSUE_REF.search(text)) == refers


def test_readme_refers_to_no_issue():
    for n, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        assert not ISSUE_REF.search(line), f"README.md:{n}: {line}"
