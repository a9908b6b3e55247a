"""The Task base class every bundled model builds on: what evaluating no samples says."""
from __future__ import annotations

import pytest

from minicavs.core.errors import FeedError
from minicavs.train.trainer import Trainer

from ..models.test_models import MODELS, TINY


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
@pytest.mark.parametrize("name", sorted(TINY))
def test_evaluating_no_samples_says_so(name, empty, tmp_path):
    """Every bundled model: evaluate() of no samples is a FeedError naming the model's evaluate and saying there
    is nothing to evaluate (a mean over nothing is no number), not a ZeroDivisionError or a NaN metric."""
    t = Trainer(MODELS / f"{name.replace('_child_sum', '')}.yaml", TINY[name], run_dir=tmp_path / "run")
    with pytest.raises(FeedError, match=rf"^{type(t.task).__name__}\.evaluate: no samples to evaluate"):
        t.task.evaluate(empty, 8)
    assert t.task.evaluate(t.task.data["train"][:2], 8)   # (one sample or more: metrics, as before)
