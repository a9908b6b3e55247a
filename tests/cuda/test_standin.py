"""The device stand-in (minicavs/cuda/standin.py) against what CuPy 14 does: it refuses every implicit
host/device crossing CuPy refuses, with CuPy's messages, accepts and counts the copies CuPy makes implicitly,
and computes what numpy computes. The three faults the first real-GPU run found are reproduced on it."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from minicavs.core import arrays
from minicavs.cuda import standin as sd

IMPLICIT = "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array explicitly."
INCORRECT = "has incorrect type (expected cupy._core.core._ndarray_base, got numpy.ndarray)"
UNSUPPORTED = "Unsupported type <class 'numpy.ndarray'>"


@pytest.fixture(autouse=True)
def _fresh_counts():
    sd.reset()
    yield
    sd.reset()


def dev(a):
    """A device array of ``a``'s values, its copy not counted (the tests count what follows)."""
    out = sd.asarray(np.asarray(a))
    sd.reset()
    return out


def test_its_arrays_are_their_own_type_with_cupys_interfaces():
    a = dev(np.arange(6.0).reshape(2, 3))
    assert not isinstance(a, np.ndarray)
    assert not hasattr(a, "__array_namespace__")          # as CuPy 14: no duck-typed array API
    cai = a.__cuda_array_interface__
    assert cai["shape"] == (2, 3) and cai["typestr"] == "<f8" and cai["version"] == 3
    assert arrays.array_module(a) is sd and arrays.on_device(a)
    assert arrays.array_module(np.zeros(2)) is np and arrays.array_module([1, 2]) is np


@pytest.mark.parametrize("convert", [np.asarray, np.array, np.ascontiguousarray,
                                     lambda a: np.float64(1.0) * np.ones(3) + np.asarray(a)])
def test_numpy_conversion_is_refused_with_cupys_message(convert):
    with pytest.raises(TypeError) as e:
        convert(dev([1.0, 2.0, 3.0]))
    assert str(e.value) == IMPLICIT
    assert not sd.crossings


@pytest.mark.parametrize("call", [
    lambda h: sd.ascontiguousarray(h), lambda h: sd.broadcast_to(h, (2, 3)), lambda h: sd.zeros_like(h),
    lambda h: sd.take_along_axis(h, h.astype(np.int64), axis=0), lambda h: sd.expand_dims(h, 0)])
def test_functions_typed_to_device_arrays_refuse_host_arrays(call):
    with pytest.raises(TypeError, match="incorrect type") as e:
        call(np.ones(3))
    assert str(e.value).endswith(INCORRECT)


@pytest.mark.parametrize("call", [
    lambda d, h: d + h, lambda d, h: h * d, lambda d, h: sd.maximum(d, h), lambda d, h: sd.tanh(h),
    lambda d, h: d @ h.reshape(3, 1), lambda d, h: sd.concatenate([d, h]), lambda d, h: np.add(h, d),
    lambda d, h: sd.exp(d, out=h)])
def test_ufuncs_with_a_host_operand_raise_unsupported_type(call):
    with pytest.raises(TypeError) as e:
        call(dev([1.0, 2.0, 3.0]), np.ones(3))
    assert str(e.value) == UNSUPPORTED


def test_a_host_array_as_a_kernel_argument_is_refused(emulation_dir):
    from minicavs.engine.codegen import cuda as gen
    from minicavs.cuda.emulation import Launcher
    launcher = Launcher(emulation_dir)
    _, source = gen.row_kernels(np.dtype(np.float64))
    src, out = np.ones((2, 3)), sd.zeros((2, 3))
    with pytest.raises(TypeError, match="You are trying to pass a numpy.ndarray of shape \\(2, 3\\)"):
        launcher(source, "gather_rows_double", 1, 32,
                 [np.int64(2), np.int64(3), src, np.int64(3), sd.asarray(np.arange(2)), out, np.int64(3)])


def test_what_cupy_copies_implicitly_is_accepted_and_counted():
    a = sd.asarray(np.arange(12.0).reshape(4, 3))          # host to device
    assert sd.crossings == {"h2d": 1}
    rows = a[np.array([2, 0])]                               # a host index array: copied over
    assert type(rows) is sd.ndarray and sd.crossings["h2d"] == 2
    a[np.array([1])] = np.array([[7.0, 8.0, 9.0]])           # host index and host values: two copies
    assert sd.crossings["h2d"] == 4
    taken = sd.take(a, np.array([3, 1]), axis=0)
    assert sd.crossings["h2d"] == 5 and type(taken) is sd.ndarray
    a[1:2] = sd.zeros((1, 3))                                # device to device: no crossing
    assert sd.crossings == {"h2d": 5}
    np.testing.assert_array_equal(rows.get(), [[6.0, 7.0, 8.0], [0.0, 1.0, 2.0]])
    assert sd.crossings["d2h"] == 1


def test_the_ways_back_are_counted_device_to_host_reads():
    a = dev([[1.5, 2.0], [3.0, 4.0]])
    sd.reset()
    s = a.sum()
    assert type(s) is sd.ndarray and s.ndim == 0 and not sd.crossings   # reductions stay on the device
    assert float(s) == 10.5 and int(a.max()) == 4 and bool(a[0, 0] > 1)
    assert a[1, 1].item() == 4.0 and sd.asnumpy(a).shape == (2, 2) and a.tolist()[0] == [1.5, 2.0]
    assert sd.crossings == {"d2h": 6}
    with pytest.raises(ValueError, match="ambiguous"):
        bool(a > 0)


def test_numpy_functions_on_device_arrays_dispatch_to_the_stand_in_or_fail():
    a = dev([0.5, -1.0])
    for got in (np.tanh(a), np.sum(a), np.concatenate([a, a]), np.isfinite(a), np.maximum(a, 0.0)):
        assert type(got) is sd.ndarray
    with pytest.raises(TypeError):   # no stand-in function: numpy refuses, as with CuPy's arrays
        np.linalg.norm(a)
    assert not sd.crossings


def test_out_of_range_integer_indices_wrap_as_in_cupy():
    a = dev([10.0, 20.0, 30.0])
    idx = sd.asarray(np.array([3, -1, 4]))
    np.testing.assert_array_equal(a[idx].get(), [10.0, 30.0, 20.0])
    np.testing.assert_array_equal(sd.take(a, idx).get(), [10.0, 30.0, 20.0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=12), st.integers(0, 4))
def test_arithmetic_reductions_and_views_compute_what_numpy_computes(values, k):
    h = np.asarray(values)
    a = sd.asarray(h)
    want = [np.tanh(h) * 2.0 + h ** 2, np.exp(-np.abs(h)), h[k % len(h):], np.maximum(h, 0.5), h.reshape(-1, 1).T]
    got = [sd.tanh(a) * 2.0 + a ** 2, sd.exp(-abs(a)), a[k % len(a):], sd.maximum(a, 0.5), a.reshape(-1, 1).T]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.get(), w, rtol=1e-15)
    assert a[1:].base is a and a.reshape(-1, 1).base is a
    assert float(sd.sum(a)) == pytest.approx(h.sum()) and float(a.mean()) == pytest.approx(h.mean())
    b = a.copy()
    b += 1.0
    np.testing.assert_allclose(b.get(), h + 1.0)
    np.testing.assert_allclose(a.get(), h)


def test_streams_and_events_exist():
    s = sd.cuda.Stream(non_blocking=True)
    with s:
        assert sd.cuda.get_current_stream() is s
        e = s.record()
    sd.cuda.get_current_stream().wait_event(e)
    sd.cuda.Device().synchronize()
    assert sd.cuda.runtime.getDeviceCount() == 1


# --- the faults of the first GPU run, reproduced on the stand-in ---------------------------------------

def test_fault_a_a_parameter_read_through_numpy_fails_as_on_the_gpu():
    """(a) ``program.check_value`` took a device parameter for a host value (it looked for
    ``__array_namespace__``, which CuPy 14's arrays lack) and called ``np.asarray`` on it."""
    value = dev(np.ones((2, 2), np.float32))
    recognised_then = hasattr(value, "__array_namespace__") or isinstance(value, np.ndarray)
    assert not recognised_then
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(value)   # what the old fallback did with it


def test_fault_b_host_indices_handed_to_a_typed_function_fail_as_on_the_gpu():
    """(b) ``cuda/kernels.py`` passed host index and key arrays to ``xp.ascontiguousarray``, typed to take
    only device arrays."""
    with pytest.raises(TypeError, match="Argument 'a' has incorrect type"):
        sd.ascontiguousarray(np.arange(4), dtype=np.int64)


def test_fault_c_device_parameters_taken_for_host_arrays_by_duck_typing():
    """(c) ``backend.array_module`` and ``validate._module`` read ``__array_namespace__``: a device array was
    reported as numpy's. The module is now asked of the array's registered type."""
    value = dev(np.ones(3))

    def old_array_module(a):
        return np if isinstance(a, np.ndarray) or not hasattr(a, "__array_namespace__") else a.__array_namespace__()
    assert old_array_module(value) is np
    assert arrays.array_module(value) is sd


def test_a_host_array_assigned_into_a_device_slice_is_refused_as_a_fill():
    """CuPy 14's basic-index assignment of a non-device value is a fill (cupy/_core/_routines_indexing.pyx
    _scatter_op, core.pyx fill): a scalar fills, a host array raises; under an advanced index it is copied."""
    a = dev(np.zeros((3, 2)))
    for host in (np.ones((1, 2)), [[1.0, 2.0]], np.ones(2)):
        with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
            a[1:2] = host
    a[0] = 5.0
    a[1, :] = np.float64(6.0)
    a[np.array([2])] = np.array([[7.0, 8.0]])                # (advanced: copied over, counted)
    assert sd.crossings == {"h2d": 2}
    np.testing.assert_array_equal(a.get(), [[5.0, 5.0], [6.0, 6.0], [7.0, 8.0]])


def test_boolean_masks_and_repr_read_the_device():
    """A boolean mask's result size and CuPy's ``repr`` (``repr(self.get())``) are device reads."""
    a = dev(np.arange(4.0))
    picked = a[dev(np.array([True, False, True, False]))]
    assert sd.crossings == {"d2h": 1} and type(picked) is sd.ndarray
    repr(a)
    assert sd.crossings == {"d2h": 2}


def test_device_arrays_are_no_python_index():
    """CuPy's arrays have no ``__index__``: a device integer is not a length, a range bound or a list index."""
    n = dev(np.int64(2))
    for use in (lambda: range(n), lambda: [1, 2, 3][n], lambda: "ab" * n):
        with pytest.raises(TypeError):
            use()
    assert not sd.crossings


def test_a_kernels_scalar_parameters_get_their_c_types(emulation_dir):
    """CuPy passes a Python float as a double and a Python int as an int64 (cupy/_core/_scalar.pyx): a kernel
    parameter of another type would read other bytes on a GPU. The stand-in's launch refuses it, naming both."""
    from minicavs.cuda.emulation import Launcher
    launcher = Launcher(emulation_dir)
    source = ('extern "C" __global__ void scale_ones(long n, float a, float *y) {\n'
              "    for (long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = a;\n"
              "}\n")
    y = sd.zeros(3, np.float32)
    for n, a in ((3, 2.0), (np.int32(3), np.float32(2.0)), (3, np.float64(2.0))):
        with pytest.raises(TypeError, match="kernel scale_ones: parameter '(long n|float a)' takes a (int64|float32)"):
            launcher(source, "scale_ones", 1, 32, [n, a, y])
    launcher(source, "scale_ones", 1, 32, [3, np.float32(2.0), y])
    np.testing.assert_array_equal(y.get(), [2.0, 2.0, 2.0])
