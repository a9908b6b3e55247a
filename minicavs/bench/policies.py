"""``minicavs bench --policies``: ED-Batch's batching policies on every bundled model (its Fig. 9 and §5.3).

Per model, the training data is shuffled (seeded) and cut into batches of 64 samples; each structure's batch
(the kinds its model assigns) is scheduled by every policy. The FSMs (encodings S1, S2, S3) learn on the
first ``learn`` batches, as the trainer does, and every policy is counted on the next ``batches`` batches
(held out from learning). Reported per model: vertices per batch, tasks (batches, in ED-Batch's words) per
batch of 64 for each policy and ED-Batch's lower bound (A.3), the FSMs' learning time and episodes, and each
policy's scheduling time per batch (median). With ``--throughput``, training throughput per policy (batch
64, hidden 256) and its split: scheduling (the policy) and the rest of the step. Output: ``policies.md``,
``policies.json`` and, with matplotlib, ``policies.png``.
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from ..runtime.frontier import Frontier, TypedGraph, native_schedule
from ..runtime.scheduler import FsmPolicy, get_policy, lower_bound
from ..train.config import load_config
from ..train.trainer import Trainer

POLICIES = ("cavs", "agenda", "greedy", "fsm:S1", "fsm:S2", "fsm:S3")


def _shared(rel: str) -> str | None:
    """The shared data file beside the repository (``../shared``) or beside its worktree folder."""
    from ..train.config import REPO_ROOT
    for root in (Path.cwd().parent, REPO_ROOT.parent, REPO_ROOT.parent.parent):
        if (root / "shared" / rel).is_file():
            return str(root / "shared" / rel)
    return None


def _sst():
    path = _shared("data/sst/train.txt")
    return [f"data.train={path}"] if path else []


def _ptb():
    path = _shared("data/ptb/ptb.valid.txt")
    return [f"data.train={path}"] if path else []


NO_DROPOUT = ["model.dropout=0.0"]
# model -> (config, overrides): the graphs (and kinds) each bundled model trains on
WORKLOADS = {
    "tree_lstm": ("tree_lstm.yaml", lambda: _sst() + NO_DROPOUT),
    "tree_fc": ("tree_fc.yaml", lambda: ["model.leaves=256", "data.synthetic.train=800"]),
    "var_lstm": ("var_lstm.yaml", lambda: _ptb() + NO_DROPOUT),
    "fixed_lstm": ("fixed_lstm.yaml", lambda: _ptb() + NO_DROPOUT),
    "tree_gru": ("tree_gru.yaml", lambda: _sst() + NO_DROPOUT),
    "mv_rnn": ("mv_rnn.yaml", lambda: _sst() + NO_DROPOUT),
    "tree_lstm_2type": ("tree_lstm_2type.yaml", lambda: _sst() + NO_DROPOUT),
    "lattice_lstm": ("lattice_lstm.yaml", lambda: NO_DROPOUT),
    "lattice_gru": ("lattice_gru.yaml", lambda: NO_DROPOUT),
    "bilstm_tagger": ("bilstm_tagger.yaml", lambda: NO_DROPOUT),
    "lstm_nmt": ("lstm_nmt.yaml", list),
}


# ED-Batch batches a DyNet graph of operators: there every tree vertex's output (its softmax loss) is a node
# of its own and a reduction sums them (its Fig. 1's O and R). Cavs's push/pull move both into the static
# part, so the bundled models' vertex graphs lack them. These rows count the same batches as the graphs
# ED-Batch schedules: an "out" vertex on every vertex that pushes, and one "sum" vertex per sample.
OP_GRAPHS = {"tree_lstm_2type+outputs": "tree_lstm_2type", "lattice_lstm+outputs": "lattice_lstm",
             "lattice_gru+outputs": "lattice_gru"}


def with_outputs(batch, pushing: set):
    """``batch`` with an "out" vertex on each vertex of a kind in ``pushing`` and a "sum" vertex per sample
    over its outputs (kinds appended after the batch's own)."""
    from ..runtime.inputs import InputGraph, make_batch
    graphs = []
    for g in batch.graphs:
        n = g.num_vertices
        outs = [v for v in range(n) if g.kinds[v] in pushing]
        children = [g.children(v).tolist() for v in range(n)] + [[v] for v in outs] + \
            [list(range(n, n + len(outs)))]
        graphs.append(InputGraph(children, list(g.kinds) + ["out"] * len(outs) + ["sum"]))
    return make_batch(graphs, kind_names=tuple(batch.kind_names) + ("out", "sum"))


def trainer_for(model: str, hidden: int | None = None, batch: int = 64, policy: str = "cavs") -> Trainer:
    from .workloads import models_dir
    config, extra = WORKLOADS[model]
    overrides = ["data.dev=null", "data.test=null", f"train.batch_size={batch}", f"train.policy={policy}"]
    overrides += extra() + ([f"model.hidden={hidden}"] if hidden else [])
    return Trainer(load_config(models_dir() / config, overrides),
                   run_dir=tempfile.mkdtemp(prefix="minicavs-policies-"))


def sample_batches(t: Trainer, count: int, batch: int = 64, seed: int = 0) -> list[dict]:
    """``count`` batches of ``batch`` training samples (shuffled, seeded): structure name -> Batch."""
    data = t.task.data["train"]
    order = np.random.default_rng([seed, 18]).permutation(len(data))
    out = []
    for i in range(0, min(len(order), count * batch), batch):
        graphs, _ = t.task.batch([data[j] for j in order[i:i + batch]])
        out.append(t.model.batches(graphs))
    return out


def count_model(model: str, batches: int = 8, learn: int = 4, log=print, search: int = 0) -> dict:
    t = trainer_for(OP_GRAPHS.get(model, model))
    sample = sample_batches(t, learn + batches)
    if model in OP_GRAPHS:
        pushing = {k for s in t.model.structures for k, f in s.functions.items() if f.pushes}
        sample = [{k: with_outputs(b, pushing) for k, b in s.items()} for s in sample]
    learn_on, evaluate_on = sample[:learn], sample[learn:] or sample
    row = {"model": model, "batches": len(evaluate_on),
           "vertices": float(np.mean([sum(b.num_vertices for b in s.values()) for s in evaluate_on])),
           "kinds": sorted({k for s in evaluate_on for b in s.values() for k in b.kind_names}),
           "lower_bound": float(np.mean([sum(lower_bound(b) for b in s.values()) for s in evaluate_on])),
           "tasks": {}, "schedule_ms": {}, "fsm": {}}
    for name in POLICIES:
        policy = get_policy(name)
        if isinstance(policy, FsmPolicy):
            learned = [policy.learn([s[k] for s in learn_on]) for k in learn_on[0]]
            row["fsm"][name] = {"seconds": sum(f.stats["seconds"] for f in learned),
                                "episodes": max(f.stats["episodes"] for f in learned),
                                "states": sum(f.stats["states"] for f in learned),
                                "lookup_us": lookup_us(learned[0], next(iter(evaluate_on[0].values()))),
                                "native_step_us": native_step_us(learned[0], [b for s in evaluate_on
                                                                               for b in s.values()])}
        tasks, times = [], []
        for s in evaluate_on:
            start = time.perf_counter()
            tasks.append(sum(policy.schedule(b).num_tasks for b in s.values()))
            times.append(time.perf_counter() - start)
        row["tasks"][name] = float(np.mean(tasks))
        row["schedule_ms"][name] = 1e3 * float(np.median(times))
    if search:
        row["search"] = bracket(evaluate_on, search, log)
    log(f"{model}: " + ", ".join(f"{k} {v:.1f}" for k, v in row["tasks"].items())
        + f", lower bound {row['lower_bound']:.1f}")
    return row


def bracket(batches: list[dict], expansions: int, log=print, width: int = 30) -> dict:
    """The optimum of every batch bracketed (:mod:`minicavs.bench.optimum`): A* with ``expansions`` states
    (exact, or a lower bound), a beam search of ``width`` (an upper bound); per batch and their means; and the
    fewest tasks any S3 table reaches on these batches (None where the kinds make too many tables to try)."""
    from .optimum import astar, beam, best_table
    per = []
    for s in batches:
        graphs = [TypedGraph.of(b) for b in s.values()]
        found = [astar(g, expansions) for g in graphs]
        per.append({"low": sum(f[0] for f in found), "exact": all(f[1] for f in found),
                    "high": sum(beam(g, width) for g in graphs),
                    "agenda": sum(get_policy("agenda").schedule(b).num_tasks for b in s.values())})
        log(f"  optimum in [{per[-1]['low']}, {per[-1]['high']}]" + (" (exact)" if per[-1]["exact"] else "")
            + f", agenda {per[-1]['agenda']}")
    tables = [best_table([TypedGraph.of(s[k]) for s in batches], batches[0][k].kind_names, "S3")
              for k in batches[0]]
    best_s3 = None if None in tables else sum(t[0] for t in tables) / len(batches)
    if best_s3 is not None:
        log(f"  the best of every S3 table: {best_s3:.2f} tasks per batch")
    return {"low": float(np.mean([p["low"] for p in per])), "high": float(np.mean([p["high"] for p in per])),
            "exact": sum(p["exact"] for p in per), "expansions": expansions, "width": width, "per_batch": per,
            "best_s3_table": best_s3}


def lookup_us(fsm, batch, repeats: int = 2000) -> float:
    """Microseconds of one FSM step's decision (state encoding + table lookup) on the batch's first frontier."""
    frontier = Frontier(TypedGraph.of(batch))
    start = time.perf_counter()
    for _ in range(repeats):
        fsm.choose(frontier)
    return 1e6 * (time.perf_counter() - start) / repeats


def native_step_us(fsm, batches, repeats: int = 20) -> float | None:
    """Microseconds per step of the FSM's whole run in the native schedule (frontier updates, encodings,
    table lookups and the checks of its input; median per batch, averaged over the batches), or None
    without one."""
    if native_schedule() is None:
        return None
    per_step = []
    for batch in batches:
        graph = TypedGraph.of(batch)
        steps = len(fsm.schedule(graph)[1])
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fsm.schedule(graph)
            times.append(time.perf_counter() - start)
        per_step.append(1e6 * float(np.median(times)) / max(steps, 1))
    return float(np.mean(per_step))


def throughput(model: str, policies, hidden: int, steps: int, repeats: int) -> dict:
    """Training samples per second per policy: median of ``repeats`` timed passes over the same ``steps``
    batches of 64, after one warm-up pass; the policies' passes alternate (the machine is noisy). An FSM
    learns before its warm-up, outside the timed passes. Also the share of each pass spent scheduling
    (the policy's ``schedule``; the memory plan and the engine are the rest: compute)."""
    runs = {}
    for name in policies:
        t = trainer_for(model, hidden=hidden, policy=name)
        t.prepare_policy()
        clock = {"s": 0.0}
        inner = t.policy.schedule

        def timed(batch, inner=inner, clock=clock):
            start = time.perf_counter()
            try:
                return inner(batch)
            finally:
                clock["s"] += time.perf_counter() - start
        t.policy.schedule = timed
        runs[name] = (t, clock, [], [], [])
    data = next(iter(runs.values()))[0].task.data["train"][:64 * steps]
    for rep in range(repeats + 1):
        for name in (policies if rep % 2 else policies[::-1]):
            t, clock, rates, cpu_rates, shares = runs[name]
            clock["s"] = 0.0
            start, cpu = time.perf_counter(), time.process_time()
            for i in range(0, len(data), 64):
                # training reshuffles, so its batches are new: drop the plans Model keeps for a batch of the
                # same graphs, which would otherwise make the cacheable policies' (not fsm's) planning free here
                t.model.forget_plans()
                res = t.loss_and_grads(data[i:i + 64])
                t.optimizer.step(res.grads, loss=res.loss)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            if rep:
                rates.append(len(data) / seconds)
                cpu_rates.append(len(data) / cpu)
                shares.append(clock["s"] / seconds)
    return {name: {"rate": float(np.median(r)), "min": float(min(r)), "max": float(max(r)),
                   "cpu_rate": float(np.median(c)), "scheduling_frac": float(np.median(sh))}
            for name, (_, _, r, c, sh) in runs.items()}


def markdown(rows: list[dict], speed: dict) -> str:
    lines = ["# Batching policies: tasks per batch of 64 samples", "",
             "Mean over held-out batches; FSMs learned on other batches of the same data. `cavs` is the "
             "depth-based policy (`depth`).", "",
             "| model | vertices | " + " | ".join(POLICIES) + " | lower bound | fsm:S3 / bound | "
             "fsm:S3 vs cavs | fsm:S3 vs agenda |",
             "|---" * (len(POLICIES) + 6) + "|"]
    for r in rows:
        t, lb = r["tasks"], r["lower_bound"]
        lines.append(f"| {r['model']} | {r['vertices']:.0f} | " + " | ".join(f"{t[p]:.1f}" for p in POLICIES)
                     + f" | {lb:.1f} | {t['fsm:S3'] / lb:.3f} | {1 - t['fsm:S3'] / t['cavs']:+.0%} fewer | "
                     f"{1 - t['fsm:S3'] / t['agenda']:+.0%} fewer |")
    lines += ["", "## FSM learning (seconds, episodes, states; one decision's encoding + lookup in numpy, then a "
              "whole step of the native schedule: frontier update, encoding, lookup, in µs) and scheduling time "
              "per batch (ms, median; a frontier policy's includes the frontier updates)", "",
              "| model | " + " | ".join(f"learn {p}" for p in POLICIES if p.startswith("fsm"))
              + " | " + " | ".join(f"{p} ms" for p in POLICIES) + " | fsm:S3 µs per task |",
              "|---" * (2 + 3 + len(POLICIES)) + "|"]
    for r in rows:
        f = r["fsm"]
        lines.append(f"| {r['model']} | " + " | ".join(
            f"{f[p]['seconds']:.2f} s, {f[p]['episodes']} ep, {f[p]['states']} st, {f[p]['lookup_us']:.1f} µs, "
            + ("no native" if f[p].get("native_step_us") is None else f"{f[p]['native_step_us']:.2f} µs native")
            for p in POLICIES
            if p.startswith("fsm")) + " | " + " | ".join(f"{r['schedule_ms'][p]:.2f}" for p in POLICIES)
            + f" | {1e3 * r['schedule_ms']['fsm:S3'] / r['tasks']['fsm:S3']:.0f} |")
    searched = [r for r in rows if "search" in r]
    if searched:
        lines += ["", "## The optimum, bracketed by search (mean per batch of 64; A* with the lower bound left as its "
                  "heuristic: exact where it settled, else a lower bound; beam search: a schedule found)", "",
                  "| model | optimum >= | optimum <= | batches settled | agenda | fewest tasks vs agenda any policy can "
                  "reach (at best) | fsm:S3 / optimum (at most) | best of every S3 table | it vs cavs, agenda |",
                  "|---" * 9 + "|"]
        for r in searched:
            s, t = r["search"], r["tasks"]
            table = s.get("best_s3_table")
            table_cells = ("n/a (too many tables) | n/a" if table is None else
                           f"{table:.1f} | {1 - table / t['cavs']:.0%}, {1 - table / t['agenda']:.0%} fewer")
            lines.append(f"| {r['model']} | {s['low']:.1f} | {s['high']:.1f} | {s['exact']}/{len(s['per_batch'])} | "
                         f"{t['agenda']:.1f} | {1 - s['low'] / t['agenda']:.0%} fewer | "
                         f"{t['fsm:S3'] / s['low']:.3f} | {table_cells} |")
    if speed:
        lines += ["", "## Training throughput at batch 64, hidden 256 (samples/s: wall-clock median [min-max], "
                  "then per CPU-second of this process, less sensitive to other load; scheduling share of the "
                  "wall time; the rest is compute)", "",
                  "| model | " + " | ".join(speed[next(iter(speed))]) + " | fsm:S3 / cavs (wall, CPU) |",
                  "|---" * (2 + len(speed[next(iter(speed))])) + "|"]
        for model, per in speed.items():
            cells = [f"{v['rate']:.1f} [{v['min']:.1f}-{v['max']:.1f}], cpu {v['cpu_rate']:.1f}; "
                     f"sched {v['scheduling_frac']:.1%}" for v in per.values()]
            f, c = per.get("fsm:S3"), per.get("cavs")
            ratio = f"{f['rate'] / c['rate']:.2f}, {f['cpu_rate'] / c['cpu_rate']:.2f}" if f and c else "n/a"
            lines.append(f"| {model} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 3, 4))
    width = 0.8 / len(POLICIES)
    for i, p in enumerate(POLICIES):
        ax.bar(np.arange(len(rows)) + i * width, [r["tasks"][p] / r["lower_bound"] for r in rows], width, label=p)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="lower bound")
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [r["model"] for r in rows], rotation=20)
    ax.set_ylabel("tasks / lower bound (batch of 64)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def available(models, op_graphs: bool = True) -> list:
    """The models whose config exists (with ``op_graphs``, also the ED-Batch graph rows of :data:`OP_GRAPHS`)."""
    from .workloads import models_dir
    return [m for m in models if (m in WORKLOADS or op_graphs) and
            (models_dir() / WORKLOADS[OP_GRAPHS.get(m, m)][0]).is_file()]


def run_policies(models, out: Path, batches: int = 8, learn: int = 4, speed: bool = False, hidden: int = 256,
                 steps: int = 4, repeats: int = 3, speed_policies=("cavs", "agenda", "greedy", "fsm:S3"),
                 log=print, search: int = 0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows = [count_model(m, batches, learn, log, search) for m in available(models)]
    results = {"rows": rows, "throughput": {}}
    if speed:
        for m in available(models, op_graphs=False):
            results["throughput"][m] = per = throughput(m, list(speed_policies), hidden, steps, repeats)
            log(f"{m}: " + ", ".join(f"{p} {v['rate']:.1f}/s (sched {v['scheduling_frac']:.1%})"
                                     for p, v in per.items()))
    (out / "policies.json").write_text(json.dumps(results, indent=1))
    (out / "policies.md").write_text(markdown(rows, results["throughput"]))
    plot(rows, out / "policies.png")
    log(f"wrote {out / 'policies.md'}")
    return results
