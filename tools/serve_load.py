"""Load test of ``minicavs serve`` (issue 49): per-request saturated throughput R, then R, 2R, 3R offered.

    minicavs export models/tree_lstm_sst.yaml --set model.hidden=512 -o sst512.mcav
    python tools/serve_load.py sst512.mcav ../shared/data/sst/test.txt --seconds 10

1. A server with ``--max-batch 1`` (every request alone) and a closed-loop client (``--connections``
   keep-alive connections, each sending its next request when the last is answered): its throughput is R.
2. The same server, then a batching one (``--max-batch``, ``--max-wait-ms``), each offered R, 2R and 3R
   requests per second by an open-loop client (requests due at fixed intervals whatever the answers; latency
   counted from when a request was due, so a server that falls behind shows it).

The client runs in its own process (this file with ``--client``) on the same machine; each row says how the
CPU seconds of the run split between client and server (from /proc). One line of the input per request,
cycling. Results: a table on stdout, and JSON with ``--out``.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np

from minicavs.bench import machine_facts as machine

SIZES = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]   # batch sizes of the service curve


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


# --- the client (its own process) ---------------------------------------------------------------------

def client(port: int, lines: list, rate: float, seconds: float, connections: int) -> dict:
    """Send for ``seconds``: closed loop if ``rate`` is 0, else open loop at ``rate`` requests/s."""
    due: queue.Queue = queue.Queue()
    latencies, errors = [], [0]
    lock = threading.Lock()
    start = time.monotonic()
    end = start + seconds

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        i = k
        while True:
            when = time.monotonic() if rate == 0 else due.get()
            if when is None or when >= end:
                break
            body = json.dumps(lines[i % len(lines)]).encode()
            i += connections
            try:
                conn.request("POST", "/predict", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                ok = response.status == 200
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                ok = False
            with lock:
                if ok:
                    latencies.append(time.monotonic() - when)
                else:
                    errors[0] += 1
        conn.close()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(connections)]
    for t in threads:
        t.start()
    sent = 0
    if rate > 0:
        while True:
            when = start + sent / rate
            if when >= end:
                break
            time.sleep(max(0.0, when - time.monotonic()))
            due.put(when)
            sent += 1
        for _ in threads:
            due.put(None)
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    lat = np.array(latencies) * 1000
    return {"offered": rate, "sent": sent or len(latencies) + errors[0], "done": len(latencies),
            "errors": errors[0], "throughput": len(latencies) / elapsed,
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
            "client_cpu_s": _cpu_seconds(os.getpid())}


# --- the driver -----------------------------------------------------------------------------------------

def start_server(model: str, flags: list, blas_threads: int | None = None) -> tuple[subprocess.Popen, int]:
    threads = [] if blas_threads is None else ["--blas-threads", str(blas_threads)]
    proc = subprocess.Popen([sys.executable, "-m", "minicavs", "serve", model, "--port", "0", *flags, *threads],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "127.0.0.1:" not in line:
        proc.kill()
        raise SystemExit(f"serve_load: the server did not start: {line!r}")
    return proc, int(line.split("127.0.0.1:")[1].split(" ")[0])


def _health(port: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def measure(port: int, server: subprocess.Popen, args, rate: float) -> dict:
    """One run of the client against the server; with the server's CPU seconds, its mean batch (samples) and
    the machine's load average before the run (other processes share the cores)."""
    load = os.getloadavg()[0]
    before, ran = _cpu_seconds(server.pid), _health(port)
    done = subprocess.run([sys.executable, __file__, "--client", str(port), args.lines, str(rate),
                           str(args.seconds), str(args.connections)], capture_output=True, text=True, check=True)
    row = json.loads(done.stdout)
    row["server_cpu_s"] = _cpu_seconds(server.pid) - before
    after = _health(port)
    row["mean_batch"] = (after["samples"] - ran["samples"]) / max(1, after["batches"] - ran["batches"])
    row["load_before"] = load
    return row


def run_server(args, flags: list, rates: list, label: str) -> list:
    proc, port = start_server(args.model, flags, args.server_blas_threads)
    try:
        measure(port, proc, argparse.Namespace(**{**vars(args), "seconds": 1.0}), rates[0] or 0)   # warm-up
        return [{"server": label, **measure(port, proc, args, rate)} for rate in rates]
    finally:
        proc.terminate()
        proc.wait(60)


def service_curve(model: str, lines: list, sizes: list, samples: int = 192) -> list:
    """Per batch size B, the model's own serial work in the server (``predict``: schedule, bind, the C run,
    rendering) for the same ``samples`` lines in batches of B, in CPU seconds with one BLAS thread (what the
    server runs with; CPU time, so the other sessions' load does not count): S(B) per batch, per sample, and
    the rate B / S(B) one model thread can sustain. Parsing is left out: it runs in the request threads."""
    from minicavs import load
    from minicavs.cpu.blas_threads import set_blas_threads
    set_blas_threads(1)
    predictor = load(model, say=None)
    parsed = [predictor.parse_input(lines[i % len(lines)], f"line {i % len(lines) + 1}") for i in range(samples)]
    rows = []
    for size in sizes:
        predictor.predict(parsed[:size], size)   # (warm: a first batch of a size plans its buffers)
        start = time.process_time()
        for i in range(0, samples, size):
            predictor.predict(parsed[i:i + size], size)
        seconds = time.process_time() - start
        batches = -(-samples // size)
        rows.append({"batch": size, "service_ms": 1e3 * seconds / batches, "per_sample_ms": 1e3 * seconds / samples,
                     "max_rate": samples / seconds})
    return rows


def curve_in_child(model: str, lines: str) -> list:
    """:func:`service_curve` in a process of its own that imports minicavs as the servers do (``-c``, like
    ``-m``, looks in the current directory first) and whose BLAS setting stays its own."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import serve_load as s; "
            "print(json.dumps(s.service_curve(sys.argv[2], s._lines(sys.argv[3]), s.SIZES)))")
    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), model, lines],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def latency_floor(curve: list, rate: float) -> str:
    """What ``curve`` says of serving ``rate`` with one model thread: the smallest batch that keeps up, whose
    service time every request in it waits (and a request arriving during the batch before waits for that
    too: up to twice as long)."""
    enough = [r for r in curve if r["max_rate"] >= rate]
    if not enough:
        return f"{rate:.1f} requests/s: no batch size measured keeps up (at most {curve[-1]['max_rate']:.1f}/s)"
    r = enough[0]
    return (f"{rate:.1f} requests/s: one model thread keeps up only with batches of >= {r['batch']} "
            f"({r['service_ms']:.1f} ms CPU each), so a request waits >= {r['service_ms']:.1f} ms for its own batch "
            f"and up to {2 * r['service_ms']:.1f} ms with the one in progress")


def curve_table(curve: list) -> str:
    out = ["| batch | service ms CPU | ms CPU per sample | max requests/s |", "|---|---|---|---|"]
    out += [f"| {r['batch']} | {r['service_ms']:.1f} | {r['per_sample_ms']:.2f} | {r['max_rate']:.1f} |" for r in curve]
    return "\n".join(out)


def table(rows: list) -> str:
    head = ("| server | offered req/s | throughput req/s | p50 ms | p99 ms | errors | mean batch | "
            "CPU s client / server | load avg before |")
    out = [head, "|" + "---|" * 9]
    for r in rows:
        offered = "closed loop" if r["offered"] == 0 else f"{r['offered']:.1f}"
        out.append(f"| {r['server']} | {offered} | {r['throughput']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                   f"{r['errors']} | {r['mean_batch']:.1f} | {r['client_cpu_s']:.1f} / {r['server_cpu_s']:.1f} | "
                   f"{r['load_before']:.1f} |")
    return "\n".join(out)


def as_user() -> None:
    """This script again with the BLAS variables unset (numpy reads them once, when it loads; the servers, the
    client and the service curve's child inherit the environment); returns when none is set."""
    if machine.blas_env():
        print("--as-user: unset " + " ".join(machine.blas_env()), file=sys.stderr, flush=True)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], machine.user_env())


def _lines(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--client":
        port, path, rate, seconds, connections = sys.argv[2:7]
        print(json.dumps(client(int(port), _lines(path), float(rate), float(seconds), int(connections))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a model file (minicavs export)")
    p.add_argument("lines", help="input lines, one request each (cycled)")
    p.add_argument("--seconds", type=float, default=10.0, help="per measurement (default 10)")
    p.add_argument("--connections", type=int, default=64, help="client keep-alive connections (default 64: an "
                   "open-loop client needs offered rate x latency of them, or it caps the throughput itself)")
    p.add_argument("--server-blas-threads", type=int, default=None, help="the server's --blas-threads "
                   "(default: the server's default, 1)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--as-user", action="store_true", help="run the driver, the servers and the client as a user's "
                   "machine does: every OPENBLAS_*, OMP_* and MKL_* variable unset (as minicavs bench --as-user)")
    args = p.parse_args(argv)
    if args.as_user:
        as_user()
    print(machine.describe(machine.facts()), flush=True)
    one = ["--max-batch", "1", "--max-wait-ms", "0"]
    saturated = run_server(args, one, [0], "max-batch 1")
    R = saturated[0]["throughput"]
    rates = [R, 2 * R, 3 * R]
    rows = saturated + run_server(args, one, rates, "max-batch 1")
    rows += run_server(args, ["--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)], rates,
                       f"batching ({args.max_batch}, {args.max_wait_ms:g} ms)")
    print(f"R (per-request saturated throughput, max-batch 1): {R:.1f} requests/s")
    print(table(rows), flush=True)
    curve = curve_in_child(args.model, args.lines)
    print("\nThe model's service time by batch size (tools/serve_load.py service_curve):")
    print(curve_table(curve))
    for k in (1, 2, 3):
        print(f"- {k}R = {latency_floor(curve, k * R)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "service_curve": curve}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
