"""The C source of a batch's preparation in one call (cpu/planner_library.py compiles it, minicavs/engine/planner.py
unpacks what it makes): flatten K input graphs, check them, find every vertex's parents, height and kind, schedule the
vertices by height and kind (the cavs policy) and lay out the memory plan's index arrays. It does what
inputs.make_batch, model.Structure.batch, scheduler.CavsPolicy and memory.plan_memory do together, which stay
the reference: at batch size 1 their ~70 numpy calls, not the vertices, were the cost (~200 us of a ~700 us
Tree-LSTM inference).

Every index the C code follows is checked before it is used (child pointers, child ids, kind ids, arities);
any input the reference would refuse makes it return a nonzero code and write nothing outside its outputs,
and the caller then runs the reference, which raises the error that names the sample and the vertex.
"""
from __future__ import annotations

# Error codes (the reference path explains each one to the user).
CODES = {1: "empty graph", 2: "bad child pointers", 3: "child id out of range", 4: "self-loop", 5: "cycle",
         6: "more children than the arity", 7: "kind without a vertex function", 8: "bad sizes"}

SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef int64_t i64;
typedef uint64_t u64;

/* Inputs: K graphs of sizes[k] vertices and edges[k] child ids; ptr_all holds their child pointers one after
   the other (sizes[k] + 1 each), idx_all their local child ids. Kinds: kind_mode 0, every vertex kind 0 (the
   only vertex function); 1, kind leaf_kind without children, internal_kind with. arity[nk]; uses[nnames * nk]:
   whether kind k pulls or pushes name m.
   Outputs (int64 unless said): offsets[K+1], sample[n], local[n], child_ptr[n+1], child_idx[E],
   parent_ptr[n+1], parent_idx[E], height[n], kind[n], order[n], row[n], task_ptr[n+1] (first T+1 used),
   tasks[4n] (per task: kind, kind offset, rows, scatter offset; first 4T used), kind_n[nk], kind_t[nk],
   verts[n] (kind-major: each kind's vertices in task order), task_of_kind[n] (kind-major task ids), task_off[n]
   (kind-major: each of those tasks' kind offset), child_rows[n*maxa] (kind-major: arity[k] slots of n_k rows),
   views[2n*maxa] (kind-major: a (T_k, 2 arity[k]) table of start and step per task and slot), keys[n] (u64,
   kind-major), name_rows[nnames*n] (kind-major: rank of the vertex among the name's users; -1 where its kind
   does not use it), name_order[nnames*n] (the users' global ids, ascending), name_count[nnames], scalars[3]
   (T, forest, max height), ttable[n * (5 + 2 maxa)] (the native task table, first T rows), gcopy[nk * maxa] (per
   kind and slot: rows of the tasks whose child rows are no view). scratch: 4n + 2K + 2 + (n + 3) nk int64.
   Returns 0, or the code of the first check that failed (codegen/planner_source.py CODES); then the outputs are
junk. */ static i64 prepare(i64 K, const i64 *sizes, const i64 *edges, const i64 *ptr_all, const i64 *idx_all, i64
               n, i64 E, i64 kind_mode, i64 leaf_kind, i64 internal_kind, i64 nk, const i64 *arity, i64 maxa,
               const u64 *sample_ids, i64 nnames, const unsigned char *uses,
               i64 *offsets, i64 *sample, i64 *local, i64 *child_ptr, i64 *child_idx, i64 *pptr, i64 *pidx,
               i64 *height, i64 *kind, i64 *order, i64 *row, i64 *task_ptr, i64 *tasks, i64 *kind_n,
               i64 *kind_t, i64 *verts, i64 *task_of_kind, i64 *task_off, i64 *child_rows, i64 *views, i64 *key_out,
               i64 *name_rows, i64 *name_order, i64 *name_count, i64 *scalars, i64 *ttable, i64 *gcopy,
               i64 *scratch) {
    u64 *keys = (u64 *)key_out;
    if (K < 1 || n < 1 || E < 0 || nk < 1 || maxa < 0 || nnames < 0) return 8;
    for (i64 k = 0; k < nk; k++) if (arity[k] < 0 || arity[k] > maxa) return 8;
    if (kind_mode != 0 && kind_mode != 1) return 8;
    if (kind_mode == 1 && (leaf_kind < 0 || leaf_kind >= nk || internal_kind < 0 || internal_kind >= nk)) return 7;
    {   /* the sizes add up to the buffers' lengths */
        i64 sn = 0, se = 0;
        for (i64 k = 0; k < K; k++) {
            if (sizes[k] < 1) return 1;
            if (edges[k] < 0) return 8;
            sn += sizes[k]; se += edges[k];
            if (sn > n || se > E) return 8;
        }
        if (sn != n || se != E) return 8;
    }
    /* 1. per graph: pointers start at 0, never decrease, end at its edge count (checked before any is followed);
       child ids in range and not the vertex itself */
    i64 pos = 0, v0 = 0, e0 = 0;
    offsets[0] = 0;
    for (i64 k = 0; k < K; k++) {
        const i64 s = sizes[k], ek = edges[k];
        const i64 *p = ptr_all + pos;
        if (p[0] != 0 || p[s] != ek) return 2;
        for (i64 v = 0; v < s; v++) if (p[v + 1] < p[v]) return 2;
        for (i64 v = 0; v < s; v++) {
            const i64 g = v0 + v;
            sample[g] = k; local[g] = v; child_ptr[g] = e0 + p[v];
            for (i64 e = p[v]; e < p[v + 1]; e++) {
                const i64 c = idx_all[e0 + e];
                if (c < 0 || c >= s) return 3;
                if (c == v) return 4;
                child_idx[e0 + e] = v0 + c;
            }
        }
        pos += s + 1; v0 += s; e0 += ek;
        offsets[k + 1] = v0;
    }
    child_ptr[n] = E;
    /* 2. the parents CSR (stable: each vertex's parents in edge order) */
    i64 *cursor = scratch, *pending = scratch + n, *best = scratch + 2 * n, *queue = scratch + 3 * n;
    memset(pptr, 0, (size_t)(n + 1) * sizeof(i64));
    for (i64 e = 0; e < E; e++) pptr[child_idx[e] + 1]++;
    for (i64 v = 0; v < n; v++) pptr[v + 1] += pptr[v];
    memcpy(cursor, pptr, (size_t)n * sizeof(i64));
    i64 forest = 1;
    for (i64 v = 0; v < n; v++) {
        for (i64 e = child_ptr[v]; e < child_ptr[v + 1]; e++) pidx[cursor[child_idx[e]]++] = v;
        if (pptr[v + 1] - pptr[v] > 1) forest = 0;
    }
    /* 3. heights, level by level from the childless vertices (Kahn); a vertex never reached lies on a cycle */
    i64 head = 0, tail = 0, maxh = 0;
    for (i64 v = 0; v < n; v++) {
        pending[v] = child_ptr[v + 1] - child_ptr[v];
        best[v] = 0;
        height[v] = -1;
        if (!pending[v]) { height[v] = 0; queue[tail++] = v; }
    }
    while (head < tail) {
        const i64 v = queue[head++];
        for (i64 e = pptr[v]; e < pptr[v + 1]; e++) {
            const i64 p = pidx[e];
            if (height[v] + 1 > best[p]) best[p] = height[v] + 1;
            if (--pending[p] == 0) { height[p] = best[p]; queue[tail++] = p; if (best[p] > maxh) maxh = best[p]; }
        }
    }
    if (tail != n) return 5;
    /* 4. kinds and arities */
    for (i64 v = 0; v < n; v++) {
        const i64 nch = child_ptr[v + 1] - child_ptr[v];
        kind[v] = kind_mode == 0 ? 0 : (nch ? internal_kind : leaf_kind);
        if (nch > arity[kind[v]]) return 6;
    }
    /* 5. the cavs schedule: by task key (height, kind), then the sample's height (tallest first), sample, local id
       (scheduler._in_task_order): counting sorts, samples visited tallest first */
    i64 *tall = scratch + 4 * n, *sample_order = tall + K, *bucket = sample_order + K + 1;
    const i64 nkeys = (maxh + 1) * nk;
    for (i64 k = 0; k < K; k++) tall[k] = 0;
    for (i64 v = 0; v < n; v++) if (height[v] > tall[sample[v]]) tall[sample[v]] = height[v];
    memset(bucket, 0, (size_t)(maxh + 2) * sizeof(i64));
    for (i64 k = 0; k < K; k++) bucket[maxh - tall[k] + 1]++;
    for (i64 h = 0; h <= maxh; h++) bucket[h + 1] += bucket[h];
    for (i64 k = 0; k < K; k++) sample_order[bucket[maxh - tall[k]]++] = k;
    memset(bucket, 0, (size_t)(nkeys + 1) * sizeof(i64));
    for (i64 v = 0; v < n; v++) bucket[height[v] * nk + kind[v] + 1]++;
    for (i64 q = 0; q < nkeys; q++) bucket[q + 1] += bucket[q];
    i64 T = 0;
    for (i64 q = 0; q < nkeys; q++)
        if (bucket[q + 1] > bucket[q]) {
            task_ptr[T] = bucket[q];
            tasks[4 * T] = q % nk;
            tasks[4 * T + 2] = bucket[q + 1] - bucket[q];
            tasks[4 * T + 3] = bucket[q];
            T++;
        }
    task_ptr[T] = n;
    for (i64 r = 0; r < K; r++) {
        const i64 k = sample_order[r];
        for (i64 v = offsets[k]; v < offsets[k + 1]; v++) order[bucket[height[v] * nk + kind[v]]++] = v;
    }
    for (i64 i = 0; i < n; i++) row[order[i]] = i;
    /* 6. per kind: vertices in task order, tasks and their kind offsets (memory.plan_memory) */
    i64 *kstart = bucket, *tstart = bucket + nk, *fill = bucket + 2 * nk;   /* (bucket is free again) */
    for (i64 k = 0; k < nk; k++) kind_n[k] = kind_t[k] = 0;
    for (i64 v = 0; v < n; v++) kind_n[kind[v]]++;
    for (i64 t = 0; t < T; t++) kind_t[tasks[4 * t]]++;
    kstart[0] = tstart[0] = 0;
    for (i64 k = 0; k + 1 < nk; k++) { kstart[k + 1] = kstart[k] + kind_n[k]; tstart[k + 1] = tstart[k] + kind_t[k]; }
    for (i64 k = 0; k < nk * maxa; k++) gcopy[k] = 0;
    for (i64 k = 0; k < nk; k++) fill[k] = 0;
    for (i64 i = 0; i < n; i++) { const i64 k = kind[order[i]]; verts[kstart[k] + fill[k]++] = order[i]; }
    for (i64 k = 0; k < nk; k++) fill[k] = 0;
    for (i64 t = 0; t < T; t++) {
        const i64 k = tasks[4 * t];
        tasks[4 * t + 1] = fill[k];
        fill[k] += tasks[4 * t + 2];
    }
    for (i64 k = 0; k < nk; k++) fill[k] = 0;
    for (i64 t = 0; t < T; t++) {
        const i64 k = tasks[4 * t];
        task_of_kind[tstart[k] + fill[k]] = t;
        task_off[tstart[k] + fill[k]] = tasks[4 * t + 1];
        fill[k]++;
    }
    /* child rows and their strided views per kind and slot (memory._strided_arrays), row keys */
    i64 cbase = 0, vbase = 0;
    for (i64 k = 0; k < nk; k++) {
        const i64 nkv = kind_n[k], tk = kind_t[k], a = arity[k];
        const i64 *vk = verts + kstart[k];
        for (i64 j = 0; j < a; j++) {
            i64 *rows = child_rows + cbase + j * nkv;
            for (i64 i = 0; i < nkv; i++) {
                const i64 v = vk[i];
                rows[i] = child_ptr[v + 1] - child_ptr[v] > j ? row[child_idx[child_ptr[v] + j]] : n;
            }
            for (i64 q = 0; q < tk; q++) {
                const i64 t = task_of_kind[tstart[k] + q], off = tasks[4 * t + 1], bs = tasks[4 * t + 2];
                i64 start = rows[off], step = start != n;
                if (bs > 1) {
                    const i64 d0 = rows[off + 1] - rows[off];
                    int ok = start == n ? d0 == 0 : d0 >= 1;
                    for (i64 i = off + 2; ok && i < off + bs; i++) ok = rows[i] - rows[i - 1] == d0;
                    step = ok ? d0 : -1;
                    if (!ok) start = -1;
                }
                views[vbase + q * 2 * a + 2 * j] = start;
                views[vbase + q * 2 * a + 2 * j + 1] = step;
                if (step < 0) gcopy[k * maxa + j] += bs;
            }
        }
        /* the C runner's task table rows of this kind (program.task_table): the task, the first row
           of the sibling-concat view (every slot j a view of step a starting j rows after slot 0's), the views */
        for (i64 q = 0; q < tk; q++) {
            const i64 t = task_of_kind[tstart[k] + q], *vw = views + vbase + q * 2 * a;
            i64 *out = ttable + t * (5 + 2 * maxa);
            for (int c = 0; c < 4; c++) out[c] = tasks[4 * t + c];
            i64 first = a >= 2 ? vw[0] : -1;
            for (i64 j = 0; j < a && first >= 0; j++) if (vw[2 * j + 1] != a || vw[2 * j] != vw[0] + j) first = -1;
            out[4] = a >= 2 && vw[1] == a ? first : -1;
            for (i64 j = 0; j < 2 * maxa; j++) out[5 + j] = j < 2 * a ? vw[j] : -1;
        }
        for (i64 i = 0; i < nkv; i++) keys[kstart[k] + i] = (sample_ids[sample[vk[i]]] << 32) | (u64)local[vk[i]];
        cbase += a * nkv;
        vbase += 2 * a * tk;
    }
    /* 7. pull and push buffers: a vertex's row is its rank among the name's users in global id order */
    for (i64 m = 0; m < nnames; m++) {
        const unsigned char *u = uses + m * nk;
        i64 c = 0;
        for (i64 v = 0; v < n; v++) {
            cursor[v] = c;
            if (u[kind[v]]) name_order[m * n + c++] = v;
        }
        name_count[m] = c;
        for (i64 i = 0; i < n; i++) name_rows[m * n + i] = u[kind[verts[i]]] ? cursor[verts[i]] : -1;
    }
    scalars[0] = T; scalars[1] = forest; scalars[2] = maxh;
    return 0;
}

/* The entry point: one buffer ``buf`` of ``capacity`` int64 holds sizes[K] and edges[K] (written by the caller),
   then OUTPUTS + 1 offsets (relative to buf) of the outputs above, in their order, then the outputs, then the
   scratch. spec: kind mode, leaf kind, internal kind, nk, maxa, nnames, arity[nk]. sample_ids NULL: 0..K-1. */
#define OUTPUTS 27
i64 mc_prepare(i64 K, i64 n, i64 E, const i64 *ptr_all, const i64 *idx_all, const i64 *spec,
               const unsigned char *uses, const u64 *sample_ids, i64 *buf, i64 capacity) {
    if (K < 1 || n < 1 || E < 0 || capacity < 2 * K + OUTPUTS + 1) return 8;
    const i64 nk = spec[3], maxa = spec[4], nnames = spec[5];
    if (nk < 1 || maxa < 0 || nnames < 0) return 8;
    const i64 lengths[OUTPUTS] = {K + 1, n, n, n + 1, E, n + 1, E, n, n, n, n, n + 1, 4 * n, nk, nk, n, n, n,
                                  n * maxa, 2 * n * maxa, n, nnames * n, nnames * n, nnames, 3,
                                  n * (5 + 2 * maxa), nk * maxa};
    i64 *bounds = buf + 2 * K, at = 2 * K + OUTPUTS + 1;
    i64 *out[OUTPUTS];
    for (int i = 0; i < OUTPUTS; i++) { bounds[i] = at; out[i] = buf + at; at += lengths[i]; }
    bounds[OUTPUTS] = at;
    if (at + K + 4 * n + 2 * K + 2 + (n + 3) * nk > capacity) return 8;   /* ids, then the scratch */
    u64 *ids = (u64 *)(buf + at);   /* (the scratch's first K entries until prepare reads them: copied below) */
    i64 *scratch = buf + at + K;
    if (sample_ids) for (i64 k = 0; k < K; k++) ids[k] = sample_ids[k];
    else for (i64 k = 0; k < K; k++) ids[k] = (u64)k;
    return prepare(K, buf, buf + K, ptr_all, idx_all, n, E, spec[0], spec[1], spec[2], nk, spec + 6, maxa, ids,
                   nnames, uses, out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7], out[8], out[9],
                   out[10], out[11], out[12], out[13], out[14], out[15], out[16], out[17], out[18], out[19],
                   out[20], out[21], out[22], out[23], out[24], out[25], out[26], scratch);
}
"""

DECLS = """
int64_t mc_prepare(int64_t K, int64_t n, int64_t E, const int64_t *ptr_all, const int64_t *idx_all,
                   const int64_t *spec, const unsigned char *uses, const uint64_t *sample_ids, int64_t *buf,
                   int64_t capacity);
"""

OUTPUTS = 27   # (the C entry point's OUTPUTS)


def capacity(K: int, n: int, E: int, nk: int, maxa: int, nnames: int) -> int:
    """int64 entries of the buffer mc_prepare needs (it checks the one it is given)."""
    return (2 * K + OUTPUTS + 1 + (K + 1) + 2 * E + n * (25 + 5 * maxa + 2 * nnames) + 2 * nk + nk * maxa + nnames + 8
            + K + 4 * n + 2 * K + 2 + (n + 3) * nk)
