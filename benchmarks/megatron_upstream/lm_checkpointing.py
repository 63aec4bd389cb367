"""Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint``
(``megatron/training/checkpointing.py`` of an extracted Megatron-LM tree, not copied here)
with ``--ckpt-format torch_dist`` and moepec's switch, on the CPU with the moepec repo's
shims: a GPTModel with SequentialMLP experts (tests/megatron_model.py), EP = world size.

    torchrun --nproc_per_node 2 lm_checkpointing.py MEGATRON_LM_DIR OUT_DIR [moepec|torch_dist]

Flags set as Megatron-LM's parser names them: ``--ckpt-format torch_dist``, the fully
parallel save (Megatron-LM's default), ``--ckpt-assume-constant-structure`` (the second
save reuses the first's cached strategy through ``checkpointing_context``), then a
resume from ``--load``. Two saves (iterations 10 and 20, the weights changed between
them), then ``load_checkpoint`` into a model built from another seed: every weight and
Adam moment equals the one of the save its view names (K = 1 of 4 experts per layer at
iteration 20). Prints ``rank R LM OK ...``. CPU stand-ins beyond the shims: ``torch.cuda.get_rng_state`` and the tracker file's
read (:func:`read_tracker`). Not run: ``--async-save`` (its persistent
worker calls ``torch.cuda.set_device``), ``--ckpt-fully-parallel-load`` (its exchange
moves CUDA tensors).

With moepec, the RAM level too (``ram_dir``; :func:`ram_resume`): a ``save_checkpoint``
at 50, ``pec.snapshot_megatron_lm`` at 53, then ``load_checkpoint`` into a fresh model,
optimizer and scheduler resumes at 53 (its sample count, scheduler and FLOP count, every
tensor bit for bit). Prints ``rank R LM RAM OK ...``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys

if __name__ == "__main__":
    # Only here: torch_dist's save spawns a helper process that runs this file's top
    # again (as __mp_main__), without these arguments.
    MEGATRON_LM, OUT = sys.argv[1], sys.argv[2]
    BACKEND = sys.argv[3] if len(sys.argv) > 3 else "moepec"  # or torch_dist: the baseline
    REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    sys.path[:0] = [MEGATRON_LM, os.path.join(REPO, "tests")]
    sys.argv = sys.argv[:1]  # Megatron-LM's parser reads sys.argv

    import megatron_shims

    megatron_shims.install()

    import torch

    # save_checkpoint gathers the RNG states even with --no-save-rng: the CPU's stands in.
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        init_num_microbatches_calculator,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args
    from megatron.training.global_vars import (
        _set_signal_handler,
        get_args,
        get_signal_handler,
        set_args,
    )
    from megatron_model import build, snapshot

    import moepec.integrations.megatron as pec


def read_tracker(path: str) -> tuple[int, bool]:
    """CPU stand-in for checkpointing.read_metadata, which agrees on the iteration with
    an all_reduce of a CUDA tensor: the tracker file's iteration (one host here, every
    rank reads the same file)."""
    with open(path) as f:
        return int(f.read().strip()), False


def change(opt, seed: int) -> None:
    """New values for every weight and Adam moment (as a training step would give)."""
    g = torch.Generator().manual_seed(seed)
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            with torch.no_grad():
                p.add_(torch.rand(p.shape, generator=g))
            state = opt.optimizer.state[p]
            state["exp_avg"] = torch.rand(p.shape, generator=g)
            state["exp_avg_sq"] = torch.rand(p.shape, generator=g)
            state["step"] = torch.tensor(float(seed))


def lm_args(root: str):
    args = parse_args(ignore_unknown_args=True)
    for name, value in dict(
            save=root, load=root, ckpt_format="torch_dist", use_dist_ckpt=True,
            ckpt_fully_parallel_save=True, ckpt_fully_parallel_load=False,
            ckpt_assume_constant_structure=True, async_save=False, no_save_rng=True,
            no_load_rng=True, use_distributed_optimizer=False, num_layers=2,
            hidden_size=16, num_attention_heads=2, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1, expert_model_parallel_size=dist.get_world_size(),
            world_size=dist.get_world_size(), rank=dist.get_rank(),
            consumed_train_samples=0, skipped_train_samples=0, consumed_valid_samples=0,
            dist_ckpt_strictness="assume_ok_unexpected", exit_on_missing_checkpoint=True,
    ).items():
        setattr(args, name, value)
    return args


def main() -> None:
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    rank = dist.get_rank()
    set_args(lm_args(OUT))
    checkpointing.read_metadata = read_tracker
    init_num_microbatches_calculator(rank, None, 2, 1, 1)  # what pretrain() sets up
    ram = f"/dev/shm/moepec-lm-{os.path.basename(os.path.abspath(OUT))}"
    if BACKEND == "moepec":  # the one line of docs/megatron.md; ram_dir: the RAM level
        pec.use_for_torch_dist(k_persist=1, ram_dir=ram)
    model, opt = build(seed=1)
    context: dict = {}
    states = {}
    for it in (10, 20):
        change(opt, seed=it)  # the same on every rank: replicated tensors agree
        checkpointing.save_checkpoint(it, [model], opt, None, 0,
                                      checkpointing_context=context)
        states[f"iter_{it:07d}"] = snapshot(model, opt)
    kept = context["save_strategy"]  # what save_checkpoint built for the flags, reused
    assert type(kept).__name__ == "FullyParallelSaveStrategyWrapper", kept
    assert kept.base_strategy.use_cached_ckpt_structure
    folder = os.path.join(OUT, "iter_0000020")
    with open(os.path.join(folder, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == BACKEND
    saved = list(range(8))
    if BACKEND == "moepec":
        with open(os.path.join(folder, "moepec.json")) as f:
            saved = json.load(f)["experts_saved"]
    model_b, opt_b = build(seed=2)
    iteration, _ = checkpointing.load_checkpoint([model_b], opt_b, None)
    assert iteration == 20, iteration
    report = pec.last_load_report() if BACKEND == "moepec" else None
    sources = report.sources if report else {}
    got, per = snapshot(model_b, opt_b), 4 // dist.get_world_size()
    stale = 0
    for name, value in got.items():
        want = "iter_0000020"
        if ".local_experts." in name:
            layer = int(name.split("decoder.layers.")[1].split(".")[0])
            expert = rank * per + int(name.split(".local_experts.")[1].split(".")[0])
            want = sources.get(f"{layer}/{expert}", {"checkpoint": want})["checkpoint"]
            stale += want != "iter_0000020"
        assert torch.equal(value, states[want][name]), (name, want)
    print(f"rank {rank} LM OK {BACKEND} iteration {iteration} experts saved at 20: {len(saved)} "
          f"of 8; tensors from older saves here: {stale} of {len(got)}", flush=True)
    if BACKEND == "moepec":
        last_saves(model_b, opt_b, context)
        ram_resume(model_b, opt_b, context)
        pec.close_ram()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ram, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def last_saves(model, opt, context: dict) -> None:
    """The saves Megatron-LM's train() makes right before it exits are complete without
    a call (moepec's megatron_lm_stops_at reads its globals): a SIGTERM caught by its own
    ``--exit-signal-handler`` (DistributedSignalHandler, on rank 1 only) before the save
    of 30, then the end of training (``--train-iters 40``); the save of 35 between rotates."""
    args = get_args()
    args.exit_signal_handler = True
    _set_signal_handler(signal.SIGTERM)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler sets its flag
    dist.barrier()
    args.train_iters = 40
    counts = []
    for it in (30, 35, 40):
        checkpointing.save_checkpoint(it, [model], opt, None, 0,
                                      checkpointing_context=context)
        if it == 30:
            get_signal_handler().release()
            args.exit_signal_handler = False
        with open(os.path.join(OUT, f"iter_{it:07d}", "moepec.json")) as f:
            counts.append(len(json.load(f)["experts_saved"]))
    assert counts == [8, 2, 8], counts
    print(f"rank {dist.get_rank()} LM LAST SAVES OK experts saved at 30 (SIGTERM on rank 1), "
          f"35, 40 (--train-iters): {counts}", flush=True)


def scheduler(opt):
    return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-5,
                                   lr_warmup_steps=80, lr_decay_steps=8000,
                                   lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=8000, wd_incr_style="constant")


def ram_resume(model, opt, context: dict) -> None:
    """Megatron-LM's ``--load`` from the RAM level: ``save_checkpoint`` at 50 (A), the
    snapshot of 53 (B) through ``pec.snapshot_megatron_lm`` (Megatron-LM's own
    generate_state_dict), then ``load_checkpoint`` into a fresh model, optimizer and
    scheduler with the sample count reset (a restarted worker's state) returns B's
    iteration, ``args.consumed_train_samples``, scheduler steps and FLOP count, and B's
    tensors bit for bit (8 samples an iteration here)."""
    args = get_args()
    args.train_iters = 1000  # not an exit save: the door rotates experts again
    sched, states = scheduler(opt), {}
    for it in (50, 53):
        change(opt, seed=it)
        sched.step(increment=8 * it - sched.num_steps)
        args.consumed_train_samples = 8 * it
        if it == 50:
            checkpointing.save_checkpoint(it, [model], opt, sched, 1e12 * it,
                                          checkpointing_context=context)
        else:
            assert pec.snapshot_megatron_lm(it, [model], opt, sched, 1e12 * it)
        states[it] = snapshot(model, opt)
    model_c, opt_c = build(seed=3)
    sched_c = scheduler(opt_c)
    args.consumed_train_samples = 0
    iteration, flops = checkpointing.load_checkpoint([model_c], opt_c, sched_c)
    report = pec.last_load_report()
    got = snapshot(model_c, opt_c)
    same = sum(torch.equal(v, states[53][k]) for k, v in got.items())
    lr = opt_c.param_groups[0]["lr"]
    assert (iteration, report.tier, report.checkpoint) == (53, "ram", "ram:53"), report
    assert (args.consumed_train_samples, sched_c.num_steps, flops) == (424, 424, 53e12)
    assert same == len(got) and lr == opt.param_groups[0]["lr"], (same, lr)
    print(f"rank {dist.get_rank()} LM RAM OK saved 50, snapshot 53; load_checkpoint: "
          f"iteration {iteration} from {report.checkpoint}, consumed_train_samples "
          f"{args.consumed_train_samples}, scheduler num_steps {sched_c.num_steps}, FLOPs "
          f"{flops:.3g}, lr {lr:.6g}; tensors equal to 53's: {same} of {len(got)}",
          flush=True)


if __name__ == "__main__":
    main()
