"""The frontier policies' schedule of a batch as one C function (strings only; minicavs/cpu/frontier.py
compiles, loads, checks and wraps it): ED-Batch's Alg. 1 with the rule choosing the type at every step.

minicavs/frontier.py's numpy :class:`~minicavs.frontier.Frontier` stays the reference and the fallback: a
handful of numpy calls per step (a parent gather, ``subtract.at``, ``unique``, ``bincount``) cost 60-75 us
a step, 2-7 ms a batch of 64 samples, against 0.1-0.2 ms for ``cavs``'s one sort. Here a step costs what
it touches: the executed vertices' parent edges and one loop over the types.

One call runs the whole schedule: the parents CSR (counting sort of the children's), the pending child
counts, one ready list per type (linked through ``next``: a vertex joins its type's list when its last child
ran, and a step takes the whole list), and the rule:

- ``RULE_S1``/``RULE_S2``/``RULE_S3``: an FSM. The state (fsm.py's ``encode``) is a tuple of type ids,
  keyed as sum_i (s_i + 1) (T + 1)^i (T <= 14 keeps it in 63 bits); the table is open addressing (Fibonacci
  hash, linear probing, key 0 empty, at least one empty slot), built from the FSM's best type per state. A
  state not in the table takes its first type (fsm.py's fallback rule);
- ``RULE_AGENDA``: the ready type whose unexecuted vertices have the lowest average height (integer sums,
  divided in double as numpy divides its exact float sums; ties to the lower id);
- ``RULE_GREEDY``: the type with the largest ready / G[t]-frontier ratio (ties to the lower id); the
  typewise parents CSR and counts come from minicavs/frontier.py's ``typewise_children``.

Returns the number of tasks (the task of every vertex in ``task``, the type of every task in
``task_kind``), or ``ERR_STUCK`` when vertices are left but none is ready (a cycle), ``ERR_CHOICE`` when a
table names a type with no ready vertex, ``ERR_RULE`` for an unknown rule. Every index it follows is an
input the wrapper range-checked or one this function derived from those, so no input reaches memory
outside the buffers; a wrong table or inconsistent typewise counts can make a wrong schedule, never a wild
write (each vertex joins a ready list at most once: its pending count reaches zero once).
"""
from __future__ import annotations

RULES = {"S1": 0, "S2": 1, "S3": 2, "agenda": 3, "greedy": 4}
ERR_STUCK, ERR_CHOICE, ERR_RULE = -1, -2, -3
HASH_MULTIPLIER = 0x9E3779B97F4A7C15     # 2^64 / golden ratio (Fibonacci hashing)

DECLS = """
long frontier_schedule(long n, long T, long rule, const long *child_ptr, const long *child_idx,
                       const long *kind, const long *height, long table_bits,
                       const unsigned long long *table_key, const long *table_best, const long *tw_count,
                       const long *tw_pptr, const long *tw_pidx, long *scratch, long *task, long *task_kind);
"""

SOURCE = r"""
#include <stdint.h>

#define RULE_S1 0
#define RULE_S2 1
#define RULE_S3 2
#define RULE_AGENDA 3
#define RULE_GREEDY 4

/* the table's type for a state, or -1 (open addressing: key 0 marks an empty slot) */
static long fsm_lookup(uint64_t key, long bits, const unsigned long long *table_key, const long *table_best) {
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    uint64_t i = (key * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
    while (table_key[i]) {
        if (table_key[i] == key) return table_best[i];
        i = (i + 1) & mask;
    }
    return -1;
}

/* fsm.py's encode as a key, and the state's first type (the fallback) in *first */
static uint64_t fsm_state(long T, long encoding, const long *counts, long *state, long *first) {
    long len = 0;
    for (long t = 0; t < T; t++) {
        if (!counts[t]) continue;
        long at = len++;
        if (encoding == RULE_S3)        /* by count, most first; a stable insertion keeps ties by id */
            for (; at > 0 && counts[state[at - 1]] < counts[t]; at--) state[at] = state[at - 1];
        state[at] = t;
    }
    if (encoding == RULE_S2) {          /* plus the most frequent type (first of the largest counts) */
        long most = 0;
        for (long t = 1; t < T; t++) if (counts[t] > counts[most]) most = t;
        state[len++] = most;
    }
    uint64_t key = 0, scale = 1;
    for (long i = 0; i < len; i++) { key += (uint64_t)(state[i] + 1) * scale; scale *= (uint64_t)(T + 1); }
    *first = state[0];
    return key;
}

long frontier_schedule(long n, long T, long rule, const long *child_ptr, const long *child_idx,
                       const long *kind, const long *height, long table_bits,
                       const unsigned long long *table_key, const long *table_best, const long *tw_count,
                       const long *tw_pptr, const long *tw_pidx, long *scratch, long *task, long *task_kind) {
    if (rule < RULE_S1 || rule > RULE_GREEDY) return -3;
    const long edges = child_ptr[n];
    /* scratch: parent_ptr (n + 1), parent_idx (edges), pending, next, tw_pending (n each), then per type
       head, counts, depth_sum, left, tw_front, state (T + 1 each) */
    long *parent_ptr = scratch, *parent_idx = parent_ptr + n + 1, *pending = parent_idx + edges;
    long *next = pending + n, *tw_pending = next + n, *head = tw_pending + n, *counts = head + T + 1;
    long *depth_sum = counts + T + 1, *left = depth_sum + T + 1, *tw_front = left + T + 1;
    long *state = tw_front + T + 1;

    for (long v = 0; v <= n; v++) parent_ptr[v] = 0;
    for (long e = 0; e < edges; e++) parent_ptr[child_idx[e] + 1]++;
    for (long v = 0; v < n; v++) parent_ptr[v + 1] += parent_ptr[v];
    for (long v = 0; v < n; v++) pending[v] = parent_ptr[v];        /* fill cursors */
    for (long v = 0; v < n; v++)
        for (long e = child_ptr[v]; e < child_ptr[v + 1]; e++) parent_idx[pending[child_idx[e]]++] = v;

    for (long t = 0; t < T; t++) head[t] = -1, counts[t] = depth_sum[t] = left[t] = tw_front[t] = 0;
    for (long v = n - 1; v >= 0; v--) {
        pending[v] = child_ptr[v + 1] - child_ptr[v];
        if (!pending[v]) { next[v] = head[kind[v]]; head[kind[v]] = v; counts[kind[v]]++; }
        if (rule == RULE_AGENDA) { depth_sum[kind[v]] += height[v]; left[kind[v]]++; }
        if (rule == RULE_GREEDY) { tw_pending[v] = tw_count[v]; if (!tw_count[v]) tw_front[kind[v]]++; }
    }

    long remaining = n, tasks = 0;
    while (remaining) {
        long t = -1;
        if (rule == RULE_AGENDA) {
            double best = 0;
            for (long u = 0; u < T; u++) {
                if (!counts[u]) continue;
                double avg = (double)depth_sum[u] / (double)(left[u] > 1 ? left[u] : 1);
                if (t < 0 || avg < best) t = u, best = avg;
            }
        } else if (rule == RULE_GREEDY) {
            double best = -1;
            for (long u = 0; u < T; u++) {
                double ratio = (double)counts[u] / (double)(tw_front[u] > 1 ? tw_front[u] : 1);
                if (ratio > best) t = u, best = ratio;
            }
        } else {
            long any = 0;
            for (long u = 0; u < T; u++) any |= counts[u];
            if (!any) return -1;
            long first;
            uint64_t key = fsm_state(T, rule, counts, state, &first);
            t = fsm_lookup(key, table_bits, table_key, table_best);
            if (t < 0) t = first;
        }
        if (t < 0 || t >= T) return -1;
        if (!counts[t]) {
            for (long u = 0; u < T; u++) if (counts[u]) return -2;
            return -1;
        }
        long v = head[t];
        remaining -= counts[t];
        head[t] = -1;
        counts[t] = 0;
        while (v >= 0) {
            const long after = next[v];
            task[v] = tasks;
            for (long e = parent_ptr[v]; e < parent_ptr[v + 1]; e++) {
                const long p = parent_idx[e];
                if (--pending[p] == 0) { next[p] = head[kind[p]]; head[kind[p]] = p; counts[kind[p]]++; }
            }
            if (rule == RULE_AGENDA) { depth_sum[t] -= height[v]; left[t]--; }
            if (rule == RULE_GREEDY) {
                tw_front[t]--;
                for (long e = tw_pptr[v]; e < tw_pptr[v + 1]; e++)
                    if (--tw_pending[tw_pidx[e]] == 0) tw_front[t]++;
            }
            v = after;
        }
        task_kind[tasks++] = t;
    }
    return tasks;
}
"""


def scratch_size(n: int, edges: int, num_types: int) -> int:
    """Longs of scratch :data:`SOURCE`'s ``frontier_schedule`` uses (the layout is in its comment)."""
    return (n + 1) + edges + 3 * n + 6 * (num_types + 1)


def state_key(state: tuple, num_types: int) -> int:
    """The C key of an FSM state (a tuple of type ids): sum_i (s_i + 1) (T + 1)^i."""
    return sum((s + 1) * (num_types + 1) ** i for i, s in enumerate(state))
