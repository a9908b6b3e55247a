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


def _epochs(step, batches: list, units: list, epochs: int, prefix: str = "", sync=_nothing, cap=None) -> dict:
    """``epochs`` runs of ``step`` over ``batches`` (``units[k]``: trees or words in batch k): units per second
    of each, and the summed breakdown when ``step`` returns one (keys ``rates``, ``construction_s``,
    ``compute_s``, each after ``prefix``). With ``cap`` seconds an epoch stops after the first batch that
    reaches it (a per-sample peer far slower than the others), its rate taken over the batches it ran
    (``timed_batches``: the fewest of any epoch). ``sync()`` waits for the device before each clock read
    (work queued on a GPU is not done when the step returns); the cap's check reads the clock without it."""
    rates, split, ran = [], [], []
    for _ in range(epochs):
        total, done_units = None, 0
        sync()
        start = time.perf_counter()
        for done, (batch, n) in enumerate(zip(batches, units), 1):
            got = step(batch)
            done_units += n
            if got is not None:
                total = [a + b for a, b in zip(total, got)] if total else list(got)
            if cap and time.perf_counter() - start >= cap:
                break
        sync()
        rates.append(done_units / (time.perf_counter() - start))
        split.append(total)
        ran.append(done)
    out = {prefix + "rates": rates, prefix + "timed_batches": min(ran)}
    if split and split[0] is not None:
        out[prefix + "construction_s"], out[prefix + "compute_s"] = [s[0] for s in split], [s[1] for s in split]
    return out


def _warmup(step, batches: list, cap, sync=_nothing) -> tuple[float, int]:
    """(seconds, batches run) of one untimed epoch of ``step`` over ``batches``. With ``cap`` seconds it stops
    after the first batch that reaches the cap, as the timed epochs are capped, and the whole epoch's seconds
    are extrapolated from the batches run (a per-sample peer's warm-up took 65 s at hidden 512)."""
    sync()
    start = time.perf_counter()
    for done, batch in enumerate(batches, 1):
        step(batch)
        if cap:
            sync()
            if time.perf_counter() - start >= cap:
                break
    sync()
    return (time.perf_counter() - start) * len(batches) / done, done


def measure(spec: dict, units: list, make, train, infer=None, sync=_nothing) -> dict:
    """The timed protocol, in steady state over the same samples as every other system of the point.

    ``make(i, j)`` is the batch of samples i..j-1 as ``train`` and ``infer`` take it; ``train(batch)`` runs
    forward, backward and update, ``infer(batch)`` the forward pass only. Either may return a
    ``(construction_s, compute_s)`` pair (DyNet's graph building vs its forward/backward/update), summed per
    epoch. ``sync()`` waits until the device has finished the work issued so far (a GPU peer's
    ``torch.cuda.synchronize``): it runs before every clock read. ``units[i]``: trees or words in sample i.

    The epoch is the first ``spec["samples"]`` samples (default: all) in whole batches of ``spec["batch"]``
    (the last one may be smaller), the very samples the host timed minicavs on. First one whole untimed epoch
    (the warm-up: one-time costs such as memory pools, caches and kernels fall there, in this process; with
    ``max_seconds`` it stops after that many seconds, :func:`_warmup`), then ``spec["epochs"]`` timed epochs;
    with ``max_seconds``, a system whose warm-up epoch took (or would take) longer than that is timed for as
    many epochs as fit ``epochs x max_seconds``, at least one (a per-sample peer far slower than the others:
    the same samples, fewer epochs); with ``timed_seconds``, each timed epoch stops after the first batch
    that reaches it (:func:`_epochs`: the rate over the first ``timed_batches`` batches). With ``inference``,
    a warm-up forward-only epoch (capped alike) and as many timed ones over the same batches."""
    n = min(int(spec.get("samples") or len(units)), len(units))
    bs = spec["batch"]
    starts = range(0, n, bs)
    batches = [make(i, min(i + bs, n)) for i in starts]
    batch_units = [sum(units[i:min(i + bs, n)]) for i in starts]
    epochs, cap, timed_cap = spec["epochs"], spec.get("max_seconds"), spec.get("timed_seconds")
    warmup_s, warmed = _warmup(train, batches, cap, sync)
    if cap and warmup_s > cap:
        epochs = max(1, min(epochs, int(epochs * cap / warmup_s)))
    out = {"units": sum(batch_units), "samples": n, "batches": len(batches), "capped": n < len(units),
           "warmup_s": warmup_s, "warmup_batches": warmed, "epochs_timed": epochs}
    out.update(_epochs(train, batches, batch_units, epochs, sync=sync, cap=timed_cap))
    if spec.get("inference"):
        if infer is None:
            raise ValueError("this peer has no inference mode")
        _warmup(infer, batches, cap, sync)
        out.update(_epochs(infer, batches, batch_units, epochs, "infer_", sync, timed_cap))
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
