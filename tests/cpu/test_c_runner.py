"""The C runner's buffer table kept from run to run (cpu/c_runner.py's BufferTable): whatever changes
between two passes (a parameter array replaced or written in place, a batch that grows the workspace's
buffers or shrinks, another plan, a table with block rows or without, the statics copied or not, a
checkpoint loaded, a run that failed), the numbers equal the reference runner's and a fresh model's, and
every address the table hands C is that of an array alive and resolved for this very pass."""
from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import numpy as np
import pytest

from minicavs.train import checkpoint
from minicavs.engine import linked_head, operands, program
from minicavs.cpu import c_runner
from minicavs.engine.compile import EngineOptions
from minicavs.runtime.memory import DynamicTensor
from minicavs.train.trainer import Trainer

from ..models.test_models import MODELS, TINY
from ..engine.test_instructions import close

pytestmark = pytest.mark.skipif(c_runner.available(np.float64) is not None,
                                reason="no C compiler or BLAS: the C runner cannot run here")


def _address(a) -> int:
    return a.__array_interface__["data"][0]


@pytest.fixture
def checked_runs(monkeypatch) -> list:
    """Wrap the binder and the C runner's run: after each call, every entry of the kept table must address the
    array of the operand the binder resolved for it in this pass (a static's copy excepted: made by the run
    itself), with the elements the binder said it uses; entries the pass left unbound must be zero. Also
    records which workspace tensors the binder did not look up again (operands.WORKSPACE_TENSORS: kept from
    the program's last binding). Returns (program, kept tensors so far) per run."""
    real_bind, real_run = program.bind_operands, c_runner.run
    programs, skipped, resolved = [], [], set()

    class Recording:
        """The pass's buffers, each one looked up recorded."""

        def __init__(self, buffers):
            self.buffers, self.ctx, self.dtype = buffers, buffers.ctx, buffers.dtype

        def __getitem__(self, key):
            resolved.add(key)
            return self.buffers[key]

    def bind(lowered, table, buffers, *rest):
        resolved.clear()
        return real_bind(lowered, table, Recording(buffers), *rest)

    def run(bound_program, *rest):
        lowered = bound_program.lowered
        real_run(bound_program, *rest)
        bound = c_runner._TABLES[lowered]
        assert not bound.info[4].any()   # (twins: let go after the call)
        for i, (key, operand) in enumerate(zip(lowered.keys, bound_program.operands)):
            if key[0] in operands.WORKSPACE_TENSORS and operand is not None and key not in resolved:
                skipped.append(key)
            ref = bound.held[i]
            held = None if ref is None else ref()   # (held weakly: a static's copy is gone after the call)
            if ref is None:   # unbound, or a batch's own array let go after the call
                assert operand is None or key[0] not in c_runner.PERSISTENT or key[0] == "static", key
                assert not bound.info[:4, i].any(), key
                continue
            assert held is operand.array or key[0] == "static", (key, "a stale array")
            if held is not None:
                assert bound.info[0, i] == _address(held)
                assert bound.info[1, i] == (operand.elements if held is operand.array else held.size)
        programs.append((lowered, len(skipped)))
    monkeypatch.setattr(program, "bind_operands", bind)
    monkeypatch.setattr(c_runner, "run", run)
    return programs


def _trainer(tmp_path, name="tree_lstm", dtype="float64") -> Trainer:
    return Trainer(MODELS / f"{name}.yaml", TINY[name] + [f"train.dtype={dtype}"], run_dir=tmp_path)


def _both(t: Trainer, samples):
    """(reference runner's, C runner's) loss and gradients on ``samples``."""
    out = []
    for runner in ("reference", "device"):
        t.model.options = EngineOptions(runner=runner)
        out.append(t.loss_and_grads(samples))
    return out


def _same(a, b, dtype="float64") -> None:
    close(a.loss, b.loss, dtype)
    assert set(a.grads) == set(b.grads)
    for k in a.grads:
        close(a.grads[k], b.grads[k], dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_every_change_between_passes_gives_the_reference_numbers(dtype, tmp_path, checked_runs):
    t = _trainer(tmp_path, dtype=dtype)
    data = t.task.data["train"]
    rng = np.random.default_rng(0)
    name = sorted(t.params)[0]
    steps = [
        ("first batch", lambda: None, data[:3]),
        ("same batch again", lambda: None, data[:3]),
        ("a parameter array replaced", lambda: setattr(t.params[name], "value",
                                                       rng.normal(size=t.params[name].value.shape).astype(dtype)),
         data[:3]),
        ("every parameter written in place", lambda: [p.value.__imul__(0.9) for p in t.params.values()], data[:3]),
        ("a larger batch (the workspace grows)", lambda: None, data[:20]),
        ("another plan", lambda: None, data[20:26]),
        ("one sample", lambda: None, data[30:31]),
        ("back to the first batch", lambda: None, data[:3]),
    ]
    for what, change, samples in steps:
        change()
        python, native = _both(t, samples)
        _same(python, native, dtype)
    # (F's and ∂F's programs, each run again and again; the static graphs' programs are checked alike)
    assert len({id(p) for p, _ in checked_runs if p.title in ("F", "∂F")}) == 2
    assert 0 < checked_runs[-1][1] < sum(len(p.keys) for p, _ in checked_runs)   # (some kept, many looked up)


def test_a_checkpoint_loaded_between_passes_gives_a_fresh_models_numbers(tmp_path, checked_runs):
    t = _trainer(tmp_path / "a")
    samples = t.task.data["train"][:6]
    t.model.options = EngineOptions(runner="device")
    t.loss_and_grads(samples)
    other = _trainer(tmp_path / "b")
    for p in other.params.values():
        p.value[...] = np.random.default_rng(1).normal(size=p.value.shape)
    checkpoint.save(tmp_path / "ck.npz", other.params)
    checkpoint.load(tmp_path / "ck.npz", t.params)   # (in place: the same arrays, new values)
    fresh = _trainer(tmp_path / "c")
    checkpoint.load(tmp_path / "ck.npz", fresh.params)
    fresh.model.options = EngineOptions(runner="device")
    _same(fresh.loss_and_grads(samples), t.loss_and_grads(samples))


def test_statics_copied_then_not_and_blocks_then_none(tmp_path, checked_runs, monkeypatch):
    """A run that copies transposed statics (their twins in the table's last row) followed by one that does
    not, and a pass with block rows followed by one without (their buffers unbound): no twin or block buffer
    of the earlier run is left in the table."""
    monkeypatch.setattr(linked_head, "refusal", lambda *args: "apart: F's table holds its blocks and tasks alone")
    t = _trainer(tmp_path, "var_lstm")
    samples = t.task.data["train"][:10]
    for threshold in (1, 10 ** 9, 1):
        monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", threshold)
        python, native = _both(t, samples)
        _same(python, native)
        bound = [c_runner._TABLES[p] for p, _ in checked_runs[-2:]]
        assert not any(b.info[4].any() for b in bound)
    # a pass whose table has block rows, then one without (a batch whose blocks the test drops: their
    # buffers left unbound), then with again
    real = program.block_rows

    def without_blocks(lowered, *args, **kwargs):
        pre, post = real(lowered, *args, **kwargs)
        return pre[:0], post[:0]
    for blocks in (True, False, True):
        monkeypatch.setattr(program, "block_rows", real if blocks else without_blocks)
        native = t.loss_and_grads(samples)   # (the model's options: the C runner, from _both)
        assert all((len(s.program.table) > len(s.program.task_table)) == blocks for s in native.states.values())
        if blocks:
            _same(python, native)
        for lowered, _ in checked_runs[-2:]:
            bound = c_runner._TABLES[lowered]
            unbound = [i for i in range(lowered.task_keys or len(lowered.keys), len(lowered.keys) - 1)]
            assert blocks or not bound.info[:4, unbound].any()


def test_a_failed_run_leaves_no_table_behind(tmp_path, monkeypatch):
    t = _trainer(tmp_path)
    samples = t.task.data["train"][:4]
    t.model.options = EngineOptions(runner="device")
    expected = t.loss_and_grads(samples)
    real = c_runner._Entries.static
    failing = []

    def broken(self, i, operand, in_tasks):   # (a static's entry, after some entries were bound)
        failing.append(self.bound)
        raise RuntimeError("binding an entry failed (test)")
    monkeypatch.setattr(c_runner._Entries, "static", broken)
    with pytest.raises(RuntimeError, match="binding an entry failed"):
        t.loss_and_grads(samples)
    assert failing and all(table not in c_runner._TABLES.values() for table in failing)
    monkeypatch.setattr(c_runner._Entries, "static", real)
    _same(expected, t.loss_and_grads(samples))
    assert len(c_runner._TABLES) and all(table not in c_runner._TABLES.values() for table in failing)


def test_bad_input_after_a_kept_table_still_gets_its_error(tmp_path):
    """A label out of range after good passes: the same clear error as on a first pass, and nothing changed."""
    t = _trainer(tmp_path)
    t.model.options = EngineOptions(runner="device")
    samples = t.task.data["train"][:4]
    before = t.loss_and_grads(samples)
    graphs, feeds = t.task.batch(samples)
    bad = dict(feeds)
    label = next(k for k, v in feeds.items() if "label" in str(k))
    bad[label] = np.full_like(np.asarray(feeds[label]), 10 ** 6)
    with pytest.raises(Exception, match="out of range"):
        t.model.forward_backward(graphs, bad, t.params, t.context(True))
    _same(before, t.loss_and_grads(samples))


def test_a_program_that_has_not_run_since_keeps_no_outgrown_buffer_alive():
    """Issue 44: a table is kept per linked program (one per set of kinds a batch holds, forward and
    backward), and one that held its arrays strongly kept the workspace's buffers of its last run alive
    after the workspace had outgrown them: a generation of buffers per idle program (TreeLSTM-2Type's RSS
    rose by more than its workspace grew). One-tree batches until one lacks a kind (its own programs), then a
    larger batch of every kind: the buffers it outgrew are freed."""
    t = Trainer(MODELS / "tree_lstm_2type.yaml", TINY["tree_lstm_2type"], run_dir=None)
    data = t.task.data["train"]
    t.loss_and_grads(data[:1])
    workspace = next(iter(t.model._workspaces.values()))
    programs = len(workspace.programs)
    for sample in data[1:]:
        t.loss_and_grads([sample])
        if len(workspace.programs) > programs:   # (a batch without one of the kinds)
            break
    assert len(workspace.programs) > programs, "no one-tree batch without a kind: the test checks nothing"
    small = [(d, weakref.ref(d.buffer)) for pool in (workspace.forward, workspace.backward, workspace.scatters,
                                                    workspace.arenas) for d in pool.values()]
    t.loss_and_grads(data[:40])   # (the programs of every kind: the buffers grow)
    gc.collect()
    outgrown = [ref for d, ref in small if ref() is not d.buffer]
    assert len(outgrown) >= len(small) // 2, "the workspace did not grow: the test checks nothing"
    assert all(ref() is None for ref in outgrown), \
        f"{sum(ref() is not None for ref in outgrown)} of {len(outgrown)} outgrown buffers kept alive"


def test_prefix_of_a_dynamic_tensor_is_only_its_last_resize():
    t = DynamicTensor("x", (3,), np.float32)
    first = t.resize(4)
    assert t.prefix(first)[0] is t.buffer and t.prefix(first)[1] == 12
    again = t.resize(2)
    assert t.prefix(first) is first and t.prefix(again)[1] == 6   # (an older view: not known to be a prefix)
    grown = t.resize(100)
    buf, used = t.prefix(grown)
    assert buf is t.buffer and used == 300 and buf.base is None and _address(buf) == _address(grown)
    assert t.prefix(t.buffer[1:3]) is not None and type(t.prefix(t.buffer[1:3])) is not tuple


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_read_only_parameters_keep_their_transposed_copies_across_batches(dtype, tmp_path, monkeypatch):
    """ParameterSet.read_only (a loaded model's parameters): the C runner makes a static's transposed copies
    once and keeps them from batch to batch (here a twin of the Tree-LSTM's near-square U, TWIN_ELEMENTS lowered
    so the tiny model has one), even in a batch with too few rows for copies per batch; the outputs equal those
    of the writable parameters (copies per batch, or none) and the reference runner's."""
    monkeypatch.setattr(c_runner, "TWIN_ELEMENTS", 1)
    t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + [f"train.dtype={dtype}"], run_dir=tmp_path)
    made = []   # (the shape transposed, of each transposed copy the C runner makes)
    real = c_runner._transposed
    monkeypatch.setattr(c_runner, "_transposed", lambda *a: made.append(a[2:4]) or real(*a))
    real_library = c_runner.library

    def recording(d):
        lib = real_library(d)
        monkeypatch.setattr(lib, "contiguous", lambda a, f=type(lib).contiguous: made.append(a.shape[::-1])
                            or f(lib, a), raising=False)
        return lib

    monkeypatch.setattr(c_runner, "library", recording)
    samples = t.task.data["train"][:6]

    def infer(options):
        graphs, feeds = t.task.batch(samples)
        return t.model.infer(graphs, feeds, t.params, t.context(training=False), options=options).outputs

    writable = infer(EngineOptions(runner="device", check=True))
    U = t.params["U"].value
    assert U.shape not in made   # (six trees: too few rows in F's tasks for copies per batch)
    t.params.read_only()
    assert not U.flags.writeable and (U.base is None or not U.base.flags.writeable)   # (a planned buffer too)
    with pytest.raises(ValueError, match="read-only"):
        U[0, 0] = 1.0
    kept = [infer(EngineOptions(runner="device", check=True)) for _ in range(3)]
    assert made.count(U.shape) == 1, made   # U's twin: made in the first batch, kept for the next two
    reference = infer(EngineOptions(runner="reference"))
    for out in kept:
        assert out.keys() == writable.keys()
        for k in out:
            close(out[k], writable[k], dtype)
            close(out[k], reference[k], dtype)


@pytest.mark.parametrize("name", ["tree_lstm", "var_lstm"])
def test_products_by_a_packed_static_give_the_reference_numbers(name, tmp_path, monkeypatch):
    """Multi-row products by a static read its copy packed for the run (codegen/packed_gemm.py), transposed
    statics (∂F's Uᵀ) included, bias added by the kernel: the reference runner's numbers at widths that are not
    a multiple of a panel's. That the packed copies are what the products read: zeroed, the numbers change."""
    interp = c_runner.c_interpreter.interpreter(np.float32)
    if interp is None or not interp.packed_nr:
        pytest.skip("no packed product here (float32 with AVX-512 only)")
    t = Trainer(MODELS / f"{name}.yaml", TINY[name] + ["train.dtype=float32", "model.hidden=45"], run_dir=tmp_path)
    samples = t.task.data["train"][:20]
    monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", 1)
    monkeypatch.setattr(c_runner, "PACKED_STATICS_ROWS", 1)
    packed, real = [], c_runner._Entries.pack
    monkeypatch.setattr(c_runner._Entries, "pack",
                        lambda self, i, op, *rest: packed.append(op.source.shape) or real(self, i, op, *rest))
    python, native = _both(t, samples)
    _same(python, native, "float32")
    assert any(shape[0] > shape[1] for shape in packed) and any(shape[0] < shape[1] for shape in packed), packed
    assert not any(b.info[5:].any() for b in c_runner._TABLES.values())   # (let go after the call)

    def zeroed(self, i, op, *rest):
        real(self, i, op, *rest)
        self.bound.packs[i][...] = 0
    monkeypatch.setattr(c_runner._Entries, "pack", zeroed)
    with pytest.raises(AssertionError):
        _same(t.loss_and_grads(samples), native, "float32")


def test_read_only_statics_are_packed_once_for_every_batch(tmp_path, monkeypatch):
    """A read-only static's packed copy (codegen/packed_gemm.py) is made in the first batch and read by the next
    ones (not packed again), with the reference runner's numbers."""
    interp = c_runner.c_interpreter.interpreter(np.float32)
    if interp is None or not interp.packed_nr:
        pytest.skip("no packed product here (float32 with AVX-512 only)")
    monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", 1)
    monkeypatch.setattr(c_runner, "PACKED_STATICS_ROWS", 1)
    t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + ["train.dtype=float32", "model.hidden=45"],
                run_dir=tmp_path)
    t.params.read_only()
    graphs, feeds = t.task.batch(t.task.data["train"][:20])

    def kept_packs() -> set:
        return {id(copy) for _, copies in c_runner._KEPT.values() for key, copy in copies.items() if key[0] == "packed"}

    runs, packs = [], []
    for _ in range(3):
        runs.append(t.model.infer(graphs, feeds, t.params, t.context(training=False),
                                  options=EngineOptions(runner="device", check=True)).outputs)
        packs.append(kept_packs())
    assert packs[0] and packs[0] == packs[1] == packs[2]
    reference = t.model.infer(graphs, feeds, t.params, t.context(training=False),
                              options=EngineOptions(runner="reference")).outputs
    for out in runs:
        for k in out:
            close(out[k], reference[k], "float32")


def test_only_statics_that_products_read_as_b_get_a_transposed_twin(tmp_path, monkeypatch):
    """A twin (a static's transposed copy, made per run) serves a product's B, multiplied as C^T = B^T·A^T; a
    static that no product reads as B (the static graph's per-vertex h, read as A by the loss's products and
    their gradients) gets none (TWIN_ELEMENTS lowered so the tiny model's statics qualify by shape), with the
    reference runner's numbers."""
    monkeypatch.setattr(c_runner, "TWIN_ELEMENTS", 1)
    monkeypatch.setattr(c_runner, "CONTIGUOUS_STATICS_ROWS", 1)
    t = Trainer(MODELS / "tree_lstm.yaml", TINY["tree_lstm"] + ["train.dtype=float64", "model.hidden=45"],
                run_dir=tmp_path)
    twins = []   # (pass, static's buffer, whether a GEMM reads it as B) of each twin a run bound
    real = c_runner._bind_entries

    def bind(program, *args, **kwargs):
        entries = real(program, *args, **kwargs)
        read_as_b = c_runner._product_statics(program.lowered)
        twins.extend((program.lowered.title, int(i), int(i) in read_as_b)
                     for i in np.flatnonzero(entries.bound.info[4]))
        return entries

    monkeypatch.setattr(c_runner, "_bind_entries", bind)
    python, native = _both(t, t.task.data["train"][:20])
    _same(python, native)
    assert any(is_b for _, _, is_b in twins), twins   # (some static is twinned: the check is not vacuous)
    assert all(is_b for _, _, is_b in twins), twins


SEQ2SEQ = ["model.hidden=8", "model.embed=4", "model.max_len=4", "data.synthetic.train=64", "data.synthetic.dev=2",
           "data.synthetic.test=2"]


def _seq2seq(tmp_path, dtype: str) -> Trainer:
    return Trainer(MODELS / "seq2seq.yaml", SEQ2SEQ + [f"train.dtype={dtype}"], run_dir=tmp_path)


def test_a_loop_program_packs_the_statics_its_steps_multiply_by(tmp_path, monkeypatch):
    """A static program's loops multiply the task's rows by a static at every step, so the rows a run's
    products read are the rows times the steps (c_runner._product_repeats): seq2seq's 32 rows by its decoder's
    W_h at 5 steps reach a threshold that 32 rows alone do not, and the statics the steps multiply by are packed,
    the parameters' transposes that the gradient loops read included; the reference runner's numbers, also
    after a parameter's array is replaced (a packing call kept for the old array is not reused)."""
    interp = c_runner.c_interpreter.interpreter(np.float32)
    if interp is None or not interp.packed_nr:
        pytest.skip("no packed product here (float32 with AVX-512 only)")
    monkeypatch.setattr(c_runner, "PACKED_STATICS_ROWS", 100)
    t = _seq2seq(tmp_path, "float32")
    packed, real = [], c_runner._Entries.pack
    monkeypatch.setattr(c_runner._Entries, "pack",
                        lambda self, i, op, *rest: packed.append((op.source.shape, op.transposed))
                        or real(self, i, op, *rest))
    python, native = _both(t, t.task.data["train"][:32])
    _same(python, native, "float32")
    assert ((8, 32), 0) in packed and ((32, 8), 1) in packed, packed   # W_h (hidden x 4 hidden) and W_hᵀ
    t.params["dec_Wh"].value = t.params["dec_Wh"].value * 0.5   # (a new array: its kept packing call is not reused)
    python, native = _both(t, t.task.data["train"][:32])
    _same(python, native, "float32")


def test_a_static_program_of_many_rows_keeps_its_statics_and_makes_no_twin(tmp_path, monkeypatch):
    """A static program whose task has more rows than SMALL_M_ROWS gets no transposed twin (only products of 2
    to SMALL_M_ROWS rows read one: seq2seq's 64 rows made four a step that no product read), and a second run
    binds again only the statics that are new operands (the batch's feeds), not the parameters or literals
    whose entries the first run left; the reference runner's numbers."""
    t = _seq2seq(tmp_path, "float64")
    bound, twins = [], []
    real_static, real_twin = c_runner._Entries.static, c_runner._Entries.twin
    monkeypatch.setattr(c_runner._Entries, "static",
                        lambda self, i, op, *rest: bound.append(op.source) or real_static(self, i, op, *rest))
    monkeypatch.setattr(c_runner._Entries, "twin",
                        lambda self, i, *rest: twins.append(i) or real_twin(self, i, *rest))
    samples = t.task.data["train"][:64]
    _same(*_both(t, samples))
    bound.clear()
    t.model.options = EngineOptions(runner="device")
    _same(t.loss_and_grads(samples), _both(t, samples)[0])
    assert not twins
    params = [p.value for p in t.params.values()]
    assert bound and not any(a is p for a in bound for p in params), [a.shape for a in bound]
    assert all(a.flags.writeable for a in bound)   # (no literal: those are read-only)
