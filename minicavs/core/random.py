"""Counter-based random numbers: a pure integer hash of (seed, step, site, row key, column).

Dropout masks come from here, never from a stateful generator, so a mask does not depend on how rows are
batched: a batched run and a per-sample run draw the same mask for the same (sample, vertex) row key.

The hash (documented so other implementations can reproduce it), all arithmetic modulo 2**64::

    mix(z)   = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31
    h        = 0x9E3779B97F4A7C15
    for w in (seed, step, site, row_key, column):  h = mix(h ^ w) + 0x9E3779B97F4A7C15     (mod 2**64)
    uniform  = (h >> 40) / 2**24                          # 24 bits: exact in float32, in [0, 1)

``mix`` is SplitMix64's finaliser (Steele, Lea, Flood 2014).
"""
from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _u64(x) -> np.ndarray:
    if type(x) is np.ndarray and x.ndim:   # the per-batch case (row keys of a batch's vertices): one call
        return x.astype(np.uint64)
    return np.atleast_1d(np.asarray(x).astype(np.uint64))


def mix(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


def hash_words(*words) -> np.ndarray:
    """Hash broadcastable arrays of non-negative integers word by word (see the module docstring)."""
    h = np.full((1,), GOLDEN, dtype=np.uint64)
    for w in words:
        h = mix(h ^ _u64(w)) + GOLDEN
    return h


def uniform(*words) -> np.ndarray:
    """Uniform float64 numbers in [0, 1) with 24 random bits, one per broadcast element of ``words``."""
    return (hash_words(*words) >> np.uint64(40)).astype(np.float64) * (1.0 / (1 << 24))


def row_key(sample: np.ndarray, vertex: np.ndarray) -> np.ndarray:
    """The row key of vertex ``vertex`` of sample ``sample``: the same whatever batch the sample is in."""
    return (_u64(sample) << np.uint64(32)) | _u64(vertex)
