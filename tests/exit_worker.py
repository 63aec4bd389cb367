"""The ranks of the exit test (issue 21.2): FSDP2 training of the toy model on gloo with a
CheckpointManager, the trainer's teardown order, then a plain interpreter exit.

Usage: exit_worker.py RANK OUT_DIR CKPT_DIR PORT [PORT ...] -- one process per rank that
imports torch and moepec once, then forks one child per port; the two ranks' children of
the same port form one run. A child trains, tears down and leaves by ``SystemExit`` out of
this script's top level: the interpreter's own exit (atexit, thread and module teardown,
C++ static destructors), as a process started afresh would, without its seconds of imports.
Its stdout and stderr go to ``OUT_DIR/<run>-<rank>.out``; this process prints one line per
run, ``<run> <exit status>``."""

from __future__ import annotations

import gc
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch._dynamo  # noqa: F401 - an optimizer's constructor imports it (1-2 s a child)
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moepec import CheckpointConfig, CheckpointManager  # noqa: E402
from tests.toy import Counter, make, run_loop  # noqa: E402


def train(ckpt: str) -> None:
    torch.set_num_threads(1)
    # The toy model returns a view (it is the test's model, and no in-place op follows).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    # What precedes this line is the start, not the exit: torch's TCPStore client may
    # log a retried connection to rank 0's store there (a port the other rank's child
    # had not yet served, or that another process held a moment before).
    print("started", flush=True)
    model, opt, sched = make(0, "stacked", 4)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.moe:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    counter = Counter()
    cfg = CheckpointConfig(path=ckpt, interval=2, k_persist=1, timeout_s=60)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 4)
    mgr.close()
    # The trainer's order (train/trainer.py): what the run built (FSDP state, the device
    # mesh, pending work handles) sits in reference cycles; freed now, while the process
    # groups they hold exist, not by the collector during interpreter exit.
    del model, opt, sched, mgr, mesh, counter
    gc.collect()
    dist.destroy_process_group()
    print("exit", dist.is_initialized(), flush=True)


def fork_runs(rank: str, out_dir: str, ckpt_dir: str, ports: list[str]) -> str | None:
    """Fork and wait for one child per port; returns the checkpoint path in a child (which
    then trains and exits), None in this process once every child ended."""
    for run, port in enumerate(ports):
        pid = os.fork()
        if pid == 0:
            fd = os.open(os.path.join(out_dir, f"{run}-{rank}.out"),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=port)
            return os.path.join(ckpt_dir, f"c{run}")
        _, status = os.waitpid(pid, 0)
        print(run, status, flush=True)
    return None


if __name__ == "__main__":
    ckpt = fork_runs(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
    if ckpt is not None:
        train(ckpt)
    sys.exit(0)
