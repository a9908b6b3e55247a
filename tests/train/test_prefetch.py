"""train.prefetch: the next batch prepared on a background thread gives the same training bit for bit, its
errors name the batch and arrive in order, and no thread outlives the loop."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from minicavs.core.errors import DataError, InputGraphError
from minicavs.train.prefetch import prefetched
from minicavs.train.trainer import Trainer

from .test_trainer import tiny_config


def prefetch_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("minicavs-prefetch")]


def test_the_next_item_is_prepared_while_the_caller_works():
    prepared_next = threading.Event()
    seen = []

    def prepare(i):
        if i == 1:
            prepared_next.set()
        return i * 10

    for value in prefetched(prepare, [0, 1, 2]):
        if value == 0:   # prepare(1) runs on the worker while the caller is still here
            assert prepared_next.wait(10)
        seen.append(value)
    assert seen == [0, 10, 20] and not prefetch_threads()


def test_without_ahead_everything_runs_in_the_callers_thread():
    threads = []
    out = list(prefetched(lambda i: threads.append(threading.current_thread()) or i, [1, 2, 3], ahead=False))
    assert out == [1, 2, 3] and set(threads) == {threading.current_thread()}


def test_an_error_arrives_with_its_item_after_the_ones_before():
    def prepare(i):
        if i == 2:
            raise ValueError("bad item 2")
        return i

    used = []
    with pytest.raises(ValueError, match="bad item 2"):
        for value in prefetched(prepare, [0, 1, 2, 3]):
            used.append(value)
    assert used == [0, 1] and not prefetch_threads()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_error_in_the_callers_loop_leaves_no_thread_and_prepares_no_further(error):
    started = []

    def prepare(i):
        started.append(i)
        return i

    from contextlib import closing
    with pytest.raises(error):
        with closing(prefetched(prepare, list(range(10)))) as stream:
            for value in stream:
                if value == 3:
                    raise error()
    assert not prefetch_threads()
    assert max(started) <= 4   # the one prepared ahead at most, nothing after it


def _trainer(tmp_path, name, prefetch: bool) -> Trainer:
    return Trainer(tiny_config(tmp_path, epochs=2), [f"train.prefetch={str(prefetch).lower()}", "model.dropout=0.3"],
                   run_dir=tmp_path / name)


def test_prefetch_trains_bit_for_bit_like_without(tmp_path):
    """Dropout on (keyed by the step, read by the main thread when the step runs), two epochs; and both as
    the plain loop of loss_and_grads and optimizer steps."""
    a, b, plain = (_trainer(tmp_path, name, prefetch) for name, prefetch in (("a", False), ("b", True), ("c", False)))
    threads = []
    prepare = b.prepare_step
    b.prepare_step = lambda ids: threads.append(threading.current_thread().name) or prepare(ids)
    rows_a, rows_b = (t.fit(progress=False, log=lambda _: None) for t in (a, b))
    assert len(threads) == 2 * len(b.epoch_batches(1))    # each batch prepared once, all on the worker
    assert all(name.startswith("minicavs-prefetch") for name in threads)
    assert [r["train_loss"] for r in rows_a] == [r["train_loss"] for r in rows_b]
    assert [r["dev_loss"] for r in rows_a] == [r["dev_loss"] for r in rows_b]
    for epoch in (1, 2):
        for idx in plain.epoch_batches(epoch):
            res = plain.loss_and_grads([plain.task.data["train"][i] for i in idx], sample_ids=idx)
            plain.optimizer.step(res.grads, loss=res.loss)
    for name, p in a.params.items():
        assert np.array_equal(p.value, b.params[name].value), name
        assert np.array_equal(p.value, plain.params[name].value), name
    assert not prefetch_threads()


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_bad_batch_is_named_and_the_ones_before_it_train(tmp_path, prefetch):
    t = Trainer(tiny_config(tmp_path), [f"train.prefetch={str(prefetch).lower()}"], run_dir=tmp_path / "run")
    batches = t.epoch_batches(1)
    bad = t.task.data["train"][int(batches[2][0])]
    bad.children = [list(ch) for ch in bad.children]
    parent = next(v for v, ch in enumerate(bad.children) if ch)
    bad.children[parent] = bad.children[parent] + [bad.children[parent][0]]   # 3 children: arity is 2
    t.task.samples.clear()
    with pytest.raises(InputGraphError, match=rf"^epoch 1: training batch 3 of {len(batches)}: sample \d+, vertex"):
        t.train_epoch(progress=False)
    assert t.optimizer.steps == 2 and not prefetch_threads()


def test_an_error_of_another_kind_gets_a_note_naming_the_batch(tmp_path):
    t = Trainer(tiny_config(tmp_path), ["train.prefetch=true"], run_dir=tmp_path / "run")
    batch = t.task.batch
    calls = []

    def failing(samples):
        calls.append(len(samples))
        if len(calls) == 2:
            raise DataError("no such word")
        return batch(samples)
    t.task.batch = failing
    with pytest.raises(DataError, match="^epoch 1: training batch 2 of 8: no such word$"):
        t.train_epoch(progress=False)
    t.task.batch = lambda samples: (_ for _ in ()).throw(KeyError("w"))
    with pytest.raises(KeyError) as info:
        t.train_epoch(progress=False)
    if hasattr(info.value, "add_note"):
        assert "training batch 1 of 8" in "".join(info.value.__notes__)
    assert not prefetch_threads()
