"""minicavs show: DOT of F and ∂F with every node's class color, fused groups as clusters, named gradients."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from minicavs.train.cli import main
from minicavs.engine.compile import EngineOptions
from minicavs.ir.graph import Graph
from minicavs.train.show import CLASSES, to_dot, views
from minicavs.train.trainer import Trainer

MODELS = Path(__file__).resolve().parents[2] / "models"
SMALL = ["data.synthetic.train=20", "data.synthetic.dev=5", "data.synthetic.test=5", "model.hidden=4",
         "model.embed=4"]


def parse(dot: str):
    """node id -> (label, fill color, cluster label or None); edges; cluster labels."""
    nodes, cluster = {}, None
    for line in dot.splitlines():
        m = re.match(r'\s*subgraph (cluster_\w+) \{', line)
        if m:
            cluster = m.group(1)
            continue
        if line.strip() == "}":
            cluster = None
            continue
        m = re.match(r'\s*(n\d+) \[label="(.*?)", fillcolor="(#\w+)"', line)
        if m:
            nodes[m.group(1)] = (m.group(2), m.group(3), cluster)
    edges = re.findall(r"(n\d+) -> (n\d+);", dot)
    return nodes, edges


@pytest.fixture(scope="module")
def tree_lstm():
    return Trainer(MODELS / "tree_lstm.yaml", SMALL)


@pytest.mark.parametrize("kind", ["leaf", "internal"])
def test_colors_clusters_and_gradient_names(tree_lstm, kind):
    compiled = tree_lstm.model.structures[0].compiled[kind].variant(EngineOptions())   # as it runs
    fl, bl, outs = compiled.labels()
    groups = compiled.fusion_groups(EngineOptions())
    for forward, view, classes in zip((True, False), views(compiled, EngineOptions()), (fl, bl)):
        mine = [g for g in groups if (g.nodes[0] in compiled.fwd_nodes) == forward]   # F's kernels or ∂F's
        dot = to_dot(view)
        nodes, edges = parse(dot)
        assert len(nodes) == len(view.nodes)
        by_id = {f"n{i}": n for i, n in enumerate(view.nodes)}
        for nid, (label, color, cluster) in nodes.items():
            n = by_id[nid]
            assert color == CLASSES[classes[n]][0], (n, classes[n])   # the class computed by passes/classify
            member = [k for k, g in enumerate(mine) if n in g.nodes]
            assert (cluster is not None) == bool(member)                # a fused node sits in its group's box
        clusters = {}
        for k, g in enumerate(mine):
            inside = {nodes[f"n{view.nodes.index(n)}"][2] for n in g.nodes if n in view.nodes}
            assert len(inside) <= 1                                     # one box per group
            clusters.update({c: k for c in inside})
        assert len(clusters) == len({v for v in clusters.values()})    # and one group per box
        assert set(edges) == {(f"n{view.nodes.index(x)}", f"n{view.nodes.index(n)}")
                              for n in view.nodes for x in n.inputs}
        for c in {classes[n] for n in view.nodes}:
            assert CLASSES[c][1] in dot                              # the legend lists every class used
    _, bwd = views(compiled, EngineOptions())
    named = {label.split("\\n")[0] for label, _, _ in parse(to_dot(bwd))[0].values()}
    assert {f"∂{p}" for p in compiled.param_grads} <= named        # every parameter gradient named
    assert {f"∂gather{k} (to child)" for k in compiled.gathers} <= named or kind == "leaf"
    assert sum(len(v.groups) for v in views(compiled, EngineOptions())) == len(groups) >= 1
    assert all(not v.groups for v in views(compiled, EngineOptions(fusion=False)))


def test_cli_show_writes_dot_and_pictures(tmp_path, capsys):
    assert main(["show", str(MODELS / "var_lstm.yaml"), "--out", str(tmp_path)] + sum(
        (["--set", s] for s in ["data.synthetic.train=20", "data.synthetic.dev=5", "data.synthetic.test=5"]), [])) == 0
    out = capsys.readouterr().out
    assert "F of 'lstm'" in out and "recurrent" in out
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "chain.lstm.F.dot" in files and "chain.lstm.dF.dot" in files
    if shutil.which("dot"):
        assert {"chain.lstm.F.svg", "chain.lstm.F.png", "chain.lstm.dF.png"} <= set(files)
        for f in ("chain.lstm.F.dot", "chain.lstm.dF.dot"):   # Graphviz accepts what we write
            subprocess.run(["dot", "-Tcanon", str(tmp_path / f)], check=True, capture_output=True)
    else:
        assert "Graphviz's dot is not installed" in out
    assert not [f for f in files if f.startswith(".")]



def test_cli_show_draws_a_model_of_static_graphs_and_its_loop_bodies(tmp_path, capsys):
    """seq2seq has no vertex function: ``show`` draws its static graph (every node of the loss's and the
    outputs' graph, every edge) and each foreach body (its arguments and the nodes computing its outputs)."""
    overrides = ["model.hidden=4", "model.embed=4", "model.max_len=3", "data.synthetic.train=10"]
    assert main(["show", str(MODELS / "seq2seq.yaml"), "--out", str(tmp_path), "--format", ""]
                + sum((["--set", s] for s in overrides), [])) == 0
    out = capsys.readouterr().out
    model = Trainer(MODELS / "seq2seq.yaml", overrides, run_dir=tmp_path / "run").model
    graph = Graph([model.loss] + list(model.outputs.values())).nodes
    nodes, edges = parse((tmp_path / "static.dot").read_text())
    assert len(nodes) == len(graph) and len(edges) == sum(len(n.inputs) for n in graph)
    bodies = {n.attrs["body"].name: n.attrs["body"] for n in graph if n.op == "foreach"}
    assert sorted(bodies) == ["decoder", "encoder"]
    drawn = {}
    for path in tmp_path.glob("static.*.dot"):
        text = path.read_text()
        name = re.search(r"label=\"body '(\w+)' of foreach#\d+\"", text).group(1)
        drawn[name] = parse(text)[0]
    assert set(drawn) == set(bodies)
    for name, body in bodies.items():
        assert len(drawn[name]) == len(set(body.args) | set(Graph(body.outputs).nodes))
        assert f"body '{name}' of foreach#" in out
