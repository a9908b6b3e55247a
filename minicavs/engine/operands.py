"""The one binder of a pass's buffers: every buffer key of a lowered program (instructions.py) resolved once into an
:class:`~minicavs.engine.backend.Operand` (its array as runners address it, elements, row stride, transposed flag,
host copy of an index array), with the gradient accumulators the pass adds into and the eager stream's own
arenas and accumulators. Every runner (the reference runner, the C runner, the CUDA issuing loop) reads this
table and nothing else of the batch: none resolves a key, lays out a static or makes an arena of its own.

Between passes of the same program in the same workspace, the dynamic tensors' operands are reused while no
dynamic tensor has allocated a buffer since (memory.allocations): a batch's re-binding then looks up only the
buffers that are the batch's own (index arrays, pull and push buffers, gradients, arenas).
"""
from __future__ import annotations

import math
import weakref

import numpy as np

from ..runtime.memory import allocations
from .backend import Operand

# buffer keys of index arrays (row numbers): resolved on the host, the device's copy beside it
INDEX_KEYS = ("child", "pullrows", "pushrows", "srows", "rowkeys", "feedrows", "feedcols",   # (feed*: a static graph's)
              "roworder", "rowsactive")   # (a per-row loop's sort and active rows: engine/row_trips.py)
INDEX_DTYPES = {what: np.dtype(np.uint64 if what == "rowkeys" else np.int64) for what in INDEX_KEYS}
# buffer keys that name a workspace's dynamic tensor whole: kept from the program's last binding in the same
# workspace while no dynamic tensor has allocated a buffer since (a plain lookup otherwise)
WORKSPACE_TENSORS = ("tensor", "btensor")


class Bound:
    """A pass's operands (one per buffer key; None: a block's own buffer, and no block runs), the parameter-gradient
    accumulators it adds into, the eager stream's operands that differ from the main stream's (its scratch and
    fixed arenas, its own accumulators) and those accumulators by parameter name."""

    __slots__ = ("operands", "kinds", "gradients", "eager_operands", "eager_gradients", "scratch", "eager_scratch",
                 "blocks")

    def __init__(self, operands, kinds, gradients, eager_operands, eager_gradients, scratch, eager_scratch, blocks):
        self.operands, self.kinds, self.gradients, self.blocks = operands, kinds, gradients, blocks   # (kinds: every
        # entry's, bound or not)
        self.eager_operands, self.eager_gradients = eager_operands, eager_gradients
        self.scratch, self.eager_scratch = scratch, eager_scratch   # the elements each stream's tasks use


class _Memo:
    """What the binder keeps of a lowered program between its bindings: every entry's kind, the widest static a
    task reads (from the nodes' shapes), its statics' operands (parameters and their views: reused while the binder
    is given the very same array) and its dynamic tensors' and arenas' operands (reused while the workspace is the
    same and no dynamic tensor has allocated a buffer since: then every memo lets go of them, so a program that does
    not run again keeps no outgrown buffer alive)."""

    __slots__ = ("kinds", "entries", "widest", "stamp", "tensors", "statics", "getters")

    def __init__(self, lowered):
        self.kinds = [key[0] for key in lowered.keys]
        # (buffer id, key, its kind, how the binder resolves it: one of the codes below)
        self.entries = [(i, key, key[0], _code(key[0])) for i, key in enumerate(lowered.keys)]
        task_keys = lowered.keys if lowered.task_keys is None else lowered.keys[:lowered.task_keys]
        self.widest = max((key[1].shape[1] for key in task_keys if key[0] == "static"
                           and len(getattr(key[1], "shape", ())) == 2 and key[1].shape[1] is not None), default=0)
        self.stamp, self.tensors, self.statics = None, {}, {}
        self.getters: dict = {}   # type of the buffers mapping -> per entry (function, its arguments)

    def getters_for(self, buffers) -> list:
        """Per entry, how ``buffers`` looks its key up: ``type(buffers).getter(key)`` (the resolving method and its
        arguments, skipping ``buffers[key]``'s dispatch on the key's first item) where the mapping offers it."""
        kind = type(buffers)
        found = self.getters.get(kind)
        if found is None:
            getter = getattr(kind, "getter", None)
            found = self.getters[kind] = [getter(key) if getter is not None else (kind.__getitem__, (key,))
                                          for _, key, _, _ in self.entries]
        return found


_MEMOS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # lowered program -> its _Memo
_SEEN = [-1]   # memory.allocations() when the memos' workspace operands were last checked


def _memo(lowered, workspace) -> _Memo:
    """The program's memo, every memo's workspace operands dropped when a dynamic tensor has allocated since."""
    now = allocations()
    if now != _SEEN[0]:
        for memo in _MEMOS.values():
            memo.tensors, memo.stamp = {}, None
        _SEEN[0] = now
    memo = _MEMOS.get(lowered)
    if memo is None:
        memo = _MEMOS[lowered] = _Memo(lowered)
    if memo.stamp is not None and memo.stamp is not workspace:
        memo.tensors = {}
    memo.stamp = workspace
    return memo


def bind_operands(lowered, table: np.ndarray, buffers, dtype, device, eager: np.ndarray | None = None,
                  workspace=None) -> Bound:
    """Every buffer of ``lowered`` for a run over ``table`` (and ``eager``, the eager stream's table), from
    ``buffers[key]`` (program.Buffers, or any mapping of the keys), on ``device``."""
    memo = _memo(lowered, workspace)
    kept = memo.tensors if workspace is not None else {}
    template_ids, rows = table[:, 0].tolist(), table[:, 2].tolist()
    streaming = eager is not None and len(eager) > 0
    n_kinds = lowered.n_kinds   # (a linked static graph's row, past the blocks' ids, names task keys: not a block)
    blocks = bool(lowered.blocks) and (streaming or any(n_kinds <= t < 3 * n_kinds for t in template_ids))
    task_keys = len(lowered.keys) if lowered.task_keys is None or blocks else lowered.task_keys
    xp = device.xp
    operands, gradients = [], {}
    scratch = scratch_elements(lowered, template_ids, rows)
    spare = min(max(rows, default=0), device.spare_product_rows) * memo.widest
    statics, append = memo.statics, operands.append
    host_index = xp is np
    for (i, key, what, code), (get, args) in zip(memo.entries[:task_keys], memo.getters_for(buffers)):
        if code == STATIC:
            a = get(buffers, *args)
            known = statics.get(i)
            if known is None or known.source is not a:
                known = statics[i] = _static(a, xp)
            append(known)
        elif code == INDEX and host_index:   # (the CPU reads a plan's int64 rows as they are)
            a = get(buffers, *args)
            if type(a) is np.ndarray and a.dtype is INDEX_DTYPES[what] and a.ndim == 1 and a.flags.c_contiguous:
                append(Operand(what, a, a.size, a.size, 0, a))
            else:
                append(_resolved(what, a, device))
        elif code == TENSOR and i in kept:   # (a dynamic tensor kept from the last binding)
            append(kept[i])
        elif code == ARENA:   # (its operand kept while the same buffer and elements: _arena)
            append(_arena(kept, i, what, buffers[("arena", what, scratch + spare if what == "scratch"
                                                  else lowered.fixed_size)], xp))
        else:
            a = get(buffers, *args)
            if what == "pgrad":
                add_accumulators(gradients, key, a)
            append(_resolved(what, a, device))
            if code == TENSOR and workspace is not None:
                kept[i] = operands[-1]
    if task_keys < len(lowered.keys):   # (a block's own buffers, and no block runs: unbound; the scratch last)
        operands += [None] * (len(lowered.keys) - task_keys - 1)
        append(_arena(kept, len(lowered.keys) - 1, "scratch",
                      buffers[("arena", "scratch", scratch + spare)], xp))
    eager_operands, eager_gradients, eager_scratch = {}, {}, 0
    if streaming:
        eager_scratch = scratch_elements(lowered, eager[:, 0].tolist(), eager[:, 2].tolist())
        eager_operands, eager_gradients = _eager_operands(lowered, buffers, gradients, eager_scratch + spare, xp)
    return Bound(operands, memo.kinds, gradients, eager_operands, eager_gradients, scratch, eager_scratch, blocks)


ARENAS = ("scratch", "fixed")
# how the binder resolves an entry, by its kind (_Memo.entries)
STATIC, INDEX, TENSOR, ARENA, OTHER = range(5)


def _code(what: str) -> int:
    return (STATIC if what == "static" else INDEX if what in INDEX_KEYS else TENSOR if what in WORKSPACE_TENSORS
            else ARENA if what in ARENAS else OTHER)


def _arena(kept: dict, i: int, what: str, found, xp) -> Operand:
    """An arena's operand: the one kept when it is the same buffer and elements (a workspace's: see _Memo)."""
    known = kept.get(i)
    array, elements = found if type(found) is tuple else (found, found.size)
    if known is not None and known.source is array and known.elements == elements:
        return known
    kept[i] = operand = _operand(what, found, xp)
    return operand


def _eager_operands(lowered, buffers, gradients: dict, scratch: int, xp) -> tuple[dict, dict]:
    """The eager stream's own operands (its scratch and fixed arenas, its accumulators of the parameter gradients
    that tasks add into too) and those accumulators by name."""
    eager_operands, eager_gradients = {}, {}
    eager_operands[len(lowered.keys) - 1] = _operand("scratch", buffers[("arena", "eager scratch", scratch)], xp)
    if ("fixed",) in lowered.keys:
        eager_operands[lowered.keys.index(("fixed",))] = _operand(
            "fixed", buffers[("arena", "eager fixed", lowered.fixed_size)], xp)
    for i in lowered.eager_accumulators:
        name = lowered.keys[i][1]
        eager_gradients[name] = xp.zeros_like(gradients[name])
        eager_operands[i] = _operand("pgrad", eager_gradients[name], xp)
    return eager_operands, eager_gradients


def _resolved(what: str, a, device) -> Operand:
    """The operand of one looked-up buffer: index arrays on the host and the device, statics laid out."""
    if what in INDEX_KEYS:   # (a batch plan's array: the device copies it once, then slices it; the CPU reads it)
        host = np.ascontiguousarray(a, np.uint64 if what == "rowkeys" else np.int64)
        return Operand(what, host if device.xp is np else device.index(host), host.size, _row_stride(host), 0,
                       host)
    if what == "dropout":   # (the entries' table: read on the host)
        host = np.ascontiguousarray(a, np.int64)
        return Operand(what, host, host.size, host.shape[-1], 0, host)
    if what == "static":
        return _static(a, device.xp)
    return _operand(what, a, device.xp)


def _operand(what: str, a, xp) -> Operand:
    """A buffer the program reads and writes as rows of its row stride: it must be C-contiguous (a copy would
    take the program's writes and lose them). ``a``: an array, or (array, the elements the run may touch)."""
    used = None
    if type(a) is tuple:   # (a workspace buffer kept from batch to batch, the elements this run may touch)
        a, used = a
    if not a.flags.c_contiguous:
        raise ValueError(f"bind: a {what} buffer of shape {a.shape} and strides {a.strides} is not C-contiguous")
    if used is not None and not 0 <= used <= a.size:
        raise ValueError(f"bind: {used} elements of a {what} buffer of {a.size}")
    return Operand(what, a, a.size if used is None else used, _row_stride(a), 0, source=a)


def _row_stride(a) -> int:
    return (a.shape[-1] if a.ndim >= 1 else 1) if a.ndim <= 2 else int(math.prod(a.shape[1:]))


def _static(a, xp) -> Operand:
    """A static (a parameter, a product's operand: only read): a transposed contiguous matrix read through the
    flag, a column block of a planned parameter buffer read in place through its row stride (:func:`strided_span`),
    anything else made contiguous; a numpy scalar (a 0-d result: a cond's pred) as an array."""
    if isinstance(a, np.generic):
        a = np.asarray(a)
    if a.ndim == 2 and not a.flags.c_contiguous and a.T.flags.c_contiguous:
        return Operand("static", a.T, a.size, a.shape[0], 1, source=a)
    if not a.flags.c_contiguous:
        span = strided_span(a)
        if span is not None:
            return Operand("static", span[0], span[0].size, span[1], span[2], source=a)
        a = xp.ascontiguousarray(a)
    return Operand("static", a, a.size, _row_stride(a), 0, source=a)


def strided_span(a) -> tuple | None:
    """(the contiguous run of memory a matrix view spans, row stride, transposed flag) of a 2-D host static whose
    rows (or, transposed, columns) are contiguous at a stride wider than they are: a column block of a
    planned parameter buffer (passes/layout.py) or its transpose, which BLAS reads in place through the
    stride; None for anything else."""
    if not isinstance(a, np.ndarray) or a.ndim != 2 or not a.size:
        return None
    rows, cols = a.shape
    item = a.itemsize
    if a.strides[1] == item and a.strides[0] % item == 0 and a.strides[0] >= cols * item:
        ld, lines, width, flag = a.strides[0] // item, rows, cols, 0
    elif a.strides[0] == item and a.strides[1] % item == 0 and a.strides[1] >= rows * item:
        ld, lines, width, flag = a.strides[1] // item, cols, rows, 1
    else:
        return None
    length = (lines - 1) * ld + width
    base = a.base
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, np.ndarray) and base.flags.c_contiguous:   # whole rows where the buffer has them:
        start = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]   # size / ld is then
        if 0 <= start and start + lines * ld * item <= base.nbytes:                    # the rows (a twin's)
            length = lines * ld
    span = np.lib.stride_tricks.as_strided(a, (length,), (item,), writeable=False)
    return span, ld, flag


def add_accumulators(grads: dict, key: tuple, a) -> None:
    """Name in ``grads`` the parameter-gradient accumulators that the buffer ``a`` of a ``pgrad`` key holds: one
    parameter's, or, for a "block" key, several parameters' side by side, each its column block
    (passes/layout.gradient_blocks)."""
    if len(key) == 3 and key[2] == "block":
        grads.update((name, a[..., lo:hi]) for name, lo, hi in key[1])
    else:
        grads[key[1]] = a


def scratch_elements(lowered, template_ids: list, rows: list) -> int:
    """Scratch elements a run over a table (its template ids, its rows) needs: the task templates' columns x the
    largest task, each block's own."""
    n_kinds, block_cols = lowered.n_kinds, lowered.block_scratch
    largest_task = blocks = 0
    for tid, n in zip(template_ids, rows):   # (a batch of one has a dozen rows: a plain loop beats numpy)
        if tid < n_kinds:
            largest_task = n if n > largest_task else largest_task
        else:
            need = block_cols.get(tid, 0) * n
            blocks = need if need > blocks else blocks
    return max(lowered.scratch_cols * largest_task, blocks)
