"""Trainable parameters: a named value plus the symbolic ``param`` node that graphs use to refer to it.

Graphs hold only the node; the executor looks the value up by name at run time, so a :class:`ParameterSet`
can be passed directly as the executor's ``params`` and the optimizer can update values in place.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..core.arrays import mark_planned
from ..core.dtypes import as_dtype
from ..ir.graph import Node, fmt_shape
from ..ops import param_node
from .init import InitSpec, get_initializer


def _rng_for(name: str, rng) -> np.random.Generator:
    """A Generator is drawn from as is; a seed (None = 0) is combined with a hash of the name, so each
    parameter's initial value depends on (seed, name) only, not on the order parameters are created in."""
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng([0 if rng is None else int(rng), zlib.crc32(name.encode())])


class Parameter:
    """A named trainable array. ``init`` is an initializer spec (see :mod:`minicavs.nn.init`) or an array
    to copy; ``weight_decay=False`` opts this parameter out of the optimizer's L2 term (biases, say).

    ``trainable=False`` freezes it: the model derives no gradient for it and the trainer gives it no
    optimizer slot, so its value stays as set (pretrained embeddings kept fixed). ``source`` records where a
    value that is not the initializer's came from (:mod:`minicavs.data.vectors` sets it; checkpoints keep it).

    ``value`` is the parameter's storage: runs read it, optimizer steps and checkpoint loads write it in
    place, so an array taken from it stays live. Only laying out (:meth:`ParameterSet.plan_buffer`, through
    :meth:`minicavs.engine.model.Model.plan_buffers`, which a Trainer calls when built) gives it a new array,
    once; take arrays after that."""

    def __init__(self, name: str, shape: Sequence[int], init: InitSpec | np.ndarray = "glorot_uniform",
                 dtype="float32", weight_decay: bool = True,
                 rng: int | np.random.Generator | None = None, trainable: bool = True):
        if not isinstance(name, str) or not name:
            raise ValueError(f"parameter name must be a non-empty string, got {name!r}")
        shape = tuple(shape)
        if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
            raise ValueError(f"parameter '{name}': shape {shape} must be non-negative integers")
        self.name = name
        self.dtype = as_dtype(dtype)
        if not self.dtype.is_float:
            raise ValueError(f"parameter '{name}': dtype {self.dtype.name} is not a float type")
        if isinstance(init, np.ndarray):
            value = np.array(init, dtype=self.dtype.np, order="C")
        else:   # C order always: optimizers update parameters in place with compiled kernels
            try:
                initializer = get_initializer(init)
            except (TypeError, ValueError) as e:
                raise ValueError(f"parameter '{name}': {e}") from None
            value = np.array(initializer(shape, _rng_for(name, rng)), dtype=self.dtype.np, order="C")
        if value.shape != shape:
            raise ValueError(f"parameter '{name}': initial value has shape {value.shape}, "
                             f"declared {fmt_shape(shape)}")
        self.value: np.ndarray = value
        self.trainable = bool(trainable)
        self.node: Node = param_node(name, shape, self.dtype, frozen=not self.trainable)
        self.weight_decay = bool(weight_decay)
        self.source: dict | None = None

    @property
    def shape(self) -> tuple:
        return self.value.shape

    def __repr__(self) -> str:
        frozen = "" if self.trainable else ", frozen"
        return f"Parameter({self.name!r}, {fmt_shape(self.shape)}, {self.dtype.name}{frozen})"


class ParameterSet(Mapping):
    """Parameters by name, in insertion order; a name may appear once. Usable as the executor's
    ``params`` mapping, by the optimizer and by checkpoints."""

    def __init__(self, params: Iterable[Parameter] = ()):
        self._params: dict[str, Parameter] = {}
        for p in params:
            self.add(p)

    def add(self, param: Parameter) -> Parameter:
        if not isinstance(param, Parameter):
            raise TypeError(f"expected a Parameter, got {type(param).__name__}")
        if param.name in self._params:
            raise ValueError(f"duplicate parameter name '{param.name}': names identify parameters in graphs "
                             "and checkpoints, so each must be unique")
        self._params[param.name] = param
        return param

    def new(self, name: str, shape: Sequence[int], **kwargs) -> Parameter:
        """Create a :class:`Parameter` (same arguments), add it, and return it."""
        return self.add(Parameter(name, shape, **kwargs))

    def __getitem__(self, name: str) -> Parameter:
        return self._params[name]

    def __contains__(self, name) -> bool:   # (Mapping's would call __getitem__ and catch the KeyError)
        return name in self._params

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def trainable(self) -> list[Parameter]:
        """The parameters an optimizer updates (frozen ones left out), in order."""
        return [p for p in self._params.values() if p.trainable]

    def read_only(self) -> None:
        """Make every value read-only, and the buffers they view: a model that only predicts (a loaded
        artifact, a server) promises this way that nothing changes them, so the C runner keeps the transposed
        copies it multiplies by from batch to batch instead of making them per batch. Writing a value then
        fails (numpy: 'assignment destination is read-only'); setting it writeable again breaks the promise."""
        for p in self._params.values():
            a = p.value
            while isinstance(a, np.ndarray):
                a.flags.writeable = False
                a = a.base

    @property
    def nodes(self) -> list[Node]:
        """The param nodes in order: the ``wrt`` list for :func:`minicavs.grad`."""
        return [p.node for p in self._params.values()]

    def split(self, name: str, parts: Sequence[str]) -> list[Parameter]:
        """Replace parameter ``name`` by ``len(parts)`` parameters ``name.part``, the equal blocks of its last
        axis in order (their values, trainability, weight decay and source; same place in the order): a
        cell written one product per gate holds the blocks of the fused cell's weight."""
        p = self[name]
        if not parts or p.value.shape[-1] % len(parts):
            raise ValueError(f"parameter '{name}': its last axis ({p.value.shape[-1]}) does not split into "
                             f"{len(parts)} equal blocks")
        width = p.value.shape[-1] // len(parts)
        made = []
        for k, part in enumerate(parts):
            block = Parameter(f"{name}.{part}", p.value.shape[:-1] + (width,),
                              init=np.ascontiguousarray(p.value[..., k * width:(k + 1) * width]), dtype=p.dtype,
                              weight_decay=p.weight_decay, trainable=p.trainable)
            block.source = p.source
            made.append(block)
        clash = [b.name for b in made if b.name in self._params]
        if clash:
            raise ValueError(f"parameter '{name}': split names {', '.join(clash)} are taken")
        items = list(self._params.items())
        at = [n for n, _ in items].index(name)
        self._params = dict(items[:at] + [(b.name, b) for b in made] + items[at + 1:])
        return made

    def plan_buffer(self, names: Sequence[str]) -> np.ndarray:
        """Lay the parameters ``names`` (matrices of one row count, or vectors; one dtype) out as adjacent
        blocks of the last axis of one new buffer, in that order, and return it: each parameter's value
        becomes a view of the buffer (same numbers), so a product over several of them reads a column block
        of the buffer with no copy (passes/layout.py). Everything else stays per parameter (names,
        checkpoints, optimizer slots, gradients); a value written in place (an optimizer step, a checkpoint
        load) writes the buffer. Already laid out so: the buffer as it is.

        Replacing ``value`` is why an array taken from a parameter before this call is no longer its
        storage: lay out before handing arrays out (Model.plan_buffers does, once per parameter)."""
        ps = [self[n] for n in names]
        first = ps[0].value
        lead = first.shape[:-1]
        bad = [p.name for p in ps if not isinstance(p.value, np.ndarray) or p.value.ndim not in (1, 2)
               or p.value.shape[:-1] != lead or p.value.dtype != first.dtype]
        if bad:
            raise ValueError(f"plan_buffer: parameters {', '.join(bad)} are not host arrays of shape "
                             f"{lead + ('n',)} and dtype {first.dtype} as '{ps[0].name}' is")
        offsets = _offsets(ps)
        width = offsets[-1] + ps[-1].value.shape[-1]
        base = first.base
        if base is not None and base.shape == lead + (width,) and all(p.value.base is base for p in ps) \
                and all(block_offset(p.value, base) == a for p, a in zip(ps, offsets)):
            return base
        buffer = np.empty(lead + (width,), first.dtype)
        mark_planned(buffer)
        for p, a in zip(ps, offsets):
            buffer[..., a:a + p.value.shape[-1]] = p.value
            p.value = buffer[..., a:a + p.value.shape[-1]]
        return buffer

    def __repr__(self) -> str:
        return f"ParameterSet({list(self._params.values())!r})"


def _offsets(ps) -> list:
    out, a = [], 0
    for p in ps:
        out.append(a)
        a += p.value.shape[-1]
    return out


def block_offset(view: np.ndarray, base: np.ndarray) -> int:
    """The first entry of ``view`` along the last axis of ``base`` (-1 if it is not such a block of it)."""
    delta = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    if view.strides != base.strides or delta % base.itemsize or view.shape[:-1] != base.shape[:-1]:
        return -1
    return delta // base.itemsize
