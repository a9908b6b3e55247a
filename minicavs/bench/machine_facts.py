"""What a benchmark ran on: numpy's BLAS (library, version, kernel, threads), the CPU (model, vector
extensions) and every ``OPENBLAS_*`` / ``OMP_*`` / ``MKL_*`` variable set.

Why: the same code runs 19-30% slower when ``OPENBLAS_CORETYPE=Haswell`` forces AVX2 kernels on an AVX-512
CPU, and a record that does not say which kernel ran cannot be compared with a user's machine.
The kernel is threadpoolctl's ``architecture`` (``pip install "minicavs[bench]"``); without threadpoolctl the
record says so instead of guessing.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

PREFIXES = ("OPENBLAS_", "OMP_", "MKL_")
# vector extensions worth naming, in /proc/cpuinfo's spelling
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx_vnni", "amx_tile")
# ISA level an OpenBLAS kernel needs (its core names, lower case); 0 = SSE-only kernels
KERNEL_LEVEL = {**dict.fromkeys(("prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "barcelona"), 0),
                **dict.fromkeys(("sandybridge", "bulldozer", "piledriver", "steamroller"), 1),
                **dict.fromkeys(("haswell", "zen", "excavator"), 2),
                **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), 3)}
LEVEL_FLAG = ("sse4_2", "avx", "avx2", "avx512f")   # the flag each level needs (index = level)


def blas_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``OPENBLAS_*``, ``OMP_*`` and ``MKL_*`` variable set, sorted by name."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith(PREFIXES)}


def user_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` without those variables: the environment a user's machine runs the benchmark in, and
    (:data:`MACHINE_ENV`) the variables it left out, for :func:`machine_env`."""
    env = os.environ if environ is None else environ
    kept = {k: v for k, v in env.items() if not k.startswith(PREFIXES)}
    return {**kept, MACHINE_ENV: json.dumps(machine_env(env))}


# where ``minicavs bench --as-user`` keeps the variables it unset (JSON), so that ``--forced-kernel`` can time
# the machine's own settings beside a user's
MACHINE_ENV = "MINICAVS_BENCH_MACHINE_ENV"


def machine_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The machine's ``OPENBLAS_*`` / ``OMP_*`` / ``MKL_*`` variables: those :func:`user_env` left out when this
    process was started without them, else those set now. A :data:`MACHINE_ENV` that is not a JSON object of
    strings is refused, naming it."""
    env = os.environ if environ is None else environ
    if MACHINE_ENV not in env:
        return blas_env(env)
    try:
        kept = json.loads(env[MACHINE_ENV])
    except ValueError:
        kept = None
    if not isinstance(kept, dict) or not all(isinstance(v, str) for v in kept.values()):
        raise ValueError(f"{MACHINE_ENV}: expected a JSON object of strings, got {env[MACHINE_ENV][:80]!r}")
    return blas_env(kept)


def cpu(path: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name and the vector extensions of :data:`VECTOR_FLAGS` it has ("unknown" / [] where
    ``path`` cannot be read, e.g. off Linux)."""
    model, flags = "unknown", set()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "vector": [f for f in VECTOR_FLAGS if f in flags]}


def blas() -> list[dict]:
    """numpy's BLAS libraries as threadpoolctl sees them (library, version, kernel, threads); one entry
    saying why when threadpoolctl is not installed."""
    import numpy  # noqa: F401  (loads the BLAS that threadpoolctl inspects)
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return [{"library": "unknown", "version": "unknown", "kernel": "unknown", "threads": None,
                 "note": 'threadpoolctl is not installed (pip install "minicavs[bench]")'}]
    return [{"library": i.get("internal_api"), "version": i.get("version"), "kernel": i.get("architecture"),
             "threads": i.get("num_threads")} for i in threadpool_info() if i.get("user_api") == "blas"]


def facts(environ: Mapping[str, str] | None = None) -> dict:
    """Everything a record names about what it ran on (:func:`blas`, :func:`cpu`, :func:`blas_env`)."""
    return {"blas": blas(), "cpu": cpu(), "env": blas_env(environ)}


def describe(f: dict) -> str:
    """One line of :func:`facts` for tables and logs."""
    libs = "; ".join(f"{b['library']} {b['version']}, kernel {b['kernel']}, {b['threads']} thread(s)"
                     + (f" ({b['note']})" if b.get("note") else "") for b in f["blas"]) or "no BLAS found"
    env = ", ".join(f"{k}={v}" for k, v in f["env"].items()) or "none"
    return (f"BLAS: {libs}. CPU: {f['cpu']['model']} ({', '.join(f['cpu']['vector']) or 'no vector flags read'})."
            f" OPENBLAS_*/OMP_*/MKL_* set: {env}.")


def load_average() -> str:
    """The machine's load averages over 1, 5 and 15 minutes ("0.6/0.9/1.1"; "unknown" where the platform
    keeps none): every record says how busy the machine was while it measured."""
    try:
        return "%.1f/%.1f/%.1f" % os.getloadavg()
    except OSError:
        return "unknown"


def _cpu_level(vector: list) -> int:
    return max((i for i, flag in enumerate(LEVEL_FLAG) if flag in vector), default=0)


def forced_kernel_warning(f: dict) -> str | None:
    """One line when ``OPENBLAS_CORETYPE`` forces a kernel (the one running, else the variable's) for an
    older ISA than the CPU has; None otherwise (not forced, or a kernel this table does not know)."""
    forced = f["env"].get("OPENBLAS_CORETYPE")
    if not forced:
        return None
    kernel = next((b["kernel"] for b in f["blas"] if b["library"] == "openblas" and b.get("kernel")), forced)
    level, best = KERNEL_LEVEL.get(str(kernel).lower()), _cpu_level(f["cpu"]["vector"])
    if level is None or level >= best:
        return None
    return (f"warning: OPENBLAS_CORETYPE={forced} makes numpy's OpenBLAS run {kernel} ({LEVEL_FLAG[level]}) "
            f"kernels on a CPU with {LEVEL_FLAG[best]}: a user's machine runs faster ones (minicavs bench "
            f"--as-user unsets it for the benchmark)")
