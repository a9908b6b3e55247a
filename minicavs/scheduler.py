"""Batching policies (§3.2): a policy turns a batch into a list of tasks before anything runs.

A :class:`Schedule` is plain arrays: ``order`` lists the vertices task by task, ``task_ptr`` delimits the
tasks. Backward replays the same tasks in reverse (Alg. 1's task stack). Policies are small objects with a
``schedule(batch)`` method; later ones (depth-based, agenda-based, learned) plug in the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

    def backward_tasks(self) -> range:
        """Task indices in the order backward runs them: the forward stack popped."""
        return range(self.num_tasks - 1, -1, -1)


def _from_keys(batch: Batch, order: np.ndarray, task_key: np.ndarray) -> Schedule:
    """Build a schedule from vertices already sorted so that equal ``task_key`` values are adjacent."""
    n = len(order)
    starts = np.flatnonzero(np.concatenate(([True], task_key[1:] != task_key[:-1]))) if n else np.zeros(0, int)
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


class CavsPolicy(Policy):
    """Cavs: task t holds every vertex whose children are all evaluated, i.e. the vertices of height t,
    one task per kind (in kind id order). Inside a task vertices are sorted by their sample's height
    (tallest first), then sample, then local id: chains sorted by length then continue as a prefix of the
    previous task, and siblings of complete trees sit side by side, so gathers become views (memory.py)."""

    name = "cavs"

    def schedule(self, batch: Batch) -> Schedule:
        tall = np.zeros(len(batch.graphs), np.int64)
        np.maximum.at(tall, batch.sample, batch.height)
        order = np.lexsort((batch.local, batch.sample, -tall[batch.sample], batch.kind, batch.height))
        key = batch.height[order] * len(batch.kind_names) + batch.kind[order]
        return _from_keys(batch, order, key)


class SerialPolicy(Policy):
    """One vertex per task, sample by sample, children before parents: the reference for checks."""

    name = "serial"

    def schedule(self, batch: Batch) -> Schedule:
        order = np.lexsort((batch.local, batch.height, batch.sample))
        return _from_keys(batch, order, np.arange(len(order)))


POLICIES: dict[str, type] = {"cavs": CavsPolicy, "serial": SerialPolicy}


def get_policy(policy: str | Policy) -> Policy:
    if isinstance(policy, Policy):
        return policy
    try:
        return POLICIES[policy]()
    except KeyError:
        raise ValueError(f"unknown batching policy {policy!r}; choose one of {sorted(POLICIES)}") from None
