"""An LSTM chain whose F holds one ``cond`` against the same F without it (the target: <= 1.1x): CPU time per
training step (forward_backward) on the C runner, one BLAS thread, the two models alternating, medians.

    python tools/bench_cond.py [--hidden 128] [--batch 32] [--rounds 7] [--steps 5]   (from a repository's root:
    its minicavs is timed, so another checkout runs the same script)

The cond picks the cell by the sign of a parameter (positive: the LSTM cell, so both models compute the same
numbers; checked before timing); the untaken branch (a cell on h alone) is never run."""
from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.getcwd())

from minicavs import ops  # noqa: E402
from minicavs.engine.compile import EngineOptions  # noqa: E402
from minicavs.engine.executor import RunContext  # noqa: E402
from minicavs.engine.model import Model, Structure  # noqa: E402
from minicavs.ops import control  # noqa: E402
from minicavs.runtime.inputs import InputGraph  # noqa: E402
from minicavs.runtime.vertex import VertexFunction  # noqa: E402


def lstm_chain(H: int, with_cond: bool) -> Model:
    """The chain's F: an LSTM cell (message [h; c]), inside a cond on step(s) or written plainly."""
    Wx, Wh = ops.param_node("Wx", (H, 4 * H)), ops.param_node("Wh", (H, 4 * H))
    b, Wr, s = ops.param_node("b", (4 * H,)), ops.param_node("Wr", (H, H)), ops.param_node("s", ())
    F = VertexFunction("lstm", arity=1, message=(2 * H,))
    with F:
        state, x = F.gather(0), F.pull((H,))

        def cell():
            h0, c0 = ops.split(state, 2)
            i, f, o, u = ops.split(x @ Wx + h0 @ Wh + b, 4)
            c = ops.sigmoid(f) * c0 + ops.sigmoid(i) * ops.tanh(u)
            return ops.concat([ops.sigmoid(o) * ops.tanh(c), c])

        def other():
            h0, c0 = ops.split(state, 2)
            return ops.concat([ops.tanh(h0 @ Wr + x), c0])
        m = control.cond(ops.step(s), cell, other) if with_cond else cell()
        F.scatter(m)
        F.push(ops.split(m, 2)[0], name="h")
    st = Structure(F, pulls={"x": ops.input((None, H), name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def batch(rng, n: int, H: int) -> tuple[list, dict]:
    lengths = rng.integers(10, 31, n)
    return [InputGraph.chain(int(k)) for k in lengths], {"xs": rng.standard_normal((int(lengths.sum()), H))
                                                           .astype(np.float32)}


def step_seconds(model: Model, graphs, feeds, params, steps: int) -> float:
    """CPU seconds per forward_backward, over ``steps`` calls."""
    start = time.process_time()
    for _ in range(steps):
        model.forward_backward(graphs, feeds, params, RunContext(), options=EngineOptions(runner="device"))
    return (time.process_time() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    H, rng = args.hidden, np.random.default_rng(0)
    params = {"Wx": rng.uniform(-0.1, 0.1, (H, 4 * H)), "Wh": rng.uniform(-0.1, 0.1, (H, 4 * H)),
              "b": np.zeros(4 * H), "Wr": rng.uniform(-0.1, 0.1, (H, H)), "s": np.array(1.0)}
    params = {k: v.astype(np.float32) for k, v in params.items()}
    graphs, feeds = batch(rng, args.batch, H)
    models = {"plain": lstm_chain(H, False), "cond": lstm_chain(H, True)}
    losses, runners = {}, {}
    for name, model in models.items():   # (warm: compiled, and the same numbers)
        got = model.forward_backward(graphs, feeds, params, RunContext(), options=EngineOptions(runner="device"))
        losses[name] = float(got.loss)
        runners[name] = sorted({p.runner for st in got.states.values() for p in (st.program, st.backward_program)})
    assert abs(losses["cond"] - losses["plain"]) <= 1e-5 * max(1.0, abs(losses["plain"])), losses
    times: dict = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            times[name].append(step_seconds(model, graphs, feeds, params, args.steps))
    medians = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    print(json.dumps({"hidden": H, "batch": args.batch, "runners": runners, "ms_per_step": medians,
                      "ratio": medians["cond"] / medians["plain"]}))


if __name__ == "__main__":
    main()
