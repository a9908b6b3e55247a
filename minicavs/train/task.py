"""What a bundled model module provides to the trainer: parameters, the model, batches and metrics."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..core.errors import FeedError
from ..engine.model import Model
from ..nn import ParameterSet

if TYPE_CHECKING:
    import numpy as np


class Task:
    """Base class of the models in ``models/``. Subclasses set the attributes and write the methods."""

    params: ParameterSet
    model: Model
    data: dict            # split name -> list of samples
    unit: str = "samples"  # what throughput counts ("trees", "words")
    key_metric: str = "loss"
    key_mode: str = "min"  # "max" if a larger key metric is better
    metrics: tuple = ("loss",)  # the keys evaluate() returns (early stopping's metric is checked against them);
                                # keys ending in "acc" are shown as percentages

    @property
    def vocabulary(self) -> list | None:
        """The words in id order, if the model has a vocabulary: checkpoints record it, and loading one
        refuses data that gives another (ids would silently mean other words)."""
        return None

    def unknown_words(self, split: str) -> tuple[int, int] | None:
        """(words of data split ``split`` that are not in the vocabulary, all its words), so ``minicavs eval``
        can warn when a test set is mostly unknown words (they all read as one <unk>); None for a model
        without a vocabulary."""
        return None

    def batch(self, samples: Sequence[Any]) -> tuple[Any, dict]:
        """(graphs, feeds) for ``Model.run`` over these samples."""
        raise NotImplementedError

    def prepare(self, samples: Sequence[Any]) -> None:
        """Build and keep what :meth:`batch` needs per sample (graphs, word ids), for many samples at once.
        The trainer calls it on every split when it starts, so data preparation is paid at load time, in
        bulk, rather than inside the first epoch's steps; ``batch`` still prepares a sample it has not seen."""

    def units(self, samples: Sequence[Any]) -> int:
        return len(samples)

    def sample_lengths(self, samples: Sequence[Any]) -> "np.ndarray | None":
        """Each sample's length (the steps its sequence takes), which ``train.order: bucket`` groups batches
        by; None: the model's samples have no length to group by (bucketing is refused)."""
        return None

    def evaluate(self, samples: Sequence[Any], batch_size: int) -> dict:
        """Metrics over ``samples`` in inference mode (no dropout). No samples is an error (FeedError): a
        mean over nothing is no number, and an empty split is more likely a mistake than a result."""
        if len(samples) == 0:
            raise FeedError(f"{type(self).__name__}.evaluate: no samples to evaluate (an empty split or list)")
        return self.eval_metrics(self.eval_sums(samples, batch_size), samples)

    def eval_sums(self, samples: Sequence[Any], batch_size: int) -> dict:
        """Additive statistics of ``samples`` (name -> float: summed losses, counts of correct answers, ...):
        sums over parts of a split add up to the split's, so evaluation can be sharded over ranks."""
        raise NotImplementedError

    def eval_metrics(self, sums: dict, samples: Sequence[Any]) -> dict:
        """Metrics from the statistics summed over all of ``samples`` (which baselines may read)."""
        raise NotImplementedError

    # --- minicavs predict --------------------------------------------------------------------------------

    #: one line saying what ``predict`` writes per input line (shown by ``minicavs predict --help`` and the
    #: README); empty: the model does not predict from text.
    predicts: str = ""

    def parse_input(self, line: str, where: str) -> Any:
        """One sample from one line of ``minicavs predict`` input; a DataError naming ``where`` if bad."""
        raise NotImplementedError(f"model {type(self).__name__} does not predict from text input")

    def inference_model(self, outputs: dict) -> Model:
        """The model's structures and parameters with other outputs and no loss (what ``predict`` runs: no
        labels or targets needed), on the model's current policy, engine switches and device."""
        m = self.model
        return Model(m.structures, outputs=outputs, policy=m.policy, options=m.options, device=m.device)

    def predict(self, samples: Sequence[Any], batch_size: int) -> list[dict]:
        """Per sample a dict with ``text`` (its output line) and the numbers behind it (JSON output)."""
        raise NotImplementedError(f"model {type(self).__name__} does not predict from text input")

    def export_spec(self) -> dict:
        """What ``minicavs export`` writes beside the graphs, as data: ``{"outputs": {name: node}, "behaviour":
        {...}}`` naming entries of :mod:`minicavs.train.behaviour` (see :mod:`minicavs.train.artifact`). The
        default refuses: this model's reading, feeding and rendering exist only as its Python code."""
        from .artifact import ArtifactError
        if not self.predicts:
            raise ArtifactError(f"cannot export model {type(self).__name__}: it does not predict from text input "
                                "(no Task.predicts): an exported model is one that minicavs predict and serve run")
        raise ArtifactError(f"cannot export model {type(self).__name__}: its input parsing and output rendering "
                            "exist only as Python code (Task.parse_input, Task.predict); it declares no "
                            "Task.export_spec")
