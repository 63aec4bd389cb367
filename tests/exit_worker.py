"""One rank of the exit test (issue 21.2): FSDP2 training of the toy model on gloo with a
CheckpointManager, the trainer's teardown order, then a plain interpreter exit. Started
without a launcher: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT come from the test."""

from __future__ import annotations

import gc
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moepec import CheckpointConfig, CheckpointManager  # noqa: E402
from tests.toy import Counter, make, run_loop  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    # The toy model returns a view (it is the test's model, and no in-place op follows).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, opt, sched = make(0, "stacked", 4)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.moe:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    counter = Counter()
    cfg = CheckpointConfig(path=sys.argv[1], interval=2, k_persist=1, timeout_s=60)
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


if __name__ == "__main__":
    main()
