"""The order an epoch draws its samples in (``train.order``).

``shuffle``: every sample in a random order, cut into batches. ``bucket``: batches of samples of similar length
(``Task.sample_lengths``), for models whose loops run over padded sequences: a batch runs as many steps as its
longest sample, so batches of one length pad little. Both are drawn from the run's (seed, epoch) alone: a run is
reproducible and ``--resume`` continues it exactly.
"""
from __future__ import annotations

import numpy as np

ORDERS = ("shuffle", "bucket")


def shuffled(n: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Sample ids 0..n-1 in a random order, cut into batches of ``batch_size`` (the last may be smaller)."""
    order = rng.permutation(n)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def bucketed(lengths: np.ndarray, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Sample ids sorted by length, samples of equal length in a random order, cut into batches, and the
    batches in a random order: each batch holds samples of about one length (the tightest grouping there is),
    while which samples of a length share a batch and the order of the batches change every epoch."""
    lengths = np.asarray(lengths)
    ties = rng.permutation(len(lengths))
    by_length = ties[np.argsort(lengths[ties], kind="stable")]
    batches = [by_length[i:i + batch_size] for i in range(0, len(by_length), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]
