"""A torchrun worker for tests/test_deepspeed_ram.py: the DeepSpeed door's two levels
(RAM snapshots every 3 steps through ``snapshot(engine, dir)``, storage saves every 4)
under ``torchrun --max-restarts 3``, 2 ranks, gloo, ZeRO-2, native MoE with 8 experts.
``python ds_ram_worker.py OUT RAM_DIR``; each attempt writes JSON per rank in OUT:

- attempt 0: steps 1-7 (saves at 4, snapshots at 3 and 6); the state at step 6 is
  recorded; rank 1 SIGKILLs itself after step 7;
- attempt 1: ``load_checkpoint(dir)`` (tag None): from RAM at step 6; every parameter's
  weight, fp32 master and Adam moments and the RNG state compared with step 6's; steps
  7-9 (save at 8, state recorded; snapshot at 9); then this node's RAM is wiped (every
  rank's slot files removed) and rank 1 SIGKILLs itself after step 10;
- attempt 2: the load takes storage (step 8), compared with step 8's; step 9 (a
  snapshot); a load naming tag ``global_step8`` takes that tag, never RAM; a load of
  the newest after it takes storage too (the snapshot of step 9 was an abandoned future);
  steps 9-11 (a snapshot at 9, state recorded); at step 12 rank 1 SIGKILLs itself inside
  its snapshot, its slot copied and not sealed (before the save of 12);
- attempt 3: the load takes RAM at 9 (rank 1's slot of 12 is torn: never read).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys

import torch
import torch.distributed as dist
from ds_worker import engine, state, train
from ram_attempts import die_inside_snapshot, write_results

import moepec.integrations.deepspeed as door
from moepec.hooks import FaultHooks


def report(eng, out: str) -> dict:
    """The last load's report, and every parameter's weight, fp32 master and Adam moments
    (and the RNG state) that differ from their values at the step the report names for
    them: its step (non-expert state), each expert's source's (a storage load of K of N
    experts reads the others from older saves)."""
    r = door.last_load_report()
    units = door.expert_params(eng)
    got, bad = state(eng), []
    for name, vals in got.items():
        unit = units.get(name)
        step = r.step if unit is None else r.sources[
            f"{unit[0].removeprefix('layer_')}/{unit[1]}"]["step"]
        at = expected(out, step)
        bad += [f"{name}.{k}@{step}" for k, v in vals.items()
                if not torch.equal(v, at[name][k])]
    at = expected(out, r.step)
    return {"tier": r.tier, "step": r.step, "checkpoint": r.checkpoint, "bad": bad,
            "checked": sum(map(len, got.values())), "global_steps": int(eng.global_steps),
            "units_from": r.units_from,
            "sources": sorted({s["step"] for s in r.sources.values()}), "rng": torch.equal(torch.get_rng_state(), at["rng"])}


def record(out: str, step: int, eng) -> None:
    torch.save({**state(eng), "rng": torch.get_rng_state()},
               os.path.join(out, f"state_{step}_{dist.get_rank()}.pt"))


def expected(out: str, step: int) -> dict:
    return torch.load(os.path.join(out, f"state_{step}_{dist.get_rank()}.pt"),
                      weights_only=True)


def run(eng, save_dir: str, out: str, until: int) -> None:
    """Train to global step ``until``: a save every 4 steps, a snapshot every 3."""
    while eng.global_steps < until:
        train(eng, 1, seed=1)
        if eng.global_steps % 4 == 0:
            eng.save_checkpoint(save_dir)
            record(out, int(eng.global_steps), eng)
        if door.snapshot(eng, save_dir):
            record(out, int(eng.global_steps), eng)


def main(out: str, ram_dir: str) -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    save_dir = os.path.join(out, "ckpt")
    section = {"k_persist": 2, "snapshot_every": 3, "ram_dir": ram_dir,
               "async_persist": False}
    eng = engine(2, "fp32", 1, seed=10 + attempt, section=section)
    hooks = FaultHooks()  # test-only fault points, read by the RAM tier this process makes
    eng._moepec_door.level.hooks = hooks
    results: dict = {}
    if attempt == 0:
        run(eng, save_dir, out, 7)
    else:
        eng.load_checkpoint(save_dir)
        results["newest"] = report(eng, out)
    if attempt == 1:
        run(eng, save_dir, out, 9)
        dist.barrier()
        shutil.rmtree(os.path.join(ram_dir, os.listdir(ram_dir)[0], f"rank{rank}"))
        dist.barrier()  # the node's RAM is gone, then the fault
        run(eng, save_dir, out, 10)
    if attempt == 2:
        run(eng, save_dir, out, 9)
        eng.load_checkpoint(save_dir, tag="global_step8")
        results["named"] = report(eng, out)
        eng.load_checkpoint(save_dir)
        results["after_named"] = report(eng, out)
        run(eng, save_dir, out, 11)  # a snapshot at 9

        def step_12() -> None:
            train(eng, 1, seed=1)
            door.snapshot(eng, save_dir)  # rank 1 dies at its seal
        die_inside_snapshot(hooks, 12, out, attempt, results, step_12)
    write_results(out, attempt, results)
    if attempt < 2:
        dist.barrier()  # both ranks wrote their results; then the fault
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # rank 0 waits here until torchrun stops it
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("moepec").setLevel(logging.INFO)
    main(sys.argv[1], sys.argv[2])
