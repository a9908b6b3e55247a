"""Parameter and ParameterSet: values, nodes, determinism, and use as the executor's params."""
import numpy as np
import pytest

from minicavs import Executor, FeedError, ops
from minicavs.nn import Parameter, ParameterSet


def test_parameter_holds_value_and_node():
    p = Parameter("enc/W", (3, 4))
    assert p.name == "enc/W" and p.shape == (3, 4) and p.weight_decay
    assert p.value.dtype == np.float32 and p.value.shape == (3, 4)
    assert p.node.op == "param" and p.node.name == "enc/W"
    assert p.node.shape == (3, 4) and p.node.dtype.name == "float32"
    assert np.abs(p.value).max() <= np.sqrt(6 / 7) and p.value.std() > 0  # glorot by default


def test_float64_and_opt_out():
    p = Parameter("b", (5,), init="zeros", dtype="float64", weight_decay=False)
    assert p.value.dtype == np.float64 and p.node.dtype.name == "float64"
    assert not p.value.any() and p.weight_decay is False


def test_seed_and_name_determine_the_value():
    a = Parameter("W", (4, 4), rng=3).value
    np.testing.assert_array_equal(a, Parameter("W", (4, 4), rng=3).value)
    assert not np.array_equal(a, Parameter("W", (4, 4), rng=4).value)
    assert not np.array_equal(a, Parameter("U", (4, 4), rng=3).value)  # same shape, other name
    np.testing.assert_array_equal(Parameter("W", (4, 4)).value, Parameter("W", (4, 4), rng=0).value)


def test_generator_is_drawn_from():
    gen = np.random.default_rng(5)
    a, b = Parameter("a", (3,), init="uniform(1)", rng=gen), Parameter("b", (3,), init="uniform(1)", rng=gen)
    expect = np.random.default_rng(5).uniform(-1, 1, size=6).astype(np.float32)
    np.testing.assert_array_equal(np.concatenate([a.value, b.value]), expect)


def test_initial_value_from_an_array_is_copied():
    src = np.arange(6.0).reshape(2, 3)
    p = Parameter("W", (2, 3), init=src)
    src[0, 0] = 99
    assert p.value[0, 0] == 0 and p.value.dtype == np.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="", shape=(2,)), "non-empty"),
    (dict(name="W", shape=(2, -1)), "non-negative"),
    (dict(name="W", shape=(2, None)), "non-negative"),
    (dict(name="W", shape=(2,), dtype="int32"), "not a float"),
    (dict(name="W", shape=(2, 3), init=np.zeros((3, 2))), r"shape \(3, 2\)"),
    (dict(name="W", shape=(2, 3), init=lambda shape, rng: np.zeros(4)), "declared"),
])
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Parameter(**kwargs)


def test_parameter_set_is_an_ordered_mapping():
    ps = ParameterSet([Parameter("z", (1,)), Parameter("a", (2,))])
    c = ps.new("m", (3,), init="zeros")
    assert list(ps) == ["z", "a", "m"] and len(ps) == 3
    assert ps["m"] is c and "a" in ps and "q" not in ps
    assert [n.name for n in ps.nodes] == ["z", "a", "m"]
    assert [p.name for p in ps.values()] == ["z", "a", "m"]


def test_duplicate_names_are_rejected():
    ps = ParameterSet([Parameter("W", (2,))])
    with pytest.raises(ValueError, match="duplicate parameter name 'W'"):
        ps.add(Parameter("W", (3,)))
    assert ps["W"].shape == (2,)
    with pytest.raises(ValueError, match="duplicate"):
        ParameterSet([Parameter("b", (1,)), Parameter("b", (1,))])
    with pytest.raises(TypeError):
        ps.add(np.zeros(2))


def test_parameter_set_feeds_the_executor():
    ps = ParameterSet()
    w = ps.new("W", (3, 2), init=np.array([[1, 2], [3, 4], [5, 6]]))
    b = ps.new("b", (2,), init="constant(0.5)")
    x = ops.input((None, 3), name="x")
    ex = Executor([ops.linear(x, w.node, b.node)])
    xv = np.array([[1, 0, -1], [2, 1, 0]], np.float32)
    np.testing.assert_array_equal(ex.run({x: xv}, ps)[0], [[-3.5, -3.5], [5.5, 8.5]])
    w.value *= 2  # in-place updates are seen by the next run
    np.testing.assert_array_equal(ex.run({x: xv}, ps)[0], [[-7.5, -7.5], [10.5, 16.5]])
    with pytest.raises(FeedError, match="'b'"):
        ex.run({x: xv}, ParameterSet([w]))


def test_a_frozen_parameter_gets_no_gradient_in_f_or_outside_it():
    """trainable=False marks the parameter's node frozen: the model derives no gradient for it, whether a
    vertex function reads it (W) or a static pull does (the table E), and the pull needs none either."""
    from minicavs import InputGraph, Model, Structure, VertexFunction, leaf_internal

    def build(frozen: set):
        p = ParameterSet()
        p.new("E", (5, 3), init="uniform(0.5)", dtype="float64", rng=1, trainable="E" not in frozen)
        p.new("W", (3, 2), dtype="float64", rng=1, trainable="W" not in frozen)
        p.new("U", (4, 2), dtype="float64", rng=1)
        leaf = VertexFunction("leaf", message=(2,), dtype="float64")
        with leaf:
            h = ops.tanh(leaf.pull((3,), "x") @ p["W"].node)
            leaf.scatter(h)
            leaf.push(h)
        internal = VertexFunction("internal", arity=2, message=(2,), dtype="float64")
        with internal:
            h = ops.tanh(ops.concat([internal.gather(0), internal.gather(1)]) @ p["U"].node)
            internal.scatter(h)
            internal.push(h)
        words = ops.input((None,), "int64", name="words")
        s = Structure({"leaf": leaf, "internal": internal}, pulls={"x": ops.lookup(p["E"].node, words)},
                      kinds=leaf_internal, name="tree")
        return p, Model(s, loss=ops.sum(s.pushed("h")))

    from minicavs.core.sparse import densify
    from minicavs.train.testing import check_model_grads

    graphs = [InputGraph([[], [], [0, 1]])]
    feeds = {"words": np.array([1, 3])}
    p, model = build(set())
    full = model.forward_backward(graphs, feeds, p).grads
    for frozen in ({"E"}, {"W"}, {"E", "W"}):
        p, model = build(frozen)
        assert [q.name for q in p.trainable()] == [n for n in ("E", "W", "U") if n not in frozen]
        assert model.structures[0].pull_grads == (set() if "E" in frozen else {"x"})
        grads = model.forward_backward(graphs, feeds, p).grads
        assert set(grads) == {"E", "W", "U"} - frozen
        for name in grads:   # the other parameters' gradients are what they are without freezing
            np.testing.assert_array_equal(densify(np, grads[name]), densify(np, full[name]))
        assert set(check_model_grads(model, graphs, feeds, p)) == {"E", "W", "U"} - frozen
    assert repr(build({"E"})[0]["E"]) == "Parameter('E', (5, 3), float64, frozen)"


def _gates(seed=0):
    ps = ParameterSet()
    ps.new("W", (3, 8), rng=seed, dtype="float64")
    ps.new("b", (8,), init="uniform(1)", rng=seed, dtype="float64", weight_decay=False)
    ps.new("V", (2, 4), rng=seed, dtype="float64")
    return ps


def test_split_gives_the_blocks_of_the_last_axis_in_place():
    ps = _gates()
    W, b = ps["W"].value.copy(), ps["b"].value.copy()
    made = ps.split("W", "ifou")
    ps.split("b", "ifou")
    assert list(ps) == ["W.i", "W.f", "W.o", "W.u", "b.i", "b.f", "b.o", "b.u", "V"]
    assert [p.name for p in made] == ["W.i", "W.f", "W.o", "W.u"]
    np.testing.assert_array_equal(np.concatenate([ps[f"W.{g}"].value for g in "ifou"], axis=1), W)
    np.testing.assert_array_equal(np.concatenate([ps[f"b.{g}"].value for g in "ifou"]), b)
    assert not ps["b.o"].weight_decay and ps["W.o"].weight_decay and ps["W.o"].value.flags.c_contiguous


def test_split_refuses_unequal_blocks_and_taken_names_and_changes_nothing():
    ps = _gates()
    with pytest.raises(ValueError, match="parameter 'W': its last axis \\(8\\) does not split into 3"):
        ps.split("W", "abc")
    ps.new("V.x", (2, 2))
    with pytest.raises(ValueError, match="split names V.x are taken"):
        ps.split("V", "xy")
    assert list(ps) == ["W", "b", "V", "V.x"]


@pytest.mark.parametrize("names", [["W.i", "W.f", "W.o", "W.u"], ["W.u", "W.i"], ["b.f", "b.i", "b.u"]])
def test_plan_buffer_makes_views_of_one_buffer_with_the_same_values(names):
    ps = _gates()
    ps.split("W", "ifou")
    ps.split("b", "ifou")
    before = {n: ps[n].value.copy() for n in names}
    buffer = ps.plan_buffer(names)
    assert buffer.flags.c_contiguous and buffer.shape[-1] == sum(before[n].shape[-1] for n in names)
    np.testing.assert_array_equal(buffer, np.concatenate([before[n] for n in names], axis=-1))
    for n in names:
        assert ps[n].value.base is buffer
        np.testing.assert_array_equal(ps[n].value, before[n])
    assert ps.plan_buffer(names) is buffer        # laid out already: the same buffer, no copy
    ps[names[0]].value[...] = 7.0                  # a write in place (an optimizer step) writes the buffer
    assert (buffer[..., :before[names[0]].shape[-1]] == 7.0).all()


def test_plan_buffer_refuses_parameters_of_other_rows_or_dtypes():
    ps = _gates()
    ps.new("U", (3, 2), dtype="float32")
    with pytest.raises(ValueError, match="plan_buffer: parameters V, U are not host arrays of shape \\(3, 'n'\\)"):
        ps.plan_buffer(["W", "V", "U"])
    assert ps["W"].value.base is None             # nothing laid out
