"""Optimizers: SGD (with momentum), Adagrad and Adam, with L2 weight decay, global-norm clipping and
row-sparse (embedding) gradients.

One :meth:`Optimizer.step` does, in order:

1. **validate** the loss (if given) and every gradient: known parameter, matching shape, finite values;
   a bad one raises :class:`~minicavs.core.errors.NonFiniteError` or ``ValueError`` naming the parameter;
2. **clip**: with ``clip_norm=c``, if the global L2 norm ``n`` of all gradients exceeds ``c``, every
   gradient is multiplied by ``c / n`` (weight decay is not part of the norm);
3. **weight decay**: ``g += weight_decay * p`` for parameters whose ``weight_decay`` flag is set;
4. **update** out of place, check the new values and slots are finite, and only then **commit** them
   (in place, so arrays handed out earlier stay valid). Any error leaves every parameter, every optimizer
   slot and the step counter exactly as they were.

A parameter missing from ``grads`` (or given ``None``) is skipped: no update, its slots do not decay.

On the CPU with the C library (numpy parameters of one float dtype, C-contiguous), a step is a handful of C
calls: every dense parameter's check pass in one call over a table of addresses (kept by the optimizer while
its arrays stay the same; the parameters of a planned buffer, the layout pass's, as one entry: the buffer,
its gradients as one buffer, slots laid out alike), one per row-sparse gradient (coalesced in C), then the
same calls applying. Both paths check and convert the gradients with the same code
(:meth:`Optimizer._validate`; the C path leaves finiteness to the check pass), and the values are those of
the per-parameter path bit for bit (the same kernels; SGD's kernel is its numpy rule operation for
operation); anything unusual (another dtype or layout of a parameter, a non-finite result) goes the
per-parameter way, which also writes the error messages.

With parameters on a device (CUDA), a step is a few launches whatever the number of parameters: the backend's
fused step runs each rule's kernel over a table of every parameter, gradient and slot (the same RULES as the
C library), first checking (the loss, the gradients, the global norm and every result gathered into one small
report), then, after the report's one device-to-host read found everything finite, applying in place. Its
errors are the per-parameter step's, word for word; row-sparse gradients stay coalesced rows there too.

Row-sparse gradients (:class:`~minicavs.core.sparse.RowSparse`, the gradient of an embedding lookup):

- default (``sparse_updates=False``): exactly the dense semantics, identical to passing ``g.to_dense()``:
  weight decay, momentum decay and Adam's moment decay reach every row, looked up or not. The compiled
  kernels (every rule, on the CPU) take the coalesced rows as they are (no dense gradient is built); other
  devices densify first.
- ``sparse_updates=True`` (DyNet's lazy updates, TensorFlow's LazyAdam): duplicate indices are summed, and
  only the looked-up rows of the parameter and of its slots are read or written. Rows not looked up keep
  their value *and* their slots: SGD momentum is neither applied nor decayed there, Adam's ``m`` and ``v``
  are not decayed, Adagrad's accumulator is unchanged (for Adagrad without weight decay this equals the
  dense result, since a zero gradient changes nothing). Weight decay applies to the looked-up rows only.
  Adam's bias correction uses the optimizer's global step count ``t``, not a per-row count. Clipping still
  uses the global norm of all gradients. Dense gradients are updated densely in either mode.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any, Iterable, Mapping

import numpy as np

from ..core.arrays import is_planned
from ..core.errors import FeedError, NonFiniteError
from ..core.sparse import RowSparse, densify
from ..core.validate import indices
from ..engine.backend import array_module, on_device
from ..nn.parameter import Parameter, block_offset
from ..ops.registry import native_kernels

Grad = Any  # np.ndarray | RowSparse


class Optimizer:
    """Base class. Subclasses name their per-parameter ``slots`` and write one elementwise :meth:`rule`,
    which runs on whole arrays (dense updates) or on the looked-up rows (lazy sparse updates) alike."""

    slots: tuple[str, ...] = ()

    def __init__(self, params: Mapping[str, Parameter] | Iterable[Parameter], lr: float, *,
                 weight_decay: float = 0.0, clip_norm: float | None = None,
                 sparse_updates: bool = False):
        items = params.values() if isinstance(params, Mapping) else params
        self.params: dict[str, Parameter] = {}
        for p in items:
            if p.name in self.params:
                raise ValueError(f"parameter '{p.name}' given twice")
            self.params[p.name] = p
        if lr <= 0 or weight_decay < 0 or (clip_norm is not None and clip_norm <= 0):
            raise ValueError(f"need lr > 0, weight_decay >= 0, clip_norm > 0; got lr={lr}, "
                             f"weight_decay={weight_decay}, clip_norm={clip_norm}")
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.sparse_updates = bool(sparse_updates)
        self.steps = 0  # successful steps so far
        self._table = None   # ((library, rule), UpdateTable, weight decays) of _native's dense updates
        self.last_loss: float | None = None   # the latest step's loss, as a float
        self.state: dict[str, dict[str, np.ndarray]] = {
            name: {s: array_module(p.value).zeros_like(p.value) for s in self.slots}
            for name, p in self.params.items()}

    # --- to be written by subclasses -----------------------------------------------------------------

    def rule(self, value: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray], t: int):
        """Return (new value, {slot: new slot}) for step number ``t`` (1-based); must not modify inputs."""
        raise NotImplementedError

    def kernel(self, t: int) -> tuple[str, tuple] | None:
        """The C library's rule (codegen/library_source.py RULES) computing :meth:`rule` for step ``t``, and its
        hyperparameters before the weight decay; None: :meth:`rule` runs in numpy."""
        return None

    def _prepare(self, value, g, slots, t: int, wd: float):
        """Check one parameter's update without changing anything: returns (not finite?, apply), where
        ``apply()`` writes the update into ``value`` and ``slots`` in place. ``g`` is dense or a coalesced
        RowSparse with dense semantics. With the C library: the rule's kernel twice (check, then apply),
        which touches memory far less than numpy's temporaries; else :meth:`rule` on the L2-decayed
        dense gradient."""
        lib = _update_kernels(value)
        kernel = self.kernel(t)
        if lib is not None and kernel is not None and _inplace(value, *slots.values()):
            rule, hyper = kernel
            run = functools.partial(lib.update, rule, value, g, tuple(slots[s] for s in self.slots), (*hyper, wd))
            return run(apply=False) > 0, functools.partial(run, apply=True)
        return self._prepare_numpy(value, g, slots, t, wd)

    def _prepare_numpy(self, value, g, slots, t: int, wd: float):
        """:meth:`_prepare` with :meth:`rule` in numpy: the reference the kernels are tested against."""
        g = densify(array_module(value), g)
        with np.errstate(all="ignore"):   # a non-finite gradient is reported by ``bad``, not by numpy warnings
            if wd:
                g = g + wd * value
            new, new_slots = self.rule(value, g, slots, t)
        bad = not all(np.isfinite(a).all() for a in (new, *new_slots.values()))

        def apply():
            value[...] = new
            for k, a in new_slots.items():
                slots[k][...] = a
        return bad, apply

    def hyper(self) -> dict:
        """Hyperparameters, recorded in :meth:`state_dict` for reference."""
        return {"lr": self.lr, "weight_decay": self.weight_decay, "clip_norm": self.clip_norm,
                "sparse_updates": self.sparse_updates}

    # --- one step ------------------------------------------------------------------------------------

    def step(self, grads: Mapping[str, Grad], loss=None) -> float | None:
        """Apply one update; returns the global gradient norm before clipping (None without clip_norm).
        ``last_loss`` is then ``loss`` as a float (on a device: read in the step's one device-to-host read)."""
        first = next((p for p in self.params.values()), None)
        if first is not None and on_device(first.value):
            return self._device_step(grads, loss)
        self.last_loss = None if loss is None else float(loss)
        native = self._native(grads, loss)
        if native is not None:
            norm, runs = native
            if not any(run(False) for run in runs):   # every update checked: applying cannot fail
                for run in runs:
                    run(True)
                self.steps += 1
                return norm
        return self._step(grads, loss)   # (after a failed check: the same values, and the error's message)

    def _native(self, grads: Mapping[str, Grad], loss):
        """The step as C calls: (norm, [run(apply) -> non-zero if not finite]), the dense parameters' one
        call first, or None where the kernels do not apply (see the module's docstring). Gradients are
        checked as :meth:`_step` checks them (the same code and errors), except for finiteness, which the
        kernels' check pass catches."""
        kernel = self.kernel(self.steps + 1)
        if kernel is None or not grads:
            return None
        first = next((self.params.get(name) for name, g in grads.items() if g is not None), None)
        lib = first and _update_kernels(first.value)
        if lib is None:
            return None
        rule, hyper = kernel
        checked = self._validate(grads, loss, lib)
        norm = scale = None
        if self.clip_norm is not None:
            norm = math.sqrt(sum(_sq_norm(g) for _, g in checked))
            if not math.isfinite(norm):
                return None
            if norm > self.clip_norm:
                scale = self.clip_norm / norm
        dense, names, runs = [], [], []
        for p, g in checked:
            value = p.value
            if value.dtype != lib.dtype:
                return None
            if not isinstance(g, RowSparse):   # (scaled below, after a planned buffer's gradients are joined)
                dense.append(g)
                names.append(p.name)
                continue
            if scale is not None:
                g = _scaled(g, scale)
            slots = tuple(self.state[p.name].values())
            h = (*hyper, self.weight_decay if p.weight_decay else 0.0)
            if not _inplace(value, *slots):
                return None
            if self.sparse_updates:
                runs.append(lib.update_lazy(rule, value, g.indices, np.ascontiguousarray(g.rows), slots, h))
            else:
                runs.append(functools.partial(lib.update, rule, value, g, slots, h))
        if dense:
            units = self._dense_units(names, dense)
            table = self._dense_table(lib, rule, units)
            if table is None:
                return None
            kernel_table, decays = table
            hypers = np.empty((len(units), len(hyper) + 1), lib.dtype)
            hypers[:, :-1] = hyper
            hypers[:, -1] = decays
            gradients = [g if scale is None else _scaled(g, scale) for _, g, _, _ in units]
            try:
                run = kernel_table.bind(gradients, hypers)
            except FeedError:   # an array made read-only since: the per-parameter path (numpy) updates it
                return None
            staged = [pair for _, _, _, pairs in units for pair in pairs]
            runs.insert(0, run if not staged else functools.partial(_unstaged, run, staged))
        return norm, runs

    def _dense_units(self, names: list, grads: list) -> list[tuple]:
        """The dense updates as the C kernels take them: per unit (the array updated, its gradient (C-contiguous),
        (its slots, its weight decay), [(strided view, its stage)]). A parameter is a unit; the parameters of
        a planned buffer (the layout pass's: ParameterSet.plan_buffer) are one when the step updates all of
        them (:meth:`_whole_buffer`: the buffer, one gradient buffer and slot buffers laid out alike, read and
        written whole). Otherwise a parameter or slot that is a strided view is updated through a contiguous
        stage, filled from it now and copied back only when the step applies."""
        units, planned = [], {}
        for name, g in zip(names, grads):
            value = self.params[name].value
            if is_planned(value.base):
                planned.setdefault(id(value.base), []).append((name, g))
            else:
                units.append(self._unit(name, g))
        for members in planned.values():
            whole = self._whole_buffer(members)
            units += [whole] if whole is not None else [self._unit(name, g) for name, g in members]
        return units

    def _unit(self, name: str, g) -> tuple:
        """One parameter's update (:meth:`_dense_units`): its value and slots, or stages of those that are
        strided views. A copy of each such array per step, where the per-parameter numpy step would cost far
        more."""
        stages = self.__dict__.setdefault("_stages", {})
        arrays, staged = [], []
        for key, a in [(name, self.params[name].value)] + [((name, s), a) for s, a in self.state[name].items()]:
            if a.flags.c_contiguous or not a.flags.writeable:
                stages.pop(key, None)
                arrays.append(a)
                continue
            stage = stages.get(key)
            if stage is None or stage.shape != a.shape or stage.dtype != a.dtype:
                stage = stages[key] = np.empty(a.shape, a.dtype)
            np.copyto(stage, a)
            staged.append((a, stage))
            arrays.append(stage)
        decay = self.weight_decay if self.params[name].weight_decay else 0.0
        return arrays[0], g if g.flags.c_contiguous else np.ascontiguousarray(g), (tuple(arrays[1:]), decay), staged

    def _whole_buffer(self, members: list) -> tuple | None:
        """The unit (:meth:`_dense_units`) of a planned buffer whose parameters ``members`` ((name, gradient))
        are all of it, with one weight decay; else None. Their gradients are read as one buffer laid out as
        the parameters are: the one they are column blocks of, at their values' places (a merged product's
        ∂W' as the engine computes it: no copy), else a buffer kept for it into which they are copied (one
        copy of the gradients, where stages would copy the values and slots in and out). Each slot becomes
        a view of one buffer laid out alike (made once, values kept), so the buffer's update is one
        elementwise kernel run over contiguous memory: the per-parameter updates' values, element for
        element. (What depends only on the parameters and slots is kept while they are the same arrays.)"""
        params = [self.params[name] for name, _ in members]
        buffer = params[0].value.base
        known = self._buffer_layout(params, buffer)
        if known is None:
            return None
        grad = _joined(members, buffer, known[2])
        if grad is None:
            grad = known[5]
            for (_, g), at in zip(members, known[2]):
                grad[..., at:at + g.shape[-1]] = g
        return buffer, grad, (known[4], self.weight_decay if params[0].weight_decay else 0.0), []

    def _buffer_layout(self, params: list, buffer: np.ndarray) -> tuple | None:
        """(buffer, the parameters' values, their offsets in it, their slot arrays, the slot buffers, a
        gradient buffer) when ``params`` are all of the planned ``buffer``, each a block of it, with one weight
        decay; else None. Kept while the values and slots are the same arrays."""
        cache = self.__dict__.setdefault("_buffers", {})
        values = tuple(p.value for p in params)
        slots = tuple(self.state[p.name][s] for s in self.slots for p in params)
        known = cache.get(id(buffer))
        if known is not None and known[0] is buffer and all(map(operator.is_, values, known[1])) \
                and all(map(operator.is_, slots, known[3])):
            return known
        offsets = [block_offset(v, buffer) for v in values]
        if not (buffer.flags.c_contiguous and buffer.flags.writeable and -1 not in offsets
                and len(set(offsets)) == len(offsets) and sum(v.size for v in values) == buffer.size
                and len({bool(p.weight_decay) for p in params}) == 1):
            cache.pop(id(buffer), None)
            return None
        laid = tuple(self._slot_buffer(params, s, buffer, offsets) for s in self.slots)
        slots = tuple(self.state[p.name][s] for s in self.slots for p in params)
        known = cache[id(buffer)] = (buffer, values, offsets, slots, laid, np.empty_like(buffer))
        return known

    def _slot_buffer(self, params: list, slot: str, buffer: np.ndarray, offsets: list) -> np.ndarray:
        """One buffer shaped as the planned ``buffer`` whose blocks at ``offsets`` are ``params``' ``slot``
        arrays: theirs already, or a new one into which they are copied and of which they become views (a
        checkpoint's load writes them in place, so it writes the buffer)."""
        arrays = [self.state[p.name][slot] for p in params]
        found = arrays[0].base
        if type(found) is np.ndarray and found.shape == buffer.shape and found.strides == buffer.strides \
                and found.flags.c_contiguous and found.flags.writeable and all(a.base is found for a in arrays) \
                and [block_offset(a, found) for a in arrays] == offsets:
            return found
        laid = np.empty_like(buffer)
        for p, a, at in zip(params, arrays, offsets):
            block = laid[..., at:at + a.shape[-1]]
            block[...] = a
            self.state[p.name][slot] = block
        return laid

    def _dense_table(self, lib, rule: str, units: list):
        """(the library's UpdateTable of these units' arrays and slots, their weight decays), kept while the
        same arrays come again step after step (the table holds them: no id is reused meanwhile); None if one
        is not a writable C-contiguous array."""
        arrays = [a for value, _, (slots, _), _ in units for a in (value, *slots)]
        known = self._table
        if known is not None and known[0] == (lib, rule) and len(known[1].arrays) == len(arrays) \
                and all(map(operator.is_, arrays, known[1].arrays)):
            return known[1:]
        if not _inplace(*arrays):
            return None
        pairs = [(value, slots) for value, _, (slots, _), _ in units]
        decays = np.array([decay for _, _, (_, decay), _ in units])
        self._table = (lib, rule), lib.update_table(rule, pairs), decays
        return self._table[1:]

    def _step(self, grads: Mapping[str, Grad], loss) -> float | None:
        """The per-parameter step: the reference for :meth:`_native`, and the way for anything unusual."""
        checked = self._validate(grads, loss)
        norm = None
        if self.clip_norm is not None:
            norm = math.sqrt(sum(_sq_norm(g) for _, g in checked))
            if not math.isfinite(norm):
                raise NonFiniteError("global gradient norm overflows; no parameter was updated")
            if norm > self.clip_norm:
                scale = self.clip_norm / norm
                checked = [(p, _scaled(g, scale)) for p, g in checked]
        t = self.steps + 1
        updates = []
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught below, as NonFiniteError
            for p, g in checked:
                slots = self.state[p.name]
                wd = self.weight_decay if p.weight_decay else 0.0
                # lazy: update gathered copies of the rows, scatter them back
                if isinstance(g, RowSparse) and self.sparse_updates:
                    idx, value, grad = g.indices, p.value[g.indices], g.rows
                    slots = {s: a[idx] for s, a in slots.items()}
                else:
                    idx, value, grad = None, p.value, g
                bad, apply = self._prepare(value, grad, slots, t, wd)
                if bad:
                    raise NonFiniteError(f"update of parameter '{p.name}' is not finite (learning rate or "
                                         "gradient too large?); no parameter was updated")
                updates.append((p, idx, value, slots, apply))
        for p, idx, value, slots, apply in updates:  # commit: every update was checked, nothing can fail
            apply()
            if idx is not None:
                p.value[idx] = value
                for s, a in slots.items():
                    self.state[p.name][s][idx] = a
        self.steps = t
        return norm

    def _device_step(self, grads: Mapping[str, Grad], loss) -> float | None:
        """The step with parameters on a device, in a number of launches that does not grow with the number
        of parameters: the backend's fused step (``fused_step`` of its native kernels, on CUDA
        cuda/optim_kernels.py) checks every update over a table of all of them and leaves a report
        ``[loss, squared norm, flags]`` on the device; that report is the step's one device-to-host read,
        and only when everything in it is finite does one more launch write the updates in place. Gradient
        indices made on the host are checked there. Where the fused step does not apply (no such kernels,
        parameters of several dtypes or not contiguous, a rule without a kernel) the per-parameter device
        step runs: the same reads, one array operation or more per parameter."""
        checked = self._validate(grads, None, device=True)
        fused = self._fused_segments(checked)
        if fused is None:
            return self._device_step_per_parameter(checked, loss)
        kernels, segments = fused
        rule, hyper = self.kernel(self.steps + 1)
        step = kernels.fused_step(rule, hyper, self.weight_decay, self.clip_norm, segments, loss)
        got = step.report.get()   # the one device-to-host read of a step
        self.last_loss = None if loss is None else float(got[0])
        norm = self._check_report(got, [p for p, _ in checked], loss is not None)
        step.apply()   # every update checked: writing it cannot fail
        self.steps += 1
        return norm

    def _fused_segments(self, checked: list[tuple[Parameter, Grad]]):
        """(the backend's kernels, one segment per parameter: (value, gradient, slots, row indices or None,
        weight decay?, lazy?)) for the fused device step, or None where it does not apply. A row-sparse
        gradient stays its coalesced rows (no dense gradient is built), updated lazily or densely."""
        if self.kernel(self.steps + 1) is None or not self.params:
            return None
        first = next(iter(self.params.values())).value
        xp, dtype = array_module(first), first.dtype
        kernels = native_kernels(xp, dtype)
        if not hasattr(kernels, "fused_step"):
            return None
        segments = []
        for p, g in checked:
            slots = tuple(self.state[p.name][s] for s in self.slots)
            if p.value.dtype != dtype or not all(_device_contiguous(a) for a in (p.value, *slots)):
                return None
            rows = None
            if isinstance(g, RowSparse):   # coalesced: sorted unique indices
                rows = xp.asarray(g.indices).astype(np.int64, copy=False)   # host indices: copied over once
                g = g.rows
            segments.append((p.value, xp.ascontiguousarray(g), slots, rows, self.weight_decay > 0 and p.weight_decay,
                             self.sparse_updates))
        return kernels, segments

    def _check_report(self, got: np.ndarray, params: list[Parameter], has_loss: bool) -> float | None:
        """The fused step's report read back: raise the per-parameter step's error for its first problem
        (the loss, a gradient, the global norm, an update: in that order, as :meth:`_step` finds them);
        return the global norm (None without clipping)."""
        if has_loss and not math.isfinite(got[0]):
            raise NonFiniteError(f"loss is {got[0]}; no parameter was updated")
        flags = got[2:].reshape(-1, 2)
        for p, (grad_bad, _) in zip(params, flags):
            if grad_bad:
                raise NonFiniteError(f"gradient of parameter '{p.name}' is not finite; no parameter was updated")
        norm = None
        if self.clip_norm is not None:
            norm = math.sqrt(got[1]) if got[1] >= 0 else float("nan")
            if not math.isfinite(norm):
                raise NonFiniteError("global gradient norm overflows; no parameter was updated")
        for p, (_, update_bad) in zip(params, flags):
            if update_bad:
                raise NonFiniteError(f"update of parameter '{p.name}' is not finite (learning rate or "
                                     "gradient too large?); no parameter was updated")
        return norm

    def _device_step_per_parameter(self, checked: list[tuple[Parameter, Grad]], loss) -> float | None:
        """The device step parameter by parameter (the fused step's reference and fallback): every update
        computed into new arrays, the loss's, the global norm's and each update's finiteness gathered into
        one small array, and that array read back in the step's one device-to-host copy; then the new values
        written in place on the device, or (something not finite) nothing changed."""
        xp = array_module(next(iter(self.params.values())).value)
        f64 = np.float64
        report = [xp.asarray(np.nan if loss is None else loss, dtype=f64) if not on_device(loss)
                  else loss.astype(f64)]
        scale = None
        if self.clip_norm is not None:
            sq = [xp.sum(xp.square((g.rows if isinstance(g, RowSparse) else g).astype(f64))) for _, g in checked]
            norm2 = functools.reduce(operator.add, sq) if sq else xp.zeros((), f64)
            report.append(norm2)
            scale = xp.minimum(1.0, self.clip_norm / xp.sqrt(norm2))   # inf/nan norms: flagged below
        t = self.steps + 1
        updates = []
        with np.errstate(all="ignore"):
            for p, g in checked:
                if scale is not None:
                    g = (RowSparse(g.indices, g.rows * scale.astype(g.rows.dtype), g.shape)
                         if isinstance(g, RowSparse) else g * scale.astype(g.dtype))
                slots = self.state[p.name]
                wd = self.weight_decay if p.weight_decay else 0.0
                if isinstance(g, RowSparse) and self.sparse_updates:   # the looked-up rows only
                    idx = xp.asarray(g.indices)                        # host indices: copied over once
                    value, grad, slots = p.value[idx], g.rows, {s: a[idx] for s, a in slots.items()}
                else:
                    idx, value, grad = None, p.value, densify(xp, g)
                if wd:
                    grad = grad + wd * value
                new, new_slots = self.rule(value, grad, slots, t)
                report.append(functools.reduce(operator.and_, (xp.all(xp.isfinite(a)) for a in new_slots.values()),
                                               xp.all(xp.isfinite(new))))
                updates.append((p, idx, new, new_slots))
        got = xp.stack([r.astype(f64) for r in report]).get()   # the one device-to-host read of a step
        norm = self._checked_report(got, loss, [p for p, *_ in updates])
        for p, idx, new, new_slots in updates:   # commit on the device: nothing can fail now
            slots = self.state[p.name]
            at = ... if idx is None else idx
            p.value[at] = new
            for s, a in new_slots.items():
                slots[s][at] = a
        self.steps = t
        return norm

    def _checked_report(self, got: np.ndarray, loss, params: list) -> float | None:
        """The global norm from the step's one read-back (loss, norm when clipping, each update's finiteness),
        raising NonFiniteError for the first thing not finite, before any parameter changes."""
        self.last_loss = None if loss is None else float(got[0])
        norm = None
        if self.clip_norm is not None:
            norm = math.sqrt(got[1]) if got[1] >= 0 else float("nan")
            if not math.isfinite(norm):
                raise NonFiniteError("global gradient norm overflows; no parameter was updated")
        if loss is not None and not math.isfinite(got[0]):
            raise NonFiniteError(f"loss is {got[0]}; no parameter was updated")
        for p, ok in zip(params, got[2 if self.clip_norm is not None else 1:]):
            if not ok:
                raise NonFiniteError(f"update of parameter '{p.name}' is not finite (learning rate or "
                                     "gradient too large?); no parameter was updated")
        return norm

    def _validate(self, grads: Mapping[str, Grad], loss, lib=None, device: bool = False
                  ) -> list[tuple[Parameter, Grad]]:
        """Check everything before anything changes; returns (parameter, gradient) pairs ready to use:
        dense arrays of the parameter's dtype, or coalesced RowSparse values. With ``lib`` (the C library of
        :meth:`_native`) finiteness is left to its kernels' check pass, and repeated rows are summed in C."""
        if loss is not None and not (math.isfinite(loss) if type(loss) is float else
                                     np.isfinite(np.asarray(loss, dtype=np.float64)).all()):
            raise NonFiniteError(f"loss is {loss}; no parameter was updated")
        out = []
        for name, g in grads.items():
            if g is None:
                continue
            p = self.params.get(name)
            if p is None:
                raise ValueError(f"gradient for unknown parameter '{name}'")
            if isinstance(g, RowSparse):
                out.append((p, _check_sparse_on_device(p, g) if device else _check_sparse(p, g, lib)))
                continue
            value = p.value
            if not (type(g) is type(value) is np.ndarray and g.dtype == value.dtype):   # (the usual case)
                g = array_module(value).asarray(g)
                if g.dtype.kind != "f":
                    raise ValueError(f"gradient of parameter '{name}' has dtype {g.dtype}, not a float type")
            if g.shape != value.shape:
                raise ValueError(f"gradient of parameter '{name}' has shape {g.shape}, "
                                 f"parameter has {value.shape}")
            if lib is None and not device and not bool(array_module(g).isfinite(g).all()):
                raise NonFiniteError(f"gradient of parameter '{name}' is not finite; "
                                     "no parameter was updated")
            out.append((p, g if g.dtype == value.dtype else g.astype(value.dtype)))
        return out

    # --- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """A snapshot (copies): ``{"type", "steps", "hyper", "slots": {param: {slot: array}}}``."""
        slots = {name: {s: a.copy() for s, a in got.items()} for name, got in self.state.items()}
        return {"type": type(self).__name__, "steps": self.steps, "hyper": self.hyper(), "slots": slots}

    def check_state_dict(self, state: Mapping) -> None:
        """Raise ValueError naming the parameter or slot if ``state`` does not fit this optimizer."""
        kind = state.get("type")
        if kind != type(self).__name__:
            raise ValueError(f"optimizer state is for {kind!r}, not {type(self).__name__!r}")
        steps = state.get("steps")
        if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"optimizer step count {steps!r} is not a non-negative integer")
        slots = state.get("slots")
        if not isinstance(slots, Mapping):
            raise ValueError("optimizer state has no 'slots' mapping")
        for name in self.params:
            if name not in slots:
                raise ValueError(f"optimizer state is missing parameter '{name}'")
        for name, got in slots.items():
            if name not in self.params:
                raise ValueError(f"optimizer state has unexpected parameter '{name}'")
            if set(got) != set(self.slots):
                raise ValueError(f"optimizer state of parameter '{name}' has slots {sorted(got)}, "
                                 f"expected {sorted(self.slots)}")
            for s, a in got.items():
                want = self.state[name][s]
                a = np.asarray(a)
                if a.shape != want.shape or a.dtype != want.dtype:
                    raise ValueError(f"optimizer slot '{s}' of parameter '{name}' is {a.dtype}{a.shape}, "
                                     f"expected {want.dtype}{want.shape}")

    def load_state_dict(self, state: Mapping) -> None:
        """Restore the step count and slots (all checked first). Hyperparameters stay as constructed, so
        a resumed run takes them from its configuration."""
        self.check_state_dict(state)
        for name, got in state["slots"].items():
            for s, a in got.items():
                slot = self.state[name][s]
                slot[...] = array_module(slot).asarray(a)
        self.steps = int(state["steps"])


def _update_kernels(value):
    """The backend's update-rule kernels for arrays like ``value`` (the C library's on the CPU), else None."""
    kernels = native_kernels(array_module(value), value.dtype)
    return kernels if hasattr(kernels, "update") else None


def _device_contiguous(a) -> bool:
    """Can the fused device step address ``a`` as one flat run of elements (C-contiguous)?"""
    return bool(a.flags.c_contiguous)


def _joined(members: list, buffer: np.ndarray, offsets: list) -> np.ndarray | None:
    """The C-contiguous buffer, laid out as the planned ``buffer``, whose blocks at ``offsets`` the gradients
    of ``members`` ((name, gradient)) are, if they are such blocks of one; else None."""
    grad = members[0][1].base
    if not (type(grad) is np.ndarray and grad.shape == buffer.shape and grad.dtype == buffer.dtype
            and grad.strides == buffer.strides and grad.flags.c_contiguous):
        return None
    origin, item = grad.__array_interface__["data"][0], grad.itemsize
    for (_, g), at in zip(members, offsets):
        if g.base is not grad or g.strides != grad.strides \
                or g.__array_interface__["data"][0] - origin != at * item:
            return None
    return grad


def _unstaged(run, staged: list, apply: bool) -> int:
    """``run(apply)`` over stages (Optimizer._unit), then, when it applied, the stages copied back into the
    parameters' strided views."""
    bad = run(apply)
    if apply:
        for value, stage in staged:
            np.copyto(value, stage)
    return bad


def _inplace(*arrays) -> bool:
    """Can a compiled (C) kernel update these arrays in place (numpy, writable, C-contiguous)?"""
    return all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable for a in arrays)


def _check_sparse(p: Parameter, g: RowSparse, lib=None) -> RowSparse:
    """The checked, coalesced gradient in the parameter's dtype, or an error naming the parameter. With the C
    library ``lib``: coalesced by its kernel (the same sums), and finiteness is left to its update kernels."""
    shape = p.value.shape
    xp = array_module(p.value)
    idx = indices(g.indices, f"row-sparse gradient of parameter '{p.name}': index", dtype=None)
    idx, rows = xp.asarray(idx), xp.asarray(g.rows)
    if tuple(g.shape) != shape:
        raise FeedError(f"row-sparse gradient of parameter '{p.name}' has shape {tuple(g.shape)}, "
                         f"parameter has {shape}")
    if idx.ndim != 1 or idx.dtype.kind not in "iu" or rows.shape != (len(idx),) + shape[1:]:
        raise FeedError(f"row-sparse gradient of parameter '{p.name}': indices {idx.dtype}{idx.shape} and "
                         f"rows {rows.shape} do not fit a parameter of shape {shape}")
    if rows.dtype.kind != "f":
        raise FeedError(f"row-sparse gradient of parameter '{p.name}' has dtype {rows.dtype}")
    if lib is not None and rows.dtype == lib.dtype and idx.dtype == np.int64:
        out_idx, out_rows = lib.coalesce(idx, rows)   # (sorted: its ends bound every index; a bad one is
        if not len(out_idx) or (out_idx[0] >= 0 and out_idx[-1] < shape[0]):   # named below)
            return RowSparse(out_idx, out_rows, shape)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= shape[0]):
        pos = int(xp.flatnonzero((idx < 0) | (idx >= shape[0]))[0])
        raise FeedError(f"row-sparse gradient of parameter '{p.name}': index out of range [0, {shape[0]}): "
                        f"{int(idx[pos])} at position {pos}")
    idx = idx.astype(np.int64, copy=False)   # in range, so a uint64 index converts exactly
    if lib is not None and rows.dtype == lib.dtype:
        return RowSparse(*lib.coalesce(idx, rows), shape)
    g = RowSparse(idx, rows, shape).coalesce(xp)  # repeated rows summed: dense or lazy, see step()
    if lib is None and not bool(xp.isfinite(g.rows).all()):
        raise NonFiniteError(f"gradient of parameter '{p.name}' is not finite; no parameter was updated")
    return RowSparse(g.indices, g.rows.astype(p.value.dtype, copy=False), shape)


def _check_sparse_on_device(p: Parameter, g: RowSparse) -> RowSparse:
    """:func:`_check_sparse` for a parameter on a device: indices checked where they live (the host, for
    every bundled model: no device read), rows kept on the device, repeated rows summed there."""
    shape = p.value.shape
    xp = array_module(p.value)
    rows = g.rows if on_device(g.rows) else xp.asarray(g.rows)
    if tuple(g.shape) != shape or rows.ndim == 0 or rows.shape[1:] != shape[1:]:
        raise FeedError(f"row-sparse gradient of parameter '{p.name}' has shape {tuple(g.shape)} and rows "
                        f"{rows.shape}; parameter has {shape}")
    if rows.dtype.kind != "f":
        raise FeedError(f"row-sparse gradient of parameter '{p.name}' has dtype {rows.dtype}")
    checked = RowSparse(g.indices, rows, shape).checked(f"row-sparse gradient of parameter '{p.name}'")
    c = checked.coalesce(xp)
    return RowSparse(c.indices, c.rows.astype(p.value.dtype, copy=False), shape)


def _sq_norm(g: Grad) -> float:
    """The squared L2 norm in float64; inf where it overflows (the caller raises NonFiniteError, no warning)."""
    a = g.rows if isinstance(g, RowSparse) else g
    a = a.astype(np.float64, copy=False).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.dot(a, a))


def _scaled(g: Grad, scale: float) -> Grad:
    if isinstance(g, RowSparse):
        return RowSparse(g.indices, g.rows * g.rows.dtype.type(scale), g.shape)
    return g * g.dtype.type(scale)


class SGD(Optimizer):
    """``v = momentum * v + g;  p -= lr * v`` (plain SGD when momentum is 0: no slot is kept)."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.0, **kwargs):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum {momentum} must be in [0, 1)")
        self.momentum = float(momentum)
        self.slots = ("momentum",) if momentum else ()
        super().__init__(params, lr, **kwargs)

    def hyper(self) -> dict:
        return {**super().hyper(), "momentum": self.momentum}

    def kernel(self, t):
        return ("momentum", (self.lr, self.momentum)) if self.momentum else ("sgd", (self.lr,))

    def rule(self, value, g, slots, t):
        if not self.momentum:
            return value - self.lr * g, {}
        v = self.momentum * slots["momentum"] + g
        return value - self.lr * v, {"momentum": v}


class Adagrad(Optimizer):
    """``acc += g**2;  p -= lr * g / (sqrt(acc) + eps)`` (Duchi et al. 2011)."""

    slots = ("sum_sq",)

    def __init__(self, params, lr: float = 0.1, eps: float = 1e-10, **kwargs):
        self.eps = float(eps)
        super().__init__(params, lr, **kwargs)

    def hyper(self) -> dict:
        return {**super().hyper(), "eps": self.eps}

    def kernel(self, t):
        return "adagrad", (self.lr, self.eps)

    def rule(self, value, g, slots, t):
        acc = slots["sum_sq"] + g * g
        return value - self.lr * g / (np.sqrt(acc) + self.eps), {"sum_sq": acc}


class Adam(Optimizer):
    """Kingma & Ba 2015: ``m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
    p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``; weight decay is L2 (added to g).

    Computed in the paper's more efficient order (its section 2), with the bias corrections folded into two
    scalars: ``p -= lr_t * m / (sqrt(v) + eps_t)``, ``lr_t = lr sqrt(1-b2^t) / (1-b1^t)``, ``eps_t = eps
    sqrt(1-b2^t)``: the same update in exact arithmetic (DyNet's Adam is this with ``eps_t = eps``), with one
    division and one square root an element instead of three divisions, which bound the step's time."""

    slots = ("m", "v")

    def __init__(self, params, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, **kwargs):
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"betas ({beta1}, {beta2}) must be in [0, 1)")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        super().__init__(params, lr, **kwargs)

    def hyper(self) -> dict:
        return {**super().hyper(), "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps}

    def corrected(self, t: int) -> tuple[float, float]:
        """(lr_t, eps_t) of step ``t``: the learning rate and eps with the bias corrections folded in."""
        root = math.sqrt(1.0 - self.beta2 ** t)
        return self.lr * root / (1.0 - self.beta1 ** t), self.eps * root

    def kernel(self, t):
        lr_t, eps_t = self.corrected(t)
        return "adam", (lr_t, self.beta1, self.beta2, eps_t)

    def rule(self, value, g, slots, t):
        lr_t, eps_t = self.corrected(t)
        m = self.beta1 * slots["m"] + (1.0 - self.beta1) * g
        v = self.beta2 * slots["v"] + (1.0 - self.beta2) * (g * g)
        return value - lr_t * m / (np.sqrt(v) + eps_t), {"m": m, "v": v}


OPTIMIZERS = {"sgd": SGD, "adagrad": Adagrad, "adam": Adam}


def make_optimizer(name: str, params, **kwargs) -> Optimizer:
    """Build an optimizer by (case-insensitive) name, as a config file names it."""
    try:
        cls = OPTIMIZERS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}") from None
    return cls(params, **kwargs)


__all__ = ["Optimizer", "SGD", "Adagrad", "Adam", "OPTIMIZERS", "make_optimizer"]
