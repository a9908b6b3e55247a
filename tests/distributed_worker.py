"""Run under mpirun by tests/train/test_distributed.py: ``python -m tests.distributed_worker SPEC.json``.

Every rank trains each case of the spec data-parallel (the trainer finds the MPI job itself), rank 0 writes the
run directory as usual, and every rank writes what the test checks besides: the sparse paths taken, the
error of the digest probe."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from minicavs.train.config import REPO_ROOT
from minicavs.train.distributed import DistributedError, world
from minicavs.train.trainer import Trainer


def run_case(case: dict, out: Path, rank: int) -> dict:
    overrides = list(case["overrides"])
    if case.get("emulated"):   # train.device=cuda on the emulated device (the stand-in), as tests/conftest.py
        from minicavs.cuda import kernels
        from minicavs.cuda.emulation import Launcher
        launcher = Launcher(out / f"emulation-{rank}")
        kernels.default_launcher = lambda: launcher
        overrides.append("train.device=cuda")
    t = Trainer(REPO_ROOT / "models" / f"{case['module']}.yaml", overrides, run_dir=out / case["name"])
    report: dict = {"rank": rank, "size": t.parallel.comm.size}
    if case.get("digest_probe"):   # one rank's parameter off by one ulp: the digest check must name it
        t.parallel.sync_state()
        if rank == t.parallel.comm.size - 1:
            w = t.params[case["digest_probe"]].value
            w.flat[0] = np.nextafter(w.flat[0], np.inf)
        try:
            t.parallel.check_digests()
            report["error"] = None
        except DistributedError as e:
            report["error"] = str(e)
        return report
    t.fit(case.get("epochs"), resume=case.get("resume", False), progress=False, log=lambda s: None)
    report["sparse_paths"] = t.parallel.reducer.stats.sparse_paths
    report["steps"] = t.optimizer.steps
    return report


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    comm = world()
    assert comm is not None and comm.size > 1, "run me under mpirun with 2 or more processes"
    reports = {case["name"]: run_case(case, out, comm.rank) for case in spec["cases"]}
    (out / f"report-{comm.rank}.json").write_text(json.dumps(reports))


if __name__ == "__main__":
    main()
