"""The workloads of ``minicavs bench --control`` (:mod:`.control_flow`): control flow inside a vertex function (a
``cond``, a ``foreach``, a ``while_loop``) against the same F without it, and the Var-LSTM written as a
``foreach`` static graph against the chain graph. Each workload is a :class:`Step`: one timed unit of work (a
training step or a pass over the data), the units it counts (steps, real words, sequences) and the arrays one
forward and backward computes (what the emulated device must reproduce).

Sizes come in the spec (a dict) so that a fresh process builds the same workload."""
from __future__ import annotations

import collections
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .. import ops
from ..core.sparse import RowSparse
from ..engine.compile import EngineOptions
from ..engine.executor import RunContext
from ..engine.model import Model, Structure
from ..ops import control
from ..runtime.inputs import InputGraph
from ..runtime.vertex import VertexFunction


@dataclass
class Step:
    """``run()`` does one timed unit of work and returns the units it covered; ``values(device)`` is one
    forward and backward on ``device`` (None: the CPU's C runner): ({"loss": ..., "d<param>": ...} as host
    arrays, the runners its vertex functions' passes ran on)."""

    run: Callable[[], float]
    values: Callable[[object], tuple[dict, list]]


def rnn_chain(H: int, T: int, unrolled: bool, loop: str = "foreach") -> Model:
    """F: a tanh RNN over the vertex's (T, H) sequence from its child's message, as a foreach or unrolled; or
    (``loop`` "while") T steps over its (H,) input, as a while_loop (while a counter is below the parameter
    ``lim`` = T - 0.5) or unrolled."""
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


def lstm_chain(H: int, with_cond: bool) -> Model:
    """The chain's F: an LSTM cell (message [h; c]), inside a cond on step(s) or written plainly. With ``s``
    positive the cond takes the LSTM cell, so both compute the same numbers; the other branch (a cell on h
    alone) never runs."""
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


def _model_step(model: Model, params: dict, graphs: list, feeds: dict) -> Step:
    """A training step's forward and backward of ``model`` (C runner) on one fixed batch."""
    def run() -> float:
        model.forward_backward(graphs, feeds, params, RunContext(), options=EngineOptions(runner="device"))
        return 1.0
    return Step(run, lambda device: _values(model, params, graphs, feeds, device))


def _values(model: Model, params: dict, graphs, feeds: dict, device) -> tuple[dict, list]:
    """Loss and gradients of one forward and backward on ``device`` (None: the CPU), as host arrays, and the
    runners of the vertex functions' passes and of the static graphs' programs (or the step runner's)."""
    if device is None:
        got = model.forward_backward(graphs, feeds, params, RunContext(), options=EngineOptions(runner="device"))
    else:
        before, model.device = model.device, device
        try:
            got = model.forward_backward(graphs, feeds, {k: device.asarray(np.asarray(v)) for k, v in params.items()},
                                         RunContext(), options=EngineOptions(runner="device"))
        finally:
            model.device = before
    host = device.to_host if device is not None else np.asarray

    def dense(g) -> np.ndarray:
        return np.asarray(host(g.to_dense() if isinstance(g, RowSparse) else g), np.float64)
    runners = {p.runner for st in got.states.values() for p in (st.program, st.backward_program)}
    runners |= {f"static program: {run.program.runner}" if run.program is not None else "static graph: step runner"
                for run in got.static}
    runners = sorted(runners)
    return {"loss": dense(got.loss), **{f"d{k}": dense(g) for k, g in got.grads.items()}}, runners


def chain_batch(rng, n: int, per_vertex: tuple) -> tuple[list, dict]:
    """``n`` chains of 10 to 30 vertices and their pulled rows (``per_vertex`` each)."""
    lengths = rng.integers(10, 31, n)
    feeds = {"xs": rng.standard_normal((int(lengths.sum()),) + per_vertex).astype(np.float32)}
    return [InputGraph.chain(int(k)) for k in lengths], feeds


def loop_in_f(spec: dict, system: str) -> Step:
    """A foreach or while_loop in F (``spec["loop"]``) or the same F unrolled (``system`` "unrolled")."""
    H, T, loop, rng = spec["hidden"], spec["steps"], spec["loop"], np.random.default_rng(0)
    params = {"Wx": rng.uniform(-0.1, 0.1, (H, H)), "Wh": rng.uniform(-0.1, 0.1, (H, H)), "b": np.zeros(H),
              "lim": np.float64(T - 0.5)}
    params = {k: np.asarray(v).astype(np.float32) for k, v in params.items()}
    graphs, feeds = chain_batch(rng, spec["batch"], (T, H) if loop == "foreach" else (H,))
    return _model_step(rnn_chain(H, T, system == "unrolled", loop), params, graphs, feeds)


def cond_in_f(spec: dict, system: str) -> Step:
    """The LSTM chain with a cond in F (``system`` "cond") or without it ("plain")."""
    H, rng = spec["hidden"], np.random.default_rng(0)
    params = {"Wx": rng.uniform(-0.1, 0.1, (H, 4 * H)), "Wh": rng.uniform(-0.1, 0.1, (H, 4 * H)),
              "b": np.zeros(4 * H), "Wr": rng.uniform(-0.1, 0.1, (H, H)), "s": np.array(1.0)}
    params = {k: v.astype(np.float32) for k, v in params.items()}
    graphs, feeds = chain_batch(rng, spec["batch"], (H,))
    return _model_step(lstm_chain(H, system == "cond"), params, graphs, feeds)


def equal_length_text(text: str | None, sentences: int) -> tuple[str, int]:
    """A text file of ``sentences`` sentences of one length, the length most sentences of ``text`` have
    (None: minicavs' synthetic corpus), and that length."""
    from ..data.text import read_sentences, synthetic_corpus
    corpus = read_sentences(text) if text else synthetic_corpus(20 * sentences)
    length = collections.Counter(map(len, corpus)).most_common(1)[0][0]
    same = [s for s in corpus if len(s) == length][:sentences]
    path = Path(tempfile.mkdtemp(prefix="minicavs-control-")) / "equal.txt"
    path.write_text("".join(" ".join(s) + "\n" for s in same))
    return str(path), length


def var_lstm(spec: dict, system: str) -> Step:
    """The Var-LSTM as the chain graph or the foreach static graph (``system`` "chain graph", "foreach",
    each maybe ", bucketed": ``train.order=bucket``): one pass over the spec's sentences, in the trainer's
    batches (of its first epoch), counting steps (``spec["per"]`` "step") or real words ("word");
    ``spec["equal"]``: sentences of one length."""
    from .workloads import var_lstm as build
    text = spec.get("ptb")
    if spec.get("equal"):
        text, _ = equal_length_text(text, spec["sentences"])
    extra = ["model.graph=" + ("foreach" if system.startswith("foreach") else "chain")]
    extra += ["train.order=bucket"] if system.endswith("bucketed") else []
    extra += [] if text else ["data.train=synthetic", f"data.synthetic.train={spec['sentences']}"]
    t = build(text or "synthetic", spec["sentences"], spec["hidden"], spec["embed"], spec["batch"],
              EngineOptions(), extra)
    return trainer_step(t, float(len(t.epoch_batches(1)) if spec["per"] == "step"
                                  else t.task.units(t.task.data["train"])))


def trainer_step(t, units: float) -> Step:
    """One training pass over the trainer's first epoch's batches, counting ``units``; its values: the first
    batch's forward and backward."""
    batches, data = t.epoch_batches(1), t.task.data["train"]

    def run() -> float:
        t.train_batches(batches)
        return units

    def values(device) -> tuple[dict, list]:
        graphs, feeds = t.task.batch([data[i] for i in batches[0]])
        return _values(t.model, {k: t.params[k].value for k in t.params}, graphs, feeds, device)
    return Step(run, values)


WORKLOADS = {"loop": loop_in_f, "cond": cond_in_f, "var_lstm": var_lstm}
