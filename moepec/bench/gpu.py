"""GPU calibration for ``moepec simulate --calibration FILE``.

On a CUDA machine, in a few minutes: device-to-host copy bandwidth (pageable and
pinned), moepec's snapshot throughput, the time the training loop is blocked per
checkpoint by moepec K=1, moepec K=N and ``dcp.async_save``, and the iteration time,
all in one process on one GPU. Writes JSON (``--out``) whose keys the simulator reads:
``d2h_pinned_Bps``, ``d2h_pageable_Bps``, ``snapshot_Bps``, ``iteration_s``,
``blocked_s`` (per method) and ``persist_Bps``.

Without CUDA it prints one line saying so and exits 0.

Run: moepec bench gpu [--config gpt-125m-8e] [--steps 30] [--interval 10] [--out gpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

NO_CUDA = "moepec bench gpu: no CUDA device here, nothing measured (run it on a GPU machine)"


def d2h_bandwidth(nbytes: int = 1 << 30, pinned: bool = True, repeats: int = 5) -> float:
    """Best device-to-host copy bandwidth (bytes/s) of ``nbytes`` over ``repeats``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return nbytes / best


def _loop(method: str, args, workdir: Path) -> dict:
    """Train ``args.steps`` steps on the GPU with one checkpoint method; returns the mean
    iteration time and blocked time per checkpoint (and moepec's throughputs)."""
    import torch.distributed.checkpoint as dcp

    from moepec import CheckpointConfig, CheckpointManager
    from moepec.bench.records import Records
    from moepec.models.configs import get_config
    from moepec.models.gpt_moe import GPTMoE

    torch.manual_seed(0)
    cfg = get_config(args.config)
    model = GPTMoE(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    manager = pending = None
    records = Records()
    if method.startswith("moepec"):
        k = cfg.n_experts if method == "moepec-full" else 1
        manager = CheckpointManager(model, opt, CheckpointConfig(
            path=str(workdir / method), interval=args.interval, k_persist=k, keep_last=1),
            **records.callbacks())
    iters, blocked = [], []
    for step in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device="cuda")
        out = model(idx, idx)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if manager is not None:
            manager.wait_for_snapshot()
        elif pending is not None and not pending.done():
            tb = time.perf_counter()
            pending.result()  # DCP's staged copy must not change while it is written
            blocked[-1] += time.perf_counter() - tb
        opt.step()
        tb = time.perf_counter()
        if manager is not None:
            manager.observe_routing([r.assigned for r in out.routing])
            manager.step(step)
        elif method == "dcp.async_save" and (step + 1) % args.interval == 0:
            if pending is not None:
                pending.result()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            pending = dcp.async_save(state, checkpoint_id=str(workdir / f"dcp{step}"),
                                     no_dist=True)
            blocked.append(time.perf_counter() - tb)
        torch.cuda.synchronize()
        iters.append(time.perf_counter() - t0)
    if pending is not None:
        pending.result()
    res = {"method": method, "iteration_s": statistics.median(iters[3:] or iters)}
    if manager is not None:
        manager.close()
        blocked = records.blocked()
        res.update(_moepec_rates(records))
    res["blocked_s"] = statistics.mean(blocked) if blocked else 0.0
    return res


def _moepec_rates(records) -> dict:
    """Snapshot and persist throughput (bytes/s) from a closed manager's records."""
    out = {}
    snaps = records.copies()
    recs = records.commits
    if snaps:
        out["snapshot_Bps"] = sum(b for b, _ in snaps) / sum(s for _, s in snaps)
    if recs:
        out["persist_Bps"] = sum(r.bytes for r in recs) / sum(r.seconds for r in recs)
    return out


def calibrate(args) -> dict:
    """All measurements as the calibration JSON (see the module docstring)."""
    out: dict = {"device": torch.cuda.get_device_name(0), "config": args.config,
                 "d2h_pinned_Bps": d2h_bandwidth(pinned=True),
                 "d2h_pageable_Bps": d2h_bandwidth(pinned=False, repeats=3)}
    runs = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for method in ("none", "moepec-pec", "moepec-full", "dcp.async_save"):
            runs[method] = _loop(method, args, Path(tmp))
    out["iteration_s"] = runs["none"]["iteration_s"]
    out["blocked_s"] = {m: r["blocked_s"] for m, r in runs.items() if m != "none"}
    for key in ("snapshot_Bps", "persist_Bps"):
        if key in runs["moepec-full"]:
            out[key] = runs["moepec-full"][key]
    out["runs"] = runs
    return out


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="gpt-125m-8e", help="model (%(default)s)")
    ap.add_argument("--steps", type=int, default=30, help="steps per method (%(default)s)")
    ap.add_argument("--interval", type=int, default=10, help="checkpoint interval (%(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (%(default)s)")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (a temp dir)")
    ap.add_argument("--out", default="gpu.json", help="calibration JSON (%(default)s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return None
    res = calibrate(args)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{res['device']}: D2H pinned {res['d2h_pinned_Bps'] / 1e9:.1f} GB/s, pageable "
          f"{res['d2h_pageable_Bps'] / 1e9:.1f} GB/s; iteration {res['iteration_s'] * 1e3:.1f}"
          " ms; blocked per checkpoint " + ", ".join(
              f"{m} {s * 1e3:.1f} ms" for m, s in res["blocked_s"].items())
          + f"; written to {args.out}")
    return res
