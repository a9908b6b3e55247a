"""What every peer script (tools/dynet_*.py, tools/torch_*.py) shares, whatever its framework: reading the
spec, the timed protocol and the JSON line it prints last. The protocol itself (spec keys, output keys) is
documented once, in minicavs/bench/peers.py.

Imported by the peer scripts, which run in the peers' own environment (tools/setup_peers.sh) and import
nothing from minicavs; the scripts' directory is on sys.path, so ``from peer_common import ...`` works.
"""
import json
import platform
import resource
import sys
import time


def read_spec() -> dict:
    """The spec.json named on the command line (``python tools/PEER.py SPEC.json``)."""
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} SPEC.json")
    with open(sys.argv[1]) as f:
        return json.load(f)


def _nothing() -> None:
    pass


def _epochs(step, batches: list, units: int, epochs: int, prefix: str = "", sync=_nothing) -> dict:
    """``epochs`` runs of ``step`` over ``batches``: units per second of each, and the summed breakdown when
    ``step`` returns one (keys ``rates``, ``construction_s``, ``compute_s``, each after ``prefix``).
    ``sync()`` waits for the device before each clock read (work queued on a GPU is not done when the
    step returns)."""
    rates, split = [], []
    for _ in range(epochs):
        total = None
        sync()
        start = time.perf_counter()
        for batch in batches:
            got = step(batch)
            if got is not None:
                total = [a + b for a, b in zip(total, got)] if total else list(got)
        sync()
        rates.append(units / (time.perf_counter() - start))
        split.append(total)
    out = {prefix + "rates": rates}
    if split and split[0] is not None:
        out[prefix + "construction_s"], out[prefix + "compute_s"] = [s[0] for s in split], [s[1] for s in split]
    return out


def _timed(step, batch, sync=_nothing) -> float:
    sync()
    start = time.perf_counter()
    step(batch)
    sync()
    return time.perf_counter() - start


WHOLE_BATCH_GRACE = 4   # a batch projected to take up to this many caps still runs whole (see measure)


def measure(spec: dict, units: list, make, train, infer=None, sync=_nothing) -> dict:
    """The timed protocol over the samples (``units[i]`` trees or words in sample i).

    ``make(i, j)`` is the batch of samples i..j-1 as ``train`` and ``infer`` take it; ``train(batch)`` runs
    forward, backward and update, ``infer(batch)`` the forward pass only. Either may return a
    ``(construction_s, compute_s)`` pair (DyNet's graph building vs its forward/backward/update), summed per
    epoch. ``sync()`` waits until the device has finished the work issued so far (a GPU peer's
    ``torch.cuda.synchronize``): it runs before every clock read.

    Warm-up: one sample (one-time costs, cheaply); with ``max_seconds``, then the first 1, 2, 4, ... samples
    up to a whole batch, each run timed, stopping early once a run took half of ``max_seconds``; a whole
    batch is still run when the last run's rate says it takes at most ``WHOLE_BATCH_GRACE`` times the cap
    (batched peers, whose rate is only comparable on whole batches). If a whole batch ran, an epoch is the
    longest prefix of whole batches that its time says fits in ``max_seconds`` (at least one); if not (one
    batch takes far longer than the cap, e.g. per-sample recursion on big trees), an epoch is one partial
    batch of the samples the last run's rate says fit (``partial_batch``). Without ``max_seconds``: every
    sample.
    Then ``epochs`` timed epochs over that prefix; with ``inference``, a one-sample forward pass to warm up
    and ``epochs`` forward-only passes over the same prefix.
    """
    n, bs, cap = len(units), spec["batch"], spec.get("max_seconds")
    full = min(bs, n)
    train(make(0, 1))
    m = n
    if cap:
        size, seconds = 1, _timed(train, make(0, 1), sync)
        while size < full and seconds < cap / 2:
            size = min(2 * size, full)
            seconds = _timed(train, make(0, size), sync)
        if size < full and seconds * full / size <= WHOLE_BATCH_GRACE * cap:
            size, seconds = full, _timed(train, make(0, full), sync)
        if size == full:
            m = min(n, max(1, int(cap / max(seconds, 1e-9))) * bs)
        else:
            m = max(1, min(full, int(size * cap / seconds)))
    batches = [make(i, min(i + bs, m)) for i in range(0, m, bs)]
    used = sum(units[:m])
    out = {"units": used, "samples": m, "batches": len(batches), "partial_batch": m < full, "capped": m < n}
    out.update(_epochs(train, batches, used, spec["epochs"], sync=sync))
    if spec.get("inference"):
        if infer is None:
            raise ValueError("this peer has no inference mode")
        infer(make(0, 1))
        out.update(_epochs(infer, batches, used, spec["epochs"], "infer_", sync))
    return out


def _peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM on Linux, since ru_maxrss there carries the forking
    parent's peak over exec (a peer started by a 400 MB benchmark would report at least 400 MB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux, bytes on macOS
    return peak / 2 ** 20 if sys.platform == "darwin" else peak / 1024


def report(spec: dict, check_loss: float, timing: dict, **extra) -> None:
    """Print the JSON line (the last line of stdout) with the process's peak resident memory and versions."""
    import numpy
    versions = {"python": platform.python_version(), "numpy": numpy.__version__, **extra.pop("versions", {})}
    peak_mb = _peak_rss_mb()
    print(json.dumps({"check_loss": float(check_loss), "check": spec["check"], "mode": spec["mode"],
                      "epochs": spec["epochs"], "max_seconds": spec.get("max_seconds"), **timing,
                      "peak_rss_mb": round(peak_mb, 1), "versions": versions, **extra}), flush=True)
