"""Megatron-Core: the ("moepec", 1) backend against Megatron's own ``torch_dist`` async
save, on the same MoE GPTModel (SequentialMLP) and Adam state, in the same run.

    moepec bench megatron [--layers 4 --experts 8 --hidden 128 --ffn 512
                           --checkpoints 8 --k 1 --repeats 5 --s3/--no-s3]

Per checkpoint, for each backend: the bytes the save folder holds (Megatron's common
files included) and the training loop's blocking: the ``dist_checkpointing.save`` call
plus scheduling the async request (planning, the host snapshot) plus the finalize step
(commit / metadata), which Megatron-LM runs on the training thread; the writer's own
time overlaps training and is reported apart. Weights and Adam moments change between
checkpoints (the forward does not run on CPU). One process (gloo, world size 1), CPU
shims from tests/megatron_shims.py (so it runs from a source checkout:
:mod:`moepec.bench.checkout`).

Then the two levels (:func:`two_level`): after a moepec save names the lineage, a RAM
snapshot (``pec.snapshot``, the whole state into shared memory) per checkpoint, its
blocking against torch_dist's async save's above; and the restore of a restarted worker
(a fresh registration, new model and optimizer; ``dist_checkpointing.load`` of the
newest folder, ``load_state_dict``) from RAM against the same load from storage (a local
folder, page cache warm: storage's best case) and, with ``--s3`` (the default when moto
and s3fs import), from S3: the folders the load reads downloaded from a bucket on moto's
server into a fresh local folder, then the same load (:mod:`moepec.bench.s3_root`);
alternating, medians of ``--repeats``, checked equal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moepec.bench.checkout import tests_dir
from moepec.bench.s3_root import S3Copies, add_flag, choose, report_line


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
                                        _init_state)
    return model, opt


def _init_state(opt, config=None) -> None:
    """Adam's moments before the first step (what a load fills: Megatron calls this
    when it builds the optimizer's sharded state dict for loading)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


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
    ap.add_argument("--repeats", type=int, default=5, help="restores per tier")
    add_flag(ap)
    args = ap.parse_args(argv)
    args.s3, args.s3_why = choose(args.s3)
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
        levels = two_level(args, model, opt, Path(tmp) / "two-level", queue)
        queue.close()
        report(args, rows)
        report_levels(levels, rows)
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


def _restore(args: argparse.Namespace, folder: Path) -> tuple[float, Any, dict]:
    """A restarted worker's restore: new model and optimizer, the load, load_state_dict."""
    from megatron.core import dist_checkpointing

    import moepec.integrations.megatron as mg

    model, opt = build(args)
    t0 = time.perf_counter()
    model_sd = model.sharded_state_dict()
    state = dist_checkpointing.load({"model": model_sd, "optimizer": opt.sharded_state_dict(
        model_sd, is_loading=True)}, str(folder))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return time.perf_counter() - t0, mg.last_load_report(), _tensors(model, opt)


def _tensors(model, opt) -> dict[str, torch.Tensor]:
    out = {f"w:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.optimizer.state.get(p, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                out[f"{k}:{n}"] = v.detach().clone()
    return out


def two_level(args: argparse.Namespace, model, opt, root: Path, queue) -> dict:
    """RAM snapshots (blocking) and restores from RAM, from storage and (``--s3``) from
    S3 (see the module docstring). The storage head is one moepec save (full: the first
    of its lineage)."""
    import moepec.integrations.megatron as mg

    ram_dir = tempfile.mkdtemp(prefix="moepec-bench-", dir="/dev/shm") \
        if os.access("/dev/shm", os.W_OK) else None
    s3 = None
    try:
        mg.register(k_persist=args.k, ram_dir=ram_dir)
        one_save(model, opt, root / "iter_0000000", ("moepec", 1), queue)
        blocking = []
        for c in range(1, args.checkpoints + 1):
            step(model, opt, seed=1000 + c)
            model_sd = model.sharded_state_dict()
            sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}
            t0 = time.perf_counter()
            assert mg.snapshot(sd, c, str(root))
            blocking.append(time.perf_counter() - t0)
        want, head = _tensors(model, opt), root / "iter_0000000"
        s3 = S3Copies(root, root.parent) if args.s3 else None
        times = _restores(args, head, ram_dir, want, s3)
        mg.register(k_persist=args.k, ram_dir=ram_dir)
        mg.close_ram()  # this rank's slots removed
    finally:
        if ram_dir is not None:
            shutil.rmtree(ram_dir, ignore_errors=True)
        if s3 is not None:
            s3.close()
    return {"snapshot": statistics.median(blocking[1:] or blocking),
            "in_shared_memory": ram_dir is not None, "s3_why": args.s3_why,
            **{t: statistics.median(v) for t, v in times.items()}}


def _restores(args: argparse.Namespace, head: Path, ram_dir: str | None,
              want: dict[str, torch.Tensor], s3: S3Copies | None) -> dict[str, list[float]]:
    """A restarted worker's restores, alternating: from RAM (checked equal to ``want``),
    from ``head``'s local folder, and from S3 (a download of what the load reads, then
    the load of the copy; checked equal to the local folder's)."""
    import moepec.integrations.megatron as mg

    tiers = ("ram", "local", "s3") if s3 is not None else ("ram", "local")
    times: dict[str, list[float]] = {t: [] for t in tiers}
    stored: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for tier in tiers:  # a fresh registration: what a restart has
            mg.register(k_persist=args.k, **({"ram_dir": ram_dir} if tier == "ram" else {}))
            folder, fetch_s = s3.fetch(head.name) if tier == "s3" else (head, 0.0)
            seconds, rep, got = _restore(args, folder)
            assert rep.tier == ("ram" if tier == "ram" else "storage"), rep.tier
            if tier == "ram":
                assert all(torch.equal(got[k], v) for k, v in want.items())
            stored = got if tier == "local" else stored
            if tier == "s3":
                assert all(torch.equal(got[k], v) for k, v in stored.items())
            times[tier].append(fetch_s + seconds)
    return times


def report_levels(levels: dict, rows: dict[str, list[dict[str, float]]]) -> None:
    """The two levels' lines, and their ratios against torch_dist and storage."""
    async_ms = statistics.median(r["blocking"] for r in rows["torch_dist"][1:]) * 1e3
    snap_ms = levels["snapshot"] * 1e3
    where = "shared memory" if levels["in_shared_memory"] else "the process"
    print(f"two levels: RAM snapshot (whole state, {where}) blocks {snap_ms:.1f} ms; "
          f"torch_dist async save blocks {async_ms:.1f} ms: {snap_ms / async_ms:.3f}x "
          f"(goal <= 0.25x)")
    ram, local = levels["ram"] * 1e3, levels["local"] * 1e3
    print(f"restore of a restarted worker: from RAM {ram:.1f} ms, from storage (local "
          f"folder, warm) {local:.1f} ms: RAM / local {ram / local:.3f}x (goal <= 1x)")
    print(report_line(levels["ram"], levels.get("s3"), levels["s3_why"]))

if __name__ == "__main__":
    main()
