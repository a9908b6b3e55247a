"""Where a minicavs training step's time goes, measured from outside the engine (benchmark only).

- **scheduling**: ``task.batch`` (input graphs and feeds from samples) and ``Model._plan`` (the batch, the
  Cavs policy's schedule and the memory plan), timed by wrapping both on this trainer's instances;
- **memory movement**: the step's gathers, scatters, pulls and pushes (forward) and their adjoints (backward)
  replayed alone, after the step, with the step's own index arrays, tensors and gather-elision views. A
  scatter is counted as a copy even where a fused kernel writes the scatter tensor in place, so this is an
  upper bound; copies of values between engine phases are not counted (they are neither of the four);
- **update**: the optimizer step;
- **computation**: the rest of the step (F and ∂F's kernels and matmuls, and Python dispatch).
"""
from __future__ import annotations

import time

import numpy as np


class _Timer:
    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def replay_memory(result, gather_elision: bool) -> float:
    """Seconds to redo one step's row copies: forward gathers/scatters/pulls/pushes and backward adjoints."""
    total = 0.0
    for name, (batch, plan) in result.batches.items():
        state = result.states[name]
        scatter = state.scatter
        start = time.perf_counter()
        if scatter is not None:
            dest = np.empty_like(scatter)
            sgrad = np.empty_like(scatter)
            for kid, koff, bs, scatter_offset in plan.tasks:          # forward, task by task
                kind_plan = plan.kinds[kid]
                for j, rows in enumerate(kind_plan.child_rows):
                    if not (gather_elision and kind_plan.views[j].get(koff) is not None):
                        np.take(scatter, rows[koff:koff + bs], axis=0)
                dest[scatter_offset:scatter_offset + bs] = scatter[scatter_offset:scatter_offset + bs]
            for kid, koff, bs, scatter_offset in reversed(plan.tasks):   # backward: gradients to the children's rows
                kind_plan = plan.kinds[kid]
                for j, rows in enumerate(kind_plan.child_rows):
                    g = scatter[scatter_offset:scatter_offset + bs]
                    view = kind_plan.views[j].get(koff) if gather_elision else None
                    if view is not None and view[1]:
                        s, step = view
                        sgrad[s:s + step * (bs - 1) + 1:step] = g
                    elif view is None:
                        sgrad[rows[koff:koff + bs]] = g
        for kind_plan in plan.kinds:
            if kind_plan is None:
                continue
            for pname, rows in kind_plan.pull_rows.items():      # pull rows in, pull gradients out
                buf = state.pull_bufs[pname]
                taken = np.take(buf, rows, axis=0)
                if np.issubdtype(buf.dtype, np.floating):
                    grad = np.empty_like(buf)
                    grad[rows] = taken
            for pname, rows in kind_plan.push_rows.items():      # push rows out, push gradients in
                out = state.pushes[pname]
                out[rows] = np.take(out, rows, axis=0)
        total += time.perf_counter() - start
    return total


def instrumented_epoch(t, samples, batch: int) -> dict:
    """One training epoch over ``samples`` with the timers on; seconds per part (see the module doc)."""
    model, task = t.model, t.task
    sched = _Timer()
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name in ((task, "batch"), (model, "_plan"))]
    for obj, name, _ in saved:
        setattr(obj, name, sched.wrap(getattr(obj, name)))
    memory = update = replay = 0.0
    start = time.perf_counter()
    try:
        for i in range(0, len(samples), batch):
            res = t.loss_and_grads(samples[i:i + batch])
            u = time.perf_counter()
            t.optimizer.step(res.grads, loss=res.loss)
            m = time.perf_counter()
            update += m - u
            memory += replay_memory(res, model.options.gather_elision)
            replay += time.perf_counter() - m      # the replay is not part of the step
    finally:
        for obj, name, before in saved:            # back to what they were (normally the class's method)
            if before is None:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
    total = time.perf_counter() - start - replay
    step = total - update
    return {"step_s": total, "scheduling_s": sched.seconds, "memory_s": memory, "update_s": update,
            "compute_s": max(0.0, step - sched.seconds - memory)}
