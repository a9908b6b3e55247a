"""A stand-in for CuPy that refuses what CuPy refuses: how the CUDA path is tested without a GPU.

Its arrays are host memory in a type of their own (not a numpy.ndarray, not a subclass), so every accidental
host/device crossing that CuPy 14 refuses fails here too, with CuPy's message, and every crossing CuPy makes
implicitly is made and counted (:data:`crossings`). The generated kernels run through the C++ emulation of
their CUDA source (:mod:`.emulation`), on the arrays' host buffers.

The CuPy behaviours it copies (from CuPy 14's ``_core``), and only those minicavs calls on:

- ``numpy.asarray(a)`` / ``numpy.array(a)`` of a device array raise ``TypeError: Implicit conversion to a
  NumPy array is not allowed. Please use `.get()` to construct a NumPy array explicitly.``;
  ``a.get()``, ``asnumpy(a)``, ``float(a)``, ``int(a)``, ``bool(a)``, ``a.item()``, ``a.tolist()`` are the ways
  back (device-to-host, counted as ``d2h``);
- ``asarray(host)`` / ``array(host)`` copy to the device (``h2d``); so do a host index array in ``take`` or in
  ``a[idx]`` and a host value or index assigned with ``a[idx] = v`` (CuPy converts those implicitly);
- a ufunc (arithmetic, math, comparisons, ``matmul``) with a numpy.ndarray operand raises ``TypeError:
  Unsupported type <class 'numpy.ndarray'>``; Python and numpy scalars are fine;
- a function typed to CuPy's own arrays (``ascontiguousarray``, ``broadcast_to`` ...) given a host array raises
  ``TypeError: Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, got numpy.ndarray)``;
  ``concatenate`` raises ``Unsupported type`` the same way; a kernel argument that is a host array raises
  CuPy's "You are trying to pass a numpy.ndarray ... as a kernel parameter";
- numpy functions and ufuncs called on device arrays dispatch to this module (``__array_function__``,
  ``__array_ufunc__``), as CuPy's do; where this module has no such function numpy raises its TypeError;
- reductions and indexing return device arrays (reductions 0-d ones); out-of-range integer indices wrap, as
  CuPy's do (no IndexError: the engine must check indices on the host);
- a host array assigned under basic indexing raises ``ValueError: non-scalar numpy.ndarray cannot be used for
  fill`` (CuPy's is a fill there; under an advanced index it is copied over, counted); a boolean mask's result
  and ``repr`` read the device (counted); device arrays have no ``__index__``;
- a kernel's scalar argument must have its parameter's C type as CuPy passes it (:func:`check_scalar`: a
  Python int is an int64, a float a float64), else a GPU would read other bytes;
- arrays have ``__cuda_array_interface__`` and no ``__array_namespace__``; streams and events exist (kernels
  run as they are issued, so they order nothing).
"""
from __future__ import annotations

import builtins
import collections
import sys
import types
from typing import Any

import numpy as np

from ..core import arrays

IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly.")

#: host/device crossings since the last :func:`reset`: ``h2d`` and ``d2h`` copies, and where they came from
crossings: collections.Counter = collections.Counter()
sites: collections.Counter = collections.Counter()
TRACE = False   # record the callers (file:function) of every crossing in ``sites`` (slow; to find them)
TRACE_DEPTH = 1


def reset() -> None:
    crossings.clear()
    sites.clear()


def _count(direction: str) -> None:
    crossings[direction] += 1
    if TRACE:
        import traceback
        frames = [f for f in traceback.extract_stack()[:-2] if "standin.py" not in f.filename]
        sites[(direction, " < ".join(f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.name}"
                                     for f in reversed(frames[-TRACE_DEPTH:])))] += 1


def _incorrect(name: str, x) -> TypeError:
    return TypeError(f"Argument '{name}' has incorrect type (expected cupy._core.core._ndarray_base, "
                     f"got {type(x).__module__}.{type(x).__name__})")


class ndarray:
    """A device array: host memory behind CuPy's array interface."""

    __array_priority__ = 100

    def __init__(self, data: np.ndarray, base: "ndarray | None" = None):
        self._a = data
        self._base = base   # the array that owns the memory of a view (CuPy's ``base``)

    def _view(self, data: np.ndarray) -> "ndarray":
        """``data`` (numpy's result on this array's memory) as a device array, a view of this one if it is."""
        if data.base is None or _owner(data) is not _owner(self._a):
            return ndarray(data)
        return ndarray(data, self if self._base is None else self._base)

    # -- metadata (no crossing) ------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self._view(self._a.T))

    @property
    def base(self):
        return self._base

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self._a.ctypes.data, False),
                "version": 3, "strides": None if self._a.flags.c_contiguous else self.strides}

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:   # (CuPy's is repr(self.get()): a device read)
        _count("d2h")
        return f"standin.{repr(self._a)}"

    # -- the ways back (device-to-host, counted) ------------------------------------------------------
    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        _count("d2h")
        return self._a.copy()

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        _count("d2h")
        return self._a.item()

    def tolist(self):
        _count("d2h")
        return self._a.tolist()

    def __float__(self) -> float:
        return float(self.get())

    def __int__(self) -> int:
        return int(self.get())

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous. "
                             "Use a.any() or a.all()")
        return bool(self.get())

    def __array__(self, dtype=None, copy=None):
        raise TypeError(IMPLICIT)

    # -- numpy's protocols: dispatch to this module, as CuPy does ------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        func = getattr(_this, ufunc.__name__, None)
        if not isinstance(func, _Ufunc):
            return NotImplemented
        return (func if method == "__call__" else getattr(func, method))(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        mine = getattr(_this, func.__name__, None)
        if mine is None or not callable(mine):
            return NotImplemented
        return mine(*args, **kwargs)

    # -- indexing ---------------------------------------------------------------------------------------
    def __getitem__(self, key):
        key = _key(key, self._a.shape)
        if builtins.any(isinstance(k, np.ndarray) and k.dtype == bool for k in _parts(key)):
            _count("d2h")   # (a boolean mask's result size is read from the device)
        got = self._a[key]
        return self._view(got) if isinstance(got, np.ndarray) else _wrap(got)

    def __setitem__(self, key, value) -> None:
        """As CuPy's: a host value is copied over under an advanced index, and under basic indexing is a fill
        (cupy/_core/_routines_indexing.pyx _scatter_op), which refuses anything but a scalar."""
        key = _key(key, self._a.shape)
        if (not isinstance(value, ndarray) and np.ndim(value) != 0
                and not builtins.any(isinstance(k, np.ndarray) for k in _parts(key))):
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        self._a[key] = _value(value)

    # -- methods ---------------------------------------------------------------------------------------
    def astype(self, dtype, copy=True, order="K"):
        out = self._a.astype(dtype, copy=copy, order=order)
        return self if out is self._a else ndarray(out)

    def reshape(self, *shape, order="C"):
        return self._view(self._a.reshape(*shape, order=order))

    def ravel(self, order="C"):
        return self._view(self._a.ravel(order))

    def view(self, dtype=None):
        return self._view(self._a.view(dtype) if dtype is not None else self._a.view())

    def copy(self, order="C"):
        return ndarray(self._a.copy(order))

    def transpose(self, *axes):
        return self._view(self._a.transpose(*axes))

    def swapaxes(self, a, b):
        return self._view(self._a.swapaxes(a, b))

    def fill(self, value) -> None:
        self._a.fill(_scalar(value))

    def take(self, indices, axis=None, out=None):
        return take(self, indices, axis, out)

    def nonzero(self):
        return tuple(ndarray(i) for i in self._a.nonzero())

    def __dlpack__(self, *a, **k):
        raise TypeError("the stand-in has no DLPack export")


def _owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _wrap(x):
    """A result of numpy on device data, as a device array (scalars as 0-d arrays, as CuPy returns them)."""
    if isinstance(x, np.ndarray):
        return ndarray(x)
    if isinstance(x, np.generic):
        return ndarray(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    return x


def _scalar(v):
    if isinstance(v, np.ndarray):
        raise TypeError(f"Unsupported type {type(v)}")
    if isinstance(v, ndarray):
        return v._a
    return v


def _key(key, shape):
    """An index on the device: device index arrays used as they are, host ones copied over (counted); integer
    arrays wrap around as in CuPy."""
    parts = key if isinstance(key, tuple) else (key,)
    out, axis = [], 0
    for k in parts:
        if isinstance(k, ndarray):
            k = k._a
        elif isinstance(k, (np.ndarray, list)):
            _count("h2d")
            k = np.asarray(k)
        if isinstance(k, np.ndarray) and k.dtype.kind in "iu" and axis < len(shape) and shape[axis]:
            k = np.mod(k, shape[axis])
        out.append(k)
        axis += 1 if k is not None and k is not Ellipsis else 0
    return tuple(out) if isinstance(key, tuple) else out[0]


def _parts(key) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def _value(v):
    if isinstance(v, ndarray):
        return v._a
    if isinstance(v, (np.ndarray, list)):
        _count("h2d")
    return v


# -- array creation and the crossings ------------------------------------------------------------------

def asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    _count("h2d")
    host = np.array(a, dtype=dtype, order="C" if order in (None, "K", "A") else order, copy=True)
    if host.dtype.byteorder == ">":   # CuPy swaps big-endian data to the device's order
        host = host.astype(host.dtype.newbyteorder("="))
    return ndarray(host)


def array(a, dtype=None, copy=True, order="K", ndmin=0):
    if isinstance(a, ndarray):
        return ndarray(np.array(a._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    return asarray(np.array(a, dtype=dtype, ndmin=ndmin))


def asnumpy(a, stream=None, order="C", out=None) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a, order=order)


def get_array_module(*args):
    return _this if any(isinstance(a, ndarray) for a in args) else np


def _creator(fn):
    def create(*args, **kwargs):
        return ndarray(fn(*args, **kwargs))
    create.__name__ = fn.__name__
    return create


def _like(fn):
    def create(a, *args, **kwargs):
        if not isinstance(a, ndarray):
            raise _incorrect("a", a)
        return ndarray(fn(a._a, *args, **kwargs))
    create.__name__ = fn.__name__
    return create


zeros, empty, ones, full, arange = (_creator(f) for f in (np.zeros, np.empty, np.ones, np.full, np.arange))
zeros_like, empty_like, ones_like = (_like(f) for f in (np.zeros_like, np.empty_like, np.ones_like))


# -- functions typed to device arrays -------------------------------------------------------------------

def _typed(fn, names: tuple[str, ...]):
    """``fn`` of numpy over device arrays; the named leading arguments must be device arrays."""
    def call(*args, **kwargs):
        args = list(args)
        for i, name in enumerate(names[:len(args)]):
            if not isinstance(args[i], ndarray):
                raise _incorrect(name, args[i])
            args[i] = args[i]._a
        for k, v in kwargs.items():
            if isinstance(v, ndarray):
                kwargs[k] = v._a
        return _wrap(fn(*args, **kwargs))
    call.__name__ = fn.__name__
    return call


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise _incorrect("a", a)
    out = np.ascontiguousarray(a._a, dtype=dtype)
    return a if out is a._a else ndarray(out)


broadcast_to = _typed(np.broadcast_to, ("array",))
expand_dims = _typed(np.expand_dims, ("a",))
transpose = _typed(np.transpose, ("a",))
flatnonzero = _typed(np.flatnonzero, ("a",))
argsort = _typed(np.argsort, ("a",))
nonzero = _typed(np.nonzero, ("a",))
take_along_axis = _typed(np.take_along_axis, ("arr", "indices"))
reshape = _typed(np.reshape, ("a",))
where = _typed(np.where, ("condition", "x", "y"))


def result_type(*arrays_and_dtypes):
    """numpy's rule over the arrays' dtypes (as CuPy's: no crossing; numpy's own would recurse through
    ``__array_function__`` back here)."""
    return np.result_type(*(a.dtype if isinstance(a, ndarray) else a for a in arrays_and_dtypes))


def put_along_axis(arr, indices, values, axis) -> None:
    if not isinstance(arr, ndarray):
        raise _incorrect("a", arr)
    np.put_along_axis(arr._a, _device_operand(indices), _device_operand(values), axis)


def take(a, indices, axis=None, out=None):
    if not isinstance(a, ndarray):
        raise _incorrect("a", a)
    if isinstance(indices, ndarray):
        idx = indices._a
    else:
        if not np.isscalar(indices):
            _count("h2d")   # CuPy copies array-like indices over (cupy._core.core.array)
        idx = np.asarray(indices)
    got = np.take(a._a, idx, axis=axis, mode="wrap")
    if out is not None:
        out._a[...] = got
        return out
    return ndarray(got)


def concatenate(arrays, axis=0, out=None, dtype=None):
    parts = [_device_operand(a) for a in arrays]
    if not parts:
        raise ValueError("Cannot concatenate from empty tuple")
    return ndarray(np.concatenate(parts, axis=axis, dtype=dtype))


def stack(arrays, axis=0):
    return ndarray(np.stack([_device_operand(a) for a in arrays], axis=axis))


def _device_operand(x):
    """An operand of a device kernel: a device array's data, or a scalar; a host array is CuPy's error."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, (bool, int, float, complex, np.generic)):
        return x
    raise TypeError(f"Unsupported type {type(x)}")


# -- ufuncs and reductions -----------------------------------------------------------------------------

class _Ufunc:
    """A numpy ufunc over device operands: host arrays refused, results device arrays."""

    def __init__(self, np_ufunc):
        self._f = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def _out(self, kwargs):
        out = kwargs.get("out")
        if out is None:
            return None
        out = out[0] if isinstance(out, tuple) else out
        if not isinstance(out, ndarray):
            raise TypeError(f"Unsupported type {type(out)}")
        kwargs["out"] = out._a
        return out

    def __call__(self, *args, **kwargs):
        out = self._out(kwargs)
        got = self._f(*(_device_operand(a) for a in args), **kwargs)
        return out if out is not None else _wrap(got)

    def reduce(self, a, axis=0, dtype=None, out=None, keepdims=False):
        return _wrap(self._f.reduce(_device_operand(a), axis=axis, dtype=dtype, keepdims=keepdims))

    def reduceat(self, a, indices, axis=0, dtype=None, out=None):
        idx = indices._a if isinstance(indices, ndarray) else indices
        if not isinstance(indices, ndarray):
            _count("h2d")
        return _wrap(self._f.reduceat(_device_operand(a), idx, axis=axis, dtype=dtype))

    def at(self, a, indices, b=None):
        idx = indices._a if isinstance(indices, ndarray) else indices
        if not isinstance(indices, ndarray):
            _count("h2d")
        self._f.at(_device_operand(a), idx, *(() if b is None else (_device_operand(b),)))


_UFUNCS = ("add subtract multiply divide true_divide floor_divide power negative positive absolute abs sign "
           "exp log log1p expm1 sqrt square tanh sin cos floor ceil maximum minimum fmax fmin "
           "isfinite isnan isinf equal not_equal less less_equal greater greater_equal "
           "logical_and logical_or logical_not bitwise_and bitwise_or bitwise_xor invert right_shift left_shift "
           "matmul").split()


def _reduction(name: str):
    fn = getattr(np, name)

    def reduce(a, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
        kw = dict(axis=axis, keepdims=keepdims, **kwargs)
        if name in ("sum", "mean", "prod"):
            kw["dtype"] = dtype
        got = _wrap(fn(_device_operand(a), **kw))
        if out is not None:
            out._a[...] = got._a
            return out
        return got
    reduce.__name__ = name
    return reduce


_REDUCTIONS = "sum mean max min prod any all argmax argmin".split()
_this = sys.modules[__name__]
for _name in _UFUNCS:
    setattr(_this, _name, _Ufunc(getattr(np, _name)))
for _name in _REDUCTIONS:
    setattr(_this, _name, _reduction(_name))


def _binary(ufunc: str, reflected: bool = False):
    f = getattr(_this, ufunc)
    return (lambda self, other: f(other, self)) if reflected else (lambda self, other: f(self, other))


for _op, _uf in {"add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide",
                 "floordiv": "floor_divide", "pow": "power", "matmul": "matmul", "and": "bitwise_and",
                 "or": "bitwise_or", "xor": "bitwise_xor", "rshift": "right_shift", "lshift": "left_shift"}.items():
    setattr(ndarray, f"__{_op}__", _binary(_uf))
    setattr(ndarray, f"__r{_op}__", _binary(_uf, reflected=True))

    def _inplace(self, other, _f=getattr(_this, _uf)):
        _f(self, other, out=self)
        return self
    setattr(ndarray, f"__i{_op}__", _inplace)
for _op, _uf in {"lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal", "eq": "equal",
                 "ne": "not_equal"}.items():
    setattr(ndarray, f"__{_op}__", _binary(_uf))
ndarray.__neg__ = lambda self: _this.negative(self)
ndarray.__abs__ = lambda self: _this.absolute(self)
ndarray.__invert__ = lambda self: _this.invert(self)
ndarray.__hash__ = None
for _name in _REDUCTIONS:
    setattr(ndarray, _name, lambda self, *a, _f=getattr(_this, _name), **k: _f(self, *a, **k))
clip = _typed(np.clip, ("a",))
ndarray.clip = lambda self, lo=None, hi=None: clip(self, lo, hi)



def _as_strided(x, shape=None, strides=None):
    """``cupy.lib.stride_tricks.as_strided``: a view of ``x``'s memory (no copy, no crossing)."""
    if not isinstance(x, ndarray):
        raise _incorrect("x", x)
    return x._view(np.lib.stride_tricks.as_strided(x._a, shape, strides))


lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=_as_strided))

# the dtypes, as cupy re-exports numpy's
float16, float32, float64 = np.float16, np.float32, np.float64
int8, int32, int64, uint8, uint32, uint64, bool_ = np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64, np.bool_
dtype, newaxis, inf, nan = np.dtype, np.newaxis, np.inf, np.nan   # (CuPy 14 has no errstate)


# -- kernel arguments: what CuPy passes for a scalar (cupy/_core/_scalar.pyx numpy_dtype_from_pyscalar) -------

PARAMETER_DTYPES = {"int": np.int32, "unsigned": np.uint32, "long": np.int64, "unsigned long": np.uint64,
                    "unsigned long long": np.uint64, "float": np.float32, "double": np.float64}


def scalar_dtype(value) -> np.dtype:
    """The dtype CuPy passes a kernel scalar as: a numpy scalar's own, int64 (uint64 past its range) for a Python
    int, float64 for a float, bool for a bool."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.dtype
    if isinstance(value, bool):
        return np.dtype(bool)
    if isinstance(value, int):
        return np.dtype(np.uint64 if value > np.iinfo(np.int64).max else np.int64)
    if isinstance(value, float):
        return np.dtype(np.float64)
    raise TypeError(f"Unsupported type {type(value)}")


def check_scalar(kernel: str, param: str, value) -> None:
    """A kernel's scalar parameter gets a value of its C type's size and kind, or a GPU reads other bytes than
    were meant (a Python float where the kernel takes a ``float``, say): refused, naming the kernel and parameter."""
    ctype = param.replace("const", "").rsplit(None, 1)[0].strip()
    want = np.dtype(PARAMETER_DTYPES[ctype])
    got = scalar_dtype(value)
    if got != want:
        raise TypeError(f"kernel {kernel}: parameter '{param}' takes a {want.name} ({ctype}); CuPy would pass "
                        f"{value!r} as {got.name}")


# -- the runtime: one device, streams and events that order nothing (kernels run as they are issued) ----

_handles = iter(range(0x1000, 1 << 62, 0x10))   # (streams' and events' handle values: distinct, never 0)


class _Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False):
        self.ptr = next(_handles)

    done = property(lambda self: True)

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Stream:
    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.ptr = 0 if null else next(_handles)

    def record(self, event=None):
        return event or _Event()

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        _current.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _current.pop()


_current = [_Stream(null=True)]


class _Device:
    def __init__(self, device_id: int = 0):
        self.id = device_id

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


cuda = types.SimpleNamespace(
    Stream=_Stream, Event=_Event, Device=_Device, get_current_stream=lambda: _current[-1],
    runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
)

__all__: list[Any] = []   # not for ``import *``: reached as a module object, as cupy is
arrays.register(ndarray, _this)
