"""tools/gpu_check.py without a GPU: it refuses to run (non-zero, naming CuPy or the device, within 60 s); the
first call's caps fit its budget and its device timeout; past a stand-in cupy that reports a device, the runner
kills a stage at its cap keeping what it wrote, shrinks the later caps to the budget and says whether the bench
call is warranted; the tests stage's pytest survives a machine plugin that warns; the loop stage fails when a
pass is issued from Python; the sanitize stage runs the step under compute-sanitizer's memcheck (a stand-in
sanitizer here) or says it has none; runs merge; the table shows them; and the loop, equality, bench and
sanitize stages themselves run on the emulated CUDA device."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minicavs import cuda as mcuda

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import gpu_check  # noqa: E402
import gpu_stages  # noqa: E402

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulation needs g++")


def run_check(out: Path, *args, pythonpath: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = None
    if pythonpath is not None:
        import os
        env = dict(os.environ, PYTHONPATH=pythonpath)
    start = time.monotonic()
    res = subprocess.run(["bash", str(TOOLS / "gpu_check.sh"), str(out), *args], capture_output=True, text=True,
                         timeout=120, env=env)
    return res, time.monotonic() - start


@pytest.mark.skipif(mcuda.available(), reason="CuPy and a CUDA device are here: the check would run")
def test_without_cupy_or_a_device_it_exits_nonzero_naming_what_is_missing(tmp_path):
    res, seconds = run_check(tmp_path / "out")
    assert res.returncode != 0 and seconds < 60
    assert "CuPy is missing" in res.stderr or "no CUDA device" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()          # nothing run, nothing written


@pytest.mark.parametrize("body, says", [
    ("raise ImportError('libcudart.so.13: cannot open shared object file')", "CuPy is missing"),
    ("class cuda:\n class runtime:\n  @staticmethod\n  def getDeviceCount():\n   return 0\n", "no CUDA device"),
    ("class cuda:\n class runtime:\n  @staticmethod\n  def getDeviceCount():\n"
     "   raise RuntimeError('cudaErrorNoDevice')\n", "no CUDA device"),
])
def test_a_broken_cupy_or_no_device_is_named(tmp_path, body, says):
    """Whatever this machine has: a stand-in cupy package first on the path (import fails, no device)."""
    (tmp_path / "fake" / "cupy").mkdir(parents=True)
    (tmp_path / "fake" / "cupy" / "__init__.py").write_text(body)
    res, seconds = run_check(tmp_path / "out", pythonpath=str(tmp_path / "fake"))
    assert res.returncode == 2 and seconds < 60
    assert says in res.stderr, res.stderr


def test_bad_arguments_are_refused(tmp_path):
    assert gpu_check.main([str(tmp_path), "--stages", "facts,nonsense", "--emulate"]) == 2
    assert gpu_check.main([str(tmp_path), "--cap", "bench=soon", "--emulate"]) == 2


# --- the stage runner --------------------------------------------------------------------------------------

def stage_cmd(out: Path, body: str) -> list:
    """A stand-in stage: writes one item as the real ones do, then runs ``body``."""
    code = (f"import json, os, sys, time\np = {str(out / 'fake.json')!r}\n"
            "json.dump({'stage': 'fake', 'items': [{'n': 1}], 'problems': 0}, open(p + '.tmp', 'w'))\n"
            "os.replace(p + '.tmp', p)\nprint('stage output')\n" + body)
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("body, status", [
    ("time.sleep(60)", "timeout"),
    ("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)", "timeout"),   # SIGKILL
    ("sys.exit(1)", "failed"),
    ("", "ok"),
])
def test_a_stage_keeps_what_it_wrote_before_its_cap(tmp_path, body, status):
    with open(tmp_path / "log.txt", "a") as log:
        start = time.monotonic()
        res = gpu_check.run_stage("fake", stage_cmd(tmp_path, body), tmp_path, 2, gpu_check.child_env(None), log)
    assert time.monotonic() - start < 2 + gpu_check.KILL_GRACE + 3
    assert res["status"] == status and res["items"] == [{"n": 1}]
    assert json.loads((tmp_path / "fake.json").read_text())["status"] == status
    assert "stage output" in (tmp_path / "log.txt").read_text()


def test_a_stage_that_writes_nothing_is_a_crash(tmp_path):
    with open(tmp_path / "log.txt", "a") as log:
        res = gpu_check.run_stage("fake", [sys.executable, "-c", "pass"], tmp_path, 10, gpu_check.child_env(None), log)
    assert res["status"] == "crashed" and res["items"] == []


def test_the_budget_shrinks_caps_and_skips_what_does_not_fit(tmp_path):
    assert gpu_check.main([str(tmp_path), "--emulate", "--stages", "bench", "--budget", "10"]) == 1
    runs = gpu_check.load_results(tmp_path)["runs"]
    assert [r["stages"]["bench"]["status"] for r in runs] == ["not run"]


def test_the_first_call_fits_its_device_timeout_and_the_bench_is_a_second_call():
    """The default stages in priority order; their caps, the setup before them, the last stage's time to die
    and the reserve for the table within the default budget, and that below the first call's timeout_s; the
    bench alone within the same budget."""
    assert gpu_check.DEFAULT_STAGES == ("loop", "facts", "equality", "tests", "sanitize")
    overhead = gpu_check.SETUP_S + gpu_check.KILL_GRACE + gpu_check.RESERVE
    assert sum(gpu_check.CAPS[s] for s in gpu_check.DEFAULT_STAGES) + overhead <= gpu_check.BUDGET
    assert gpu_check.CAPS["bench"] + overhead <= gpu_check.BUDGET
    assert gpu_check.BUDGET + 10 <= gpu_check.DEVICE_TIMEOUT_S <= 360
    args = gpu_check.parse_args(["out"])
    assert args.budget == gpu_check.BUDGET and args.stages.split(",") == list(gpu_check.DEFAULT_STAGES)


# --- the runner past a stand-in cupy (a device reported), stages stood in for --------------------------------

@pytest.fixture
def standin_cupy(tmp_path, monkeypatch):
    """A cupy package that reports one CUDA device, first on the children's path: the runner takes it for a
    GPU machine (the stages themselves are stood in for by :func:`fake_stages`)."""
    (tmp_path / "standin" / "cupy").mkdir(parents=True)
    (tmp_path / "standin" / "cupy" / "__init__.py").write_text(
        "class cuda:\n class runtime:\n  @staticmethod\n  def getDeviceCount():\n   return 1\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "standin"), os.environ.get("PYTHONPATH", "")]))
    return ["--wheels", str(tmp_path / "no-wheels"), "--site", str(tmp_path / "site")]


def fake_stages(monkeypatch, results: dict, sleep: float = 0.0) -> None:
    """Each stage's process writes ``results[stage]`` (as a stage writes its JSON) and then sleeps ``sleep``."""
    def command(name, out, cap, args):
        data = {"stage": name, "items": [], "problems": 0, **results.get(name, {})}
        code = (f"import json, os, time\np = {str(out / f'{name}.json')!r}\n"
                f"open(p + '.tmp', 'w').write({json.dumps(data)!r})\nos.replace(p + '.tmp', p)\n"
                f"time.sleep({sleep})\n")
        return [sys.executable, "-c", code]
    monkeypatch.setattr(gpu_check, "stage_command", command)


def test_stages_past_their_caps_are_killed_their_items_kept_and_the_budget_holds(tmp_path, monkeypatch, capsys,
                                                                               standin_cupy):
    """Every stage sleeps past its cap: loop, facts and equality are killed at theirs (2 s), tests at what
    the budget leaves it (less than its 30 s), sanitize is not started (less than 5 s left)."""
    results = {s: {"items": [{"case": f"{s} item", "ok": True}]} for s in gpu_check.STAGES}
    results["equality"] = equality_result(PLAN, [PLAN[0] + (True,)])         # cut off after its first case
    fake_stages(monkeypatch, results, 60)
    caps = ["--cap", "loop=2", "--cap", "facts=2", "--cap", "equality=2", "--cap", "tests=30",
            "--cap", "sanitize=30"]
    budget = 28
    start = time.monotonic()
    assert gpu_check.main([str(tmp_path / "out"), "--budget", str(budget), *caps, *standin_cupy]) == 1
    assert time.monotonic() - start <= budget
    stages = gpu_check.load_results(tmp_path / "out")["runs"][0]["stages"]
    assert [stages[s]["status"] for s in gpu_check.DEFAULT_STAGES] == ["timeout"] * 4 + ["not run"]
    assert stages["loop"]["cap_s"] == stages["facts"]["cap_s"] == stages["equality"]["cap_s"] == 2
    assert 5 <= stages["tests"]["cap_s"] <= budget - 6 - gpu_check.RESERVE - gpu_check.KILL_GRACE
    for s in gpu_check.DEFAULT_STAGES[:4]:
        assert stages[s]["items"] == results[s]["items"]
        assert stages[s]["seconds"] <= stages[s]["cap_s"] + gpu_check.KILL_GRACE
        assert json.loads((tmp_path / "out" / f"{s}.json").read_text())["items"] == stages[s]["items"]
    assert "the bench call is NOT warranted: equality stopped before comparing tree_lstm float32, var_lstm float32, " \
           "var_lstm float64" in capsys.readouterr().out


def equality_result(planned: list, items: list) -> dict:
    return {"stage": "equality", "status": "ok",
            "planned": [{"case": f"{m} {d}{v}", "model": m, "dtype": d} for m, d, v in planned],
            "items": [{"case": f"{m} {d}{v}", "model": m, "dtype": d, "ok": ok} for m, d, v, ok in items]}


PLAN = [("tree_lstm", "float64", ""), ("var_lstm", "float64", ""), ("tree_lstm", "float32", ""),
        ("var_lstm", "float32", ""), ("tree_lstm", "float64", " streaming"), ("var_lstm", "float32", " streaming")]


@pytest.mark.parametrize("items, warranted, says", [
    ([p + (True,) for p in PLAN], True, "all 6 equality cases equal"),
    ([p + (True,) for p in PLAN[:4]], True, "2 variant cases not reached"),
    ([p + (p[0] != "var_lstm" or p[1] != "float32",) for p in PLAN], False, "2 of 6 equality cases not equal"),
    ([p + (True,) for p in PLAN[:3]], False, "before comparing var_lstm float32"),
    ([], False, "compared nothing"),
])
def test_the_bench_is_warranted_only_when_every_model_and_dtype_compared_equal(items, warranted, says):
    got, why = gpu_check.bench_verdict(equality_result(PLAN, items))
    assert got is warranted and says in why, why


def test_the_bench_is_not_warranted_without_an_equality_plan_or_run():
    assert gpu_check.bench_verdict(equality_result([], [PLAN[0] + (True,)])) == \
        (False, "equality recorded no plan of its cases: what it did not reach is unknown")
    assert gpu_check.bench_verdict(None) == (False, "equality did not run")


def test_the_first_call_ends_saying_the_bench_call_is_warranted(tmp_path, monkeypatch, capsys, standin_cupy):
    fake_stages(monkeypatch, {"equality": equality_result(PLAN, [p + (True,) for p in PLAN])})
    assert gpu_check.main([str(tmp_path / "out"), *standin_cupy]) == 0
    out = capsys.readouterr().out
    assert "the bench call is WARRANTED: all 6 equality cases equal" in out
    assert out.rstrip().endswith("Second call: bash tools/gpu_check.sh OUT --stages bench")
    run = gpu_check.load_results(tmp_path / "out")["runs"][0]
    assert run["bench_warranted"]["warranted"] and list(run["stages"]) == list(gpu_check.DEFAULT_STAGES)


# --- the tests stage's pytest and a machine's plugins ----------------------------------------------------------

def warning_plugin(root: Path) -> Path:
    """A site folder holding an installed distribution whose pytest11 entry point is a plugin that warns in
    ``pytest_configure`` (as pytest-benchmark does under xdist): with it on PYTHONPATH, pytest's autoloading
    loads it, and ``filterwarnings = error`` turns its warning into an INTERNALERROR."""
    site = root / "site"
    (site / "warnplugin-1.0.dist-info").mkdir(parents=True)
    (site / "warnplugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: warnplugin\nVersion: 1.0\n")
    (site / "warnplugin-1.0.dist-info" / "entry_points.txt").write_text("[pytest11]\nwarnplugin = warnplugin_hooks\n")
    (site / "warnplugin_hooks.py").write_text(
        "import warnings\n\ndef pytest_configure(config):\n"
        "    warnings.warn('warnplugin: a plugin of the machine warns at configure', UserWarning)\n")
    return site


TINY_TESTS = ("from hypothesis import given, strategies as st\n\n"
              "def test_sum():\n    assert 1 + 1 == 2\n\n"
              "@given(st.integers())\ndef test_any_integer(n):\n    assert n - n == 0\n")


@pytest.mark.parametrize("parallel", [[], pytest.param(["-n", "2"], marks=pytest.mark.skipif(
    not gpu_stages.has_xdist(), reason="pytest-xdist is not installed"))])
def test_a_machine_plugin_that_warns_cannot_break_the_tests_stage(tmp_path, monkeypatch, parallel):
    """The tests stage on a tiny selection with the warning plugin installed: it passes, with the plugins it
    names loaded (xdist's ``-n``, hypothesis' ``--hypothesis-seed`` are understood); the same pytest command
    with autoloading on fails on the plugin's warning (what the stage is guarded against)."""
    site = warning_plugin(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "test_tiny.py").write_text(TINY_TESTS)
    selection = parallel + ["--hypothesis-seed=1", str(tmp_path / "tiny" / "test_tiny.py")]
    out = tmp_path / "tests.json"
    assert gpu_stages.main(["tests", str(out), "--emulate", "--cap", "120", "--pytest-args", " ".join(selection)]) == 0
    item = json.loads(out.read_text())["items"][0]
    assert (item["exit"], item.get("passed"), item.get("failed"), item.get("errors")) == (0, 2, 0, 0), item
    assert item["command"].startswith("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 ")

    autoload = {k: v for k, v in gpu_stages.pytest_env().items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    cmd = gpu_stages.pytest_command(tmp_path / "autoload.xml", selection)
    res = subprocess.run(cmd, env=autoload, cwd=str(TOOLS.parent), capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "warnplugin: a plugin of the machine warns" in res.stdout + res.stderr


# --- the sanitize stage -------------------------------------------------------------------------------------

FAKE_SANITIZER = """#!/bin/sh
# compute-sanitizer stood in for: records its arguments, runs the program after its options (the first
# argument that is a file), reports FAKE_ERRORS errors as memcheck does, after FAKE_SLEEP seconds
printf '%s\\n' "$@" > "$0.argv"
echo "========= COMPUTE-SANITIZER"
sleep "${FAKE_SLEEP:-0}"
while [ $# -gt 0 ] && [ ! -f "$1" ]; do shift; done
"$@"; rc=$?
n=${FAKE_ERRORS:-0}
if [ "$n" -gt 0 ]; then echo "========= Invalid __global__ read of size 4 bytes"; fi
echo "========= ERROR SUMMARY: $n errors"
if [ "$n" -gt 0 ]; then exit 1; fi
exit $rc
"""


@pytest.fixture
def fake_sanitizer(tmp_path, monkeypatch) -> Path:
    """A compute-sanitizer first on PATH (``.argv`` beside it gets the arguments it was given)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "compute-sanitizer").write_text(FAKE_SANITIZER)
    (bin_dir / "compute-sanitizer").chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), os.environ["PATH"]]))
    return bin_dir / "compute-sanitizer"


@needs_cxx
@pytest.mark.parametrize("errors", [0, 2])
def test_the_sanitize_stage_runs_one_training_step_under_memcheck(tmp_path, monkeypatch, fake_sanitizer, errors):
    monkeypatch.setenv("FAKE_ERRORS", str(errors))
    out = tmp_path / "sanitize.json"
    assert gpu_stages.main(["sanitize", str(out), "--emulate", "--cap", "300"]) == 0
    res = json.loads(out.read_text())
    argv = fake_sanitizer.with_name("compute-sanitizer.argv").read_text().splitlines()
    assert argv[:4] == ["--tool", "memcheck", "--error-exitcode", "1"]          # any error: exit status 1
    assert argv[4:] == [sys.executable, str(TOOLS / "gpu_stages.py"), "step", argv[7], "--emulate"]
    assert gpu_stages.sanitize_command("cs", Path(argv[7]), emulate=False) == ["cs"] + argv[:-1]   # on a GPU
    [item] = res["items"]
    assert item["step"]["device"] == "emulated" and item["step"]["finite"] and item["step"]["loss"] > 0
    assert item["summary"] == f"ERROR SUMMARY: {errors} errors" and item["errors"] == errors
    assert (item["exit"], item["ok"], res["problems"]) == ((0, True, 0) if errors == 0 else (1, False, 1))
    assert ("========= Invalid __global__ read of size 4 bytes" in item["report"]) == (errors > 0)


def test_a_sanitizer_past_the_stage_cap_is_stopped_and_said(tmp_path, monkeypatch, fake_sanitizer):
    monkeypatch.setenv("FAKE_SLEEP", "60")
    out = tmp_path / "sanitize.json"
    start = time.monotonic()
    assert gpu_stages.main(["sanitize", str(out), "--emulate", "--cap", "10"]) == 0
    assert time.monotonic() - start < 10
    [item] = json.loads(out.read_text())["items"]
    assert item["note"].startswith("stopped after 5 s") and item["step"] is None and not item["ok"]
    assert item["tail"] == ["========= COMPUTE-SANITIZER"]


def test_without_compute_sanitizer_the_stage_is_skipped_and_says_so(tmp_path, monkeypatch):
    (tmp_path / "empty-bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    args = gpu_check.parse_args([str(tmp_path), "--emulate"])
    with open(tmp_path / "log.txt", "a") as log:
        res = gpu_check.run_stage("sanitize", gpu_check.stage_command("sanitize", tmp_path, 30, args), tmp_path, 30,
                                  gpu_check.child_env(None), log)
    assert res["status"] == "skipped" and res["items"] == []
    assert gpu_check.stage_summary("sanitize", res).startswith("skipped: no compute-sanitizer")


# --- merging and the table ---------------------------------------------------------------------------------

def a_run(run_id: str, started: str, **stages) -> dict:
    return {"id": run_id, "started": started, "commit": "abc", "emulated": False,
            "stages": {k: {"stage": k, "status": "ok", "seconds": 1.0, **v} for k, v in stages.items()}}


def test_runs_merge_once_each_oldest_first(tmp_path):
    first = {"format": 1, "runs": [a_run("r1", "2026-11-23T10:00:00Z", facts={"facts": {"device": "H100"}})]}
    second = {"format": 1, "runs": [a_run("r2", "2026-11-23T11:00:00Z", bench={"items": []}),
                                    a_run("r1", "2026-11-23T10:00:00Z", facts={"facts": {"device": "H100 again"}})]}
    merged = gpu_check.merge(first, second)
    assert [r["id"] for r in merged["runs"]] == ["r1", "r2"]
    assert merged["runs"][0]["stages"]["facts"]["facts"]["device"] == "H100 again"   # the later copy of r1
    latest = gpu_check.latest(merged)
    assert set(latest) == {"facts", "bench"} and latest["bench"][1]["id"] == "r2"
    # the command line: folders and files, merged into what DEST holds
    for name, data in (("a", first), ("b", second)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(data))
    assert gpu_check.main([str(tmp_path / "dest"), "--merge", str(tmp_path / "a"),
                           str(tmp_path / "b" / "results.json")]) == 0
    assert [r["id"] for r in gpu_check.load_results(tmp_path / "dest")["runs"]] == ["r1", "r2"]
    (tmp_path / "bad.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(SystemExit, match="not a results file"):
        gpu_check.load_results(tmp_path / "bad.json")


def test_the_table_shows_each_stage_newest_and_the_benchmark_rows():
    tests = {"items": [{"name": "pytest -m gpu", "passed": 7, "failed": 2, "errors": 0, "skipped": 1}]}
    eq = {"items": [{"case": "tree_lstm float32", "ok": True, "params_ok": False}, {"case": "tree_fc float64", "ok": False}]}
    bench = {"items": [{"point": "tree_lstm-h512-b64", "system": "minicavs", "train": 2500.0, "infer": 9000.0,
                        "two_vs_one_stream": 1.25, "launches_per_batch": 400, "kernels_per_batch": 900.0,
                        "gpu_busy_s_per_step": 0.01, "wall_s_per_step_profiled": 0.04},
                       {"point": "tree_lstm-h512-b64", "system": "PyTorch level", "train": 1000.0, "infer": 3000.0,
                        "ratio_train": 2.5, "ratio_infer": 3.0},
                       {"point": "var_lstm-h512-b64", "system": "minicavs", "error": "RuntimeError: boom"}]}
    sanitize = {"items": [{"errors": 2, "exit": 1, "step": {"loss": 1.5, "device": "cuda"}}]}
    results = {"format": 1, "runs": [a_run("r1", "1", tests={"items": []}),
                                     a_run("r2", "2", tests=tests, equality=eq, bench=bench, sanitize=sanitize)]}
    text = gpu_check.render(results)
    assert "memcheck: 2 errors (exit 1), step loss 1.5 on cuda" in text
    assert "7 passed, 2 failed" in text and "1/2 equal" in text and "not equal: tree_fc float64" in text
    assert "1 with parameters beyond tolerance" in text
    rows = [line for line in text.splitlines() if line.startswith("tree_lstm-h512-b64")]
    assert "2.5e+03" in rows[0] and "1.25" in rows[0] and "400 / 900" in rows[0] and "25%" in rows[0]
    assert "2.5" in rows[1].split() and "error: RuntimeError: boom" in text
    assert text.rstrip().endswith("2 run(s) merged")


def test_junit_reports_are_read_with_their_failures(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\ndef test_ok(): pass\ndef test_bad(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skip(): pass\n")
    item = gpu_stages.run_pytest("sample", [str(tmp_path / "test_sample.py")], 60, tmp_path)
    assert (item["passed"], item["failed"], item["skipped"], item["interrupted"]) == (1, 1, 1, False)
    assert "one is not two" in item["failures"][0]["message"] and item["skip_reasons"] == {"not here": 1}


# --- the stages on the emulated CUDA device ------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _shared_emulation(emulation_dir, monkeypatch):
    """The session's emulation libraries (tests/engine/test_backend.py builds many of the same sources); the stand-in
    that ``--emulate`` installs in this process is taken out again after each test."""
    from minicavs.cuda import kernels
    monkeypatch.setattr(gpu_stages, "_EMULATION_DIR", str(emulation_dir))
    monkeypatch.setattr(kernels, "default_launcher", kernels.default_launcher)


@needs_cxx
def test_the_equality_stage_runs_on_the_emulated_device(tmp_path):
    out = tmp_path / "equality.json"
    assert gpu_stages.main(["equality", str(out), "--emulate", "--quick", "--data", str(tmp_path)]) == 0
    res = json.loads(out.read_text())
    cases = {i["case"]: i for i in res["items"]}
    assert set(cases) == {"tree_lstm float64", "tree_lstm float64 streaming", "var_lstm float64",
                          "var_lstm float64 streaming", "DAG atomics float64"}
    assert all(i["ok"] for i in res["items"]) and res["problems"] == 0 and res["completed"]
    assert all(i["generated_launches"] > 0 for c, i in cases.items() if not c.startswith("DAG"))
    assert res["missing_data"] == ["tree_lstm_sst", "var_lstm_ptb"]


@needs_cxx
def test_the_loop_stage_issues_every_pass_from_c_on_the_emulated_device(tmp_path):
    out = tmp_path / "loop.json"
    assert gpu_stages.main(["loop", str(out), "--emulate"]) == 0
    res = json.loads(out.read_text())
    assert [i["case"] for i in res["items"]] == ["binary_tree_lstm float32 streaming", "binary_tree_lstm float64"]
    assert all(i["ok"] and i["issued_from_c"] and i["passes"] == 2 and i["launches"] > 0 and i["products"] > 0
               for i in res["items"]) and res["problems"] == 0
    assert res["items"][0]["events"] > 0   # (streaming: the eager stream's events)
    assert "2/2 cases issued every pass from C" in gpu_check.stage_summary("loop", res)


@needs_cxx
def test_the_loop_stage_fails_when_a_pass_is_issued_from_python(tmp_path, monkeypatch):
    """The loop's setup failing (as ``.ptr`` of a RawKernel failed on a GPU: a warning, then the Python
    runner) fails the stage, naming the passes and the reason."""
    from minicavs.cuda import issue

    def unreachable(*args):
        raise AttributeError("'RawKernel' object has no attribute 'ptr'")
    monkeypatch.setattr(issue, "_Standin", unreachable)
    out = tmp_path / "loop.json"
    assert gpu_stages.main(["loop", str(out), "--emulate"]) == 1
    res = json.loads(out.read_text())
    assert res["problems"] == 2 and not any(i["ok"] or i["issued_from_c"] for i in res["items"])
    assert all("cannot reach the device's entry points" in " ".join(i["warnings"]) for i in res["items"])
    summary = gpu_check.stage_summary("loop", res)
    assert summary.startswith("0/2 cases issued every pass from C; NOT binary_tree_lstm float32 streaming: G forward "
                              "from Python (the issuing loop cannot reach"), summary


@needs_cxx
def test_the_equality_comparison_can_fail(tmp_path):
    config, overrides = gpu_stages.equality_models(tmp_path, True, True)[0]["tree_lstm"]
    item, ref = gpu_stages.compare_training(config, overrides, "emulated", "float64", False, False, 2, None)
    assert item["ok"]
    ref["losses"][1] *= 1 + 1e-6
    ref["grads"]["W"] = ref["grads"]["W"] + 1e-6
    item, _ = gpu_stages.compare_training(config, overrides, "emulated", "float64", False, False, 2, ref)
    assert not item["ok"] and item["loss_errs"][1] > 1e-10 and item["grad_worst"] == "W"


@needs_cxx
def test_the_bench_stage_runs_on_the_emulated_device(tmp_path):
    out = tmp_path / "bench.json"
    assert gpu_stages.main(["bench", str(out), "--emulate", "--data", str(tmp_path)]) == 0
    res = json.loads(out.read_text())
    ours = [i for i in res["items"] if i["system"] == "minicavs"]
    assert [i["point"] for i in ours] == ["tree_lstm-h8-b4", "tree_fc-h8-b2-l8", "var_lstm-h8-b4"]
    for i in ours:
        assert i["train"] > 0 and i["infer"] > 0 and i["train_two_streams"] > 0 and i["launches_per_batch"] > 0
        assert len(i["train_rates"]) == 2 and i["units"] >= i["samples"] > 0
    peers = [i for i in res["items"] if i["system"] != "minicavs"]
    assert len(peers) == 3        # measured, or the reason it could not be (no torch here)


def test_the_bench_stage_starts_no_point_that_its_cap_leaves_no_time_for(tmp_path):
    out = tmp_path / "bench.json"
    assert gpu_stages.main(["bench", str(out), "--emulate", "--data", str(tmp_path), "--cap", "5"]) == 0
    res = json.loads(out.read_text())
    assert [i["point"] for i in res["items"]] == ["tree_lstm-h8-b4", "tree_fc-h8-b2-l8", "var_lstm-h8-b4"]
    assert all(i["error"].startswith("not run: the last point took 0 s, more than the 0 s left") for i in res["items"])


@needs_cxx
def test_the_facts_stage_times_rowop_block_per_row_against_one_thread_per_row(tmp_path):
    """The facts stage's rowop item (on a GPU: 64 x 10,000 float32 by CUDA events; here on the emulation,
    4 x 1,000, its times meaning nothing): the cross-entropy and its gradient by the kernel the loop launches,
    with the loop's geometry (one block per row, threads from the row length), and by the one thread per row
    of before, each equal to numpy."""
    from minicavs.cuda import issue
    out = tmp_path / "facts.json"
    assert gpu_stages.main(["facts", str(out), "--emulate"]) == 0
    rowop = json.loads(out.read_text())["facts"]["rowop"]
    assert rowop["emulated"] and rowop["ok"] and rowop["shape"] == [4, 1000]
    assert [(c["kernel"], c["fn"]) for c in rowop["cases"]] == [("new", 1), ("before", 1), ("new", 2), ("before", 2)]
    new = [c for c in rowop["cases"] if c["kernel"] == "new"]
    assert all((c["grid"], c["block"]) == (4, issue.library()[1].mc_rowop_threads(1000)) for c in new)
    assert all(c["rel_err"] <= 1e-5 and c["us"] > 0 for c in rowop["cases"])
    assert ", rowop 4x1000 f32 µs: cross-entropy " in gpu_check.stage_summary("facts", json.loads(out.read_text()))
