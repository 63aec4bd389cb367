"""RAM restore vs storage restore of the same view, in one process run.

For each model: one full checkpoint is taken with the shared-memory RAM tier on
(``ram_dir``) and committed to storage (a local folder), so both tiers hold the same
view. The manager is then abandoned without ``close`` (what a SIGKILL leaves), and a
"restarted worker" (a new manager over new model and optimizer objects) restores:

- ``ram``: with the same ``ram_dir`` (the slots the dead worker left: mapped, checksums
  verified, copied into the model);
- ``storage``: with ``ram_dir=None`` (the committed checkpoint, read and verified).

Storage is a local folder (page cache warm: storage's best case) and, with ``--s3``, an
S3 bucket on moto's server over HTTP on loopback (an object store, still on this host).

Timed: ``restore`` (``RestoreReport.seconds``) and restart to first step (manager
construction + restore + one training step), medians of ``--repeats`` alternating
runs, page cache warm for storage (its best case). The restores are checked equal
(``torch.equal`` over the whole state). Also measured: persist on failure (the
restarted worker committing a RAM-only snapshot) and the process start a real restart
adds to both (``python -c 'import moepec, torch'``).

Run: moepec bench ram-restore [--configs small gpt-125m-8e/4] [--repeats 5] [--s3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moepec import CheckpointConfig, CheckpointManager, FaultHooks
from moepec.bench import at_least_one
from moepec.bench.s3_root import start_moto
from moepec.bench.size import scaled, trained_model
from moepec.models.configs import get_config

GOAL = 5.0
"""RAM restore should be at least this many times faster than storage restore."""


def _cfg(name: str):
    base, _, scale = name.partition("/")
    return scaled(base, int(scale)) if scale else get_config(base)


def _abandon(mgr: CheckpointManager) -> None:
    """Stop a manager as a crashed worker leaves it: closed while an error is being handled,
    it keeps its shared-memory slots for the restarted worker (CheckpointManager.close)."""
    try:
        raise RuntimeError("the worker crashed")
    except RuntimeError:
        mgr.close()


def _state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"o/{i}/{k}": v for k, v in st.items()})
    return out


def _one_step(model, cfg, opt) -> None:
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    model(idx, idx).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _restart(root: str, ram_dir: str | None, cfg, n_experts: int, opts: dict):
    t0 = time.perf_counter()
    model, opt = trained_model(cfg)  # new objects, other values (seed-identical init)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    mgr = CheckpointManager(model, opt, CheckpointConfig(
        path=root, ram_dir=ram_dir, k_persist=1, k_snapshot=n_experts,
        async_snapshot=False, async_persist=False, storage_options=opts))
    t1 = time.perf_counter()
    report = mgr.restore()
    t2 = time.perf_counter()
    _one_step(model, cfg, opt)
    t3 = time.perf_counter()
    state = {k: v.clone() for k, v in _state(model, opt).items()}
    _abandon(mgr)
    return report, {"setup_s": t1 - t0, "restore_s": t2 - t1, "first_step_s": t3 - t2,
                    "restart_to_first_step_s": t3 - t0}, state


def measure(name: str, repeats: int, work: Path, ram_base: str, s3: dict | None) -> dict:
    cfg = _cfg(name)
    tag = name.replace("/", "-") + ("-s3" if s3 else "")
    root = f"s3://moepec-bench/{tag}" if s3 else str(work / f"ckpt-{tag}")
    opts = s3 or {}
    ram_dir = f"{ram_base}/{tag}"
    model, opt = trained_model(cfg)
    started: list = []  # the CheckpointEvent of the one save
    mgr = CheckpointManager(model, opt, CheckpointConfig(
        path=root, ram_dir=ram_dir, k_persist=1, k_snapshot=cfg.n_experts,
        async_snapshot=False, async_persist=False, storage_options=opts),
        on_checkpoint=started.append)
    mgr.save(0)  # the first checkpoint is full: both tiers hold the same view
    nbytes = started[-1].snapshot_bytes
    _abandon(mgr)
    rows: dict[str, list[dict]] = {"ram": [], "storage": []}
    states = {}
    for _ in range(repeats):
        for tier, rd in (("ram", ram_dir), ("storage", None)):
            report, times, state = _restart(root, rd, cfg, cfg.n_experts, opts)
            assert report is not None and report.tier == tier, (tier, report)
            rows[tier].append(times)
            states[tier] = state
    ram_s, st_s = states["ram"], states["storage"]
    equal = ram_s.keys() == st_s.keys() and all(torch.equal(ram_s[k], st_s[k]) for k in ram_s)
    med = {tier: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for tier, rs in rows.items()}
    pof = (None if s3 else _persist_on_failure(cfg, work / f"pof-{tag}",
                                               f"{ram_base}/pof-{tag}"))
    shutil.rmtree(ram_dir, ignore_errors=True)
    return {"config": name, "storage": "s3 (moto, loopback)" if s3 else "local folder",
            "snapshot_bytes": nbytes, "median": med, "equal": equal,
            "restore_speedup": med["storage"]["restore_s"] / med["ram"]["restore_s"],
            "restart_speedup": (med["storage"]["restart_to_first_step_s"]
                                / med["ram"]["restart_to_first_step_s"]),
            "persist_on_failure_s": pof}


def _persist_on_failure(cfg, root: Path, ram_dir: str) -> float:
    """Seconds the restarted worker's restore spends committing a RAM-only snapshot."""
    model, opt = trained_model(cfg)
    hooks = FaultHooks()
    mgr = CheckpointManager(model, opt, CheckpointConfig(
        path=str(root), ram_dir=ram_dir, k_persist=1, k_snapshot=cfg.n_experts,
        async_snapshot=False, async_persist=False), hooks=hooks)
    mgr.save(0)

    def fail(where: str, name: str) -> None:
        if where == "before_commit":
            raise OSError("the worker died before the commit")

    hooks.on_persist = fail
    try:
        _one_step(model, cfg, opt)
        mgr.save(1)
    except Exception:  # noqa: BLE001 - the failed commit is the point
        pass
    finally:
        hooks.on_persist = None
    _abandon(mgr)
    model, opt = trained_model(cfg)
    fresh = CheckpointManager(model, opt, CheckpointConfig(
        path=str(root), ram_dir=ram_dir, k_persist=1, k_snapshot=cfg.n_experts,
        async_snapshot=False, async_persist=False))
    t0 = time.perf_counter()
    report = fresh.restore()
    total = time.perf_counter() - t0
    assert report.tier == "ram" and report.persisted_on_failure, report
    fresh.close()
    shutil.rmtree(ram_dir, ignore_errors=True)
    return total


def process_start_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, moepec.manager.manager"], check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["small", "gpt-125m-8e/4"])
    ap.add_argument("--repeats", type=at_least_one, default=5)
    ap.add_argument("--ram-base", default="/dev/shm/moepec-bench" if os.path.isdir("/dev/shm")
                    else None)
    ap.add_argument("--s3", action="store_true",
                    help="also measure storage on S3 (moto's server on loopback)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ram_base = args.ram_base or f"{tmp}/ram"
        s3, server = start_moto() if args.s3 else (None, None)
        rows = [measure(c, args.repeats, Path(tmp), ram_base, None) for c in args.configs]
        rows += [measure(c, args.repeats, Path(tmp), ram_base, s3)
                 for c in args.configs] if s3 else []
        results = {"process_start_s": process_start_s(), "rows": rows, "goal": GOAL}
        shutil.rmtree(ram_base, ignore_errors=True)
        if server is not None:
            server.stop()
    for r in results["rows"]:
        m = r["median"]
        pof = r["persist_on_failure_s"]
        print(f"{r['config']:<16} {r['storage']:<20} {r['snapshot_bytes'] / 2**20:7.1f} MiB  "
              f"restore ram "
              f"{m['ram']['restore_s']:.3f}s storage {m['storage']['restore_s']:.3f}s "
              f"({r['restore_speedup']:.1f}x)  restart->first step ram "
              f"{m['ram']['restart_to_first_step_s']:.3f}s storage "
              f"{m['storage']['restart_to_first_step_s']:.3f}s ({r['restart_speedup']:.1f}x)  "
              f"equal={r['equal']}  persist-on-failure "
              f"{'-' if pof is None else f'{pof:.3f}s'}")
    print(f"process start (python -c 'import torch, moepec'): "
          f"{results['process_start_s']:.2f}s")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
