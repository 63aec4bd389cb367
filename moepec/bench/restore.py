"""Stitched restore vs a full load: PEC's restore of a view spread over many checkpoints
against ``dcp.load`` of one full checkpoint of the same state.

With K=1 of E experts, the newest view of a PEC run spans E+1 checkpoints: every expert's
newest copy lives in a different one. moepec reads that view with one sequential pass
per data file at the locations its manifests record (no DCP ``.metadata`` to unpickle,
no planning round trips); the baseline is a stock ``dcp.save`` of the model and
optimizer state dicts, loaded back with ``dcp.load``. Both run in this process, on the
same model, timed as medians of a few repeats (page cache warm for both). Each restore
runs in a root of its own, the PEC root's files hard-linked without its lease files (the
same bytes, the same page cache), so that no restore takes over a root another one held.

Run: moepec bench restore [--experts 64 128] [--repeats 5] [--check TOLERANCE] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moepec import CheckpointConfig, CheckpointManager
from moepec.bench import at_least_one
from moepec.models.configs import get_config
from moepec.models.gpt_moe import GPTMoE
from moepec.store.storage import single_process_dcp

GOAL = 1.0
"""The stitched restore may take at most this many times the full dcp.load (issue 50; it
was 1.5 before)."""


def _model(n_experts: int, seed: int) -> tuple[GPTMoE, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPTMoE(get_config("small", n_experts=n_experts))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _nudge(model, opt)  # the optimizer gets its state (Adam moments, step counters)
    return model, opt


def _nudge(model: GPTMoE, opt: torch.optim.Optimizer) -> None:
    """One cheap optimizer step: new values without a forward pass."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _pec_run(root: Path, n_experts: int) -> int:
    """E+1 checkpoints at K=1: the newest view needs all of them. Returns its bytes."""
    model, opt = _model(n_experts, 0)
    cfg = CheckpointConfig(path=str(root), interval=1, k_persist=1, keep_last=1,
                           async_snapshot=False, async_persist=False)
    with CheckpointManager(model, opt, cfg) as mgr:
        for step in range(n_experts + 1):
            _nudge(model, opt)
            mgr.save(step)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
        if torch.is_tensor(v))


def _own_root(root: Path, work: Path) -> Path:
    """A root of its own for one restore: ``root``'s files hard-linked (not copied: the
    same page cache), its lease files left out (a new run takes a free root, quietly)."""
    fresh = work / f"{root.name}-restore"
    shutil.copytree(root, fresh, copy_function=os.link,
                    ignore=shutil.ignore_patterns("moepec.lease*"))
    return fresh


def _restore_once(root: Path, n_experts: int, in_place: bool) -> tuple[float, int]:
    root = _own_root(root, root.parent)
    model, opt = _model(n_experts, 1)
    mgr = CheckpointManager(model, opt, CheckpointConfig(path=str(root), k_persist=1,
                                                         restore_in_place=in_place))
    t0 = time.perf_counter()
    report = mgr.restore()
    seconds = time.perf_counter() - t0
    mgr.close()
    shutil.rmtree(root)
    return seconds, len({s["checkpoint"] for s in report.sources.values()}
                        | {report.checkpoint})


def _load_once(root: Path, n_experts: int) -> float:
    model, opt = _model(n_experts, 1)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with single_process_dcp():
        t0 = time.perf_counter()
        dcp.load(state, checkpoint_id=str(root), no_dist=True)
        return time.perf_counter() - t0


def run(experts: list[int], repeats: int = 5) -> list[dict]:
    """One row per expert count: both timings (medians, the two alternating so that both
    see the same machine) and their ratio."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in experts:
            pec, full = Path(tmp) / f"pec{n}", Path(tmp) / f"full{n}"
            nbytes = _pec_run(pec, n)
            model, opt = _model(n, 0)
            with single_process_dcp():
                dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                         checkpoint_id=str(full), no_dist=True)
            stitched, in_place, loads, sources = [], [], [], 0
            for _ in range(repeats):
                seconds, sources = _restore_once(pec, n, in_place=False)
                stitched.append(seconds)
                in_place.append(_restore_once(pec, n, in_place=True)[0])
                loads.append(_load_once(full, n))
            s, p, f = (statistics.median(x) for x in (stitched, in_place, loads))
            rows.append({"experts": n, "state_mb": nbytes / 1e6, "view_checkpoints": sources,
                         "stitched_restore_s": s, "in_place_restore_s": p,
                         "dcp_load_full_s": f, "ratio": s / f, "ratio_in_place": p / f,
                         "goal": GOAL, "repeats": repeats})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--repeats", type=at_least_one, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (%(default)s)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--check", type=float, default=None, metavar="TOLERANCE",
                    help=f"exit 1 unless every stitched restore takes at most {GOAL}x + "
                         f"TOLERANCE the full dcp.load (`make bench-check`)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.experts, args.repeats)
    print(f"{'experts':>7} {'state MB':>9} {'view ckpts':>10} {'stitched s':>11} "
          f"{'in place s':>11} {'dcp.load s':>11} {'ratio':>6} {'in place':>9}  goal <= {GOAL}x")
    for r in rows:
        print(f"{r['experts']:>7} {r['state_mb']:>9.1f} {r['view_checkpoints']:>10} "
              f"{r['stitched_restore_s']:>11.3f} {r['in_place_restore_s']:>11.3f} "
              f"{r['dcp_load_full_s']:>11.3f} {r['ratio']:>5.2f}x {r['ratio_in_place']:>8.2f}x  "
              f"{'met' if min(r['ratio'], r['ratio_in_place']) <= GOAL else 'MISSED'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    if args.check is not None:
        failed = [f"restore_le_{GOAL}x_dcp_load at {r['experts']} experts ({r['ratio']:.2f}x)"
                  for r in rows if r["ratio"] > GOAL + args.check]
        print(f"bench-check (tolerance {args.check:.2f}): "
              + (f"FAILED {', '.join(failed)}" if failed else "all met"))
        if failed:
            raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main()
