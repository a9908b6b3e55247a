"""The IR as data: a graph with control-flow bodies, constants and tuple attributes decodes to one that computes
the same numbers; attribute values that are code, and damaged tables, are clear errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

import minicavs.ops as ops
from minicavs import control as C
from minicavs.engine.executor import run
from minicavs.ir.graph import Graph, Node
from minicavs.ops.serialize import Decoder, Encoder, SerializeError


def _round_trip(outputs: list) -> list:
    """``outputs`` encoded, passed through JSON text, and decoded: the decoded output nodes."""
    enc = Encoder(outputs)
    table = json.loads(json.dumps(enc.table, allow_nan=False))
    dec = Decoder(table, {k: v.copy() for k, v in enc.arrays.items()})
    return [dec.node(enc.ref(o)) for o in outputs]


def _loop_graph():
    x = ops.input((None, 3), "float64", name="x")
    w = ops.constant(np.array([[0.5, -1.0, 2.0]]), "float64")

    def body(vs):
        h, k = vs
        h2 = ops.tanh(h * w + 0.25)
        return [ops.sum(h2, axis=1)], [h2, k + 1.0]

    def more(vs):
        return 3.0 - ops.sum(vs[1])
    (sums,), (h, _), steps = C.while_loop(more, body, [x, ops.constant(np.float64(0.0), "float64")], 5, name="w")
    picked = C.cond(ops.sum(x), lambda a: a * 2.0, lambda a: a - 1.0, [h])
    return x, [sums, picked, steps, ops.split(h, 3)[1]]


def test_a_while_loop_and_a_cond_decode_to_the_same_numbers():
    x, outputs = _loop_graph()
    decoded = _round_trip(outputs)
    feed = np.random.default_rng(0).normal(size=(4, 3))
    want = run(outputs, {"x": feed})
    got = run(decoded, {"x": feed})
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert Graph(decoded).dump() == Graph(outputs).dump()   # same ops, attributes, types and names
    assert not set(Graph(decoded).nodes) & set(Graph(outputs).nodes)


def test_an_attribute_that_is_code_is_refused_naming_the_node():
    x = ops.input((2,), "float32", name="x")
    bad = Node("neg", (x,), {"hook": print}, x.shape, x.dtype, name="hooked")
    with pytest.raises(SerializeError, match=r"neg#\d+ 'hooked' attribute 'hook' is a builtin_function_or_method"
                                             r".*exists only as Python code"):
        Encoder([bad])


@pytest.mark.parametrize("change, match", [
    (lambda t: t[-1].__setitem__(0, "frobnicate"), "op 'frobnicate' is not in this minicavs's registry"),
    (lambda t: t[-1].__setitem__(1, [len(t)]), "outside the table"),
    (lambda t: t[-1].__setitem__(4, "float8"), "unknown dtype 'float8'"),
    (lambda t: t.__setitem__(0, "garbage"), "node 0: not an entry"),
])
def test_a_damaged_table_is_a_clear_error(change, match):
    _, outputs = _loop_graph()
    enc = Encoder(outputs)
    table = json.loads(json.dumps(enc.table))
    change(table)
    with pytest.raises(SerializeError, match=match):
        Decoder(table, enc.arrays)
