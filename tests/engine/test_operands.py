"""The one binder (minicavs/engine/operands.py): every buffer of a pass resolved once into the seam's Operands, which
is all a runner receives. Runners look up no buffer, keep nothing on the program objects, and take the bound
program alone; each operand is the buffer the key names, laid out as the runners address it."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from minicavs.cpu import CPU, c_runner
from minicavs.cuda import issue
from minicavs.engine import program as binding, reference
from minicavs.engine.backend import Backend, Operand
from minicavs.engine.compile import EngineOptions
from minicavs.engine.lowered import Lowered

from ..models.test_models import trainer

CACHED = {"block_scratch", "c_refusal", "eager_accumulators"}   # the program's own derived facts (functools.cached_property)


def test_every_runner_takes_the_bound_program_alone():
    assert list(inspect.signature(Backend.run).parameters) == ["self", "program"]
    assert list(inspect.signature(Backend.runner_declines).parameters) == ["self", "program"]
    assert list(inspect.signature(c_runner.run).parameters) == ["program", "clock"]
    assert list(inspect.signature(reference.run).parameters) == ["program", "device"]
    assert list(inspect.signature(issue.run).parameters) == ["program", "device", "tf32"]


@pytest.mark.parametrize("runner", ["device", "reference"])
@pytest.mark.parametrize("name, streaming", [("tree_lstm", False), ("var_lstm", True), ("tree_fc", False)])
def test_runners_look_up_no_buffer_and_leave_nothing_on_the_program(name, streaming, runner, tmp_path,
                                                                    monkeypatch):
    """While a runner runs (the C runner through the CPU's Backend.run, or the reference runner), no buffer key is
    resolved: the binder did it before. Afterwards the linked programs hold only their own fields."""
    t = trainer(name, tmp_path)
    t.model.options = EngineOptions(runner=runner, streaming=streaming)
    inside, looked_up = [0], []
    lookup = binding.Buffers.__getitem__

    def recording(self, key):
        if inside[0]:
            looked_up.append(key)
        return lookup(self, key)

    def entered(run):
        def wrapped(*args, **kwargs):
            inside[0] += 1
            try:
                return run(*args, **kwargs)
            finally:
                inside[0] -= 1
        return wrapped
    monkeypatch.setattr(binding.Buffers, "__getitem__", recording)
    monkeypatch.setattr(type(CPU), "run", entered(type(CPU).run))
    monkeypatch.setattr(reference, "run", entered(reference.run))
    result = t.loss_and_grads(t.task.data["train"][:6])
    assert not looked_up, looked_up
    fields = {f.name for f in dataclasses.fields(Lowered)}
    for state in result.states.values():
        for program in (state.program, state.backward_program):
            assert program.runner == ("C runner" if runner == "device" else "reference runner")
            assert set(vars(program.lowered)) <= fields | CACHED, set(vars(program.lowered)) - fields
            assert program.bound is not None and len(program.operands) == len(program.lowered.keys)


def test_each_operand_is_its_buffer_as_the_runners_address_it(tmp_path):
    """Per operand: the array its key resolves to (a transposed static: its contiguous transpose, read through the
    flag; a block of a planned parameter buffer: the memory it spans, at its row stride), contiguous, with the
    elements the pass may touch; index arrays as int64 (row keys uint64) with their host copy; the gradient
    accumulators named by parameter."""
    t = trainer("tree_lstm", tmp_path)
    result = t.loss_and_grads(t.task.data["train"][:6])
    state = result.states[next(iter(result.states))]
    seen = set()
    for program in (state.program, state.backward_program):
        for key, operand in zip(program.lowered.keys, program.operands):
            if operand is None:
                continue
            assert isinstance(operand, Operand) and operand.kind == key[0]
            assert operand.array.flags.c_contiguous and 0 <= operand.elements <= operand.array.size, (key, operand)
            seen.add(key[0])
            if key[0] in ("scratch", "fixed"):
                continue
            if key[0] == "pgrad":   # (made by the lookup: the accumulator the program's gradients name)
                named = program.gradients[key[1][0][0] if len(key) == 3 and key[2] == "block" else key[1]]
                assert np.shares_memory(named, operand.array), key
                continue
            a = program.buffers[key]
            a = a[0] if type(a) is tuple else a
            if key[0] == "static":
                if operand.transposed and operand.array.ndim == 2:
                    assert operand.array.base is a or operand.array is a.T or np.shares_memory(operand.array, a)
                    np.testing.assert_array_equal(operand.array.T, a)
                elif operand.array.ndim == 1 and a.ndim == 2:   # a planned block, read in place
                    assert np.shares_memory(operand.array, a)
                    got = np.lib.stride_tricks.as_strided(operand.array, a.T.shape if operand.transposed else a.shape,
                                                          (operand.ld * a.itemsize, a.itemsize))
                    np.testing.assert_array_equal(got.T if operand.transposed else got, a)
                else:
                    np.testing.assert_array_equal(operand.array.reshape(a.shape), a)
            elif operand.host is not None:
                assert operand.host.dtype == (np.uint64 if key[0] == "rowkeys" else np.int64)
                np.testing.assert_array_equal(operand.host, np.asarray(a).reshape(-1).astype(operand.host.dtype))
                assert operand.array is operand.host   # (the CPU: one array serves both)
            else:
                assert operand.array is a, key
        for name, accumulator in program.gradients.items():
            assert name in t.params and accumulator.shape == t.params[name].value.shape
    assert {"static", "tensor", "child", "scratch", "pgrad"} <= seen, seen


PROTOCOL = {name for name in dir(Backend) if not name.startswith("_")}


class OnlyTheProtocol(Backend):
    """A device that answers only what the Backend protocol lists (forwarding to the device it wraps): anything
    else the engine asks for is an AttributeError naming it, and is recorded in ``outside`` (a ``getattr`` with a
    default would swallow the error: a probe)."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "outside", [])

    def __getattribute__(self, name):
        if name.startswith("__") or name in ("_inner", "outside"):
            return object.__getattribute__(self, name)
        if name not in PROTOCOL:
            object.__getattribute__(self, "outside").append(name)
            raise AttributeError(f"the engine asked a device for {name!r}, which the Backend protocol does not list")
        return getattr(object.__getattribute__(self, "_inner"), name)


@pytest.mark.parametrize("runner, streaming", [("device", False), ("device", True), ("reference", False)])
def test_the_engine_asks_a_device_only_what_the_protocol_lists(runner, streaming, tmp_path):
    """A training step (forward, backward, the optimizer's update) and inference on a device that refuses every
    attribute outside the Backend protocol: the same numbers as on the CPU itself."""
    want = trainer("tree_lstm", tmp_path / "cpu")
    got = trainer("tree_lstm", tmp_path / "strict")
    got.model.device = OnlyTheProtocol(CPU)
    samples = want.task.data["train"][:5]
    for t in (want, got):
        t.model.options = EngineOptions(runner=runner, streaming=streaming)
        result = t.loss_and_grads(samples)
        t.optimizer.step(result.grads, loss=result.loss)
        t.result = result
    assert got.result.loss == want.result.loss
    for name in want.params:
        np.testing.assert_array_equal(got.params[name].value, want.params[name].value, err_msg=name)
    graphs, feeds = got.task.batch(samples)
    got.model.infer(graphs, feeds, got.params, got.context(training=False))
    assert not got.model.device.outside, got.model.device.outside


@pytest.mark.parametrize("from_c", [True, False])
def test_on_the_emulated_device_the_engine_asks_only_what_the_protocol_lists(cuda_standin, from_c, tmp_path):
    """The same on the CUDA backend (the stand-in's arrays): the CUDA runner, or with ``issue_from_c`` off the
    reference runner over the device's arrays (its index copies, row and fused kernels through the protocol)."""
    from minicavs.cuda import Cuda
    want = trainer("tree_lstm", tmp_path / "cpu")
    got = trainer("tree_lstm", tmp_path / "strict", "train.device=cuda")
    inner = Cuda(cuda_standin, issue_from_c=from_c)
    got.model.device = OnlyTheProtocol(inner)
    samples = want.task.data["train"][:4]
    a, b = want.loss_and_grads(samples), got.loss_and_grads(samples)
    assert abs(float(inner.to_host(b.loss)) - float(a.loss)) <= 1e-4 * max(1.0, abs(float(a.loss)))
    for state in b.states.values():
        assert state.program.runner == ("cuda runner" if from_c else "reference runner")
    assert not got.model.device.outside, got.model.device.outside


def test_the_binders_getters_resolve_every_key_as_the_lookup_does(tmp_path):
    """The binder finds, once per program, how each entry's key is resolved (Buffers.getter: the method and its
    arguments, without the per-batch dispatch on the key); each resolves to what ``buffers[key]`` gives, for F and ∂F
    (the linked head's keys included); a mapping without ``getter`` is looked up by key; a key no method resolves
    (an arena's) falls back to the lookup itself."""
    from minicavs.engine.operands import _memo
    t = trainer("tree_lstm", tmp_path)
    result = t.loss_and_grads(t.task.data["train"][:3])
    state = result.states[next(iter(result.states))]
    for program in (state.program, state.backward_program):
        buffers = program.buffers
        getters = _memo(program.lowered, state.workspace).getters_for(buffers)
        assert len(getters) == len(program.lowered.keys)
        for key, (get, args) in zip(program.lowered.keys, getters):
            if key[0] in ("scratch", "fixed", "pgrad", "dropout"):   # (made per call: compared by what they are)
                continue
            want, got = buffers[key], get(buffers, *args)
            want, got = (want, got) if type(want) is tuple else ((want,), (got,))   # ((buffer, elements): a prefix)
            assert len(got) == len(want), key
            for x, y in zip(got, want):
                assert type(x) is type(y) and (x is y or np.array_equal(x, y)), key
    assert binding.Buffers.getter(("fixed",)) == (binding.Buffers.__getitem__, (("fixed",),))
    plain = {("child", 0, 1): np.arange(3)}
    get, args = _memo(state.program.lowered, None).getters_for(plain)[0]
    assert get is dict.__getitem__ and args == (state.program.lowered.keys[0],)
