"""The GPU check in two device calls: on a bare GPU machine with this checkout, its carried wheels (``.whl/``)
and data (``.gpu-data/``, both packed here by tools/gpu_pack.sh), install what is missing and run stages in
priority order, each in a process of its own under its own time cap, keeping what it wrote before the cap, so
that a call cut off early still brings back what matters most.

The first call (the default stages, ``BUDGET`` = 340 s in all, so a device ``timeout_s`` of 360 covers it,
the machine's start apart):

- ``loop`` (cap 30 s): a binary Tree-LSTM pass, float32 streaming and float64, issued by the C issuing loop
  through the driver and cuBLAS, before any stage whose fallback to the Python runner could hide that the loop
  did not run: it fails if any pass was issued from Python or anything warned (the loop's setup failing is a
  warning and a fallback), naming the pass and why;
- ``facts`` (cap 30 s): nvidia-smi, versions, CuPy's device, the two ceilings (a large device copy, a large
  matmul), and ROWOP's kernel at 64 x 10,000 float32 (the PTB softmax loss of a 64-row batch: µs a launch
  of the cross-entropy and of its gradient, the block-per-row kernel the loop launches against the one
  thread per row it replaced, each checked against numpy);
- ``equality`` (105 s): a few training steps of every bundled model on the device against the CPU, float64 and
  float32 first, then streaming and deterministic on, then a DAG summed by atomics run twice;
- ``tests`` (105 s): ``pytest -m gpu``, then the CUDA tests (tests/cuda, tests/engine/codegen/test_cuda.py,
  tests/engine/test_backend.py), pytest with plugin autoloading off and the plugins it needs named, so that a plugin
  of the machine's (pytest-benchmark warns under xdist) cannot turn ``filterwarnings = error`` against it;
- ``sanitize`` (45 s): one training step of the bundled tree_lstm under ``compute-sanitizer --tool memcheck``
  ("skipped: no compute-sanitizer" where the machine has none on PATH).

It ends by saying whether the second call is warranted (every equality case equal, every model and dtype
reached): ``bench`` (cap 240 s), the throughput points against PyTorch on the same GPU.

    bash tools/gpu_check.sh OUT                                  # first call: loop, facts, equality, tests, sanitize
    bash tools/gpu_check.sh OUT --stages bench                   # second call, only if the first says so
    python3 tools/gpu_check.py DEST --merge SRC [SRC ...]        # here: merge the calls' results, print the table

OUT gets one JSON per stage (``facts.json`` ...), ``results.json`` (every run in OUT merged: a run's stages
are added to what OUT already holds) and ``log.txt`` (every stage's output): at most 7 files, so all of them
come back from a device call. The table is printed last. Without CuPy or a CUDA device it exits with status 2
within seconds, naming what is missing. ``--emulate`` runs the stages on the CPU emulation of the CUDA device
(the one switch: tools/gpu_stages.py's ``project_device`` says which device that is): how the stage code is
tested without a GPU; its results say so and never count as GPU results.

Standard library only (plus the project, imported by the stages in their own processes).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("loop", "facts", "equality", "tests", "sanitize", "bench")      # the table's order
DEFAULT_STAGES = ("loop", "facts", "equality", "tests", "sanitize")          # the first call, in priority order
CAPS = {"loop": 30, "facts": 30, "equality": 105, "tests": 105, "sanitize": 45, "bench": 240}   # seconds
BUDGET = 340          # seconds for the whole command by default: the first call's device timeout_s is 360
DEVICE_TIMEOUT_S = 360   # what the device call of the first call is given (README): BUDGET must end before it
SETUP_S = 15          # seconds before the first stage: the CuPy probe, the wheels' install, the import check
KILL_GRACE = 5        # seconds a stage past its cap may take to die: SIGTERM, 3 s, SIGKILL, 2 s
RESERVE = 5           # seconds kept back from the budget for merging and the table
FORMAT = 1


# --- prerequisites ----------------------------------------------------------------------------------------

def missing_gpu() -> str | None:
    """What stops a GPU run (CuPy, a CUDA device), or None. Asked in a child process with a time limit, so
    that a broken driver cannot hang the check."""
    probe = ("import sys\ntry:\n    import cupy\nexcept Exception as e:\n"
             "    print('CuPy is missing: import cupy failed (%s: %s)' % (type(e).__name__, e)); sys.exit(3)\n"
             "try:\n    n = cupy.cuda.runtime.getDeviceCount()\nexcept Exception as e:\n"
             "    print('no CUDA device: CuPy cannot reach one (%s: %s)' % (type(e).__name__, e)); sys.exit(4)\n"
             "if n == 0:\n    print('no CUDA device: CuPy counts 0 devices'); sys.exit(4)\n")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=45,
                             env=child_env(None))
    except subprocess.TimeoutExpired:
        return "no CUDA device: asking CuPy for the device count did not return within 45 s"
    if out.returncode == 0:
        return None
    return (out.stdout.strip() or out.stderr.strip()[-500:] or f"the CuPy probe exited {out.returncode}")


def child_env(site: Path | None) -> dict:
    """The environment of every child: the carried wheels' folder and the checkout on PYTHONPATH (the
    project runs from the checkout, so the machine's CuPy is never replaced), output unbuffered."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    parts = ([str(site)] if site else []) + [str(ROOT)] + \
        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def install_wheels(wheels: Path, site: Path, log) -> str:
    """``pip install --no-index --no-deps --target SITE`` of the carried wheels (cffi, pycparser): what the
    machine lacks, never a replacement of what it has."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return f"no wheels in {wheels} (nothing installed)"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site)] + [str(w) for w in found]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    log(f"$ {' '.join(cmd)}\n{out.stdout}{out.stderr}")
    if out.returncode:
        return f"pip install of {len(found)} wheels failed (exit {out.returncode}): {out.stderr.strip()[-300:]}"
    return f"installed {', '.join(w.name.split('-')[0] for w in found)} into {site}"


# --- the stage runner -------------------------------------------------------------------------------------

def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data) -> None:
    """Atomically: a reader (the runner after a kill) sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def run_stage(name: str, cmd: list, out: Path, cap: float, env: dict, logfile) -> dict:
    """Run one stage's process (its own process group) for at most ``cap`` seconds (and ``KILL_GRACE`` to
    die); its result is what it last wrote to ``OUT/<name>.json`` (items so far), with the status the runner
    saw: ok, skipped (it ran and said why it measured nothing), failed (exit status), timeout (killed at the
    cap: the items before it are kept) or crashed (wrote nothing)."""
    path = out / f"{name}.json"
    if path.exists():
        path.unlink()
    logfile.write(f"\n===== stage {name} (cap {cap:.0f} s): {' '.join(cmd)}\n")
    logfile.flush()
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                            start_new_session=True)
    status = "ok"
    try:
        rc = proc.wait(timeout=max(cap, 1))
        if rc:
            status = "failed"
    except subprocess.TimeoutExpired:
        status, rc = "timeout", None
        for sig, grace in ((signal.SIGTERM, 3), (signal.SIGKILL, KILL_GRACE - 3)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    seconds = time.monotonic() - start
    result = read_json(path)
    if result is None:
        result = {"stage": name, "items": []}
        if status == "ok":
            status = "crashed"
    elif status == "ok" and result.get("skipped"):
        status = "skipped"
    result.update(stage=name, status=status, exit=rc, seconds=round(seconds, 1), cap_s=cap)
    logfile.write(f"===== stage {name}: {result['status']} after {seconds:.1f} s (exit {rc})\n")
    logfile.flush()
    write_json(path, result)
    return result


# --- merging ----------------------------------------------------------------------------------------------

def load_results(source: Path) -> dict:
    """A results.json (or a folder holding one); an empty result set when there is none."""
    path = source / "results.json" if source.is_dir() else source
    data = read_json(path) if path.exists() else None
    if data is None:
        return {"format": FORMAT, "runs": []}
    if data.get("format") != FORMAT or not isinstance(data.get("runs"), list):
        raise SystemExit(f"gpu_check: {path} is not a results file of format {FORMAT}")
    return data


def merge(*result_sets: dict) -> dict:
    """Every run of every set, once (by run id; a later copy of a run replaces an earlier one), oldest first."""
    runs: dict = {}
    for rs in result_sets:
        for run in rs.get("runs", []):
            runs[run["id"]] = run
    return {"format": FORMAT, "runs": sorted(runs.values(), key=lambda r: (r.get("started", ""), r["id"]))}


def latest(results: dict) -> dict:
    """stage -> (its result in the newest run that ran it, that run)."""
    out = {}
    for run in results["runs"]:
        for name, res in run.get("stages", {}).items():
            out[name] = (res, run)
    return out


# --- the table --------------------------------------------------------------------------------------------

def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def rowop_summary(rowop: dict | None) -> str:
    """The facts' ROWOP timing in a few words: µs a launch, block per row / one thread per row (before)."""
    if not rowop:
        return ""
    us = {(c["kernel"], c["fn"]): c["us"] for c in rowop.get("cases", [])}
    shape = "x".join(str(n) for n in rowop.get("shape", []))
    new_before = [f"{fmt(us.get(('new', fn)), 4)} (before {fmt(us.get(('before', fn)), 4)})" for fn in (1, 2)]
    return (f", rowop {shape} f32 µs: cross-entropy {new_before[0]}, gradient {new_before[1]}"
            + ("" if rowop.get("ok") else " NOT equal to numpy"))


def stage_summary(name: str, res: dict) -> str:
    items = res.get("items", [])
    if name == "facts":
        f = res.get("facts", {})
        return (f"{f.get('device', '?')}, driver {f.get('driver', '?')}, CUDA runtime {f.get('cuda_runtime', '?')}, "
                f"CuPy {f.get('cupy', '?')}, copy {fmt(f.get('copy_GBps'))} GB/s, "
                f"matmul f32 {fmt(f.get('matmul_f32_TFLOPs'))} / f64 {fmt(f.get('matmul_f64_TFLOPs'))} TFLOP/s"
                + rowop_summary(f.get("rowop")))
    if name == "loop":
        return loop_summary(items)
    if name == "tests":
        return "; ".join(f"{i.get('name', '?')}: {i.get('passed', 0)} passed, {i.get('failed', 0)} failed, "
                         f"{i.get('errors', 0)} errors, {i.get('skipped', 0)} skipped"
                         + (" (interrupted at its cap)" if i.get("interrupted") else "") for i in items) or "no tests ran"
    if name == "equality":
        bad = [i for i in items if not i.get("ok")]
        drift = sum(1 for i in items if i.get("params_ok") is False)
        unreached = len(res.get("planned", [])) - len(items)
        return (f"{len(items) - len(bad)}/{len(items)} equal" +
                (f" ({unreached} planned cases not reached)" if unreached > 0 else "") +
                (f" ({drift} with parameters beyond tolerance after all steps)" if drift else "") +
                (": not equal: " + ", ".join(i["case"] for i in bad[:6]) + (" ..." if len(bad) > 6 else "")
                 if bad else ""))
    if name == "sanitize":
        if res.get("skipped"):
            return f"skipped: {res['skipped']}"
        return "; ".join(f"memcheck: {i.get('errors', '?')} errors (exit {i.get('exit')}), "
                         + (f"step loss {fmt(i['step'].get('loss'))} on {i['step'].get('device')}" if i.get("step")
                            else "the step wrote no result")
                         + (f"; {i['note']}" if i.get("note") else "") for i in items) or "nothing ran"
    if name == "bench":
        return f"{len(items)} measurements"
    return f"{len(items)} items"


def loop_summary(items: list) -> str:
    """The loop stage's line: per case its counters, or the passes issued from Python and why."""
    bad = [i for i in items if not i.get("ok")]
    parts = [f"{len(items) - len(bad)}/{len(items)} cases issued every pass from C"]
    for i in items:
        if i.get("ok"):
            parts.append(f"{i['case']}: {i.get('launches')} launches, {i.get('products')} products, "
                         f"{i.get('events')} events")
        else:
            why = i.get("error") or "; ".join([f"{k} from Python ({v})" for k, v in i.get("from_python", {}).items()]
                                              + i.get("warnings", []))
            parts.append(f"NOT {i['case']}: {why[:300]}")
    return "; ".join(parts)


def bench_verdict(equality: dict | None) -> tuple[bool, str]:
    """Whether an equality result warrants the second call (the bench), and why: every case it compared
    equal, and every bundled model in every dtype compared at least once (a variant its cap cut off is
    said, but does not hold the bench back: the bench times the plain path)."""
    if equality is None:
        return False, "equality did not run"
    items = equality.get("items", [])
    if not items:
        return False, f"equality compared nothing (status {equality.get('status', '?')})"
    bad = [i for i in items if not i.get("ok")]
    if bad:
        return False, (f"{len(bad)} of {len(items)} equality cases not equal (first: {bad[0].get('case', '?')}): "
                       f"fix those first")
    planned = equality.get("planned", [])
    if not planned:
        return False, "equality recorded no plan of its cases: what it did not reach is unknown"
    compared = {f"{i.get('model')} {i.get('dtype')}" for i in items}
    missing = sorted({f"{c['model']} {c['dtype']}" for c in planned} - compared)
    if missing:
        return False, f"equality stopped before comparing {', '.join(missing)}"
    unreached = len(planned) - len(items)
    return True, (f"all {len(items)} equality cases equal" +
                  (f" ({unreached} variant cases not reached before the cap)" if unreached > 0 else ""))


BENCH_HEAD = ["point", "system", "train/s", "infer/s", "minicavs/peer", "(infer)", "2 streams/1", "launches/batch",
              "GPU busy", "TFLOP/s", "note"]


def bench_rows(res: dict) -> list[list[str]]:
    """One row per measurement: rates (medians), minicavs/peer (training, inference) on the peer's row, two
    streams over one, launches per training batch (generated kernels / every kernel CUPTI saw), the GPU's
    busy share of a step's wall time, useful matmul TFLOP/s in training."""
    rows = []
    for i in res.get("items", []):
        if i.get("error"):
            rows.append([i.get("point", "?"), i.get("system", "?")] + ["-"] * (len(BENCH_HEAD) - 3)
                        + ["error: " + str(i["error"])[:90]])
            continue
        launches = fmt(i.get("launches_per_batch"))
        if i.get("kernels_per_batch") is not None:
            launches += f" / {fmt(i['kernels_per_batch'])}"
        busy = i.get("gpu_busy_s_per_step"), i.get("wall_s_per_step_profiled")
        rows.append([i["point"], i["system"], fmt(i.get("train")), fmt(i.get("infer")), fmt(i.get("ratio_train")),
                     fmt(i.get("ratio_infer")), fmt(i.get("two_vs_one_stream")), launches,
                     f"{100 * busy[0] / busy[1]:.0f}%" if busy[0] is not None and busy[1] else "-",
                     fmt(i.get("train_TFLOPs")), i.get("note", "") or i.get("profile", "")])
    return rows


def table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(r[k])) for r in rows + [head]) for k in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def render(results: dict) -> str:
    """The short table printed last: per stage its newest result, then the benchmark's rows."""
    lat = latest(results)
    rows = []
    for name in STAGES:
        if name in lat:
            res, run = lat[name]
            mode = " EMULATED" if run.get("emulated") else ""
            rows.append([name, res.get("status", "?") + mode, fmt(res.get("seconds")), run.get("commit", "?")[:10],
                         stage_summary(name, res)])
    text = table(rows, ["stage", "status", "s", "commit", "result"]) if rows else "no results"
    if "bench" in lat and lat["bench"][0].get("items"):
        text += "\n\n" + table(bench_rows(lat["bench"][0]), BENCH_HEAD)
    return text + f"\n\n{len(results['runs'])} run(s) merged"


# --- the command ------------------------------------------------------------------------------------------

def commit() -> str:
    """The checkout's commit: git where the .git travelled, else the file tools/gpu_pack.sh wrote."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty", "--abbrev=40"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    stamp = ROOT / ".gpu-data" / "COMMIT"
    return stamp.read_text().strip() + " (packed)" if stamp.exists() else "unknown"


def stage_command(name: str, out: Path, cap: float, args: argparse.Namespace) -> list:
    """The command line of stage ``name``'s process: tools/gpu_stages.py, told its cap."""
    return ([sys.executable, str(Path(__file__).with_name("gpu_stages.py")), name, str(out / f"{name}.json"),
             "--data", args.data, "--cap", f"{cap:.0f}"]
            + (["--quick"] if args.quick else []) + (["--emulate"] if args.emulate else []))


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (created; results already there are merged with this run's)")
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                   help=f"comma-separated, run in this order (known: {', '.join(STAGES)})")
    p.add_argument("--cap", action="append", default=[], metavar="STAGE=SECONDS",
                   help=f"a stage's time cap (defaults: {', '.join(f'{k}={v}' for k, v in CAPS.items())})")
    p.add_argument("--budget", type=float, default=BUDGET,
                   help="seconds for the whole command: stage caps shrink so that it ends in time (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer cases and points (a smoke run)")
    p.add_argument("--emulate", action="store_true",
                   help="no GPU: the stages on the CPU emulation of the CUDA device (tests the stage code)")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="carried wheels (default: .whl of the checkout)")
    p.add_argument("--data", default=str(ROOT / ".gpu-data"), help="carried data (default: .gpu-data)")
    p.add_argument("--site", default="/tmp/minicavs-site", help="where the wheels are installed")
    p.add_argument("--merge", nargs="+", metavar="SRC", default=None,
                   help="merge the results of SRC folders or results.json files into OUT and print the table; "
                        "runs nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    if args.merge is not None:
        out.mkdir(parents=True, exist_ok=True)
        merged = merge(load_results(out), *(load_results(Path(s)) for s in args.merge))
        write_json(out / "results.json", merged)
        print(render(merged))
        return 0
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        print(f"gpu_check: unknown stage(s) {unknown or args.stages!r}; known: {', '.join(STAGES)}", file=sys.stderr)
        return 2
    caps = dict(CAPS)
    for item in args.cap:
        name, _, sec = item.partition("=")
        if name not in STAGES or not sec.replace(".", "", 1).isdigit():
            print(f"gpu_check: --cap {item!r}: expected STAGE=SECONDS with STAGE one of {', '.join(STAGES)}",
                  file=sys.stderr)
            return 2
        caps[name] = float(sec)
    started = time.monotonic()
    if not args.emulate:
        why = missing_gpu()
        if why:
            print(f"gpu_check: cannot run on a GPU: {why}. Run it on a machine with CuPy (cupy-cuda13x) and a "
                  f"CUDA device (see docs/gpu.md), or pass --emulate to test the stage code on the CPU.",
                  file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    run = {"id": uuid.uuid4().hex[:12], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": commit(), "argv": sys.argv[1:] if argv is None else list(argv), "emulated": args.emulate,
           "quick": args.quick, "stages": {}}
    with open(out / "log.txt", "a") as logfile:
        def log(text: str) -> None:
            logfile.write(text + "\n")
            logfile.flush()
        log(f"\n##### gpu_check run {run['id']} at {run['started']}, commit {run['commit']}, stages {stages}")
        site = Path(args.site)
        if not args.emulate:
            run["install"] = install_wheels(Path(args.wheels), site, log)
            print(f"gpu_check: {run['install']}", flush=True)
        env = child_env(site if site.is_dir() else None)
        if not args.emulate:
            probe = subprocess.run([sys.executable, "-c", "import cffi, yaml, numpy"], env=env, capture_output=True,
                                   text=True, timeout=60)
            if probe.returncode:   # the C kernels (the CPU reference) need cffi: say so first, then go on
                run["install"] += f"; WARNING: {probe.stderr.strip().splitlines()[-1]} (carry .whl: tools/gpu_pack.sh)"
                print(f"gpu_check: {run['install']}", flush=True)
        for name in stages:
            left = args.budget - (time.monotonic() - started) - RESERVE - KILL_GRACE
            cap = min(caps[name], left)
            if cap < min(5, caps[name]):       # under 5 s left (or under the cap asked for, if smaller)
                run["stages"][name] = {"stage": name, "status": "not run", "items": [],
                                       "note": f"the budget of {args.budget:.0f} s was spent"}
                continue
            print(f"gpu_check: stage {name} (cap {cap:.0f} s) ...", flush=True)
            res = run_stage(name, stage_command(name, out, cap, args), out, cap, env, logfile)
            run["stages"][name] = res
            print(f"gpu_check: stage {name}: {res['status']} in {res['seconds']} s", flush=True)
            merged = merge(load_results(out), {"runs": [run]})    # after every stage: a later kill loses nothing
            write_json(out / "results.json", merged)
        if "equality" in stages and "bench" not in stages:
            warranted, why = bench_verdict(run["stages"].get("equality"))
            run["bench_warranted"] = {"warranted": warranted, "why": why}
    merged = merge(load_results(out), {"runs": [run]})
    write_json(out / "results.json", merged)
    print()
    print(render(merged))
    if "bench_warranted" in run:
        print(f"\ngpu_check: the bench call is {'WARRANTED' if warranted else 'NOT warranted'}: {why}"
              + (" (EMULATED: not a GPU result)" if args.emulate else "")
              + (f". Second call: bash tools/gpu_check.sh OUT --stages bench" if warranted else ""), flush=True)
    bad = [n for n, r in run["stages"].items() if r.get("status") not in ("ok", "skipped") or r.get("problems")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
