"""``minicavs serve``: a model over HTTP, batching the requests that arrive close together through one schedule.

    minicavs serve tree_lstm.mcav --port 8000 --max-batch 64 --max-wait-ms 5
    curl -d '["((the movie) (was great))", "(a b)"]' http://127.0.0.1:8000/predict

``POST /predict`` takes JSON: one input line (a string) or a list of them; it answers
``{"results": [row per line], "batch": {"requests": r, "samples": k}}``, each row what ``minicavs predict
--json`` writes for the line. The lines are parsed in the request's own thread, so a bad one is a 400 with the
parser's message (naming ``request:LINE``) and never joins a batch; a body over ``--max-request-bytes`` is
refused (413) before it is read. Requests run in batches of at most ``--max-batch`` samples: when a batch ends,
every request queued meanwhile forms the next one at once; a request that finds the server idle waits
``--max-wait-ms`` for others to join it. Cavs merges a batch's graphs into one schedule, and each response
holds only its own request's rows. ``GET /health`` says the model, the requests in flight and the batches run so
far. SIGTERM (or Ctrl-C) stops accepting connections, finishes the requests in flight and exits 0.

The server is the standard library's threading HTTP server: no dependency to install, a thread per connection
that only parses and waits, while one batcher thread runs the model (its kernels are C and release nothing
to gain from more Python threads on 2 cores); HTTP/1.1 keep-alive for clients that send many requests.

The model computes with one BLAS thread unless ``--blas-threads`` says more (cpu/blas_threads.py sets it in the
running process; ``OPENBLAS_NUM_THREADS`` is read only when numpy loads OpenBLAS): the request threads and any
client on the machine need the other cores, and OpenBLAS's threads spin while they wait for each other, so once
another process holds a core each product stalls. On 2 busy cores (load average 3) one Tree-LSTM sentence at
hidden 512 took 132 ms with OpenBLAS's default 2 threads, 7.3 ms with one.

Each response is one write on a TCP_NODELAY socket: the standard library's handler writes the headers, then
the body, and the body then waited for the client's delayed ACK of the headers (Nagle's algorithm): 48 ms a
request on a model that answers in 1 ms.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from .. import set_blas_threads
from ..core.errors import DataError, MinicavsError
from ..data.text import is_blank

IDLE_SECONDS = 5.0   # a keep-alive connection idle this long is closed (so shutdown never waits longer)


class Batcher:
    """One thread that runs queued requests together. A busy batcher takes every request queued when its
    previous batch ends and runs them at once (up to ``max_batch`` samples): under load a batch is what arrived
    during the last one, and the model never idles while requests wait. An idle one, woken by a request,
    waits ``max_wait`` seconds for others to join it (at no cost to throughput: it had nothing to do)."""

    def __init__(self, predictor, max_batch: int, max_wait: float):
        self.predictor, self.max_batch, self.max_wait = predictor, max_batch, max_wait
        self.queue: queue.Queue = queue.Queue()
        self.batches = self.samples = 0   # run so far (GET /health: the mean batch a load gets)
        self.thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self.thread.start()

    def submit(self, samples: Sequence[Any]) -> Future:
        done: Future = Future()
        self.queue.put((list(samples), done))
        return done

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _loop(self) -> None:
        while True:
            try:
                batch, wait = [self.queue.get_nowait()], 0.0   # busy: what queued during the last batch
            except queue.Empty:
                batch, wait = [self.queue.get()], self.max_wait   # idle: woken by a request
            if batch[0] is None:
                return
            self._gather(batch, time.monotonic() + wait)
            self._run(batch)

    def _gather(self, batch: list, deadline: float) -> None:
        """Add requests to ``batch`` until ``max_batch`` samples, the queue is empty at ``deadline``, or the stop
        mark (put back: it stops the loop after this batch)."""
        count = len(batch[0][0])
        while count < self.max_batch:
            try:
                more = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if more is None:
                self.queue.put(None)
                break
            batch.append(more)
            count += len(more[0])

    def _run(self, batch: list) -> None:
        """All requests of ``batch`` as one prediction; if that fails, each alone, so that one request's
        failure reaches only that request."""
        samples = [s for request, _ in batch for s in request]
        try:
            rows = self.predictor.predict(samples, max(1, len(samples)))
        except Exception:   # (each alone below gets its own error)
            if len(batch) > 1:
                for one in batch:
                    self._run([one])
                return
            batch[0][1].set_exception(sys.exc_info()[1])
            return
        info = {"requests": len(batch), "samples": len(samples)}
        self.batches += 1
        self.samples += len(samples)
        start = 0
        for request, done in batch:
            done.set_result((rows[start:start + len(request)], info))
            start += len(request)


def parse_request(predictor, body: bytes) -> list:
    """The samples of a request body (a JSON string or list of strings); DataError naming the line if bad."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DataError(f"request: not JSON ({e})") from None
    lines = [payload] if isinstance(payload, str) else payload
    if not isinstance(lines, list) or not lines or not all(isinstance(x, str) for x in lines):
        raise DataError("request: expected an input line (a JSON string) or a non-empty list of them")
    samples = []
    for i, line in enumerate(lines, 1):
        if is_blank(line):
            raise DataError(f"request:{i}: a blank line")
        samples.append(predictor.parse_input(line, f"request:{i}"))
    return samples


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_SECONDS
    disable_nagle_algorithm = True   # (TCP_NODELAY: a response never waits for the ACK of the one before)
    server: "ModelServer"

    def log_message(self, format: str, *args) -> None:   # (quiet: one line per request is noise at load)
        pass

    def _reply(self, status: int, payload: dict) -> None:
        """The whole response (status line, headers, JSON body) in one write: written as headers then body, the
        body waited for the client's delayed ACK of the headers (Nagle's algorithm), 40 ms a request."""
        data = json.dumps(payload).encode("utf-8")
        if self.server.stopping.is_set():
            self.close_connection = True
        closing = self.close_connection
        head = (f"{self.protocol_version} {status} {HTTPStatus(status).phrase}\r\n"
                f"Date: {self.date_time_string()}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n" + ("Connection: close\r\n" if closing else "") + "\r\n")
        self.wfile.write(head.encode("latin-1") + data)

    def do_GET(self) -> None:
        if self.path != "/health":
            return self._reply(404, {"error": f"no {self.path}: GET /health or POST /predict"})
        self._reply(200, {"status": "stopping" if self.server.stopping.is_set() else "ok",
                          "model": self.server.name, "in_flight": self.server.in_flight,
                          "batches": self.server.batcher.batches, "samples": self.server.batcher.samples,
                          "blas_threads": self.server.blas_threads})

    def do_POST(self) -> None:
        if self.path != "/predict":
            self.close_connection = True   # (its body is not read: the connection cannot be reused)
            return self._reply(404, {"error": f"no {self.path}: POST /predict"})
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            return self._reply(411, {"error": "a request needs a Content-Length"})
        if int(length) > self.server.max_bytes:
            self.close_connection = True   # (the body is not read: the connection cannot be reused)
            return self._reply(413, {"error": f"request of {int(length):,} bytes; this server takes at most "
                                              f"{self.server.max_bytes:,} (--max-request-bytes)"})
        with self.server.counting():
            self._predict(int(length))

    def _predict(self, length: int) -> None:
        try:
            samples = parse_request(self.server.predictor, self.rfile.read(length))
        except DataError as e:
            return self._reply(400, {"error": str(e)})
        try:
            rows, info = self.server.batcher.submit(samples).result()
        except MinicavsError as e:
            return self._reply(400, {"error": str(e)})
        except Exception as e:   # a bug: the server keeps serving the others
            return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
        self._reply(200, {"results": rows, "batch": info})


class ModelServer(ThreadingHTTPServer):
    daemon_threads = False   # server_close joins the handler threads: requests in flight finish
    block_on_close = True
    request_queue_size = 128   # the listen backlog (the standard library's 5 resets a burst of new connections)

    def __init__(self, address, predictor, name: str, max_batch: int, max_wait: float, max_bytes: int):
        super().__init__(address, Handler)
        self.predictor, self.name, self.max_bytes = predictor, name, max_bytes
        self.batcher = Batcher(predictor, max_batch, max_wait)
        self.stopping = threading.Event()
        self.in_flight = 0   # predict requests read and not yet answered
        self.blas_threads: int | None = None   # what run() set (GET /health); None: left as the library had it
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def counting(self):
        with self._lock:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def stop_soon(self, *_) -> None:
        """From a signal handler: stop accepting (serve_forever returns); run() then drains what is in flight."""
        if not self.stopping.is_set():
            self.stopping.set()
            threading.Thread(target=self.shutdown, daemon=True).start()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODEL.mcav|RUN_DIR", help="a model file written by minicavs export, or a "
                   "run dir (its config and best checkpoint)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this "
                   "machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port (printed)")
    p.add_argument("--max-batch", type=int, default=64, help="samples per batch at most (default 64)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a request that finds the server "
                   "idle waits for others to join its batch (default 5 ms; a busy server runs what queued at once)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies are refused "
                   "(413) unread (default 1 MiB)")
    p.add_argument("--blas-threads", type=int, default=1, help="threads numpy's BLAS (the model's products) "
                   "computes with (default 1: the request threads and clients need the other cores, and "
                   "OpenBLAS's threads spin while they wait, stalling once another process holds a core)")


def _predictor(target: str):
    from .artifact import SUFFIX, load
    if target.endswith(SUFFIX):
        return load(target)
    from .trainer import Trainer
    return Trainer.for_target(target)[0].task


def run(args: argparse.Namespace) -> int:
    from .predict import PredictError
    if args.max_batch < 1 or args.max_wait_ms < 0 or args.max_request_bytes < 1:
        raise PredictError("--max-batch and --max-request-bytes must be >= 1, --max-wait-ms >= 0")
    blas = set_blas_threads(args.blas_threads)
    predictor = _predictor(args.target)
    if not predictor.predicts:
        raise PredictError(f"{args.target}: this model does not predict from text input")
    server = ModelServer((args.host, args.port), predictor, args.target, args.max_batch,
                         args.max_wait_ms / 1000, args.max_request_bytes)
    server.blas_threads = args.blas_threads   # (set and read back from the library above)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.stop_soon)
    host, port = server.server_address[:2]
    print(f"serving {args.target} on http://{host}:{port} (POST /predict, GET /health; max batch "
          f"{args.max_batch}, max wait {args.max_wait_ms:g} ms, {args.blas_threads} BLAS thread(s) via {blas})",
          flush=True)
    server.serve_forever()
    server.server_close()   # joins the handler threads: the requests in flight get their answers
    server.batcher.stop()
    print("minicavs serve: stopped", file=sys.stderr, flush=True)
    return 0
