"""A check for one suspect of the torchtitan crash (docs/testing.md): gloo collectives on
two process groups from two threads at once, as training (the default group) and moepec's
persist thread (a group of its own) run them, with small tensors (the heap blocks the
crash was about). Fixed counts, so both ranks run the same collectives; run it with tcache
off so that a write into a freed small block meets glibc's fastbin checks:

    GLIBC_TUNABLES=glibc.malloc.tcache_count=0 python -m torch.distributed.run \\
        --nproc_per_node 2 tests/gloo_two_groups.py [MAIN_STEPS] [BACKGROUND_STEPS]
"""

import sys
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def background(group: dist.ProcessGroup, rank: int, world: int, steps: int,
               errors: list[str]) -> None:
    """Object collectives and small all-reduces on ``group``, as the persist thread's."""
    try:
        for i in range(steps):
            objs: list = [None] * world
            dist.all_gather_object(objs, {"i": i, "rank": rank, "pad": "x" * (i % 97)},
                                   group=group)
            dist.all_reduce(torch.full((1 + i % 30,), float(rank)), group=group)
            box = [i] if rank == 0 else [None]
            dist.broadcast_object_list(box, src=0, group=group)
    except Exception as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(repr(exc))


def main() -> None:
    warnings.simplefilter("ignore", FutureWarning)
    main_steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60_000
    bg_steps = int(sys.argv[2]) if len(sys.argv) > 2 else main_steps // 2
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    errors: list[str] = []
    thread = threading.Thread(target=background, args=(group, rank, world, bg_steps, errors))
    thread.start()
    started = time.monotonic()
    for i in range(main_steps):  # the training thread: funcol all-gathers, all-reduces
        gathered = funcol.all_gather_tensor(torch.randn(1 + i % 29), 0, dist.group.WORLD)
        (gathered * 2).sum()
        dist.all_reduce(torch.randn(3 + i % 17))
        if i % 50 == 0:
            objs: list = [None] * world
            dist.all_gather_object(objs, i)
    thread.join()
    print(f"rank {rank}: {main_steps} main and {bg_steps} background steps in "
          f"{time.monotonic() - started:.1f} s, errors: {errors or 'none'}", flush=True)
    dist.destroy_process_group()
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
