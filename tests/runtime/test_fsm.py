"""The FSM policy's parts: state encodings, the n-step Q update, the file format."""
from __future__ import annotations

import json

import numpy as np
import pytest

from minicavs.runtime.fsm import Fsm, Hyper, encode, learn, update
from minicavs.runtime.frontier import TypedGraph
from minicavs.runtime.inputs import InputGraph, make_batch

from .test_frontier import fig1_graph


def test_encodings():
    counts = np.array([0, 3, 5, 3])
    assert encode(counts, "S1") == (1, 2, 3)
    assert encode(counts, "S2") == (1, 2, 3, 2)       # plus the most frequent type
    assert encode(counts, "S3") == (2, 1, 3)           # by count, most first; ties by id
    with pytest.raises(ValueError, match="S4"):
        encode(counts, "S4")


def test_n_step_update_by_hand():
    # two steps, rewards -0.5 then -1; alpha 0.4, gamma 1
    log = [(("s0",), 0, -0.5), (("s1",), 0, -1.0)]
    q = {("s0",): [0.0], ("s1",): [0.0]}
    update(q, log, Hyper(n_step=10))
    # step 0: full return -1.5 -> 0.4 * -1.5; step 1: -1 -> 0.4 * -1
    assert q == {("s0",): [pytest.approx(-0.6)], ("s1",): [pytest.approx(-0.4)]}
    q = {("s0",): [0.0], ("s1",): [-2.0]}
    update(q, log, Hyper(n_step=1))
    # step 0 bootstraps from max Q(s1) = -2: g = -0.5 - 2; step 1: g = -1 -> -2 + 0.4 * (-1 + 2)
    assert q == {("s0",): [pytest.approx(0.4 * -2.5)], ("s1",): [pytest.approx(-1.6)]}


def test_learns_the_optimum_of_fig1_and_stops_at_the_bound():
    children, kinds = fig1_graph()
    batch = make_batch([InputGraph(children, kinds)] * 4, kind_names=("I", "O", "R"))
    fsm = learn([TypedGraph.of(batch)], batch.kind_names, "S1", seed=3)
    assert fsm.stats["lower_bound"] == 6 and fsm.stats["batches"] == 6
    assert fsm.stats["episodes"] % 50 == 0 and fsm.stats["episodes"] < 1000
    assert len(fsm.schedule(TypedGraph.of(batch))[1]) == 6


def test_unseen_state_falls_back_to_the_first_type_of_the_state():
    fsm = Fsm("S3", ("a", "b", "c"), {(1, 0): [-1.0, -0.5]})

    class F:
        counts = np.array([4, 2, 0])
    assert fsm.choose(F) == 0                       # (0, 1): unseen, first of the state
    F.counts = np.array([2, 4, 0])
    assert fsm.choose(F) == 0                       # (1, 0): learned, action 0 has the larger Q


def test_file_format_checks(tmp_path):
    fsm = Fsm("S2", ("x", "y"), {(0, 1, 1): [0.5, -1.0]}, {"episodes": 50})
    fsm.save(tmp_path / "f.json")
    again = Fsm.load(tmp_path / "f.json")
    assert again.q == fsm.q and again.best == {(0, 1, 1): 0} and again.stats == {"episodes": 50}
    doc = json.loads((tmp_path / "f.json").read_text())
    doc["q"][0][1] = [0.5]
    with pytest.raises(ValueError, match="1 Q values for actions"):
        Fsm.from_json(doc)
    with pytest.raises(ValueError, match="not a minicavs FSM"):
        Fsm.from_json({"q": []})


def test_learning_never_returns_a_table_worse_than_the_fallback_rule():
    """The empty table (every state takes its fallback) is the first candidate; with a single episode (no
    check before the end) learning must still return a table at least as good on its sample batches."""
    from minicavs.data.lattice import synthetic_lattices
    lattices, _ = synthetic_lattices(40, seed=4)
    batch = make_batch([lat.to_graph() for lat in lattices], kind_names=("char", "char_words", "word"))
    graph = TypedGraph.of(batch)
    fallback = len(Fsm("S3", batch.kind_names, {}).schedule(graph)[1])
    for seed in range(3):
        fsm = learn([graph], batch.kind_names, "S3", Hyper(episodes=1), seed=seed)
        assert fsm.stats["batches"] <= fallback
        assert len(fsm.schedule(graph)[1]) == fsm.stats["batches"]
