"""minicavs serve: concurrent clients get what predict gives for their lines, batched together; a bad request
fails alone; an oversized one is refused unread; SIGTERM finishes the requests in flight. 127.0.0.1 only."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from minicavs.train import artifact
from minicavs.train.predict import predict_lines
from tests.train.test_artifact import tiny_trainer

ROOT = Path(__file__).resolve().parents[2]
CLIENT_LINES = [["((the movie) (was great))"], ["(3 (2 it) (4 works))", "word"], ["(w1 (w2 w3))"],
                ["((a b) (c d))", "zz"], ["(a b c)"], ["(b a)"]]   # the fifth is bad: three children


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    trainer = tiny_trainer(tmp, hidden=8, embed=6)
    path = tmp / "tree.mcav"
    artifact.export(path, trainer.task, trainer.cfg)
    return trainer, path


def start(path: Path, *flags: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "minicavs", "serve", str(path), "--port", "0", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()   # "serving ... on http://127.0.0.1:PORT ..."
    assert "127.0.0.1:" in line, proc.stderr.read()
    return proc, int(line.split("127.0.0.1:")[1].split(" ")[0])


def post(port: int, body: bytes, timeout: float = 30) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def concurrently(port: int, bodies: list) -> list:
    answers: list = [None] * len(bodies)

    def send(i):
        answers[i] = post(port, bodies[i])
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return answers


def test_concurrent_clients_get_their_own_rows_batched_and_a_bad_request_fails_alone(model):
    trainer, path = model
    proc, port = start(path, "--max-wait-ms", "300", "--max-request-bytes", "4000")
    try:
        answers = concurrently(port, [json.dumps(lines).encode() for lines in CLIENT_LINES])
        for lines, (status, got) in zip(CLIENT_LINES, answers):
            if lines == ["(a b c)"]:
                assert status == 400 and got["error"].startswith("request:1: a node with 3 children")
                continue
            assert status == 200, got
            assert got["results"] == [{k: v for k, v in row.items() if k != "line"}
                                      for row in predict_lines(trainer.task, lines)]
        assert max(got["batch"]["requests"] for status, got in answers if status == 200) > 1
        status, got = post(port, b'"' + b"a" * 5000 + b'"')
        assert status == 413 and "5,002 bytes" in got["error"] and "at most 4,000" in got["error"]
        assert post(port, b'{"not": "a line"}')[0] == 400 and post(port, b"\xff")[0] == 400
        assert health(port)["status"] == "ok"
        assert post(port, b'"(one more)"')[0] == 200   # still serving after the refusals
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_sigterm_finishes_the_requests_in_flight(model):
    _, path = model
    proc, port = start(path, "--max-wait-ms", "1500")
    answers: list = []
    sender = threading.Thread(target=lambda: answers.extend(
        concurrently(port, [json.dumps(lines).encode() for lines in CLIENT_LINES[:3]])))
    sender.start()
    deadline = time.monotonic() + 30
    while health(port)["in_flight"] < 3 and time.monotonic() < deadline:   # all three wait in the batcher
        time.sleep(0.02)
    assert health(port)["in_flight"] == 3
    proc.send_signal(signal.SIGTERM)
    sender.join(60)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped" in err
    assert [status for status, _ in answers] == [200, 200, 200]


class SlowEcho:
    """A predictor that takes ``seconds`` per batch and records each batch's samples."""

    def __init__(self, seconds: float):
        self.seconds, self.batches = seconds, []

    def predict(self, samples, batch_size):
        self.batches.append(list(samples))
        time.sleep(self.seconds)
        return [{"text": s} for s in samples]


def test_a_busy_batcher_runs_what_queued_during_its_last_batch_without_waiting():
    """Under load the model must not idle for --max-wait-ms: the requests that queued while a batch ran form
    the next batch at once (an idle batcher's wait is for requests not yet sent)."""
    from minicavs.train.serve import Batcher
    echo = SlowEcho(0.3)
    batcher = Batcher(echo, max_batch=3, max_wait=5.0)
    try:
        first = batcher.submit(["a1", "a2", "a3"])   # a full batch: runs at once
        time.sleep(0.1)
        queued = [batcher.submit(["b"]), batcher.submit(["c"])]   # arrive while it runs
        first.result(10)
        done = time.monotonic()
        assert [rows for rows, _ in (f.result(10) for f in queued)] == [[{"text": "b"}], [{"text": "c"}]]
        assert time.monotonic() - done < 2.0 and echo.batches == [["a1", "a2", "a3"], ["b", "c"]]
    finally:
        batcher.stop()


def test_a_burst_of_new_connections_is_served(model):
    """64 clients connecting at once (a load test's keep-alive pool) are all accepted and answered."""
    _, path = model
    proc, port = start(path)
    try:
        start_at = time.monotonic()
        answers = concurrently(port, [json.dumps("(a b)").encode()] * 64)
        assert [a[0] if a else None for a in answers] == [200] * 64
        assert time.monotonic() - start_at < 20.0   # (no connection waits out a SYN retry storm)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_each_response_is_one_write_on_a_no_delay_socket(model, monkeypatch):
    """Headers and body written apart, the body waited for the client's delayed ACK of the headers (Nagle's
    algorithm): 40-50 ms a request, on a model that answers in 1 ms. Each response is one write, on sockets
    with TCP_NODELAY."""
    from minicavs.train import serve
    writes, nodelay = [], []
    setup = serve.Handler.setup

    def counted(self):
        setup(self)
        nodelay.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        write = self.wfile.write
        self.wfile.write = lambda data: writes.append(bytes(data)) or write(data)
    monkeypatch.setattr(serve.Handler, "setup", counted)
    server = serve.ModelServer(("127.0.0.1", 0), artifact.load(model[1], say=None), "m", 8, 0.0, 1 << 16)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    try:
        for path, body, status in [("/predict", b'"(a b)"', 200), ("/predict", b'"(a b c)"', 400),
                                   ("/nowhere", b'"x"', 404), ("/predict", b'["w", "(x y)"]', 200)]:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == status and json.loads(response.read())
    finally:
        conn.close()
        server.shutdown()
        server.server_close()
        server.batcher.stop()
        thread.join()
    assert len(nodelay) == 2 and all(nodelay)   # (the 404 closes its connection: its body was not read)
    assert len(writes) == 4 and all(w.startswith(b"HTTP/1.1 ") and w.endswith(b"}") for w in writes)


@pytest.mark.parametrize("flags, threads", [((), 1), (("--blas-threads", "2"), 2)])
def test_the_server_sets_its_own_blas_threads(model, flags, threads, monkeypatch):
    """Default one thread (the request threads and clients need the other cores), whatever OpenBLAS would
    pick from the environment; /health reads the count back from the library."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    proc, port = start(model[1], *flags)
    try:
        assert health(port)["blas_threads"] == threads
        assert post(port, b'"(a b)"')[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_a_bad_blas_thread_count_is_one_line_and_exit_2(model):
    done = subprocess.run([sys.executable, "-m", "minicavs", "serve", str(model[1]), "--blas-threads", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["minicavs serve: error: BLAS threads: 0 is not an integer >= 1"]
