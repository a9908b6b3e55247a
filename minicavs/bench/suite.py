"""The benchmark suite: every sweep point on minicavs (a child process per point) and on each installed peer,
then the reports. See ``minicavs.bench`` for the command line."""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from . import headline, machine_facts as machine, peers, report, sweep_time, targets
from .peers import PER_SAMPLE
from .point import core_rate, measure, run_in_child
from .sweeps import LABELS, UNITS, Point, both_sweeps, distinct_points, per_sample_points, sweeps
from .workloads import ABLATED, SWITCHES, Data, build, machine_rate


TIMED_CAP = 3.0   # a timed epoch stops after this many epoch caps (Settings.timed_cap)


@dataclass
class Settings:
    models: tuple
    quick: bool
    cap: float                 # seconds of timed training per system and point: repeats x epoch cap
    repeats: int               # rounds: each times every system once per point, the systems alternating
    data: Data
    out: Path
    dynet_python: str | None = None
    torch_python: str | None = None
    check: int = 4             # samples whose loss every peer must match before timing
    inference: bool = True
    breakdown: bool = True
    ablation: bool = True
    sweeps: bool = True
    plots: bool = True
    grid: dict | None = None   # replaces the full or quick grid (sweeps.FULL's keys)
    ablation_hidden: tuple = (64, 128, 256, 512)
    log: object = print
    gemm_n: int = 2048         # size of the numpy GEMM that measures the machine
    available: dict = field(default_factory=dict)   # framework -> python that can run its peers
    notes: list = field(default_factory=list)       # what was skipped and why (printed and in summary.md)
    engine: dict = field(default_factory=dict)      # EngineOptions fields set for minicavs (--engine KEY=VALUE)
    targets: bool = False      # only the points the speed targets need, systems alternating (--targets)
    command: str = ""          # the command line, quoted in the reports
    machine: dict = field(default_factory=dict)     # what the run ran on (machine_facts.facts): BLAS, CPU, variables
    gemm: dict = field(default_factory=dict)        # numpy GEMM FLOP/s, start and end: "machine" and "core"
    points: tuple = ()         # point keys to run (``--points``; default every point of the sweeps)
    work: Path | None = None   # where the peers' handovers are written (a temporary directory of the run)
    handovers: dict = field(default_factory=dict)   # point key -> (peers.prepare's spec, check loss, samples)
    forced: dict = field(default_factory=dict)      # --forced-kernel: the machine's BLAS variables ({}: off)

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.log(text)

    @property
    def epoch_cap(self) -> float:
        return self.cap / self.repeats

    @property
    def timed_cap(self) -> float:
        """Seconds after which any system's timed epoch stops (at the end of a batch): minicavs' epoch is
        sized to ``epoch_cap``, so only a system several times slower than minicavs (a per-sample peer)
        reaches it and is timed on the first batches of the same samples."""
        return TIMED_CAP * self.epoch_cap

    @property
    def timeout(self) -> float:
        """Seconds after which one system's run at one point is stopped and reported as failed (a batch
        can take longer than the cap, and a loaded machine can be very slow)."""
        return 120 + 20 * self.cap   # both thread settings


def _load() -> str:
    return f"{machine.load_average()} (1/5/15 min)"


def find_peers(s: Settings) -> dict:
    """framework -> python for the peers that can run; says why the others are skipped."""
    ok = {}
    if not hasattr(peers, "run"):
        s.note("skipping the peers: minicavs/bench/peers.py has no run() (the peer protocol) yet")
        return ok
    for fw, python in (("dynet", s.dynet_python), ("pytorch", s.torch_python)):
        why = peers.missing(python, fw)
        if why:
            s.note(f"skipping the {fw} peers: {why}")
        else:
            ok[fw] = python
    return ok


def _ours(s: Settings, point: Point, repeats: int | None = None, samples: int | None = None,
          breakdown: bool | None = None, env: dict | None = None) -> dict:
    """minicavs at ``point`` free to use the machine, then (``per_core``) on one BLAS thread over the same
    samples, in one child process (:func:`point.measure_both`; ``env``: its environment, default this one's);
    it chooses the samples (its epoch cap) when ``samples`` is not given. The breakdown epoch (``breakdown``,
    default the settings') runs free to use the machine only: the reports show that one. ``wall_s``: the
    seconds the child took."""
    spec = {"point": point.as_dict(), "data": asdict(s.data), "repeats": repeats or s.repeats,
            "epoch_cap": s.epoch_cap, "inference": s.inference, "options": dict(s.engine),
            "breakdown": bool(s.breakdown if breakdown is None else breakdown)}
    if samples:
        spec["samples"] = samples
    start = time.perf_counter()
    try:
        got = run_in_child(spec, timeout=s.timeout, env=env)
    except Exception as e:   # a failed point is reported in its row, the suite goes on
        got = {"error": f"failed: {str(e).strip().splitlines()[-1][:200]}"}
    got["wall_s"] = time.perf_counter() - start
    return got


def _handover(s: Settings, point: Point, samples: int | None) -> tuple[dict, float, int]:
    """(what every peer of ``point`` is handed, minicavs' loss of the check samples, the samples to time):
    the point's trainer built, checked and written out once for every peer and round (:func:`peers.prepare`)."""
    key = point.key()
    if key not in s.handovers:
        t = build(point, s.data)
        n = len(t.task.data["train"])
        limit = min(n, samples or n)   # every system times the samples minicavs was timed on
        directory = s.work / key
        directory.mkdir(parents=True, exist_ok=True)
        s.handovers[key] = (peers.prepare(t, limit, str(directory)), peers.check_loss(t, s.check), limit)
    return s.handovers[key]


def forced_points(pts: list[Point]) -> list[Point]:
    """The points of ``pts`` that ``--forced-kernel`` also times with the machine's BLAS variables: the
    Tree-LSTM targets' (batch 64 at hidden 64, 128, 512; batch 1 at hidden 128), the README's headline."""
    headline = {t.point for t in targets.TARGETS if t.model == "tree_lstm" and t.point is not None}
    return [p for p in pts if p in headline]


def _minicavs_runs(s: Settings, point: Point, r: int, samples: dict) -> dict:
    """minicavs at ``point`` in round ``r`` as a user's machine runs it and, at :func:`forced_points` with
    ``--forced-kernel``, in another fresh process with the machine's BLAS variables (:data:`report.FORCED`):
    the two in turn, the second first every other round once the samples are known (the first run of a
    point chooses them). {system: result}, minicavs first."""
    key = point.key()
    names = [report.MINICAVS] + ([report.FORCED] if s.forced and forced_points([point]) else [])
    if r % 2 and samples.get(key):
        names.reverse()
    out = {}
    for name in names:
        forced = name == report.FORCED
        out[name] = _ours(s, point, repeats=1, samples=samples.get(key),
                          breakdown=s.breakdown and r == 0 and not forced,
                          env={**os.environ, **s.forced} if forced else None)
        samples.setdefault(key, out[name].get("samples"))
    return {n: out[n] for n in sorted(out, key=lambda n: n != report.MINICAVS)}


def _peers_at(s: Settings, point: Point, ours: dict, labels=None, epochs: int | None = None) -> dict:
    """Every available peer at ``point`` (those of ``labels`` if given; the per-sample ones only at
    :func:`sweeps.per_sample_points`): its JSON plus ``same_loss`` against minicavs' loss of the same
    samples with the same weights, and ``wall_s``, the seconds its process took."""
    out = {}
    per_sample_here = point in per_sample_points(sweeps(s.models, s.quick, s.grid))
    todo = [p for p in peers.PEERS.get(point.model, ()) if p.framework in s.available
            and (labels is None or p.label in labels) and (per_sample_here or p.mode not in PER_SAMPLE)]
    if not todo:
        return out
    prepared, ours_check, samples = _handover(s, point, ours.get("samples"))
    for p in todo:
        start = time.perf_counter()
        try:   # free to use the machine, then on one thread (per core), in one process
            got = peers.run(s.available[p.framework], p.framework, None, mode=p.mode,
                            epochs=epochs or s.repeats, check=s.check, max_seconds=s.epoch_cap,
                            inference=s.inference, samples=samples, timeout=s.timeout,
                            timed_seconds=s.timed_cap, prepared=prepared, per_core=True)
            got["same_loss"] = bool(peers.same_loss(ours_check, got["check_loss"]))
            got["ours_check_loss"] = ours_check
        except Exception as e:
            got = {"error": f"failed: {str(e).strip().splitlines()[-1][:200]}"}
        got["wall_s"] = time.perf_counter() - start
        if p.framework == "dynet":   # DyNet computes on one thread either way: the same run
            got["per_core"] = dict(got)
        out[p.label] = got
    return out


def _line(point: Point, name: str, r: dict, ours: dict) -> str:
    if "error" in r:
        return f"  {point.key():<28} {name:<36} {r['error']}"
    med, lo, hi = report.spread(r.get("rates"))
    text = f"  {point.key():<28} {name:<36} train {report.fmt_rate(med, lo, hi):>26} {UNITS[point.model]}/s"
    if r.get("infer_rates"):
        text += f"   infer {report.fmt_rate(*report.spread(r['infer_rates'])):>26}"
    if name != report.MINICAVS and ours.get("rates"):
        text += f"   minicavs/this {report.spread(ours['rates'])[0] / med:5.2f}x"
    core = r.get("per_core") or {}
    if core.get("rates"):   # the same samples on one thread
        cmed = report.spread(core["rates"])[0]
        text += f"   per core {report.fmt_rate(*report.spread(core['rates']))}"
        ours_core = (ours.get("per_core") or {}).get("rates")
        if name != report.MINICAVS and ours_core:
            text += f" ({report.spread(ours_core)[0] / cmed:5.2f}x)"
    elif core.get("error"):
        text += f"   per core: {core['error']}"
    if "same_loss" in r:
        text += (f"   same loss: {'yes' if r['same_loss'] else 'NO'} "
                 f"({r['ours_check_loss']:.6f} vs {r['check_loss']:.6f})")
    return text


def _as_list(v) -> list:
    return list(v) if isinstance(v, list) else [v]


def _merge(into: dict, new: dict) -> None:
    """Add one round's result of a system to the rounds before: rates extended, the rest from the first
    round that worked; an error stays only while no round has worked."""
    if "error" in new:
        if not into:
            into.update(new)
        return
    if not into or "error" in into:
        into.clear()
        into.update(new)
        return
    for key in ("rates", "infer_rates", "construction_s", "compute_s", "infer_construction_s", "infer_compute_s",
                "wall_s", "timed_batches", "infer_timed_batches"):   # one entry (or list) per round
        if key in new:
            into[key] = _as_list(into.get(key, [])) + _as_list(new[key])
    if "same_loss" in new:
        into["same_loss"] = bool(into.get("same_loss", True)) and bool(new["same_loss"])
    if "peak_rss_mb" in new:
        into["peak_rss_mb"] = max(into.get("peak_rss_mb", 0.0), new["peak_rss_mb"])
    if "per_core" in new:
        _merge(into.setdefault("per_core", {}), new["per_core"])


def sweep_points(s: Settings) -> list[Point]:
    """Every point of the sweeps, the summary's first (a cut-short run still has them)."""
    sw = sweeps(s.models, s.quick, s.grid)
    main = list(main_point(sw).values())
    return main + [p for p in distinct_points(sw) if p not in main]


def run_rounds(s: Settings, pts: list[Point], labels=None) -> dict:
    """minicavs and the peers (those of ``labels``, default all) at every point of ``pts``, in ``repeats``
    rounds of one timed epoch per system: the points in reverse order every other round, the peers before
    minicavs at a point every other round (and minicavs' two runs of ``--forced-kernel`` swapped), so that a
    change of the machine's load falls on every system alike. Rates are the medians over the rounds; every round times the samples minicavs' first round
    chose. Returns {point key: {system: result}} (also written to results.json after every round)."""
    results: dict = {p.key(): {} for p in pts}
    samples: dict = {}
    for r in range(s.repeats):
        s.log(f"round {r + 1}/{s.repeats} ({len(pts)} points; load average {_load()})")
        round_start = time.perf_counter()
        for point in (pts if r % 2 == 0 else pts[::-1]):
            key, start = point.key(), time.perf_counter()
            peers_first = bool(r % 2 and samples.get(key))
            systems = _peers_at(s, point, {"samples": samples[key]}, labels, epochs=1) if peers_first else {}
            mine = _minicavs_runs(s, point, r, samples)
            ours = mine[report.MINICAVS]
            systems = {**mine, **systems}
            if not peers_first:
                systems.update(_peers_at(s, point, ours, labels, epochs=1))
            for name, res in systems.items():
                _merge(results[key].setdefault(name, {}), res)
                s.log(_line(point, name, res, ours))
            s.log(f"  ({time.perf_counter() - start:.0f} s)")
            _write_results(s, results)
        took = time.perf_counter() - round_start
        s.log(f"round {r + 1} took {took / 60:.1f} min; the rounds left about {(s.repeats - r - 1) * took / 60:.1f} "
              f"min (as long as this one)")
    return results


def _write_results(s: Settings, results: dict) -> None:
    """results.json: what the run ran on (:mod:`.machine_facts`: BLAS, CPU, variables) and every point's systems."""
    (s.out / "results.json").write_text(json.dumps({"machine": s.machine, "gemm": s.gemm, "forced": s.forced,
                                                    "points": results}, indent=1, default=str))


def ablation(s: Settings) -> dict:
    """Fig. 10: each switch's training-throughput speedup over all switches off, on Tree-LSTM and
    Fixed-LSTM at batch 64, on the same samples for every switch setting (the all-off run's prefix)."""
    out: dict = {}
    for model in ("tree_lstm", "fixed_lstm"):
        if model not in s.models:
            continue
        for h in s.ablation_hidden:
            point = Point(model, h, (s.grid or {}).get("batch_at", 64))
            spec = {"point": point.as_dict(), "data": asdict(s.data), "repeats": s.repeats,
                    "epoch_cap": s.epoch_cap / 4, "inference": False, "breakdown": False}
            rates = {}
            t = build(point, s.data)    # one trainer: the switches change how, not what, it computes
            for label, opts in SWITCHES.items():   # --engine settings other than the switches varied here
                r = measure({**spec, "options": {**{k: v for k, v in s.engine.items() if k not in ABLATED},
                                                 **asdict(opts)}}, t)
                spec.setdefault("samples", r["samples"])
                rates[label] = float(np.median(r["rates"]))
            base = rates.pop("all off")
            out.setdefault(LABELS[model], {})[h] = {k: v / base for k, v in rates.items()}
            s.log(f"  {LABELS[model]:<10} hidden {h:>4}: " + "  ".join(
                f"{k} {v / base:4.2f}x" for k, v in rates.items()) + f"   (all off {base:.1f} {UNITS[model]}/s)")
    return out


def ablation_markdown(ab: dict) -> str:
    if not ab:
        return ""
    switches = list(next(iter(next(iter(ab.values())).values())))
    lines = ["| model | hidden | " + " | ".join(switches) + " |", "|" + " --- |" * (len(switches) + 2)]
    for model, by_h in ab.items():
        for h, sp in by_h.items():
            lines.append(f"| {model} | {h} | " + " | ".join(f"{sp[k]:.2f}x" for k in switches) + " |")
    return "\n".join(lines) + "\n"


def write_reports(s: Settings, results: dict, gemm: tuple, ab: dict, seconds: float) -> Path:
    """Per sweep a CSV and a markdown table, the plots and summary.md; returns the summary's path."""
    sw = sweeps(s.models, s.quick, s.grid) if results else {}
    rate = float(np.median(gemm))
    core = float(np.median(s.gemm["core"])) if s.gemm.get("core") else math.nan
    rows_by_sweep = {}
    all_rows = []
    for name, points in sw.items():
        rows = [row for p in points if p.key() in results
                for row in report.rows_for(name, p, results[p.key()], rate, core_gemm=core)]
        rows_by_sweep[name] = rows
        all_rows += rows
        report.write_sweep(s.out, name, rows, _conditions(s, gemm))
    report.write_csv(s.out / "all.csv", all_rows)
    plots = report.plot_sweeps(s.out, sw, rows_by_sweep) if s.plots else []
    flat = [name for name, rows in rows_by_sweep.items() if not report.plottable(name, rows)]
    if s.plots and flat and not isinstance(plots, str):
        s.note(f"no plot of {len(flat)} sweep(s) measured at a single point ({', '.join(flat)}): see their tables")
    if ab:
        (s.out / "ablation.md").write_text("## Speedup of each engine switch over all off (Fig. 10)\n\n"
                                           + ablation_markdown(ab))
        ab_plot = report.plot_ablation(s.out, ab) if s.plots else None
        if isinstance(ab_plot, str):
            s.note(ab_plot)
    if isinstance(plots, str):
        s.note(plots)
    table = targets_markdown(s, results, rate)
    if table:
        (s.out / "targets.md").write_text(f"## {TARGETS_TITLE}\n\n" + _conditions(s, gemm) + table)
    head = headline.markdown({"points": results, "forced": s.forced})
    if head:
        (s.out / "headline.md").write_text(f"## {HEADLINE_TITLE}\n\n" + _conditions(s, gemm) + head)
    summary = s.out / "summary.md"
    summary.write_text(summary_markdown(s, sw, results, rate, gemm, ab, seconds))
    return summary


TARGETS_TITLE = "Speed targets"
HEADLINE_TITLE = "The README's Tree-LSTM figures"


def targets_markdown(s: Settings, results: dict, rate: float) -> str:
    """The targets table over the measured points: "" when nothing was measured, and for ``--quick``
    (without ``--targets``), whose few short points judge no target: its rows would all be noise or
    "not measured". Judged per core (the one-thread GEMM rate for the GEMM shares), machine ratios beside."""
    if not results or (s.quick and not s.targets):
        return ""
    core = float(np.median(s.gemm["core"])) if s.gemm.get("core") else math.nan
    return targets.markdown(targets.evaluate(results, rate, s.models, s.quick, s.grid, core=core), s.command)


def _conditions(s: Settings, gemm: tuple) -> str:
    """The paragraph above every table: how it was measured and what on (BLAS, CPU, variables)."""
    core = s.gemm.get("core") or []
    core_text = f" ({', '.join(f'{c / 1e9:.0f}' for c in core)} on one thread)" if core else ""
    return (f"numpy float32 {s.gemm_n}^3 GEMM {gemm[0] / 1e9:.0f} GFLOP/s at the start, {gemm[1] / 1e9:.0f} at "
            f"the end{core_text}; medians of {s.repeats} rounds (min-max in brackets), each running every system "
            f"once for one timed epoch, systems alternating (the points in reverse order and the peers first "
            f"every other round), each process after one whole untimed warm-up epoch over the timed samples (a "
            f"peer's warm-up stops after the epoch cap, a timed epoch after {TIMED_CAP:g}x it: 'timed on k of n "
            f"batches'); every system of a point is timed on the same samples: "
            f"the longest prefix of whole batches that minicavs' warm-up says fits {s.epoch_cap:.3g} s (cap: "
            f"{s.cap:g} s of timed training per system and point, at least one batch); DyNet with 2048 MB of "
            f"memory pools from the start; float32, Adam, embedding rows updated lazily (only those a batch "
            f"looks up) by every system. Per core (the ratios that count): minicavs on one BLAS thread, "
            f"PyTorch on one intra-op thread, DyNet on its one; machine: minicavs' BLAS and PyTorch on every "
            f"core; both in one process per system, point and round, machine first.\n\n"
            + (machine.describe(s.machine) + "\n\n" if s.machine else ""))


def main_point(sw: dict) -> dict:
    """Per model the point shown in the summary: the one in both Fig. 8 sweeps (hidden 512, batch 64)."""
    return both_sweeps(sw)


def summary_markdown(s: Settings, sw: dict, results: dict, rate: float, gemm: tuple, ab: dict,
                     seconds: float) -> str:
    title = "minicavs bench" + (" --quick" if s.quick else "") + (" --targets" if s.targets else "")
    lines = [f"# {title}", "", f"{len(results) if s.targets else len(distinct_points(sw))} points, "
             f"{seconds / 60:.1f} min wall time. " + _conditions(s, gemm)]
    if s.command:
        lines += [f"Command: `{s.command}`\n"]
    lines += [f"- {n}" for n in s.notes] + ([""] if s.notes else [])
    main = main_point(sw)
    if main:
        p = next(iter(main.values()))
        lines += [f"## Hidden {p.hidden}, batch {p.batch} (every model)", ""]
    rows = [row for m, p in main.items() if p.key() in results
            for row in report.rows_for(f"{m}/hidden", p, results[p.key()], rate)]
    lines.append(main_table(rows))
    if sw and not s.targets:
        lines += ["Sweeps: " + ", ".join(f"[{n}]({n.replace('/', '_')}.md)" for n in sw) + " (CSV alongside; "
                  "all.csv has every row).", ""]
    table = targets_markdown(s, results, rate)
    if table:
        lines += [f"## {TARGETS_TITLE}" + (" (over the points measured)" if not s.targets else ""), "", table]
    head = headline.markdown({"points": results, "forced": s.forced})
    if head:
        lines += [f"## {HEADLINE_TITLE}", "", head]
    if ab:
        lines += ["## Speedup of each engine switch over all off (Fig. 10)", "", ablation_markdown(ab)]
    return "\n".join(lines) + "\n"


def main_table(rows: list[dict]) -> str:
    """The summary's main table: model, system, training and inference rates, ratios, GEMM share, RSS."""
    head = ["model", "system", "train /s", "minicavs/system", "infer /s", "minicavs/system (infer)", "threads",
            "train /s per core", "minicavs/system per core", "% GEMM", "peak RSS MB", "same loss", "time split"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        split = ""
        if r.get("compute_frac") not in (None, ""):
            split = (f"sched {report._pct(r['scheduling_frac'])}, memory {report._pct(r['memory_frac'])}, "
                     f"compute {report._pct(r['compute_frac'])}, update {report._pct(r['update_frac'])}")
        elif r.get("construction_frac") not in (None, ""):
            split = f"graph construction {report._pct(r['construction_frac'])}"
        if r.get("note"):
            split = r["note"]
        same = {True: "yes", False: "NO"}.get(r.get("same_loss"), "")
        rss = r.get("peak_rss_mb")
        leaves = f", {r['leaves']} leaves" if r.get("leaves") else ""
        lines.append("| " + " | ".join([
            f"{LABELS[r['model']]}{leaves}", r["system"], report.fmt_rate(r["train_median"], r["train_min"],
                                                                        r["train_max"]),
            "" if r["system"] == report.MINICAVS else report._x(r["ratio_train"]),
            report.fmt_rate(r["infer_median"], r["infer_min"], r["infer_max"]),
            "" if r["system"] == report.MINICAVS else report._x(r["ratio_infer"]), report.threads_cell(r),
            report.fmt_rate(r["core_train_median"], r["core_train_min"], r["core_train_max"]),
            "" if r["system"] == report.MINICAVS else report._x(r["core_ratio_train"]),
            report._pct(r["gemm_fraction"]),
            "" if rss is None or (isinstance(rss, float) and math.isnan(rss)) else f"{rss:.0f}", same, split])
            + " |")
    return "\n".join(lines) + "\n"


def _gemm_rates(s: Settings) -> tuple[float, float]:
    """numpy's float32 GEMM FLOP/s free to use the machine (this process) and on one thread (a child)."""
    return machine_rate(n=s.gemm_n), core_rate(s.gemm_n)


def _ran_on(s: Settings) -> None:
    """Record and log what the run runs on; the forced-kernel warning on stderr (one line)."""
    s.machine = machine.facts()
    s.log(machine.describe(s.machine))
    warning = machine.forced_kernel_warning(s.machine)
    if warning:
        print(warning, file=sys.stderr)
        s.notes.append(warning)


def run_points(s: Settings) -> list[Point]:
    """The points this run measures: the targets' (``--targets``) or every sweep point, those of ``--points``
    only when given (unknown keys are refused, naming the known ones)."""
    pts = targets.points(s.models, s.quick, s.grid) if s.targets else sweep_points(s)
    if not s.points:
        return pts
    known = {p.key(): p for p in pts}
    unknown = [k for k in s.points if k not in known]
    if unknown:
        raise ValueError(f"--points: unknown {unknown}; this run's points: {', '.join(known)}")
    return [known[k] for k in s.points]


def first_trees(data: Data, work: Path) -> Data:
    """``data`` with its SST file cut to the trees the points read (the first ``data.trees`` non-blank lines,
    the same trees and so the same vocabulary), written once into the run's directory ``work``: each process
    then parses 1,024 trees instead of the file's 8,544 (a second or more of every Tree-LSTM start-up)."""
    if not data.sst:
        return data
    path = work / "sst-first-trees.txt"
    kept = 0
    with open(data.sst, "rb") as src, open(path, "wb") as dst:
        for line in src:
            if kept == data.trees:
                break
            if line.strip():
                dst.write(line if line.endswith(b"\n") else line + b"\n")
                kept += 1
    return replace(data, sst=str(path))


def _estimate(s: Settings, pts: list[Point]) -> dict:
    """:func:`sweep_time.estimate` of this run (its points, the peers found, its caps and parts)."""
    cells = 0 if (s.targets or not s.ablation) else len(s.ablation_hidden) * len(
        {"tree_lstm", "fixed_lstm"} & set(s.models))
    at = per_sample_points(sweeps(s.models, s.quick, s.grid))
    return sweep_time.estimate(pts if s.sweeps else [], s.available, at, repeats=s.repeats, epoch_cap=s.epoch_cap,
                               timed_cap=s.timed_cap, inference=s.inference, ablation_cells=cells,
                               labels=targets.BATCHED if s.targets else None, load=_stretch(),
                               forced_at=forced_points(pts) if s.forced else ())


def _stretch() -> float:
    try:
        return sweep_time.stretch(os.getloadavg()[0], os.cpu_count() or 1)
    except OSError:
        return 1.0


def plan_text(s: Settings) -> str:
    """``--plan``: every point's processes and modelled seconds, and the run's estimate; runs nothing."""
    s.available = find_peers(s)
    pts = run_points(s)
    at = per_sample_points(sweeps(s.models, s.quick, s.grid))
    body = sweep_time.listing(pts, s.available, at, s.epoch_cap, s.timed_cap, s.inference,
                              targets.BATCHED if s.targets else None, _stretch(),
                              forced_points(pts) if s.forced else ()) if s.sweeps else "  (no sweeps)"
    return f"{body}\n{sweep_time.headline(_estimate(s, pts), s.repeats)}"


def run_suite(s: Settings) -> Path:
    start = time.perf_counter()
    s.out.mkdir(parents=True, exist_ok=True)
    _ran_on(s)
    s.available = find_peers(s)
    pts = run_points(s)
    s.note(sweep_time.headline(_estimate(s, pts), s.repeats))
    m0, c0 = _gemm_rates(s)
    s.log(f"machine: numpy float32 {s.gemm_n}^3 GEMM {m0 / 1e9:.1f} GFLOP/s ({c0 / 1e9:.1f} on one thread); "
          f"cap {s.cap:g} s of timed training per system and point ({s.repeats} rounds of one epoch of at most "
          f"{s.epoch_cap:.3g} s; a slower system's timed epoch stops after {s.timed_cap:.3g} s), "
          f"python {sys.version.split()[0]}")
    s.note(f"load average {_load()} at the start, on {os.cpu_count()} cores (above 0.1: other work shared "
           f"the machine and the numbers are noisy)")
    if s.engine:
        s.note("minicavs' engine: " + ", ".join(f"{k}={v}" for k, v in s.engine.items()))
    s.gemm = {"machine": [m0], "core": [c0]}
    results = {}
    if s.sweeps:
        data = s.data
        with tempfile.TemporaryDirectory(prefix="minicavs-bench-") as work:
            s.work, s.handovers = Path(work), {}
            s.data = first_trees(data, s.work)
            try:
                results = run_rounds(s, pts, targets.BATCHED if s.targets else None)
            finally:
                s.data = data
    ab = {}
    if s.ablation and not s.targets:
        s.log("speedup over all switches off (Fig. 10), training, batch 64")
        ab = ablation(s)
    m1, c1 = _gemm_rates(s)
    s.gemm = {"machine": [m0, m1], "core": [c0, c1]}
    _write_results(s, results)
    s.note(f"load average {_load()} at the end (before this run's own last GEMM measurement)")
    summary = write_reports(s, results, (m0, m1), ab, time.perf_counter() - start)
    table = targets_markdown(s, results, float(np.median((m0, m1))))
    if s.targets:
        s.log("\n" + table)
    wrote = "".join(f", {f}" for f in ("targets.md", "headline.md") if (s.out / f).is_file())
    s.log(f"\nwrote {s.out}/ (summary.md{wrote}, a CSV and a markdown table per sweep) in "
          f"{(time.perf_counter() - start) / 60:.1f} min")
    return summary
