"""Which array module an array belongs to: numpy, or a device's.

A device array is recognised by its type, registered by the backend that makes it (CuPy's ``ndarray`` when the
CUDA backend starts, the stand-in's when it is imported), or as CuPy itself reports it
(``cupy.get_array_module``) once CuPy is imported; never by duck typing (CuPy 14's arrays have no
``__array_namespace__``, and a numpy subclass or a list is a host value). A base module so that the index
checks (validate.py) and everything above can ask it.
"""
from __future__ import annotations

import sys
import weakref
from types import ModuleType

import numpy as np

_DEVICE_TYPES: dict[type, ModuleType] = {}


def register(array_type: type, module: ModuleType) -> None:
    """Arrays of ``array_type`` live on the device whose array module is ``module``."""
    _DEVICE_TYPES[array_type] = module


def array_module(a) -> ModuleType:
    """numpy for host values (arrays, scalars, lists), or the array module of the device ``a`` lives on."""
    if type(a) is np.ndarray:
        return np
    module = _DEVICE_TYPES.get(type(a))
    if module is not None:
        return module
    cupy = sys.modules.get("cupy")
    if cupy is not None and not isinstance(a, np.ndarray):
        found = cupy.get_array_module(a)
        if found is cupy:
            return cupy
    return np


def on_device(a) -> bool:
    """Does ``a`` live on a device (not in host memory)?"""
    return array_module(a) is not np


def as_module(xp: ModuleType, a):
    """``a`` as an array of ``xp``: unchanged if it already is one; a host array (indices checked on the host)
    copied to ``xp``'s device, a counted host-to-device copy."""
    return a if xp is np or array_module(a) is xp else xp.asarray(a)


# Parameter buffers laid out by ParameterSet.plan_buffer (passes/layout.py), by id: a concat of their
# adjacent blocks is read as a view of them, and only of them (a view of any other array could alias memory
# a later run overwrites, a workspace tensor's, say, or be written through).
_PLANNED: "weakref.WeakValueDictionary[int, np.ndarray]" = weakref.WeakValueDictionary()


def mark_planned(buffer: np.ndarray) -> None:
    """Record ``buffer`` as a planned parameter buffer (kept only while something else holds it)."""
    _PLANNED[id(buffer)] = buffer


def is_planned(buffer) -> bool:
    """Is ``buffer`` a planned parameter buffer (:func:`mark_planned`)?"""
    return buffer is not None and _PLANNED.get(id(buffer)) is buffer
