"""Checkpoints: exact round trips, atomic writes, and load errors that leave the model untouched."""
import json
import os
import re

import numpy as np
import pytest

from minicavs import CheckpointError
from minicavs.train import checkpoint
from minicavs.nn import Parameter, ParameterSet
from minicavs.train.optim import SGD, Adam
from minicavs.core.sparse import RowSparse


def model(seed=0):
    return ParameterSet([Parameter("enc/W", (4, 3), rng=seed),
                         Parameter("enc/b", (3,), init="uniform(1)", rng=seed, weight_decay=False),
                         Parameter("emb/table \u00e9", (6, 2), dtype="float64", rng=seed)])


def trained(seed=0, steps=3):
    ps = model(seed)
    opt = Adam(ps, lr=0.01, weight_decay=0.01)
    rng = np.random.default_rng(seed + 100)
    for _ in range(steps):
        grads = {k: rng.standard_normal(p.shape) for k, p in ps.items()}
        grads["emb/table \u00e9"] = RowSparse(np.array([1, 1, 4]), rng.standard_normal((3, 2)), (6, 2))
        opt.step(grads)
    return ps, opt


def snapshot(ps, opt):
    return ({k: p.value.copy() for k, p in ps.items()}, opt.state_dict(), opt.steps)


def assert_same(ps, opt, snap):
    values, state, steps = snap
    for k, p in ps.items():
        assert p.value.dtype == values[k].dtype
        np.testing.assert_array_equal(p.value, values[k])
    for k, slots in state["slots"].items():
        for s, a in slots.items():
            assert opt.state[k][s].dtype == a.dtype
            np.testing.assert_array_equal(opt.state[k][s], a)
    assert opt.steps == steps


def test_round_trip_is_bit_exact(tmp_path):
    ps, opt = trained()
    path = tmp_path / "ck.npz"
    checkpoint.save(path, ps, opt, extra={"data": {"epoch": 2, "offset": 17}, "rng": [1, 2 ** 70]})
    fresh_ps = model(seed=5)
    fresh_opt = Adam(fresh_ps, lr=0.01, weight_decay=0.01)
    assert not np.array_equal(fresh_ps["enc/W"].value, ps["enc/W"].value)
    ck = checkpoint.load(path, fresh_ps, fresh_opt)
    assert_same(fresh_ps, fresh_opt, snapshot(ps, opt))
    assert ck.step == 3 and fresh_opt.steps == 3
    assert ck.extra == {"data": {"epoch": 2, "offset": 17}, "rng": [1, 2 ** 70]}
    assert ck.meta["format"] == checkpoint.FORMAT and ck.meta["version"] == checkpoint.VERSION


def test_resumed_training_matches_uninterrupted(tmp_path):
    ps, opt = trained(steps=2)
    checkpoint.save(tmp_path / "ck", ps, opt)
    ps2 = model(seed=9)
    opt2 = Adam(ps2, lr=0.01, weight_decay=0.01)
    checkpoint.load(tmp_path / "ck", ps2, opt2)
    g = {k: np.full(p.shape, 0.5) for k, p in ps.items()}
    opt.step(g)
    opt2.step(g)
    for k in ps:
        np.testing.assert_array_equal(ps[k].value, ps2[k].value)


def test_load_assigns_in_place_and_read_needs_no_model(tmp_path):
    ps, opt = trained()
    checkpoint.save(tmp_path / "ck", ps, step=42)  # no optimizer; explicit step
    target = model(seed=1)
    arrays = {k: p.value for k, p in target.items()}
    ck = checkpoint.load(tmp_path / "ck", target)
    assert ck.step == 42 and ck.optimizer is None
    for k in target:
        assert target[k].value is arrays[k]  # same array objects: references elsewhere stay valid
        np.testing.assert_array_equal(arrays[k], ps[k].value)
    ck = checkpoint.read(tmp_path / "ck")
    assert list(ck.params) == list(ps) and ck.params["enc/b"].dtype == np.float32


def test_restores_by_name_not_position(tmp_path):
    ps, opt = trained()
    checkpoint.save(tmp_path / "ck", ps, opt)
    reordered = ParameterSet(reversed(list(model(seed=3).values())))
    opt2 = Adam(reordered, lr=0.01)
    checkpoint.load(tmp_path / "ck", reordered, opt2)
    for k in ps:
        np.testing.assert_array_equal(reordered[k].value, ps[k].value)
        np.testing.assert_array_equal(opt2.state[k]["v"], opt.state[k]["v"])


def test_plain_arrays_and_default_step(tmp_path):
    checkpoint.save(tmp_path / "ck", {"w": np.arange(3.0)})
    ck = checkpoint.read(tmp_path / "ck")
    assert ck.step == 0 and ck.extra == {}
    np.testing.assert_array_equal(ck.params["w"], [0.0, 1.0, 2.0])


def test_metadata_is_json_in_the_npz(tmp_path):
    ps, opt = trained()
    checkpoint.save(tmp_path / "ck.npz", ps, opt)
    with np.load(tmp_path / "ck.npz", allow_pickle=False) as z:
        meta = json.loads(z["__meta__"].tobytes().decode())
        assert meta["params"][0] == {"name": "enc/W", "key": "param/enc/W", "shape": [4, 3], "dtype": "float32"}
        assert meta["optimizer"]["type"] == "Adam" and meta["optimizer"]["steps"] == 3
        key = meta["optimizer"]["slots"]["enc/b"]["v"]
        np.testing.assert_array_equal(z[key], opt.state["enc/b"]["v"])


@pytest.mark.parametrize("name, key", [
    ("W", "param/W"), ("enc/W", "param/enc/W"), ("cell.U_f-1", "param/cell.U_f-1"),
    ("__meta__", "param/__meta__"),                        # no clash with the metadata entry
    ("emb/table \u00e9", "p0"), ("a b", "p0"), ("../up", "p0"), ("a//b", "p0"), ("/abs", "p0"), ("a/", "p0"),
    ("x\\y", "p0"), ("a/./b", "p0")])
def test_arrays_are_stored_under_their_parameter_names(tmp_path, name, key):
    """Plain names are readable keys of the .npz (its arrays can be read with numpy alone); any other name
    gets an opaque key, and both read back by name."""
    ps = ParameterSet([Parameter(name, (2, 3), dtype="float64", rng=0)])
    opt = Adam(ps, lr=0.1)
    opt.step({name: np.ones((2, 3))})
    value = ps[name].value.copy()
    checkpoint.save(tmp_path / "ck.npz", ps, opt)
    with np.load(tmp_path / "ck.npz", allow_pickle=False) as z:
        np.testing.assert_array_equal(z[key], value)
        slot_keys = {k for k in z.files if k not in (key, "__meta__")}
        assert slot_keys == ({f"slot/{name}/m", f"slot/{name}/v"} if key != "p0" else {"o0", "o1"})
    ck = checkpoint.read(tmp_path / "ck.npz")
    np.testing.assert_array_equal(ck.params[name], value)
    np.testing.assert_array_equal(ck.optimizer["slots"][name]["m"], opt.state[name]["m"])


def test_files_with_the_older_opaque_keys_still_load(tmp_path, monkeypatch):
    """Files written before keys were readable hold every array under p0, o0, ... (the writer then)."""
    ps, opt = trained()
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_array_key", lambda readable, name, opaque, taken: opaque)
        checkpoint.save(tmp_path / "old.npz", ps, opt)
    with np.load(tmp_path / "old.npz", allow_pickle=False) as z:
        assert sorted(z.files) == sorted(["__meta__"] + [f"p{i}" for i in range(3)] + [f"o{i}" for i in range(6)])
    fresh_ps = model(seed=5)
    fresh_opt = Adam(fresh_ps, lr=0.01, weight_decay=0.01)
    checkpoint.load(tmp_path / "old.npz", fresh_ps, fresh_opt)
    assert_same(fresh_ps, fresh_opt, snapshot(ps, opt))


# --- atomic writes ----------------------------------------------------------------------------------


def failing_savez(f, **arrays):
    f.write(b"PK\x03\x04 half a zip file")
    raise OSError("disk full")


def failing_replace(src, dst):
    raise OSError("rename failed")


@pytest.mark.parametrize("target, fake", [("savez", failing_savez), ("replace", failing_replace)])
def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch, target, fake):
    old_ps, old_opt = trained(seed=0)
    path = tmp_path / "ck.npz"
    checkpoint.save(path, old_ps, old_opt)
    before = path.read_bytes()
    new_ps, new_opt = trained(seed=1, steps=5)
    monkeypatch.setattr(np if target == "savez" else os, target, fake)
    with pytest.raises(OSError):
        checkpoint.save(path, new_ps, new_opt)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ck.npz"]  # no temp file left behind
    assert checkpoint.read(path).step == 3


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_file_gets_umask_permissions(tmp_path):
    mask = os.umask(0o022)
    os.umask(mask)
    checkpoint.save(tmp_path / "ck", model())
    assert os.stat(tmp_path / "ck").st_mode & 0o777 == 0o666 & ~mask


def test_failed_first_write_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(np, "savez", failing_savez)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path / "ck", model())
    assert os.listdir(tmp_path) == []


def test_bad_extra_is_refused_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match="not plain JSON"):
        checkpoint.save(tmp_path / "ck", model(), extra={"when": object()})
    with pytest.raises(CheckpointError, match="not plain JSON"):
        checkpoint.save(tmp_path / "ck", model(), extra={"x": float("nan")})
    assert os.listdir(tmp_path) == []


# --- load errors change nothing ---------------------------------------------------------------------


def rewrite(path, edit_meta=None, edit_arrays=None):
    """Write a modified copy of a valid checkpoint (bypassing minicavs) to test the reader."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["__meta__"].tobytes().decode())
    if edit_meta:
        edit_meta(meta)
    if edit_arrays:
        edit_arrays(arrays)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.fixture
def saved(tmp_path):
    ps, opt = trained()
    path = tmp_path / "ck.npz"
    checkpoint.save(path, ps, opt)
    return path


def fresh_target():
    ps = model(seed=7)
    opt = Adam(ps, lr=0.01)
    opt.step({"enc/W": np.ones((4, 3))})  # state that must survive a failed load
    return ps, opt


def expect_load_error(path, ps, opt, match):
    snap = snapshot(ps, opt)
    with pytest.raises(CheckpointError, match=match) as info:
        checkpoint.load(path, ps, opt)
    assert str(path) in str(info.value)
    assert_same(ps, opt, snap)


def test_missing_parameter(saved):
    ps, opt = fresh_target()
    ps.new("dec/W", (2, 2))
    opt = Adam(ps, lr=0.01)
    expect_load_error(saved, ps, opt, "parameter 'dec/W' is missing")


def test_unexpected_parameter(saved):
    ps = ParameterSet([p for k, p in model(seed=7).items() if k != "enc/b"])
    opt = Adam(ps, lr=0.01)
    expect_load_error(saved, ps, opt, "unexpected parameter 'enc/b'")


@pytest.mark.parametrize("shape, dtype, match", [((3, 4), "float32", r"'enc/W' is float32\(4, 3\)"),
                                                 ((4, 3), "float64", r"'enc/W' is float32\(4, 3\)")])
def test_shape_or_dtype_mismatch(saved, shape, dtype, match):
    ps = model(seed=7)
    mismatched = ParameterSet([Parameter("enc/W", shape, dtype=dtype)]
                              + [p for k, p in ps.items() if k != "enc/W"])
    opt = Adam(mismatched, lr=0.01)
    expect_load_error(saved, mismatched, opt, match)


def test_optimizer_mismatch(saved, tmp_path):
    ps, _ = fresh_target()
    expect_load_error(saved, ps, SGD(ps, lr=0.1, momentum=0.9), "state is for 'Adam'")
    checkpoint.save(tmp_path / "params_only", trained()[0])
    ps, opt = fresh_target()
    expect_load_error(tmp_path / "params_only", ps, opt, "no optimizer state")


def test_misshaped_optimizer_slot(saved):
    def edit(arrays):
        arrays["slot/enc/W/m"] = np.zeros((1, 1), np.float32)
    rewrite(saved, edit_arrays=edit)
    ps, opt = fresh_target()
    expect_load_error(saved, ps, opt, "slot 'm' of parameter 'enc/W'")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format="something-else"), "format is 'something-else'"),
    (lambda m: m.update(version=checkpoint.VERSION + 1), "version 2 is not supported"),
    (lambda m: m.update(version="1"), "version '1' is not supported"),
    (lambda m: m.update(version=True), "version True is not supported"),
    (lambda m: m.pop("params"), "metadata is malformed"),
    (lambda m: m["params"][0].update(shape=[3, 4]), "metadata says"),
    (lambda m: m["params"][1].update(key="p99"), "'p99' of parameter 'enc/b' is missing"),
])
def test_bad_metadata(saved, edit, match):
    rewrite(saved, edit_meta=edit)
    ps, opt = fresh_target()
    expect_load_error(saved, ps, opt, match)


def test_not_json_and_no_metadata(saved, tmp_path):
    rewrite(saved, edit_arrays=lambda a: None)
    with np.load(saved) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["__meta__"] = np.frombuffer(b"{not json", np.uint8)
    np.savez(tmp_path / "bad_json.npz", **arrays)
    del arrays["__meta__"]
    np.savez(tmp_path / "no_meta.npz", **arrays)
    ps, opt = fresh_target()
    expect_load_error(tmp_path / "bad_json.npz", ps, opt, "not valid JSON")
    expect_load_error(tmp_path / "no_meta.npz", ps, opt, "no metadata entry")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip", "empty"])
def test_corrupt_file(saved, damage):
    data = bytearray(saved.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"this is not a zip file at all" * 10)
    elif damage == "flip":
        i = data.index(b".npy") + 200  # inside the first parameter's data: the zip CRC catches it
        data[i] ^= 0xFF
    else:
        data = bytearray()
    saved.write_bytes(bytes(data))
    ps, opt = fresh_target()
    expect_load_error(saved, ps, opt, "corrupt or not a checkpoint")
    with pytest.raises(CheckpointError) as info:
        checkpoint.read(saved)
    assert str(info.value).count(str(saved)) == 1


def test_missing_file(tmp_path):
    ps, opt = fresh_target()
    expect_load_error(tmp_path / "nope.npz", ps, opt, "no checkpoint file")


# --- non-finite values: refused on read, naming the file and the array --------------------------------


def _meta(path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return json.loads(z["__meta__"].tobytes().decode())


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["enc/W", "enc/b", "emb/table \u00e9", "slot m of enc/W",
                                   "slot v of emb/table \u00e9"])
@pytest.mark.parametrize("count", [1, 3])
def test_non_finite_values_are_refused_naming_the_array(saved, bad, where, count):
    meta = _meta(saved)
    if where.startswith("slot"):
        _, slot, _, name = where.split(" ", 3)
        key, what = meta["optimizer"]["slots"][name][slot], f"optimizer slot '{slot}' of parameter '{name}'"
    else:
        key, what = next(e["key"] for e in meta["params"] if e["name"] == where), f"parameter '{where}'"

    def edit(arrays):
        arrays[key] = arrays[key].copy()
        arrays[key].flat[-count:] = bad
    rewrite(saved, edit_arrays=edit)
    kind = "NaN" if np.isnan(bad) else "infinite"
    with pytest.raises(CheckpointError, match=re.escape(f"{saved}: {what} holds non-finite values ({count} {kind}, ")):
        checkpoint.read(saved)
    ps, opt = fresh_target()
    expect_load_error(saved, ps, opt, "non-finite")
    assert checkpoint.read(saved, finite=False).step == 3     # the metadata alone stays readable


def test_integer_arrays_need_no_finiteness_check(tmp_path):
    checkpoint.save(tmp_path / "ints.npz", {"ids": np.arange(4)})
    assert checkpoint.read(tmp_path / "ints.npz").params["ids"].tolist() == [0, 1, 2, 3]


def _split_model(seed=0, views=False):
    ps = ParameterSet([Parameter(f"W.{g}", (4, 3), rng=seed, dtype="float64") for g in "ifou"]
                      + [Parameter("b", (3,), rng=seed, dtype="float64")])
    if views:
        ps.plan_buffer([f"W.{g}" for g in "ifou"])
    return ps


@pytest.mark.parametrize("saved_views, loaded_views", [(True, False), (False, True), (True, True)])
def test_parameters_laid_out_in_one_buffer_round_trip_with_plain_ones(tmp_path, saved_views, loaded_views):
    ps = _split_model(views=saved_views)
    opt = Adam(ps, lr=0.01)
    rng = np.random.default_rng(3)
    for _ in range(2):
        opt.step({k: rng.standard_normal(p.shape) for k, p in ps.items()})
    snap = snapshot(ps, opt)
    checkpoint.save(tmp_path / "ck", ps, opt)
    fresh = _split_model(seed=9, views=loaded_views)
    buffer = fresh["W.i"].value.base
    fresh_opt = Adam(fresh, lr=0.01)
    checkpoint.load(tmp_path / "ck", fresh, fresh_opt)
    assert_same(fresh, fresh_opt, snap)
    if loaded_views:   # loaded in place: still views of the one buffer, which holds the loaded values
        assert all(fresh[f"W.{g}"].value.base is buffer for g in "ifou")
        np.testing.assert_array_equal(buffer, np.concatenate([snap[0][f"W.{g}"] for g in "ifou"], axis=1))
