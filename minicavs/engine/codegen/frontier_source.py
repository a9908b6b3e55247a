"""The frontier policies' schedule of a batch as one C function (strings only; minicavs/cpu/frontier_kernel.py
compiles, loads, checks and wraps it): ED-Batch's Alg. 1 with the rule choosing the type at every step.

minicavs/runtime/frontier.py's numpy :class:`~minicavs.runtime.frontier.Frontier` stays the reference and the
fallback: a handful of numpy calls per step (a parent gather, ``subtract.at``, ``unique``, ``bincount``) cost 60-75 us
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
  typewise parents CSR and counts come from ``frontier_typewise`` (minicavs/runtime/frontier.py's
  ``typewise_children`` in C, a second call: its near sets grow with the graph, so it allocates its own).

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
long frontier_typewise(long n, const long *child_ptr, const long *child_idx, const long *kind, long cap,
                       long *tw_count, long *tw_pptr, long *tw_pidx);
long frontier_schedule(long n, long T, long rule, const long *child_ptr, const long *child_idx,
                       const long *kind, const long *height, long table_bits,
                       const unsigned long long *table_key, const long *table_best, const long *tw_count,
                       const long *tw_pptr, const long *tw_pidx, long *scratch, long *task, long *task_kind);
"""

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

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

/* G[t] for every type at once (minicavs/runtime/frontier.py's typewise_children): children first (Kahn's
   order), near(u) = {u} plus the members of its children's near sets of another type than u's, and u's typewise
   children the members of its type, each once (a stamp per vertex). Writes each vertex's typewise child count, and the
   typewise parents as CSR when they fit ``cap`` entries. Returns the number of typewise edges (more than cap:
   call again with that much room), ERR_STUCK on a cycle, -4 when memory runs out. */
static int grow(long **buf, long *cap, long need) {
    if (need <= *cap) return 1;
    long c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    long *b = realloc(*buf, (size_t)c * sizeof(long));
    if (!b) return 0;
    *buf = b;
    *cap = c;
    return 1;
}

long frontier_typewise(long n, const long *child_ptr, const long *child_idx, const long *kind, long cap,
                       long *tw_count, long *tw_pptr, long *tw_pidx) {
    const long edges = child_ptr[n];
    long *pptr = malloc((size_t)(n + 1) * sizeof(long)), *pidx = malloc((size_t)(edges + 1) * sizeof(long));
    long *pending = malloc((size_t)(n + 1) * sizeof(long)), *queue = malloc((size_t)(n + 1) * sizeof(long));
    long *near_start = malloc((size_t)(n + 1) * sizeof(long)), *near_len = malloc((size_t)(n + 1) * sizeof(long));
    long *in_near = malloc((size_t)(n + 1) * sizeof(long)), *in_tw = malloc((size_t)(n + 1) * sizeof(long));
    long *near = NULL, *owner = NULL, *member = NULL, near_cap = 0, owner_cap = 0, member_cap = 0;
    long used = 0, tw_edges = 0, head = 0, tail = 0, result = -4;
    if (!pptr || !pidx || !pending || !queue || !near_start || !near_len || !in_near || !in_tw) goto done;
    for (long v = 0; v <= n; v++) pptr[v] = 0;
    for (long e = 0; e < edges; e++) pptr[child_idx[e] + 1]++;
    for (long v = 0; v < n; v++) pptr[v + 1] += pptr[v];
    for (long v = 0; v < n; v++) pending[v] = pptr[v];
    for (long v = 0; v < n; v++)
        for (long e = child_ptr[v]; e < child_ptr[v + 1]; e++) pidx[pending[child_idx[e]]++] = v;
    for (long v = 0; v < n; v++) {
        pending[v] = child_ptr[v + 1] - child_ptr[v];
        in_near[v] = in_tw[v] = -1;
        tw_count[v] = 0;
        if (!pending[v]) queue[tail++] = v;
    }
    while (head < tail) {
        const long u = queue[head++];
        near_start[u] = used;
        if (!grow(&near, &near_cap, used + 1)) goto done;
        near[used++] = u;
        in_near[u] = u;
        for (long e = child_ptr[u]; e < child_ptr[u + 1]; e++) {
            const long c = child_idx[e];
            for (long j = near_start[c]; j < near_start[c] + near_len[c]; j++) {
                const long m = near[j];
                if (kind[m] == kind[u]) {
                    if (in_tw[m] == u) continue;
                    in_tw[m] = u;
                    if (!grow(&owner, &owner_cap, tw_edges + 1) || !grow(&member, &member_cap, tw_edges + 1)) goto done;
                    owner[tw_edges] = u;
                    member[tw_edges++] = m;
                    tw_count[u]++;
                } else if (in_near[m] != u) {
                    in_near[m] = u;
                    if (!grow(&near, &near_cap, used + 1)) goto done;
                    near[used++] = m;
                }
            }
        }
        near_len[u] = used - near_start[u];
        for (long e = pptr[u]; e < pptr[u + 1]; e++)
            if (--pending[pidx[e]] == 0) queue[tail++] = pidx[e];
    }
    if (tail < n) { result = -1; goto done; }
    result = tw_edges;
    if (tw_edges > cap) goto done;
    for (long v = 0; v <= n; v++) tw_pptr[v] = 0;
    for (long k = 0; k < tw_edges; k++) tw_pptr[member[k] + 1]++;
    for (long v = 0; v < n; v++) tw_pptr[v + 1] += tw_pptr[v];
    for (long v = 0; v < n; v++) pending[v] = tw_pptr[v];
    for (long k = 0; k < tw_edges; k++) tw_pidx[pending[member[k]]++] = owner[k];
done:
    free(pptr); free(pidx); free(pending); free(queue); free(near_start); free(near_len); free(in_near);
    free(in_tw); free(near); free(owner); free(member);
    return result;
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
