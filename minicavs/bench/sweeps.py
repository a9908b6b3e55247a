"""The paper's sweeps (Fig. 8 and Fig. 9a) scaled to a 2-core CPU: which points each model runs.

Fig. 8: hidden 512 with batch 1, 16, 64, 256 ("batch" sweep) and batch 64 with hidden 64 .. 1024 ("hidden"
sweep), for every model; Fig. 9a: Tree-FC at batch 64, hidden 512 with 32, 256 and 1024 leaves. Tree-LSTM also
runs one tree at a time at hidden 128 ("latency": the batch-1 forward-only speed target against DyNet). A
point shared by two sweeps (batch 64, hidden 512) is measured once and shown in both.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MODELS = ("tree_lstm", "tree_fc", "var_lstm", "fixed_lstm")
LABELS = {"tree_lstm": "Tree-LSTM", "tree_fc": "Tree-FC", "var_lstm": "Var-LSTM", "fixed_lstm": "Fixed-LSTM"}
UNITS = {"tree_lstm": "trees", "tree_fc": "trees", "var_lstm": "words", "fixed_lstm": "words"}
TREE_FC_LEAVES = 256   # Tree-FC's leaves in the batch and hidden sweeps (TensorFlow Fold's benchmark)

# "batch" runs at hidden "hidden_at", "hidden" at batch "batch_at"; Tree-FC has "fc_leaves" leaves in both,
# and "leaves" runs at ("hidden_at", "batch_at"); "latency": Tree-LSTM's hidden sizes at batch 1
FULL = {"batch": [1, 16, 64, 256], "hidden": [64, 128, 256, 512, 1024], "leaves": [32, 256, 1024],
        "hidden_at": 512, "batch_at": 64, "fc_leaves": TREE_FC_LEAVES, "latency": [128]}
QUICK = {**FULL, "batch": [64], "hidden": [512], "leaves": [256], "latency": []}   # the summary table's points


@dataclass(frozen=True)
class Point:
    """One workload size: a model at a hidden size and batch size (Tree-FC also a number of leaves)."""

    model: str
    hidden: int
    batch: int
    leaves: int = 0     # Tree-FC only

    def key(self) -> str:
        leaves = f"-l{self.leaves}" if self.leaves else ""
        return f"{self.model}-h{self.hidden}-b{self.batch}{leaves}"

    def as_dict(self) -> dict:
        return asdict(self)


def sweeps(models=MODELS, quick: bool = False, grid: dict | None = None) -> dict[str, list[Point]]:
    """Sweep name (``<model>/batch``, ``<model>/hidden``, ``tree_fc/leaves``, ``tree_lstm/latency``) -> its
    points in order.
    ``grid`` (keys as in FULL) replaces the full or quick grid."""
    grid = grid or (QUICK if quick else FULL)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    out: dict[str, list[Point]] = {}
    for m in models:
        leaves = grid["fc_leaves"] if m == "tree_fc" else 0
        H, B = grid["hidden_at"], grid["batch_at"]
        out[f"{m}/batch"] = [Point(m, H, b, leaves) for b in grid["batch"]]
        out[f"{m}/hidden"] = [Point(m, h, B, leaves) for h in grid["hidden"]]
        if m == "tree_fc":
            out["tree_fc/leaves"] = [Point(m, H, B, n) for n in grid["leaves"]]
        if m == "tree_lstm" and grid.get("latency"):
            out["tree_lstm/latency"] = [Point(m, h, 1) for h in grid["latency"]]
    return out


def axis(sweep: str) -> str:
    """The Point field a sweep varies (its plots' x axis)."""
    kind = sweep.split("/")[1]
    return "hidden" if kind == "latency" else kind


def both_sweeps(sw: dict[str, list[Point]]) -> dict[str, Point]:
    """Per model the point in both of its Fig. 8 sweeps (hidden 512, batch 64): the summary's."""
    both = {}
    for name, pts in sw.items():
        if name.endswith("/batch"):
            both.update((p.model, p) for p in pts if p in sw.get(name.replace("/batch", "/hidden"), ()))
    return both


def per_sample_points(sw: dict[str, list[Point]]) -> list[Point]:
    """The points where the per-sample peers run: Tree-LSTM's largest batch, the one point where the paper
    gives PyTorch's time (542 s an epoch at batch 256, §5.1; Fig. 8 shows no per-sample system). Elsewhere a
    per-sample peer would cost a point more than every other system together: one of its batches outlasts
    the caps (Tree-FC, 64 trees of 256 leaves: 16 s a batch)."""
    return [max(sw["tree_lstm/batch"], key=lambda p: p.batch)] if sw.get("tree_lstm/batch") else []


def distinct_points(sw: dict[str, list[Point]]) -> list[Point]:
    """Every point once, in first-appearance order."""
    return list(dict.fromkeys(p for pts in sw.values() for p in pts))
