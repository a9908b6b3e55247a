"""Parameter initializers: ``init(shape, rng) -> float64 array``, deterministic given the Generator.

Layout convention (minicavs computes ``rows @ W``): the last axis of a weight is its fan-out, the product
of the others its fan-in; a 1-D shape counts as fan-in = fan-out = its length. Initializers return float64;
:class:`~minicavs.nn.Parameter` casts to the parameter's dtype, so one seed gives the same numbers (up to
rounding) in float32 and float64 runs.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Sequence, Union

import numpy as np

Initializer = Callable[[tuple, np.random.Generator], np.ndarray]
InitSpec = Union[str, Initializer]


def as_rng(rng: int | np.random.Generator | None) -> np.random.Generator:
    """A Generator from a seed (None means seed 0: results never depend on global state)."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(0 if rng is None else rng)


def fans(shape: Sequence[int]) -> tuple[int, int]:
    """(fan_in, fan_out) under the ``rows @ W`` layout described in the module docstring."""
    shape = tuple(shape)
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    return math.prod(shape[:-1]), shape[-1]


def uniform(scale: float = 0.05) -> Initializer:
    """U(-scale, scale)."""
    def init(shape, rng):
        return as_rng(rng).uniform(-scale, scale, size=tuple(shape))
    return init


def normal(std: float = 1.0) -> Initializer:
    """N(0, std²) elementwise (``normal(1.0)`` is PyTorch's ``nn.Embedding`` default)."""
    def init(shape, rng):
        return as_rng(rng).normal(0.0, std, size=tuple(shape))
    return init


def glorot_uniform(gain: float = 1.0) -> Initializer:
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio 2010): keeps the activation
    and gradient variances roughly equal across layers."""
    def init(shape, rng):
        fan_in, fan_out = fans(shape)
        limit = gain * math.sqrt(6.0 / max(1, fan_in + fan_out))
        return as_rng(rng).uniform(-limit, limit, size=tuple(shape))
    return init


xavier_uniform = glorot_uniform


def orthogonal(gain: float = 1.0) -> Initializer:
    """gain * a random orthogonal matrix (Saxe et al. 2014), drawn uniformly via QR with sign correction.

    The shape is viewed as (fan_in, fan_out): with fan_in >= fan_out the columns are orthonormal
    (Q^T Q = I), otherwise the rows are (Q Q^T = I). Recurrent weights keep their norm under repetition."""
    def init(shape, rng):
        shape = tuple(shape)
        if len(shape) < 2:
            raise ValueError(f"orthogonal init needs at least 2 axes, got shape {shape}")
        rows, cols = fans(shape)
        a = as_rng(rng).standard_normal((max(rows, cols), min(rows, cols)))
        q, r = np.linalg.qr(a)
        q *= np.where(np.diag(r) < 0, -1.0, 1.0)  # make the draw uniform (Haar), not QR-biased
        if rows < cols:
            q = q.T
        return gain * q.reshape(shape)
    return init


def constant(c: float) -> Initializer:
    """Every element equal to ``c`` (e.g. a forget-gate bias of 1)."""
    def init(shape, rng):
        return np.full(tuple(shape), float(c))
    return init


def zeros() -> Initializer:
    return constant(0.0)


_FACTORIES: dict[str, Callable[..., Initializer]] = {
    "uniform": uniform,
    "normal": normal,
    "glorot_uniform": glorot_uniform,
    "xavier_uniform": glorot_uniform,
    "glorot": glorot_uniform,
    "xavier": glorot_uniform,
    "orthogonal": orthogonal,
    "zeros": zeros,
    "constant": constant,
}

_SPEC = re.compile(r"^\s*([a-z_]+)\s*(?:\((.*)\))?\s*$")


def get_initializer(spec: InitSpec) -> Initializer:
    """An initializer from a callable (returned as is) or a name, optionally with numeric arguments as a
    config file would write them: ``"orthogonal"``, ``"uniform(0.1)"``, ``"constant(1.0)"``."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"initializer must be a name or a callable, got {type(spec).__name__}")
    m = _SPEC.match(spec)
    if not m or m.group(1) not in _FACTORIES:
        raise ValueError(f"unknown initializer {spec!r}; known: {', '.join(sorted(_FACTORIES))}")
    args = []
    if m.group(2) is not None and m.group(2).strip():
        try:
            args = [float(a) for a in m.group(2).split(",")]
        except ValueError:
            raise ValueError(f"initializer {spec!r}: arguments must be numbers") from None
    try:
        return _FACTORIES[m.group(1)](*args)
    except TypeError:
        raise ValueError(f"initializer {spec!r}: wrong number of arguments") from None


__all__ = ["Initializer", "InitSpec", "as_rng", "fans", "uniform", "normal", "glorot_uniform", "xavier_uniform",
           "orthogonal", "constant", "zeros", "get_initializer"]
