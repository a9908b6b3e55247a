"""Pictures of F and ∂F: ``minicavs show CONFIG`` writes, per vertex function, Graphviz DOT (and SVG/PNG when
Graphviz's ``dot`` is installed) with every node colored by its class, fused groups drawn as clusters and
∂F's outputs named by what they are the gradient of; then the model's static graph (pulls, loss, outputs: the
whole of a model without vertex functions) and each control-flow body in it, one picture each.

:func:`to_dot` renders plain data (nodes, classes, groups, names), so it knows nothing of the engine;
:func:`views` collects that data from a compiled vertex function.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ..core.atomic import write_bytes, write_text
from ..ir.graph import Graph, Node, type_str
from ..ops.flow import flow
from ..ops.registry import OPS

# class -> (fill color, what it means); the legend lists the classes a picture uses, in this order
CLASSES = {
    "eager": ("#b7e4c7", "eager: pulls and parameters only, once over all vertices before the tasks"),
    "recurrent": ("#f4a6a6", "recurrent: on the gather -> scatter path, task by task"),
    "lazy": ("#a9c9f5", "lazy: nothing recurrent reads it, once after the tasks"),
    "static": ("#d9d9d9", "static: no vertex axis (parameters), once per batch"),
    "forward value": ("#ffffff", "forward value: a value of F that ∂F reads"),
    "static graph": ("#e8e0f5", "static graph: once per batch, node by node (the step interpreter)"),
}


@dataclass
class View:
    """One picture: ``nodes`` in topological order, a class per node, fused groups, names for some nodes."""
    title: str
    nodes: Sequence[Node]
    classes: Mapping[Node, str]
    groups: Sequence[Sequence[Node]] = ()
    names: Mapping[Node, str] = field(default_factory=dict)   # e.g. a gradient's "∂W"
    outputs: Sequence[Node] = ()


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def to_dot(view: View) -> str:
    """Graphviz source of ``view``: a box per node (op, name, type), filled by class; clusters for fused
    groups; a legend of the classes used."""
    idx = {n: i for i, n in enumerate(view.nodes)}
    outs = set(view.outputs)
    lines = ["digraph G {", "  rankdir=TB;", f'  label="{_esc(view.title)}"; labelloc=t; fontsize=18;',
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
             '  edge [color="#555555", arrowsize=0.6];']

    def node_line(n: Node, indent: str = "  ") -> str:
        cls = view.classes.get(n, "static")
        color = CLASSES.get(cls, ("#ffffff", ""))[0]
        parts = [n.name if n.op == "param" else n.op + (f" '{n.name}'" if n.name else ""), type_str(n)]
        if n in view.names:
            parts.insert(0, view.names[n])
        text = "\\n".join(_esc(p) for p in parts)
        shape = ", shape=ellipse" if OPS[n.op].source and not n.inputs and OPS[n.op].rows is None else ""
        style = ', style="rounded,filled,dashed"' if cls == "forward value" else ""
        extra = ", penwidth=2.5" if n in outs or n in view.names else ""
        return f'{indent}n{idx[n]} [label="{text}", fillcolor="{color}"{shape}{style}{extra}];'

    grouped = {}
    for k, group in enumerate(view.groups):
        members = [n for n in group if n in idx]
        if not members:
            continue
        lines.append(f"  subgraph cluster_fused{k} {{")
        lines.append(f'    label="fused kernel {k + 1} ({len(members)} ops)"; style="dashed,rounded"; '
                     'color="#7a4fbf"; fontcolor="#7a4fbf"; fontsize=10;')
        for n in members:
            lines.append(node_line(n, "    "))
            grouped[n] = k
        lines.append("  }")
    for n in view.nodes:
        if n not in grouped:
            lines.append(node_line(n))
    for n in view.nodes:
        for x in n.inputs:
            if x in idx:
                lines.append(f"  n{idx[x]} -> n{idx[n]};")
    used = [c for c in CLASSES if c in set(view.classes.get(n, "static") for n in view.nodes)]
    lines.append("  subgraph cluster_legend {")
    lines.append('    label="classes"; style=rounded; color="#999999"; fontsize=10;')
    for c in used:
        color, meaning = CLASSES[c]
        style = ', style="rounded,filled,dashed"' if c == "forward value" else ""
        lines.append(f'    legend_{c.replace(" ", "_")} [label="{_esc(meaning)}", fillcolor="{color}"{style}];')
    if view.groups:
        lines.append('    legend_fused [label="dashed purple box: one fused (generated) kernel", '
                     'style="rounded,dashed", color="#7a4fbf", fontcolor="#7a4fbf"];')
    legend = [f"legend_{c.replace(' ', '_')}" for c in used] + (["legend_fused"] if view.groups else [])
    for a, b in zip(legend, legend[1:]):
        lines.append(f"    {a} -> {b} [style=invis];")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def views(compiled, options) -> tuple[View, View]:
    """F and ∂F of a compiled vertex function (``compile.CompiledFunction``) under engine ``options``."""
    compiled = compiled.variant(options)
    fl, bl, outs = compiled.labels()
    groups = [g.nodes for g in compiled.fusion_groups(options)] if options.fusion else []
    name = compiled.F.name
    f_graph = compiled.F.graph
    fwd = View(f"F of '{name}'", f_graph.nodes, fl, [g for g in groups if g[0] in fl], outputs=f_graph.outputs)
    names = {g: f"∂{p}" for p, g in compiled.param_grads.items()}
    for leaf, g in compiled.leaf_grads.items():
        names[g] = f"∂{leaf.name or leaf.op}" + (" (to child)" if leaf in compiled.gather_slot else "")
    b_graph = Graph(outs)
    bwd = View(f"∂F of '{name}' (outputs: gradients, bold)", b_graph.nodes, bl,
               [g for g in groups if g[0] not in fl], names, outputs=outs)
    return fwd, bwd


def static_views(model) -> list[tuple[str, View]]:
    """The model's static graph (the nodes its structures' pulls, its loss and its outputs need) and each
    control-flow body in it, nested ones too: (file stem, picture) pairs; none for a model without one."""
    nodes = [n for stage in model.stages for n in stage] + list(model.final_stage)
    if not nodes:
        return []
    outputs = ([model.loss] if model.loss is not None else []) + list(model.outputs.values())
    found = [("static", _static_view("static graph: pulls, loss and outputs", nodes, outputs))]
    holders = list(nodes)
    while holders:
        node = holders.pop(0)
        held = flow(node)
        for role, body in held.bodies if held is not None else ():
            title = f"{role} '{body.name}' of {node.label()}"
            found.append((f"static.{node.op}{node.id}.{role}", _static_view(title, body.nodes, body.outputs)))
            holders += list(body.computed)
    return found


def _static_view(title: str, nodes: Sequence[Node], outputs: Sequence[Node]) -> View:
    return View(title, nodes, dict.fromkeys(nodes, "static graph"), outputs=outputs)


def render(dot_path: Path, formats: Sequence[str]) -> list[Path]:
    """``dot -T<format>`` beside the DOT file, for each format; nothing without Graphviz."""
    exe = shutil.which("dot")
    written = []
    if exe is None:
        return written
    for fmt in formats:
        target = dot_path.with_suffix(f".{fmt}")
        picture = subprocess.run([exe, f"-T{fmt}", str(dot_path)], check=True, capture_output=True).stdout
        write_bytes(target, picture)
        written.append(target)
    return written


def summary(view: View) -> str:
    counts = {}
    for n in view.nodes:
        c = view.classes.get(n, "static")
        counts[c] = counts.get(c, 0) + 1
    return (f"{len(view.nodes)} nodes (" + ", ".join(f"{c} {counts[c]}" for c in CLASSES if c in counts)
            + f"), {len(view.groups)} fused kernels")


def add_arguments(p) -> None:
    p.add_argument("config", help="a YAML config, e.g. models/tree_lstm.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.engine.fusion=false (repeatable)")
    p.add_argument("--out", default=None, help="where the files go (default graphs/<config name>)")
    p.add_argument("--format", default="svg,png",
                   help="what Graphviz's dot renders besides the DOT files (default svg,png; '' for none)")


def run(args) -> int:
    from .trainer import Trainer
    trainer = Trainer(args.config, args.overrides)
    out = Path(args.out) if args.out else Path("graphs") / trainer.cfg["config_name"]
    out.mkdir(parents=True, exist_ok=True)
    formats = [f for f in args.format.split(",") if f]
    rendered = shutil.which("dot") is not None
    pictures = [(f"{s.name}.{kind}.{suffix}", view) for s in trainer.model.structures
                for kind, compiled in s.compiled.items()
                for suffix, view in zip(("F", "dF"), views(compiled, trainer.model.options))]
    for stem, view in pictures + static_views(trainer.model):
        path = out / f"{stem}.dot"
        write_text(path, to_dot(view))
        files = [path] + render(path, formats)
        print(f"{view.title}: {summary(view)}: " + ", ".join(str(f) for f in files))
    if formats and not rendered:
        print("Graphviz's dot is not installed: DOT files only (apt-get install graphviz, then dot -Tsvg FILE)")
    return 0
