"""Training throughput, python vs native executor, alternating runs, medians: python tools/native_timing.py CONFIG REPEATS BATCHES [--set overrides...]"""
import sys, time, tempfile, os, statistics
sys.path.insert(0, ".")
import numpy as np
from dataclasses import replace
from minicavs.training import Trainer
cfg, reps, nb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sets = sys.argv[4:]
t = Trainer(cfg, sets, run_dir=tempfile.mkdtemp())
bs = t.cfg["train"]["batch_size"]
order = np.arange(len(t.task.data["train"]))
batches = [order[i*bs:(i+1)*bs] for i in range(nb)]
base = t.model.options
res = {"python": [], "native": []}
for ex in ("python", "native"):  # warm up
    t.model.options = replace(base, executor=ex); t.train_step(batches[0])
for r in range(reps):
    for ex in (("python", "native") if r % 2 == 0 else ("native", "python")):
        t.model.options = replace(base, executor=ex)
        t0 = time.perf_counter(); n = 0
        for b in batches:
            _, u = t.train_step(b); n += len(b)
        res[ex].append(n / (time.perf_counter() - t0))
st = next(iter(t.loss_and_grads([t.task.data["train"][i] for i in batches[0]]).states.values()))
load = os.getloadavg()[0]
mp, mn = statistics.median(res["python"]), statistics.median(res["native"])
print(f"{cfg} {' '.join(sets)}: python {mp:.0f}/s native {mn:.0f}/s ratio {mn/mp:.2f} (load {load:.1f}) native_used={st.program.native is not None}/{st.backward_program.native is not None}")
# where a native step's time goes: the task loops' GEMMs, fused kernels and the rest (dispatch, row moves)
import minicavs.instructions as instructions
from minicavs.cpu import runner as c_runner
t.model.options = replace(base, executor="native")
c_runner.PROFILE = np.zeros(len(instructions.OPCODES) + 1, np.int64)
t0 = time.perf_counter()
for b in batches:
    t.train_step(b)
step = (time.perf_counter() - t0) / len(batches) * 1e3
per_op = dict(zip(list(instructions.OPCODES) + ["all"], c_runner.PROFILE / len(batches) / 1e6))
c_runner.PROFILE = None
loop, gemm, fused = per_op.pop("all"), per_op.pop("GEMM"), per_op.pop("FUSED")
rest = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])[:4])
print(f"  native step {step:.1f} ms (timed per instruction): task loops {loop:.1f} ms ({100 * loop / step:.0f}%), "
      f"GEMM {gemm:.1f}, fused {fused:.1f}, other {loop - gemm - fused:.2f} ms "
      f"({100 * (loop - gemm - fused) / loop:.1f}% of the loops: {rest})")
