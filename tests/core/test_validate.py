"""The index checks' messages: the input, the sizes and the first bad position. (Every op and kernel that takes
indices is fuzzed in test_fuzz_kernels.py, in subprocesses; these run in-process, so none may crash.)"""
import numpy as np
import pytest

from minicavs import ops
from minicavs.core.errors import FeedError
from minicavs.engine.executor import run
from minicavs.core.validate import check_labels, indices


@pytest.mark.parametrize("values, kwargs, match", [
    ([0, 3, 9], dict(size=9), r"^x 9 out of range \[0, 9\) at position 2$"),
    (np.array([[0, -4]]), dict(size=9), r"^x -4 out of range \[0, 9\) at position \(0, 1\)$"),
    (np.array([0, 2 ** 63], np.uint64), {}, r"^x 9223372036854775808 out of range \[0, 2\*\*63\) at position 1$"),
    (np.array([1.0, 2.5]), {}, r"^x dtype float64 is not an integer type \(first non-integer 2.5 at position 1\)$"),
    (np.array([True]), {}, r"^x dtype bool is not an integer type$"),
    ([1, True], {}, r"^x True at position 1 is not an int64 integer$"),
    ([1, 2 ** 63], {}, r"^x 9223372036854775808 at position 1 is not an int64 integer$"),
    ([1, 2], dict(shape=(3,), of=" (3 rows)"), r"^x array of shape \(2,\), need \(3,\) \(3 rows\)$"),
    (np.array([-1], np.int64), dict(dtype=np.uint64), r"^x -1 out of range \[0, 2\*\*64\) at position 0$"),
])
def test_messages(values, kwargs, match):
    with pytest.raises(FeedError, match=match):
        indices(values, "x", **kwargs)


def test_good_indices_pass_through_without_a_copy():
    a = np.arange(5)
    assert indices(a, "x", size=5) is a
    assert indices(np.array(3), "x", size=4).shape == ()
    assert indices([], "x", shape=(0,)).dtype == np.int64
    keys = np.array([2 ** 64 - 1], np.uint64)
    assert indices(keys, "k", dtype=np.uint64) is keys


def test_labels_must_match_the_rows_of_the_logits():
    """Too many labels were silently ignored; too few made the C kernels read and write past their buffers."""
    logits = ops.input((None, 4), "float64", name="logits")
    labels = ops.input((None,), "int64", name="labels")
    loss = ops.sum(ops.softmax_cross_entropy(logits, labels))
    x = np.zeros((3, 4))
    with pytest.raises(FeedError, match=r"^softmax_cross_entropy: labels of shape \(5,\) for logits of shape "
                                        r"\(3, 4\): need one label per row, shape \(3,\) \[at softmax_cross_entropy#"
                                        r"\d+ of input#\d+ 'logits', input#\d+ 'labels'\]$"):
        run(loss, {logits: x, labels: np.zeros(5, np.int64)})
    with pytest.raises(FeedError, match=r"label 4 out of range \[0, 4\) at row 1 \(4 classes\)"):
        check_labels(x, np.array([0, 4, 1]))
    with pytest.raises(FeedError, match=r"^feed for input input#\d+ 'labels': got dtype bool, declared int64$"):
        run(loss, {logits: x, labels: np.ones(3, bool)})
    with pytest.raises(FeedError, match=r"'labels': value 9223372036854775808 does not fit its declared dtype int64"):
        run(loss, {logits: x, labels: np.array([0, 2 ** 63, 1], np.uint64)})


def _python_calls(fn) -> list:
    """The Python functions ``fn()`` enters (C functions not counted)."""
    import sys
    entered = []
    sys.setprofile(lambda frame, event, arg: entered.append(frame.f_code.co_name) if event == "call" else None)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered


def test_a_batch_of_ones_index_and_label_checks_cost_one_reduction_and_no_helpers():
    """A plan's or a feed's int64 rows (a lookup's ids, a cross-entropy's labels) are checked at every run, at
    a batch of one too: one reduction over them, no array-module lookup and no numpy wrapper frames (each is
    microseconds there); any other input still takes the full check (test_messages)."""
    ids, labels, logits = np.array([4, 0, 2]), np.array([1, 0, 2]), np.zeros((3, 3), np.float32)
    assert indices(ids, "x", size=5) is ids and check_labels(logits, labels) is labels
    assert _python_calls(lambda: indices(ids, "x", size=5)) == ["<lambda>", "indices", "_int64_below"]
    assert _python_calls(lambda: check_labels(logits, labels)) == ["<lambda>", "check_labels", "_int64_below"]
    for bad in (-1, 5):   # (the one-reduction check's "no" sends the input to the full check, which names it)
        with pytest.raises(FeedError, match=rf"^x {bad} out of range \[0, 5\) at position 1$"):
            indices(np.array([4, bad, 2]), "x", size=5)
        with pytest.raises(FeedError, match=rf"label {bad} out of range \[0, 3\) at row 1 \(3 classes\)$"):
            check_labels(logits, np.array([0, bad, 2]))
