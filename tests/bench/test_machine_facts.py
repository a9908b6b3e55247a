"""What a benchmark record says it ran on (minicavs/bench/machine_facts.py): BLAS, CPU, variables, a forced kernel,
and ``minicavs bench --as-user``."""
from __future__ import annotations

import os
import sys

import pytest

from minicavs.bench import machine_facts as machine

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16
"""


def _openblas(kernel: str) -> list[dict]:
    """threadpoolctl's answer for numpy's OpenBLAS running ``kernel``."""
    return [{"user_api": "blas", "internal_api": "openblas", "num_threads": 2, "prefix": "libscipy_openblas",
             "version": "0.3.31", "threading_layer": "pthreads", "architecture": kernel},
            {"user_api": "openmp", "internal_api": "openmp", "num_threads": 2, "version": None}]


@pytest.fixture
def amd(tmp_path, monkeypatch):
    """An AVX-512 CPU whose OpenBLAS runs the kernel the test sets (threadpoolctl and /proc/cpuinfo faked)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    monkeypatch.setattr(machine.cpu, "__defaults__", (str(tmp_path / "cpuinfo"),))
    for name in list(os.environ):
        if name.startswith(machine.PREFIXES):
            monkeypatch.delenv(name)

    def running(kernel: str) -> None:
        monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: _openblas(kernel))
    running("SkylakeX")
    return running


def test_records_name_the_blas_the_cpu_and_every_blas_variable(amd, monkeypatch):
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "1048576")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("MKL_DEBUG_CPU_TYPE", "5")
    monkeypatch.setenv("OPENBLASX", "not one of them")
    f = machine.facts()
    assert f["blas"] == [{"library": "openblas", "version": "0.3.31", "kernel": "SkylakeX", "threads": 2}]
    assert f["cpu"] == {"model": "AMD EPYC 9R14 96-Core Processor",
                        "vector": ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"]}
    assert f["env"] == {"MKL_DEBUG_CPU_TYPE": "5", "OMP_NUM_THREADS": "2", "OPENBLAS_L2_SIZE": "1048576"}
    line = machine.describe(f)
    assert "openblas 0.3.31, kernel SkylakeX, 2 thread(s)" in line and "AMD EPYC 9R14" in line
    assert "avx512f" in line and "OPENBLAS_L2_SIZE=1048576" in line and "\n" not in line
    assert machine.forced_kernel_warning(f) is None   # nothing forced


@pytest.mark.parametrize("forced,running,warned", [
    ("Haswell", "Haswell", True),            # AVX2 kernels on an AVX-512 CPU
    ("sandybridge", "Sandybridge", True),
    ("SkylakeX", "SkylakeX", False),         # forced, but the CPU's own level
    ("Haswell", "SkylakeX", False),          # the variable did not take: the running kernel decides
])
def test_a_forced_kernel_older_than_the_cpu_is_reported(amd, monkeypatch, forced, running, warned):
    monkeypatch.setenv("OPENBLAS_CORETYPE", forced)
    amd(running)
    warning = machine.forced_kernel_warning(machine.facts())
    assert (warning is not None) == warned
    if warned:
        assert f"OPENBLAS_CORETYPE={forced}" in warning and "avx512f" in warning and "--as-user" in warning


def test_bench_warns_on_stderr_in_one_line_and_the_summary_says_it(amd, monkeypatch, tmp_path, capsys):
    from minicavs.bench import suite
    from minicavs.bench.workloads import Data
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    amd("Haswell")
    monkeypatch.setattr(suite, "machine_rate", lambda n: 1e11)
    monkeypatch.setattr(suite, "core_rate", lambda n: 5e10)
    s = suite.Settings(models=("tree_fc",), quick=True, cap=0.05, repeats=1, data=Data(), out=tmp_path,
                       sweeps=False, ablation=False, plots=False, log=lambda *a: None)
    summary = suite.run_suite(s).read_text()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: OPENBLAS_CORETYPE=Haswell")
    assert err[0] in summary and "kernel Haswell" in summary and "OPENBLAS_CORETYPE=Haswell" in summary
    recorded = __import__("json").loads((tmp_path / "results.json").read_text())
    assert recorded["machine"]["blas"][0]["kernel"] == "Haswell"
    assert recorded["gemm"] == {"machine": [1e11, 1e11], "core": [5e10, 5e10]}


def test_as_user_reruns_the_command_without_the_blas_variables(monkeypatch):
    from minicavs.bench import as_user
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MINICAVS_TORCH_PYTHON", "/p/bin/python")
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    as_user(["--quick", "--as-user"])
    (path, argv, env), = calls
    assert path == sys.executable and argv[1:] == ["-m", "minicavs", "bench", "--quick", "--as-user"]
    assert not any(k.startswith(("OPENBLAS_", "OMP_", "MKL_")) for k in env)
    assert env["MINICAVS_TORCH_PYTHON"] == "/p/bin/python" and os.environ["OPENBLAS_CORETYPE"] == "Haswell"
    calls.clear()
    for name in ("OPENBLAS_CORETYPE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name)
    for name in [n for n in os.environ if n.startswith(machine.PREFIXES)]:
        monkeypatch.delenv(name)
    as_user(["--quick"])   # nothing to unset: runs on, no second process
    assert calls == []


def test_as_user_keeps_the_machines_variables_for_the_forced_kernel_runs(monkeypatch):
    """The rerun's environment lacks the variables but names them in MACHINE_ENV, which machine_env reads back
    (and keeps across a further user_env); without it machine_env is the variables set now; a MACHINE_ENV that
    is not a JSON object of strings is refused, naming it."""
    from minicavs.bench import as_user
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "1048576")
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append(env))
    as_user(["--as-user", "--forced-kernel"])
    (env,) = calls
    machine_set = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576"}
    assert machine.machine_env() == machine_set and not machine.blas_env(env)
    assert machine.machine_env(env) == machine_set == machine.machine_env(machine.user_env(env))
    for bad in ("not json", '["OPENBLAS_CORETYPE"]', '{"OPENBLAS_CORETYPE": 5}'):
        with pytest.raises(ValueError, match=f"^{machine.MACHINE_ENV}: expected a JSON object of strings"):
            machine.machine_env({machine.MACHINE_ENV: bad})
