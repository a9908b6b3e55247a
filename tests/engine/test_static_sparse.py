"""A lookup by a matrix of ids (seq2seq's source and decoder tokens) inside the static program, and row-sparse
gradients paired on the host from the program's rows and the fed ids (minicavs/engine/static_sparse.py): equal to
the step runner (the path before) on every runner in float64, the embedding's gradient against finite
differences, bad id matrices refused naming the feed with nothing changed, and the optimizers' sparse steps
unchanged."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from minicavs.core.errors import FeedError
from minicavs.core.sparse import RowSparse
from minicavs.cuda import Cuda
from minicavs.engine.lowered import OPCODES_BY_ID
from minicavs.train.optim import SGD, Adam

from .test_static_program import _dense, _equal, _model, _programs, _run, _steps_only

SEQ2SEQ = "seq2seq"


def _opcodes(result) -> list:
    return [OPCODES_BY_ID[op] for p in _programs(result) for op in p.lowered.code[:, 0].tolist()]


def _host(result) -> dict:
    """{op: what the host did} over the static graphs of ``result``; asserts none left a node to the step runner."""
    assert not [(run.title, n.op, why) for run in result.static for n, why in (run.left or {}).items()]
    return {n.op: why for run in result.static for n, why in (run.host or {}).items()}


def test_seq2seqs_lookups_by_id_matrices_run_in_the_program_on_every_runner(cuda_standin, tmp_path):
    t, graphs, feeds = _model(SEQ2SEQ, tmp_path)
    want = _steps_only(t, graphs, feeds)
    steps = feeds["src"].shape[1] + feeds["dec_in"].shape[1]
    for runner, device in [("reference", None), ("device", None), ("device", Cuda(cuda_standin))]:
        got = _run(t, graphs, feeds, runner, device, check=True)   # (every id checked by each runner too)
        _equal(got, want, runner)
        assert _opcodes(got).count("TAKETO") == steps, runner   # (one per step of each id matrix)
        assert set(_host(got)) == {"lookup_grad", "accum"}
        assert isinstance(got.grads["E"], RowSparse)
        assert np.array_equal(np.sort(got.grads["E"].indices), np.sort(want.grads["E"].indices))


def _loss(t, graphs, feeds, params) -> float:
    return float(_run_params(t, graphs, feeds, params).loss)


def _run_params(t, graphs, feeds, params):
    return t.model.forward_backward(graphs, feeds, params, t.context(training=False))


def test_seq2seqs_embedding_gradient_matches_finite_differences_with_repeated_ids(tmp_path):
    """Ids repeated within a row, across rows and across the source and the decoder's input, id 0 and the last
    id: every entry of E's gradient (paired on the host from the program's stacked rows) against central
    differences."""
    t, graphs, feeds = _model(SEQ2SEQ, tmp_path)
    params = {k: p.value.copy() for k, p in t.params.items()}
    last = params["E"].shape[0] - 1
    src, dec_in = feeds["src"].copy(), feeds["dec_in"].copy()
    src[0, :3], src[1, :2], src[2, -1] = last, 0, 3
    dec_in[1:, 1], dec_in[0, 2] = 3, last
    feeds = dict(feeds, src=src, dec_in=dec_in)
    got = _run_params(t, graphs, feeds, params)
    assert set(_host(got)) == {"lookup_grad", "accum"}
    g = _dense(got.grads["E"])
    eps, fd = 1e-5, np.zeros_like(g)
    for at in np.ndindex(*g.shape):
        for sign in (1, -1):
            moved = dict(params, E=params["E"].copy())
            moved["E"][at] += sign * eps
            fd[at] += sign * _loss(t, graphs, feeds, moved) / (2 * eps)
    assert np.all(np.abs(fd - g) <= 1e-6 * np.maximum(np.abs(fd), np.abs(g)) + 1e-8), np.abs(fd - g).max()
    assert np.abs(g[[0, last]]).max() > 0 and np.abs(g[3]).max() > 0


@pytest.mark.parametrize("feed", ["src", "dec_in"])
@pytest.mark.parametrize("how", ["past the table", "negative", "floats", "a column more", "a row less"])
def test_a_bad_id_matrix_is_a_feed_error_naming_the_feed_and_changes_nothing(cuda_standin, feed, how, tmp_path):
    t, graphs, feeds = _model(SEQ2SEQ, tmp_path)
    want = _run(t, graphs, feeds, "device")
    ids = feeds[feed]
    bad = {"past the table": np.where(np.arange(ids.size).reshape(ids.shape) == 1, 12, ids),
           "negative": np.where(np.arange(ids.size).reshape(ids.shape) == 1, -1, ids),
           "floats": ids.astype(np.float64) + 0.5,
           "a column more": np.concatenate([ids, ids[:, :1]], axis=1),
           "a row less": ids[:-1]}[how]
    before = {k: p.value.copy() for k, p in t.params.items()}
    for runner, device in [("reference", None), ("device", None), ("device", Cuda(cuda_standin))]:
        with pytest.raises(FeedError, match=rf"'{feed}'"):
            _run(t, graphs, dict(feeds, **{feed: bad}), runner, device, check=runner == "reference")
    assert all(np.array_equal(p.value, before[k]) for k, p in t.params.items())
    _equal(_run(t, graphs, feeds, "device"), want, "after the refused runs")


def _stepped(t, grads, make) -> dict:
    params = copy.deepcopy(t.params)
    make(params).step(grads)
    return {k: p.value for k, p in params.items()}


@pytest.mark.parametrize("name", [SEQ2SEQ, "tree_lstm"])
def test_one_sparse_optimizer_step_equals_the_step_runners(name, tmp_path):
    t, graphs, feeds = _model(name, tmp_path)
    want = _steps_only(t, graphs, feeds)
    got = _run(t, graphs, feeds, "device")
    assert isinstance(got.grads["E"], RowSparse) and {"lookup_grad"} <= set(_host(got))
    for make in (lambda p: SGD(p, lr=0.5, momentum=0.9, sparse_updates=True), lambda p: Adam(p, lr=0.1),
                 lambda p: Adam(p, lr=0.1, sparse_updates=True)):
        a, b = _stepped(t, got.grads, make), _stepped(t, want.grads, make)
        for k in b:
            assert np.abs(a[k] - b[k]).max(initial=0) <= 1e-12 * max(1.0, np.abs(b[k]).max(initial=0)), (name, k)
