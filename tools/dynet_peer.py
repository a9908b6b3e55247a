"""What the DyNet peers share: DyNet's configuration, the optimizer and the step functions handed to the
protocol of tools/peer_common.py (documented in minicavs/bench/peers.py).

Imported by tools/dynet_*.py, which run in DyNet's own environment (tools/setup_peers.sh: PyPI ``dynet38``,
DyNet 2.2) and import nothing from minicavs.

Modes: ``autobatch`` (DyNet's automatic operation batching, autobatch=1: the comparison of the paper) or
``unbatched`` (autobatch=0: every sample's operations one by one).

Memory: DyNet takes its memory pools (``spec["mem"]`` MB, split between forward, backward, parameters and
scratch) at start-up, 2048 MB by default (minicavs/bench/peers.py), and with autobatching it cannot grow them: a
graph that does not fit fails with "pre-allocate enough memory". The host then runs the peer again with twice
the memory, so ``mem_mb`` in the report is the pools it ran with; the warm-up epoch runs every timed batch
first, so no timed epoch meets a pool too small. DyNet's peak resident memory is about the pools' pages it
touched plus the interpreter's.

Threads: DyNet's CPU backend runs its kernels (Eigen) on the calling thread unless it was built with MKL;
:func:`threads` reports 1 and says so unless an MKL or OpenMP runtime is mapped into the process.

The spec's ``optimizer`` (minicavs' optimizer and its hyperparameters) becomes DyNet's trainer: Adam ->
``AdamTrainer(alpha, beta_1, beta_2, eps)``, Adagrad -> ``AdagradTrainer(learning_rate, eps)``, SGD ->
``SimpleSGDTrainer`` or ``MomentumSGDTrainer(learning_rate, mom)``; DyNet's default gradient clipping
(threshold 5) is replaced by minicavs' ``clip_norm`` (off when None) and lookup parameters get sparse
updates exactly when minicavs' ``sparse_updates`` is set. Two differences DyNet's kernels impose, both
negligible unless the second moments are as small as eps: DyNet's Adam adds eps to sqrt(v) before the bias
correction (lr·sqrt(1-b2^t)/(1-b1^t)·m/(sqrt(v)+eps); minicavs computes the same way with eps·sqrt(1-b2^t)
in its place, which is lr·m̂/(sqrt(v̂)+eps)) and its Adagrad
divides by sqrt(acc + eps) instead of sqrt(acc) + eps. DyNet's weight decay is a different rule (a global shrink per
update), so a nonzero ``weight_decay`` is refused.
"""
import importlib.metadata
import time

import numpy as np

from peer_common import measure, report

MODES = {"autobatch": 1, "unbatched": 0}


def start(spec: dict):
    """Configure and import DyNet for the spec's mode; returns the module."""
    if spec["mode"] not in MODES:
        raise ValueError(f"mode {spec['mode']!r}: the DyNet peers run {', '.join(MODES)}")
    import dynet_config
    spec.setdefault("mem", 2048)
    dynet_config.set(autobatch=MODES[spec["mode"]], mem=spec["mem"], random_seed=1)
    import dynet
    return dynet


def threads() -> tuple:
    """(threads DyNet computes with, why): 1 unless an MKL or OpenMP runtime is loaded."""
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1].rsplit("/", 1)[-1] for line in f if ".so" in line}
    parallel = sorted(lib for lib in libs if any(k in lib for k in ("mkl", "gomp", "iomp", "omp.so")))
    if parallel:
        return None, "DyNet loaded " + ", ".join(parallel) + ": it may use several threads"
    return 1, "dynet38 is built without MKL or OpenMP: Eigen kernels on the calling thread"


def make_trainer(dy, pc, spec: dict):
    o = dict(spec["optimizer"])
    name, lr = o["name"].lower(), o["lr"]
    if o.get("weight_decay"):
        raise ValueError("DyNet's weight decay is not minicavs' L2 rule: run the DyNet peers with weight_decay 0")
    if name == "adam":
        trainer = dy.AdamTrainer(pc, alpha=lr, beta_1=o["beta1"], beta_2=o["beta2"], eps=o["eps"])
    elif name == "adagrad":
        trainer = dy.AdagradTrainer(pc, learning_rate=lr, eps=o["eps"])
    elif name == "sgd" and o.get("momentum"):
        trainer = dy.MomentumSGDTrainer(pc, learning_rate=lr, mom=o["momentum"])
    elif name == "sgd":
        trainer = dy.SimpleSGDTrainer(pc, learning_rate=lr)
    else:
        raise ValueError(f"optimizer {name!r}: the DyNet peers know adam, sgd, adagrad")
    trainer.set_clip_threshold(o.get("clip_norm") or 0.0)   # 0 turns DyNet's clipping off
    trainer.set_sparse_updates(bool(o.get("sparse_updates")))
    return trainer


def check_loss(dy, batch_loss, samples) -> float:
    """The loss of the check samples for the weights as handed over (forward only, no update)."""
    dy.renew_cg()
    return float(batch_loss(samples).value())


def train_and_report(dy, pc, batch_loss, samples: list, units: list, spec: dict, check: float) -> None:
    """The protocol (tools/peer_common.py) over ``samples`` (``batch_loss(samples[i:j])`` builds a batch's
    loss expression; ``units[i]`` trees or words in sample i). Each step times the graph construction in Python
    (renew_cg and building the expressions) apart from the computation (forward with DyNet's batching,
    backward, update; forward only for inference). Prints the JSON line."""
    trainer = make_trainer(dy, pc, spec)

    def step(batch, training: bool):
        start = time.perf_counter()
        dy.renew_cg()
        loss = batch_loss(batch)
        built = time.perf_counter()
        loss.value()
        if training:
            loss.backward()
            trainer.update()
        return built - start, time.perf_counter() - built

    timing = measure(spec, units, lambda i, j: samples[i:j], lambda b: step(b, True), lambda b: step(b, False))
    n, why = threads()
    report(spec, check, timing, framework="dynet", threads=n, threads_note=why, optimizer=type(trainer).__name__,
           mem_mb=spec["mem"], versions={"dynet38": importlib.metadata.version("dynet38")})


def lstm_builder(dy, pc, W_x, W_h, b):
    """A one-layer ``VanillaLSTMBuilder`` holding minicavs' LSTM weights (rows @ W: DyNet's are transposed);
    forget_bias=0 and DyNet's gate order i, f, o, g are minicavs' own, so the weights go in unchanged."""
    lstm = dy.VanillaLSTMBuilder(1, W_x.shape[0], W_h.shape[0], pc, forget_bias=0.0)
    (x_weights, h_weights, bias), = lstm.get_parameters()
    x_weights.set_value(np.ascontiguousarray(W_x.T))
    h_weights.set_value(np.ascontiguousarray(W_h.T))
    bias.set_value(b)
    return lstm
