"""Fuzz every op and kernel that takes integer indices or keys with wrong lengths, out-of-range, negative and
non-integer values: each must raise a clear error (a minicavs ValueError naming the input and the sizes)
before any C or CUDA kernel runs, and change nothing.

A bad index that reached a C kernel would read or write outside its buffers and may crash the process, so
every group of cases runs in a subprocess (``python -c 'from tests.engine.test_fuzz_kernels import main; ...'``)
that announces each case before running it and reports its outcome after; a crash (a negative exit
status) fails the test naming the case that was running. Cases come from a seeded generator.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


# --- bad values -------------------------------------------------------------------------------------

def bad_indices(rng, n: int, size: int, one_d: bool = True, unsigned: bool = False):
    """(name, value, must) cases for an index array that should hold ``n`` integers in [0, size): ``must``
    lists strings the error message has to contain (the sizes or the bad value)."""
    top = 1000 if size is None else max(size, 1)
    good = rng.integers(0, top, n) if size != 0 else np.zeros(n, np.int64)
    p = int(rng.integers(0, max(n, 1)))
    out = []
    if one_d:
        for m in sorted({0, n - 1, n + 1, 2 * n + 3, int(rng.integers(n + 2, 4 * n + 8))} - {n}):
            if m >= 0:
                out.append((f"length {m}", rng.integers(0, top, m), [str(n), str(m)]))
        out.append(("2-D", good.reshape(1, -1), [str(n)]))
    if n == 0:
        return out
    for bad in (-1, -size - 1, -2 ** 63) if unsigned is False else (-1,):
        a = good.copy()
        a[p] = bad
        out.append((f"value {bad}", a, [str(bad)]))
    if size is not None:
        for bad in sorted({size, size + int(rng.integers(1, 100)), max(size, 2 ** 31), max(size, 2 ** 62)}):
            a = good.copy()
            a[p] = bad
            out.append((f"value {bad}", a, [str(bad), str(size)]))
        a = good.astype(np.uint64)
        a[p] = 2 ** 63
        out.append(("uint64 2**63", a, [str(2 ** 63)]))
        a = good.astype(np.uint64)
        a[p] = 2 ** 64 - 1
        out.append(("uint64 2**64-1", a, [str(2 ** 64 - 1)]))
    out += [
        ("float fraction", good + 0.5, ["float64"]),
        ("float integral", good.astype(np.float64), ["float64"]),
        ("float32", good.astype(np.float32), ["float32"]),
        ("nan", np.where(np.arange(n) == p, np.nan, good), ["float64"]),
        ("inf", np.where(np.arange(n) == p, np.inf, good), ["float64"]),
        ("bool", good % 2 == 0, ["bool"]),
        ("object None", np.array([None if i == p else int(x) for i, x in enumerate(good)], dtype=object), ["None"]),
        ("object str", np.array(["a" if i == p else int(x) for i, x in enumerate(good)], dtype=object), ["'a'"]),
        ("list 0.9", [0.9 if i == p else int(x) for i, x in enumerate(good)], ["0.9"]),
        ("list True", [True if i == p else int(x) for i, x in enumerate(good)], ["True"]),
        ("list 2**64", [2 ** 64 if i == p else int(x) for i, x in enumerate(good)], [str(2 ** 64)]),
        ("list nested", [[1] if i == p else int(x) for i, x in enumerate(good)], []),
    ]
    if not unsigned:   # a uint64 key may be 2**63
        out.append(("list 2**63", [2 ** 63 if i == p else int(x) for i, x in enumerate(good)], [str(2 ** 63)]))
    return out


# --- the targets: each returns a list of (case name, thunk, must) -----------------------------------

def _xent_op(rng):
    from minicavs import ops
    from minicavs.engine.executor import run
    from minicavs.ops import make_node
    cases = []
    for dtype in ("float32", "float64"):
        for n, classes in ((6, 5), (1, 3), (9, 1)):
            logits = ops.input((None, classes), dtype, name="logits")
            labels = ops.input((None,), "int64", name="labels")
            loss = ops.softmax_cross_entropy(logits, labels)
            g = ops.input((None,), dtype, name="g")
            dx = make_node("xent_grad", (g, logits, labels))
            x = rng.standard_normal((n, classes)).astype(dtype)
            gv = rng.standard_normal(n).astype(dtype)
            for name, bad, must in bad_indices(rng, n, classes):
                feeds = {logits: x, labels: bad, g: gv}
                cases.append((f"softmax_cross_entropy {dtype} ({n}, {classes}) labels {name}",
                              lambda o=loss, f=feeds: run(o, f), must + ["labels"]))
                cases.append((f"xent_grad {dtype} ({n}, {classes}) labels {name}",
                              lambda o=dx, f=feeds: run(o, f), must + ["labels"]))
    return cases


def _library(rng):
    from minicavs.cpu.library import library
    from minicavs.core.sparse import RowSparse
    cases = []
    for dtype in (np.float32, np.float64):
        lib = library(dtype)
        if lib is None:
            continue
        n, classes = 7, 4
        x = rng.standard_normal((n, classes)).astype(dtype)
        for name, bad, must in bad_indices(rng, n, classes):
            cases.append((f"Library.xent {np.dtype(dtype)} labels {name}", lambda b=bad: lib.xent(x, b),
                          must + ["label"]))
            cases.append((f"Library.xent_grad {np.dtype(dtype)} labels {name}",
                          lambda b=bad: lib.xent_grad(np.ones(n, dtype), x, b), must + ["label"]))
        for name, bad, must in bad_indices(rng, n, None, unsigned=True):
            cases.append((f"Library.dropout {np.dtype(dtype)} keys {name}",
                          lambda b=bad: lib.dropout(x, b, 12345, 0.5), must + ["row key"]))
        keys = np.arange(n, dtype=np.uint64)
        for name, h, p in (("h -1", -1, 0.5), ("h 2**64", 2 ** 64, 0.5), ("h 0.5", 0.5, 0.5), ("p 1", 1, 1.0),
                           ("p -0.1", 1, -0.1), ("p nan", 1, float("nan")), ("p str", 1, "0.5")):
            cases.append((f"Library.dropout {np.dtype(dtype)} {name}", lambda h=h, p=p: lib.dropout(x, keys, h, p),
                          ["dropout"]))
        rows, width = 9, 3
        for rule, nslots, hyper in (("adam", 2, (0.1, 0.9, 0.999, 1e-8, 0.0)),
                                    ("adagrad", 1, (0.1, 1e-10, 0.0))):
            k = 4
            for name, bad, must in bad_indices(rng, k, rows):
                def update(bad=bad, rule=rule, nslots=nslots, hyper=hyper):
                    p = np.ones((rows, width), dtype)
                    slots = tuple(np.ones((rows, width), dtype) for _ in range(nslots))
                    before = [a.copy() for a in (p, *slots)]
                    try:
                        g = RowSparse(bad, np.ones((k, width), dtype), (rows, width))
                        lib.update(rule, p, g, slots, hyper, True)
                    finally:
                        assert all(np.array_equal(a, b) for a, b in zip((p, *slots), before)), "changed"
                cases.append((f"Library.update {rule} {np.dtype(dtype)} indices {name}", update, must + ["index"]))
            for name, idx in (("unsorted", [3, 1, 5, 7]), ("repeated", [1, 1, 5, 7])):
                def unsorted(idx=idx, rule=rule, nslots=nslots, hyper=hyper):
                    g = RowSparse(np.array(idx), np.ones((k, width), dtype), (rows, width))
                    slots = tuple(np.ones((rows, width), dtype) for _ in range(nslots))
                    lib.update(rule, np.ones((rows, width), dtype), g, slots, hyper, True)
                cases.append((f"Library.update {rule} {np.dtype(dtype)} {name}", unsorted, ["sorted"]))
            for name, slots, rows_arr in (
                    ("slot dtype", lambda n=nslots: tuple(np.ones((rows, width), np.float16) for _ in range(n)), None),
                    ("slot shape", lambda n=nslots: tuple(np.ones((rows - 1, width), dtype) for _ in range(n)), None),
                    ("rows shape", None, np.ones((k + 2, width), dtype))):
                def update2(slots=slots, rows_arr=rows_arr, rule=rule, nslots=nslots, hyper=hyper):
                    s = slots() if slots else tuple(np.ones((rows, width), dtype) for _ in range(nslots))
                    r = rows_arr if rows_arr is not None else np.ones((k, width), dtype)
                    lib.update(rule, np.ones((rows, width), dtype), RowSparse(np.array([0, 2, 4, 6]), r, (rows, width)),
                               s, hyper, True)
                cases.append((f"Library.update {rule} {np.dtype(dtype)} {name}", update2, ["update"]))
    return cases


def _lookup(rng):
    from minicavs import ops
    from minicavs.engine.executor import run
    cases = []
    for rows in (7, 1):
        table = ops.param_node("E", (rows, 3), "float64")
        E = rng.standard_normal((rows, 3))
        for shape in ((None,), (None, 2)):
            idx = ops.input(shape, "int64", name="words")
            out = ops.lookup(table, idx)
            for name, bad, must in bad_indices(rng, 5, rows, one_d=False):
                if shape == (None, 2) and getattr(bad, "ndim", 1) == 1:
                    bad = np.asarray(bad, dtype=object if isinstance(bad, list) else None)
                    if bad.dtype != object:
                        bad = np.stack([bad, bad], axis=1)
                    else:
                        bad = np.array([[a, a] for a in bad], dtype=object)
                cases.append((f"lookup table {rows} rows idx {shape} {name}",
                              lambda o=out, b=bad, E=E: run(o, {"words": b}, {"E": E}), must + ["words"]))
    return cases


def _c_rows(rng):
    from minicavs.cpu.compiler import row_kernels
    cases = []
    for dtype in (np.float32, np.float64):
        rk = row_kernels(dtype)
        src = rng.standard_normal((6, 4)).astype(dtype)
        for name, bad, must in bad_indices(rng, 5, 6):
            if name.startswith("length"):
                continue  # gather takes any number of indices
            cases.append((f"C gather {np.dtype(dtype)} {name}", lambda b=bad: rk.gather(src, b), must + ["gather"]))

        def add(bad):
            dst = np.zeros((6, 4), dtype)
            try:
                rk.scatter_add(dst, bad, np.ones((5, 4), dtype))
            finally:
                assert not dst.any(), "changed"
        for name, bad, must in bad_indices(rng, 5, 6):
            cases.append((f"C scatter_add {np.dtype(dtype)} {name}", lambda b=bad: add(b), must + ["scatter_add"]))
    return cases


def _cuda_rows(rng):
    from minicavs import cuda as mcuda
    from minicavs.cuda.emulation import Launcher
    from minicavs.cuda import Cuda
    cases = []
    launcher = Launcher()
    device = Cuda(launcher=launcher)
    det = Cuda(launcher=Launcher(), deterministic=True)
    xp = launcher.xp   # the device stand-in: data on the device, bad indices from the host as users give them
    for dtype in (np.float32, np.float64):
        rk = mcuda.RowKernels(dtype, launcher)
        src = xp.asarray(rng.standard_normal((6, 4)).astype(dtype))
        for name, bad, must in bad_indices(rng, 5, 6):
            if not name.startswith("length"):
                cases.append((f"CUDA gather {np.dtype(dtype)} {name}", lambda b=bad: rk.gather(src, b),
                              must + ["gather"]))
            for kernel in ("scatter", "scatter_add", "segment_sum"):
                def launch(b=bad, kernel=kernel):
                    dst = xp.zeros((6, 4), dtype)
                    try:
                        getattr(rk, kernel)(dst, b, xp.ones((5, 4), dtype))
                    finally:
                        assert not bool(dst.any()), "changed"
                cases.append((f"CUDA {kernel} {np.dtype(dtype)} {name}", launch, must + [kernel]))
            for dev, what in ((device, "atomic"), (det, "deterministic")):
                cases.append((f"CUDA device scatter_add {what} {np.dtype(dtype)} {name}",
                               lambda b=bad, dev=dev: dev.rows(dtype).scatter_add(xp.zeros((6, 4), dtype), b,
                                                                                  xp.ones((5, 4), dtype)),
                               must + ["scatter_add"]))
        for name, bad, must in bad_indices(rng, 6, None, unsigned=True):
            cases.append((f"CUDA dropout {np.dtype(dtype)} keys {name}", lambda b=bad: rk.dropout(src, b, 7, 0.5),
                          must + ["row key"]))
        good_plan = (np.arange(5), np.array([0, 2, 5]), np.array([1, 3]))
        for name, plan in (("order out of range", (np.array([0, 1, 2, 3, 9]),) + good_plan[1:]),
                           ("order short", (np.arange(4),) + good_plan[1:]),
                           ("ptr past the end", (good_plan[0], np.array([0, 2, 7]), good_plan[2])),
                           ("ptr decreasing", (good_plan[0], np.array([0, 4, 2]), good_plan[2])),
                           ("ptr length", (good_plan[0], np.array([0, 5]), good_plan[2])),
                           ("target out of range", good_plan[:2] + (np.array([1, 6]),)),
                           ("target negative", good_plan[:2] + (np.array([-1, 3]),)),
                           ("target float", good_plan[:2] + (np.array([1.0, 3.0]),)),
                           ("two arrays", good_plan[:2])):
            cases.append((f"CUDA segment_sum plan {np.dtype(dtype)} {name}",
                          lambda plan=plan: rk.segment_sum(xp.zeros((6, 4), dtype), np.arange(5) % 6,
                                                           xp.ones((5, 4), dtype), plan=plan), ["segment_sum"]))
    return cases


def _dropout_op(rng):
    from minicavs import ops
    from minicavs.engine.executor import RunContext, run
    cases = []
    for dtype in ("float32", "float64"):
        x = ops.input((None, 5), dtype, name="x")
        y = ops.dropout(x, 0.5, site=3)
        xv = rng.standard_normal((6, 5)).astype(dtype)
        for name, bad, must in bad_indices(rng, 6, None, unsigned=True):
            cases.append((f"dropout op {dtype} row keys {name}",
                          lambda b=bad, y=y, xv=xv: run(y, {"x": xv}, ctx=RunContext(row_keys=b)), must + ["row key"]))
    return cases


def _optim(rng):
    from minicavs.nn.parameter import Parameter, ParameterSet
    from minicavs.train.optim import SGD, Adagrad, Adam
    from minicavs.core.sparse import RowSparse
    cases = []
    makers = {"sgd": lambda ps, lazy: SGD(ps, lr=0.1, momentum=0.9, sparse_updates=lazy),
              "adagrad": lambda ps, lazy: Adagrad(ps, lr=0.1, sparse_updates=lazy),
              "adam": lambda ps, lazy: Adam(ps, lr=0.1, weight_decay=0.1, sparse_updates=lazy)}
    for dtype in ("float32", "float64"):
        for opt_name, make in makers.items():
            for lazy in (False, True):
                for name, bad, must in bad_indices(rng, 4, 8):
                    def step(bad=bad, make=make, lazy=lazy):
                        ps = ParameterSet([Parameter("E", (8, 3), init=np.ones((8, 3)), dtype=dtype)])
                        opt = make(ps, lazy)
                        opt.step({"E": RowSparse(np.array([1, 2]), np.ones((2, 3), dtype), (8, 3))})
                        before = (ps["E"].value.copy(), {k: a.copy() for k, a in opt.state["E"].items()})
                        try:
                            opt.step({"E": RowSparse(bad, np.ones((4, 3), dtype), (8, 3))})
                        finally:
                            assert np.array_equal(ps["E"].value, before[0]) and all(
                                np.array_equal(a, before[1][k]) for k, a in opt.state["E"].items()), "changed"
                    cases.append((f"{opt_name} lazy={lazy} {dtype} indices {name}", step, must + ["'E'"]))
    return cases


def _sparse(rng):
    from minicavs.core.sparse import RowSparse, add_all
    cases = []
    for name, bad, must in bad_indices(rng, 4, 6):
        cases.append((f"RowSparse.to_dense {name}",
                      lambda b=bad: RowSparse(b, np.ones((4, 2)), (6, 2)).to_dense(), must + ["index"]))
        cases.append((f"add_all {name}",
                      lambda b=bad: add_all(np, [np.zeros((6, 2)), RowSparse(b, np.ones((4, 2)), (6, 2))]),
                      must + ["index"]))
    return cases


def _graphs(rng):
    from minicavs.runtime.inputs import InputGraph, make_batch
    cases = []
    n = 6
    ptr = np.array([0, 0, 0, 2, 2, 4, 6])
    idx = np.array([0, 1, 2, 3, 4, 0])
    for name, bad, must in bad_indices(rng, len(idx), n):
        cases.append((f"from_csr child ids {name}",
                      lambda b=bad: make_batch([InputGraph([[]]), InputGraph.from_csr(ptr, b)]), must + ["child"]))
        if not name.startswith(("length", "2-D", "uint64", "float", "nan", "inf", "bool", "object")):
            children = [list(bad[ptr[v]:ptr[v + 1]]) for v in range(n)]
            cases.append((f"InputGraph child ids {name}",
                          lambda c=children: make_batch([InputGraph([[]]), InputGraph(c)]), must + ["child"]))
    for name, bad, must in bad_indices(rng, len(ptr), len(idx) + 1):
        if not name.startswith("length"):
            cases.append((f"from_csr child_ptr {name}", lambda b=bad: InputGraph.from_csr(b, idx), ["child_ptr"]))
    for name, p in (("ptr not from 0", [1, 2, 2]), ("ptr decreasing", [0, 2, 1]), ("ptr short", [0, 1]),
                    ("ptr long", [0, 1, 2, 3]), ("ptr empty", [])):
        cases.append((f"from_csr {name}", lambda p=p: InputGraph.from_csr(p, [1, 0]), ["child_ptr"]))
    for name, kinds in (("kinds short", ["a"]), ("kinds str", "ab"), ("kinds int", [0, 1]),
                        ("kinds None", [None, "a"])):
        cases.append((f"InputGraph {name}", lambda k=kinds: InputGraph([[], [0]], kinds=k), ["kind"]))
    for name, children in (("children int", [0, 1]), ("children str", ["ab"]), ("children 0.9", [[], [0.9]]),
                           ("children True", [[], [True]]), ("children 2**63", [[], [2 ** 63]]),
                           ("children -2**64", [[], [-2 ** 64]])):
        cases.append((f"InputGraph {name}", lambda c=children: make_batch([InputGraph(c)]), ["vertex"]))
    return cases


def _model(rng):
    from tests.cells import batch_feeds, binary_tree_lstm
    from minicavs.runtime.inputs import InputGraph
    case = binary_tree_lstm(np.random.default_rng(0), p_drop=0.3)
    graphs = [InputGraph.complete_binary_tree(4), InputGraph.complete_binary_tree(2)]
    per = [case.data(np.random.default_rng(i), g) for i, g in enumerate(graphs)]
    feeds = batch_feeds(case, graphs, per)
    cases = []
    for name, bad, must in bad_indices(rng, len(graphs), 1 << 32):
        cases.append((f"Model sample_ids {name}",
                      lambda b=bad: case.model.forward_backward(graphs, feeds, case.params, sample_ids=b),
                      must + ["sample id"]))
    for key, size in (("labels", 3), ("words", 7)):
        for name, bad, must in bad_indices(rng, len(feeds[key]), size):
            cases.append((f"Model feed {key} {name}",
                          lambda b=bad, key=key: case.model.forward_backward(graphs, {**feeds, key: b}, case.params),
                          must + [key]))
    return cases


GROUPS = {"xent_op": _xent_op, "library": _library, "lookup": _lookup, "c_rows": _c_rows, "cuda_rows": _cuda_rows,
          "dropout_op": _dropout_op, "optim": _optim, "sparse": _sparse, "graphs": _graphs, "model": _model}


HARNESS = {"_crash": lambda rng: [("fine", lambda: None, []),
                                  ("read address 0", lambda: __import__("ctypes").string_at(0), [])]}


def main(group: str) -> None:
    """Run one group's cases, one JSON line each: announced before it runs, its outcome after, so that a
    crash leaves the name of the case that was running."""
    from minicavs.core.errors import MinicavsError
    rng = np.random.default_rng(sorted({**GROUPS, **HARNESS}).index(group))
    for name, thunk, must in {**GROUPS, **HARNESS}[group](rng):
        print(json.dumps({"start": name}), flush=True)
        try:
            thunk()
            outcome = {"case": name, "error": None}
        except Exception as e:   # noqa: BLE001 - any exception is recorded and judged by the test
            outcome = {"case": name, "error": type(e).__name__, "message": str(e),
                       "clear": isinstance(e, MinicavsError) and isinstance(e, ValueError),
                       "missing": [m for m in must if m not in str(e)]}
        print(json.dumps(outcome), flush=True)


def run_group(group: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", f"from tests.engine.test_fuzz_kernels import main; main({group!r})"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        running = lines[-1].get("start") if lines and "start" in lines[-1] else None
        pytest.fail(f"the {group} cases crashed the process (exit status {proc.returncode}) "
                    f"in case {running!r}:\n{proc.stderr[-3000:]}")
    return [x for x in lines if "case" in x]


MINIMUM = {"xent_op": 300, "library": 150, "lookup": 80, "c_rows": 50, "cuda_rows": 200, "dropout_op": 30,
           "optim": 300, "sparse": 40, "graphs": 50, "model": 60}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_bad_index_is_a_clear_error(group):
    results = run_group(group)
    assert len(results) >= MINIMUM[group], f"only {len(results)} cases ran"
    silent = [r["case"] for r in results if r["error"] is None]
    assert not silent, f"{len(silent)} of {len(results)} bad inputs raised nothing: {silent[:10]}"
    unclear = [(r["case"], r["error"], r["message"][:200]) for r in results if not r["clear"]]
    assert not unclear, f"{len(unclear)} of {len(results)} errors are not minicavs ValueErrors: {unclear[:5]}"
    vague = [(r["case"], r["missing"], r["message"][:300]) for r in results if r["missing"]]
    assert not vague, f"{len(vague)} of {len(results)} messages do not name the input or sizes: {vague[:5]}"


def test_a_crash_fails_with_the_case_named():
    """The harness itself: a case that kills its process (a read at address 0) fails the test, naming it."""
    with pytest.raises(pytest.fail.Exception, match="crashed the process .* in case 'read address 0'"):
        run_group("_crash")
