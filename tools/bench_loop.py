"""A chain whose F runs a ``foreach`` over each vertex's pulled sequence (an RNN over T steps from the child's
message) against the same F unrolled in Python, and against the foreach run as an APPLY of its op (how every
foreach in F ran before the loop opcodes): CPU time per training step (forward_backward), one BLAS thread, the
models alternating, medians. ``--loop while``: a ``while_loop`` instead (T steps of the RNN over the vertex's
pulled (H,) input, while a step counter is below a parameter ``lim`` = T - 0.5; ∂F's loop over the steps run
reads its trip count where it runs).

    python tools/bench_loop.py [--loop foreach|while] [--hidden 128] [--steps-per-vertex 8] [--batch 16]
                               [--rounds 5] [--calls 3]
    (from a repository's root: its minicavs is timed)

The three compute the same numbers (checked before timing)."""
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
from minicavs.engine import instructions  # noqa: E402
from minicavs.engine.compile import EngineOptions  # noqa: E402
from minicavs.engine.executor import RunContext  # noqa: E402
from minicavs.engine.model import Model, Structure  # noqa: E402
from minicavs.ops import control  # noqa: E402
from minicavs.runtime.inputs import InputGraph  # noqa: E402
from minicavs.runtime.vertex import VertexFunction  # noqa: E402

LOOPS = instructions.loops


def rnn_chain(H: int, T: int, unrolled: bool, loop: str = "foreach") -> Model:
    """F: a tanh RNN over the vertex's (T, H) sequence from its child's message, as a foreach or unrolled; or
    (``loop`` "while") T steps over its (H,) input, as a while_loop or unrolled."""
    Wx, Wh, b = ops.param_node("Wx", (H, H)), ops.param_node("Wh", (H, H)), ops.param_node("b", (H,))
    lim = ops.param_node("lim", ())
    F = VertexFunction("seq", arity=1, message=(H,))
    with F:
        xs, h = F.pull((T, H) if loop == "foreach" else (H,)), F.gather(0)

        def body(x, s):
            return [], ops.tanh(x @ Wx + s @ Wh + b)
        if loop == "while" and unrolled:
            for _ in range(T):
                h = body(xs, h)[1]
        elif loop == "while":
            _, (h, _), _ = control.while_loop(lambda v: ops.step(lim - v[1]),
                                              lambda v: ([], [body(xs, v[0])[1], v[1] + 1.0]),
                                              [h, ops.constant(0.0, lim.dtype)], T)
        elif unrolled:
            for t in range(T):
                h = body(ops.reshape(ops.slice_(xs, t, t + 1, axis=0), (H,)), h)[1]
        else:
            h = control.foreach(body, xs, h)[1]
        F.scatter(h)
        F.push(h)
    st = Structure(F, pulls={"x": ops.input((None,) + ((T, H) if loop == "foreach" else (H,)), name="xs")})
    return Model(st, loss=ops.sum(ops.square(st.pushed("h"))))


def seconds(model: Model, graphs, feeds, params, calls: int, loops: bool) -> tuple:
    """CPU seconds per forward_backward over ``calls`` calls and the last result (``loops`` False: a foreach
    is an APPLY)."""
    instructions.loops = LOOPS if loops else (lambda t, step: False)
    try:
        start = time.process_time()
        for _ in range(calls):
            got = model.forward_backward(graphs, feeds, params, RunContext(), options=EngineOptions(runner="device"))
        return (time.process_time() - start) / calls, got
    finally:
        instructions.loops = LOOPS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loop", choices=("foreach", "while"), default="foreach")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps-per-vertex", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    H, T, rng = args.hidden, args.steps_per_vertex, np.random.default_rng(0)
    params = {"Wx": rng.uniform(-0.1, 0.1, (H, H)), "Wh": rng.uniform(-0.1, 0.1, (H, H)), "b": np.zeros(H),
              "lim": np.float64(T - 0.5)}
    params = {k: np.asarray(v).astype(np.float32) for k, v in params.items()}
    lengths = rng.integers(10, 31, args.batch)
    graphs = [InputGraph.chain(int(k)) for k in lengths]
    per_vertex = (T, H) if args.loop == "foreach" else (H,)
    feeds = {"xs": rng.standard_normal((int(lengths.sum()),) + per_vertex).astype(np.float32)}
    models = {"loop": (rnn_chain(H, T, False, args.loop), True),
              "unrolled": (rnn_chain(H, T, True, args.loop), True),
              "apply": (rnn_chain(H, T, False, args.loop), False)}
    losses, runners = {}, {}
    for name, (model, loops) in models.items():   # (warm: compiled, and the same numbers)
        _, got = seconds(model, graphs, feeds, params, 1, loops)
        losses[name] = float(got.loss)
        runners[name] = sorted({p.runner for st in got.states.values() for p in (st.program, st.backward_program)})
    for name in losses:
        assert abs(losses[name] - losses["unrolled"]) <= 1e-4 * max(1.0, abs(losses["unrolled"])), losses
    times: dict = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, (model, loops) in models.items():
            times[name].append(seconds(model, graphs, feeds, params, args.calls, loops)[0])
    ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    print(json.dumps({"loop": args.loop, "hidden": H, "steps": T, "batch": args.batch, "vertices": int(lengths.sum()),
                      "runners": runners, "ms_per_step": ms, "loop/unrolled": ms["loop"] / ms["unrolled"],
                      "apply/loop": ms["apply"] / ms["loop"]}))


if __name__ == "__main__":
    main()
