"""What a sweep will run and about how long it takes, before it runs: ``minicavs bench --plan`` lists every
point and process, and every sweep prints its estimate before it starts ("this sweep: 35 points, about 54
min").

The model follows the protocol (:mod:`minicavs.bench.suite`): per round and point, each system runs in a fresh
process, minicavs and PyTorch measuring twice in it (free to use the machine, then on one thread), DyNet once
(it computes on one thread either way). A process costs its start-up (imports, the point's trainer or the
peer's model built, kernels compiled: :data:`STARTUP`, measured on this machine kind) plus its timed phases,
each bounded by the caps: minicavs' epoch is sized to ``epoch_cap`` and it runs a warm-up epoch, a timed one,
a forward-only warm-up and timed pass (:data:`INFER`: their share of a training epoch) and, in the first
round's machine run only, the breakdown epoch; a peer's warm-up stops at ``epoch_cap`` and its timed epochs at
``timed_cap``, so its phases take ``min(slowdown x epoch, cap)``, :data:`SLOWDOWN` its usual time over
minicavs' for the same samples, but at least one of its batches (a cap stops a phase at the end of a batch);
minicavs' epoch is at least one batch, :func:`batch_seconds` from the batch's matmul FLOPs.
The parent adds, once per point, the peers' handover (the point's trainer built and checked,
:data:`HANDOVER`), and, once per run, the GEMM measurements and the ablation.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import peers
from .report import FORCED
from .sweeps import LABELS, Point
from .workloads import lstm_lm_flops, tree_fc_flops

# Seconds on a quiet 2-core machine (the old protocol's quiet sweep of 2026-12-02: each point's wall time less
# its phases, 1.2-3.6 s a process), stretched by the load (:func:`stretch`)
STARTUP = {"minicavs": 2.5, "dynet": 1.5, "pytorch": 3.0}   # imports, the trainer or the peer's model, kernels
HANDOVER = 3.0            # the parent's build + check + .npz of a point, once per point
GEMM = 8.0                # the machine's GEMM rates (both thread settings), at the start and at the end
INFER = 0.35              # a forward-only pass's time over a training epoch's
BREAKDOWN = 1.5           # the instrumented epoch over a plain one (its timers)
RATE = 150e9              # useful FLOP/s of a minicavs training step (Tree-FC h512 272 machine / 176 per core,
                          # Tree-LSTM h512 133, Var-LSTM 122: the quiet sweep)
# a peer's time over minicavs' for the same samples, the mean of its machine and per-core figures in the
# quiet sweep (PyTorch's two threads were often slower than its one: packed Var-LSTM 9x vs 1.3x)
SLOWDOWN = {("autobatch", "tree_lstm"): 2.1, ("autobatch", "tree_fc"): 3.5, ("autobatch", "var_lstm"): 1.9,
            ("autobatch", "fixed_lstm"): 1.3, ("level", "tree_lstm"): 1.6, ("level", "tree_fc"): 2.3,
            ("packed", "var_lstm"): 5.0, ("packed", "fixed_lstm"): 0.6, ("recursive", "tree_lstm"): 15.0}
ABLATION = 22.0           # seconds per model and hidden size (eight switch settings in one process)


def stretch(load: float, cores: int) -> float:
    """How much longer the work a cap does not bound (start-ups, handovers) takes when ``load`` runnable
    processes share ``cores``: the run gets about cores / load of the CPU. The capped phases are bounded in
    wall-clock seconds, so they do not stretch."""
    return max(1.0, load / max(1, cores))


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


def runs(points: list[Point], available, per_sample_at, labels=None, forced_at=()) -> list[Run]:
    """The processes of one round, in order: minicavs (and at ``forced_at`` minicavs with the machine's BLAS
    variables: ``--forced-kernel``) then every available peer (``available``: frameworks) at each point, the
    per-sample peers only at ``per_sample_at``."""
    out = []
    for p in points:
        out.append(Run(p, "minicavs", "minicavs"))
        if p in forced_at:
            out.append(Run(p, FORCED, "minicavs"))
        for peer in peers.PEERS.get(p.model, ()):
            if peer.framework not in available or (labels is not None and peer.label not in labels):
                continue
            if peer.mode in peers.PER_SAMPLE and p not in per_sample_at:
                continue
            out.append(Run(p, peer.label, peer.framework, peer.mode))
    return out


def run_seconds(run: Run, epoch_cap: float, timed_cap: float, inference: bool = True,
                first: bool = False, load: float = 1.0) -> float:
    """The model's seconds for one process (module doc); ``first``: the first round's (minicavs sizes its
    prefix and runs the breakdown epoch); ``load``: :func:`stretch`'s factor."""
    batch = load * batch_seconds(run.point)       # minicavs' training batch: its epoch is at least one
    n = max(1, int(epoch_cap / batch))            # the batches of the prefix that fits the epoch cap
    epoch = n * batch
    if run.framework == "minicavs":
        phases = run.settings * epoch * (2 + (2 * INFER if inference else 0))
        return load * STARTUP["minicavs"] + phases + ((BREAKDOWN * epoch + 2 * batch) if first else 0.0)
    slow = SLOWDOWN.get((run.mode, run.point.model), 2.0)   # its time over minicavs' on the same samples
    train = _phase(slow * epoch, epoch_cap, slow * batch) + _phase(slow * epoch, timed_cap, slow * batch)
    infer = (_phase(INFER * slow * epoch, epoch_cap, INFER * slow * batch)
             + _phase(INFER * slow * epoch, timed_cap, INFER * slow * batch))
    return load * STARTUP[run.framework] + run.settings * (train + (infer if inference else 0.0))


def _phase(epoch_s: float, cap: float, batch_s: float) -> float:
    """A capped phase: the whole epoch, or the cap rounded up to the end of a batch."""
    return min(epoch_s, max(cap, batch_s))


def batch_seconds(point: Point) -> float:
    """minicavs' seconds for one training batch at ``point`` on a quiet machine: the equations' products of a
    batch (forward, and backward at twice that) at :data:`RATE` (SST's average tree: 19 leaves; PTB valid's
    sentences: 22 words; its vocabulary: 6022 words)."""
    H = point.hidden
    if point.model == "tree_lstm":
        leaves, embed = 19, 128
        forward = 2.0 * (leaves * embed * 3 * H + (leaves - 1) * 8 * H * H + (2 * leaves - 1) * H * 5)
    elif point.model == "tree_fc":
        forward = tree_fc_flops(1, point.leaves, H)
    else:
        words = 64 if point.model == "fixed_lstm" else 22
        forward = lstm_lm_flops([words], 256, H, 6022)
    return 3 * forward * point.batch / RATE


def estimate(points: list[Point], available, per_sample_at, *, repeats: int, epoch_cap: float,
             timed_cap: float, inference: bool = True, ablation_cells: int = 0, labels=None,
             load: float = 1.0, forced_at=()) -> dict:
    """Seconds of the whole run by part: ``rounds`` (every process of every round), ``handover``, ``gemm``,
    ``ablation``, ``total``; and ``processes``, ``points``, ``load`` (:func:`stretch`'s factor used)."""
    one = runs(points, available, per_sample_at, labels, forced_at)
    first = sum(run_seconds(r, epoch_cap, timed_cap, inference, r.system != FORCED, load) for r in one)
    later = sum(run_seconds(r, epoch_cap, timed_cap, inference, False, load) for r in one)
    parts = {"rounds": first + (repeats - 1) * later,
             "handover": load * HANDOVER * len(points) if set(available) else 0.0,
             "gemm": GEMM, "ablation": load * ABLATION * ablation_cells}
    return {**parts, "total": sum(parts.values()), "processes": len(one) * repeats, "points": len(points),
            "load": load}


def listing(points: list[Point], available, per_sample_at, epoch_cap: float, timed_cap: float,
            inference: bool = True, labels=None, load: float = 1.0, forced_at=()) -> str:
    """One line per point: its processes of a round and their modelled seconds (a later round's)."""
    lines = []
    for p in points:
        mine = runs([p], available, per_sample_at, labels, forced_at)
        secs = sum(run_seconds(r, epoch_cap, timed_cap, inference, load=load) for r in mine)
        names = ", ".join(r.system for r in mine)
        lines.append(f"  {p.key():<26} {LABELS[p.model]:<10} {len(mine)} processes, ~{secs:4.0f} s a round: {names}")
    return "\n".join(lines)


def headline(est: dict, repeats: int) -> str:
    """The line printed before a run starts."""
    loaded = f"; start-ups x{est['load']:.1f} for the machine's load" if est["load"] > 1 else ""
    return (f"this sweep: {est['points']} points, {est['processes']} processes in {repeats} rounds, about "
            f"{est['total'] / 60:.0f} min (rounds {est['rounds'] / 60:.1f}, peers' handovers "
            f"{est['handover'] / 60:.1f}, ablation {est['ablation'] / 60:.1f}, GEMM rates {est['gemm'] / 60:.1f}"
            f"{loaded})")
