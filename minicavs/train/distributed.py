"""Data-parallel training over MPI (mpi4py): ``mpirun -n N minicavs train CONFIG``.

Every rank holds the whole model and the whole data set. Each global batch (the batch a single-process run
would take, same samples, same order) is cut into N contiguous shards; rank r runs forward and backward on
shard r, keyed by the samples' global ids, so dropout masks, and therefore the gradient, do not depend on N.
The bundled models normalise the loss by the number of samples in the batch they are given, so a shard's loss
and gradient are scaled by ``n_shard / n_batch`` before they are summed across ranks: the summed gradient is
the single-process gradient of the global batch (up to the order of floating-point additions), and every rank
applies the same optimizer step to the same parameters.

Per step (:meth:`GradientReducer.reduce`): one small allgather of a float64 header (scaled loss, units, and per
parameter: dense, none, or the number of row-sparse rows), then one in-place ``Allreduce`` per dtype of a flat
buffer holding every dense gradient, and, per embedding, either an ``Allgatherv`` of its rows (indices + rows)
or a dense buffer with a row-touch mark (folded into the same flat buffer), whichever puts fewer bytes on the
wire this step. Device arrays are copied to the host, reduced there, and copied back (NCCL is not used).

Robustness: the configs are compared at start (a difference names the key and the ranks), rank 0's state
(parameters, optimizer slots, epoch) is broadcast at start, so ``--resume`` works with any N, and a digest of
every parameter and slot is compared every ``train.distributed.digest_every`` steps (a mismatch names the
parameter). A rank that dies is detected by the MPI runtime (Open MPI's and MPICH's launchers end the whole job
and name the rank); as a second line of defence a watchdog thread ends this process if one collective waits
longer than ``train.distributed.timeout`` seconds (a peer that hangs rather than dies).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..core.errors import MinicavsError
from ..core.sparse import RowSparse
from ..engine.backend import array_module, to_host
from .task import Task

# The world size and rank MPI launchers put in every process they start: Open MPI; MPICH/Hydra and Intel MPI.
_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
SPARSE_MODES = ("auto", "allgather", "allreduce")
# train.distributed in a config: digest check period (steps, 0: only at start), watchdog seconds, sparse path
SETTINGS = {"digest_every": 100, "timeout": 600.0, "sparse": "auto"}
_NONE, _DENSE = -1.0, -2.0   # header codes of a parameter without a gradient / with a dense one


class DistributedError(MinicavsError, RuntimeError):
    """Ranks that disagree (config, parameters) or a collective that cannot complete."""


def launched_size() -> int:
    """How many processes the MPI launcher says this job has (1 when not started by a launcher)."""
    for var in _LAUNCH_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def launched_rank() -> int:
    """This process's rank as the MPI launcher says it (0 when not started by a launcher)."""
    for var in _RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


_WORLD: "Communicator | None" = None
_ALONE = False   # set by alone_on_rank_0(): this process runs as one, even under a launcher


def alone_on_rank_0() -> bool:
    """For a command with nothing to share out (show, plot, prepare...) under an MPI launcher: rank 0 runs
    it as a single process and the others do nothing, so it prints and writes once. True on rank 0 (from
    now on :func:`world` is None: MPI is never initialised, so the other ranks may end at once and the
    job's exit status is rank 0's), False on the others. Outside a launcher: True."""
    global _ALONE
    _ALONE = True
    return launched_rank() == 0


def world() -> "Communicator | None":
    """The job's communicator when this process was started by an MPI launcher with more than one process,
    else None (mpi4py is not even imported: ``train`` runs as it always did). An MPI job without mpi4py is
    an error, not N independent runs that would all write the same run directory."""
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    n = launched_size()
    if n <= 1 or _ALONE:
        return None
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise DistributedError(f"started by an MPI launcher with {n} processes but mpi4py cannot be imported "
                               f"({e}): pip install 'minicavs[mpi]'") from None
    _WORLD = Communicator(MPI.COMM_WORLD)
    _install_excepthook(_WORLD)
    return _WORLD


def on_root(comm, work: Callable):
    """``work()`` on rank 0 of ``comm`` only (the rank that reads and writes the run dir); its result, or
    its error, reaches every rank. Without a communicator (one process): ``work()``."""
    if comm is None or comm.size == 1:
        return work()
    result, error = None, None
    if comm.rank == 0:
        try:
            result = work()
        except (MinicavsError, OSError) as e:
            error = e
    result, error = comm.bcast_obj((result, error), "the run dir's answer")
    if error is not None:
        raise on_every_rank(error)
    return result


def on_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as raised by every rank at the same point (a collective told them all): the CLI has
    rank 0 alone say it, and every rank ends normally (no rank is left waiting for another)."""
    error.on_every_rank = True
    return error


def raised_on_every_rank(error: BaseException) -> bool:
    """Whether :func:`on_every_rank` marked ``error``."""
    return getattr(error, "on_every_rank", False)


def says_error(error: BaseException) -> bool:
    """Whether this process should print ``error``: always, unless every rank raised it and this is not
    rank 0."""
    return not raised_on_every_rank(error) or _WORLD is None or _WORLD.rank == 0


def scatter_from_root(comm: "Communicator | None", work: Callable[[], list]) -> list:
    """``work()`` on rank 0 alone (it reads the input: standard input reaches rank 0 only), cut into
    contiguous shards (:func:`shard`); rank r gets shard r. Its error reaches every rank. Without a
    communicator: all of ``work()``."""
    if comm is None or comm.size == 1:
        return work()
    chunks, error = None, None
    if comm.rank == 0:
        try:
            items = work()
            chunks = [(shard(items, r, comm.size), None) for r in range(comm.size)]
        except (MinicavsError, OSError) as e:
            error = e
        chunks = chunks or [(None, error)] * comm.size
    mine, error = comm.scatter_obj(chunks, "the input's scatter")
    if error is not None:
        raise on_every_rank(error)
    return mine


def gather_to_root(comm: "Communicator | None", work: Callable[[], list]) -> list | None:
    """``work()`` on every rank (a list: the results of its shard); rank 0 gets them concatenated in rank
    order (after :func:`scatter_from_root`: input order), the others None. An error on any rank is raised
    on every rank, the first one's, naming its rank. Without a communicator: ``work()``."""
    if comm is None or comm.size == 1:
        return work()
    mine, error = None, None
    try:
        mine = work()
    except (MinicavsError, OSError) as e:
        error = e
    everyone = comm.gather_obj(mine, "the results' gather")
    errors = comm.allgather_obj(None if error is None else str(error), "the error check")
    failed = [(r, message) for r, message in enumerate(errors) if message is not None]
    if failed:
        rank, message = failed[0]
        raise on_every_rank(error if rank == comm.rank else DistributedError(f"rank {rank} of {comm.size}: {message}"))
    return [row for got in everyone for row in got] if comm.rank == 0 else None



def abort_peers(code: int) -> None:
    """After an error on this rank: end the whole MPI job (the other ranks may be waiting in a collective
    this rank will never join). A no-op outside an MPI job."""
    if _WORLD is not None and _WORLD.size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        _WORLD.comm.Abort(code)


def _install_excepthook(comm: "Communicator") -> None:
    """An uncaught exception on one rank prints its traceback and aborts the job, instead of leaving the
    other ranks blocked (mpi4py's ``python -m mpi4py`` does the same for scripts)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        sys.stderr.write(f"rank {comm.rank} of {comm.size}: uncaught exception, aborting the MPI job\n")
        previous(kind, value, tb)
        abort_peers(1)
    sys.excepthook = hook


class Communicator:
    """The few collectives data parallelism needs, on an mpi4py communicator, each under the watchdog."""

    def __init__(self, comm, timeout: float = 600.0):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = float(timeout)
        self._deadline: tuple[float, str] | None = None
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None

    # --- the watchdog --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _guard(self, what: str):
        """Arm the watchdog for one collective (``what`` goes into its message)."""
        with self._lock:
            self._deadline = (time.monotonic() + self.timeout, what)
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="minicavs-mpi-watchdog", daemon=True)
            self._watchdog.start()
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        """mpi4py releases the GIL inside MPI calls, so this thread runs while the main thread waits."""
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self._lock:
                deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline[0]:
                sys.stderr.write(f"minicavs: rank {self.rank} of {self.size}: {deadline[1]} has waited more than "
                                 f"{self.timeout:g} s for the other ranks (train.distributed.timeout): a rank "
                                 f"died or hangs; ending this process\n")
                sys.stderr.flush()
                os._exit(3)

    # --- collectives ---------------------------------------------------------------------------------

    def allreduce_(self, buf: np.ndarray, what: str = "allreduce") -> None:
        """Sum ``buf`` (contiguous, host) over ranks, in place."""
        with self._guard(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def allgather(self, buf: np.ndarray, what: str = "allgather") -> np.ndarray:
        """(size, *buf.shape): every rank's ``buf``."""
        out = np.empty((self.size,) + buf.shape, buf.dtype)
        with self._guard(what):
            self.comm.Allgather(np.ascontiguousarray(buf), out)
        return out

    def allgatherv(self, buf: np.ndarray, counts: Sequence[int], what: str = "allgatherv") -> np.ndarray:
        """Rank-ordered concatenation along axis 0 of every rank's ``buf``; ``counts``: rows per rank."""
        row = int(np.prod(buf.shape[1:], dtype=np.int64))
        out = np.empty((int(sum(counts)),) + buf.shape[1:], buf.dtype)
        sizes = [int(c) * row for c in counts]
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(int).tolist()
        with self._guard(what):
            self.comm.Allgatherv(np.ascontiguousarray(buf), [out, sizes, offsets, self.MPI._typedict[buf.dtype.char]])
        return out

    def allgather_obj(self, obj: Any, what: str = "allgather") -> list:
        with self._guard(what):
            return self.comm.allgather(obj)

    def bcast_obj(self, obj: Any, what: str = "broadcast") -> Any:
        with self._guard(what):
            return self.comm.bcast(obj, root=0)

    def scatter_obj(self, objs: Sequence | None, what: str = "scatter") -> Any:
        """Rank r gets ``objs[r]`` of rank 0 (the others pass None)."""
        with self._guard(what):
            return self.comm.scatter(objs, root=0)

    def gather_obj(self, obj: Any, what: str = "gather") -> list | None:
        """Rank 0 gets every rank's ``obj`` in rank order, the others None."""
        with self._guard(what):
            return self.comm.gather(obj, root=0)


def shard(indices: Sequence[int], rank: int, size: int):
    """Rank ``rank``'s contiguous part of ``indices``: sizes differ by at most one, the first ranks larger."""
    n = len(indices)
    start = rank * (n // size) + min(rank, n % size)
    return indices[start:start + n // size + (rank < n % size)]


@dataclass
class ReduceStats:
    """What the reduction moved and how long it waited, summed over steps (for benchmarks and the README)."""
    steps: int = 0
    seconds: float = 0.0          # in reduce(), waiting for slower ranks included
    wait_seconds: float = 0.0     # in the header allgather: mostly waiting for the slowest rank's backward
    dense_bytes: int = 0          # elements allreduced x itemsize (header excluded)
    gathered_bytes: int = 0       # bytes of sparse rows + indices all ranks contributed to allgathers
    sparse_paths: dict = field(default_factory=lambda: {"allgather": 0, "allreduce": 0})


class GradientReducer:
    """Sums per-rank gradients into the global batch's gradient (see the module docstring)."""

    def __init__(self, comm: Communicator, params: Mapping[str, Any], device=None, sparse: str = "auto"):
        if sparse not in SPARSE_MODES:
            raise DistributedError(f"train.distributed.sparse: {sparse!r} is not one of {', '.join(SPARSE_MODES)}")
        self.comm = comm
        self.params = dict(params)
        self.names = sorted(self.params)   # every rank packs in the same order
        self.device = device
        self.sparse = sparse
        self.stats = ReduceStats()

    def _to_device(self, a: np.ndarray):
        return self.device.asarray(a) if self.device is not None else a

    def reduce(self, grads: Mapping[str, Any], loss: float, weight: float, units: int) -> tuple[dict, float, int]:
        """(summed gradients, global loss, global units) from this rank's ``grads`` and ``loss`` of its shard,
        each multiplied by ``weight`` (its share of the global batch's samples) before the sum."""
        start = time.perf_counter()
        comm, names = self.comm, self.names
        local = {}
        header = np.empty(2 + len(names))
        header[0], header[1] = float(loss) * weight, units
        for j, name in enumerate(names):
            g = grads.get(name)
            if isinstance(g, RowSparse):
                g = RowSparse(to_host(g.indices).reshape(-1).astype(np.int64), to_host(g.rows),
                              tuple(g.shape)).coalesce()   # repeated rows summed here: fewer bytes to send
                header[2 + j] = len(g.indices)
            else:
                header[2 + j] = _NONE if g is None else _DENSE
                g = None if g is None else to_host(g)
            local[name] = g
        waited = time.perf_counter()
        headers = comm.allgather(header, "the gradient header allgather")
        self.stats.wait_seconds += time.perf_counter() - waited
        total_loss = float(headers[:, 0].sum())
        total_units = int(round(headers[:, 1].sum()))
        # What travels how: a parameter with a dense gradient on any rank goes dense; row-sparse everywhere
        # (or absent): allgather of rows or dense allreduce, by bytes; absent everywhere: nothing.
        dense_names, gather_names = [], []
        for j, name in enumerate(names):
            codes = headers[:, 2 + j]
            if (codes == _NONE).all():
                continue
            if (codes == _DENSE).any():
                dense_names.append((name, False))
                continue
            if self._gather(name, int(codes[codes >= 0].sum())):
                gather_names.append((name, j))
            else:
                dense_names.append((name, True))
        out: dict = {}
        by_dtype: dict = {}
        for name, touched in dense_names:
            by_dtype.setdefault(np.dtype(self.params[name].value.dtype), []).append((name, touched))
        for dtype, group in by_dtype.items():
            out.update(self._reduce_dense(dtype, group, local, weight))
        for name, j in gather_names:
            g = local[name]
            shape = tuple(self.params[name].value.shape)
            if g is None:
                g = RowSparse(np.zeros(0, np.int64), np.zeros((0,) + shape[1:], self.params[name].value.dtype), shape)
            counts = headers[:, 2 + j].clip(0).astype(np.int64)
            indices = comm.allgatherv(g.indices, counts, f"the row allgather of '{name}'")
            rows = comm.allgatherv(np.ascontiguousarray(g.rows * g.rows.dtype.type(weight)), counts,
                                   f"the row allgather of '{name}'")
            self.stats.gathered_bytes += indices.nbytes + rows.nbytes
            self.stats.sparse_paths["allgather"] += 1
            out[name] = RowSparse(self._to_device(indices), self._to_device(rows), shape)
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - start
        return out, total_loss, total_units

    def _gather(self, name: str, rows: int) -> bool:
        """Allgather the rows iff that receives fewer bytes per rank than a ring allreduce of the dense table
        plus its touch counts (2 (N-1)/N of the buffer, each way); forced by ``sparse``."""
        if self.sparse != "auto":
            return self.sparse == "allgather"
        value = self.params[name].value
        row_bytes = value.dtype.itemsize * int(np.prod(value.shape[1:], dtype=np.int64))
        n = self.comm.size
        gather = rows * (row_bytes + 8) * (n - 1) / n
        allreduce = 2 * (n - 1) / n * value.shape[0] * (row_bytes + value.dtype.itemsize)
        return gather < allreduce

    def _reduce_dense(self, dtype, group, local, weight) -> dict:
        """One flat buffer for every gradient of this dtype (plus a touch mark per row of densified
        row-sparse gradients, so the optimizer still sees which rows were looked up), one allreduce."""
        sizes = []
        for name, touched in group:
            value = self.params[name].value
            sizes.append(value.size + (value.shape[0] if touched else 0))
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        buf = np.zeros(int(offsets[-1]), dtype)
        for (name, touched), lo in zip(group, offsets):
            g = local[name]
            if g is None:
                continue
            value = self.params[name].value
            if touched:   # g is coalesced: unique indices
                buf[lo:lo + value.size].reshape(value.shape)[g.indices] = g.rows
                buf[lo + value.size + g.indices] = 1
            else:
                buf[lo:lo + value.size] = g.reshape(-1)
        if weight != 1:
            buf *= dtype.type(weight)   # the touch marks too: only their being nonzero matters
        self.comm.allreduce_(buf, f"the gradient allreduce ({dtype.name}, {buf.size:,} elements)")
        self.stats.dense_bytes += buf.nbytes
        out = {}
        for (name, touched), lo in zip(group, offsets):
            value = self.params[name].value
            g = buf[lo:lo + value.size].reshape(value.shape)
            if touched:
                self.stats.sparse_paths["allreduce"] += 1
                rows = np.flatnonzero(buf[lo + value.size:lo + value.size + value.shape[0]])
                out[name] = RowSparse(self._to_device(rows), self._to_device(g[rows]), tuple(value.shape))
            else:
                out[name] = self._to_device(g)
        return out


def digests(named_arrays: Mapping[str, Any]) -> np.ndarray:
    """One 64-bit BLAKE2b digest per array (bytes and shape), in the mapping's order."""
    out = np.empty(len(named_arrays), np.uint64)
    for i, a in enumerate(named_arrays.values()):
        host = np.ascontiguousarray(to_host(a))
        h = hashlib.blake2b(host.tobytes(), digest_size=8)
        h.update(repr((host.shape, host.dtype.str)).encode())
        out[i] = np.frombuffer(h.digest(), np.uint64)[0]
    return out


def _flat(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class DataParallel:
    """A :class:`~minicavs.train.trainer.Trainer`'s data parallelism: what its hooks call (trainer.py stays
    unaware of MPI). Construct once per trainer; every rank must make the same calls in the same order."""

    def __init__(self, trainer, comm: Communicator):
        self.trainer = trainer
        self.comm = comm
        settings = trainer.cfg["train"].get("distributed") or {}
        unknown = set(settings) - set(SETTINGS)
        if unknown:
            keys = ", ".join(f"train.distributed.{k}" for k in sorted(unknown))
            raise DistributedError(f"unknown config key(s) {keys}; known: {', '.join(SETTINGS)}")
        settings = {**SETTINGS, **settings}
        comm.timeout = float(settings["timeout"])
        self.digest_every = int(settings["digest_every"])
        self.check_config(trainer.cfg)
        self.reducer = GradientReducer(comm, trainer.params, trainer.model.device, settings["sparse"])

    @property
    def root(self) -> bool:
        return self.comm.rank == 0

    # --- at start ------------------------------------------------------------------------------------

    def check_config(self, cfg: Mapping) -> None:
        """Refuse to start unless every rank has the same config and data sizes (the config's path may differ)."""
        mine = _flat({k: v for k, v in cfg.items() if k not in ("config_path", "config_name")})
        mine = {k: json.dumps(v, sort_keys=True, default=str) for k, v in mine.items()}
        data = self.trainer.task.data
        mine["(data sizes)"] = json.dumps({k: len(v) for k, v in sorted(data.items()) if v is not None})
        everyone = self.comm.allgather_obj(mine, "the config check")
        problems = []
        for key in sorted(set().union(*everyone)):
            values = [d.get(key, "(missing)") for d in everyone]
            if len(set(values)) > 1:
                by_value: dict = {}
                for r, v in enumerate(values):
                    by_value.setdefault(v, []).append(r)
                problems.append(f"{key}: " + "; ".join(f"ranks {','.join(map(str, rs))} have {v}"
                                                       for v, rs in by_value.items()))
        if problems:
            raise DistributedError(f"rank {self.comm.rank}: the ranks' configs differ, refusing to start: "
                                   + " | ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))

    def sync_state(self) -> None:
        """Rank 0's parameters, optimizer state, epoch and early-stopping state to every rank (after rank 0
        alone read a checkpoint, or at start), then check every rank holds the same."""
        t = self.trainer
        state = None
        if self.root:
            opt = t.optimizer.state_dict()
            opt["slots"] = {n: {s: to_host(a) for s, a in got.items()} for n, got in opt["slots"].items()}
            state = {"params": {n: to_host(p.value) for n, p in t.params.items()}, "optimizer": opt,
                     "epoch": t.epoch, "early": dict(t.early)}
        state = self.comm.bcast_obj(state, "the state broadcast")
        if not self.root:
            for n, p in t.params.items():
                p.value[...] = array_module(p.value).asarray(state["params"][n])
            t.optimizer.load_state_dict(state["optimizer"])
            t.epoch = state["epoch"]
            t.early.update(state["early"])
        self.check_digests()

    def load(self, path, optimizer: bool = True) -> dict:
        """Rank 0 reads the checkpoint (the run directory need not be shared), every rank gets the state; an
        error reading it is raised on every rank."""
        extra, error = None, None
        if self.root:
            try:
                extra = self.trainer._load(path, optimizer)
            except (MinicavsError, OSError) as e:
                error = e
        extra, error = self.comm.bcast_obj((extra, error), "the checkpoint broadcast")
        if error is not None:
            raise error
        self.sync_state()
        return extra

    def bcast(self, value):
        return self.comm.bcast_obj(value)

    # --- every step ----------------------------------------------------------------------------------

    def loss_and_grads(self, idx: np.ndarray):
        """This rank's shard of global batch ``idx``: forward, backward, and the sum over ranks. Returns
        (Result with the global loss and gradients, units of the global batch)."""
        t = self.trainer
        if self.digest_every and t.optimizer.steps % self.digest_every == 0:
            self.check_digests()
        mine = shard(idx, self.comm.rank, self.comm.size)
        self.reducer.device = t.model.device
        samples = [t.task.data["train"][i] for i in mine]
        if len(samples):
            res = t.loss_and_grads(samples, sample_ids=mine)
            loss, units = res.loss, t.task.units(samples)
        else:   # more ranks than samples in this batch: contribute nothing
            from ..engine.model import Result
            res, loss, units = Result(0.0), 0.0, 0
        grads, res.loss, units = self.reducer.reduce(res.grads, loss, len(mine) / len(idx), units)
        res.grads = grads
        return res, units

    def check_digests(self) -> None:
        """Every parameter and optimizer slot bit-equal on every rank, else an error naming the first ones."""
        t = self.trainer
        named = {f"parameter '{n}'": p.value for n, p in t.params.items()}
        for n, got in t.optimizer.state.items():
            for s, a in got.items():
                named[f"optimizer slot '{s}' of parameter '{n}'"] = a
        table = self.comm.allgather(digests(named), "the parameter digest check")
        bad = np.flatnonzero((table != table[0]).any(axis=0))
        if len(bad):
            names = list(named)
            what = []
            for j in bad[:3]:
                ranks = np.flatnonzero(table[:, j] != table[0, j]).tolist()
                what.append(f"{names[j]} differs on rank(s) {ranks} from rank 0")
            raise DistributedError(f"rank {self.comm.rank}: the ranks' models diverged at step "
                                   f"{t.optimizer.steps}: " + "; ".join(what)
                                   + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""))

    # --- evaluation ----------------------------------------------------------------------------------

    def evaluate(self, samples: Sequence, batch_size: int) -> dict:
        """Each rank sums the statistics of its shard of ``samples``; the sums are added in rank order (the
        same bits on every rank) and turned into metrics over the whole split."""
        task = self.trainer.task
        if type(task).eval_sums is Task.eval_sums:   # a task with evaluate() only: every rank does it all
            return task.evaluate(samples, batch_size)
        mine = shard(samples, self.comm.rank, self.comm.size)
        sums = task.eval_sums(mine, batch_size) if len(mine) else None
        everyone = self.comm.allgather_obj(sums, "the evaluation reduction")
        total: dict = {}
        for got in everyone:
            for k, v in (got or {}).items():
                total[k] = total.get(k, 0.0) + v
        return task.eval_metrics(total, samples)
