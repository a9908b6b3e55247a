"""Initializers: bounds and moments, orthogonality, determinism, spec parsing."""
import math

import numpy as np
import pytest

from minicavs.nn import init


def test_uniform_bounds_and_moments():
    a = init.uniform(0.3)((400, 500), np.random.default_rng(0))
    assert a.shape == (400, 500) and a.dtype == np.float64
    assert np.abs(a).max() <= 0.3 and np.abs(a).max() > 0.299
    assert abs(a.mean()) < 0.003
    assert a.var() == pytest.approx(0.3 ** 2 / 3, rel=0.01)


def test_normal_moments_and_spec():
    a = init.get_initializer("normal(0.5)")((400, 500), np.random.default_rng(0))
    assert a.shape == (400, 500) and a.dtype == np.float64
    assert abs(a.mean()) < 0.005
    assert a.std() == pytest.approx(0.5, rel=0.01)
    assert np.mean(np.abs(a) < 0.5) == pytest.approx(0.6827, abs=0.005)  # Gaussian, not uniform


@pytest.mark.parametrize("shape, fan_in, fan_out",
                         [((200, 300), 200, 300), ((7,), 7, 7), ((4, 5, 60), 20, 60), ((), 1, 1)])
def test_fans(shape, fan_in, fan_out):
    assert init.fans(shape) == (fan_in, fan_out)


@pytest.mark.parametrize("name", ["glorot_uniform", "xavier_uniform", "glorot", "xavier"])
def test_glorot_bounds(name):
    limit = math.sqrt(6.0 / (200 + 300))
    a = init.get_initializer(name)((200, 300), np.random.default_rng(1))
    assert np.abs(a).max() <= limit
    assert np.abs(a).max() > 0.99 * limit  # the bound is reached, not some smaller one
    assert a.var() == pytest.approx(limit ** 2 / 3, rel=0.02)


def test_glorot_gain_and_higher_rank():
    a = init.glorot_uniform(gain=2.0)((4, 5, 60), np.random.default_rng(2))
    limit = 2.0 * math.sqrt(6.0 / (20 + 60))
    assert a.shape == (4, 5, 60)
    assert limit * 0.98 < np.abs(a).max() <= limit


@pytest.mark.parametrize("shape", [(50, 20), (20, 50), (16, 16), (3, 4, 10)])
def test_orthogonal(shape):
    q = init.orthogonal()(shape, np.random.default_rng(3))
    assert q.shape == shape
    m = q.reshape(-1, shape[-1])
    small = m.T @ m if m.shape[0] >= m.shape[1] else m @ m.T
    np.testing.assert_allclose(small, np.eye(small.shape[0]), atol=1e-12)


def test_orthogonal_gain_and_sign_correction():
    q = init.orthogonal(gain=0.5)((8, 8), np.random.default_rng(4))
    np.testing.assert_allclose(q.T @ q, 0.25 * np.eye(8), atol=1e-12)
    # Haar-distributed: over many 1x1 draws the sign is +1 or -1 about equally often.
    signs = [init.orthogonal()((1, 1), np.random.default_rng(s)).item() for s in range(200)]
    assert set(np.round(signs, 12)) == {-1.0, 1.0}
    assert 60 < sum(s > 0 for s in signs) < 140


def test_orthogonal_needs_a_matrix():
    with pytest.raises(ValueError, match="at least 2 axes"):
        init.orthogonal()((5,), np.random.default_rng(0))


def test_zeros_and_constant():
    assert not init.zeros()((3, 2), None).any()
    np.testing.assert_array_equal(init.constant(1.5)((2, 2), None), np.full((2, 2), 1.5))


@pytest.mark.parametrize("spec", ["uniform", "glorot_uniform", "orthogonal"])
def test_seeded_reproducibility(spec):
    f = init.get_initializer(spec)
    a = f((6, 4), np.random.default_rng(7))
    np.testing.assert_array_equal(a, f((6, 4), np.random.default_rng(7)))
    np.testing.assert_array_equal(a, f((6, 4), 7))  # an int seed means the same as default_rng(seed)
    assert not np.array_equal(a, f((6, 4), np.random.default_rng(8)))
    gen = np.random.default_rng(7)
    first, second = f((6, 4), gen), f((6, 4), gen)  # a Generator is a stream: draws differ
    np.testing.assert_array_equal(first, a)
    assert not np.array_equal(first, second)


def test_get_initializer_with_arguments():
    a = init.get_initializer("uniform(0.01)")((100, 100), np.random.default_rng(0))
    assert 0.0099 < np.abs(a).max() <= 0.01
    np.testing.assert_array_equal(init.get_initializer(" constant( 2.5 ) ")((2,), None), [2.5, 2.5])
    q = init.get_initializer("orthogonal(3)")((4, 4), np.random.default_rng(0))
    np.testing.assert_allclose(q.T @ q, 9 * np.eye(4), atol=1e-12)


def test_get_initializer_passes_callables_through():
    def mine(shape, rng):
        return np.ones(shape)
    assert init.get_initializer(mine) is mine


@pytest.mark.parametrize("spec, match", [("gaussian", "unknown initializer"), ("uniform(a)", "numbers"),
                                         ("constant", "number of arguments"),
                                         ("zeros(1, 2)", "number of arguments")])
def test_get_initializer_rejects_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        init.get_initializer(spec)


def test_get_initializer_rejects_other_types():
    with pytest.raises(TypeError):
        init.get_initializer(3)
