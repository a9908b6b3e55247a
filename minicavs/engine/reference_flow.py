"""The reference runner's control-flow opcodes (reference.py: the machine they move): a cond's branch and jump,
loops with their counters per depth (a trip count given, read from a static or from a register), a step's block
of a per-step value, a while_loop's test. Each returns how many instructions to skip (negative: back)."""
from __future__ import annotations

from .backend import to_host

# (``Machine`` in the annotations is reference.Machine, which imports this module: not imported back)


def op_branch(m: Machine, pred, n) -> int:
    """A cond's branch: skip the then-branch (its ``n`` instructions, the JUMP over the else-branch included) when
    the pred, one value, is 0; NaN is true, as C reads it (on a device: one read a pass, a crossing)."""
    if pred not in m.preds:   # (a static: the same for every task of the pass, read once)
        m.preds[pred] = float(to_host(m.flats[pred][:1])[0])
    return n if m.preds[pred] == 0 else 0


def op_jump(m: Machine, n) -> int:
    """Skip the next ``n`` instructions (the end of a cond's then-branch: over the else-branch)."""
    return n


def op_loop(m: Machine, trips, n, depth) -> int:
    """A foreach's loop: the depth's counter to 0, its trip count ``trips``; none: skip its body and ENDLOOP
    (``n`` instructions)."""
    m.lt[depth], m.lim[depth] = 0, trips
    return n if trips == 0 else 0


def op_loopn(m: Machine, count, most, n, depth) -> int:
    """A loop whose trip count is read where it runs from ``count`` (one int64 value; on a device one read a
    pass, a crossing), refused outside [0, most] (the loop's memory holds ``most`` steps); else as LOOP."""
    if count not in m.preds:   # (a static: the same for every task of the pass, read once)
        m.preds[count] = int(to_host(m.flats[count][:1])[0])
    trips = m.preds[count]
    if not 0 <= trips <= most:
        m.fail(f"operand count: a trip count of {trips}, outside [0, {most}]")
    return op_loop(m, trips, n, depth)


def op_endloop(m: Machine, trips, n, depth) -> int:
    """The end of a loop's body: the counter + 1; while below the trip count (and ``trips``, the most the loop
    runs), back ``n`` (to the body's first)."""
    m.lt[depth] += 1
    return -n if m.lt[depth] < min(m.lim[depth], trips) else 0


def op_stepcols(m: Machine, dst, src, width, first, stride, depth) -> None:
    """dst = src's columns from (first + stride x counter) x ``width``: the step's block of a per-step value
    (a negative ``first`` counts from the trip count: a reverse loop's last step run is -1)."""
    buf, offset, ld, transposed = m.reg(src)
    base = m.lim[depth] + first if first < 0 else first
    m.set(dst, buf, offset + (base + stride * m.lt[depth]) * width, ld, transposed)


def op_steps(m: Machine, dst, depth) -> None:
    """dst's one value = the depth's counter: a while_loop's count of steps run, after its ENDLOOP (where a
    loop's body reads it; on a device one write, a crossing)."""
    m.matrix(dst, 1, 1)[...] = m.lt[depth]


def op_loopr(m: Machine, most, n, depth, cond) -> int:
    """LOOPN with the trip count read from register ``cond`` (a count STEPS wrote; on a device one read),
    refused unless a whole number in [0, most]."""
    value = float(to_host(m.matrix(cond, 1, 1).reshape(-1))[0])
    if not (0 <= value <= most and value == int(value)):
        m.fail(f"operand cond: a trip count of {value}, not a whole number in [0, {most}]")
    return op_loop(m, int(value), n, depth)


def op_while(m: Machine, n, cond) -> int:
    """A while_loop's test: skip ``n`` (the rest of the body and its ENDLOOP: the loop ends) when the one value
    of register ``cond``, computed by the instructions before it, is 0; NaN is true (on a device: one read, a
    crossing, per iteration)."""
    value = float(to_host(m.matrix(cond, 1, 1).reshape(-1))[0])
    return n if value == 0 else 0


def op_if(m: Machine, n, pred) -> int:
    """BRANCH on a pred the program computed: skip ``n`` (the then-branch and its JUMP) when the one value of
    register ``pred`` is 0; NaN is true (on a device: one read, a crossing)."""
    value = float(to_host(m.matrix(pred, 1, 1).reshape(-1))[0])
    return n if value == 0 else 0


def op_rows(m: Machine, table, first, stride, depth) -> None:
    """The instructions after it run over the loop's active rows, ``table``'s entry for the step (first + stride
    x counter, as STEPCOLS); table -1: over the task's rows again. At the loop's first step the entries it will
    read are checked (the host copy): each in [0, the task's rows], none above the one before."""
    if table < 0:
        m.active = None
        return
    if not 0 <= table < len(m.flats) or table not in m.hosts or m.hosts[table].size < m.lim[depth]:
        m.fail(f"operand table: buffer {table} is no table of {m.lim[depth]} active-row counts")
    active = m.hosts[table]
    if m.lt[depth] == 0:
        steps = active[:m.lim[depth]]
        if steps.size and (steps.min() < 0 or steps.max() > m.task_bs or (steps[1:] > steps[:-1]).any()):
            m.fail(f"operand table: active rows {steps.tolist()} are not each in [0, {m.task_bs}] and "
                   "non-increasing")
    m.active = int(active[(m.lim[depth] + first if first < 0 else first) + stride * m.lt[depth]])
