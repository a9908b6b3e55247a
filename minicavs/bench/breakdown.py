"""Where a minicavs training step's time goes, measured from outside the engine (benchmark only).

- **scheduling**: ``task.batch`` (input graphs and feeds from samples) and ``Model._plan`` (the batch, the
  Cavs policy's schedule and the memory plan), timed by wrapping both on this trainer's instances;
- **memory movement**: the row moves the step's programs really do, in two parts:

  - ``memory_native_s``: the native executor's pass (its blocks before and after the task loop too), measured
    live by its per-opcode clock (``c_runner.PROFILE``): the instructions that copy rows (``GATHER`` where
    it is not a view, ``TAKE``, ``TAKETO``, ``COPY``, ``PUT``, ``ADJ``, and a block's ``SROWS`` and ``SPUT``
    where its kind's scatter rows are no one block of rows: gathers, pulls, scatters into the scatter tensor,
    stores into dynamic tensors, pushes and the gathers' adjoints). Elided moves (views: ``CATVIEW``, strided
    ``GATHER``s, ``SROWS`` at an offset, in-place writes) cost an instruction's dispatch and nothing else;
  - ``memory_blocks_s``: the Python-run blocks (before and after the task loop when the native executor
    cannot run them, and the per-task blocks when the Python interpreter runs the loop): each bound block's takes, stores, writes, puts and gradient
    adjoints replayed after the step, one by one, with the block's own buffers, index arrays and views, into
    scratch copies of the destinations (so nothing the step produced changes). Moves the binding elided
    (views, in-place outputs) are not in a block's lists and cost nothing here either. A replay runs with
    warm caches, so this part is a slight underestimate; it is excluded from the step's time.

  Copies inside the ops themselves (a concat's, a reshape's) and between the engine's phases are not
  counted: they are compute here;
- **update**: the optimizer step;
- **computation**: the rest of the step (F and ∂F's kernels and matmuls, Python dispatch and the bookkeeping
  of binding).
"""
from __future__ import annotations

import time

import numpy as np

from .. import instructions
from ..cpu import runner as c_runner
from ..program import BatchProgram

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


def _moves(program: BatchProgram, xp):
    """The Python-run row moves of a bound program, each as (rows moved, a zero-argument function that redoes
    it into scratch); scratch buffers are made here, outside what is timed."""
    scratch: dict = {}

    def like(buf):
        if id(buf) not in scratch:
            scratch[id(buf)] = (buf, xp.empty_like(buf))   # (keeps buf alive so its id stays unique)
        return scratch[id(buf)][1]

    def rows_of(buf, index):
        return (len(range(*index.indices(len(buf)))) if isinstance(index, slice) else len(index),) + buf.shape[1:]

    out = []
    for block in program.blocks():
        for _, buffer, index, _ in block.takes:
            out.append((len(index), lambda buffer=buffer, index=index: xp.take(buffer, index, axis=0)))
        for _, dst, _ in block.stores_in:
            out.append((len(dst), lambda dst=dst, to=xp.empty_like(dst): to.__setitem__(Ellipsis, dst)))
        for _, dst, index, _ in block.writes + block.puts:
            shape = rows_of(dst, index)
            out.append((shape[0], lambda to=like(dst), index=index, src=xp.empty(shape, dst.dtype):
                        to.__setitem__(index, src)))
        for _, adjoint, before, after, _ in block.adjoints:
            backend, buf, rows, *rest = before
            grad = xp.zeros((len(rows),) + buf.shape[1:], buf.dtype)
            out.append((len(rows), lambda adjoint=adjoint, args=(backend, like(buf), rows, *rest, grad, *after):
                        adjoint(*args)))
    return out


def replay_memory(result) -> dict:
    """Redo one step's Python-run row moves (forward and backward programs, see the module doc): seconds and
    rows moved."""
    seconds, rows = 0.0, 0
    for name in result.batches:
        state = result.states[name]
        for program in (state.program, state.backward_program):
            if program is None:
                continue
            for n, move in _moves(program, np):
                start = time.perf_counter()
                move()
                seconds += time.perf_counter() - start
                rows += n
    return {"seconds": seconds, "rows": rows}


def instrumented_epoch(t, samples, batch: int) -> dict:
    """One training epoch over ``samples`` with the timers on; seconds per part (see the module doc)."""
    model, task = t.model, t.task
    sched = _Timer()
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name in ((task, "batch"), (model, "_plan"))]
    for obj, name, _ in saved:
        setattr(obj, name, sched.wrap(getattr(obj, name)))
    profile_before = c_runner.PROFILE
    c_runner.PROFILE = profile = np.zeros(len(instructions.OPCODES) + 1, np.int64)
    blocks = update = replay = 0.0
    start = time.perf_counter()
    try:
        for i in range(0, len(samples), batch):
            res = t.loss_and_grads(samples[i:i + batch])
            u = time.perf_counter()
            t.optimizer.step(res.grads, loss=res.loss)
            m = time.perf_counter()
            update += m - u
            blocks += replay_memory(res)["seconds"]
            replay += time.perf_counter() - m      # the replay is not part of the step
    finally:
        c_runner.PROFILE = profile_before
        for obj, name, before in saved:            # back to what they were (normally the class's method)
            if before is None:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
    total = time.perf_counter() - start - replay
    step = total - update
    ops = list(instructions.OPCODES)
    native = sum(int(profile[ops.index(op)]) for op in ROW_MOVES) / 1e9
    memory = native + blocks
    return {"step_s": total, "scheduling_s": sched.seconds, "memory_s": memory, "memory_native_s": native,
            "memory_blocks_s": blocks, "update_s": update, "compute_s": max(0.0, step - sched.seconds - memory)}
