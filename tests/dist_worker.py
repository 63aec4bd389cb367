"""Workers for multi-process checkpoint tests (spawned, gloo, file rendezvous).

The model is a toy with experts placed by expert parallelism: rank r holds the
experts [ep_rank * n_local, (ep_rank + 1) * n_local) of every MoE layer. Expert
weights are initialised by global id, so any layout starts from the same model.
"""

from __future__ import annotations

import json
import os
import signal
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

N_GLOBAL = 4
D, F = 8, 16


class EPMoE(nn.Module):
    def __init__(self, n_local: int, offset: int, layout: str, layer: int) -> None:
        super().__init__()
        self.router = nn.Linear(D, N_GLOBAL, bias=False)
        g = torch.Generator().manual_seed(1000 + layer)
        w1 = torch.randn(N_GLOBAL, D, F, generator=g) * 0.1
        w2 = torch.randn(N_GLOBAL, F, D, generator=g) * 0.1
        self.layout, self.n_local, self.offset = layout, n_local, offset
        sl = slice(offset, offset + n_local)
        if layout == "stacked":
            self.experts = nn.Module()
            self.experts.w1 = nn.Parameter(w1[sl].clone())
            self.experts.w2 = nn.Parameter(w2[sl].clone())
        else:
            self.experts = nn.ModuleList()
            for e in range(offset, offset + n_local):
                m = nn.Module()
                m.w1 = nn.Parameter(w1[e].clone())
                m.w2 = nn.Parameter(w2[e].clone())
                self.experts.append(m)

    def expert(self, local: int):
        if self.layout == "stacked":
            return self.experts.w1[local], self.experts.w2[local]
        return self.experts[local].w1, self.experts[local].w2

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i in range(self.n_local):
            w1, w2 = self.expert(i)
            mask = (choice == self.offset + i)[:, None]
            out = out + torch.where(mask, torch.relu(x @ w1) @ w2, 0.0) + 0.0 * (w1.sum() + w2.sum())
        return x + out, torch.bincount(choice, minlength=N_GLOBAL)


class EPToy(nn.Module):
    def __init__(self, n_local: int, offset: int, layout: str = "stacked") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D, D)
        self.moe = nn.ModuleList(EPMoE(n_local, offset, layout, i) for i in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        counts = []
        for moe in self.moe:
            x, c = moe(torch.tanh(self.embed(x)))
            counts.append(c)
        return self.head(x).squeeze(-1), counts


def init(rank: int, world: int, store: str, timeout_s: float = 30) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def expert_state(model: EPToy, opt, ep_rank: int, n_local: int) -> dict[str, torch.Tensor]:
    """Weights and Adam state by canonical name: experts by (layer, global id)."""
    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for li, moe in enumerate(model.moe):
        for i in range(n_local):
            g = ep_rank * n_local + i
            for wname, w in zip(("w1", "w2"), moe.expert(i)):
                out[f"E{li}.{g}.{wname}"] = w.detach().clone()
                if moe.layout == "stacked":
                    st = opt.state[getattr(moe.experts, wname)]
                    out[f"E{li}.{g}.{wname}.exp_avg"] = st["exp_avg"][i].clone()
                else:
                    st = opt.state[getattr(moe.experts[i], wname)]
                    out[f"E{li}.{g}.{wname}.exp_avg"] = st["exp_avg"].clone()
    for n, p in model.named_parameters():
        if "experts" not in n:
            out[n] = p.detach().clone()
            if p in opt.state:
                out[f"{n}.exp_avg"] = opt.state[p]["exp_avg"].clone()
    del names
    return out


def _build(world: int, rank: int, ep: int, layout: str):
    from moepec import CheckpointConfig  # noqa: F401  (import check in the child)

    n_local = N_GLOBAL // ep
    ep_rank = rank % ep
    model = EPToy(n_local, ep_rank * n_local, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, ep_rank, n_local


def _groups(world: int, ep: int):
    """Expert-data-parallel groups (ranks with the same ep_rank), created on all ranks."""
    groups = {}
    for e in range(ep):
        groups[e] = dist.new_group([r for r in range(world) if r % ep == e])
    return groups


def train_worker(rank: int, world: int, store: str, out: str, ep: int, layout: str,
                 steps: int, ckpt: str, k_persist: int, k_snapshot: int, write_mode: str,
                 kill: str | None = None, ram_restore: bool = False,
                 drop_ram_rank: int | None = None) -> None:
    from moepec import CheckpointConfig, CheckpointManager, FaultHooks

    result = {"rank": rank}
    hooks = FaultHooks()
    try:
        init(rank, world, store)
        model, opt, ep_rank, n_local = _build(world, rank, ep, layout)
        groups = _groups(world, ep) if ep > 1 else {}
        if kill and rank == 1:
            point, nth = kill.split(":")
            seen = {"n": 0}

            def hook(where: str, name: str) -> None:
                if where == point:
                    seen["n"] += 1
                    if seen["n"] == int(nth):
                        os.kill(os.getpid(), signal.SIGKILL)

            hooks.on_persist = hook
        # In-process RAM tier: these workers drop a rank's RAM copies by hand (the
        # shared-memory tier, which outlives them, has its own tests).
        cfg = CheckpointConfig(path=ckpt, interval=2, k_persist=k_persist, k_snapshot=k_snapshot,
                               write_mode=write_mode, keep_last=10, timeout_s=20, ram_dir=None)
        mgr = CheckpointManager(model, opt, cfg, hooks=hooks,
                                expert_parallel=(ep_rank, ep) if ep > 1 else None)
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(steps):
            x = torch.randn(16, D, generator=gen)
            pred, counts = model(x)
            loss = (pred ** 2).mean()
            opt.zero_grad()
            loss.backward()
            for n, p in model.named_parameters():
                if p.grad is None:  # the router: argmax routing has no gradient here
                    p.grad = torch.zeros_like(p)
                if "experts" in n:
                    if ep > 1:
                        dist.all_reduce(p.grad, group=groups[ep_rank])
                    else:
                        dist.all_reduce(p.grad)
                    p.grad /= world // ep if ep > 1 else world
                else:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            mgr.wait_for_snapshot()
            opt.step()
            mgr.observe_routing(counts)
            if mgr.step(step):
                mgr.wait_for_snapshot()
                torch.save(expert_state(model, opt, ep_rank, n_local),
                           Path(out) / f"hist-r{rank}-s{step}.pt")
        if ram_restore:
            mgr.wait_for_snapshot()
            mgr._persister.wait_idle()
            if rank == drop_ram_rank:
                # this rank "restarted": its RAM tier is gone, the others' survived
                mgr._ram_tier.drop()
            # a fault inside the step on every rank: processes survive, RAM is intact
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            report = mgr.restore()
            result.update(step=report.step, tier=report.tier, units_from=report.units_from,
                          plt=report.plt, lost=report.lost)
            torch.save(expert_state(model, opt, ep_rank, n_local),
                       Path(out) / f"restored-r{rank}.pt")
        mgr.close()
        result["records"] = [(r.name, r.bytes_per_rank) for r in mgr._persister.records]
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["trace"] = traceback.format_exc()
    Path(out, f"result-r{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def restore_worker(rank: int, world: int, store: str, out: str, ep: int, layout: str,
                   ckpt: str, n_global: int = N_GLOBAL) -> None:
    from moepec import CheckpointConfig, CheckpointManager

    global N_GLOBAL
    N_GLOBAL = n_global
    result = {"rank": rank}
    try:
        if world > 1:
            init(rank, world, store)
        model, opt, ep_rank, n_local = _build(world, rank, ep, layout)
        cfg = CheckpointConfig(path=ckpt, interval=2, keep_last=10, timeout_s=20)
        mgr = CheckpointManager(model, opt, cfg,
                                expert_parallel=(ep_rank, ep) if ep > 1 else None)
        report = mgr.restore()
        result.update(step=report.step, plt=report.plt, lost=report.lost,
                      sources=report.sources, ok=True)
        torch.save(expert_state(model, opt, ep_rank, n_local), Path(out) / f"restored-r{rank}.pt")
        mgr.close()
    except BaseException as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["trace"] = traceback.format_exc()
    Path(out, f"result-r{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def started_write_worker(rank: int, world: int, store: str, out: str, root: str,
                         fail_rank: int) -> None:
    """Storage.write of two ranks' keys (a whole tensor each, the chunks of one shared
    tensor); rank ``fail_rank`` (-1: none) cannot start its data file. Records what
    each rank saw and how long its write took."""
    import time

    from moepec.store import dcp_raw
    from moepec.store.storage import Storage

    init(rank, world, store, timeout_s=60)
    result: dict = {"rank": rank}
    if rank == fail_rank:
        def no_room(self, tensors, r):
            raise OSError(28, "No space left on device (this test's)")
        dcp_raw.RawFileSystemWriter.start = no_room
    w = torch.arange(12, dtype=torch.float32).view(4, 3)
    tensors = {f"own{rank}": torch.full((5,), float(rank)),
               f"w#{2 * rank},0+2,3:4,3": w[2 * rank:2 * rank + 2].clone()}
    t0 = time.perf_counter()
    try:
        where = Storage(root).write("c", tensors, None)
        result.update(ok=True, where=sorted(
            (k, loc.file, loc.offset, loc.length) for k, loc in where.items()))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    result["seconds"] = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"result-r{rank}.json").write_text(json.dumps(result))
