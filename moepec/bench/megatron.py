"""Megatron-Core: the ("moepec", 1) backend against Megatron's own ``torch_dist`` async
save, on the same MoE GPTModel (SequentialMLP) and Adam state, in the same run.

    moepec bench megatron [--layers 4 --experts 8 --hidden 128 --ffn 512
                           --checkpoints 8 --k 1]

Per checkpoint, for each backend: the bytes the save folder holds (Megatron's common
files included) and the training loop's blocking: the ``dist_checkpointing.save`` call
plus scheduling the async request (planning, the host snapshot) plus the finalize step
(commit / metadata), which Megatron-LM runs on the training thread; the writer's own
time overlaps training and is reported apart. Weights and Adam moments change between
checkpoints (the forward does not run on CPU). One process (gloo, world size 1), CPU
shims from tests/megatron_shims.py (so it runs from a source checkout:
:mod:`moepec.bench.checkout`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moepec.bench.checkout import tests_dir


def install_shims() -> None:
    """Megatron-Core's checkpointing path on a CPU-only torch (tests/megatron_shims.py);
    called before anything imports Megatron."""
    tests = str(tests_dir("megatron_shims.py"))
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import megatron_shims

    megatron_shims.install()


def build(args: argparse.Namespace):
    import megatron_shims
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
        num_moe_experts=args.experts, moe_router_topk=2, moe_ffn_hidden_size=args.ffn,
        ffn_hidden_size=args.ffn, moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True, add_bias_linear=False)
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=args.experts),
                     vocab_size=1024, max_sequence_length=64)
    groups = [{"params": [p for n, p in model.named_parameters() if (".experts." in n) == e],
               "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": e,
               "is_decoupled_lr": False} for e in (False, True)]
    adam = torch.optim.Adam(groups, lr=1e-3)
    opt = megatron_shims.fp32_optimizer(adam, OptimizerConfig(optimizer="adam", lr=1e-3),
                                        lambda o, c=None: None)
    return model, opt


def step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.optimizer.step()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def one_save(model, opt, folder: Path, strategy, queue) -> dict[str, float]:
    from megatron.core import dist_checkpointing

    folder.mkdir(parents=True)
    model_sd = model.sharded_state_dict()
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}
    t0 = time.perf_counter()
    req = dist_checkpointing.save(sd, str(folder), sharded_strategy=strategy,
                                  async_sharded_save=True)
    queue.schedule_async_request(req)
    t1 = time.perf_counter()
    writer = queue.async_calls[-1].async_caller.process  # Megatron's forked writer
    if writer is not None:
        writer.join(timeout=600)
    t2 = time.perf_counter()
    queue.maybe_finalize_async_calls(blocking=True)
    t3 = time.perf_counter()
    return {"blocking": (t1 - t0) + (t3 - t2), "save": t1 - t0, "finalize": t3 - t2,
            "writer": t2 - t1, "bytes": folder_bytes(folder)}


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # Megatron's forked writer
    install_shims()
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import moepec.integrations.megatron as mg

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--checkpoints", type=int, default=8)
    ap.add_argument("--k", type=int, default=1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moepec-bench-megatron-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0,
                                world_size=1)
        ps.initialize_model_parallel()
        mg.register(k_persist=args.k)
        model, opt = build(args)
        queue = AsyncCallsQueue()
        rows: dict[str, list[dict[str, float]]] = {"torch_dist": [], "moepec": []}
        for c in range(args.checkpoints):
            step(model, opt, seed=c)
            order = [("torch_dist", ("torch_dist", 1)), ("moepec", ("moepec", 1))]
            for name, strategy in order[::1 if c % 2 else -1]:  # alternate who goes first
                rows[name].append(one_save(model, opt, Path(tmp) / name / f"iter_{c:07d}",
                                           strategy, queue))
        queue.close()
        report(args, rows)
        dist.destroy_process_group()


def report(args: argparse.Namespace, rows: dict[str, list[dict[str, float]]]) -> None:
    print(f"Megatron-Core GPTModel: {args.layers} MoE layers x {args.experts} experts "
          f"(hidden {args.hidden}, expert ffn {args.ffn}), Adam; {args.checkpoints} "
          f"checkpoints, moepec K={args.k}; CPU, 1 process")
    print("medians over the checkpoints after the first; blocking = save call + "
          "scheduling + finalize")
    print(f"{'backend':<12} {'MB first':>9} {'MB rest':>8} {'blocking ms':>12} "
          f"{'save+sched ms':>14} {'finalize ms':>12} {'writer ms':>10}")
    summary = {}
    for name, rs in rows.items():
        first, rest = rs[0]["bytes"] / 1e6, statistics.mean(r["bytes"] for r in rs[1:]) / 1e6
        med = {k: statistics.median(r[k] for r in rs[1:]) * 1e3
               for k in ("blocking", "save", "finalize", "writer")}
        summary[name] = (rest, med["blocking"])
        print(f"{name:<12} {first:>9.2f} {rest:>8.2f} {med['blocking']:>12.1f} "
              f"{med['save']:>14.1f} {med['finalize']:>12.1f} {med['writer']:>10.1f}")
    (tb, tblk), (mb, mblk) = summary["torch_dist"], summary["moepec"]
    print(f"moepec / torch_dist: bytes per checkpoint {mb / tb:.3f}x, blocking per "
          f"checkpoint {mblk / tblk:.3f}x (checkpoints after the first)")


if __name__ == "__main__":
    main()
