"""tools/serve_load.py's client against an in-process server on 127.0.0.1: open and closed loop, every request
answered, latencies and CPU seconds reported; its table has a row per measurement."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from minicavs.train import artifact
from minicavs.train.serve import ModelServer
from tests.train.test_artifact import tiny_trainer

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import serve_load  # noqa: E402

LINES = ["((the movie) (was great))", "(3 (2 it) (4 works))", "word"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    trainer = tiny_trainer(tmp, hidden=4, embed=4)
    artifact.export(tmp / "m.mcav", trainer.task, trainer.cfg)
    return tmp / "m.mcav"


@pytest.fixture(scope="module")
def server(model_file):
    srv = ModelServer(("127.0.0.1", 0), artifact.load(model_file), "m", 8, 0.002, 1 << 16)
    thread = threading.Thread(target=srv.serve_forever)
    thread.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()
    srv.batcher.stop()
    thread.join()


@pytest.mark.parametrize("rate", [0.0, 40.0])
def test_the_client_sends_for_the_time_given_and_counts_every_answer(server, rate):
    row = serve_load.client(server, LINES, rate, 0.5, 3)
    assert row["errors"] == 0 and row["done"] == row["sent"] > 0
    assert 0 < row["p50_ms"] <= row["p99_ms"] and row["client_cpu_s"] > 0
    if rate:
        assert row["sent"] == 20   # due every 25 ms for 0.5 s


def test_the_table_has_a_row_per_measurement():
    rows = [{"server": "max-batch 1", "offered": 0, "throughput": 10.0, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0,
             "mean_batch": 1.0, "client_cpu_s": 0.1, "server_cpu_s": 0.9, "load_before": 2.5},
            {"server": "batching", "offered": 20.0, "throughput": 19.5, "p50_ms": 3.0, "p99_ms": 9.0, "errors": 1,
             "mean_batch": 6.25, "client_cpu_s": 0.2, "server_cpu_s": 0.8, "load_before": 3.0}]
    lines = serve_load.table(rows).splitlines()
    assert len(lines) == 4 and "| max-batch 1 | closed loop | 10.0 |" in lines[2]
    assert lines[3] == "| batching | 20.0 | 19.5 | 3.0 | 9.0 | 1 | 6.2 | 0.2 / 0.8 | 3.0 |"


def test_the_service_curve_times_the_same_samples_at_each_batch_size(model_file):
    curve = serve_load.service_curve(str(model_file), LINES, [1, 2, 4], samples=8)
    assert [r["batch"] for r in curve] == [1, 2, 4]
    for r in curve:
        assert r["service_ms"] > 0
        assert r["per_sample_ms"] * 8 == pytest.approx(r["service_ms"] * (8 // r["batch"]))
        assert r["max_rate"] == pytest.approx(1e3 / r["per_sample_ms"])
    assert len(serve_load.curve_table(curve).splitlines()) == 2 + 3


def test_the_latency_floor_is_the_smallest_batch_that_keeps_up():
    curve = [{"batch": 1, "service_ms": 5.0, "max_rate": 200.0}, {"batch": 8, "service_ms": 20.0, "max_rate": 400.0},
             {"batch": 16, "service_ms": 32.0, "max_rate": 500.0}]
    assert serve_load.latency_floor(curve, 450.0) == (
        "450.0 requests/s: one model thread keeps up only with batches of >= 16 (32.0 ms CPU each), so a request "
        "waits >= 32.0 ms for its own batch and up to 64.0 ms with the one in progress")
    assert serve_load.latency_floor(curve, 150.0).startswith("150.0 requests/s: one model thread keeps up only "
                                                             "with batches of >= 1 (5.0 ms")
    assert serve_load.latency_floor(curve, 600.0) == ("600.0 requests/s: no batch size measured keeps up (at most "
                                                      "500.0/s)")


def test_the_tool_measures_the_curve_in_a_process_of_its_own(model_file, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(LINES) + "\n")
    curve = serve_load.curve_in_child(str(model_file), str(lines))
    assert [r["batch"] for r in curve] == serve_load.SIZES and all(r["max_rate"] > 0 for r in curve)


@pytest.mark.parametrize("as_user", [False, True])
def test_the_tool_names_the_blas_it_ran_with_and_unsets_the_forced_kernel_as_a_user(tmp_path, as_user):
    """The header names the BLAS and the variables set; --as-user re-runs the tool with them unset (the servers
    and the client inherit that environment). A missing model stops it right after the header."""
    import os
    import subprocess
    env = {**os.environ, "OPENBLAS_CORETYPE": "Haswell"}
    done = subprocess.run([sys.executable, str(TOOLS / "serve_load.py"), str(tmp_path / "missing.mcav"),
                           str(tmp_path / "lines.txt"), *(["--as-user"] if as_user else [])],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2])
    header = done.stdout.splitlines()[0]
    assert done.returncode != 0 and header.startswith("BLAS: ")
    if as_user:
        assert header.endswith("OPENBLAS_*/OMP_*/MKL_* set: none.")
        assert "--as-user: unset OPENBLAS_CORETYPE" in done.stderr
    else:
        assert "OPENBLAS_CORETYPE=Haswell" in header
