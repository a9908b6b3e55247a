"""ED-Batch's learned batching policy: a finite state machine over "which types are on the frontier".

At each step the frontier is encoded as a state (one of three encodings), and the type to run is read from a
table: a dict lookup, constant time per step. The table is learned per model by tabular Q-learning on sample
batches (ED-Batch §2.3; the authors' ``dynet/ooc-scheduler.cc`` was read for the update rule, not copied):

- encodings: ``S1`` the types with ready vertices (by id); ``S2`` S1 plus the most frequent of them; ``S3``
  the types sorted by how many ready vertices each has, most first (ties by id);
- reward of running type a (Eq. 1): ``-1 + ready(a) / |frontier of G[a]|``; the -1 counts batches, the ratio
  is 1 exactly when Lemma 1 says an optimal sequence may start with a;
- 10-step returns, learning rate 0.4, gamma 1, Q = 0 initially; epsilon-greedy exploration with epsilon
  0.5 x 0.9 per episode down to 0.05; at most 1000 episodes; every 50 the greedy policy is run on all sample
  batches, the best table so far kept (the empty table, i.e. the fallback rule below, is the first
  candidate), and learning stops once it needs at most 1.01 x the lower bound.

A state never seen in learning falls back to a fixed rule: the first type of the state (S3: the type with
the most ready vertices; S1/S2: the lowest type id), which is also what a fresh all-zero entry would pick.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..core import atomic
from .frontier import Frontier, TypedGraph, native_schedule, run_policy

ENCODINGS = ("S1", "S2", "S3")


def encode(counts: np.ndarray, encoding: str) -> tuple[int, ...]:
    """The state of a frontier from its ready count per type."""
    present = [t for t, c in enumerate(counts.tolist()) if c]
    if encoding == "S1":
        return tuple(present)
    if encoding == "S2":
        return tuple(present) + (int(np.argmax(counts)),)
    if encoding == "S3":
        c = counts.tolist()
        return tuple(sorted(present, key=lambda t: -c[t]))
    raise ValueError(f"unknown FSM state encoding {encoding!r}; choose one of {ENCODINGS}")


def actions(state: tuple[int, ...], encoding: str) -> tuple[int, ...]:
    """The types a state lets the policy choose: those with ready vertices."""
    return state[:-1] if encoding == "S2" else state


@dataclass
class Fsm:
    """A learned table: state -> Q value per action; ``choose`` is a dict lookup."""

    encoding: str
    kind_names: tuple
    q: dict = field(default_factory=dict)       # state tuple -> list of Q values, aligned with actions(state)
    stats: dict = field(default_factory=dict)   # how it was learned (episodes, seconds, batches, bound)

    def __post_init__(self):
        encode(np.zeros(1, np.int64), self.encoding)   # validates the encoding
        self.kind_names = tuple(self.kind_names)
        self.freeze()

    def freeze(self) -> None:
        """Precompute state -> best type, so applying the FSM is one lookup per step."""
        self.best = {s: actions(s, self.encoding)[int(np.argmax(q))] for s, q in self.q.items()}
        self._native_table = None    # the native kernel's form of ``best``, made on first use

    def set_best(self, best: dict) -> None:
        """Run ``best`` (state -> type) instead of what ``q`` says: a table searched for, not learned."""
        self.best = dict(best)
        self._native_table = None

    def choose(self, frontier: Frontier) -> int:
        state = encode(frontier.counts, self.encoding)
        best = self.best.get(state)
        return state[0] if best is None else best

    def schedule(self, graph: TypedGraph, native: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(task of every vertex, kind of every task), the FSM choosing every step: in one native call where
        a backend provides one (the same schedule), else with :class:`Frontier` and :meth:`choose`."""
        kernel = native_schedule() if native else None
        if kernel is not None and graph.num_types <= kernel.max_fsm_types:
            if self._native_table is None or self._native_table.num_types != graph.num_types:
                self._native_table = kernel.table(self.best, graph.num_types)
            return kernel.schedule(self.encoding, graph.child_ptr, graph.child_idx, graph.kind, graph.num_types,
                                   table=self._native_table)
        return run_policy(Frontier(graph), self.choose)


    # --- files: a small JSON document ---------------------------------------------------------------

    def to_json(self) -> dict:
        return {"format": "minicavs-fsm", "version": 1, "encoding": self.encoding,
                "kind_names": list(self.kind_names), "stats": self.stats,
                "q": [[list(s), [float(x) for x in q]] for s, q in sorted(self.q.items())]}

    @classmethod
    def from_json(cls, doc: dict) -> "Fsm":
        if not isinstance(doc, dict) or doc.get("format") != "minicavs-fsm":
            raise ValueError("not a minicavs FSM document (format 'minicavs-fsm')")
        enc, names = doc["encoding"], tuple(doc["kind_names"])
        q = {}
        for state, values in doc["q"]:
            state = tuple(int(t) for t in state)
            acts = actions(state, enc) if state else ()
            if not acts or len(values) != len(acts) or any(not 0 <= t < len(names) for t in state):
                raise ValueError(f"FSM entry {state}: {len(values)} Q values for actions {acts} of "
                                 f"{len(names)} kinds")
            q[state] = [float(x) for x in values]
        return cls(enc, names, q, dict(doc.get("stats", {})))

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Fsm":
        with open(path) as f:
            return cls.from_json(json.load(f))


def write_json(path: str | os.PathLike, doc: dict) -> None:
    """Atomically (:mod:`minicavs.core.atomic`): a crash leaves the old file or the new."""
    atomic.write_text(path, json.dumps(doc, indent=1))


@dataclass(frozen=True)
class Hyper:
    """ED-Batch's tabular Q-learning settings: n-step returns, learning rate, epsilon schedule, the episode
    budget and when learning stops."""

    episodes: int = 1000
    n_step: int = 10
    alpha: float = 0.4
    gamma: float = 1.0
    eps_start: float = 0.5
    eps_decay: float = 0.9
    eps_min: float = 0.05
    check_every: int = 50
    stop_ratio: float = 1.01


def episode(graph: TypedGraph, q: dict, encoding: str, eps: float, rng: np.random.Generator) -> list:
    """One epsilon-greedy run over ``graph``; (state, action index, reward) per step."""
    frontier = Frontier(graph, track_typewise=True)
    log = []
    while frontier.left:
        state = encode(frontier.counts, encoding)
        acts = actions(state, encoding)
        values = q.get(state)
        if values is None:
            values = q[state] = [0.0] * len(acts)
        a = int(rng.integers(len(acts))) if rng.random() < eps else int(np.argmax(values))
        t = acts[a]
        reward = -1.0 + frontier.counts[t] / frontier.tw_front[t]
        frontier.run(t)
        log.append((state, a, reward))
    return log


def update(q: dict, log: list, hp: Hyper) -> None:
    """n-step Q-learning over one episode's log, front to back (the bootstrap reads the current table)."""
    L = len(log)
    for i in range(L):
        J = min(i + hp.n_step, L)
        g = 0.0 if J == L else max(q[log[J][0]])
        for j in range(J - 1, i - 1, -1):
            g = g * hp.gamma + log[j][2]
        state, a, _ = log[i]
        q[state][a] += hp.alpha * (g - q[state][a])


def learn(graphs: Sequence[TypedGraph], kind_names: Sequence[str], encoding: str = "S3",
          hp: Hyper = Hyper(), seed: int = 0) -> Fsm:
    """Learn an FSM on sample batches (episodes cycle through them). Its ``stats`` say how it went."""
    if not graphs:
        raise ValueError("learning an FSM needs at least one sample batch")
    start = time.perf_counter()
    rng = np.random.default_rng([seed, 18])
    bound = sum(g.lower_bound() for g in graphs)
    q: dict = {}
    # the all-zero table (every state takes its fallback) is the first candidate: learning keeps a table only
    # if the greedy check finds it better on the sample batches
    best, eps, done = {}, hp.eps_start, 0
    best_batches = sum(len(Fsm(encoding, kind_names, {}).schedule(g)[1]) for g in graphs)
    for ep in range(hp.episodes):
        update(q, episode(graphs[ep % len(graphs)], q, encoding, eps, rng), hp)
        eps = max(hp.eps_min, eps * hp.eps_decay)
        done = ep + 1
        if done % hp.check_every == 0 or done == hp.episodes:
            fsm = Fsm(encoding, kind_names, q)
            batches = sum(len(fsm.schedule(g)[1]) for g in graphs)
            if batches < best_batches:
                best, best_batches = {s: list(v) for s, v in q.items()}, batches
            if best_batches <= hp.stop_ratio * bound:
                break
    stats = {"episodes": done, "seconds": time.perf_counter() - start, "batches": best_batches,
             "lower_bound": bound, "samples": len(graphs), "states": len(best)}
    return Fsm(encoding, kind_names, best, stats)
