"""Checks users can run on their own graphs: central finite differences in float64.

The tolerance rule is the project's (DESIGN.md): ``|fd - g| <= rtol * max(|fd|, |g|) + atol`` per element,
with rtol=1e-6 and atol=1e-8 by default.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from ..core.sparse import densify
from ..engine.executor import Executor, RunContext
from ..ir.graph import Graph, Node
from ..ops.autodiff import grad
from ..ops import input as input_node
from ..ops.sources import trainable


def assert_close_grad(fd, g, rtol: float = 1e-6, atol: float = 1e-8, what: str = "gradient"):
    """Raise AssertionError naming the worst element if the tolerance rule fails anywhere."""
    fd = np.asarray(fd, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    err = np.abs(fd - g) - (rtol * np.maximum(np.abs(fd), np.abs(g)) + atol)
    if err.size and err.max() > 0:
        k = np.unravel_index(int(np.argmax(err)), err.shape)
        raise AssertionError(f"{what}: element {k}: finite difference {fd[k]!r} vs autodiff {g[k]!r} "
                             f"(|diff| {abs(fd[k] - g[k]):.3e})")


def central_difference(f: Callable[[], float], x: np.ndarray, eps: float, direction=None):
    """d f / d x by central differences, perturbing ``x`` in place (restored afterwards).

    With ``direction`` returns the directional derivative along it, else the full gradient array."""
    if direction is not None:
        x0 = x.copy()
        x += eps * direction
        fp = f()
        x[...] = x0 - eps * direction
        fm = f()
        x[...] = x0
        return (fp - fm) / (2 * eps)
    out = np.zeros_like(x)
    flat, gflat = x.reshape(-1), out.reshape(-1)
    for i in range(flat.size):
        v = flat[i]
        flat[i] = v + eps
        fp = f()
        flat[i] = v - eps
        fm = f()
        flat[i] = v
        gflat[i] = (fp - fm) / (2 * eps)
    return out


def check_grads(outputs: Node | Sequence[Node], wrt: Sequence[Node], feeds: Mapping[Node, np.ndarray],
                params: Mapping[str, np.ndarray] | None = None, *, eps: float = 1e-6, rtol: float = 1e-6,
                atol: float = 1e-8, directions: int = 0, seed: int = 0, ctx: RunContext | None = None) -> dict:
    """Compare autodiff with central finite differences of ``L = sum_i sum(outputs[i] * R_i)``.

    ``wrt`` holds input or parameter nodes; their values come from ``feeds`` / ``params`` and must be float64.
    ``directions=0`` checks every element (pinpoints the wrong entry); ``directions=k`` checks k random
    directions per node (for whole models). Returns the largest |fd - g| per wrt node; raises AssertionError.
    """
    outputs = [outputs] if isinstance(outputs, Node) else list(outputs)
    params = {k: np.array(getattr(v, "value", v), dtype=np.float64) for k, v in (params or {}).items()}
    feeds = {k: np.array(v, dtype=np.float64 if np.asarray(v).dtype.kind == "f" else np.asarray(v).dtype)
             for k, v in feeds.items()}
    for n in Graph(outputs).nodes:
        if n.dtype.is_float and n.dtype.name != "float64":
            raise TypeError(f"check_grads needs a float64 graph; {n.label()} is {n.dtype.name}")
    rng = np.random.default_rng(seed)
    cots = [input_node(o.shape, o.dtype, name=f"cotangent{i}") for i, o in enumerate(outputs)]
    grads = grad(outputs, wrt, cots)
    fwd = Executor(outputs)
    bwd = Executor(grads)
    values = [None] * len(outputs)
    ctx = ctx or RunContext()

    def loss() -> float:
        outs = fwd.run(feeds, params, ctx)
        return float(sum(np.sum(o * r) for o, r in zip(outs, values)))

    first = fwd.run(feeds, params, ctx)
    values[:] = [rng.standard_normal(np.shape(o)) for o in first]
    cot_feeds = dict(feeds)
    cot_feeds.update(zip(cots, values))
    analytic = [densify(np, g) for g in bwd.run(cot_feeds, params, ctx)]
    report = {}
    for w, g in zip(wrt, analytic):
        x = params[w.name] if w.op == "param" else feeds[w]
        if directions:
            fds, gds = [], []
            for _ in range(directions):
                d = rng.standard_normal(x.shape)
                fds.append(central_difference(loss, x, eps, d))
                gds.append(float(np.sum(g * d)))
            fd, gv = np.array(fds), np.array(gds)
        else:
            fd, gv = central_difference(loss, x, eps), np.asarray(g)
        assert_close_grad(fd, gv, rtol, atol, what=f"gradient of {w.label()}")
        report[w] = float(np.max(np.abs(fd - gv))) if np.size(fd) else 0.0
    return report


def check_model_grads(model, graphs, feeds, params: Mapping[str, np.ndarray], *, directions: int = 2,
                      eps: float = 1e-5, rtol: float = 1e-6, atol: float = 1e-8, seed: int = 0,
                      ctx: RunContext | None = None) -> dict:
    """Finite differences through a whole model (vertex functions + input graphs + static graphs).

    Perturbs every float parameter (but frozen ones) along ``directions`` random directions (float64 values required) and
    compares the central difference of the loss with the gradient the model returns. ``eps`` is larger than
    for single ops: a model's loss sums many terms, and rounding error grows as |loss| * 1e-16 / eps while
    the truncation error shrinks only as eps**2. Returns the largest
    |fd - g| per parameter; raises AssertionError naming the parameter on failure."""
    params = {k: np.array(getattr(v, "value", v)) for k, v in params.items()}
    for k, v in params.items():
        if v.dtype.kind == "f" and v.dtype != np.float64:
            raise TypeError(f"check_model_grads needs float64 parameters; '{k}' is {v.dtype}")
    rng = np.random.default_rng(seed)
    ctx = ctx or RunContext()

    def fresh():
        return RunContext(ctx.seed, ctx.step, ctx.training)

    grads = model.forward_backward(graphs, feeds, params, fresh()).grads
    report = {}
    for name, x in params.items():
        if x.dtype.kind != "f" or name not in model.param_nodes or not trainable(model.param_nodes[name]):
            continue   # (a frozen parameter has no gradient to check)
        g = densify(np, grads[name]) if name in grads else np.zeros_like(x)
        fds, gds = [], []
        for _ in range(directions):
            d = rng.standard_normal(x.shape)
            fds.append(central_difference(lambda: model.run(graphs, feeds, params, fresh(),
                                                            backward_pass=False).loss, x, eps, d))
            gds.append(float(np.sum(g * d)))
        assert_close_grad(np.array(fds), np.array(gds), rtol, atol, what=f"gradient of parameter '{name}'")
        report[name] = float(np.max(np.abs(np.array(fds) - np.array(gds))))
    return report
