"""``minicavs plot RUN_DIR``: training curves from ``RUN_DIR/metrics.jsonl`` as one PNG (the ``plot`` extra).

One panel per metric, every split that reports it as a line (train solid, dev dashed...), a baseline the
model reports beside a metric (``root_majority_acc`` beside ``root_acc``, ``unigram_perplexity`` beside
``perplexity``) as a grey dotted line in that metric's panel, and the training throughput. Epochs are
markers too, so a one-epoch run shows its point.
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

from ..core.atomic import write_bytes
from ..core.errors import MinicavsError

SPLITS = ("train", "dev", "test")
BASELINE_WORDS = ("majority", "unigram")
STYLE = {"train": ("-", "C0"), "dev": ("--", "C1"), "test": (":", "C2")}


class PlotError(MinicavsError):
    pass


def read_metrics(path: Path) -> list[dict]:
    """The epoch rows of a metrics file; a torn last line (a crash mid-write) is left out."""
    if not path.is_file():
        raise PlotError(f"{path}: no metrics file (is this a run dir written by minicavs train?)")
    rows = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines):
                break          # torn by a crash; resume repairs it
            raise PlotError(f"{path}:{i}: not a JSON line") from None
    if not rows:
        raise PlotError(f"{path}: no epochs recorded yet")
    return rows


def panels(rows: list[dict]) -> dict[str, dict[str, list]]:
    """metric -> line label -> [(epoch, value)]: splits of one metric share a panel; baselines join theirs."""
    out: dict = {}
    for row in rows:
        for key, value in row.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or key in ("epoch", "step"):
                continue
            split, _, metric = key.partition("_")
            if split not in SPLITS or not metric:
                continue
            label = split
            for word in BASELINE_WORDS:
                if word in metric.split("_"):
                    metric = "_".join(w for w in metric.split("_") if w != word)
                    label = f"{split} {word} baseline"
            if math.isfinite(value):
                out.setdefault(metric, {}).setdefault(label, []).append((row["epoch"], value))
        for key, value in (row.get("timing") or {}).items():
            if key.endswith("_per_s"):
                out.setdefault(key.replace("_per_s", "/s").replace("_", " "), {}).setdefault(
                    "throughput", []).append((row["epoch"], value))
    order = ["loss"] + sorted(k for k in out if k != "loss" and "/s" not in k) + [k for k in out if "/s" in k]
    return {k: out[k] for k in order if k in out}


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the curves of ``run_dir`` to ``out`` (default ``RUN_DIR/curves.png``); returns the path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install 'minicavs[plot]'") from None
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    data = panels(rows)
    cols = min(3, len(data))
    nrows = math.ceil(len(data) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.3 * nrows), squeeze=False)
    epochs = sorted({r["epoch"] for r in rows})
    for ax, (metric, lines) in zip(axes.flat, data.items()):
        for label, pts in lines.items():
            xs, ys = zip(*pts)
            split = label.split()[0]
            if "baseline" in label:
                ax.plot(xs, ys, ":", color="grey", marker=".", label=label)
            else:
                line, color = STYLE.get(split, ("-", "C0"))
                ax.plot(xs, ys, line, color=color, marker="o", markersize=4, label=label)
        ax.set_title(metric.replace("_", " "))
        ax.set_xlabel("epoch")
        ax.set_xticks(epochs if len(epochs) <= 12 else epochs[::math.ceil(len(epochs) / 12)])
        if len(epochs) == 1:
            ax.set_xlim(epochs[0] - 1, epochs[0] + 1)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    fig.suptitle(f"{run_dir.resolve().name}: {len(epochs)} epoch{'s' if len(epochs) != 1 else ''}")
    fig.tight_layout()
    target = Path(out) if out else run_dir / "curves.png"
    png = io.BytesIO()
    fig.savefig(png, dpi=100, format="png")
    plt.close(fig)
    write_bytes(target, png.getvalue())
    return target


def add_arguments(p) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run dir written by minicavs train (its metrics.jsonl)")
    p.add_argument("--out", "-o", default=None, help="the PNG to write (default RUN_DIR/curves.png)")


def run(args) -> int:
    print(plot_run(args.run_dir, args.out))
    return 0
