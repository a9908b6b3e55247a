"""Every host/device crossing of a training step on the emulated CUDA device, counted by the device stand-in,
for every bundled model: one device-to-host read a step (the loss, the global norm and the finite flags read
together by the optimizer's fused step, whose launches are counted too), and host-to-device copies that do not grow with the number of tasks (none per
task), each from a site that says why it is there."""
from __future__ import annotations

import pytest

from minicavs.core import arrays
from minicavs.train.config import REPO_ROOT
from minicavs.cuda import standin
from minicavs.ops.registry import native_kernels
from minicavs.train.trainer import Trainer

from ..models.test_models import TINY

# Where a step may copy host data to the device, and why (file:function of the copying call).
WHY_H2D = {
    "engine/backend.py:to_device": "a float feed (the seam's copy: one per feed and batch)",
    "core/arrays.py:as_module": "host indices checked on the host, then copied where a kernel reads them: "
                                "labels (forward and backward), lookup indices, row-sparse positions",
    "cuda/device.py:_plan_copy": "a batch plan's index arrays (child rows, row keys): each copied once a "
                                 "batch, sliced per task on the device (as many as the plan has arrays)",
    "cuda/device.py:index": "an index array made when a pass is bound, not sliced from a plan array (the "
                            "interleaved child rows of a kind's regathered concat): once per kind and pass",
    "engine/alg1.py:_device_index": "the scatter-gradient rows no task writes, zeroed once per batch and "
                                    "message shape (only in batches that have such rows)",
    "core/sparse.py:to_dense": "a row-sparse gradient's indices, to densify it for a dense update",
    "train/optim.py:_device_step_per_parameter": "the looked-up rows of a sparse (lazy) update",
    "train/optim.py:_fused_segments": "the looked-up rows of a sparse (lazy) update",
    "cuda/optim_kernels.py:_copy_table": "the fused optimizer step's table of this step's gradient addresses: "
                                         "one a step",
}


def _trainer(name: str, tmp_path) -> Trainer:
    overrides = [o for o in TINY[name] if not o.startswith(("model.dropout", "data.synthetic.train"))]
    config = REPO_ROOT / "models" / f"{name.replace('_child_sum', '')}.yaml"
    return Trainer(config, overrides + ["data.synthetic.train=24", "train.device=cuda"], run_dir=tmp_path / name)


def _optimizer_launches(t: Trainer) -> list:
    """The launches of the fused optimizer step's kernels so far (they run on the stand-in's native kernels)."""
    dtype = next(iter(t.params.values())).value.dtype
    return [name for name, _, _ in native_kernels(standin, dtype).launcher.launches if name.startswith("optim_")]


def _step_crossings(t: Trainer, samples: list) -> tuple[dict, dict]:
    standin.reset()
    before = len(_optimizer_launches(t))
    t.train_step(samples)
    # the optimizer's update of every parameter: report, check and apply (and the norm's two with clipping)
    assert len(_optimizer_launches(t)) - before == (5 if t.optimizer.clip_norm else 3)
    return dict(standin.crossings), {site: n for (way, site), n in standin.sites.items() if way == "h2d"}


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_training_step_reads_the_device_once_and_copies_nothing_per_task(cuda_standin, monkeypatch, name,
                                                                            tmp_path):
    monkeypatch.setattr(standin, "TRACE", True)
    t = _trainer(name, tmp_path)
    n = len(t.task.data["train"])
    copied = []   # the plan arrays copied over: each one once
    monkeypatch.setattr(type(t.device), "_plan_copy",
                        lambda self, base, _copy=type(t.device)._plan_copy: copied.append(base) or _copy(self, base))
    t.train_step(list(range(2)))                      # compiles; the first step's one-time copies
    small, small_sites = _step_crossings(t, [2, 3])
    large, large_sites = _step_crossings(t, list(range(4, n)))   # many more vertices and tasks
    for counts in (small, large):
        assert counts.get("d2h", 0) == 1, f"{name}: {counts} ({standin.sites})"
    assert set(small_sites) | set(large_sites) <= set(WHY_H2D), \
        f"{name}: copies from {(set(small_sites) | set(large_sites)) - set(WHY_H2D)}"
    messages = sum(len(s.message_shapes) for s in t.model.structures)
    for site in WHY_H2D:   # the same copies for a few tasks and for many: none per task
        if site == "engine/alg1.py:_device_index":
            assert large_sites.get(site, 0) <= messages and small_sites.get(site, 0) <= messages
        elif site == "cuda/device.py:_plan_copy":   # one copy per plan array (checked below), not per task
            continue
        else:
            assert large_sites.get(site, 0) == small_sites.get(site, 0), (name, site, small_sites, large_sites)
    assert len({id(a) for a in copied}) == len(copied), f"{name}: a plan array was copied twice"
    assert t.optimizer.last_loss is not None and t.optimizer.steps == 3
    assert all(arrays.on_device(p.value) for p in t.params.values())            # parameters stay there,
    assert all(arrays.on_device(a) for slots in t.optimizer.state.values() for a in slots.values())  # slots too
