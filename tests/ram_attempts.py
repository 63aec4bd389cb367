"""One torchrun launch of a door's RAM-level worker (tests/megatron_ram_worker.py,
tests/ds_ram_worker.py): 2 ranks, restarted by ``--max-restarts`` after each kill the
worker makes, the RAM tier in a folder of its own under /dev/shm; each attempt's result
as JSON, read back per (attempt, rank)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_attempts(worker: Path, out: Path, attempts: int, **env: str) -> list[list[Any]]:
    """Run ``worker`` (argv: ``out``, the RAM folder) with ``attempts - 1`` restarts;
    asserts torchrun's exit 0 and that the last attempt's clean end removed its slots.
    Returns ``[attempt][rank]`` of the worker's ``attempt<a>_<r>.json``."""
    ram = tempfile.mkdtemp(prefix="moepec-test-", dir="/dev/shm")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "--max-restarts", str(attempts - 1), str(worker), str(out), ram]
    try:
        with subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as proc:
            try:
                stdout, stderr = proc.communicate(timeout=500)
            except subprocess.TimeoutExpired:  # the ranks too, not only torchrun
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
        left = sorted(p.name for p in Path(ram).glob("*/rank*/slot*"))
    finally:
        shutil.rmtree(ram, ignore_errors=True)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    assert left == [], left  # the clean end of the last attempt removed its slots
    return [[json.loads((out / f"attempt{a}_{r}.json").read_text()) for r in (0, 1)]
            for a in range(attempts)]


def write_results(out: str, attempt: int, results: dict) -> None:
    """In a worker: this rank's results of this attempt, as ``attempt<a>_<rank>.json``."""
    import torch.distributed as dist

    with open(os.path.join(out, f"attempt{attempt}_{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)


def die_inside_snapshot(hooks: Any, step: int, out: str, attempt: int, results: dict,
                        snapshot: Callable[[], object]) -> None:
    """In a worker, every rank: write this attempt's results, then take the snapshot of
    ``step`` (``snapshot()``), inside which rank 1 SIGKILLs itself at the ``seal`` fault
    point (its slot copied, its header not written); rank 0 waits for torchrun to stop
    it. ``hooks``: the door's ``FaultHooks``."""
    import torch.distributed as dist

    def die(point: str, at: int) -> None:
        if (point, at) == ("seal", step) and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    hooks.on_snapshot = die
    write_results(out, attempt, results)
    dist.barrier()  # every rank holds its earlier snapshots and wrote its results
    snapshot()  # returns once copied: rank 1's seal (on the copy thread) kills it
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()  # rank 0 waits here until torchrun stops it
