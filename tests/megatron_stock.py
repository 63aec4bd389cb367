"""Stock Megatron-Core, no moepec: load a folder that ``moepec materialize`` wrote and the
``torch_dist`` reference of the same state into fresh models (EP = this run's world
size) with a plain ``dist_checkpointing.load``; every tensor must be equal, bit for bit.

    python -m torch.distributed.run --nproc_per_node N tests/megatron_stock.py MATERIALIZED REF

Prints ``rank R STOCK OK <tensors>``; fails if anything imported moepec.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import megatron_shims  # noqa: E402

megatron_shims.install()

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron_model import build, sharded, snapshot  # noqa: E402


def loaded(folder: str, seed: int) -> dict[str, torch.Tensor]:
    model, opt = build(seed)
    state = dist_checkpointing.load(sharded(model, opt, loading=True), folder)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return snapshot(model, opt)


def main() -> None:
    materialized, ref = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    got, want = loaded(materialized, seed=101), loaded(ref, seed=202)
    assert got.keys() == want.keys() and len(got) > 0
    diff = [k for k in got if not torch.equal(got[k], want[k])]
    assert not diff, f"{len(diff)} differ, e.g. {diff[:3]}"
    assert not [m for m in sys.modules if m.split(".")[0] == "moepec"]
    sys.stdout.write(f"rank {dist.get_rank()} STOCK OK {len(got)}\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
