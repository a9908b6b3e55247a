"""A self-contained training run: a 2-layer MLP on a synthetic 3-arm spiral (the quick-start job).

It exercises the whole static-graph path users rely on before any dynamic model: ops, autodiff, the
executor, parameters and an optimizer. The data is generated here from the seed, so a run is reproducible
and needs no downloads.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .. import ops
from ..engine.executor import Executor
from ..ops.autodiff import grad
from ..nn import ParameterSet
from .optim import make_optimizer

DEFAULTS = {"sgd": {"lr": 0.1, "momentum": 0.9}, "adagrad": {"lr": 0.2}, "adam": {"lr": 0.02}}


def spiral(n_per_class: int = 100, classes: int = 3, noise: float = 0.2, seed: int = 0):
    """Points on ``classes`` interleaved spiral arms (float32 (N, 2)) and their labels (int32 (N,)).

    Not linearly separable, so a linear model stays far from 100% and the hidden layer has to work."""
    rng = np.random.default_rng(seed)
    r = np.tile(np.linspace(0.05, 1.0, n_per_class), classes)
    label = np.repeat(np.arange(classes), n_per_class)
    theta = (label * 2 * np.pi / classes + r * 4.0
             + noise * rng.standard_normal(n_per_class * classes))
    x = np.stack([r * np.sin(theta), r * np.cos(theta)], axis=1)
    return x.astype(np.float32), label.astype(np.int32)


def build_mlp(inputs: int, hidden: int, classes: int, seed: int = 0):
    """The model: ``logits = relu(x W1 + b1) W2 + b2``; returns (params, x, y, loss, logits)."""
    params = ParameterSet()
    w1 = params.new("mlp/W1", (inputs, hidden), init="glorot_uniform", rng=seed)
    b1 = params.new("mlp/b1", (hidden,), init="zeros", weight_decay=False)
    w2 = params.new("mlp/W2", (hidden, classes), init="glorot_uniform", rng=seed)
    b2 = params.new("mlp/b2", (classes,), init="zeros", weight_decay=False)
    x = ops.input((None, inputs), name="x")
    y = ops.input((None,), dtype="int32", name="y")
    h = ops.relu(ops.linear(x, w1.node, b1.node))
    logits = ops.linear(h, w2.node, b2.node)
    loss = ops.mean(ops.softmax_cross_entropy(logits, y))
    return params, x, y, loss, logits


def train_mlp(steps: int = 500, optimizer: str = "adam", hidden: int = 32, seed: int = 0,
              lr: float | None = None, log: Callable[[str], None] | None = print,
              log_every: int | None = None) -> dict:
    """Train the MLP full-batch on the spiral; returns the initial and final loss and accuracy.

    ``lr`` defaults per optimizer (:data:`DEFAULTS`; SGD also gets momentum 0.9). ``log`` receives one
    line every ``log_every`` steps (default: ten lines per run) and a summary; None silences it."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    data_x, data_y = spiral(seed=seed)
    params, x, y, loss, logits = build_mlp(2, hidden, 3, seed=seed)
    train = Executor([loss, logits] + grad(loss, params.nodes))
    settings = dict(DEFAULTS.get(optimizer.lower(), {}))
    if lr is not None:
        settings["lr"] = lr
    opt = make_optimizer(optimizer, params, **settings)
    feeds = {x: data_x, y: data_y}
    every = log_every or max(1, steps // 10)
    start = time.perf_counter()
    first = None
    for step in range(steps + 1):  # the last pass only evaluates the trained model
        value, out, *grads = train.run(feeds, params)
        loss_value, acc = float(value), float(np.mean(np.argmax(out, axis=1) == data_y))
        first = first or (loss_value, acc)
        if log is not None and (step % every == 0 or step == steps):
            log(f"step {step:5d}  loss {loss_value:.4f}  accuracy {acc:.3f}")
        if step < steps:
            opt.step(dict(zip(params, grads)), loss=value)
    result = {"optimizer": optimizer, "steps": steps, "initial_loss": first[0], "initial_accuracy": first[1],
              "loss": loss_value, "accuracy": acc, "seconds": time.perf_counter() - start}
    if log is not None:
        log(f"done: loss {result['loss']:.4f}, accuracy {result['accuracy']:.3f} "
            f"in {result['seconds']:.2f} s ({optimizer}, {steps} steps)")
    return result


__all__ = ["spiral", "build_mlp", "train_mlp"]
