"""The suite's output: rows from measured rates, a CSV and a markdown table per sweep, the summary, plots.

A row is one system at one sweep point. Rates are units (trees or words) per second; a row shows the median
of the repeats with min and max, the minicavs/system ratio of medians (1 for minicavs itself) with every system
free to use the machine and per core (every system on one thread: the ``per_core`` result), the threads each
used, the achieved useful-matmul FLOP rate as a fraction of the machine's numpy GEMM rate, and the process's
peak RSS.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from .sweeps import LABELS, UNITS, Point, axis

COLUMNS = ["sweep", "model", "hidden", "batch", "leaves", "system", "unit", "samples", "units",
           "train_median", "train_min", "train_max", "infer_median", "infer_min", "infer_max",
           "ratio_train", "ratio_infer", "threads", "core_train_median", "core_train_min", "core_train_max",
           "core_ratio_train", "core_infer_median", "core_ratio_infer", "core_threads", "gflops_train",
           "gemm_fraction", "core_gemm_fraction", "blas", "peak_rss_mb", "same_loss",
           "scheduling_frac", "memory_frac", "update_frac", "compute_frac", "construction_frac", "batches",
           "timed_batches", "note"]
MINICAVS = "minicavs"
FORCED = "minicavs (machine's BLAS variables)"   # bench --forced-kernel: the machine's OPENBLAS_* etc. as set


def spread(values) -> tuple[float, float, float]:
    """(median, min, max) of a list of rates; NaNs when there are none."""
    if not values:
        return math.nan, math.nan, math.nan
    v = np.asarray(values, float)
    return float(np.median(v)), float(v.min()), float(v.max())


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def blas_cell(r: dict) -> str:
    """The BLAS a system's record names (``machine``, :mod:`minicavs.bench.machine_facts`): library, version,
    kernel, threads; "" when the record has none."""
    libs = (r.get("machine") or {}).get("blas") or []
    return "; ".join(f"{b['library']} {b['version']} {b['kernel']} x{b['threads']}" for b in libs)


def rows_for(sweep: str, point: Point, systems: dict, machine: float, *, core_gemm: float = math.nan) -> list[dict]:
    """One row per measured system at ``point``. ``systems``: name -> result dict (``rates``, optional
    ``infer_rates``, ``flops_per_unit`` for minicavs, ``peak_rss_mb``, ``same_loss``, ``breakdown`` for
    minicavs, ``construction_s``/``compute_s`` for DyNet, ``per_core``: the same on one thread, ``error``
    when the system failed). ``machine`` and ``core_gemm``: numpy's GEMM FLOP/s on every core and on one."""
    ours = systems.get(MINICAVS, {})
    ot, oi = spread(ours.get("rates")), spread(ours.get("infer_rates"))
    oc = spread(ours.get("per_core", {}).get("rates"))
    oci = spread(ours.get("per_core", {}).get("infer_rates"))
    fpu = ours.get("flops_per_unit", math.nan)
    rows = []
    for name, r in systems.items():
        tr, inf = spread(r.get("rates")), spread(r.get("infer_rates"))
        gflops = tr[0] * 3 * fpu / 1e9       # forward + backward: 3x the forward's matmul FLOPs
        row = {"sweep": sweep, "model": point.model, "hidden": point.hidden, "batch": point.batch,
               "leaves": point.leaves or "", "system": name, "unit": UNITS[point.model],
               "samples": r.get("samples", ""), "units": r.get("units", ""),
               "train_median": tr[0], "train_min": tr[1], "train_max": tr[2],
               "infer_median": inf[0], "infer_min": inf[1], "infer_max": inf[2],
               "ratio_train": _ratio(ot[0], tr[0]), "ratio_infer": _ratio(oi[0], inf[0]),
               "threads": r.get("threads", ""),
               "gflops_train": gflops, "gemm_fraction": gflops * 1e9 / machine if machine else math.nan,
               "peak_rss_mb": r.get("peak_rss_mb", math.nan), "same_loss": r.get("same_loss", ""),
               "batches": r.get("batches", ""), "timed_batches": _fewest(r.get("timed_batches")),
               "note": r.get("error", "")}
        core = r.get("per_core") or {}   # the same system on one thread (per core)
        ct, ci = spread(core.get("rates")), spread(core.get("infer_rates"))
        row.update(core_train_median=ct[0], core_train_min=ct[1], core_train_max=ct[2],
                   core_ratio_train=_ratio(oc[0], ct[0]), core_infer_median=ci[0],
                   core_ratio_infer=_ratio(oci[0], ci[0]), core_threads=core.get("threads", ""),
                   core_gemm_fraction=_ratio(ct[0] * 3 * fpu, core_gemm), blas=blas_cell(r))
        if core.get("error") and not row["note"]:
            row["note"] = f"per core: {core['error']}"
        b = r.get("breakdown")
        if b:
            for part in ("scheduling", "memory", "update", "compute"):
                row[f"{part}_frac"] = b[f"{part}_s"] / b["step_s"] if b["step_s"] else math.nan
        if "construction_s" in r and "compute_s" in r:
            c, k = np.median(r["construction_s"]), np.median(r["compute_s"])
            row["construction_frac"] = float(c / (c + k)) if c + k else math.nan
        rows.append(row)
    return rows


def _fewest(counts) -> int | str:
    """The fewest batches a capped timed epoch ran over the rounds ("" when the peer does not say)."""
    if counts in (None, "", []):
        return ""
    return min(counts) if isinstance(counts, list) else counts


def _cell(v) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _cell(r.get(c, "")) for c in COLUMNS})


def fmt_rate(med: float, lo: float, hi: float) -> str:
    """``median (min-max)`` with as many digits as the size needs."""
    if math.isnan(med):
        return "-"
    d = 0 if med >= 100 else 1 if med >= 10 else 2
    return f"{med:.{d}f} ({lo:.{d}f}-{hi:.{d}f})"


def _pct(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) or x == "" else f"{100 * x:.0f}%"


def _x(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}x"


def threads_cell(r: dict) -> str:
    """The threads a system computed with: ``machine / per core`` (as each reported them)."""
    return f"{r.get('threads', '') or '?'} / {r.get('core_threads', '') or '?'}"


def point_label(r: dict) -> str:
    leaves = f", {r['leaves']} leaves" if r.get("leaves") else ""
    return f"h{r['hidden']} b{r['batch']}{leaves}"


def markdown(rows: list[dict]) -> str:
    """A markdown table: one line per system and point, with the minicavs/system ratios."""
    head = ["point", "system", "train /s median (min-max)", "minicavs/system", "infer /s median (min-max)",
            "minicavs/system (infer)", "threads", "train /s per core", "minicavs/system per core",
            "% of numpy GEMM", "peak RSS MB", "same loss", "breakdown"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        parts = []
        if r.get("compute_frac") not in (None, ""):
            parts.append(f"sched {_pct(r['scheduling_frac'])}, memory {_pct(r['memory_frac'])}, "
                         f"update {_pct(r['update_frac'])}, compute {_pct(r['compute_frac'])}")
        if r.get("construction_frac") not in (None, ""):
            parts.append(f"construction {_pct(r['construction_frac'])}")
        if r.get("timed_batches") != "" and r.get("batches") and r["timed_batches"] < r["batches"]:
            parts.append(f"timed on {r['timed_batches']} of {r['batches']} batches (timed cap)")
        if r.get("note"):
            parts.append(str(r["note"]))
        same = {True: "yes", False: "NO"}.get(r.get("same_loss"), "")
        rss = r.get("peak_rss_mb")
        lines.append("| " + " | ".join([
            point_label(r), r["system"], fmt_rate(r["train_median"], r["train_min"], r["train_max"]),
            "" if r["system"] == MINICAVS else _x(r["ratio_train"]),
            fmt_rate(r["infer_median"], r["infer_min"], r["infer_max"]),
            "" if r["system"] == MINICAVS else _x(r["ratio_infer"]), threads_cell(r),
            fmt_rate(r["core_train_median"], r["core_train_min"], r["core_train_max"]),
            "" if r["system"] == MINICAVS else _x(r["core_ratio_train"]), _pct(r["gemm_fraction"]),
            "" if rss is None or (isinstance(rss, float) and math.isnan(rss)) else f"{rss:.0f}", same,
            "; ".join(parts)]) + " |")
    return "\n".join(lines) + "\n"


def sweep_title(sweep: str) -> str:
    model, kind = sweep.split("/")
    what = {"batch": "hidden 512, batch sweep", "hidden": "batch 64, hidden sweep",
            "leaves": "batch 64, hidden 512, leaves sweep (Fig. 9a)",
            "latency": "batch 1 (one tree at a time: forward-only latency)"}[kind]
    return f"{LABELS[model]} ({UNITS[model]}/s), {what}"


def write_sweep(out: Path, sweep: str, rows: list[dict], header: str = "") -> tuple[Path, Path]:
    """``<model>_<kind>.csv`` and ``.md`` in ``out``."""
    stem = sweep.replace("/", "_")
    write_csv(out / f"{stem}.csv", rows)
    (out / f"{stem}.md").write_text(f"## {sweep_title(sweep)}\n\n{header}{markdown(rows)}")
    return out / f"{stem}.csv", out / f"{stem}.md"


def plottable(sweep: str, rows: list[dict]) -> bool:
    """Whether a sweep's rows span at least two values of its axis: a plot of one point shows nothing its
    table does not (``--quick`` measures every sweep at one point)."""
    return len({r[axis(sweep)] for r in rows}) >= 2


def plot_sweeps(out: Path, sweeps: dict, rows_by_sweep: dict) -> list[Path] | str:
    """Fig. 8-like PNGs: training throughput vs batch and vs hidden (and leaves) per model, one line per
    system, log-scaled; a sweep measured at a single point gets none (:func:`plottable`). Returns the files
    written, or why none were (matplotlib missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'minicavs[plot]'): no plots"
    written = []
    for sweep, rows in rows_by_sweep.items():
        if not plottable(sweep, rows):
            continue
        kind = axis(sweep)
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, (col, what) in zip(axes, (("train", "training"), ("infer", "inference"))):
            for system in dict.fromkeys(r["system"] for r in rows):
                pts = [r for r in rows if r["system"] == system and not math.isnan(r[f"{col}_median"])]
                if not pts:
                    continue
                xs = [r[kind] for r in pts]
                med = np.array([r[f"{col}_median"] for r in pts])
                err = [med - [r[f"{col}_min"] for r in pts], [r[f"{col}_max"] for r in pts] - med]
                ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=system,
                            linewidth=2.5 if system == MINICAVS else 1.2)
            _scales(ax, [r[kind] for r in rows], [v for r in rows for v in (r[f"{col}_min"], r[f"{col}_max"])])
            ax.set_xlabel(kind)
            ax.set_ylabel(f"{UNITS[sweep.split('/')[0]]}/s")
            ax.set_title(what)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(sweep_title(sweep))
        fig.tight_layout()
        path = out / f"{sweep.replace('/', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _scales(ax, xs, ys) -> None:
    """Log axes where the values span them; a narrow range of rates gets a linear axis from 0, never empty
    log decades."""
    xs = sorted({x for x in xs if x})
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ys = [y for y in ys if y and not math.isnan(y)]
    if ys and max(ys) / min(ys) > 10:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(ys, default=1) * 1.15)


def plot_ablation(out: Path, ablation: dict) -> Path | str:
    """Fig. 10-like PNG: each engine switch's speedup over all switches off, per model and hidden size.
    ``ablation``: model label -> hidden -> switch label -> speedup."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'minicavs[plot]'): no ablation plot"
    fig, axes = plt.subplots(1, len(ablation), figsize=(5.5 * len(ablation), 3.8), squeeze=False)
    for ax, (model, by_hidden) in zip(axes[0], ablation.items()):
        hiddens = sorted(by_hidden)
        switches = list(next(iter(by_hidden.values())))
        width = 0.8 / len(switches)
        for i, s in enumerate(switches):
            ax.bar(np.arange(len(hiddens)) + i * width, [by_hidden[h][s] for h in hiddens], width, label=s)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(np.arange(len(hiddens)) + 0.4 - width / 2)
        ax.set_xticklabels([f"h{h}" for h in hiddens])
        ax.set_ylabel("speedup over all off")
        ax.set_title(model)
    handles, labels = axes[0][0].get_legend_handles_labels()   # below the panels, clear of the bars
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08 + 0.04 * ((len(labels) - 1) // 6), 1, 1))
    path = out / "ablation.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
