"""The C issuing loop of the CUDA runner (minicavs/cuda/issue.py, codegen/issue_source.py) on the emulated device:
a pass is one C call (its Python calls do not grow with the tasks), a wrong instruction is refused before
anything is issued, the eager table's launches go to the second stream behind events, the TF32 mode rounds the
stand-in's product inputs, and a device that does no work sees the same launches and products. (That every
bundled model issued from C equals the C runner: tests/cuda/test_device_runners.py.)"""
from __future__ import annotations

import collections
import gc
import sys

import numpy as np
import pytest

from minicavs.engine import instructions
from minicavs.cpu import CPU
from minicavs.cuda import Cuda, issue
from minicavs.engine.compile import EngineOptions
from minicavs.engine.executor import RunContext
from minicavs.runtime.inputs import InputGraph

from .. import cells
from ..engine.test_alg1 import CASES
from ..engine.test_backend import close


def _run(case, device, graphs, options=EngineOptions(), params=None):
    rng = np.random.default_rng(0)
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    params = {k: device.asarray(v) for k, v in case.params.items()} if params is None else params
    case.model.device = device
    try:
        return case.model.forward_backward(graphs, feeds, params, RunContext(), options=options)
    finally:
        case.model.device = CPU


def test_the_loop_compiles():
    assert issue.library() is not None


def _pass_calls(case, device, graphs) -> collections.Counter:
    """Python calls (sys.setprofile 'call' and 'c_call' events) made inside the engine's run of a bound pass
    (alg1._run: the device's runner, or the reference runner) during one forward and backward pass, and how many
    of those ran an instruction or the task loop in Python."""
    rng = np.random.default_rng(0)
    feeds = cells.batch_feeds(case, graphs, [case.data(rng, g) for g in graphs])
    params = {k: device.asarray(v) for k, v in case.params.items()}
    case.model.device = device
    counts: collections.Counter = collections.Counter()
    inside = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_run" and "engine/alg1.py" in frame.f_code.co_filename:
            inside[0] += 1
        elif event == "return" and frame.f_code.co_name == "_run" and "engine/alg1.py" in frame.f_code.co_filename:
            inside[0] -= 1
        elif inside[0] and event in ("call", "c_call"):
            counts[event] += 1
            if event == "call" and (frame.f_code.co_name.startswith("op_") or frame.f_code.co_name == "_loop"):
                counts["per instruction"] += 1   # (the Python runners' opcode functions and task loop)
    try:
        case.model.forward_backward(graphs, feeds, params, RunContext())   # compiled, cached
        gc.collect()
        gc.disable()
        sys.setprofile(profile)
        try:
            case.model.forward_backward(graphs, feeds, params, RunContext())
        finally:
            sys.setprofile(None)
            gc.enable()
    finally:
        case.model.device = CPU
    return counts


def test_python_calls_of_an_issued_pass_do_not_grow_with_the_tasks(cuda_standin):
    """Chains of 4 and of 16 vertices (4 and 16 tasks a pass): the passes issued from C make the same Python
    calls, none of them per instruction; issued from Python they grow with the tasks."""
    case = cells.chain_lstm(np.random.default_rng(0))
    short = [InputGraph.chain(4) for _ in range(5)]
    long = [InputGraph.chain(16) for _ in range(5)]
    device = Cuda(cuda_standin)
    calls = _pass_calls(case, device, short)
    assert calls == _pass_calls(case, device, long) and calls["per instruction"] == 0, calls
    assert calls["call"] > 0
    python = Cuda(cuda_standin, issue_from_c=False)
    assert _pass_calls(case, python, long)["per instruction"] > _pass_calls(case, python, short)["per instruction"] > 0


# (opcode, operand, added): an operand pushed far outside what it addresses
CORRUPTIONS = [("BIND", 3, 10**9), ("SCRATCH", 1, 10**9), ("COLS", 2, 10**9), ("GEMM", 3, 10**6),
               ("FUSED", 2, 10**6), ("STATIC", 1, 10**6), ("ADJ", 1, 10**6)]


@pytest.mark.parametrize("opcode, operand, added", CORRUPTIONS)
def test_a_wrong_instruction_is_refused_before_it_is_issued(cuda_standin, opcode, operand, added):
    """A binary Tree-LSTM pass whose first ``opcode`` instruction addresses outside its buffer: the loop
    raises naming the instruction and operand (that instruction, or, where it only sets a register, the
    first that reads the register) before issuing anything there (the stand-in's memory is host memory: a
    launch that wrote outside a buffer would corrupt this process, not raise)."""
    case = cells.binary_tree_lstm(np.random.default_rng(1))
    trees = [InputGraph([[1, 2], [], []])] * 3
    device = Cuda(cuda_standin)
    result = _run(case, device, trees)
    programs = [result.states["G"].program.lowered, result.states["G"].backward_program.lowered]
    lowered = next(p for p in programs if (p.code[:, 0] == instructions.OPCODE[opcode]).any())
    pc = int(np.flatnonzero(lowered.code[:, 0] == instructions.OPCODE[opcode])[0])
    lowered.code[pc][1 + operand] += added
    try:
        with pytest.raises(issue.IssueCheckError, match=r"cuda (∂F|F): task \d+, instruction (\d+) \(\w+ .*\): "
                                                        r"operand [\w ]+ is out of bounds") as caught:
            _run(case, device, trees)
    finally:
        lowered.code[pc][1 + operand] -= added
    at = int(caught.value.args[0].split("instruction ")[1].split()[0])
    assert at == pc or (at > pc and opcode in ("SCRATCH", "COLS")), (pc, caught.value)


def test_a_row_number_out_of_range_is_caught_in_check_mode(cuda_standin, monkeypatch):
    """In the runners' check mode (``train.engine.check``) the loop checks every row number of an index array
    on its host copy (as the C runner's): a child row past the scatter tensor is refused."""
    case = cells.binary_tree_lstm(np.random.default_rng(1))
    trees = [InputGraph([[1, 2], [], []])] * 3
    device = Cuda(cuda_standin)
    from minicavs.engine import program as program_module
    real = program_module._BY_WHAT["child"]

    def far(self, slot, kind_id):
        rows = real(self, slot, kind_id).copy()
        rows[:] = 10**6
        return rows
    monkeypatch.setitem(program_module._BY_WHAT, "child", far)
    with pytest.raises(issue.IssueCheckError, match=r"instruction \d+ \((GATHER|TAKETO|ADJ) .*out of bounds"):
        _run(case, device, trees, EngineOptions(gather_elision=False, check=True))


def test_eager_launches_go_to_the_second_stream_behind_events(cuda_standin):
    """Streaming, every launch and product of an eager chunk is issued on the eager stream, every task's on
    the main one; the eager stream first waits for the main stream's earlier work, records the chunk event
    after each chunk, and the main stream waits for that event before each task that follows a chunk."""
    from cffi import FFI
    ffi, lib = issue.library()
    case = cells.binary_tree_lstm(np.random.default_rng(6))
    trees = [InputGraph([[1, 2], [3, 4], [], [], []])] * 3
    device = Cuda(cuda_standin)
    handles = issue.functions(device, "float64")
    log = []
    launch = ffi.callback("int(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,"
                          " void **, void **)",
                          lambda f, gx, gy, gz, bx, by, bz, sh, stream, params, extra:
                          (log.append(("launch", int(ffi.cast("intptr_t", stream)))),
                           lib.mc_standin_launch(f, gx, gy, gz, bx, by, bz, sh, stream, params, extra))[1])
    record = ffi.callback("int(void *, void *)", lambda event, stream: log.append(
        ("record", int(ffi.cast("intptr_t", event)), int(ffi.cast("intptr_t", stream)))) or 0)
    wait = ffi.callback("int(void *, void *, unsigned)", lambda stream, event, flags: log.append(
        ("wait", int(ffi.cast("intptr_t", stream)), int(ffi.cast("intptr_t", event)))) or 0)
    MAIN, EAGER, START, CHUNK = 11, 22, 33, 44
    handles.dev[[0, 3, 4, 5, 6, 7, 8]] = [int(ffi.cast("intptr_t", launch)), int(ffi.cast("intptr_t", record)),
                                     int(ffi.cast("intptr_t", wait)), MAIN, EAGER, START, CHUNK]
    want = _run(case, Cuda(cuda_standin), trees)
    got = _run(case, device, trees, EngineOptions(streaming=True))
    close(got.loss, want.loss, "float64")
    for k in want.grads:
        close(got.grads[k], want.grads[k], "float64", k)
    state = got.states["G"]
    assert state.program.eager is not None and len(state.program.eager), "the forward pass did not stream"
    # the forward pass's entries: up to the first launch after it (the backward pass begins with its own record)
    starts = [i for i, e in enumerate(log) if e == ("record", START, MAIN)]
    assert starts and log[starts[0] + 1] == ("wait", EAGER, START)
    forward = log[starts[0]:starts[1] if len(starts) > 1 else len(log)]
    chunks, tasks = len(state.program.eager), len(state.program.table)
    assert sum(e == ("record", CHUNK, EAGER) for e in forward) == chunks
    assert sum(e == ("wait", MAIN, CHUNK) for e in forward) == min(chunks, tasks) + (chunks > tasks)
    assert {e[1] for e in forward if e[0] == "launch"} == {MAIN, EAGER}
    # between two chunk records: the wait for the last chunk, the task after it on the main stream, then the
    # next chunk on the eager stream
    segments, seg = [], []
    for e in forward[2:]:
        if e == ("record", CHUNK, EAGER):
            segments.append(seg)
            seg = []
        else:
            seg.append(e)
    segments.append(seg)
    for k, seg in enumerate(segments):
        streams = [e[1] for e in seg if e[0] == "launch"]
        assert streams == sorted(streams, key=lambda s: s == EAGER), (k, streams)
        if MAIN in streams:
            assert seg[0] == ("wait", MAIN, CHUNK), (k, seg[:2])


def test_tf32_rounds_the_stand_in_product_inputs(cuda_standin):
    """A float32 pass with TF32 on (``train.engine.tf32``, or the device's ``tf32``): the stand-in's products read
    their inputs rounded to 10 mantissa bits, so the loss moves away from exact float32's, a little."""
    case = cells.binary_tree_lstm(np.random.default_rng(2), H=8, D=6, dtype="float32")
    trees = [InputGraph([[1, 2], [3, 4], [], [], []])] * 2
    exact = _run(case, Cuda(cuda_standin), trees)
    by_device = _run(case, Cuda(cuda_standin, tf32=True), trees)
    by_options = _run(case, Cuda(cuda_standin), trees, EngineOptions(tf32=True))   # (train.engine.tf32)
    diff = abs(float(by_options.loss) - float(exact.loss))
    assert 0 < diff < 1e-2 * max(1.0, abs(float(exact.loss))), diff
    assert float(by_device.loss) == float(by_options.loss)


def test_a_device_that_does_no_work_sees_the_same_launches(cuda_standin):
    """The timing device (a launcher with ``no_work``: launches and products that do nothing) is issued the
    same launches as the emulated device, for the same batch, and about as many products."""
    case = cells.binary_tree_lstm(np.random.default_rng(3))
    trees = [InputGraph([[1, 2], [3, 4], [], [], []])] * 3
    device = Cuda(cuda_standin)
    params = {k: device.asarray(v) for k, v in case.params.items()}   # (the same arrays: products of two
    _run(case, device, trees, params=params)                           # weights batch as their addresses allow)
    before = issue.stats(device).copy()
    _run(case, device, trees, params=params)
    per_batch = issue.stats(device) - before

    class NoWork:
        no_work, emulated, xp = True, True, cuda_standin.xp
    idle = Cuda(NoWork())
    _run(case, idle, trees, params=params)
    assert per_batch[0] > 0 and per_batch[1] > 0
    got = issue.stats(idle)
    # (launches and events exactly; two products batch only when their operands lie in one order in memory,
    # which the two devices' workspaces may not share: the products within that)
    assert got[0] == per_batch[0] and got[2] == per_batch[2], (got, per_batch)
    assert per_batch[1] / 2 <= got[1] <= 2 * per_batch[1], (got, per_batch)


def _column_major(ffi, ptr, rows: int, cols: int, ld: int, dtype):
    """rows x cols at a C pointer, column-major with leading dimension ld: a numpy view of that memory."""
    if rows == 0 or cols == 0:
        return np.zeros((rows, cols), dtype)
    item = np.dtype(dtype).itemsize
    flat = np.frombuffer(ffi.buffer(ffi.cast("char *", ptr), ((cols - 1) * ld + rows) * item), dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (item, ld * item), writeable=True)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_cublas_shim_maps_row_major_products(cuda_standin, dtype):
    """The GPU's product path without a GPU: the loop's products go through mc_cublas_gemm (row-major
    C = op(A) op(B) as cuBLAS's column-major C^T = op(B)^T op(A)^T, strided batches, beta, on the stream's
    handle) into stand-ins of cublasGemmEx / cublasGemmStridedBatchedEx that compute in
    column-major terms with numpy, as cuBLAS documents them: a binary Tree-LSTM pass equals the stand-in's."""
    ffi, lib = issue.library()
    np_dtype = np.dtype(dtype)
    calls = collections.Counter()

    def batched(handle, ta, tb, m, n, k, alpha, A, at, lda, sa, B, bt, ldb, sb, beta, C, ct, ldc, sc, count,
                compute, algo):
        assert at == bt == ct == (0 if dtype == "float32" else 1) and compute == (68 if dtype == "float32" else 70)
        scalar = "float *" if dtype == "float32" else "double *"
        a_, b_ = ffi.cast(scalar, alpha)[0], ffi.cast(scalar, beta)[0]
        item = np_dtype.itemsize
        for i in range(count):
            a = _column_major(ffi, int(ffi.cast("uintptr_t", A)) + i * sa * item, k if ta else m, m if ta else k, lda,
                              np_dtype)
            b = _column_major(ffi, int(ffi.cast("uintptr_t", B)) + i * sb * item, n if tb else k, k if tb else n, ldb,
                              np_dtype)
            c = _column_major(ffi, int(ffi.cast("uintptr_t", C)) + i * sc * item, m, n, ldc, np_dtype)
            c[...] = a_ * ((a.T if ta else a) @ (b.T if tb else b)) + (b_ * c if b_ else 0)
        calls["batched" if count > 1 else "one"] += 1
        return 0
    signature = ("int(void *, int, int, int, int, int, const void *, const void *, int, int, long long, const void *,"
                 " int, int, long long, const void *, void *, int, int, long long, int, int, int)")
    gemm_batched = ffi.callback(signature, batched)
    gemm_one = ffi.callback(
        "int(void *, int, int, int, int, int, const void *, const void *, int, int, const void *, int, int,"
        " const void *, void *, int, int, int, int)",
        lambda h, ta, tb, m, n, k, al, A, at, lda, B, bt, ldb, be, C, ct, ldc, comp, algo:
        batched(h, ta, tb, m, n, k, al, A, at, lda, 0, B, bt, ldb, 0, be, C, ct, ldc, 0, 1, comp, algo))
    case = cells.binary_tree_lstm(np.random.default_rng(4), dtype=dtype)
    trees = [InputGraph([[1, 2], [3, 4], [], [], []]), InputGraph([[1, 2], [], []])] * 2
    want = _run(case, Cuda(cuda_standin), trees)   # (the stand-in's own products: the CPU's cblas)
    device = Cuda(cuda_standin)
    handles = issue.functions(device, dtype)
    handles.ctx.gemm_ex, handles.ctx.gemm_batched = [int(ffi.cast("uintptr_t", f)) for f in (gemm_one, gemm_batched)]
    handles.ctx.stream[0], handles.ctx.handle[0] = ffi.NULL, ffi.cast("void *", 1)   # (the null stream's handle)
    handles.dev[1] = int(ffi.cast("uintptr_t", getattr(lib, f"mc_cublas_gemm_{handles.c_type}")))
    got = _run(case, device, trees)
    close(got.loss, want.loss, dtype)
    for k in want.grads:
        close(got.grads[k], want.grads[k], dtype, k)
    assert calls["one"], calls
    # and a strided batch of every transpose combination, onto C (beta 1), straight through the shim
    rng = np.random.default_rng(5)
    m, n, k, count = 3, 5, 4, 3
    for ta in (0, 1):
        for tb in (0, 1):
            a, b = rng.standard_normal((count, m, k)).astype(dtype), rng.standard_normal((count, k, n)).astype(dtype)
            stored_a = np.ascontiguousarray(a.transpose(0, 2, 1) if ta else a)
            stored_b = np.ascontiguousarray(b.transpose(0, 2, 1) if tb else b)
            c = rng.standard_normal((count, m, n)).astype(dtype)
            want_c = c + a @ b

            def at(x):
                return ffi.cast("void *", x.ctypes.data)
            rc = getattr(lib, f"mc_cublas_gemm_{handles.c_type}")(
                handles.ctx, ffi.NULL, ta, tb, m, n, k, at(stored_a), stored_a.shape[2], m * k, at(stored_b),
                stored_b.shape[2], k * n, at(c), n, m * n, count, 1)
            assert rc == 0
            np.testing.assert_allclose(c, want_c, rtol=1e-5, atol=1e-5)
    assert calls["batched"] >= 4


def test_unreachable_entry_points_fall_back_to_the_reference_runner(cuda_standin, monkeypatch):
    """A device whose function pointers cannot be had (a driver or cuBLAS the loop has not met): one warning,
    and the reference runner runs its passes on the device with the same numbers, not an error."""
    case = cells.chain_lstm(np.random.default_rng(2))
    graphs = [InputGraph.chain(3)] * 2
    want = _run(case, Cuda(cuda_standin), graphs)

    def unreachable(*args):
        raise OSError("libcublas.so: cannot open shared object file")
    monkeypatch.setattr(issue, "_Standin", unreachable)
    device = Cuda(cuda_standin)
    with pytest.warns(RuntimeWarning, match="cannot reach the device's entry points .*libcublas"):
        got = _run(case, device, graphs)
    why = got.states["G"].program.declined
    assert why is not None and "libcublas" in why
    close(got.loss, want.loss, "float64")
    for k in want.grads:
        close(got.grads[k], want.grads[k], "float64", k)


def test_a_device_issues_from_c_unless_told_not_to(cuda_standin):
    assert Cuda(cuda_standin).issue_from_c and not Cuda(cuda_standin, issue_from_c=False).issue_from_c


def test_rowop_is_issued_one_block_per_row_its_threads_from_the_row_length(cuda_standin, tmp_path):
    """A 330-word softmax loss (ROWOP's cross-entropy and its gradient over 330+ columns) issued from C on the
    emulated device: every rowop launch is one block per row (grid: the loss's rows) with the loop's threads for
    its row length, more than a warp for the vocabulary; the loss and gradients equal the C runner's in
    float32."""
    from minicavs.engine.backend import to_host
    from minicavs.engine.lowered import OPCODES_BY_ID
    from minicavs.train.trainer import Trainer
    from ..engine.test_static_program import _dense, _programs, _run
    from ..models.test_models import MODELS, TINY
    words = [f"w{i}" for i in range(330)]
    order = np.random.default_rng(3).permutation(words * 2)
    text = tmp_path / "wide.txt"
    text.write_text("\n".join(" ".join(order[i:i + 6]) for i in range(0, len(order), 6)) + "\n")
    t = Trainer(MODELS / "var_lstm.yaml", TINY["var_lstm"] + [f"data.train={text}", f"data.dev={text}",
                                                             f"data.test={text}", "train.dtype=float32"],
                run_dir=tmp_path / "run")
    graphs, feeds = t.task.batch(t.task.data["train"][:8])
    want = _run(t, graphs, feeds, "device")
    cuda_standin.launches.clear()
    got = _run(t, graphs, feeds, "device", Cuda(cuda_standin))
    programs = _programs(got)
    assert programs and all(p.runner == "cuda runner" and p.declined is None for p in programs)
    cols = [int(row[1 + 5]) for p in programs for row in p.lowered.code if OPCODES_BY_ID[int(row[0])] == "ROWOP"]
    threads = {issue.library()[1].mc_rowop_threads(c) for c in cols}
    launched = [(grid, block) for name, grid, block in cuda_standin.launches if name == "rowop_float"]
    assert cols and len(launched) >= len(cols) and max(threads) > 32
    rows = len(feeds["targets"])   # (the loss's rows: one per target word)
    assert {block for _, block in launched} == threads and {grid for grid, _ in launched} == {rows}, launched
    assert abs(float(to_host(got.loss)) - float(to_host(want.loss))) <= 1e-5 * abs(float(to_host(want.loss)))
    for k, b in want.grads.items():
        a, b = _dense(got.grads[k]), _dense(b)
        assert np.abs(a - b).max(initial=0) <= 1e-5 * max(1.0, np.abs(b).max(initial=0)), k
