"""An array taken from a trainer's parameter (``trainer.params[name].value``) is that parameter's storage for
good: after a forward run (where the layout used to be planned), a fit, a checkpoint load and a resume, on
the fused and the naive cell, with the layout on and off, it is still the value, it holds what training and
loading wrote, and a write to it is what the next forward computes with."""
from __future__ import annotations

import numpy as np
import pytest

from minicavs.train.trainer import Trainer
from tests.models.test_models import MODELS, TINY

SMALL = ["data.synthetic.train=8", "data.dev=null", "data.test=null", "train.batch_size=4", "train.epochs=1"]
CASES = [(model, cell, layout) for model in ("tree_lstm", "tree_lstm_2type", "var_lstm", "lattice_lstm")
         for cell in ("naive", "fused") for layout in (True, False)]


def _trainer(model: str, cell: str, layout: bool, run_dir) -> Trainer:
    return Trainer(MODELS / f"{model}.yaml", TINY[model] + SMALL + [
        f"model.cell={cell}", f"train.engine.plan_layout={str(layout).lower()}"], run_dir=run_dir)


def _taken(t: Trainer) -> dict:
    """Every parameter's array, as a user takes it."""
    return {name: p.value for name, p in t.params.items()}


def _loss(t: Trainer) -> float:
    return float(t.loss_and_grads(t.task.data["train"][:4], training=False).loss)


def _assert_live(t: Trainer, taken: dict, event: str) -> None:
    """Each taken array is still its parameter's value, and a write through it is the write through the
    value: the next forward's loss is the one computed after writing the same numbers into the value."""
    stale = [n for n, a in taken.items() if a is not t.params[n].value]
    assert not stale, f"after {event}: arrays taken before are no longer the values of {stale}"
    rng = np.random.default_rng(0)
    for name, array in taken.items():
        before = array.copy()
        moved = before + rng.normal(0.0, 0.5, before.shape).astype(before.dtype)
        t.params[name].value[...] = moved
        want = _loss(t)
        t.params[name].value[...] = before
        unchanged = _loss(t)
        array[...] = moved
        got = _loss(t)
        array[...] = before
        assert want != unchanged, f"{name}: the perturbation changes nothing (a useless check)"
        assert got == want, f"after {event}: a write to the array taken from '{name}' is not seen by the model"


@pytest.mark.parametrize("model, cell, layout", CASES)
def test_an_array_taken_before_a_forward_and_a_fit_stays_the_trained_value(model, cell, layout, tmp_path):
    t = _trainer(model, cell, layout, tmp_path / "run")
    taken = _taken(t)
    first = {n: a.copy() for n, a in taken.items()}
    _loss(t)
    _assert_live(t, taken, "a forward run")
    t.fit(progress=False, log=lambda _: None)
    _assert_live(t, taken, "fit")
    trained = [n for n, a in taken.items() if t.params[n].trainable and (a != first[n]).any()]
    assert trained == [n for n, p in t.params.items() if p.trainable], "fit trained the arrays taken before it"


@pytest.mark.parametrize("model, cell, layout", CASES)
def test_an_array_taken_before_a_checkpoint_load_and_a_resume_holds_what_they_load(model, cell, layout,
                                                                                    tmp_path):
    _trainer(model, cell, layout, tmp_path / "run").fit(progress=False, log=lambda _: None)
    t = _trainer(model, cell, layout, tmp_path / "fresh")
    taken = _taken(t)
    for a in taken.values():
        a[...] = 0.0
    t.load(tmp_path / "run" / "last.npz")
    saved = {n: a.copy() for n, a in taken.items()}
    assert all(a.any() for a in saved.values()), "the checkpoint's values reached the arrays taken before"
    _assert_live(t, taken, "a checkpoint load")

    resumed = Trainer.resuming(tmp_path / "run", ["train.epochs=2"], log=lambda _: None)
    taken = _taken(resumed)
    resumed.fit(resume=True, progress=False, log=lambda _: None)
    for name, a in taken.items():
        assert a is resumed.params[name].value, f"after a resume: the array taken from '{name}' is stale"
        if resumed.params[name].trainable:
            assert (a != saved[name]).any(), f"after a resume: '{name}' was not trained from the checkpoint"
    _assert_live(resumed, taken, "a resume")
