"""The CPU speed targets: which points each needs, and met or missed from measured results.

A target is a bound on one measure over one or more sweep points; over several points the worst point
decides (and is named). Every target is judged per core (every system on one thread: minicavs' BLAS,
PyTorch's intra-op threads and DyNet each on one; GEMM shares of numpy's one-thread GEMM rate), so that a
machine's cores and load do not move the ratio; the same point's ratio with every system free to use the
machine is printed beside. Measures, from :func:`report.rows_for`'s rows:

- ``train``: minicavs' training throughput / the named peer's (medians of the repeats);
- ``infer``: the same for forward-only passes (a latency target: at most half the peer's latency is at
  least 2x its rate at batch 1);
- ``gemm``: minicavs' useful matmul FLOP rate as a share of the machine's numpy GEMM rate;
- ``fastest``: minicavs' training throughput / the fastest batched peer's at that point (DyNet autobatching,
  PyTorch batched by level, ``nn.LSTM`` packed; not the per-sample peers).

``minicavs bench --targets`` measures only the points these need (``points``), alternating the systems
round by round; the full sweep's summary carries the same table over every point it measured.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .report import MINICAVS, rows_for
from .sweeps import LABELS, Point, distinct_points, sweeps

DYNET = "DyNet (autobatching)"
TORCH_LEVEL = "PyTorch (batched by level)"
TORCH_PACKED = "PyTorch (nn.LSTM, packed)"
BATCHED = (DYNET, TORCH_LEVEL, TORCH_PACKED)   # the batched peers (peers.PEERS' labels)


@dataclass(frozen=True)
class Target:
    text: str                # what the target is: model, point, measure and bound
    model: str
    measure: str             # "train", "infer", "gemm" or "fastest" (module doc)
    at_least: float
    peer: str | None = None  # the peer a train/infer ratio is taken against
    point: Point | None = None   # one point, or
    sweeps: tuple = ()       # every point of these sweeps (``sweeps.sweeps`` names; "*": all of them)


TARGETS = (
    Target("Tree-LSTM, batch 64, hidden 64: >= 5x DyNet", "tree_lstm", "train", 5.0, DYNET, Point("tree_lstm", 64, 64)),
    Target("Tree-LSTM, batch 64, hidden 128: >= 4x DyNet", "tree_lstm", "train", 4.0, DYNET,
           Point("tree_lstm", 128, 64)),
    Target("Tree-LSTM, batch 64, hidden 512: >= 2.3x DyNet", "tree_lstm", "train", 2.3, DYNET,
           Point("tree_lstm", 512, 64)),
    Target("Tree-LSTM, batch 64, hidden 512: >= 75% of the matmul rate", "tree_lstm", "gemm", 0.75, None,
           Point("tree_lstm", 512, 64)),
    Target("Tree-LSTM, batch 1, hidden 128, forward only: latency <= 1/2 DyNet's (rate >= 2x)", "tree_lstm",
           "infer", 2.0, DYNET, Point("tree_lstm", 128, 1)),
    Target("Tree-FC, 256 leaves, batch 64, hidden 512: >= 85% of the matmul rate", "tree_fc", "gemm", 0.85, None,
           Point("tree_fc", 512, 64, 256)),
    Target("Tree-FC: >= 1.0x PyTorch batched by level at every point of the hidden, batch and leaves sweeps",
           "tree_fc", "train", 1.0, TORCH_LEVEL, sweeps=("tree_fc/hidden", "tree_fc/batch", "tree_fc/leaves")),
    Target("Var-LSTM, hidden 512, batch 64: >= 1.7x nn.LSTM packed", "var_lstm", "train", 1.7, TORCH_PACKED,
           Point("var_lstm", 512, 64)),
    Target("Fixed-LSTM: >= 1.0x nn.LSTM packed at every point", "fixed_lstm", "train", 1.0, TORCH_PACKED,
           sweeps=("fixed_lstm/hidden", "fixed_lstm/batch")),
    Target("No sweep point below 1.0x the fastest batched peer", "*", "fastest", 1.0, sweeps=("*",)),
)


def target_points(target: Target, models, quick: bool = False, grid: dict | None = None) -> list[Point]:
    """The points ``target`` is judged on, among ``models``."""
    if target.point is not None:
        return [target.point] if target.point.model in models else []
    sw = sweeps(models, quick, grid)
    names = list(sw) if "*" in target.sweeps else [n for n in target.sweeps if n in sw]
    return distinct_points({n: sw[n] for n in names})


def points(models, quick: bool = False, grid: dict | None = None, targets=TARGETS) -> list[Point]:
    """Every point the targets need, once, single-point targets first. The "fastest batched peer" target
    adds no points: it is judged on the points measured for the others (the full sweep: ``minicavs
    bench``)."""
    out: dict = {}
    for t in sorted(targets, key=lambda t: t.point is None):
        if "*" not in t.sweeps:
            out.update(dict.fromkeys(target_points(t, models, quick, grid)))
    return list(out)


# the per-core column of each measure (the targets are judged on it) and the machine column printed beside
COLUMNS = {"train": ("core_ratio_train", "ratio_train"), "infer": ("core_ratio_infer", "ratio_infer"),
           "gemm": ("core_gemm_fraction", "gemm_fraction")}


def _value(row_ours: dict, rows: list[dict], target: Target) -> tuple[float, float, str]:
    """(value per core, value free to use the machine, what it was measured against) at one point; (NaN,
    NaN, why) when it was not measured: the peer did not run, failed, or ran less than a batch (its note)."""
    if target.measure == "gemm":
        core, whole = COLUMNS["gemm"]
        return row_ours.get(core, math.nan), row_ours.get(whole, math.nan), ""
    if target.measure == "fastest":
        peers = [r for r in rows if r["system"] in BATCHED and not math.isnan(r["core_train_median"])
                 and not r["note"]]
        if not peers:
            return math.nan, math.nan, "no batched peer measured a whole batch on one thread"
        best = max(peers, key=lambda r: r["core_train_median"])
        return best["core_ratio_train"], best["ratio_train"], best["system"]
    peer = next((r for r in rows if r["system"] == target.peer), None)
    if peer is None or peer["note"]:
        return math.nan, math.nan, f"{target.peer}: {peer['note'] if peer else 'not run'}"
    core, whole = COLUMNS[target.measure]
    return peer[core], peer[whole], target.peer


def evaluate(results: dict, machine: float, models, quick: bool = False, grid: dict | None = None,
             targets=TARGETS, *, core: float = math.nan) -> list[dict]:
    """One row per target: the worst point's value per core (every system on one thread; GEMM shares of the
    one-thread GEMM rate ``core``) among the measured ones, met or missed (or not measured), and the same
    point's value free to use the machine (``machine``: the GEMM FLOP/s on every core) beside it.
    ``results``: {point key: {system: result}} (the suite's)."""
    rows = []
    for target in targets:
        if target.model != "*" and target.model not in models:
            continue
        pts = target_points(target, models, quick, grid)
        if target.sweeps == ("*",):   # judged on every measured point (the sweeps', the targets')
            pts = [p for p in dict.fromkeys(pts + points(models, quick, grid, targets)) if p.key() in results]
        measured, why = [], ""
        for p in pts:
            if p.key() not in results:
                continue
            point_rows = rows_for("", p, results[p.key()], machine, core_gemm=core)
            ours = next((r for r in point_rows if r["system"] == MINICAVS), None)
            if ours is None or math.isnan(ours["core_train_median"]):
                why = why or f"minicavs: {ours['note'] if ours and ours['note'] else 'not run on one thread'}"
                continue
            value, whole, against = _value(ours, point_rows, target)
            if math.isnan(value):
                why = why or against
            else:
                measured.append((value, whole, p, against))
        rows.append(_judged(target, len(pts), measured, why))
    return rows


def _judged(target: Target, points_wanted: int, measured: list, why: str) -> dict:
    """A target's row from its measured points (value per core, machine value, point, against)."""
    row = {"target": target.text, "measure": target.measure, "at_least": target.at_least,
           "points": points_wanted, "measured": len(measured), "value": math.nan, "machine": math.nan,
           "worst": "", "against": "", "status": "not measured" + (f" ({why})" if why else "")}
    if measured:
        value, whole, p, against = min(measured, key=lambda m: m[0])
        row.update(value=value, machine=whole, worst=_label(p), against=against,
                   status="met" if value >= target.at_least else "missed")
    return row


def _label(p: Point) -> str:
    leaves = f" l{p.leaves}" if p.leaves else ""
    return f"{LABELS[p.model]} h{p.hidden} b{p.batch}{leaves}"


def _fmt(row: dict, key: str = "value") -> str:
    if math.isnan(row[key]):
        return "-"
    return f"{100 * row[key]:.0f}%" if row["measure"] == "gemm" else f"{row[key]:.2f}x"


def markdown(rows: list[dict], command: str = "") -> str:
    """The targets table: target, bound, measured per core (the worst point, and against which peer), the
    same point free to use the machine, status."""
    lines = ["| target | bound | measured per core | machine | at (worst point) | points measured | status |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        bound = f">= {100 * r['at_least']:.0f}%" if r["measure"] == "gemm" else f">= {r['at_least']:.2f}x"
        at = r["worst"] + (f" vs {r['against']}" if r["against"] and r["measure"] == "fastest" else "")
        status = {"met": "met", "missed": "**missed**"}.get(r["status"], r["status"])
        lines.append(f"| {r['target']} | {bound} | {_fmt(r)} | {_fmt(r, 'machine')} | {at} | "
                     f"{r['measured']}/{r['points']} | {status} |")
    text = "\n".join(lines) + "\n"
    return text + (f"\nMeasured by `{command}`.\n" if command else "")


# --- the control-flow rows of ``minicavs bench --control`` (minicavs/bench/control_flow.py) ----------------

@dataclass(frozen=True)
class RowTarget:
    """A bound on one named control-flow row's ratio per core (CPU time, one BLAS thread): a time row's
    ratio is the system's time per unit over its baseline's (``at_most``), a rate row's the system's rate
    over the base commit's (at least)."""

    text: str
    row: str
    bound: float
    at_most: bool = True


ROW_TARGETS = (
    RowTarget("foreach Var-LSTM, equal-length sentences: time per step <= 1.1x the chain graph's", "foreach_equal",
              1.1),
    RowTarget("foreach Var-LSTM, PTB, bucketed: time per real word <= 1.3x the chain graph's", "foreach_bucketed",
              1.3),
    RowTarget("LSTM chain with a cond in F: time per step <= 1.1x the same F without it", "cond_in_f", 1.1),
    RowTarget("foreach in F: time per step <= 1.1x the same F unrolled", "foreach_in_f", 1.1),
    RowTarget("seq2seq training: sequences/s >= 3x the base commit's (--base: a065f3c)", "seq2seq", 3.0, at_most=False),
)


def judge_rows(ratios: dict, targets=ROW_TARGETS) -> list[dict]:
    """One row per target whose row was asked for (a key of ``ratios``: row name -> the ratio per core, NaN
    when not measured): the ratio, met, missed or not measured."""
    out = []
    for t in targets:
        if t.row not in ratios:
            continue
        value = ratios[t.row]
        met = value <= t.bound if t.at_most else value >= t.bound
        out.append({"target": t.text, "row": t.row, "bound": t.bound, "at_most": t.at_most, "value": value,
                    "status": "not measured" if math.isnan(value) else "met" if met else "missed"})
    return out


def rows_markdown(judged: list[dict]) -> str:
    """The control-flow targets table: target, bound, measured per core, status."""
    lines = ["| target | bound | measured per core (CPU time) | status |", "| --- | --- | --- | --- |"]
    for r in judged:
        value = "-" if math.isnan(r["value"]) else f"{r['value']:.2f}x"
        status = {"met": "met", "missed": "**missed**"}.get(r["status"], r["status"])
        lines.append(f"| {r['target']} | {'<=' if r['at_most'] else '>='} {r['bound']:.2f}x | {value} | {status} |")
    return "\n".join(lines) + "\n"
