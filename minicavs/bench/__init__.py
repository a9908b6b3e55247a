"""``minicavs bench``: the paper's evaluation (§5) in one command, against DyNet and PyTorch in the same run.

Sweeps (Fig. 8 scaled to 2 cores): hidden 512 with batch 1, 16, 64, 256, and batch 64 with hidden 64 .. 1024,
for Tree-LSTM (SST), Tree-FC (complete binary trees of 256 leaves), Var-LSTM (PTB text) and Fixed-LSTM (64-word
windows of it); Tree-FC at batch 64, hidden 512 with 32, 256 and 1024 leaves (Fig. 9a). Each point trains a
fixed number of samples, cut to the prefix of whole batches that fits the time cap, on minicavs (in a process
of its own: its peak RSS is the point's) and on every installed peer (tools/setup_peers.sh; the peer first
computes the loss of a few samples with minicavs' weights, which must equal minicavs'). Reported per point:
training and forward-only rates (medians of ``--repeats`` rounds, every system timed once per round, the
systems alternating), minicavs/peer ratios per core (the targets' measure) and free to use the machine, the
useful matmul FLOP rate as a share of the machine's numpy GEMM rate (measured in the same run), peak RSS, minicavs' time
split (scheduling, memory movement, update, computation) and DyNet's (graph construction vs computation).
Then the ablation (Fig. 10): each engine switch's speedup over all switches off, and the table of the CPU
speed targets over the points measured (not with ``--quick``, whose few short points judge none;
``--targets``: only the points the targets need, minicavs and the batched peers alternating round by round;
:mod:`minicavs.bench.targets`). ``--engine KEY=VALUE`` sets minicavs' engine (any ``train.engine`` key) for
every point. ``--as-user`` runs the command with every ``OPENBLAS_*``, ``OMP_*`` and ``MKL_*`` variable
unset (as a user's machine runs it; a development machine may force an older BLAS kernel); every record names
the BLAS (library, version, kernel, threads), the CPU and the variables set (:mod:`minicavs.bench.machine_facts`).

Output (``--out``): per sweep a CSV and a markdown table, ``all.csv``, ``summary.md``, ``results.json`` and,
with matplotlib (``pip install "minicavs[plot]"``), a PNG per sweep of two or more points and ``ablation.png``;
``targets.md``.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..train.config import ConfigError   # a bad flag: one line, exit 2 (train/cli.py)
from .sweeps import MODELS
from .workloads import Data

SST = "../shared/data/sst/train.txt"
PTB = "../shared/data/ptb/ptb.valid.txt"
FULL_CAP, QUICK_CAP = 2.5, 1.5   # the full sweep in ~54 min on a quiet 2-core machine (3 s: ~58 min; --plan)
ABLATION_HIDDEN = (64, 512)      # the ablation's hidden sizes: the range's ends (all four: +1.5 min)
QUICK_DATA = {"trees": 256, "fc_trees": 64, "sentences": 500, "windows": 128}


def add_arguments(p: argparse.ArgumentParser) -> None:
    _sweep_arguments(p)
    _mode_arguments(p)
    _control_arguments(p)


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The sweeps': which models, how long, which data, which peers, what else to measure."""
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--quick", action="store_true",
                   help=f"one point per model (batch 64, hidden 512), a {QUICK_CAP:g} s cap, a small ablation "
                        f"(hidden 128), no targets table and no plots of one-point sweeps: about 3 minutes")
    p.add_argument("--cap", type=float, default=None,
                   help=f"seconds of timed training per system and point (default {FULL_CAP:g}, "
                        f"quick {QUICK_CAP:g}); each timed epoch gets cap/repeats")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds, each timing every system once per point, alternating (default 3, quick 2)")
    p.add_argument("--out", default="bench-results", help="output directory")
    p.add_argument("--points", nargs="+", default=None, metavar="KEY",
                   help="only these points of the sweeps (keys as --plan lists them, e.g. tree_fc-h512-b64-l256)")
    p.add_argument("--plan", action="store_true",
                   help="print every point's processes and the run's time estimate, then stop (runs nothing)")
    p.add_argument("--sst", default=None,
                   help=f"SST train file (default {SST} if it exists, else 'synthetic': minicavs' own treebank)")
    p.add_argument("--ptb", default=None,
                   help=f"text of the LMs (default {PTB} if it exists, else 'synthetic')")
    p.add_argument("--trees", type=int, default=None, help="Tree-LSTM trees per point before the cap (1024)")
    p.add_argument("--fc-trees", type=int, default=None, help="Tree-FC trees per point before the cap (256)")
    p.add_argument("--sentences", type=int, default=None, help="Var-LSTM sentences per point before the cap (2000)")
    p.add_argument("--windows", type=int, default=None, help="Fixed-LSTM windows per point before the cap (512)")
    p.add_argument("--dynet-python", default=os.environ.get("MINICAVS_DYNET_PYTHON"),
                   help="a python with dynet38 (tools/setup_peers.sh; env MINICAVS_DYNET_PYTHON)")
    p.add_argument("--torch-python", default=os.environ.get("MINICAVS_TORCH_PYTHON"),
                   help="a python with torch (tools/setup_peers.sh; env MINICAVS_TORCH_PYTHON)")
    p.add_argument("--inference", action=argparse.BooleanOptionalAction, default=True,
                   help="also time forward-only passes")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                   help="minicavs' time split (one more instrumented epoch per point)")
    p.add_argument("--ablation", action=argparse.BooleanOptionalAction, default=True,
                   help="each engine switch's speedup over all off (Fig. 10)")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                   help="PNG plots (needs matplotlib: pip install 'minicavs[plot]')")
    p.add_argument("--sweeps", action=argparse.BooleanOptionalAction, default=True,
                   help="the Fig. 8/9a sweeps (--no-sweeps: only the ablation)")
    p.add_argument("--targets", action="store_true",
                   help="only the points the CPU speed targets need (minicavs and the batched peers), in "
                        "--repeats rounds of one timed epoch per system, systems alternating; prints and writes "
                        "targets.md: each target, the measured ratio, met or missed")
    p.add_argument("--as-user", action="store_true",
                   help="run the benchmark as a user's machine does: with every OPENBLAS_*, OMP_* and MKL_* "
                        "variable unset for this command alone (e.g. a forced OPENBLAS_CORETYPE; the per-core "
                        "runs still set one thread)")
    p.add_argument("--forced-kernel", action="store_true",
                   help="with --as-user: also time minicavs at the Tree-LSTM headline points (batch 64 at hidden "
                        "64, 128, 512; batch 1 at hidden 128) with the machine's OPENBLAS_*, OMP_* and MKL_* "
                        "variables as set (e.g. a forced older kernel), in the same rounds, alternating with the "
                        "user's runs, as the system \"minicavs (machine's BLAS variables)\"; each record names "
                        "its kernel, and headline.md has both columns")


def _mode_arguments(p: argparse.ArgumentParser) -> None:
    """The engine settings, and the modes that replace the sweeps (layout table, policies, ED-Batch)."""
    p.add_argument("--engine", nargs="+", default=[], metavar="KEY=VALUE",
                   help="minicavs' engine settings, as train.engine.KEY=VALUE in a config (any EngineOptions "
                        "field, e.g. fusion=false; the ablation keeps varying its own switches)")
    p.add_argument("--layout", action="store_true",
                   help="only the layout table (ED-Batch's Table 2): naive cells without and with the layout "
                        "pass, and fused, per cell: copies, time per batch, planning time (--layout-hidden, "
                        "--repeats)")
    p.add_argument("--layout-hidden", type=int, default=128, help="hidden size of the layout table's cells (128)")
    p.add_argument("--step-breakdown", type=int, nargs="?", const=512, default=None, metavar="HIDDEN",
                   help="instead of the sweeps: where a Tree-LSTM training step's time goes (hidden HIDDEN, default "
                        "512; batch 64, embed 128, Adam; SST or --sst; --trees, --repeats), per core with the "
                        "CPU's own BLAS kernels: products, fused kernels, row moves, optimizer and host work per "
                        "batch, and the products' GFLOP/s against numpy's at the same shapes; writes "
                        "step_breakdown.md/.json (minicavs.bench.step_breakdown)")
    p.add_argument("--policies", action="store_true",
                   help="instead of the sweeps: ED-Batch's batching policies on every bundled model (tasks per "
                        "batch of 64 for cavs/depth, agenda, greedy, fsm S1-S3 and the lower bound, FSM learning "
                        "time, scheduling time); writes policies.md/.json/.png")
    p.add_argument("--ed-batch", action="store_true",
                   help="instead of the sweeps: ED-Batch's headline comparison, every ED-Batch workload under each "
                        "policy against DyNet's autobatching (needs --dynet-python), training and inference, per "
                        "core and machine; prints the table beside the paper's ratios, writes ed_batch.md/.json "
                        "(--quick: three policies, one batch; --repeats: rounds, default 3, quick 2)")
    p.add_argument("--padding", action="store_true",
                   help="instead of the sweeps: the Var-LSTM as one static graph (foreach, each sentence run for "
                        "its own length) against the chain graph, each with shuffled and length-bucketed batches "
                        "(train.order), training time per real word on --ptb (--sentences, --repeats: alternating "
                        "epochs, medians); writes padding.md/.json")
    p.add_argument("--ed-batch-models", nargs="+", default=None, metavar="MODEL",
                   help="models for --ed-batch (default all eight)")
    p.add_argument("--policy-models", nargs="+", default=None,
                   help="models for --policies (default: every bundled model with a config, and the rows "
                        "tree_lstm_2type+outputs, lattice_lstm+outputs, lattice_gru+outputs: the same batches as "
                        "ED-Batch's operator graphs have them, with an output vertex per pushing vertex and a sum "
                        "per sample)")
    p.add_argument("--policy-batches", type=int, default=8, help="held-out batches counted per model (8)")
    p.add_argument("--policy-search", type=int, default=0, metavar="STATES",
                   help="with --policies: bracket each batch's optimum by A* over at most STATES expanded states "
                        "and a beam search (slow: minutes per model for 20000; default 0, off)")
    p.add_argument("--policy-throughput", action=argparse.BooleanOptionalAction, default=True,
                   help="with --policies: training throughput per policy at batch 64, hidden 256")
    p.add_argument("--policy-repeats", type=int, default=None, metavar="N",
                   help="with --policies: timed passes per policy for the throughput (alternating; the median "
                        "is reported; default 3, 2 with --quick)")


def _control_arguments(p: argparse.ArgumentParser) -> None:
    """``--control``'s: its rows and the base commit some of them compare with."""
    p.add_argument("--control", action="store_true",
                   help="instead of the sweeps: control flow's speed rows (minicavs.bench.control_flow: the foreach "
                        "Var-LSTM vs the chain graph on equal-length and on bucketed PTB sentences, a cond, a "
                        "foreach and a while_loop in F vs F without them, seq2seq training vs --base), each "
                        "system in a fresh process per round, alternating, per core and on the machine "
                        "(--repeats, default 3, quick 2), then the same rows' values on the emulated CUDA "
                        "device against the C runner's; writes control.md, summary.md, results.json")
    p.add_argument("--control-rows", nargs="+", default=None, metavar="ROW",
                   help="rows for --control (default: foreach_equal foreach_bucketed foreach_padded cond_in_f "
                        "foreach_in_f while_in_f seq2seq); also, this tree against --base alone: batch1_infer (the SST "
                        "Tree-LSTM, hidden 128, one tree at a time, --sst), batch1_train, batch64_train, "
                        "seq2seq_predict (greedy decoding)")
    p.add_argument("--base", default="a065f3c", metavar="COMMIT",
                   help="--control's rows against a base commit (seq2seq and the rows above): the commit, checked "
                        "out into a temporary git worktree and timed alternating with this tree, each in fresh "
                        "processes ('none': this tree alone)")


def _data_file(given: str | None, default: str, what: str, flag: str) -> str | None:
    if given == "synthetic" or (given is None and not os.path.isfile(default)):
        if given is None:
            print(f"{what}: {default} not found, using minicavs' synthetic data (pass {flag})")
        return None
    path = given or default
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: {path} (pass {flag} FILE or {flag} synthetic)")
    return path


def engine_settings(items) -> dict:
    """``--engine KEY=VALUE ...`` as EngineOptions fields: read and checked as ``train.engine.KEY=VALUE``
    overrides of a config are, so every field the engine gains is taken with its config's rules."""
    if not items:
        return {}
    from ..train.config import bundled_models_dir, load_config
    from ..train.trainer import engine_options
    keys = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--engine {item!r}: expected KEY=VALUE, e.g. fusion=false")
        keys.append(item.split("=", 1)[0].strip())
    try:
        cfg = load_config(bundled_models_dir() / "tree_lstm.yaml", [f"train.engine.{item}" for item in items])
        opts = engine_options(cfg["train"]["engine"])
    except ConfigError as e:
        raise ConfigError(f"--engine: {str(e).split(': ', 1)[-1]}") from None
    return {k: getattr(opts, k) for k in keys}


def _positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse a size flag of ``names`` (argparse's dests) set to zero or less, naming the flag."""
    for name in names:
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")


def settings(args: argparse.Namespace):
    """The suite's settings from the command line (defaults depend on ``--quick``)."""
    import shlex
    import sys
    from .suite import Settings
    _positive(args, "cap", "repeats", "trees", "fc_trees", "sentences", "windows")
    sizes = {k: getattr(args, k) for k in ("trees", "fc_trees", "sentences", "windows")}
    base = QUICK_DATA if args.quick else {}
    sizes = {k: v if v is not None else base.get(k, getattr(Data, k)) for k, v in sizes.items()}
    data = Data(sst=_data_file(args.sst, SST, "SST", "--sst") if "tree_lstm" in args.models else None,
                ptb=_data_file(args.ptb, PTB, "PTB text", "--ptb")
                if {"var_lstm", "fixed_lstm"} & set(args.models) else None, **sizes)
    return Settings(models=tuple(args.models), quick=args.quick, forced=_forced(args),
                    cap=args.cap or (QUICK_CAP if args.quick else FULL_CAP),
                    repeats=args.repeats or (2 if args.quick else 3), data=data, out=Path(args.out),
                    dynet_python=args.dynet_python, torch_python=args.torch_python, inference=args.inference,
                    breakdown=args.breakdown, ablation=args.ablation,
                    ablation_hidden=(128,) if args.quick else ABLATION_HIDDEN, sweeps=args.sweeps,
                    plots=args.plots, engine=engine_settings(args.engine), targets=args.targets,
                    points=tuple(args.points or ()),
                    command=shlex.join(["minicavs", "bench"] + sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "")


def _forced(args: argparse.Namespace) -> dict:
    """``--forced-kernel``'s variables: the machine's (:func:`machine_facts.machine_env`); {} without the flag,
    or, with a note, on a machine that sets none (its user's runs are the machine's)."""
    from . import machine_facts as machine
    if not args.forced_kernel:
        return {}
    try:
        forced = machine.machine_env()
    except ValueError as e:
        raise ConfigError(f"--forced-kernel: {e}") from None
    if not forced:
        print("--forced-kernel: this machine sets no OPENBLAS_*, OMP_* or MKL_* variable: a user's runs are its "
              "own, nothing more to time")
    return forced


def as_user(argv: list[str]) -> None:
    """Run ``minicavs bench`` again in this process with the BLAS variables unset (:func:`machine_facts.user_env`),
    since numpy reads them once, when it loads; returns only when none is set (nothing to unset)."""
    import sys
    from . import machine_facts as machine
    if not machine.blas_env():
        return
    print("--as-user: unset " + " ".join(machine.blas_env()), file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, "-m", "minicavs", "bench", *argv], machine.user_env())


def _ed_batch(args: argparse.Namespace) -> int:
    from .ed_batch import MODELS as ED_MODELS, run_ed_batch
    from .peers import missing
    unknown = set(args.ed_batch_models or ()) - set(ED_MODELS)
    if unknown:
        raise ConfigError(f"--ed-batch-models: unknown {sorted(unknown)}; known: {', '.join(ED_MODELS)}")
    _positive(args, "repeats")
    why = missing(args.dynet_python, "dynet")
    if why:
        raise ConfigError(f"--ed-batch compares with DyNet: {why}")
    print(run_ed_batch(args.ed_batch_models or ED_MODELS, args.dynet_python, Path(args.out), args.quick,
                       args.repeats or (2 if args.quick else 3)))
    return 0


def _step_breakdown(args: argparse.Namespace) -> int:
    from .step_breakdown import run_step_breakdown
    _positive(args, "step_breakdown", "trees", "repeats")
    trees = args.trees or (QUICK_DATA["trees"] if args.quick else Data.trees)
    data = Data(sst=_data_file(args.sst, SST, "SST", "--sst"), trees=trees)
    print(run_step_breakdown(args.step_breakdown, 64, data, args.repeats or 3, engine_settings(args.engine),
                             args.out))
    return 0


def _padding(args: argparse.Namespace) -> int:
    from .padding import run_padding
    _positive(args, "repeats", "sentences")
    sentences = args.sentences or (QUICK_DATA["sentences"] if args.quick else Data.sentences)
    text = _data_file(args.ptb, PTB, "PTB text", "--ptb")
    print(run_padding(Path(args.out), text, sentences, args.repeats or (2 if args.quick else 5)))
    return 0


def _control(args: argparse.Namespace) -> int:
    import shlex
    import sys
    from .control_flow import DEFAULT_ROWS, QUICK, ROWS, TREE_WORKLOADS, ControlRun, run_control
    _positive(args, "repeats")
    unknown = set(args.control_rows or ()) - set(ROWS)
    if unknown:
        raise ConfigError(f"--control-rows: unknown {sorted(unknown)}; known: {', '.join(ROWS)}")
    rows = tuple(args.control_rows or DEFAULT_ROWS)
    reads = {ROWS[n].workload for n in rows}
    text = _data_file(args.ptb, PTB, "PTB text", "--ptb") if "var_lstm" in reads else None
    sst = _data_file(args.sst, SST, "SST", "--sst") if reads & set(TREE_WORKLOADS) else None
    print(run_control(ControlRun(
        Path(args.out), rows, args.repeats or (2 if args.quick else 3), os.path.abspath(text) if text else None,
        None if args.base == "none" else args.base, QUICK if args.quick else {},
        shlex.join(["minicavs", "bench"] + sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "",
        sst=os.path.abspath(sst) if sst else None)))
    return 0


def run(args: argparse.Namespace) -> int:
    import sys
    modes = [f"--{m.replace('_', '-')}" for m in ("layout", "ed_batch", "padding", "control", "policies")
             if getattr(args, m)] + (["--step-breakdown"] if args.step_breakdown is not None else [])
    if args.forced_kernel and modes:
        raise ConfigError(f"--forced-kernel times the sweeps' Tree-LSTM points, not {modes[0]}")
    if args.as_user:
        if sys.argv[1:2] != ["bench"]:
            raise ConfigError("--as-user reruns the command line: use it from `minicavs bench`, or unset the "
                             "OPENBLAS_*, OMP_* and MKL_* variables before calling Python")
        as_user(sys.argv[2:])
    elif args.forced_kernel:
        raise ConfigError("--forced-kernel times the machine's BLAS variables beside a user's runs: add --as-user")
    if args.layout:
        from .layout_table import run_layout
        _positive(args, "layout_hidden")
        print(run_layout(Path(args.out), args.layout_hidden, 64, 2 if args.quick else 4,
                         args.repeats or (3 if args.quick else 7)))
        return 0
    if args.ed_batch:
        return _ed_batch(args)
    if args.step_breakdown is not None:
        return _step_breakdown(args)
    if args.padding:
        return _padding(args)
    if args.control:
        return _control(args)
    if args.policies:
        from .policies import OP_GRAPHS, WORKLOADS, run_policies
        _positive(args, "policy_batches", "policy_repeats")
        known = list(WORKLOADS) + list(OP_GRAPHS)
        unknown = set(args.policy_models or ()) - set(known)
        if unknown:
            raise ConfigError(f"--policy-models: unknown {sorted(unknown)}; known: {', '.join(known)}")
        if args.policy_search < 0:
            raise ConfigError(f"--policy-search must be >= 0, got {args.policy_search}")
        run_policies(args.policy_models or known, Path(args.out), batches=args.policy_batches,
                     search=args.policy_search, speed=args.policy_throughput, steps=2 if args.quick else 4,
                     repeats=args.policy_repeats or (2 if args.quick else 3))
        return 0
    from .suite import plan_text, run_points, run_suite
    s = settings(args)
    try:
        run_points(s)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.plan:
        print(plan_text(s))
        return 0
    run_suite(s)
    return 0
