"""The stages of tools/gpu_check.py (loop, facts, equality, tests, sanitize, bench), each run by it in a process
of its own, and the one training step the sanitize stage runs under compute-sanitizer:

    python tools/gpu_stages.py STAGE OUT.json [--data DIR] [--cap SECONDS] [--quick] [--emulate]
    python tools/gpu_stages.py step OUT.json [--emulate]

A stage appends one item per measurement to OUT.json, rewritten atomically after each, so that what it
measured before being stopped at its cap is kept. It exits 0 when it ran to its end, whatever it found
(failing tests, unequal results, sanitizer errors: ``problems`` counts them); an exception that escapes is a
failed stage. A stage that measures nothing for a reason it can name (no compute-sanitizer) says so in
``skipped``.

Everything that touches the project goes through the section "the project's API" below (Trainer, config
overrides, the device's launcher and synchronize), so that an engine refactor is adapted in one place; and
``--emulate`` is the one switch between the GPU and the CPU's stand-in for it (``project_device``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

from gpu_check import read_json, write_json   # tools/ is this script's directory

ROOT = Path(__file__).resolve().parent.parent
TOL = {"float32": 1e-5, "float64": 1e-10}    # DESIGN.md: max|a - b| <= tol * max(1, max|ref|)


class Recorder:
    """The stage's JSON: ``items`` plus stage-level fields, written atomically after every change."""

    def __init__(self, path: Path, stage: str, **fields):
        self.path = path
        self.data = {"stage": stage, "items": [], "problems": 0, **fields}
        self.write()

    def add(self, item: dict, problem: bool = False) -> None:
        self.data["items"].append(item)
        self.data["problems"] += bool(problem)
        self.write()

    def set(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        write_json(self.path, self.data)


def say(*parts) -> None:
    print(*parts, flush=True)


# --- the project's API, in one place ------------------------------------------------------------------------
# (where the engine or the device moves, adapt these functions, nothing else)

_EMULATION_DIR = None


def use_standin() -> None:
    """``--emulate``: ``train.device: cuda`` (and ``Cuda()``) is the emulated device in this process, the
    generated kernels on the CPU over the device stand-in's arrays, installed as the test suite installs it
    (tests/conftest.py). Idempotent."""
    global _EMULATION_DIR
    from minicavs.cuda import kernels
    from minicavs.cuda.emulation import Launcher
    if getattr(kernels.default_launcher, "standin", False):
        return
    _EMULATION_DIR = _EMULATION_DIR or tempfile.mkdtemp(prefix="gpu-check-emu-")
    launcher = Launcher(_EMULATION_DIR)

    def default_launcher():
        return launcher
    default_launcher.standin = True
    kernels.default_launcher = default_launcher


def project_device(kind: str, deterministic: bool = False):
    """A device object: ``cuda`` (CuPy), ``emulated`` (the CUDA device over the stand-in), ``cpu``."""
    from minicavs.cpu import CPU
    from minicavs.cuda import Cuda
    if kind == "cpu":
        return CPU
    if kind == "emulated":
        use_standin()
    else:
        from minicavs import cuda
        cuda.require()
    return Cuda(deterministic=deterministic)


def device_overrides(kind: str, deterministic: bool = False, streaming: bool = False) -> list[str]:
    """Config overrides that put a trainer on ``kind`` (``emulated``: ``train.device=cuda`` on the stand-in)."""
    if kind == "emulated":
        use_standin()
    return [f"train.device={'cpu' if kind == 'cpu' else 'cuda'}", f"train.deterministic={str(deterministic).lower()}",
            f"train.engine.streaming={str(streaming).lower()}"]


def make_trainer(config: str, overrides: list, kind: str, deterministic: bool = False, streaming: bool = False):
    from minicavs.train.config import REPO_ROOT
    from minicavs.train.trainer import Trainer
    path = Path(config) if Path(config).is_absolute() else REPO_ROOT / "models" / config
    return Trainer(path, list(overrides) + device_overrides(kind, deterministic, streaming),
                   run_dir=tempfile.mkdtemp(prefix="gpu-check-run-"))


def train_step(t, samples):
    """Forward, backward, update; the Result (loss as a host float)."""
    res = t.loss_and_grads(samples)
    t.optimizer.step(res.grads, loss=res.loss)
    res.loss = t.optimizer.last_loss   # (read by the step's one device-to-host copy)
    return res


def infer_step(t, samples):
    graphs, feeds = t.task.batch(samples)
    return t.model.infer(graphs, feeds, t.params, t.context(training=False))


def synchronize(t) -> None:
    t.model.device.synchronize()


def set_streaming(t, on: bool) -> None:
    t.model.options = replace(t.model.options, streaming=on)


def host(a):
    """A numpy float64 copy of a parameter value or gradient (dense), wherever it lives (a copy: parameters
    are updated in place)."""
    import numpy as np
    from minicavs.engine.backend import to_host
    if hasattr(a, "to_dense"):
        a = a.to_dense()
    return np.array(to_host(a), dtype=np.float64, copy=True)


def params_of(t) -> dict:
    return {name: host(p.value) for name, p in t.params.items()}


class CountingLauncher:
    """Wraps a device's launcher: counts the generated kernels launched through it from Python (fused groups,
    row kernels, the optimizer's); everything else (what kind of launcher it is) is the inner one's."""

    def __init__(self, inner):
        self.inner, self.xp, self.count = inner, inner.xp, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def generated_launches(t, counter: CountingLauncher | None) -> int | None:
    """Generated kernels launched on ``t``'s device: through its launcher from Python, and by the C loop that
    issues a pass (cuda/issue.py's counters)."""
    if counter is None:
        return None
    from minicavs.cuda import issue
    return counter.count + int(issue.stats(t.model.device)[0])


def count_launches(t) -> CountingLauncher | None:
    """Install a counter on ``t``'s device before its first step (kernels keep the launcher they are built
    with); None on a device without generated kernels (the CPU)."""
    dev = t.model.device
    if not hasattr(dev, "launcher"):
        return None
    if not isinstance(dev.launcher, CountingLauncher):
        dev.launcher = CountingLauncher(dev.launcher)
    return dev.launcher


def dag_case(dtype: str, hidden: int, seed: int = 7):
    """A child-sum Tree-LSTM over random DAGs (vertices with several parents: their gradient rows are
    summed by atomicAdd, or by the sorted segment sum when deterministic): tests/cells.py's model."""
    import numpy as np
    sys.path.insert(0, str(ROOT))
    from tests import cells
    from tests.engine.test_alg1 import random_dag
    rng = np.random.default_rng(seed)
    case = cells.child_sum_tree_lstm(rng, arity=3, H=hidden, D=16, C=5, dtype=dtype)
    graphs = [random_dag(rng, 120, 3) for _ in range(8)]
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    return case, graphs, feeds


def dag_run(case, graphs, feeds, kind: str, deterministic: bool):
    from minicavs.engine.executor import RunContext
    dev = project_device(kind, deterministic)
    case.model.device = dev
    res = case.model.forward_backward(graphs, feeds, {k: dev.asarray(v) for k, v in case.params.items()},
                                      RunContext())
    return float(res.loss), {k: host(g) for k, g in res.grads.items()}


# --- helpers -----------------------------------------------------------------------------------------------

def rel_err(got, want) -> float:
    """max|got - want| / max(1, max|want|) (DESIGN.md's scale)."""
    import numpy as np
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def worst(got: dict, want: dict) -> tuple[float, str]:
    if set(got) != set(want):
        return float("inf"), f"names differ: {sorted(set(got) ^ set(want))}"
    errs = {k: rel_err(got[k], want[k]) for k in want}
    k = max(errs, key=errs.get) if errs else ""
    return (errs[k] if errs else 0.0), k


def median(xs):
    return float(statistics.median(xs)) if xs else None


def data_file(data_dir: Path, rel: str) -> str | None:
    path = data_dir / rel
    return str(path) if path.is_file() else None


# --- the facts stage ----------------------------------------------------------------------------------------

def run_text(cmd: list, timeout: float = 20) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (out.stdout + out.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({cmd[0]}: {e})"


def versions() -> dict:
    import importlib
    out = {"python": platform.python_version()}
    for name in ("numpy", "cupy", "torch", "cffi", "pycparser", "yaml", "pytest", "hypothesis"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:   # absent, or broken on import: say which
            out[name] = f"missing ({type(e).__name__})"
    return out


def event_times(cupy, fn, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` by CUDA events on the current stream, after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return times


def copy_rate(cupy, n: int = 1 << 28) -> float:
    """Bytes per second (read + written) of a device-to-device copy of ``n`` float32 (1 GiB)."""
    src, dst = cupy.ones(n, cupy.float32), cupy.empty(n, cupy.float32)
    seconds = median(event_times(cupy, lambda: dst.__setitem__(Ellipsis, src), 10))
    return 2 * src.nbytes / seconds


def matmul_rate(cupy, dtype, m: int = 8192) -> float:
    """FLOP/s of an m x m x m cuBLAS matmul of random values (never zeros) in ``dtype``."""
    a = cupy.random.standard_normal((m, m), dtype=cupy.float64).astype(dtype)
    b = cupy.random.standard_normal((m, m), dtype=cupy.float64).astype(dtype)
    return 2 * m ** 3 / median(event_times(cupy, lambda: cupy.matmul(a, b), 5))


def stage_facts(rec: Recorder, args) -> None:
    facts = {"versions": versions(), "hostname": platform.node(), "cpus": os.cpu_count()}
    rec.set(facts=facts)
    smi = run_text(["nvidia-smi"])
    say(smi)
    q = run_text(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,"
                  "power.limit,pstate,temperature.gpu,persistence_mode,mig.mode.current", "--format=csv,noheader"])
    facts["nvidia_smi"] = q
    facts["nvcc"] = run_text(["nvcc", "--version"]).splitlines()[-1:] or ["?"]
    facts["gxx"] = run_text(["g++", "--version"]).splitlines()[:1]   # the CUDA emulation's compiler
    facts["cc"] = run_text(["cc", "--version"]).splitlines()[:1]      # the C kernels' (the CPU reference)
    if args.emulate:
        import numpy as np
        facts["device"] = "EMULATED (CPU)"
        a = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
        start = time.perf_counter()
        a @ a
        facts["matmul_f32_TFLOPs"] = 2 * 512 ** 3 / (time.perf_counter() - start) / 1e12
        rec.set(facts=facts)
        facts["rowop"] = rowop_facts(emulate=True)
        rec.set(facts=facts)
        return
    import cupy
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    facts.update(device=name, driver=q.split(",")[1].strip() if q.count(",") > 2 else "?",
                 cuda_runtime=rt.runtimeGetVersion(), cuda_driver=rt.driverGetVersion(), cupy=cupy.__version__,
                 sms=props.get("multiProcessorCount"), memory_GiB=round(props.get("totalGlobalMem", 0) / 2 ** 30, 1),
                 compute_capability=f"{props.get('major')}.{props.get('minor')}", l2_MiB=props.get("l2CacheSize", 0) / 2 ** 20,
                 cupy_tf32=os.environ.get("CUPY_TF32", "0"))
    from minicavs import cuda as mcuda
    facts["minicavs_cuda_available"] = mcuda.available()
    rec.set(facts=facts)
    facts["copy_GBps"] = copy_rate(cupy) / 1e9
    rec.set(facts=facts)
    facts["matmul_f32_TFLOPs"] = matmul_rate(cupy, cupy.float32) / 1e12
    rec.set(facts=facts)
    facts["matmul_f64_TFLOPs"] = matmul_rate(cupy, cupy.float64) / 1e12
    rec.set(facts=facts)
    cupy.get_default_memory_pool().free_all_blocks()
    facts["rowop"] = rowop_facts(emulate=False)
    say(json.dumps(facts["rowop"], default=str)[:1500])
    rec.set(facts=facts)


# --- the rowop kernel (in the facts stage) ------------------------------------------------------------------

# ROWOP's kernel as d53128a had it (one thread per row over all its columns, 256-thread blocks over the rows),
# kept only as the "before" of the timing below; the loop launches codegen/issue_kernels.py's rowop
BASELINE_ROWOP = r"""
extern "C" __global__ void rowop_thread_per_row(long fn, long rows, long cols, const float *__restrict__ src,
                                                long lds, const float *__restrict__ g, long ldg,
                                                const long *__restrict__ lab, float *__restrict__ dst, long ldd)
{
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < rows; i += (long)blockDim.x * gridDim.x) {
        const float *s = src + i * lds;
        float *d = dst + i * ldd;
        const long y = lab[i];
        float mx = s[0], sum = 0;
        for (long j = 1; j < cols; j++) mx = s[j] > mx ? s[j] : mx;
        for (long j = 0; j < cols; j++) sum += exp(s[j] - mx);
        const float lse = mx + log(sum);
        if (fn == 1) { d[0] = lse - s[y]; continue; }
        const float scale = g[i * ldg];
        for (long j = 0; j < cols; j++) d[j] = exp(s[j] - lse) * scale;
        d[y] -= scale;
    }
}
"""


def rowop_want(fn: int, x, labels, g):
    """numpy's cross-entropy (fn 1) or its gradient x g (fn 2) of each row, float64."""
    import numpy as np
    x = x.astype(np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    rows = np.arange(len(x))
    if fn == 1:
        return (lse - x[rows, labels])[:, None]
    grad = np.exp(x - lse[:, None])
    grad[rows, labels] -= 1
    return grad * g[:, None].astype(np.float64)


def rowop_case(dev, kernel: str, fn: int, x, labels, g, emulate: bool) -> dict:
    """One kernel's µs a launch (CUDA events after a warm-up; the wall clock on the emulation) and its
    largest relative error against numpy: ``new`` (the loop's kernel and geometry) or ``before``."""
    import numpy as np
    from minicavs.cuda import issue
    from minicavs.engine.codegen.cuda import MAX_BLOCKS
    from minicavs.engine.codegen.issue_kernels import issue_kernels
    rows, cols = x.shape
    dx, dl, dg = dev.asarray(x), dev.asarray(labels), dev.asarray(g)
    out = dev.xp.zeros((rows, cols if fn == 2 else 1), np.float32)
    if kernel == "new":
        geometry = (min(rows, MAX_BLOCKS), int(issue.library()[1].mc_rowop_threads(cols)))
        source, name, args = issue_kernels("float"), "rowop_float", \
            (fn, rows, cols, dx, cols, dg, 1, dl, dx, 0, out, out.shape[1])
    else:
        geometry = (-(-rows // 256), 256)
        source, name, args = BASELINE_ROWOP, "rowop_thread_per_row", (fn, rows, cols, dx, cols, dg, 1, dl, out,
                                                                      out.shape[1])
    launch = lambda: dev.launcher(source, name, geometry[0], geometry[1], args)
    if emulate:
        launch()
        start = time.perf_counter()
        launch()
        us = [(time.perf_counter() - start) * 1e6]
    else:
        import cupy
        us = [s * 1e6 for s in event_times(cupy, launch, 20, warmup=3)]
    want = rowop_want(fn, x, labels, g)
    err = float(np.abs(host(out) - want).max() / max(1.0, np.abs(want).max()))
    return {"kernel": kernel, "fn": fn, "grid": geometry[0], "block": geometry[1], "us": median(us),
            "rel_err": err, "ok": err <= TOL["float32"]}


def rowop_facts(emulate: bool) -> dict:
    """ROWOP at 64 x 10,000 float32 (a 64-row batch of the PTB vocabulary's softmax loss; 4 x 1,000 on the
    emulation): the cross-entropy and its gradient, the block-per-row kernel against the one thread per row of
    before."""
    import numpy as np
    rows, cols = (4, 1000) if emulate else (64, 10_000)
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((rows, cols))).astype(np.float32)
    labels, g = rng.integers(0, cols, rows), rng.standard_normal(rows).astype(np.float32)
    dev = project_device("emulated" if emulate else "cuda")
    cases = [rowop_case(dev, kernel, fn, x, labels, g, emulate) for fn in (1, 2) for kernel in ("new", "before")]
    return {"shape": [rows, cols], "dtype": "float32", "emulated": emulate, "cases": cases,
            "ok": all(c["ok"] for c in cases),
            "speedup_grad": cases[3]["us"] / cases[2]["us"] if cases[2]["us"] else None}


# --- the loop stage -----------------------------------------------------------------------------------------

# (dtype, streaming) of a binary Tree-LSTM pass (tests/cells.py): both dtypes' loops, both streams
LOOP_CASES = (("float32", True), ("float64", False))


def loop_case(dtype: str, streaming: bool, kind: str) -> dict:
    """One forward and backward pass of a binary Tree-LSTM on ``kind``: for each pass whether the C issuing
    loop issued it (else why the Python runner did), the loop's counters, every warning raised (the loop's
    setup failing on a GPU is a warning, then a fallback to Python)."""
    import warnings
    import numpy as np
    from minicavs.cuda import issue
    from minicavs.engine.compile import EngineOptions
    from minicavs.engine.executor import RunContext
    from minicavs.runtime.inputs import InputGraph
    sys.path.insert(0, str(ROOT))
    from tests import cells
    rng = np.random.default_rng(0)
    case = cells.binary_tree_lstm(rng, H=16, D=8, dtype=dtype)
    graphs = [InputGraph([[1, 2], [3, 4], [], [], []]), InputGraph([[1, 2], [], []])] * 4
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    dev = project_device(kind)
    case.model.device = dev
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = case.model.forward_backward(graphs, feeds, {k: dev.asarray(v) for k, v in case.params.items()},
                                          RunContext(), options=EngineOptions(streaming=streaming))
        loss = float(host(res.loss))
    declined = {f"{key} {which}": program.declined
                for key, state in res.states.items()
                for which, program in (("forward", state.program), ("backward", state.backward_program))
                if program is not None}
    counters = dict(zip(issue.STATS, issue.stats(dev).tolist()))
    return {"case": f"binary_tree_lstm {dtype}" + (" streaming" if streaming else ""), "loss": loss,
            "passes": len(declined), "issued_from_c": bool(declined) and all(v is None for v in declined.values()),
            "from_python": {k: v for k, v in declined.items() if v is not None}, **counters,
            "warnings": [f"{w.category.__name__}: {w.message}"[:400] for w in caught],
            "seconds": round(time.monotonic() - start, 1)}


def stage_loop(rec: Recorder, args) -> int:
    """The C issuing loop on this device, first, before any stage whose fallback could hide it: fails (exit
    1) if any pass was issued from Python or anything warned."""
    kind = "emulated" if args.emulate else "cuda"
    for dtype, streaming in LOOP_CASES:
        try:
            item = loop_case(dtype, streaming, kind)
        except Exception as e:
            traceback.print_exc()
            item = {"case": f"binary_tree_lstm {dtype}" + (" streaming" if streaming else ""), "issued_from_c": False,
                    "error": f"{type(e).__name__}: {e}"[:600]}
        item["ok"] = item["issued_from_c"] and not item.get("warnings")
        say(json.dumps(item, default=str)[:800])
        rec.add(item, problem=not item["ok"])
    return 1 if rec.data["problems"] else 0


# --- the tests stage ----------------------------------------------------------------------------------------

def parse_junit(path: Path) -> dict:
    """Counts and failures (test id, message, the end of the report) of a pytest junit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": {}}
    for suite in suites:
        for case in suite.iter("testcase"):
            if not case.get("name"):     # the test an interrupt stopped: pytest writes it without a name
                continue
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            bad = [c for c in case if c.tag in ("failure", "error")]
            skip = [c for c in case if c.tag == "skipped"]
            if bad:
                kind = "failed" if bad[0].tag == "failure" else "errors"
                out[kind] += 1
                out["failures"].append({"test": test, "kind": bad[0].tag,
                                        "message": (bad[0].get("message") or "")[:400],
                                        "report": (bad[0].text or "")[-1500:]})
            elif skip:
                out["skipped"] += 1
                reason = (skip[0].get("message") or "")[:120]
                out["skip_reasons"][reason] = out["skip_reasons"].get(reason, 0) + 1
            else:
                out["passed"] += 1
    return out


INTERRUPT_GRACE = 10    # seconds pytest has, after SIGINT at its deadline, to write its report and stop


TEST_PLUGINS = ("xdist.plugin", "_hypothesis_pytestplugin")   # the modules of the plugins the project's tests use


def pytest_plugins() -> list[str]:
    """``-p`` options of the plugins the project's tests use (pytest-xdist, hypothesis), those installed, for
    pytest run with plugin autoloading off; ``no:cacheprovider`` writes nothing into the checkout. Each is
    named by its pytest11 entry point (``xdist``, ``hypothesispytest``: what ``-p`` takes since pytest 4.4),
    so it is registered under the name autoloading would give it: the command means the same either way,
    where a module name (``xdist.plugin``) would have the plugin registered twice with autoloading on."""
    import importlib.metadata
    installed = {ep.value: ep.name for ep in importlib.metadata.entry_points(group="pytest11")}
    return ["-p", "no:cacheprovider"] + [a for module in TEST_PLUGINS if module in installed
                                         for a in ("-p", installed[module])]


def has_xdist() -> bool:
    import importlib.metadata
    return any(ep.value == "xdist.plugin" for ep in importlib.metadata.entry_points(group="pytest11"))


def pytest_command(junit: Path, pytest_args: list) -> list:
    """The tests stage's pytest: the project's own configuration (setup.cfg, ``filterwarnings = error``)
    wherever the selection lies, short tracebacks (the junit report keeps each failure's), a junit report."""
    return ([sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-c", str(ROOT / "setup.cfg"),
             "--rootdir", str(ROOT)] + pytest_plugins() + [f"--junitxml={junit}"] + list(pytest_args))


def pytest_env() -> dict:
    """The environment of the tests stage's pytest: plugin autoloading off, so that a plugin installed on
    the machine (pytest-benchmark, which warns under xdist: an INTERNALERROR under ``filterwarnings =
    error``) is never loaded; only those of :func:`pytest_plugins` are."""
    return dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


def run_pytest(name: str, pytest_args: list, seconds: float, workdir: Path) -> dict:
    """pytest with a junit XML report; at ``seconds`` it gets SIGINT, so that it still writes the report of
    the tests run so far (then SIGKILL if it has not stopped ``INTERRUPT_GRACE`` seconds later)."""
    junit = workdir / f"junit-{len(list(workdir.glob('junit-*')))}.xml"
    cmd = pytest_command(junit, pytest_args)
    say(f"$ PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {' '.join(cmd)}  (at most {seconds:.0f} s)")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=pytest_env())
    interrupted = False
    try:
        rc = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        interrupted = True
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=INTERRUPT_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    item = {"name": name, "command": "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 " + " ".join(cmd[1:]), "exit": rc,
            "seconds": round(time.monotonic() - start, 1), "interrupted": interrupted}
    if junit.exists():
        item.update(parse_junit(junit))
    else:
        item["error"] = "pytest wrote no junit report"
    return item


def stage_tests(rec: Recorder, args) -> None:
    """``pytest -m gpu`` (the tests that need the device), then the CUDA tests not marked gpu (the emulated
    launcher's, NVRTC's compile check) spread over workers; each run gets a share of what is left of the cap,
    less the time pytest needs to stop and write its report."""
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-junit-"))
    workers = max(2, min(8, (os.cpu_count() or 2) // 2))
    parallel = ["-n", str(workers)] if has_xdist() else []
    runs = [("pytest -m gpu", ["-m", "gpu"], 0.5),
            ("CUDA tests", parallel + ["-m", "not gpu", "tests/cuda", "tests/engine/codegen/test_cuda.py",
                                       "tests/engine/test_backend.py"], 1.0)]
    if args.pytest_args:        # the runner's own tests: a given selection instead
        runs = [("selected tests", args.pytest_args.split(), 1.0)]
    deadline = time.monotonic() + args.cap - 3
    for name, pytest_args, share in runs:
        left = deadline - time.monotonic() - INTERRUPT_GRACE
        item = run_pytest(name, pytest_args, max(5.0, left * share), workdir)
        bad = item.get("failed", 0) + item.get("errors", 0) or item.get("exit") not in (0, 5) or item["interrupted"]
        if name == "pytest -m gpu" and item.get("skipped") and not args.emulate:   # on a GPU: none may skip
            item["note"] = "gpu tests skipped on a GPU machine: see skip_reasons"
            bad = True
        rec.add(item, problem=bool(bad))


# --- the equality stage ---------------------------------------------------------------------------------------

def equality_models(data_dir: Path, quick: bool, emulate: bool) -> dict:
    """name -> (config, overrides): every bundled model at a size the GPU does in well under a second a step;
    the SST and PTB recipes on the carried data (skipped, and said so, without it)."""
    tiny = emulate   # the emulation runs every GPU thread one after another: tiny sizes
    h = "model.hidden=8" if tiny else "model.hidden=96"
    e = "model.embed=6" if tiny else "model.embed=64"
    trees = ["data.synthetic.train=12", "data.dev=null", "data.test=null", "train.batch_size=4" if tiny else
             "train.batch_size=16"]
    models = {
        "tree_lstm": ("tree_lstm.yaml", [h, e] + trees),
        "tree_lstm_child_sum": ("tree_lstm.yaml", [h, e, "model.variant=child_sum"] + trees),
        "var_lstm": ("var_lstm.yaml", [h, e, "data.dev=null", "data.test=null",
                                       "train.batch_size=4" if tiny else "train.batch_size=32"]),
        "fixed_lstm": ("fixed_lstm.yaml", [h, e, "data.dev=null", "data.test=null",
                                           "train.batch_size=2" if tiny else "train.batch_size=16"]),
        "tree_fc": ("tree_fc.yaml", ["model.hidden=8" if tiny else "model.hidden=128",
                                     "model.leaves=8" if tiny else "model.leaves=64", "data.synthetic.train=12",
                                     "data.dev=null", "train.batch_size=4"]),
    }
    sst, ptb = data_file(data_dir, "sst/train.txt"), data_file(data_dir, "ptb/ptb.valid.txt")
    models["tree_lstm_sst"] = ("tree_lstm_sst.yaml", ([f"data.train={sst}"] if sst else []) +
                               ["data.dev=null", "data.test=null", "data.limit=48"] +
                               (["model.hidden=8", "model.embed=6", "train.batch_size=4"] if tiny else []))
    models["var_lstm_ptb"] = ("var_lstm_ptb.yaml", ([f"data.train={ptb}"] if ptb else []) +
                              ["data.dev=null", "data.dev_fraction=0.0", "data.test=null"] +
                              (["model.hidden=8", "model.embed=6", "train.batch_size=4"] if tiny else []))
    missing = {"tree_lstm_sst": sst is None, "var_lstm_ptb": ptb is None}
    if quick:
        models = {k: models[k] for k in ("tree_lstm", "var_lstm")}
    return {k: v for k, v in models.items() if not missing.get(k)}, [k for k, v in missing.items() if v]


def compare_training(config: str, overrides: list, kind: str, dtype: str, streaming: bool, deterministic: bool,
                     steps: int, reference: dict | None) -> tuple[dict, dict]:
    """``steps`` training steps on the device against the CPU (the CPU run is ``reference`` when given):
    each step's loss, the first step's gradients, the first update given the CPU's own gradients (the
    optimizer alone), and the parameters after ``steps`` steps (see the note of stage_equality)."""
    ov = list(overrides) + [f"train.dtype={dtype}"]
    if reference is None:
        cpu = make_trainer(config, ov, "cpu")
        B = cpu.cfg["train"]["batch_size"]
        batches = [cpu.task.data["train"][i * B:(i + 1) * B] for i in range(steps)]
        batches = [b for b in batches if b]
        reference = {"init": params_of(cpu), "losses": [], "batches": batches}
        for i, samples in enumerate(batches):
            res = cpu.loss_and_grads(samples)
            reference["losses"].append(float(res.loss))
            if i == 0:
                reference["grads"] = {k: host(g) for k, g in res.grads.items()}
            cpu.optimizer.step(res.grads, loss=res.loss)
            if i == 0:
                reference["after_first"] = params_of(cpu)
        reference["final"] = params_of(cpu)
    dev = make_trainer(config, ov, kind, deterministic, streaming)
    counter = count_launches(dev)
    item = {"init_err": worst(params_of(dev), reference["init"])[0], "losses": [], "loss_errs": []}
    for i, samples in enumerate(reference["batches"]):
        res = dev.loss_and_grads(samples)
        item["losses"].append(float(res.loss))
        item["loss_errs"].append(rel_err(float(res.loss), reference["losses"][i]))
        if i == 0:
            item["grad_err"], item["grad_worst"] = worst({k: host(g) for k, g in res.grads.items()},
                                                         reference["grads"])
            xp = dev.model.device.xp     # the update alone: the CPU's gradients on the device
            dev.optimizer.step({k: xp.asarray(g.astype(dtype)) for k, g in reference["grads"].items()},
                               loss=reference["losses"][0])
            item["update_err"], item["update_worst"] = worst(params_of(dev), reference["after_first"])
        else:
            dev.optimizer.step(res.grads, loss=res.loss)
    item["param_err"], item["param_worst"] = worst(params_of(dev), reference["final"])
    item["generated_launches"] = generated_launches(dev, counter)
    tol = TOL[dtype]
    item["loss_err"] = max(item["loss_errs"]) if item["loss_errs"] else 0.0
    item["tol"] = tol
    item["ok"] = all(item[k] <= tol for k in ("init_err", "loss_err", "grad_err", "update_err"))
    item["params_ok"] = item["param_err"] <= tol
    return item, reference


def equality_plan(models: dict, dtypes: list, variants: list) -> list[dict]:
    """The equality cases in priority order, so that a cap that cuts the stage short still compared the most:
    every model in every dtype on the plain path first, then the DAG summed by atomics, then the other
    engine switches (streaming, deterministic)."""
    def case(model, dtype, streaming, deterministic):
        name = f"{model} {dtype}{' streaming' if streaming else ''}{' deterministic' if deterministic else ''}"
        return {"case": name, "model": model, "dtype": dtype, "streaming": streaming, "deterministic": deterministic}
    plain = [case(m, d, *variants[0]) for d in dtypes for m in models]
    dag = [{"case": f"DAG atomics {d}", "model": "child_sum_dag", "dtype": d} for d in dtypes[::-1]]
    rest = [case(m, d, *v) for v in variants[1:] for d in dtypes for m in models]
    return plain + dag + rest


def dag_equality(kind: str, dtype: str, emulate: bool) -> dict:
    """A DAG: gradient rows of vertices with several parents summed by atomicAdd (twice: the difference is
    the atomics' order) and by the sorted segment sum (twice: bit-equal), each against the CPU."""
    case, graphs, feeds = dag_case(dtype, hidden=8 if emulate else 128)
    want = dag_run(case, graphs, feeds, "cpu", False)
    runs = {d: [dag_run(case, graphs, feeds, kind, d) for _ in range(2)] for d in (False, True)}
    item = {"tol": TOL[dtype]}
    for d, (a, b) in runs.items():
        tag = "sorted" if d else "atomic"
        item[f"{tag}_vs_cpu"] = max(rel_err(a[0], want[0]), worst(a[1], want[1])[0])
        item[f"{tag}_run_to_run"] = max(rel_err(a[0], b[0]), worst(a[1], b[1])[0])
    item["ok"] = (item["atomic_vs_cpu"] <= TOL[dtype] and item["sorted_vs_cpu"] <= TOL[dtype]
                  and item["atomic_run_to_run"] <= TOL[dtype] and item["sorted_run_to_run"] == 0.0)
    return item


def stage_equality(rec: Recorder, args) -> None:
    """Every bundled model, float64 and float32, streaming and deterministic on and off, against the CPU, in
    the order of :func:`equality_plan` (``planned`` lists it, so that what the cap cut off is known).

    ``ok`` is: equal initial parameters, every step's loss, the first step's gradients and the first update
    (the CPU's gradients fed to the device's optimizer) within DESIGN.md's tolerance. The parameters after
    all steps are reported apart (``params_ok``): Adam and Adagrad move a parameter by about lr times the
    sign of its gradient whatever its size, so a gradient within rounding of zero, which cuBLAS and the
    CPU's BLAS may round to opposite signs, moves a parameter by up to 2 lr between the runs: a
    disagreement there is rounding amplified by the optimizer unless the losses disagree too."""
    kind = "emulated" if args.emulate else "cuda"
    models, missing = equality_models(Path(args.data), args.quick, args.emulate)
    dtypes = ["float64"] if args.quick else ["float64", "float32"]
    variants = [(False, False), (True, False)] if args.emulate else \
        [(False, False), (True, False), (False, True), (True, True)]
    steps = 2 if args.emulate else 3
    plan = equality_plan(models, dtypes, variants)
    rec.set(device=kind, missing_data=missing, tolerances=TOL,
            planned=[{k: c[k] for k in ("case", "model", "dtype")} for c in plan])
    references = {}              # (model, dtype) -> the CPU's run, shared by the engine switches
    for c in plan:
        start = time.monotonic()
        try:
            if c["model"] == "child_sum_dag":
                item = dag_equality(kind, c["dtype"], args.emulate)
            else:
                config, overrides = models[c["model"]]
                key = (c["model"], c["dtype"])
                item, references[key] = compare_training(config, overrides, kind, c["dtype"], c["streaming"],
                                                         c["deterministic"], steps, references.get(key))
        except Exception as e:
            traceback.print_exc()
            item = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
        item.update(c, seconds=round(time.monotonic() - start, 2))
        say(f"{c['case']}: {'equal' if item['ok'] else 'NOT EQUAL'} "
            + ", ".join(f"{k} {item[k]}" for k in ("loss_err", "grad_err", "update_err", "param_err",
                                                    "atomic_vs_cpu", "sorted_vs_cpu", "error") if k in item))
        rec.add(item, problem=not item["ok"])


# --- the sanitize stage ---------------------------------------------------------------------------------------

SANITIZE_CONFIG = ("tree_lstm.yaml", ["model.hidden=16", "model.embed=8", "data.synthetic.train=8", "data.dev=null",
                                      "data.test=null", "train.batch_size=4"])
SANITIZER_LINES = 40     # the sanitizer's report lines kept (its errors, first to last), besides the summary


def find_sanitizer() -> str | None:
    """compute-sanitizer on PATH, else in ``$CUDA_HOME/bin``; None where there is none."""
    found = shutil.which("compute-sanitizer")
    home = os.environ.get("CUDA_HOME")
    if found is None and home and os.access(Path(home) / "bin" / "compute-sanitizer", os.X_OK):
        found = str(Path(home) / "bin" / "compute-sanitizer")
    return found


def sanitize_command(sanitizer: str, step_out: Path, emulate: bool) -> list:
    """memcheck over one training step (:func:`one_step`), exiting 1 on any error it reports."""
    return ([sanitizer, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, str(Path(__file__).resolve()),
             "step", str(step_out)] + (["--emulate"] if emulate else []))


def one_step(out: Path, emulate: bool) -> None:
    """One training step of the bundled tree_lstm (small) on the device, its loss written to ``out``. On the
    GPU, CuPy's memory pools are off first: every array is then an allocation of its own, whose bounds
    memcheck knows (an overrun inside a pool's block is invisible to it)."""
    kind = "emulated" if emulate else "cuda"
    start = time.monotonic()
    if not emulate:
        import cupy
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)
    config, overrides = SANITIZE_CONFIG
    t = make_trainer(config, overrides, kind)
    samples = t.task.data["train"][:t.cfg["train"]["batch_size"]]
    loss = float(train_step(t, samples).loss)
    synchronize(t)
    write_json(out, {"device": kind, "model": config, "overrides": overrides, "samples": len(samples),
                     "loss": loss, "finite": math.isfinite(loss), "seconds": round(time.monotonic() - start, 1)})


def sanitizer_report(text: str) -> dict:
    """The error count of compute-sanitizer's ``ERROR SUMMARY`` line (None without one) and its report
    lines (those it prefixes with ``=========``), the first ``SANITIZER_LINES`` of them."""
    lines = [line for line in text.splitlines() if line.startswith("=========")]
    summary = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    return {"errors": int(summary.group(1)) if summary else None, "summary": summary.group(0) if summary else None,
            "report": lines[:SANITIZER_LINES]}


def stage_sanitize(rec: Recorder, args) -> None:
    """One training step under ``compute-sanitizer --tool memcheck`` (skipped, and said so, without one):
    its exit status, its error count and first report lines, and the step's own result. The sanitizer is
    stopped a few seconds before the stage's cap, so that what it printed is kept."""
    sanitizer = find_sanitizer()
    if sanitizer is None:
        rec.set(skipped="no compute-sanitizer (not on PATH, nor in $CUDA_HOME/bin)")
        say(f"sanitize: {rec.data['skipped']}")
        return
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-sanitize-"))
    step_out, log = workdir / "step.json", workdir / "sanitizer.txt"
    cmd = sanitize_command(sanitizer, step_out, args.emulate)
    say(f"$ {' '.join(cmd)}")
    seconds = max(5.0, args.cap - 8)
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
        stop = lambda: os.killpg(proc.pid, signal.SIGKILL)        # the sanitizer and the step it runs
        before = signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(1)))   # the runner's kill: both
        try:
            rc, note = proc.wait(timeout=seconds), None
        except subprocess.TimeoutExpired:
            stop()
            rc, note = proc.wait(), f"stopped after {seconds:.0f} s (the stage's cap): the step did not finish"
        finally:
            signal.signal(signal.SIGTERM, before)
    text = log.read_text(errors="replace")
    say(text[-20000:])
    item = {"command": " ".join(cmd), "exit": rc, "seconds": round(time.monotonic() - start, 1),
            **sanitizer_report(text), "step": read_json(step_out)}
    if note:
        item["note"] = note
    if item["step"] is None:
        item["tail"] = text.splitlines()[-15:]
    item["ok"] = (rc == 0 and item["errors"] == 0 and bool(item["step"]) and item["step"].get("finite", False))
    rec.add(item, problem=not item["ok"])


# --- the bench stage ------------------------------------------------------------------------------------------

def bench_points(quick: bool, emulate: bool) -> list:
    """(point, data settings) of the benchmark's throughput points (tiny stand-ins under the emulation)."""
    from minicavs.bench.sweeps import Point
    if emulate:
        return [(Point("tree_lstm", 8, 4), {"trees": 8, "tree_embed": 6}),
                (Point("tree_fc", 8, 2, 8), {"fc_trees": 4}),
                (Point("var_lstm", 8, 4), {"sentences": 8, "lm_embed": 6})]
    points = [(Point("tree_lstm", 512, 64), {}), (Point("tree_lstm", 512, 256), {}), (Point("tree_lstm", 128, 64), {}),
              (Point("tree_fc", 512, 64, 256), {}), (Point("var_lstm", 512, 64), {})]
    return points[:1] + points[3:4] if quick else points


def timed(t, samples, batch: int, training: bool, repeats: int) -> list[float]:
    """Units per second of ``repeats`` passes over ``samples``; the device is synchronized before each clock
    read, so queued work is counted."""
    units = t.task.units(samples)
    fn = train_step if training else infer_step
    rates = []
    for _ in range(repeats):
        synchronize(t)
        start = time.perf_counter()
        for i in range(0, len(samples), batch):
            fn(t, samples[i:i + batch])
        synchronize(t)
        rates.append(units / (time.perf_counter() - start))
    return rates


def profile_steps(t, samples, steps: int = 3) -> dict:
    """Kernels per training step and GPU busy time per step, by CUPTI through torch.profiler (it sees every
    kernel of the process, CuPy's and cuBLAS' included), against the step's wall time."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:
        return {"profile": f"unavailable: {type(e).__name__}: {e}"[:200]}
    try:
        torch.cuda.init()
        synchronize(t)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                train_step(t, samples)
            synchronize(t)
            wall = time.perf_counter() - start
        kernels, busy = 0, 0.0
        for ev in prof.events():
            if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA:
                kernels += 1
                busy += ev.time_range.elapsed_us()     # a kernel's own GPU time (overlaps on two streams count twice)
        out = {"kernels_per_batch": kernels / steps, "gpu_busy_s_per_step": busy / 1e6 / steps,
               "wall_s_per_step_profiled": wall / steps}
        if not kernels:
            out["profile"] = "CUPTI (torch.profiler) saw no kernel of CuPy's: no count, no busy time"
            out["kernels_per_batch"] = out["gpu_busy_s_per_step"] = None
        return out
    except Exception as e:
        return {"profile": f"failed: {type(e).__name__}: {e}"[:300]}


def measure_minicavs(point, data, kind: str, repeats: int, epoch_cap: float) -> tuple[dict, object]:
    from minicavs.bench.workloads import build, flops_per_unit
    from minicavs.engine.compile import EngineOptions
    t = build(point, data, EngineOptions(), device_overrides(kind))
    counter = count_launches(t)
    B = point.batch
    warm = t.task.data["train"][:B]
    train_step(t, warm)                               # compiles kernels, sizes the dynamic tensors
    synchronize(t)
    start = time.perf_counter()
    train_step(t, warm)
    synchronize(t)
    per_batch = time.perf_counter() - start
    n = min(len(t.task.data["train"]), max(1, int(epoch_cap / max(per_batch, 1e-9))) * B)
    samples = t.task.data["train"][:n]
    timed(t, samples, B, True, 1)                     # warm-up epoch: every batch shape once
    set_streaming(t, True)                            # two streams (eager nodes on the second): its kernels
    train_step(t, warm)
    item = {"samples": n, "units": t.task.units(samples), "batches": -(-n // B), "train_rates": [],
            "train_two_streams_rates": []}
    for _ in range(repeats):                          # one stream and two, alternately (drift hits both)
        set_streaming(t, False)
        item["train_rates"] += timed(t, samples, B, True, 1)
        set_streaming(t, True)
        item["train_two_streams_rates"] += timed(t, samples, B, True, 1)
    set_streaming(t, False)
    item["train"] = median(item["train_rates"])
    item["train_two_streams"] = median(item["train_two_streams_rates"])
    item["two_vs_one_stream"] = item["train_two_streams"] / item["train"]
    infer_step(t, warm)
    item["infer_rates"] = timed(t, samples, B, False, repeats)
    item["infer"] = median(item["infer_rates"])
    if counter is not None:
        before = generated_launches(t, counter)
        timed(t, warm, B, True, 1)
        item["launches_per_batch"] = generated_launches(t, counter) - before
        before = generated_launches(t, counter)
        timed(t, warm, B, False, 1)
        item["launches_per_batch_infer"] = generated_launches(t, counter) - before
    synchronize(t)
    start = time.perf_counter()
    train_step(t, warm)
    synchronize(t)
    item["step_s"] = time.perf_counter() - start
    fpu = flops_per_unit(t, samples, point)
    item["train_TFLOPs"] = 3 * fpu * item["train"] / 1e12     # useful matmul FLOPs: backward = 2x forward
    item["infer_TFLOPs"] = fpu * item["infer"] / 1e12
    if kind == "cuda":
        item.update(profile_steps(t, warm))
    return item, t


def stage_bench(rec: Recorder, args) -> None:
    from minicavs.bench.peers import PEERS, check_loss, run as run_peer, same_loss
    from minicavs.bench.workloads import Data
    kind = "emulated" if args.emulate else "cuda"
    data_dir = Path(args.data)
    sst, ptb = data_file(data_dir, "sst/train.txt"), data_file(data_dir, "ptb/ptb.valid.txt")
    repeats = 2 if args.quick or args.emulate else 3
    epoch_cap = 0.5 if args.emulate else 3.0
    try:
        import torch
        torch_ok = torch.cuda.is_available() or args.emulate
        torch_why = None if torch_ok else "torch sees no CUDA device"
    except Exception as e:
        torch_ok, torch_why = False, f"no torch ({type(e).__name__})"
    rec.set(device=kind, data={"sst": sst or "synthetic (no carried SST)", "ptb": ptb or "synthetic (no carried PTB)"},
            repeats=repeats, epoch_cap_s=epoch_cap)
    deadline, last, point_start = time.monotonic() + args.cap - 5, 0.0, None   # a point starts if the last fits
    for point, sizes in bench_points(args.quick, args.emulate):
        data = Data(sst=sst, ptb=ptb, **sizes)
        key = point.key()
        if point_start is not None:
            last = time.monotonic() - point_start
        point_start = time.monotonic()
        if point_start + last > deadline:
            rec.add({"point": key, "system": "minicavs", "error": f"not run: the last point took {last:.0f} s, "
                     f"more than the {max(0.0, deadline - time.monotonic()):.0f} s left of the stage's cap"})
            continue
        say(f"--- {key}")
        start = time.monotonic()
        try:
            item, t = measure_minicavs(point, data, kind, repeats, epoch_cap)
            item.update(point=key, system="minicavs", seconds=round(time.monotonic() - start, 1))
            rec.add(item)
        except Exception as e:
            traceback.print_exc()
            rec.add({"point": key, "system": "minicavs", "error": f"{type(e).__name__}: {e}"[:600]}, problem=True)
            continue
        say(json.dumps(item, default=str)[:600])
        peer = PEERS[point.model][-1]                 # PyTorch batched: by level, or nn.LSTM packed (cuDNN)
        if not torch_ok:
            rec.add({"point": key, "system": peer.label, "error": f"skipped: {torch_why}"})
            continue
        start = time.monotonic()
        try:
            got = run_peer(sys.executable, "pytorch", t, mode=peer.mode, epochs=repeats, max_seconds=epoch_cap,
                           inference=True, samples=item["samples"], timeout=120,
                           device="cpu" if args.emulate else "cuda")
            ours = check_loss(t, got["check"])
            pi = {"point": key, "system": f"PyTorch {peer.mode}" + (" (CPU)" if args.emulate else ""),
                  "train": median(got["rates"]), "infer": median(got.get("infer_rates", [])),
                  "train_rates": got["rates"], "infer_rates": got.get("infer_rates"), "samples": got["samples"],
                  "same_loss": same_loss(ours, got["check_loss"]), "check_loss": got["check_loss"],
                  "minicavs_check_loss": ours, "device": got.get("device"), "torch": got["versions"].get("torch"),
                  "seconds": round(time.monotonic() - start, 1)}
            pi["ratio_train"] = item["train"] / pi["train"] if pi["train"] else None
            pi["ratio_infer"] = item["infer"] / pi["infer"] if pi["infer"] else None
            pi["note"] = "" if pi["same_loss"] else "NOT the same loss"
            rec.add(pi, problem=not pi["same_loss"])
        except Exception as e:
            traceback.print_exc()
            rec.add({"point": key, "system": peer.label, "error": f"{type(e).__name__}: {e}"[:600]}, problem=True)
        del t


STAGE_FUNCTIONS = {"loop": stage_loop, "facts": stage_facts, "equality": stage_equality, "tests": stage_tests,
                   "sanitize": stage_sanitize, "bench": stage_bench}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpu_stages")
    p.add_argument("stage", choices=sorted(STAGE_FUNCTIONS) + ["step"],
                   help="a stage, or step: the sanitize stage's one training step (its result to OUT)")
    p.add_argument("out")
    p.add_argument("--data", default=str(ROOT / ".gpu-data"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--cap", type=float, default=300.0, help="the runner's cap for this stage (seconds)")
    p.add_argument("--pytest-args", default=None, help="tests stage: this selection instead of the GPU suites")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.stage == "step":
        one_step(Path(args.out), args.emulate)
        return 0
    rec = Recorder(Path(args.out), args.stage, emulated=args.emulate)
    try:
        rc = STAGE_FUNCTIONS[args.stage](rec, args) or 0   # (a stage may fail on what it measured: loop)
    except Exception as e:
        traceback.print_exc()
        rec.set(error=f"{type(e).__name__}: {e}"[:1000])
        return 1
    rec.set(completed=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
