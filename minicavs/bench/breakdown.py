"""Where a minicavs training step's time goes, measured from outside the engine (benchmark only).

- **scheduling**: ``task.batch`` (input graphs and feeds from samples) and ``Model._plan`` (the batch, the
  Cavs policy's schedule and the memory plan), timed by wrapping both on this trainer's instances;
- **memory movement**: the row moves the step's programs really do, measured live by the C runner's per-opcode
  clock (the device's ``opcode_clock``) over its whole pass (the blocks before and after the task loop too): the
  instructions that copy rows (``GATHER`` where it is not a view, ``TAKE``, ``TAKETO``, ``COPY``, ``PUT``,
  ``ADJ``, and a block's ``SROWS`` and ``SPUT`` where its kind's scatter rows are no one block of rows:
  gathers, pulls, scatters into the scatter tensor, stores into dynamic tensors, pushes and the gathers'
  adjoints). Elided moves (views: ``CATVIEW``, strided ``GATHER``s, ``SROWS`` at an offset, in-place writes)
  cost an instruction's dispatch and nothing else. Copies inside the ops themselves (a concat's, a reshape's)
  are counted as compute here;
- **update**: the optimizer step;
- **computation**: the rest of the step (F and ∂F's kernels and matmuls, Python dispatch and the bookkeeping
  of binding).
"""
from __future__ import annotations

import time

from ..engine.codegen.machine import OPS

ROW_MOVES = ("GATHER", "TAKE", "TAKETO", "COPY", "PUT", "ADJ", "SROWS", "SPUT")   # the native opcodes that move rows


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


def instrumented_epoch(t, samples, batch: int) -> dict:
    """One training epoch over ``samples`` with the timers on; seconds per part (see the module doc)."""
    model, task = t.model, t.task
    sched = _Timer()
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name in ((task, "batch"), (model, "_plan"))]
    for obj, name, _ in saved:
        setattr(obj, name, sched.wrap(getattr(obj, name)))
    update = 0.0
    start = time.perf_counter()
    try:
        with t.device.opcode_clock() as clock:
            for i in range(0, len(samples), batch):
                res = t.loss_and_grads(samples[i:i + batch])
                u = time.perf_counter()
                t.optimizer.step(res.grads, loss=res.loss)
                update += time.perf_counter() - u
    finally:
        for obj, name, before in saved:            # back to what they were (normally the class's method)
            if before is None:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
    total = time.perf_counter() - start
    step = total - update
    memory = sum(int(clock[OPS[op]]) for op in ROW_MOVES) / 1e9
    return {"step_s": total, "scheduling_s": sched.seconds, "memory_s": memory, "update_s": update,
            "compute_s": max(0.0, step - sched.seconds - memory)}
