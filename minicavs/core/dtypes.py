"""The dtype table: one row per supported dtype, used by the IR, the executor and (later) codegen."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    np: np.dtype
    c_type: str
    c_suffix: str  # literal suffix, so generated constants never promote to double
    is_float: bool

    def __repr__(self) -> str:
        return self.name


float32 = DType("float32", np.dtype(np.float32), "float", "f", True)
float64 = DType("float64", np.dtype(np.float64), "double", "", True)
int32 = DType("int32", np.dtype(np.int32), "int", "", False)
int64 = DType("int64", np.dtype(np.int64), "long long", "LL", False)

DTYPES = {d.name: d for d in (float32, float64, int32, int64)}
SHORT = {"float32": "f32", "float64": "f64", "int32": "i32", "int64": "i64"}


def as_dtype(x) -> DType:
    """Map a DType, a name ('float32') or a numpy dtype to the table row; anything else is an error."""
    if isinstance(x, DType):
        return x
    try:
        name = np.dtype(x).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise TypeError(f"unknown dtype {x!r}: minicavs supports {', '.join(DTYPES)}")
    return DTYPES[name]
