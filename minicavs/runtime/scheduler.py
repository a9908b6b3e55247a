"""Batching policies (§3.2): a policy turns a batch into a list of tasks before anything runs.

A :class:`Schedule` is plain arrays: ``order`` lists the vertices task by task, ``task_ptr`` delimits the
tasks. Backward replays the same tasks in reverse (Alg. 1's task stack). Policies are small objects with a
``schedule(batch)`` method, chosen by name (``train.policy``):

- ``cavs`` (alias ``depth``, TF Fold's and DyNet's depth-based batching): one task per height and kind;
- ``agenda`` (DyNet): the ready kind whose unexecuted vertices have the lowest average depth;
- ``greedy``: the kind maximising ED-Batch's Eq. 1 ratio (its sufficient condition for optimal batching);
- ``fsm``: ED-Batch's learned finite state machine (:mod:`minicavs.runtime.fsm`);
- ``serial``: one vertex per task, the reference for checks.

The frontier policies (agenda, greedy, fsm) run :mod:`minicavs.runtime.frontier`'s simulation of Alg. 1; every
policy orders the vertices inside a task the same way (see :class:`CavsPolicy`), so gathers stay views.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..core.onetime import one_time
from . import fsm as fsm_module
from .frontier import TypedGraph, run_agenda, run_greedy
from .inputs import Batch


@dataclass
class Schedule:
    order: np.ndarray      # (N,) global vertex ids in execution order, task-major
    task_ptr: np.ndarray   # (T+1,) task t runs order[task_ptr[t]:task_ptr[t+1]]
    task_kind: np.ndarray  # (T,) kind id of the vertices of task t
    row: np.ndarray        # (N,) position of each vertex in ``order``

    @property
    def num_tasks(self) -> int:
        return len(self.task_ptr) - 1

    def task(self, t: int) -> np.ndarray:
        return self.order[self.task_ptr[t]:self.task_ptr[t + 1]]

    def sizes(self) -> np.ndarray:
        return np.diff(self.task_ptr)



def _from_keys(batch: Batch, order: np.ndarray, task_key: np.ndarray) -> Schedule:
    """Build a schedule from vertices already sorted so that equal ``task_key`` values are adjacent."""
    n = len(order)
    starts = np.concatenate(([0], (task_key[1:] != task_key[:-1]).nonzero()[0] + 1)) if n else np.zeros(0, int)
    ptr = np.concatenate((starts, [n])).astype(np.int64)
    row = np.empty(n, np.int64)
    row[order] = np.arange(n, dtype=np.int64)
    return Schedule(order.astype(np.int64), ptr, batch.kind[order[starts]], row)


class Policy:
    """Base class: ``schedule(batch)`` returns the tasks; every vertex's children in earlier tasks."""

    name = "policy"

    def schedule(self, batch: Batch) -> Schedule:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} '{self.name}'>"


def _in_task_order(batch: Batch, task: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vertices sorted by task, and inside a task by their sample's height (tallest first), then sample,
    then local id: chains sorted by length then continue as a prefix of the previous task, and siblings of
    complete trees sit side by side, so gathers become views (memory.py)."""
    tall = np.zeros(len(batch.graphs), np.int64)
    np.maximum.at(tall, batch.sample, batch.height)
    order = np.lexsort((batch.local, batch.sample, -tall[batch.sample], task))
    return order, task[order]


def _one_kind(batch: Batch) -> bool:
    """Whether every frontier policy runs cavs's schedule, so it is returned without a frontier run: with one
    kind, the vertices run level by level; with a leaf kind (exactly the childless vertices) and one other
    kind, the leaves are all that is ready first, and the other kind all that is left after them."""
    if batch.num_vertices == 0 or bool(np.all(batch.kind == batch.kind[0])):
        return True
    childless = batch.num_children() == 0
    kinds = len(batch.kind_names)     # bincount, not unique: no sort (this runs on every batch)
    leaf = np.bincount(batch.kind[childless], minlength=kinds) > 0
    other = np.bincount(batch.kind[~childless], minlength=kinds) > 0
    return int(leaf.sum()) == 1 and int(other.sum()) == 1 and not bool((leaf & other).any())


class CavsPolicy(Policy):
    """Cavs: task t holds every vertex whose children are all evaluated, i.e. the vertices of height t,
    one task per kind (in kind id order)."""

    name = "cavs"

    def schedule(self, batch: Batch) -> Schedule:
        return _from_keys(batch, *_in_task_order(batch, batch.height * len(batch.kind_names) + batch.kind))


class AgendaPolicy(Policy):
    """DyNet's agenda-based batching (:func:`minicavs.runtime.frontier.run_agenda`)."""

    name = "agenda"

    def schedule(self, batch: Batch) -> Schedule:
        if _one_kind(batch):
            return CavsPolicy().schedule(batch)
        task, _ = run_agenda(TypedGraph.of(batch))
        return _from_keys(batch, *_in_task_order(batch, task))


class GreedyPolicy(Policy):
    """The kind with the largest Eq. 1 ratio next (:func:`minicavs.runtime.frontier.greedy_choice`); it builds
    ED-Batch's G[t] per batch, the cost the FSM avoids."""

    name = "greedy"

    def schedule(self, batch: Batch) -> Schedule:
        if _one_kind(batch):
            return CavsPolicy().schedule(batch)
        task, _ = run_greedy(TypedGraph.of(batch))
        return _from_keys(batch, *_in_task_order(batch, task))


class FsmPolicy(Policy):
    """ED-Batch's learned FSM, one per set of kind names (one per structure of a model).

    ``learn(batches)`` learns it on sample batches (the trainer does so before training); a batch whose
    kinds have no FSM yet learns one on that batch first, as ED-Batch does on its first graph."""

    name = "fsm"

    @property
    def learned(self) -> bool:
        return bool(self.fsms)

    def __init__(self, fsms: dict | None = None, encoding: str = "S3", hyper: fsm_module.Hyper | None = None,
                 seed: int = 0):
        fsm_module.encode(np.zeros(1, np.int64), encoding)
        self.encoding, self.hyper, self.seed = encoding, hyper or fsm_module.Hyper(), seed
        self.fsms: dict[tuple, fsm_module.Fsm] = dict(fsms or {})

    def learn(self, batches) -> fsm_module.Fsm:
        batches = list(batches)
        names = batches[0].kind_names
        if any(b.kind_names != names for b in batches):
            raise ValueError("FSM sample batches must share their kind names")
        with one_time(f"learning the FSM batching policy for kinds {', '.join(names)} (once per run)"):
            self.fsms[names] = fsm_module.learn([TypedGraph.of(b) for b in batches], names, self.encoding,
                                                self.hyper, self.seed)
        return self.fsms[names]

    def schedule(self, batch: Batch) -> Schedule:
        if _one_kind(batch):
            return CavsPolicy().schedule(batch)
        fsm = self.fsms.get(batch.kind_names) or self.learn([batch])
        task, _ = fsm.schedule(TypedGraph.of(batch))
        return _from_keys(batch, *_in_task_order(batch, task))

    def to_json(self) -> dict:
        return {"format": "minicavs-fsm-policy", "encoding": self.encoding,
                "fsms": [f.to_json() for f in self.fsms.values()]}

    @classmethod
    def from_json(cls, doc: dict) -> "FsmPolicy":
        if not isinstance(doc, dict) or doc.get("format") != "minicavs-fsm-policy":
            raise ValueError("not a minicavs FSM policy document (format 'minicavs-fsm-policy')")
        fsms = [fsm_module.Fsm.from_json(d) for d in doc["fsms"]]
        return cls({f.kind_names: f for f in fsms}, doc["encoding"])

    def save(self, path) -> None:
        fsm_module.write_json(path, self.to_json())

    @classmethod
    def load(cls, path) -> "FsmPolicy":
        with open(path) as f:
            return cls.from_json(json.load(f))


class SerialPolicy(Policy):
    """One vertex per task, sample by sample, children before parents: the reference for checks."""

    name = "serial"

    def schedule(self, batch: Batch) -> Schedule:
        order = np.lexsort((batch.local, batch.height, batch.sample))
        return _from_keys(batch, order, np.arange(len(order)))


POLICIES: dict[str, type] = {"cavs": CavsPolicy, "depth": CavsPolicy, "agenda": AgendaPolicy,
                             "greedy": GreedyPolicy, "fsm": FsmPolicy, "serial": SerialPolicy}


def depends_on_batch_only(policy: Policy) -> bool:
    """Whether ``policy``'s schedule is a function of the batch alone (no learned or other state), so a
    batch of the same graphs may reuse it (Model's plan cache). Exact types: a subclass may add state."""
    return type(policy) in (CavsPolicy, AgendaPolicy, GreedyPolicy, SerialPolicy)


def policy_names() -> tuple:
    """Every name :func:`get_policy` accepts (``fsm:S1`` ... name an FSM's state encoding)."""
    return tuple(POLICIES) + tuple(f"fsm:{e}" for e in fsm_module.ENCODINGS)


def lower_bound(batch: Batch) -> int:
    """ED-Batch's lower bound (A.3) on the number of tasks of any policy for this batch."""
    return TypedGraph.of(batch).lower_bound()


def get_policy(policy: str | Policy) -> Policy:
    """A policy by name; ``fsm`` uses encoding S3, ``fsm:S1`` / ``fsm:S2`` / ``fsm:S3`` name one."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy.startswith("fsm:"):
        if policy[4:] not in fsm_module.ENCODINGS:
            raise ValueError(f"unknown FSM state encoding in policy {policy!r}; choose one of "
                             + ", ".join(f"fsm:{e}" for e in fsm_module.ENCODINGS))
        return FsmPolicy(encoding=policy[4:])
    try:
        return POLICIES[policy]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown batching policy {policy!r}; choose one of {sorted(POLICIES)} "
                         f"(or fsm:S1, fsm:S2, fsm:S3)") from None
