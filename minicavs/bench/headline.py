"""The README's Tree-LSTM headline from a sweep's ``results.json``: minicavs against DyNet autobatching, training
at batch 64 (hidden 64, 128, 512) and the batch-1 forward (hidden 128), per core and free to use the machine,
as a user's machine runs it (``minicavs bench --as-user``) and, where the run also timed it (``--forced-kernel``),
with the machine's BLAS variables: one pair of columns each, named by the kernel its records say ran.

    python -m minicavs.bench.headline RESULTS_JSON     # prints the table (a run writes it to headline.md)

Why: a development machine may force an older BLAS kernel (``OPENBLAS_CORETYPE=Haswell`` on an AVX-512 CPU);
a user's figure and the forced-kernel figure side by side say how much of a ratio is the kernel's.
"""
from __future__ import annotations

import json
import math
import sys

from .report import FORCED, MINICAVS, spread
from .sweeps import Point
from .targets import DYNET

ROWS = (("training, batch 64, hidden 64", Point("tree_lstm", 64, 64), "rates"),
        ("training, batch 64, hidden 128", Point("tree_lstm", 128, 64), "rates"),
        ("training, batch 64, hidden 512", Point("tree_lstm", 512, 64), "rates"),
        ("forward, batch 1, hidden 128", Point("tree_lstm", 128, 1), "infer_rates"))


def ratio(systems: dict, ours: str, measure: str, per_core: bool) -> float:
    """``ours``' median rate over DyNet's (``measure``: "rates" or "infer_rates"), on one thread or free to use
    the machine; NaN where either was not measured."""
    def median(name: str) -> float:
        r = systems.get(name) or {}
        return spread((r.get("per_core") or {}).get(measure) if per_core else r.get(measure))[0]
    mine, theirs = median(ours), median(DYNET)
    return mine / theirs if theirs and not math.isnan(mine) and not math.isnan(theirs) else math.nan


def kernel(results: dict, system: str) -> str:
    """The BLAS kernel ``system``'s records name (the first point that names one), e.g. "SkylakeX"."""
    for systems in results.values():
        for b in ((systems.get(system) or {}).get("machine") or {}).get("blas") or []:
            if b.get("kernel"):
                return str(b["kernel"])
    return "kernel unknown"


def markdown(recorded: dict) -> str:
    """The table (rows :data:`ROWS`, a pair of columns per minicavs system measured); "" when the run has none
    of the rows' points with DyNet. ``recorded``: results.json's content."""
    results = recorded.get("points") or {}
    measured = [row for row in ROWS if DYNET in results.get(row[1].key(), {})]
    if not measured:
        return ""
    systems = [MINICAVS] + ([FORCED] if any(FORCED in results[p.key()] for _, p, _ in measured) else [])
    forced = ", ".join(f"{k}={v}" for k, v in (recorded.get("forced") or {}).items())
    names = {MINICAVS: f"as a user's machine runs it ({kernel(results, MINICAVS)})",
             FORCED: f"machine's BLAS variables ({kernel(results, FORCED)}: {forced})"}
    head = "| Tree-LSTM, minicavs / DyNet autobatching | " + " | ".join(
        f"{where}, {names[s]}" for s in systems for where in ("per core", "machine")) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(systems))]
    for text, point, measure in measured:
        cells = [ratio(results[point.key()], s, measure, per_core) for s in systems for per_core in (True, False)]
        lines.append(f"| {text} | " + " | ".join("-" if math.isnan(c) else f"{c:.2f}x" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m minicavs.bench.headline RESULTS.json", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            recorded = json.load(f)
    except (OSError, ValueError) as e:
        print(f"minicavs.bench.headline: {argv[0]}: {e}", file=sys.stderr)
        return 2
    if not isinstance(recorded, dict) or not isinstance(recorded.get("points", {}), dict):
        print(f"minicavs.bench.headline: {argv[0]}: not a minicavs bench results.json (no points)", file=sys.stderr)
        return 2
    table = markdown(recorded)
    print(table or f"{argv[0]}: no Tree-LSTM headline point measured with DyNet")
    return 0 if table else 1


if __name__ == "__main__":
    sys.exit(main())
