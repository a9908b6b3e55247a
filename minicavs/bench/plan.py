"""What a sweep will run and about how long it takes, before it runs: ``minicavs bench --plan`` lists every
point and process, and every sweep prints its estimate before it starts ("this sweep: 35 points, about 41
min").

The model follows the protocol (:mod:`minicavs.bench.suite`): per round and point, each system runs in a fresh
process, minicavs and PyTorch measuring twice in it (free to use the machine, then on one thread), DyNet once
(it computes on one thread either way). A process costs its start-up (imports, the point's trainer or the peer's model built,
kernels compiled: :data:`STARTUP`, measured on this machine kind) plus its timed phases, each bounded by the
caps: minicavs' epoch is sized to ``epoch_cap`` and it runs a warm-up epoch, a timed one, a forward-only
warm-up and timed pass (:data:`INFER`: their share of a training epoch) and, in the first round's machine run
only, the breakdown epoch; a peer's warm-up stops at ``epoch_cap`` and its timed epochs at ``timed_cap``, so
its phases take ``min(slowdown x epoch_cap, cap)`` with :data:`SLOWDOWN` its usual time over minicavs' for the
same samples. The parent adds, once per point, the peers' handover (the point's trainer built and checked,
:data:`HANDOVER`), and, once per run, the GEMM measurements and the ablation.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import peers
from .sweeps import LABELS, Point

# seconds of a process before its first timed batch (loaded 2-core machine, 2026-12-02: wall_s - phases)
STARTUP = {"minicavs": 4.0, "dynet": 2.5, "pytorch": 4.0}
HANDOVER = 3.0            # the parent's build + check + .npz of a point, once per point
GEMM = 8.0                # the machine's GEMM rates (both thread settings), at the start and at the end
INFER = 0.35              # a forward-only pass's time over a training epoch's
BREAKDOWN = 1.5           # the instrumented epoch over a plain one (its timers)
SLOWDOWN = {"autobatch": 2.5, "level": 2.0, "packed": 1.0, "recursive": 20.0}   # peer time / minicavs' time
ABLATION = 22.0           # seconds per model and hidden size (eight switch settings in one process)


@dataclass(frozen=True)
class Run:
    """One process of one round: a system at a point (both thread settings, but DyNet's one)."""

    point: Point
    system: str          # the report's label (report.MINICAVS or a peer's label)
    framework: str       # "minicavs", "dynet", "pytorch"
    mode: str = ""       # the peer's mode (peers.PEERS)

    @property
    def settings(self) -> int:
        """Thread settings measured in the process: DyNet computes on one thread either way."""
        return 1 if self.framework == "dynet" else 2


def runs(points: list[Point], available, per_sample_at, labels=None) -> list[Run]:
    """The processes of one round, in order: minicavs then every available peer (``available``: frameworks)
    at each point, the per-sample peers only at ``per_sample_at``."""
    out = []
    for p in points:
        out.append(Run(p, "minicavs", "minicavs"))
        for peer in peers.PEERS.get(p.model, ()):
            if peer.framework not in available or (labels is not None and peer.label not in labels):
                continue
            if peer.mode in peers.PER_SAMPLE and p not in per_sample_at:
                continue
            out.append(Run(p, peer.label, peer.framework, peer.mode))
    return out


def run_seconds(run: Run, epoch_cap: float, timed_cap: float, inference: bool = True,
                breakdown: bool = False) -> float:
    """The model's seconds for one process (module doc)."""
    if run.framework == "minicavs":
        phases = run.settings * (2 + (2 * INFER if inference else 0)) + (BREAKDOWN if breakdown else 0)
        return STARTUP["minicavs"] + phases * epoch_cap
    slow = SLOWDOWN.get(run.mode, 2.0) * epoch_cap
    train = min(slow, epoch_cap) + min(slow, timed_cap)
    infer = min(INFER * slow, epoch_cap) + min(INFER * slow, timed_cap) if inference else 0.0
    return STARTUP[run.framework] + run.settings * (train + infer)


def estimate(points: list[Point], available, per_sample_at, *, repeats: int, epoch_cap: float,
             timed_cap: float, inference: bool = True, breakdown: bool = True, ablation_cells: int = 0,
             labels=None) -> dict:
    """Seconds of the whole run by part: ``rounds`` (every process of every round), ``handover``, ``gemm``,
    ``ablation``, ``total``; and ``processes``, ``points``."""
    one = runs(points, available, per_sample_at, labels)
    first = sum(run_seconds(r, epoch_cap, timed_cap, inference, breakdown and r.framework == "minicavs")
                for r in one)
    later = sum(run_seconds(r, epoch_cap, timed_cap, inference) for r in one)
    parts = {"rounds": first + (repeats - 1) * later,
             "handover": HANDOVER * len(points) if set(available) else 0.0,
             "gemm": GEMM, "ablation": ABLATION * ablation_cells}
    return {**parts, "total": sum(parts.values()), "processes": len(one) * repeats, "points": len(points)}


def listing(points: list[Point], available, per_sample_at, epoch_cap: float, timed_cap: float,
            inference: bool = True, labels=None) -> str:
    """One line per point: its processes of a round and their modelled seconds."""
    lines = []
    for p in points:
        mine = runs([p], available, per_sample_at, labels)
        secs = sum(run_seconds(r, epoch_cap, timed_cap, inference) for r in mine)
        names = ", ".join(r.system for r in mine)
        lines.append(f"  {p.key():<26} {LABELS[p.model]:<10} {len(mine)} processes, ~{secs:4.0f} s a round: {names}")
    return "\n".join(lines)


def headline(est: dict, repeats: int) -> str:
    """The line printed before a run starts."""
    return (f"this sweep: {est['points']} points, {est['processes']} processes in {repeats} rounds, about "
            f"{est['total'] / 60:.0f} min (rounds {est['rounds'] / 60:.1f}, peers' handovers "
            f"{est['handover'] / 60:.1f}, ablation {est['ablation'] / 60:.1f}, GEMM rates {est['gemm'] / 60:.1f})")
