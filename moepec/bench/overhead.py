"""Checkpoint overhead on the training loop: moepec PEC vs full and vs PyTorch baselines.

One process, one model (`small` GPT-MoE by default), one interval; for each method
the loop trains the same steps and we record, per checkpoint, the time the training
loop is blocked, and the mean iteration time against a run without checkpoints:

  none             no checkpointing (the baseline iteration time)
  torch.save       sync torch.save of model+optimizer state dicts, fsync'd
  dcp.save         sync torch.distributed.checkpoint.save
  dcp.async_save   DCP's async save (stage in the loop, write in a thread)
  moepec-full      moepec, K = N (every expert), asynchronous snapshot + persist
  moepec-pec       moepec, K_persist = 1 (K_snapshot = 1), asynchronous
  moepec-pec-shm   moepec-pec with the RAM tier in shared memory (``--ram-dir``) instead
                   of in-process buffers; the ratio of its blocking to moepec-pec's is
                   reported (``--repeats`` interleaves the methods to pair them in time)

It also measures this machine's host memcpy and fsync'd write bandwidth in the same
run, and reports moepec's snapshot and persist throughput as fractions of them. The
write bandwidth that the persist is held against is that of plain fsync'd writes of
the same bytes, paired with each persist (see ``bandwidth_phase``): on a VM whose page
cache grows into memory the host has not backed yet, writes into new files run 4-5x
slower than a rewrite into just-freed pages, so a bandwidth measured apart from the
persists would compare different things.
Batches are random tokens: this measures time, not learning.

Run: moepec bench overhead [--steps 60 --interval 10 --threads 1] [--out runs/bench/overhead.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moepec import CheckpointConfig, CheckpointManager, FaultHooks
from moepec.bench import at_least_one
from moepec.bench.records import Records
from moepec.models.configs import get_config
from moepec.models.gpt_moe import GPTMoE
from moepec.store.storage import single_process_dcp

METHODS = ("none", "torch.save", "dcp.save", "dcp.async_save", "moepec-full", "moepec-pec",
           "moepec-pec-shm")
SHM_DIR = "/dev/shm/moepec-bench"
SNAPSHOT_GOAL = 0.8
"""A K=1 snapshot copies at least this fraction of a memcpy of the same bytes (medians)."""
PERSIST_GOAL = 0.8
"""A raw persist writes at least this fraction of a plain fsync'd write of the same bytes."""


def checks(bw: dict, tolerance: float = 0.0) -> dict[str, bool]:
    """The throughput checks of the bandwidth phase: each fraction at least its goal less
    ``tolerance`` (a fraction too: 0.05 lets 0.76 pass a goal of 0.8)."""
    pct = f"{round(100 * SNAPSHOT_GOAL)}pct"
    return {f"snapshot_shm_ge_{pct}_memcpy":
            bw["snapshot_frac_memcpy"] >= SNAPSHOT_GOAL - tolerance,
            f"snapshot_process_ge_{pct}_memcpy":
            bw["torch_save"]["snapshot_frac_memcpy"] >= SNAPSHOT_GOAL - tolerance,
            f"persist_ge_{round(100 * PERSIST_GOAL)}pct_write":
            bw["persist_frac_write"] >= PERSIST_GOAL - tolerance}


def memcpy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _free_on_every_cpu(paths: list[Path], cpus: list[int | None]) -> None:
    """Unlink ``paths[i]`` on ``cpus[i]`` (the calling thread pinned there for it, then
    given back its CPUs), so that every CPU has a checkpoint's worth of just-freed pages.

    On this project's VM a write into pages freed on another CPU runs as slowly as one
    into pages the host has never backed (an unlink on CPU 0 then a 94 MB write on CPU
    1: 391 ms median against 95 ms on CPU 0, 10 pairs). The plain write runs on the
    thread that unlinked; the persist writes its data file on a thread of its own,
    wherever the scheduler puts it: freeing pages on every CPU gives both the same
    pages. Until issue 50's fifth pass one scratch file was freed on the unlinking
    thread's CPU, which favoured the plain write."""
    mask = os.sched_getaffinity(0) if cpus[0] is not None else None
    try:
        for path, cpu in zip(paths, cpus, strict=True):
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            path.unlink()
    finally:
        if mask is not None:
            os.sched_setaffinity(0, mask)


def _timed_write(path: Path, data: bytes) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def write_bandwidth(directory: Path, nbytes: int = 128 << 20, files: int = 3
                    ) -> tuple[float, float]:
    """fsync'd write bandwidth two ways: (fresh, rewrite).

    *fresh*: the median over ``files`` new files, all kept until the end, so the page
    cache grows as it does while checkpoints are kept. *rewrite*: the best of writing
    one file again right after unlinking it, so the kernel reuses the pages just freed.
    On a VM whose free memory is handed back to the host (this project's machine) the
    two differ by 4-5x; a checkpoint that keeps its files sees the first.
    """
    data = os.urandom(1 << 20) * (nbytes >> 20)
    fresh = sorted(_timed_write(directory / f"bw-{i}.bin", data) for i in range(files))
    for i in range(files):
        (directory / f"bw-{i}.bin").unlink()
    rewrite = float("inf")
    for _ in range(2):
        rewrite = min(rewrite, _timed_write(directory / "bw.bin", data))
        (directory / "bw.bin").unlink()
    return nbytes / fresh[files // 2], nbytes / rewrite


def fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def run(method: str, args, workdir: Path) -> dict:
    """One method's training run. Stock DCP's one-process warning is silenced for the
    whole run: ``dcp.async_save`` writes in a thread of its own after the call returns."""
    with single_process_dcp():
        return _run(method, args, workdir)


def _run(method: str, args, workdir: Path) -> dict:
    torch.manual_seed(0)
    cfg = get_config(args.config)
    model = GPTMoE(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    root = workdir / method.replace(".", "_")
    manager = None
    records = Records()
    if method.startswith("moepec"):
        k = cfg.n_experts if method == "moepec-full" else 1
        ram_dir = args.ram_dir if method.endswith("-shm") else None
        manager = CheckpointManager(model, opt, CheckpointConfig(
            path=str(root), interval=args.interval, k_persist=k, k_snapshot=k, keep_last=2,
            ram_dir=ram_dir), **records.callbacks())
    pending = None
    iter_times, blocked = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=gen)
        out = model(idx, idx)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if manager:
            manager.wait_for_snapshot()
        elif pending is not None and method == "dcp.async_save" and not pending.done():
            # DCP's staged copy must not be mutated while it is written: wait here
            tb = time.perf_counter()
            pending.result()
            blocked[-1] += time.perf_counter() - tb
        opt.step()
        due = (step + 1) % args.interval == 0
        tb = time.perf_counter()
        if manager:
            manager.observe_routing([r.assigned for r in out.routing])
            manager.step(step)
        elif due and method == "torch.save":
            path = root / f"step{step}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
            fsync_tree(path.parent)
        elif due and method == "dcp.save":
            dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                     checkpoint_id=str(root / f"step{step}"), no_dist=True)
        elif due and method == "dcp.async_save":
            if pending is not None:
                pending.result()
            pending = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                     checkpoint_id=str(root / f"step{step}"), no_dist=True)
        if due and not manager:
            blocked.append(time.perf_counter() - tb)
        iter_times.append(time.perf_counter() - t0)
    t_close = time.perf_counter()
    if pending is not None:
        pending.result()
    result = {"method": method}
    if manager:
        manager.close()
        blocked = records.blocked()
        snaps = records.copies()
        recs = records.commits
        result["snapshot_bytes"] = statistics.mean(b for b, _ in snaps)
        result["snapshot_Bps"] = sum(b for b, _ in snaps) / sum(s for _, s in snaps)
        result["persist_bytes"] = statistics.mean(r.bytes for r in recs)
        result["persist_Bps"] = sum(r.bytes for r in recs) / sum(r.seconds for r in recs)
    result["drain_s"] = time.perf_counter() - t_close
    result["iter_all_s"] = iter_times[args.warmup:]
    result["blocked_all_s"] = blocked
    shutil.rmtree(root, ignore_errors=True)
    return result


def merge(runs: list[dict]) -> dict:
    """One row from repeated runs of a method: per-checkpoint blocking and iteration
    times pooled over the runs, throughputs averaged."""
    row = {"method": runs[0]["method"], "repeats": len(runs)}
    for name in ("snapshot_bytes", "snapshot_Bps", "persist_bytes", "persist_Bps", "drain_s"):
        if name in runs[0]:
            row[name] = statistics.mean(r[name] for r in runs)
    iters = [t for r in runs for t in r["iter_all_s"]]
    blocked = [b for r in runs for b in r["blocked_all_s"]]
    row["iter_s"] = statistics.mean(iters)
    row["blocked_s"] = statistics.mean(blocked) if blocked else 0.0
    row["blocked_max_s"] = max(blocked, default=0.0)
    row["blocked_per_run_s"] = [statistics.mean(r["blocked_all_s"]) if r["blocked_all_s"]
                                else 0.0 for r in runs]
    row["blocked_all_s"] = blocked
    row["checkpoints"] = len(blocked)
    return row


def bandwidth_phase(args, workdir: Path) -> dict:
    """Snapshot and persist throughput on a larger model, where per-item costs amortise:
    a 1/scale copy of --bw-config, K_persist = 1 (after the first, full checkpoint).

    Each persist is paired with a plain fsync'd write of the same number of bytes into
    a new file, in alternating order, every file kept until the end. Both timed regions
    start by unlinking one scratch file per CPU, each on its CPU (for the persist, from
    moepec.store.persist's seam right before its DCP write; ``_free_on_every_cpu``), so
    both write into pages just freed, whichever CPU writes: on this project's VM,
    writes into pages the host has not backed yet run 4-5x slower and would otherwise
    land on one side or the other by chance. The ratio is the persist path's efficiency
    against the plain write of the same bytes.
    Both serializations run: ``raw`` (moepec's default) and ``torch_save`` (stock DCP).
    """
    from moepec.bench.size import scaled, trained_model

    model, opt = trained_model(scaled(args.bw_config, args.bw_scale))
    out = {"config": f"{args.bw_config}/{args.bw_scale}",
           "params": sum(p.numel() for p in model.parameters())}
    out.update(_persist_vs_plain(model, opt, "raw", args.bw_saves, workdir, args.ram_dir))
    out["torch_save"] = _persist_vs_plain(model, opt, "torch_save", args.bw_saves, workdir,
                                          None)
    return out


def _full_collections(found: list[float]) -> Callable[[str, dict], None]:
    """A ``gc.callbacks`` entry that appends the seconds of every full garbage collection
    (any thread) to ``found``: each holds the GIL, so every thread waits for it, and the
    objects a persist leaves alive bring them on (docs/results.md, section 3, issue 50's
    tenth pass)."""
    started: dict[int, float] = {}

    def timer(phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[threading.get_ident()] = time.perf_counter()
        elif (t0 := started.pop(threading.get_ident(), None)) is not None:
            found.append(time.perf_counter() - t0)

    return timer


def _persist_vs_plain(model, opt, serialization: str, saves: int, workdir: Path,
                      ram_dir: str | None) -> dict:
    """Persists of one serialization, each paired with a plain write of the same bytes,
    and the snapshots before them (RAM tier in ``ram_dir``, None: in-process buffers),
    each paired with a memcpy of the same bytes right before it."""
    root, plain_dir = workdir / f"bw-{serialization}", workdir / f"bw-{serialization}-plain"
    plain_dir.mkdir()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [None]
    scratch = [workdir / f"scratch{i}.bin" for i in range(len(cpus))]
    records, hooks = Records(), FaultHooks()
    manager = CheckpointManager(model, opt, CheckpointConfig(
        path=str(root), interval=1, k_persist=1, keep_last=saves + 3,
        serialization=serialization, ram_dir=ram_dir), hooks=hooks, **records.callbacks())
    copy_src = copy_dst = torch.empty(0, dtype=torch.uint8)
    memcpy_s: list[float] = []

    def save(step: int) -> int:
        if copy_src.numel():  # the baseline, right before the snapshot: same bytes
            t0 = time.perf_counter()
            copy_dst.copy_(copy_src)
            memcpy_s.append(time.perf_counter() - t0)
        manager.save(step)
        manager.wait_for_snapshot()
        manager.wait_for_persist()
        return records.commits[-1].bytes

    def plain_write(step: int) -> float:
        for path in scratch:
            _timed_write(path, filler)
        _free_on_every_cpu(scratch, cpus)
        return _timed_write(plain_dir / f"{step}.bin", data)

    def persist_write(step: int) -> int:
        for path in scratch:
            _timed_write(path, filler)
        return save(step)  # the hook unlinks the scratch files

    unlink_s: list[float] = []

    def unlink_before_write(point: str, name: str) -> None:
        if point == "write":  # inside the timed persist: measured and taken out below
            t0 = time.perf_counter()
            _free_on_every_cpu(scratch, cpus)
            unlink_s.append(time.perf_counter() - t0)

    filler = os.urandom(1 << 20) * (save(0) >> 20)  # the first, full checkpoint: untimed
    save(1)  # the first K=1 one, untimed too: each timed snapshot reuses memory (below)
    hooks.on_persist = unlink_before_write
    full_gc_s: list[float] = []
    gc.callbacks.append(timer := _full_collections(full_gc_s))
    try:
        nbytes = persist_write(2)  # sizes the plain writes and the memcpys
        copy_src = torch.empty(records.checkpoints[-1].snapshot_bytes, dtype=torch.uint8)
        copy_dst = torch.empty_like(copy_src.fill_(1)).fill_(0)
        data = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes % (1 << 20))
        plain = []
        for step in range(2, saves + 2):
            # alternate which goes first; persist 2 already ran
            for what in ("persist", "plain") if step % 2 == 0 else ("plain", "persist"):
                if what == "plain":
                    plain.append(plain_write(step))
                elif step > 2:
                    persist_write(step)
    finally:
        hooks.on_persist = None
        gc.callbacks.remove(timer)
    manager.close()
    events = [(e, records.snapshots[e.seq]) for e in records.checkpoints if not e.full]
    recs = records.commits[2:]
    persist_s = [r.seconds - u for r, u in zip(recs, unlink_s, strict=True)]
    # Medians: the typical persist against the typical plain write. The VM stalls some
    # writes 3x for reasons outside both (see the module docstring); the ratio over all
    # pairs, stalls included, is reported beside it.
    persist_bps = len(data) / statistics.median(persist_s)
    write_bps = len(data) / statistics.median(plain)
    # Snapshots: medians per checkpoint over the ones paired with a memcpy. The first two
    # K=1 snapshots are not (the memcpy buffers are sized from the second), and with the
    # full one before them each buffer of the triple buffer has been used once: every
    # paired snapshot copies into memory used before, as in a run's steady state. A
    # buffer's first use takes its page faults (the mean over all shows them). Until
    # issue 50's fourth pass the first K=1 one was in the median, until its eighth the
    # second (the third buffer's first use) was.
    paired = events[len(events) - len(memcpy_s):]
    snap_bps = statistics.median(e.snapshot_bytes / s.copy_s for e, s in paired)
    memcpy_bps = statistics.median(copy_src.numel() / t for t in memcpy_s)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(plain_dir, ignore_errors=True)
    return {"persist_bytes": sum(r.bytes for r in recs) / len(recs),
            "persist_Bps": persist_bps, "write_Bps": write_bps,
            "persist_frac_write": persist_bps / write_bps,
            "persist_frac_write_all": sum(plain) / sum(persist_s),
            "persist_s": persist_s, "write_s": plain, "unlink_s": unlink_s,
            "full_gc_s": full_gc_s,
            "ram": ram_dir or "process",
            "snapshot_bytes": statistics.mean(e.snapshot_bytes for e, _ in events),
            "snapshot_Bps": snap_bps, "memcpy_paired_Bps": memcpy_bps,
            "snapshot_frac_memcpy": snap_bps / memcpy_bps,
            "snapshot_mean_Bps": sum(e.snapshot_bytes for e, _ in events) / sum(
                s.copy_s for _, s in events),
            "snapshot_s": [s.copy_s for _, s in events], "memcpy_s": memcpy_s}


def _collections(seconds: list[float]) -> str:
    return (f"{len(seconds)}, " + ", ".join(f"{1e3 * x:.0f}" for x in seconds) + " ms"
            if seconds else "none")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for training (leave a core to the writer on 2 cores)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--ram-dir", default=SHM_DIR,
                    help="shared-memory folder of the moepec-pec-shm row's RAM tier")
    ap.add_argument("--repeats", type=at_least_one, default=1,
                    help="run the methods this many times, interleaved (order reversed "
                         "every other round); rows pool their checkpoints")
    ap.add_argument("--bw-config", default="gpt-125m-8e",
                    help="model whose 1/--bw-scale copy measures snapshot/persist throughput")
    ap.add_argument("--bw-scale", type=int, default=4)
    ap.add_argument("--bw-saves", type=int, default=8)
    ap.add_argument("--out", default="runs/bench/overhead.json",
                    help="where the results go, as JSON")
    ap.add_argument("--check", type=float, default=None, metavar="TOLERANCE",
                    help="exit 1 unless the snapshot and persist throughput goals are met "
                         "within TOLERANCE (a fraction: 0.05 passes 76%% against 80%%); "
                         "needs --bw-saves > 0 (`make bench-check`)")
    args = ap.parse_args(argv)
    if args.check is not None and args.bw_saves < 1:
        ap.error("--check needs the bandwidth phase (--bw-saves of at least 1)")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=os.environ.get("MOEPEC_BENCH_DIR")) as tmp:
        workdir = Path(tmp)
        memcpy = memcpy_bandwidth()
        write_fresh, write_rewrite = write_bandwidth(workdir)
        runs: dict[str, list[dict]] = {m: [] for m in args.methods}
        for i in range(args.repeats):
            for m in args.methods if i % 2 == 0 else args.methods[::-1]:
                runs[m].append(run(m, args, workdir))
        rows = [merge(rs) for rs in runs.values()]
        bw = bandwidth_phase(args, workdir) if args.bw_saves > 0 else None
    # The machine's write bandwidth: the plain writes paired with persists when there are.
    write = bw["write_Bps"] if bw else write_fresh
    base = next((r["iter_s"] for r in rows if r["method"] == "none"), None)
    for r in rows:
        r["blocked_frac_iter"] = r["blocked_s"] / base if base else None
        r["iter_overhead"] = r["iter_s"] / base - 1 if base else None
        if "snapshot_Bps" in r:
            r["snapshot_frac_memcpy"] = r["snapshot_Bps"] / memcpy
    result = {"config": vars(args), "memcpy_Bps": memcpy, "write_Bps": write,
              "write_fresh_Bps": write_fresh, "write_rewrite_Bps": write_rewrite,
              "baseline_iter_s": base, "rows": rows, "bandwidth": bw,
              "torch": torch.__version__}
    by = {r["method"]: r for r in rows}
    if "moepec-pec" in by and "dcp.async_save" in by:
        pec, dasync = by["moepec-pec"], by["dcp.async_save"]
        result["targets"] = {
            "pec_blocked_le_5pct_iter": pec["blocked_frac_iter"] <= 0.05,
            "pec_5x_less_blocked_than_dcp_async": dasync["blocked_s"] >= 5 * pec["blocked_s"],
            "dcp_async_over_pec_blocked": dasync["blocked_s"] / max(pec["blocked_s"], 1e-9),
        }
    if bw:
        result.setdefault("targets", {}).update(checks(bw))
    if "moepec-pec" in by and "moepec-pec-shm" in by:
        proc, shm = by["moepec-pec"], by["moepec-pec-shm"]
        result["shm_vs_process"] = {
            "process_blocked_s": proc["blocked_s"], "shm_blocked_s": shm["blocked_s"],
            "process_blocked_max_s": proc["blocked_max_s"],
            "shm_blocked_max_s": shm["blocked_max_s"],
            "ratio": shm["blocked_s"] / max(proc["blocked_s"], 1e-9),
            "shm_le_1_2x_process": shm["blocked_s"] <= 1.2 * proc["blocked_s"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    report(result)
    if args.check is not None:
        failed = [name for name, ok in checks(bw, args.check).items() if not ok]
        print(f"bench-check (tolerance {args.check:.2f}): "
              + (f"FAILED {', '.join(failed)}" if failed else "all met"))
        if failed:
            raise SystemExit(1)
    return result


def report(res: dict) -> None:
    print(f"machine: memcpy {res['memcpy_Bps'] / 1e9:.2f} GB/s, fsync'd write "
          f"{res['write_Bps'] / 1e9:.2f} GB/s (new files: {res['write_fresh_Bps'] / 1e9:.2f}; "
          f"rewriting just-freed pages: {res['write_rewrite_Bps'] / 1e9:.2f}); baseline iteration "
          f"{1e3 * res['baseline_iter_s']:.1f} ms ({res['config']['config']}, "
          f"{res['config']['threads']} thread(s))")
    print(f"{'method':<16}{'blocked/ckpt ms':>16}{'% of iter':>10}{'iter ms':>9}"
          f"{'overhead':>10}{'snap GB/s':>11}{'%memcpy':>9}{'persist GB/s':>13}")
    for r in res["rows"]:
        line = (f"{r['method']:<16}{1e3 * r['blocked_s']:>16.2f}"
                f"{100 * (r['blocked_frac_iter'] or 0):>9.1f}%{1e3 * r['iter_s']:>9.1f}"
                f"{100 * (r['iter_overhead'] or 0):>9.1f}%")
        if "snapshot_Bps" in r:
            line += (f"{r['snapshot_Bps'] / 1e9:>11.2f}{100 * r['snapshot_frac_memcpy']:>8.0f}%"
                     f"{r['persist_Bps'] / 1e9:>13.2f}")
        print(line)
    svp = res.get("shm_vs_process")
    if svp:
        print(f"RAM tier blocking per checkpoint (K=1): shared memory mean "
              f"{1e3 * svp['shm_blocked_s']:.2f} ms (max {1e3 * svp['shm_blocked_max_s']:.2f}), "
              f"in-process buffers {1e3 * svp['process_blocked_s']:.2f} ms (max "
              f"{1e3 * svp['process_blocked_max_s']:.2f}): ratio {svp['ratio']:.2f}x")
    bw = res.get("bandwidth")
    if bw:
        print(f"throughput on {bw['config']} ({bw['params'] / 1e6:.1f}M params, K=1 "
              f"checkpoint {bw['persist_bytes'] / 1e6:.1f} MB):")
        for r in (bw, bw["torch_save"]):
            where = "in-process buffers" if r["ram"] == "process" else r["ram"]
            print(f"  snapshot into {where}: {r['snapshot_Bps'] / 1e9:.2f} GB/s, "
                  f"{100 * r['snapshot_frac_memcpy']:.0f}% of the "
                  f"{r['memcpy_paired_Bps'] / 1e9:.2f} GB/s of a memcpy of the same bytes "
                  f"right before it (medians over the {len(r['memcpy_s'])} checkpoints "
                  f"paired with one; "
                  f"the mean, first use of its memory included: "
                  f"{r['snapshot_mean_Bps'] / 1e9:.2f} GB/s)")
        for name, r in (("raw", bw), ("torch_save", bw["torch_save"])):
            print(f"  persist ({name}): {r['persist_Bps'] / 1e9:.2f} GB/s, "
                  f"{100 * r['persist_frac_write']:.0f}% of the {r['write_Bps'] / 1e9:.2f} GB/s "
                  f"of plain fsync'd writes of the same bytes (medians over "
                  f"{len(r['persist_s'])} pairs; over all pairs, stalls included: "
                  f"{100 * r['persist_frac_write_all']:.0f}%; full garbage collections "
                  f"meanwhile: {_collections(r['full_gc_s'])})")
    for name, ok in res.get("targets", {}).items():
        shown = ("not measured (--bw-saves 0)" if ok is None
                 else ok if isinstance(ok, bool) else f"{ok:.1f}x")
        print(f"  {name}: {shown}")


if __name__ == "__main__":
    main()
