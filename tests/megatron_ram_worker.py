"""A torchrun worker for tests/test_megatron_ram.py: the Megatron-Core door's two levels
(``pec.snapshot`` every 3 iterations into the RAM tier, a ``dist_checkpointing`` save
every 4) under ``torchrun --max-restarts 3``, 2 ranks, gloo, EP 2, K = 1 of 4 experts.
``python megatron_ram_worker.py OUT RAM_DIR``; each attempt writes JSON per rank in OUT:

- attempt 0: iterations 1-7 (save at 4, snapshot at 6; none at 3: no lineage yet); the
  state at 4 and 6 recorded; rank 1 SIGKILLs itself after 7;
- attempt 1: a load of the newest folder (iter 4): from RAM at 6, bit for bit; 7-9 (save
  at 8, snapshot at 9); the node's RAM is wiped; rank 1 SIGKILLs itself;
- attempt 2: the load takes storage (8; each expert from its source's step); 9 (a
  snapshot); a load naming iter 4 takes it, never RAM; a load of the newest after it
  takes storage (the snapshot of 9 was an abandoned future); 9 again (a snapshot), then
  at 10 rank 1 SIGKILLs itself inside its snapshot, its slot copied and not sealed;
- attempt 3: the load takes RAM at 9 (rank 1's slot of 10 is torn: never read).

Every save and snapshot is of a Megatron-LM-shaped state dict (:func:`lm_state`): its
common state holds ``iteration``, ``args`` (an ``argparse.Namespace`` with the sample
counts, a dtype, Megatron's enums), the scheduler's dict and the FLOP count, and an
``rng_state`` ShardedObject numpy's and torch's RNG states; every load returns them as
``lm`` (they must be those of the step the load names). In attempt 0 a snapshot whose
``args`` holds a function is refused (``refused``: the message).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from argparse import Namespace

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.transformer.enums import AttnBackend
from megatron_model import build, sharded, snapshot
from megatron_worker import expert_of, make_folder, train_a_bit
from ram_attempts import die_inside_snapshot, write_results

import moepec
import moepec.integrations.megatron as pec
from moepec.hooks import FaultHooks


def folder(save_dir: str, it: int) -> str:
    return os.path.join(save_dir, f"iter_{it:07d}")


def newest(save_dir: str) -> str:
    """The newest saved folder (what Megatron-LM's tracker file names)."""
    return max(n for n in os.listdir(save_dir)
               if os.path.exists(os.path.join(save_dir, n, "metadata.json")))


def lm_state(model, opt, it: int, loading: bool = False, **args) -> dict:
    """The model's and optimizer's shards with Megatron-LM's common values and RNG
    states of iteration ``it`` (as its generate_state_dict puts them)."""
    rng = {"np_rng_state": np.random.RandomState(it).get_state(),
           "torch_rng_state": torch.Generator().manual_seed(it).get_state()}
    return {**sharded(model, opt, loading), "iteration": it, "checkpoint_version": 3.0,
            "args": Namespace(consumed_train_samples=8 * it, params_dtype=torch.float32,
                              attention_backend=AttnBackend.auto,
                              exit_signal=signal.SIGTERM, **args),
            "opt_param_scheduler": {"num_steps": 8 * it, "max_lr": 1e-3},
            "num_floating_point_operations_so_far": 1.5 * it,
            "rng_state": ShardedObject("rng_state", [rng], (2,), (dist.get_rank(),),
                                       replica_id=0)}


def lm_values(state: dict, it: int) -> list:
    """What Megatron-LM's load_checkpoint reads after the load, and whether it is
    iteration ``it``'s (the RNG states bit for bit)."""
    rng = state["rng_state"][0]
    return [state["iteration"], state["args"].consumed_train_samples,
            str(state["args"].params_dtype), state["args"].attention_backend.name,
            state["opt_param_scheduler"]["num_steps"],
            state["num_floating_point_operations_so_far"],
            rng["np_rng_state"][0], bool(np.array_equal(
                rng["np_rng_state"][1], np.random.RandomState(it).get_state()[1])),
            bool(torch.equal(rng["torch_rng_state"],
                             torch.Generator().manual_seed(it).get_state()))]


def adam_step(opt) -> float:
    """Adam's step count (which Megatron keeps in the common state, as ``common_step``)."""
    steps = {float(s["step"]) for s in opt.optimizer.state.values() if "step" in s}
    assert len(steps) == 1, steps
    return steps.pop()


def record(out: str, it: int, model, opt) -> None:
    torch.save({**snapshot(model, opt), "adam_step": torch.tensor(adam_step(opt))},
               os.path.join(out, f"state_{it}_{dist.get_rank()}.pt"))


def expected(out: str, it: int) -> dict:
    return torch.load(os.path.join(out, f"state_{it}_{dist.get_rank()}.pt"),
                      weights_only=True)


def load(model, opt, path: str, out: str) -> dict:
    """A plain dist_checkpointing.load of ``path``; the report, every weight and Adam
    moment that differs from its value at the step the report names for it, and Adam's
    step count with its value at the report's step."""
    state = dist_checkpointing.load(lm_state(model, opt, 0, loading=True), path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    r = pec.last_load_report()
    got, bad = snapshot(model, opt), []
    for key, v in got.items():
        unit = expert_of(key.split(":", 1)[1])
        step = r.step if unit is None else r.sources[f"{unit[0]}/{unit[1]}"]["step"]
        bad += [f"{key}@{step}"] if not torch.equal(v, expected(out, step)[key]) else []
    return {"tier": r.tier, "step": r.step, "checkpoint": r.checkpoint, "bad": bad,
            "checked": len(got), "units_from": r.units_from,
            "sources": sorted({s["step"] for s in r.sources.values()}),
            "adam_step": adam_step(opt),
            "adam_step_then": float(expected(out, r.step)["adam_step"]),
            "lm": lm_values(state, r.step)}


def run(model, opt, save_dir: str, out: str, start: int, until: int) -> None:
    """Iterations start+1 .. until: a save every 4, a snapshot every 3."""
    for it in range(start + 1, until + 1):
        train_a_bit(model, opt, seed=it)
        if it % 4 == 0:
            make_folder(folder(save_dir, it))
            dist_checkpointing.save(lm_state(model, opt, it), folder(save_dir, it),
                                    sharded_strategy=("moepec", 1))
            record(out, it, model, opt)
        if it % 3 == 0 and pec.snapshot(lm_state(model, opt, it), it, save_dir):
            record(out, it, model, opt)


def main(out: str, ram_dir: str) -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    save_dir = os.path.join(out, "ckpt")
    hooks = FaultHooks()
    pec.register(k_persist=1, ram_dir=ram_dir, hooks=hooks)
    model, opt = build(seed=10 + attempt)
    results: dict = {}
    if attempt == 0:
        run(model, opt, save_dir, out, 0, 7)
        try:
            pec.snapshot(lm_state(model, opt, 7, init=print), 7, save_dir)
        except moepec.ConfigError as exc:
            results["refused"] = str(exc)
    else:
        results["newest"] = load(model, opt, folder(save_dir, int(
            newest(save_dir).removeprefix("iter_"))), out)
    if attempt == 1:
        run(model, opt, save_dir, out, 6, 9)
        dist.barrier()
        shutil.rmtree(os.path.join(ram_dir, os.listdir(ram_dir)[0], f"rank{rank}"))
        dist.barrier()  # the node's RAM is gone, then the fault
    if attempt == 2:
        run(model, opt, save_dir, out, 8, 9)
        results["named"] = load(model, opt, folder(save_dir, 4), out)
        results["after_named"] = load(model, opt, folder(save_dir, 8), out)
        run(model, opt, save_dir, out, 8, 9)  # a snapshot at 9

        def iteration_10() -> None:
            train_a_bit(model, opt, seed=10)
            pec.snapshot(lm_state(model, opt, 10), 10, save_dir)  # rank 1 dies at its seal
        die_inside_snapshot(hooks, 10, out, attempt, results, iteration_10)
    write_results(out, attempt, results)
    if attempt < 2:
        dist.barrier()  # both ranks wrote their results; then the fault
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # rank 0 waits here until torchrun stops it
    pec.close_ram()  # a clean end: this rank's slots removed
    dist.destroy_process_group()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("moepec").setLevel(logging.INFO)
    main(sys.argv[1], sys.argv[2])
