"""Which vertex function runs a vertex (its kind) is explicit: the kinds given with its graph, else the
structure's kind rule, else the only function; never a function's name."""
import numpy as np
import pytest

from minicavs import ops
from minicavs.core.errors import InputGraphError, ShapeError
from minicavs.runtime.inputs import InputGraph
from minicavs.engine.model import Model, Structure, by_child_count, leaf_internal
from minicavs.runtime.vertex import VertexFunction

H = 3
RNG = np.random.default_rng(0)
VALUES = {"W": RNG.standard_normal((H, H)), "U": RNG.standard_normal((2 * H, H)), "b": RNG.standard_normal(H)}


def tree_model(leaf_name: str, internal_name: str, kinds=None):
    """A leaf projects its pulled x, an internal vertex mixes its two children; loss = sum of pushed h**2."""
    W, U, b = (ops.param_node(n, v.shape, "float64") for n, v in VALUES.items())
    leaf = VertexFunction(leaf_name, message=(H,), dtype="float64")
    with leaf:
        h = ops.tanh(ops.linear(leaf.pull((H,), "x"), W, b))
        leaf.scatter(h)
        leaf.push(h)
    internal = VertexFunction(internal_name, arity=2, message=(H,), dtype="float64")
    with internal:
        h = ops.tanh(ops.linear(ops.concat([internal.gather(0), internal.gather(1)]), U, b))
        internal.scatter(h)
        internal.push(h)
    s = Structure({leaf_name: leaf, internal_name: internal}, pulls={"x": ops.input((None, H), "float64", name="xs")},
                  kinds=kinds)
    return s, Model(s, loss=ops.sum(ops.square(s.pushed("h"))))


def trees():
    return [InputGraph([[], [], [0, 1], [], [2, 3]]), InputGraph.complete_binary_tree(2)]


def with_kinds(graphs, leaf, internal):
    return [InputGraph.from_csr(g.child_ptr, g.child_idx, [leaf if n == 0 else internal for n in g.num_children()])
            for g in graphs]


def run(model, graphs):
    leaves = sum(int((g.num_children() == 0).sum()) for g in graphs)
    res = model.forward_backward(graphs, {"xs": np.linspace(-1, 1, leaves * H).reshape(leaves, H)}, VALUES)
    return res.loss, res.grads


def test_function_names_do_not_choose_the_function():
    """The same model under other names, with the kinds given by a rule or with the graphs, computes the
    same loss and gradients; with no rule and no kinds, even 'leaf'/'internal' is an error, not a guess."""
    want = run(tree_model("leaf", "internal", leaf_internal)[1], trees())
    for model, graphs in ((tree_model("word", "merge", by_child_count("word", "merge"))[1], trees()),
                          (tree_model("word", "merge")[1], with_kinds(trees(), "word", "merge")),
                          (tree_model("leaf", "internal")[1], with_kinds(trees(), "leaf", "internal"))):
        loss, grads = run(model, graphs)
        assert loss == pytest.approx(want[0], rel=1e-14, abs=0)
        for name in VALUES:
            np.testing.assert_allclose(grads[name], want[1][name], rtol=1e-13, atol=1e-15)
    for names in (("leaf", "internal"), ("word", "merge")):
        s, model = tree_model(*names)
        with pytest.raises(InputGraphError, match=rf"structure 'G' has vertex functions \['{names[0]}', "
                                                  rf"'{names[1]}'\], but sample 0 gives no kinds: give each graph "
                                                  r"its kinds .* or the structure a kind rule"):
            s.batch(trees())


def test_kinds_given_with_a_graph_are_honoured_even_against_the_rule():
    s, _ = tree_model("leaf", "internal", leaf_internal)
    g = InputGraph([[], [], [0, 1]], kinds=["leaf", "internal", "internal"])   # vertex 1: no children, internal
    batch = s.batch([g, InputGraph([[], [], [0, 1]])])                         # sample 1: by the rule
    assert [batch.kind_names[k] for k in batch.kind] == ["leaf", "internal", "internal", "leaf", "leaf", "internal"]


def test_a_kind_without_a_function_is_an_error_naming_sample_vertex_kind_and_functions():
    s, _ = tree_model("word", "merge")
    g = InputGraph([[], [], [0, 1]], kinds=["word", "word", "internal"])
    with pytest.raises(InputGraphError, match=r"sample 1, vertex 2: kind 'internal' \(given with the graph\) has "
                                              r"no vertex function in structure 'G' \(vertex functions "
                                              r"\['word', 'merge'\]\)"):
        s.batch([with_kinds(trees(), "word", "merge")[0], g])
    s, _ = tree_model("word", "merge", leaf_internal)   # the rule names kinds the structure does not have
    with pytest.raises(InputGraphError, match=r"sample 0, vertex 0: kind 'leaf' \(by the structure's rule "
                                              r"by_child_count\('leaf', 'internal'\)\) has no vertex function"):
        s.batch(trees())


def test_arity_errors_name_sample_vertex_kind_function_and_where_the_kind_came_from():
    s, _ = tree_model("word", "merge")
    g = InputGraph([[], [], [0, 1]], kinds=["word", "word", "word"])
    with pytest.raises(InputGraphError, match=r"sample 0, vertex 2: 2 children, more than the arity 0 of vertex "
                                              r"function 'word' \(kind 'word', given with the graph\)"):
        s.batch([g])
    s, _ = tree_model("word", "merge", by_child_count("merge", "word"))   # a rule that swaps them
    with pytest.raises(InputGraphError, match=r"sample 0, vertex 2: 2 children, more than the arity 0 of vertex "
                                              r"function 'word' \(kind 'word', by the structure's rule "
                                              r"by_child_count\('merge', 'word'\)\)"):
        s.batch([InputGraph([[], [], [0, 1]])])


def test_one_function_runs_every_vertex_and_other_kinds_are_rejected():
    F = VertexFunction("cell", arity=2, message=(H,), dtype="float64")
    with F:
        F.scatter(ops.tanh(F.pull((H,), "x") + F.gather(0) + F.gather(1)))
    s = Structure(F, pulls={"x": ops.input((None, H), "float64", name="xs")})
    assert s.batch(trees()).kind.tolist() == [0] * 8
    assert s.batch([InputGraph([[]], kinds=["cell"])]).kind.tolist() == [0]
    with pytest.raises(InputGraphError, match=r"sample 0, vertex 0: kind 'leaf' \(given with the graph\) has no "
                                              r"vertex function in structure 'G' \(vertex functions \['cell'\]\)"):
        s.batch([InputGraph([[]], kinds=["leaf"])])


def test_a_rule_must_be_callable_and_give_a_kind_per_vertex():
    F = VertexFunction("cell", message=(H,), dtype="float64")
    with F:
        F.scatter(ops.tanh(F.pull((H,), "x")))
    with pytest.raises(ShapeError, match=r"kinds must be a rule"):
        Structure(F, pulls={"x": ops.input((None, H), "float64", name="xs")}, kinds=["cell"])
    s = Structure(F, pulls={"x": ops.input((None, H), "float64", name="xs")},
                  kinds=lambda batch: (np.zeros(batch.num_vertices - 1, np.int64), ("cell",)))
    with pytest.raises(InputGraphError, match=r"kind rule <lambda>: kind id array of shape \(4,\), need \(5,\)"):
        s.batch(trees()[:1])
    s = Structure(F, pulls={"x": ops.input((None, H), "float64", name="xs")},
                  kinds=lambda batch: (np.full(batch.num_vertices, 1), ("cell",)))
    with pytest.raises(InputGraphError, match=r"kind rule <lambda>: kind id 1 out of range \[0, 1\) at vertex 0"):
        s.batch(trees()[:1])


def test_a_step_without_outputs_skips_them_and_changes_nothing_else():
    """forward_backward(outputs=False), as a training step calls it, computes the same loss and gradients and
    no outputs: an output the loss does not need (here a softmax over the pushed rows) is not evaluated."""
    s, _ = tree_model("leaf", "internal", leaf_internal)
    h = s.pushed("h")
    model = Model(s, loss=ops.sum(ops.square(h)), outputs={"probs": ops.softmax(h), "h": h})
    feeds = {"xs": np.linspace(-1, 1, 5 * H).reshape(5, H)}
    full = model.forward_backward(trees(), feeds, VALUES)
    lean = model.forward_backward(trees(), feeds, VALUES, outputs=False)
    assert set(full.outputs) == {"probs", "h"} and lean.outputs == {}
    assert lean.loss == full.loss and set(lean.grads) == set(full.grads) == set(VALUES)
    for name in VALUES:
        assert np.array_equal(lean.grads[name], full.grads[name])
    assert not any(n.op == "softmax" for n in model.loss_stage)
    assert any(n.op == "softmax" for n in model.final_stage)


# --- the plan cache: a batch of the very same graphs reuses its flattening, schedule and memory plan ----------

def plans_of(prepared):
    (plan,) = prepared.plans.values()
    return plan


def test_a_batch_of_the_same_graph_objects_reuses_its_plan_and_computes_the_same():
    s, model = tree_model("leaf", "internal", leaf_internal)
    graphs = trees()
    first = plans_of(model.prepare(graphs))
    assert plans_of(model.prepare(list(graphs))) is first                    # same objects, another list
    assert plans_of(model.prepare(graphs, sample_ids=[7, 9])) is first       # no dropout: ids do not matter
    cached = run(model, graphs)
    fresh = run(Model(s, loss=model.loss), graphs)
    assert cached[0] == fresh[0] and all(np.array_equal(cached[1][k], fresh[1][k]) for k in VALUES)


def test_the_plan_cache_never_serves_a_plan_made_for_other_graphs_policy_or_options(monkeypatch):
    from minicavs.engine import model as model_module
    from minicavs.engine.compile import EngineOptions
    from minicavs.runtime.scheduler import FsmPolicy
    s, model = tree_model("leaf", "internal", leaf_internal)
    graphs = trees()
    first = plans_of(model.prepare(graphs))
    same_shape = [InputGraph.from_csr(g.child_ptr, g.child_idx) for g in graphs]   # equal, not the same objects
    assert plans_of(model.prepare(same_shape)) is not first
    other = [graphs[1], graphs[0]]
    assert plans_of(model.prepare(other))[0].num_vertices == first[0].num_vertices
    assert plans_of(model.prepare(other)) is not first
    assert np.array_equal(plans_of(model.prepare(other))[0].child_idx,
                          plans_of(Model(s, loss=model.loss).prepare(other))[0].child_idx)
    assert plans_of(model.prepare(graphs, policy="serial")) is not first
    assert plans_of(model.prepare(graphs, options=EngineOptions(lazy_batching=False))) is not first
    fsm = FsmPolicy()
    assert plans_of(model.prepare(graphs, policy=fsm)) is not plans_of(model.prepare(graphs, policy=fsm))
    for k in range(8):   # bounded: the oldest plans go
        model.prepare([InputGraph.complete_binary_tree(2 ** (k % 4 + 1))] * (k // 4 + 1))
    assert len(model._plans) <= 4 and plans_of(model.prepare(graphs)) is not first
    monkeypatch.setattr(model_module, "PLAN_CACHE_VERTICES", 40)   # and at most so many vertices, but the last
    big = [InputGraph.complete_binary_tree(32)]
    plans_of(model.prepare(graphs))
    assert plans_of(model.prepare(big)) is plans_of(model.prepare(big)) and len(model._plans) == 1
    kept = plans_of(model.prepare(big))
    model.forget_plans()
    assert plans_of(model.prepare(big)) is not kept


def test_with_dropout_the_sample_ids_key_the_plan():
    H2 = 2
    leaf = VertexFunction("leaf", message=(H2,), dtype="float64")
    with leaf:
        leaf.scatter(ops.dropout(leaf.pull((H2,), "x"), 0.5))
    node = VertexFunction("internal", arity=2, message=(H2,), dtype="float64")
    with node:
        h = ops.dropout(node.gather(0) + node.gather(1), 0.5)
        node.scatter(h)
        node.push(h)
    s = Structure({"leaf": leaf, "internal": node}, pulls={"x": ops.input((None, H2), "float64", name="xs")},
                  kinds=leaf_internal)
    model = Model(s, loss=ops.sum(s.pushed("h")))
    assert s.reads_row_keys
    graphs = trees()
    a = plans_of(model.prepare(graphs, sample_ids=[0, 1]))
    b = plans_of(model.prepare(graphs, sample_ids=[4, 1]))
    assert a is not b and plans_of(model.prepare(graphs, sample_ids=[0, 1])) is a
    keys = [p.row_keys for p in a[1].kinds], [p.row_keys for p in b[1].kinds]
    assert not all(np.array_equal(x, y) for x, y in zip(*keys))
