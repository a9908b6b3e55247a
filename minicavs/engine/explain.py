"""Seeing and checking the batching: what ran where and how much memory moved, and batched == serial."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.sparse import densify
from .executor import RunContext


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
class Explanation:
    structures: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = []
        for r in self.structures:
            sizes = r.task_sizes
            hist = np.bincount(np.minimum(np.ceil(np.log2(np.maximum(sizes, 1))).astype(int), 16))
            bins = ", ".join(f"<={1 << i}: {c}" for i, c in enumerate(hist) if c)
            lines += [f"structure '{r.name}': {r.vertices} vertices in {r.tasks} tasks by policy '{r.policy}', "
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
            lines.append(f"  dynamic tensors: {len(r.tensors)}, {r.tensor_bytes / 1024:.1f} KiB held by this batch, "
                         f"peak {r.peak_bytes / 1024:.1f} KiB of buffers")
            for kind, sym, shape, dtype, nbytes in sorted(r.tensors, key=lambda t: -t[4])[:12]:
                lines.append(f"    {kind:>10} {sym:<24} {str(shape):<12} {dtype:<8} {nbytes / 1024:10.1f} KiB")
        return "\n".join(lines)


def explain(model, graphs, feeds=None, params=None, ctx=None, policy=None) -> Explanation:
    """Run one training step's forward and backward and report the batching it used."""
    from ..runtime.scheduler import get_policy, lower_bound
    policy = get_policy(policy) if policy is not None else model.policy
    result = model.run(graphs, feeds, params, ctx or RunContext(), policy=policy)
    out = Explanation()
    for s in model.structures:
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
            forward_phases, backward_phases = fn.phases(state.opts)
            where[kname] = {"F static": len(fn.static_fwd),
                            "F before tasks": len(forward_phases.programs[0]),
                            "F per task": len(forward_phases.programs[1]),
                            "F after tasks": len(forward_phases.programs[2]),
                            "∂F static": len(fn.static_bwd),
                            "∂F before tasks": len(backward_phases.programs[0]),
                            "∂F per task": len(backward_phases.programs[1]),
                            "∂F after tasks": len(backward_phases.programs[2]),
                            "fused kernels": sum(len(g) for g in forward_phases.groups + backward_phases.groups),
                            "merged GEMMs": len(fn.merges)}
        for shape, sc in state.scatters.items():    # one per message shape, shared by the kinds scattering it
            tensors.append(("(shared)", "scatter", shape, sc.dtype.name, sc.nbytes))
        peak = model.workspace(s.name).peak_bytes
        programs = [p for p in (state.program, state.backward_program) if p is not None]
        out.structures.append(StructureReport(s.name, batch.num_vertices, len(sizes), sizes,
                                              dict(state.copies), tensors, where, peak, policy.name,
                                              lower_bound(batch), programs))
    return out


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
