"""Seeing how a model runs and checking it: per structure the batching (tasks, rows moved, memory, who ran F and
∂F); the static graphs around them, or making up the whole model (their steps, control flow, fused kernels and
who ran them); and batched == serial."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..core.sparse import densify
from ..ir.graph import type_str
from ..ops.flow import Flow, flow
from .backend import to_host
from .compile import TASK
from .executor import RunContext
from .lowered import OPCODES, OPCODES_BY_ID, PHASE_WORDS, _key_text
from .program import StaticRun


@dataclass
class StructureReport:
    name: str
    vertices: int
    tasks: int
    task_sizes: np.ndarray
    copies: dict
    tensors: list          # (kind, symbol, per-vertex shape, dtype, bytes)
    where: dict            # kind -> number of nodes run in each phase (static, before, per task, after)
    peak_bytes: int        # the largest buffers the reused dynamic tensors have held so far
    policy: str = ""       # the batching policy that made the tasks
    lower_bound: int = 0   # ED-Batch's lower bound (A.3) on the tasks of any policy for this batch
    programs: list = field(default_factory=list)   # the BatchPrograms that ran: F, then ∂F

    @property
    def gather_copied(self) -> float:
        """Fraction of gathered rows that were copied (the rest were read as views: gather elision)."""
        return self.copies.get("gather", 0) / max(1, self.copies.get("gathered", 0))

    @property
    def tensor_bytes(self) -> int:
        return sum(t[4] for t in self.tensors)


@dataclass
class LoopReport:
    """A control-flow node of a static graph: what it holds and, for a loop, the steps it ran."""

    label: str               # the node's ("foreach#12")
    name: str                # its body's
    flow: Flow
    ran: int | None          # the steps run (None: a cond)
    bodies: list             # (role, BodyReport)


@dataclass
class BodyReport:
    """A control-flow body: its size, its nodes by op, the control flow inside it."""

    name: str
    nodes: int               # the nodes it computes (its arguments aside)
    ops: dict                # op -> nodes
    nested: list             # (op, Flow, [(role, BodyReport)]) of the control flow inside it


@dataclass
class StaticReport:
    """One static graph as a model run ran it (program.StaticRun, summarized)."""

    title: str
    runner: str
    steps: int
    ops: dict                # op -> steps (a fused step: "fused[...]")
    fused: int               # steps that ran a generated kernel
    rows: tuple              # the row counts of its values with the row axis
    nbytes: int              # what its values hold (kept for the backward pass)
    loops: list              # LoopReport per control-flow node it ran
    largest: list            # (node label, type, bytes), largest first
    program: object = None   # its program as the device's runner ran it (static_program.py), or None
    left: dict = field(default_factory=dict)   # why the step runner ran the rest: reason -> ops
    linked: str = ""         # linked into a structure's pass (engine/linked_head.py), or why it ran apart
    host: dict = field(default_factory=dict)   # what the host did, evaluating no op: reason -> ops


@dataclass
class Explanation:
    structures: list = field(default_factory=list)
    static: list = field(default_factory=list)   # StaticReport per static graph run, in run order
    device_runner: str = ""                     # who runs the vertex functions' programs on the model's device

    def __str__(self) -> str:
        lines = []
        for r in self.structures:
            lines += _structure_lines(r)
        if self.static:
            lines += _static_lines(self.static, self.device_runner)
        return "\n".join(lines)


def _structure_lines(r: StructureReport) -> list[str]:
    sizes = r.task_sizes
    hist = np.bincount(np.minimum(np.ceil(np.log2(np.maximum(sizes, 1))).astype(int), 16))
    bins = ", ".join(f"<={1 << i}: {c}" for i, c in enumerate(hist) if c)
    lines = [f"structure '{r.name}': {r.vertices} vertices in {r.tasks} tasks by policy '{r.policy}', "
             f"lower bound {r.lower_bound} ({r.tasks / max(r.lower_bound, 1):.2f}x) "
             f"(vertices per task: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()})",
             f"  tasks by size: {bins}",
             "  rows copied: " + ", ".join(f"{k} {v}" for k, v in r.copies.items() if k != "gathered")
             + f"; gathered rows copied: {100 * r.gather_copied:.1f}% of {r.copies.get('gathered', 0)}"]
    for kind, counts in r.where.items():
        lines.append(f"  kind '{kind}': " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for program in r.programs:
        lowered, rows = program.lowered, len(program.table)
        lines.append(f"  {program.title}: {len(program.task_table)} tasks and {rows - len(program.task_table)} "
                     f"blocks before and after them, one call of the {program.runner} "
                     f"({len(lowered.code)} instructions in {len(lowered.templates)} templates"
                     + (f"; the device's runner declined it: {program.declined})" if program.declined else ")"))
        lines += flow_lines(program, "    ")
    lines.append(f"  dynamic tensors: {len(r.tensors)}, {r.tensor_bytes / 1024:.1f} KiB held by this batch, "
                 f"peak {r.peak_bytes / 1024:.1f} KiB of buffers")
    for kind, sym, shape, dtype, nbytes in sorted(r.tensors, key=lambda t: -t[4])[:12]:
        lines.append(f"    {kind:>10} {sym:<24} {str(shape):<12} {dtype:<8} {nbytes / 1024:10.1f} KiB")
    return lines


def flow_lines(program, indent: str = "", where: bool = True) -> list[str]:
    """The loops and branches of a pass's program (a bound BatchProgram), one line each, where they lie (its
    kind and template, the instruction): per loop its depth, trip count (fixed; read where it runs, with the
    value this batch had; a while_loop's most and the register its condition tests) and body length; per
    branch its pred (with its value) and the instructions of each side (``where`` False: the instruction alone,
    for a program of one template)."""
    lowered, lines = program.lowered, []
    for tid, t in zip(lowered.template_ids, lowered.templates):
        begin, end = lowered.ranges[tid]
        place = f"kind '{t.kind}' " + ("task" if t.phase == TASK else PHASE_WORDS[t.phase] + " block")
        for pc in range(begin, end):
            text = _flow_instruction(program, t, pc)
            if text:
                lines.append(f"{indent}{program.title} {place}, instruction {pc}: {text}" if where else
                             f"{indent}instruction {pc}: {text}")
    return lines


def _flow_instruction(program, template, pc: int) -> str:
    """One LOOP, LOOPN, LOOPR, BRANCH or IF of ``program`` described ('' for any other instruction)."""
    lowered = program.lowered
    op, *a = lowered.code[pc].tolist()
    name = OPCODES_BY_ID[op]
    a = a[:len(OPCODES[name])]
    if name == "BRANCH":
        jump = pc + a[1]   # (the JUMP ending the then-branch)
        pred = _key_text(lowered.keys[a[0]])
        return (f"branch on {pred} = {_value(program, a[0])}: then {a[1] - 1} instructions, else "
                f"{int(lowered.code[jump][1])}")
    if name == "IF":   # (a static graph's cond on a pred its program computes)
        return (f"branch on r{a[1]}({template.reg_names[a[1]]}), computed in the program: then {a[0] - 1} "
                f"instructions, else {int(lowered.code[pc + a[0]][1])}")
    if name not in ("LOOP", "LOOPN", "LOOPR"):
        return ""
    at = dict(zip(OPCODES[name], a))
    depth, n = at["depth"], at["n"]
    if name == "LOOPN":
        trips = (f"{_value(program, at['count'])} steps of at most {at['most']}, the trip count read where it runs "
                 f"from {_key_text(lowered.keys[at['count']])}")
    elif name == "LOOPR":
        trips = (f"at most {at['most']} steps, the trip count read where it runs from r{at['cond']}"
                 f"({template.reg_names[at['cond']]}), a while_loop's count (STEPS)")
    else:
        trips = f"{at['trips']} steps"
    tests = [w for w in range(pc + 1, pc + n) if OPCODES_BY_ID[int(lowered.code[w][0])] == "WHILE"
             and w + 1 + int(lowered.code[w][1]) == pc + n + 1]
    if tests:
        cond = int(lowered.code[tests[0]][2])
        trips = (f"at most {at['trips']} steps, while r{cond}({template.reg_names[cond]}) is not 0 "
                 f"(WHILE at {tests[0]})")
    return f"loop at depth {depth}: {trips}, body {n - 1} instructions (to ENDLOOP at {pc + n}){_active(program, pc)}"


def _active(program, pc: int) -> str:
    """How a per-row loop opening at ``pc`` (ROWS first in its body) runs its steps: over the active rows, and
    the row-steps that makes of those its longest row would run on every row."""
    op, table, *_ = program.lowered.code[pc + 1].tolist()
    operand = program.operands[table] if OPCODES_BY_ID[op] == "ROWS" and 0 <= table < len(program.operands) \
        else None
    if operand is None or operand.host is None:
        return ""
    active = [int(v) for v in operand.host[:int(_value(program, int(program.lowered.code[pc][1])))]]
    rows = int(program.table[0][2])
    return (f"; each step over the rows still running, sorted longest first (ROWS): {sum(active)} row-steps of "
            f"{rows * len(active)}")


def _value(program, buf: int):
    """The one value of a static buffer of ``program`` (on a device: one read)."""
    operand = program.operands[buf] if 0 <= buf < len(program.operands) else None
    if operand is None:
        return "?"
    value = to_host(operand.array.reshape(-1)[:1])[0]
    return int(value) if np.issubdtype(value.dtype, np.integer) else float(value)


def _counts(ops: dict) -> str:
    return ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))


def _static_lines(reports: list, device_runner: str) -> list[str]:
    """The static graphs: who ran them and why not the device's runner, then per graph its program, its steps,
    loops and bytes, then the largest values."""
    runners = ", ".join(dict.fromkeys(r.runner for r in reports if r.steps))
    fused = sum(r.fused for r in reports)
    if any(r.program is not None for r in reports):
        programs = ", ".join(dict.fromkeys(r.program.runner for r in reports if r.program is not None))
        rest = f"what no runner takes node by node by the {runners}" if runners else \
            "no node left to the step runner (program.run_steps)"
        lines = [f"static graphs: each one program of instructions run by the {programs} (one call, a task of "
                 f"all its rows), {rest}"]
    else:
        lines = [f"static graphs: run by the {runners}, one step per node"
                 + ("" if fused else ", no fused kernel (the fusion pass groups vertex functions' phases only)")
                 + f"; the {device_runner} runs only vertex functions' programs (these static graphs were not lowered to "
                 "instructions; control flow inside a vertex function is: its loops and branches are listed "
                 "with its programs)"]
    for r in reports:
        rows = f", rows {', '.join(map(str, r.rows))}" if r.rows else ""
        lines.append(f"  {r.title}:" if (r.program is not None or r.host) and not r.steps else
                     f"  {r.title}: {r.steps} step{'s' if r.steps != 1 else ''} ({_counts(r.ops)}), fused kernels "
                     f"{r.fused}{rows}, values {r.nbytes / 1024:.1f} KiB")
        lines += _program_lines(r)
        for loop in r.loops:
            lines += _loop_lines(loop, "    ")
    largest = sorted((v for r in reports for v in r.largest), key=lambda v: -v[2])[:8]
    lines.append("  largest values:")
    lines += [f"    {label:<28} {kind:<40} {nbytes / 1024:10.1f} KiB" for label, kind, nbytes in largest]
    return lines


def _program_lines(r: StaticReport) -> list[str]:
    """A static graph's program (who ran it, what it holds, whether the device's runner declined it) and why the
    step runner ran the rest."""
    lines = []
    if r.program is not None:
        p = r.program
        opcodes = Counter(OPCODES_BY_ID[op] for op in p.lowered.code[:, 0].tolist())
        lines.append(f"    program: {len(p.lowered.code)} instructions ({_counts(opcodes)}) over {int(p.table[0, 2])} "
                     f"rows, one call of the {p.runner}"
                     + (f"; the device's runner declined it: {p.declined}" if p.declined else "")
                     + (f"; {r.linked}" if r.linked else ""))
        lines += flow_lines(p, "      ", where=False)   # (its loops: LOOP/LOOPN ... ENDLOOP)
    for why, ops in r.host.items():
        lines.append(f"    host: {', '.join(sorted(ops))}: {why}")
    for why, ops in r.left.items():
        lines.append(f"    step runner: {', '.join(sorted(ops))}: {why}")
    return lines


def _flow_text(what: str, name: str, f: Flow, ran: int | None) -> str:
    """One control-flow node: its trip count (and the steps run, where known), its inputs and states."""
    if f.length is None:
        head = f"{what} '{name}': {f.iterated} operands, {f.outputs} results"
    else:
        steps = f"{ran} of {f.length} steps ran" if ran is not None else \
            f"at most {f.length} steps" if f.counted else f"{f.length} steps"
        head = f"{what} '{name}'" + (" (reverse)" if f.reverse else "") + (
            f": {steps}, {f.iterated} iterated inputs, {f.states} states, {f.outputs} stacked outputs")
    return head + f", {f.captured} captured" + (", its per-step states saved for the gradient" if f.saves else "")


def _loop_lines(loop: LoopReport, indent: str) -> list[str]:
    lines = [indent + _flow_text(loop.label, loop.name, loop.flow, loop.ran)]
    for role, body in loop.bodies:
        lines += _body_lines(role, body, indent + "  ")
    return lines


def _body_lines(role: str, body: BodyReport, indent: str) -> list[str]:
    lines = [f"{indent}{role} '{body.name}': {body.nodes} nodes ({_counts(body.ops)}), run node by node by "
             "subgraph.Subgraph.run"]
    for op, f, bodies in body.nested:
        lines.append(indent + "  " + _flow_text(op, bodies[0][1].name, f, None))
        for role2, inner in bodies:
            lines += _body_lines(role2, inner, indent + "    ")
    return lines


def _body_report(sub) -> BodyReport:
    nested = []
    for n in sub.computed:
        f = flow(n)
        if f is not None:
            nested.append((n.op, f, [(role, _body_report(b)) for role, b in f.bodies]))
    return BodyReport(sub.name, len(sub.computed), dict(Counter(n.op for n in sub.computed)), nested)


def _loop_report(node, f: Flow, trips: dict) -> LoopReport:
    ran = trips.get(node)
    if ran is not None:
        ran = int(to_host(ran).reshape(-1).max(initial=0))   # (a trip count per row: its longest row's)
    elif f.length is not None and not f.counted:
        ran = f.length
    return LoopReport(node.label(), f.bodies[0][1].name, f, ran, [(role, _body_report(b)) for role, b in f.bodies])


def static_report(run: StaticRun) -> StaticReport:
    """A program.StaticRun summarized: its steps by op, the fused ones, its loops, its bytes."""
    ops, loops, sized = Counter(), [], []
    for step, nbytes in zip(run.steps, run.nbytes):
        node = step.outputs[0]
        ops[f"fused[{' '.join(n.op for n in step.run.group.nodes)}]" if step.fused else node.op] += 1
        f = None if step.fused else flow(node)
        if f is not None:
            loops.append(_loop_report(node, f, run.trips))
        kind = type_str(node)
        sized.append((node.label(), kind if len(kind) <= 40 else f"({len(node.attrs['_types'])} values)", nbytes))
    largest = sorted(sized, key=lambda v: -v[2])[:8]
    left, host = _by_reason(run.left), _by_reason(run.host)
    return StaticReport(run.title, run.runner, len(run.steps), dict(ops), sum(s.fused for s in run.steps),
                        run.rows, sum(run.nbytes), loops, largest, run.program, left, run.linked, host)


def _by_reason(nodes: dict | None) -> dict:
    """{reason: the ops of ``nodes`` (node -> reason) given it}."""
    found: dict = {}
    for node, why in (nodes or {}).items():
        found.setdefault(why, set()).add(node.op)
    return found


def explain(model, graphs, feeds=None, params=None, ctx=None, policy=None) -> Explanation:
    """Run one training step's forward and backward and report how it ran: per structure the batching it
    used and who ran F and ∂F; the static graphs (loss, classifier, a model of static graphs only), their
    control flow, what was fused and who ran them."""
    from ..runtime.scheduler import get_policy
    policy = get_policy(policy) if policy is not None else model.policy
    result = model.run(graphs, feeds, params, ctx or RunContext(), policy=policy)
    return Explanation([_structure_report(model, s, result, policy) for s in model.structures],
                       [static_report(run) for run in result.static], model.device.runner_name)


def _structure_report(model, s, result, policy) -> StructureReport:
    """Structure ``s`` in ``result``: its tasks, tensors, phases per kind and the programs that ran."""
    from ..runtime.scheduler import lower_bound
    batch, plan = result.batches[s.name]
    state = result.states[s.name]
    sizes = np.diff(plan.schedule.task_ptr)
    tensors, where = [], {}
    for kind_id, kname in enumerate(batch.kind_names):
        fn = s.compiled.get(kname)
        if fn is None or plan.kinds[kind_id] is None:
            continue
        fn = fn.variant(state.opts)
        for node, t in state.tensors[kind_id].items():
            tensors.append((kname, node.name or f"{node.op}#{node.id}", t.shape, t.dtype.name, t.nbytes))
        where[kname] = _phase_counts(fn, state.opts)
    for shape, sc in state.scatters.items():    # one per message shape, shared by the kinds scattering it
        tensors.append(("(shared)", "scatter", shape, sc.dtype.name, sc.nbytes))
    peak = model.workspace(s.name).peak_bytes
    programs = [p for p in (state.program, state.backward_program) if p is not None]
    return StructureReport(s.name, batch.num_vertices, len(sizes), sizes, dict(state.copies), tensors, where,
                           peak, policy.name, lower_bound(batch), programs)


def _phase_counts(fn, opts) -> dict:
    """A compiled function's nodes per phase of F and ∂F, its fused kernels and merged GEMMs."""
    forward_phases, backward_phases = fn.phases(opts)
    return {"F static": len(fn.static_fwd),
            "F before tasks": len(forward_phases.programs[0]),
            "F per task": len(forward_phases.programs[1]),
            "F after tasks": len(forward_phases.programs[2]),
            "∂F static": len(fn.static_bwd),
            "∂F before tasks": len(backward_phases.programs[0]),
            "∂F per task": len(backward_phases.programs[1]),
            "∂F after tasks": len(backward_phases.programs[2]),
            "fused kernels": sum(len(g) for g in forward_phases.groups + backward_phases.groups),
            "merged GEMMs": len(fn.merges)}


def _maxdiff(a, b) -> float:
    a, b = np.asarray(densify(np, a), np.float64), np.asarray(densify(np, b), np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def check(model, graphs, feeds=None, params=None, ctx=None) -> dict:
    """Rerun the batch with the serial policy; the largest differences in loss, pushes and gradients.

    Run in float64 for a meaningful comparison (DESIGN.md's "equal": max|a-b| <= 1e-10 * max(1, max|ref|))."""
    ctx = ctx or RunContext()
    batched = model.run(graphs, feeds, params, RunContext(ctx.seed, ctx.step, ctx.training))
    serial = model.run(graphs, feeds, params, RunContext(ctx.seed, ctx.step, ctx.training), policy="serial")
    report = {}
    if batched.loss is not None:
        report["loss"] = abs(batched.loss - serial.loss)
    for name in batched.outputs:
        report[f"output {name}"] = _maxdiff(batched.outputs[name], serial.outputs[name])
    for s, pushes in batched.pushes.items():
        for name, buf in pushes.items():
            report[f"push {s}.{name}"] = _maxdiff(buf, serial.pushes[s][name])
    for name, g in batched.grads.items():
        report[f"grad {name}"] = _maxdiff(g, serial.grads[name])
    report["max"] = max(report.values()) if report else 0.0
    return report
