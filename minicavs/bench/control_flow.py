"""``minicavs bench --control``: control flow's speed rows, each a system against its baseline on the same work.

Rows (:data:`ROWS`; workloads in :mod:`.control_models`):

- ``foreach_equal``: the Var-LSTM as a ``foreach`` static graph against the chain graph on sentences of one
  length (no padding), time per training step;
- ``foreach_bucketed``: the same on PTB sentences, the foreach's batches bucketed by length (``train.order:
  bucket``), the chain graph's shuffled, time per real word;
- ``foreach_padded``: the same, both shuffled: the foreach's batches padded to their longest sentence (a loop
  with a trip count per row runs each step over the rows still running: its time per real word should approach
  the bucketed one's);
- ``cond_in_f``: an LSTM chain whose F holds a ``cond`` against the same F without it, time per step;
- ``foreach_in_f`` / ``while_in_f``: a ``foreach`` (``while_loop``) in F against the same F unrolled;
- ``seq2seq``: seq2seq training, sequences per second, this tree against a base commit (``--base``, default
  a065f3c) checked out into a temporary ``git worktree`` (without a git checkout the row has this tree alone).

Rows run only when named (``--control-rows``), each this tree against the base commit (a change's regression
check; the default set is :data:`DEFAULT_ROWS`):

- ``batch1_infer``: the SST Tree-LSTM (hidden 128) inferring one tree at a time, time per tree;
- ``batch1_train`` / ``batch64_train``: its training at batch 1 / 64, trees per second;
- ``seq2seq_predict``: seq2seq's greedy decoding (``minicavs predict``'s pass), sequences per second.

Protocol: every system of every row timed in a fresh process per round (:mod:`.control_child`: one untimed
pass, then timed passes, wall and CPU time per unit, the median of the passes), ``repeats`` rounds, each timing
every row's systems per core (one BLAS thread) and free to use the machine; every other round the rows in reverse
order and each row's systems swapped, so that a change of load falls on both alike; medians over the rounds.
Targets (:data:`.targets.ROW_TARGETS`) are judged on the per-core CPU-time ratio. Then each row's workloads
once on the emulated CUDA device (the generated kernels run on the CPU) and, where one is lent, on a GPU: loss
and gradients equal to the C runner's (float32: ``max|a - b| <= 1e-5 * max(1, max|ref|)`` per array); not a
speed.

A system named ``base`` runs from the base commit's checkout (its records name the commit, and each run's the
minicavs it imported); a base commit's numbers are its own, so its values are not checked on the devices.

Writes ``results.json`` (every run, the order, what it ran on), ``control.md`` and ``summary.md``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import machine_facts as machine, padding, targets
from .point import ONE_THREAD

BASE = "a065f3c"   # the seq2seq row's base: the commit before control flow ran in the instruction program
BASE_SYSTEM = "base"   # the system that runs from the base commit's checkout
MODES = ("per core", "machine")
CHILD = Path(__file__).with_name("control_child.py")
LSTM = {"hidden": padding.HIDDEN, "embed": padding.EMBED, "batch": padding.BATCH}   # bench --padding's sizes


@dataclass(frozen=True)
class Row:
    text: str
    workload: str          # control_models.WORKLOADS' key (the child's "seq2seq" for the base commit)
    systems: tuple         # (the system measured, its baseline)
    spec: dict             # the workload's sizes and ``passes``
    unit: str              # what one unit's time (or the rate) is reported in
    rate: bool = False     # True: units per second, the ratio system / baseline of rates
    devices: bool = True   # its values checked on the emulated CUDA device (and a GPU) against the C runner's


ROWS = {
    "foreach_equal": Row("foreach Var-LSTM vs the chain graph, equal-length sentences", "var_lstm",
                         ("foreach", "chain graph"),
                         {**LSTM, "sentences": 128, "equal": True, "per": "step", "passes": 3}, "ms per step"),
    "foreach_bucketed": Row("foreach Var-LSTM (bucketed) vs the chain graph (shuffled), PTB", "var_lstm",
                            ("foreach, bucketed", "chain graph"),
                            {**LSTM, "sentences": 1000, "per": "word", "passes": 1}, "us per real word"),
    "foreach_padded": Row("foreach Var-LSTM (shuffled: padded) vs the chain graph (shuffled), PTB", "var_lstm",
                          ("foreach", "chain graph"),
                          {**LSTM, "sentences": 1000, "per": "word", "passes": 1}, "us per real word"),
    "cond_in_f": Row("LSTM chain, a cond in F vs the same F without it", "cond", ("cond", "plain"),
                     {"hidden": 128, "batch": 32, "passes": 15}, "ms per step"),
    "foreach_in_f": Row("foreach in F vs the same F unrolled (RNN, 8 steps a vertex)", "loop", ("loop", "unrolled"),
                        {"loop": "foreach", "hidden": 128, "steps": 8, "batch": 16, "passes": 15}, "ms per step"),
    "while_in_f": Row("while_loop in F vs the same F unrolled (RNN, 8 steps a vertex)", "loop", ("loop", "unrolled"),
                      {"loop": "while", "hidden": 128, "steps": 8, "batch": 16, "passes": 15}, "ms per step"),
    "seq2seq": Row("seq2seq training, this tree vs the base commit", "seq2seq", ("now", BASE_SYSTEM),
                   {"sequences": 2048, "passes": 3}, "sequences/s", rate=True),
}
DEFAULT_ROWS = tuple(ROWS)
TREE = {"hidden": 128, "data_trees": 1024}   # the sweep's Tree-LSTM (tree_lstm-h128-b1) on SST
ROWS.update({
    "batch1_infer": Row("Tree-LSTM batch-1 inference, this tree vs the base commit", "batch1_infer",
                        ("now", BASE_SYSTEM), {**TREE, "trees": 256, "passes": 3}, "us per tree", devices=False),
    "batch1_train": Row("Tree-LSTM training at batch 1, this tree vs the base commit", "tree_train",
                        ("now", BASE_SYSTEM), {**TREE, "trees": 256, "batch": 1, "passes": 2}, "trees/s",
                        rate=True, devices=False),
    "batch64_train": Row("Tree-LSTM training at batch 64, this tree vs the base commit", "tree_train",
                         ("now", BASE_SYSTEM), {**TREE, "trees": 1024, "batch": 64, "passes": 3}, "trees/s",
                         rate=True, devices=False),
    "seq2seq_predict": Row("seq2seq greedy decoding (predict, batch 64), this tree vs the base commit",
                           "seq2seq_predict", ("now", BASE_SYSTEM), {"sequences": 2048, "passes": 3},
                           "sequences/s", rate=True, devices=False),
})
TREE_WORKLOADS = ("batch1_infer", "tree_train")   # the rows' workloads that read SST (``sst``)
# --quick: smaller workloads, a couple of minutes in all
QUICK = {"foreach_equal": {"passes": 2}, "foreach_bucketed": {"sentences": 256},
         "foreach_padded": {"sentences": 256}, "cond_in_f": {"passes": 5},
         "foreach_in_f": {"passes": 5}, "while_in_f": {"passes": 5}, "seq2seq": {"sequences": 512, "passes": 2},
         "batch1_infer": {"trees": 64, "passes": 2}, "batch1_train": {"trees": 64},
         "batch64_train": {"trees": 256, "passes": 2}, "seq2seq_predict": {"sequences": 512, "passes": 2}}
SCALE = {"ms per step": 1e3, "us per real word": 1e6, "us per tree": 1e6}


@dataclass
class ControlRun:
    out: Path
    rows: tuple = DEFAULT_ROWS
    repeats: int = 3
    ptb: str | None = None        # the Var-LSTM rows' text (None: minicavs' synthetic corpus)
    base: str | None = BASE       # the base commit of the rows with a "base" system (None: this tree alone)
    sizes: dict = field(default_factory=dict)   # row -> spec entries replacing ROWS' (tests, --quick)
    command: str = ""
    log: Callable = print
    notes: list = field(default_factory=list)
    sst: str | None = None        # the Tree-LSTM rows' SST file (None: minicavs' synthetic treebank)

    def spec(self, name: str, system: str) -> dict:
        row = ROWS[name]
        return {**row.spec, **self.sizes.get(name, {}), "workload": row.workload, "system": system,
                "ptb": self.ptb, "sst": self.sst}

    def with_base(self) -> bool:
        """Whether a row of this run times the base commit."""
        return any(BASE_SYSTEM in ROWS[n].systems for n in self.rows)


def package_root() -> Path:
    """The folder holding the ``minicavs`` package this process runs (what PYTHONPATH names for a child)."""
    return Path(__file__).resolve().parents[2]


def run_child(spec: dict, tree: Path, one_thread: bool, timeout: float = 900) -> dict:
    """:mod:`.control_child` on ``spec`` in a fresh process importing the minicavs of ``tree``; its JSON."""
    env = {**os.environ, "PYTHONPATH": str(tree), **(ONE_THREAD if one_thread else {})}
    try:
        out = subprocess.run([sys.executable, str(CHILD)], input=json.dumps(spec), text=True, capture_output=True,
                             timeout=timeout, env=env, cwd=str(tree))
    except subprocess.TimeoutExpired:
        return {"error": f"ran longer than {timeout:.0f} s"}
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextmanager
def base_tree(commit: str | None, notes: list):
    """A temporary ``git worktree`` of ``commit`` of the repository this package runs from (None, with a
    note, where there is no commit, no git or no such commit); removed afterwards."""
    repo = package_root()
    if commit is None:
        yield None
        return
    where = Path(tempfile.mkdtemp(prefix="minicavs-base-")) / "tree"
    made = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(where), commit],
                          capture_output=True, text=True) if shutil.which("git") else None
    if made is None or made.returncode:
        why = "git is not installed" if made is None else made.stderr.strip().splitlines()[-1]
        notes.append(f"base commit {commit} not measured: {why}")
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(where)], capture_output=True)


def _tree(system: str, base: Path | None) -> Path | None:
    """The tree a system runs from: the base checkout for :data:`BASE_SYSTEM`, else this package's."""
    return base if system == BASE_SYSTEM else package_root()


def commit_of(tree: Path | None) -> str | None:
    """The commit checked out at ``tree`` (its full hash; None without a tree)."""
    if tree is None:
        return None
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def _order(rows: tuple, r: int) -> list[tuple[str, str]]:
    """Round ``r``'s (row, system) runs: every other round the rows reversed and each row's systems swapped."""
    names = rows if r % 2 == 0 else rows[::-1]
    return [(n, s) for n in names for s in (ROWS[n].systems if r % 2 == 0 else ROWS[n].systems[::-1])]


def time_rows(c: ControlRun, base: Path | None) -> tuple[dict, list]:
    """Every row's systems in ``repeats`` rounds, each per core then on the machine (fresh processes):
    {row: {system: {mode: [child record per round]}}} and the order the runs ran in (both also in
    results.json after every run, marked partial, so that a run cut short keeps what it measured)."""
    runs: dict = {n: {s: {m: [] for m in MODES} for s in ROWS[n].systems} for n in c.rows}
    order = []
    for r in range(c.repeats):
        c.log(f"round {r + 1}/{c.repeats} (load average {machine.load_average()})")
        for mode in MODES:
            for name, system in _order(c.rows, r):
                tree = _tree(system, base)
                got = {"error": "no base checkout"} if tree is None else \
                    run_child(c.spec(name, system), tree, mode == "per core")
                runs[name][system][mode].append(got)
                order.append([r, mode, name, system])
                (c.out / "results.json").write_text(json.dumps({"partial": True, "order": order, "runs": runs}))
                c.log(f"  {mode:<8} {name:<17} {system:<18} " + _brief(ROWS[name], got))
    return runs, order


def _brief(row: Row, got: dict) -> str:
    if "error" in got:
        return got["error"]
    wall, cpu = statistics.median(got["wall"]), statistics.median(got["cpu"])
    return f"{_shown(row, wall)} wall, {_shown(row, cpu)} CPU {row.unit}"


def _shown(row: Row, seconds: float) -> str:
    """Seconds per unit in the row's unit (a rate: units per second)."""
    if math.isnan(seconds):
        return "-"
    value = 1 / seconds if row.rate else seconds * SCALE[row.unit]
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _median(records: list, key: str) -> float:
    """The median over rounds of each round's median pass (NaN when no round ran)."""
    per_round = [statistics.median(g[key]) for g in records if "error" not in g]
    return statistics.median(per_round) if per_round else math.nan


def summarize(runs: dict) -> dict:
    """Per row and mode: each system's wall and CPU seconds per unit (medians) and the ratio system /
    baseline (a rate row: baseline / system, the system's speedup)."""
    out = {}
    for name, systems in runs.items():
        row, stats = ROWS[name], {}
        for mode in MODES:
            per = {s: {k: _median(systems[s][mode], k) for k in ("wall", "cpu")} for s in row.systems}
            ours, base = (per[s] for s in row.systems)
            ratio = {k: (base[k] / ours[k]) if row.rate else (ours[k] / base[k]) for k in ("wall", "cpu")}
            stats[mode] = {"systems": per, "ratio": ratio}
        out[name] = stats
    return out


# --- the devices: the same workloads, values equal to the C runner's --------------------------------------

def devices(c: ControlRun) -> dict:
    """The devices the rows' values are checked on: the emulated CUDA device (with g++) and a GPU where one is
    lent (CuPy and a device); a note for each that is not."""
    from ..engine.backend import emulated_cuda, get_device
    out = {}
    if shutil.which("g++"):
        out["emulated CUDA"] = emulated_cuda()
    else:
        c.notes.append("emulated device rows not run: the CUDA emulation needs g++")
    try:
        out["GPU"] = get_device("cuda")
    except Exception as e:   # (CudaUnavailable: no CuPy or no device)
        c.notes.append(f"no GPU rows: {str(e).splitlines()[0]}")
    return out


def device_rows(c: ControlRun) -> dict:
    """Each row's systems of this tree once on the CPU (C runner) and once on each of :func:`devices`:
    {device: {row: {system: {"arrays", "worst", "equal", "runners"}}}} (worst: max |a - b| / max(1, max|ref|)
    over the arrays; runners: the vertex functions' passes' on the CPU and on the device). Not a speed."""
    out: dict = {}
    for label, device in devices(c).items():
        for name in c.rows:
            for system in ROWS[name].systems:
                if system == BASE_SYSTEM or not ROWS[name].devices:
                    continue   # (the base commit's numbers are its own)
                step = workload(c.spec(name, system), system)
                (want, c_runners), (got, runners) = step.values(None), step.values(device)
                checked = {**same_values(want, got), "runners": [c_runners, runners]}
                out.setdefault(label, {}).setdefault(name, {})[system] = checked
                c.log(f"  {label} {name:<17} {system:<18} {checked}")
    return out


def workload(spec: dict, system: str):
    """The :class:`.control_models.Step` of one system of a row, in this process (seq2seq's trainer: the timed
    child's own, :func:`.control_child.seq2seq_trainer`)."""
    from .control_models import WORKLOADS, trainer_step
    if spec["workload"] == "seq2seq":
        from .control_child import seq2seq_trainer
        t = seq2seq_trainer(spec)
        return trainer_step(t, float(len(t.task.data["train"])))
    return WORKLOADS[spec["workload"]](spec, system)


def same_values(want: dict, got: dict, tolerance: float = 1e-5) -> dict:
    """Whether ``got`` equals ``want`` array by array (float32's rule: ``max|a - b| <= tolerance x max(1,
    max|want|)``), and the worst array's share of its bound's scale."""
    worst = 0.0
    for k, ref in want.items():
        if k not in got or np.shape(got[k]) != np.shape(ref):
            return {"arrays": len(want), "worst": math.inf, "equal": False, "missing": k}
        scale = max(1.0, float(np.max(np.abs(ref))) if np.size(ref) else 0.0)
        worst = max(worst, float(np.max(np.abs(got[k] - ref))) / scale if np.size(ref) else 0.0)
    return {"arrays": len(want), "worst": worst, "equal": bool(worst <= tolerance)}


# --- reports ------------------------------------------------------------------------------------------------

def ratios_per_core(stats: dict) -> dict:
    """Row -> its per-core CPU-time ratio (what the targets judge)."""
    return {name: s["per core"]["ratio"]["cpu"] for name, s in stats.items()}


def table(stats: dict) -> str:
    """One line per row: the two systems per core (CPU, wall) and on the machine (wall), and the ratios."""
    lines = ["| row | unit | system / baseline | per core, CPU | ratio | per core, wall | ratio | machine, wall "
             "| ratio |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in stats.items():
        row = ROWS[name]
        cells = []
        for mode, key in (("per core", "cpu"), ("per core", "wall"), ("machine", "wall")):
            ours, base = (s[mode]["systems"][x][key] for x in row.systems)
            ratio = s[mode]["ratio"][key]
            cells += [f"{_shown(row, ours)} / {_shown(row, base)}", "-" if math.isnan(ratio) else f"{ratio:.2f}x"]
        lines.append(f"| {name}: {row.text} | {row.unit} | {' / '.join(row.systems)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def device_table(checked: dict) -> str:
    """One line per device, row and system: the runners, the arrays compared, the worst, equal or not."""
    lines = ["| device | row | system | runners (CPU; device) | arrays (loss, gradients) | worst max abs(a - b) / "
             "max(1, max abs(ref)) | equal to the CPU's |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, rows in checked.items():
        for name, systems in rows.items():
            for system, e in systems.items():
                runners = "; ".join(", ".join(r) for r in e["runners"])
                lines.append(f"| {label} | {name} | {system} | {runners} | {e['arrays']} | {e['worst']:.2e} | "
                             f"{'yes' if e['equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def conditions(c: ControlRun, facts: dict, load: list, base: str | None = None) -> str:
    """How the rows were measured and on what (the paragraph above the tables)."""
    return (f"Medians of {c.repeats} rounds; each round runs every row's systems, each in a fresh process (one "
            f"untimed pass, then timed passes: the process's value is their median), per core (one BLAS thread) "
            f"and free to use the machine, every other round the rows reversed and each row's systems swapped. "
            f"Load average (1/5/15 min) {load[0]} at the start, {load[-1]} at the end, on {os.cpu_count()} "
            f"cores. " + (f"Var-LSTM text: {c.ptb or 'synthetic'}. " if _reads(c, ("var_lstm",)) else "")
            + (f"Tree-LSTM trees: {c.sst or 'synthetic'}. " if _reads(c, TREE_WORKLOADS) else "")
            + (f"Base commit: {c.base} ({base}). " if base else "") + machine.describe(facts) + "\n")


def _reads(c: ControlRun, workloads: tuple) -> bool:
    """Whether a row of the run has one of ``workloads``."""
    return any(ROWS[n].workload in workloads for n in c.rows)


def write_reports(c: ControlRun, result: dict) -> str:
    """control.md (the rows, the targets, the device rows) and summary.md; returns control.md's text."""
    judged = targets.judge_rows(ratios_per_core(result["stats"]))
    text = ("## Control flow (`minicavs bench --control`)\n\n"
            + conditions(c, result["machine"], result["load"], result["base_commit"])
            + "\n" + table(result["stats"]))
    if judged:   # (the rows against a base commit but seq2seq have no target)
        text += "\n### Targets (per core, CPU time)\n\n" + targets.rows_markdown(judged)
    if result["devices"]:
        text += "\n### On the devices (correctness, not speed)\n\n" + device_table(result["devices"])
    text += "".join(f"\n- {n}" for n in c.notes) + ("\n" if c.notes else "")
    text += f"\nMeasured by `{c.command}`.\n" if c.command else ""
    (c.out / "control.md").write_text(text)
    (c.out / "summary.md").write_text(f"# minicavs bench --control\n\n{result['seconds'] / 60:.1f} min wall "
                                      f"time.\n\n" + text)
    return text


def run_control(c: ControlRun) -> str:
    """Time the rows, check their values on the devices, write results.json and the reports; the text."""
    start = time.perf_counter()
    c.out.mkdir(parents=True, exist_ok=True)
    facts, load = machine.facts(), [machine.load_average()]
    c.log(machine.describe(facts))
    with base_tree(c.base if c.with_base() else None, c.notes) as base:
        commit = commit_of(base)
        runs, order = time_rows(c, base)
    load.append(machine.load_average())
    result = {"machine": facts, "load": load, "command": c.command, "repeats": c.repeats, "base": c.base,
              "base_commit": commit, "order": order, "runs": runs, "stats": summarize(runs),
              "devices": device_rows(c)}
    result["targets"] = targets.judge_rows(ratios_per_core(result["stats"]))
    result["seconds"] = time.perf_counter() - start
    (c.out / "results.json").write_text(json.dumps({**result, "notes": c.notes}, indent=1, default=float) + "\n")
    return write_reports(c, result)
