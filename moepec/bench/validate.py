"""The simulator against a measured run on this machine.

Trains the same short run twice with the real trainer (``moepec train``, one process):
with checkpoints and no fault, then with the same checkpoints and in-process faults at
fixed steps (``--faults exception@S,... --restarts R``, recovered from the RAM tier).
The simulator is calibrated with what the fault-free run measured (its iteration time
including checkpoints, the blocking time and the write bandwidth from its metrics, the
restore time from the faulty run's recovery records, the routing shares from its last
manifest) and replays the same faults at the same steps. Compared: wall-time overhead
of the faults, recomputed steps and PLT.

Run: moepec bench validate [--config small --steps 150 --interval 10 --faults 37,81,129]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moepec.plan.simulate import Plan, SimRun
from moepec.plan.workload import Cluster, Failures, Timing, shape_from_name


def replay(run: SimRun, fault_steps: list[int], total_steps: int) -> dict:
    """Drive ``run`` to ``total_steps`` steps with a fault before each of ``fault_steps``
    (each fires once, like the trainer's injector); in-process faults: the restart
    first finishes the snapshot in flight (the manager drains it)."""
    it, interval = run.timing.iteration_s, run.plan.interval
    pending = sorted(fault_steps)
    while run.step < total_steps:
        next_ck = run.step + interval - run.step % interval
        stop = min([next_ck, total_steps] + pending[:1])
        run.t += (stop - run.step) * it
        run.step = stop
        if run.step == next_ck:
            stall = run.checkpoint()
            run.t += stall
            run.stats["stall"] += stall
        if pending and run.step == pending[0]:
            pending.pop(0)
            drained = max([run.t] + [c.snap_done for c in run.ckpts])
            run.fail(drained)
            run.t += run.downtime(run.from_ram)
            run.stats["restart"] += run.downtime(run.from_ram)
    return {"wall_s": run.t, "recomputed_steps": run.stats["recomputed"],
            "plt": run.ledger.plt() if run.track else 0.0, "stall_s": run.stats["stall"]}


def _train(out: Path, ckpt: Path, args, faults: str | None) -> dict:
    cmd = [sys.executable, "-m", "moepec", "--log-level", "WARNING", "train", "--config",
           args.config, "--steps", str(args.steps), "--threads", "1", "--eval-batches", "0",
           "--no-progress", "--seed", "0", "--out-dir", str(out), "--log-interval", "1",
           "--ckpt-dir", str(ckpt), "--ckpt-interval", str(args.interval), "--k", str(args.k),
           "--no-dynamic-k"]  # the simulated "pec" strategy keeps K fixed
    if faults:
        cmd += ["--faults", faults, "--restarts", str(faults.count(",") + 1)]
    subprocess.run(cmd, check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "events": [e for e in events if "event" in e],
            "step_s": [summary["tokens"] / summary["steps"] / e["tokens_per_s"]
                       for e in events if "event" not in e and e.get("tokens_per_s")]}


def _routing_shares(ckpt: Path) -> list[list[float]]:
    from moepec.store.storage import Storage

    st = Storage(str(ckpt))
    last = st.read_manifest(st.committed()[-1])
    return [[float(c) for c in row] for row in last.meta.counts]


def measure_and_replay(args, work: Path) -> dict:
    """Both trainer runs, the calibration, the replay and the comparison."""
    clean = _train(work / "a", work / "ck_a", args, None)
    faults = ",".join(f"exception@{s}" for s in args.faults)
    faulty = _train(work / "b", work / "ck_b", args, faults)
    ev = clean["events"]
    blocked = [e["blocked_s"] for e in ev if e["event"] == "checkpoint"]
    commits = [e for e in ev if e["event"] == "commit"]
    restores = [r["seconds"] for r in faulty["summary"]["recoveries"]]
    # The fault-free run's mean step, checkpoints included: the simulator must predict
    # the faulty run's extra wall time (recomputed steps, restores).
    it = clean["summary"]["wall_time_s"] / args.steps
    shape = shape_from_name(args.config)
    cluster = Cluster(gpus=1, gpus_per_node=1, d2h_bw=1e12, storage_bw_gpu=sum(
        c["bytes"] for c in commits) / sum(c["seconds"] for c in commits),
        read_bw_gpu=1e12)
    timing = Timing(iteration_s=it, fixed_block_s=statistics.mean(blocked), commit_s=0.0)
    failures = Failures(mtbf_s=1e9, ram_survives=1.0, detect_s=0.0,
                        restart_s=statistics.mean(restores))
    plan = Plan(name="pec", interval=args.interval, k_persist=args.k, ram_tier=True)
    out = {}
    for label, routing in (("uniform", "uniform"), ("measured", _routing_shares(work / "ck_a"))):
        run = SimRun(shape, cluster, plan, timing, failures, routing=routing,
                   sim_layers=shape.n_moe_layers, budget=0.0375, seed=0)
        out[label] = replay(run, list(args.faults), args.steps)
    wall = faulty["summary"]["wall_time_s"]
    measured = {"wall_s": wall, "overhead_s": wall - clean["summary"]["wall_time_s"],
                "median_step_s": statistics.median(faulty["step_s"]),
                "clean_median_step_s": statistics.median(clean["step_s"]),
                "recomputed_steps": faulty["summary"]["steps"] - args.steps,
                "plt": faulty["summary"]["recoveries"][-1]["plt"]}
    clean_sim = it * args.steps
    for r in out.values():
        r["overhead_s"] = r["wall_s"] - clean_sim
    return {"calibration": {"iteration_s": it, "blocked_s": timing.fixed_block_s,
                            "write_Bps": cluster.storage_bw_gpu,
                            "restore_s": failures.restart_s},
            "measured": measured, "simulated": out, "faults": list(args.faults),
            "config": args.config, "steps": args.steps, "interval": args.interval, "k": args.k}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="small")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--faults", type=int, nargs="+", default=[37, 81, 129])
    ap.add_argument("--out", default=None, help="write the comparison as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        res = measure_and_replay(args, Path(tmp))
    m = res["measured"]
    print(f"{'':>22} {'measured':>10} {'sim uniform':>12} {'sim measured routing':>21}")
    for key, fmt in (("wall_s", "{:.2f}"), ("overhead_s", "{:.2f}"), ("recomputed_steps", "{}"), ("plt", "{:.4f}")):
        print(f"{key:>22} {fmt.format(m[key]):>10} "
              f"{fmt.format(res['simulated']['uniform'][key]):>12} "
              f"{fmt.format(res['simulated']['measured'][key]):>21}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res
