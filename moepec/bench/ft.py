"""``moepec bench ft`` (and ``moepec demo --ft``): what a fault costs with replica groups on
torchft, against today's restart-all recovery, in one run on this machine.

Replica groups: a Lighthouse (in this process) and two groups, one ``torchrun`` each
(``--ranks-per-group`` ranks, ``--max-restarts`` = kills). The bench SIGKILLs the training
process of a random rank of group 1 (pids from the ``ft_join`` record) a few seconds after
the group (re)joined, ``kills`` times; its warm spares take over (``--spares 0``: torchrun
restarts the workers, new Pythons) and heal from group 0. Per kill: the survivor's lost
seconds (the kill to its next committed step), its steps rolled back (0: it never
recovers), the healed group's rejoin time (the kill to the state loaded from the
survivor) and the kill to its first committed step (``ft_first_commit``). Restart-all: one ``torchrun`` with 2
ranks of the same model, the same number of SIGKILLs of rank 1 (``--faults``); torchrun
restarts both workers, which restore from the PEC checkpoints (RAM tier, else storage). Per fault: the downtime (the kill to the
restore) plus the steps redone since the restored checkpoint at the median step time.
Medians, and the ratio of lost seconds per fault.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moepec.train.metrics import read_jsonl
from moepec.train.replicas import STALL_S

__all__ = ["FtBenchSettings", "format_result", "main", "run_bench", "run_demo_ft",
           "run_replica_groups", "run_restart_all"]


@dataclass(kw_only=True, slots=True)
class FtBenchSettings:
    """What the bench runs (defaults: a few minutes on 2 CPU cores)."""

    kills: int = 5
    """SIGKILLs of each run."""
    config: str = "tiny"
    """Model config of both runs."""
    batch_size: int = 8
    """Global batch of both runs."""
    steps: int = 6000
    """Steps of the replica-group run (long enough for every kill and heal)."""
    restart_all_steps: int = 1200
    """Steps of the restart-all run (kills spread evenly)."""
    ckpt_interval: int = 50
    """Steps between PEC checkpoints (both runs)."""
    heartbeat_timeout_ms: int = 1000
    """The Lighthouse's failure-detection time."""
    gap_s: float = 3.0
    """Seconds between a group's (re)join and the next kill."""
    spares: int = 10
    """``--ft-spares`` of the groups: a killed training process is replaced by its warm
    spare (every rank of the group, a new generation); 0: by torchrun's restart (a new
    Python)."""
    ranks_per_group: int = 1
    """Ranks of each replica group (one torchrun each); a kill strikes one at random."""
    restart_all: bool = True
    """Also run restart-all (2 x ranks_per_group ranks in one torchrun) for the ratio."""
    seed: int = 0


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.setdefault("RUST_LOG", "warn")
    return env


def _train_args(s: FtBenchSettings, out: Path, steps: int) -> list[str]:
    return ["-m", "moepec", "--log-level", "WARNING", "train", "--config", s.config,
            "--steps", str(steps), "--batch-size", str(s.batch_size), "--seed", str(s.seed),
            "--threads", "1", "--no-progress", "--log-interval", "10", "--eval-batches", "0",
            "--ckpt-dir", str(out / "ckpt"), "--ckpt-interval", str(s.ckpt_interval),
            "--out-dir", str(out)]


def _torchrun(nproc: int, restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), "--max-restarts", str(restarts), "--monitor-interval", "0.1"]


def _events(records: list[dict], name: str) -> list[dict]:
    return [r for r in records if r.get("event") == name]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench ft: {what} did not happen within {timeout:.0f}s")
        time.sleep(0.05)


def run_replica_groups(s: FtBenchSettings, out: Path, say=print) -> dict[str, Any]:
    """The replica-group run with ``s.kills`` SIGKILLs of group 1; returns its rows."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft is imported
    from moepec.integrations.torchft import start_lighthouse

    lighthouse = start_lighthouse(0, heartbeat_timeout_ms=s.heartbeat_timeout_ms,
                                  join_timeout_ms=500)
    metrics = [out / f"group-{g}" / "metrics.jsonl" for g in (0, 1)]
    procs, kills = [], []
    pick = random.Random(s.seed)
    try:
        for g in (0, 1):
            cmd = _torchrun(s.ranks_per_group, s.kills if g else 0) + _train_args(s, out, s.steps) + [
                "--ft-lighthouse", lighthouse.address, "--ft-groups", "2", "--ft-group", str(g),
                "--ft-timeout", "5", "--ram-dir", "none", "--ft-spares", str(s.spares)]
            log = open(out / f"group{g}.log", "ab")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env()))
        _wait_for(lambda: any("loss" in r for r in read_jsonl(metrics[1])), 300, "group 1 training")
        for k in range(s.kills):
            heals = len(_events(read_jsonl(metrics[1]), "heal"))
            time.sleep(s.gap_s)
            if procs[0].poll() is not None:
                say(f"the run ended after {k} kills; use more --steps")
                break
            join = _events(read_jsonl(metrics[1]), "ft_join")[-1]
            pids = join.get("pids") or [join["pid"]]
            rank = pick.randrange(len(pids))
            t_kill = time.time()
            os.kill(pids[rank], signal.SIGKILL)
            kills.append(t_kill)
            say(f"  kill {k + 1}/{s.kills}: SIGKILL group 1's rank {rank} (pid {pids[rank]})")
            _wait_for(lambda h=heals: len(_events(read_jsonl(metrics[1]), "heal")) > h, 300,
                      f"the heal after kill {k + 1}")
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    return _replica_rows(kills, [read_jsonl(m) for m in metrics], codes)


def _replica_rows(kills: list[float], records: list[list[dict]], codes: list[int]
                  ) -> dict[str, Any]:
    survivor, healed = records
    stalls = _events(survivor, "ft_stall")
    heals = _events(healed, "heal")
    rows = []
    for t in kills:
        # the survivor's first commit after the kill ends the stall the kill caused (a
        # stall recorded is a commit more than STALL_S after the one before); none that
        # began by then: the survivor lost less than STALL_S
        lost = next((w["time"] - t for w in stalls
                     if w["time"] > t and w["time"] - w["seconds"] <= t), STALL_S)
        heal = next((h for h in heals if h["time"] > t), None)
        trains = next((c["time"] - t for c in _events(healed, "ft_first_commit")
                       if c["time"] > t), None)
        rows.append({"kill_time": t, "survivor_lost_s": lost,
                     "rejoin_s": heal["time"] - t if heal else None, "trains_again_s": trains,
                     "heal_step": heal["step"] if heal else None,
                     "transfer_s": heal["seconds"] if heal else None})
    ends = [_events(r, "ft_end") for r in records]
    summary = {"exit_codes": codes,
               "survivor_processes": len(_events(survivor, "ft_join")),
               "survivor_recoveries": len(_events(survivor, "recovery")),
               "survivor_rolled_back_steps": 0 if not _events(survivor, "recovery") else None,
               "survivor_retried_steps": len(_events(survivor, "ft_retry")),
               "final": [e[-1] if e else None for e in ends],
               "same_final_state": bool(all(ends) and ends[0][-1]["model"] == ends[1][-1]["model"]
                                        and ends[0][-1]["optimizer"] == ends[1][-1]["optimizer"]),
               "plt": 0.0}
    return {"rows": rows, **summary}


def run_restart_all(s: FtBenchSettings, out: Path, say=print) -> dict[str, Any]:
    """Today's recovery: one torchrun job of 2 ranks, ``s.kills`` SIGKILLs of rank 1."""
    every = s.restart_all_steps // (s.kills + 1)
    faults = ",".join(f"sigkill@{every * (k + 1) + s.ckpt_interval // 2}:r1"
                      for k in range(s.kills))
    cmd = _torchrun(2 * s.ranks_per_group, s.kills) + _train_args(s, out, s.restart_all_steps) \
        + ["--faults", faults]
    say(f"  restart-all: {2 * s.ranks_per_group} ranks, faults {faults}")
    with open(out / "train.log", "ab") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                              timeout=1800).returncode
    records = read_jsonl(out / "metrics.jsonl")
    faults_fired = _events(read_jsonl(out / "faults.jsonl"), "fault")
    recoveries = _events(records, "recovery")
    from moepec.models import get_config

    step_s = _median_step_s(records, s.batch_size * get_config(s.config).seq_len)
    rows = []
    for f in sorted(faults_fired, key=lambda f: f["time"]):
        rec = next((r for r in recoveries if r["time"] > f["time"]), None)
        if rec is None:
            continue
        redone = f["step"] - rec["step"] - 1
        rows.append({"kill_time": f["time"], "downtime_s": rec["time"] - f["time"],
                     "steps_redone": redone, "lost_s": rec["time"] - f["time"] + redone * step_s,
                     "tier": rec["tier"], "plt": rec["plt"]})
    return {"rows": rows, "exit_code": code, "step_s": step_s,
            "plt": recoveries[-1]["plt"] if recoveries else 0.0}


def _median_step_s(records: list[dict], tokens_per_step: int) -> float:
    """The median seconds per step of a run's metrics lines (their throughput)."""
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    return tokens_per_step / statistics.median(rates) if rates else 0.0


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def run_bench(s: FtBenchSettings, out: Path, say=print) -> dict[str, Any]:
    """Both runs, then the comparison (written to ``out/bench_ft.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("replica-groups", "restart-all"):
        if (out / name).exists():
            import shutil

            shutil.rmtree(out / name)
        (out / name).mkdir()
    t0 = time.time()
    say(f"[1/2] replica groups: 2 groups x {s.ranks_per_group} rank(s), {s.kills} SIGKILLs "
        "of a random rank of group 1")
    ft = run_replica_groups(s, out / "replica-groups", say)
    ra: dict[str, Any] = {"rows": [], "plt": 0.0}
    if s.restart_all:
        say(f"[2/2] restart-all: {2 * s.ranks_per_group} ranks, {s.kills} SIGKILLs of rank 1")
        ra = run_restart_all(s, out / "restart-all", say)
    lost_ft = _median([r["survivor_lost_s"] for r in ft["rows"]])
    lost_ra = _median([r["lost_s"] for r in ra["rows"]])
    result = {
        "settings": asdict(s), "wall_s": time.time() - t0, "replica_groups": ft,
        "restart_all": ra,
        "median": {"survivor_lost_s": lost_ft,
                   "rejoin_s": _median([r["rejoin_s"] for r in ft["rows"]]),
                   "trains_again_s": _median([r["trains_again_s"] for r in ft["rows"]]),
                   "transfer_s": _median([r["transfer_s"] for r in ft["rows"]]),
                   "restart_all_lost_s": lost_ra,
                   "restart_all_downtime_s": _median([r["downtime_s"] for r in ra["rows"]]),
                   "restart_all_steps_redone": _median([r["steps_redone"] for r in ra["rows"]]),
                   "ratio": lost_ra / lost_ft if lost_ft and lost_ra else None}}
    (out / "bench_ft.json").write_text(json.dumps(result, indent=2) + "\n")
    say(format_result(result))
    return result


def _f(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def format_result(r: dict[str, Any]) -> str:
    """The comparison as a small table (also the demo's report)."""
    m, ft, ra = r["median"], r["replica_groups"], r["restart_all"]
    final = ft["final"][0] or {}
    lines = [
        f"faults: {len(ft['rows'])} kills with replica groups, {len(ra['rows'])} with "
        "restart-all (medians)",
        f"{'':<34}{'replica groups':>16}{'restart-all':>14}",
        f"{'lost seconds per fault':<34}{_f(m['survivor_lost_s']):>16}"
        f"{_f(m['restart_all_lost_s']):>14}",
        f"{'  of which downtime (kill->train)':<34}{_f(m['survivor_lost_s']):>16}"
        f"{_f(m['restart_all_downtime_s']):>14}",
        f"{'steps rolled back':<34}{ft['survivor_rolled_back_steps']!s:>16}"
        f"{_f(m['restart_all_steps_redone'], ''):>14}",
        f"{'failed group rejoins (kill->heal)':<34}{_f(m['rejoin_s']):>16}{'(all restart)':>14}",
        f"{'  and trains (kill->first commit)':<34}{_f(m.get('trains_again_s')):>16}{'-':>14}",
        f"{'  state transfer from the peer':<34}{_f(m['transfer_s']):>16}{'-':>14}",
        f"{'PLT':<34}{100 * ft['plt']:>15.3f}%{100 * ra['plt']:>13.3f}%",
        f"less lost time per fault: {_f(m['ratio'], 'x')}",
        f"replica groups: survivor kept 1 process ({ft['survivor_processes']}), "
        f"{ft['survivor_recoveries']} recoveries, {ft['survivor_retried_steps']} steps retried; "
        f"final step {final.get('step')}, data position {final.get('data')}, both groups "
        f"{'bit-identical' if ft['same_final_state'] else 'DIFFERENT'} at the end",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``moepec bench ft [--kills N] [--out DIR] ...``."""
    p = argparse.ArgumentParser(prog="moepec bench ft", description=__doc__.split("\n")[0])
    d = FtBenchSettings()
    p.add_argument("--kills", type=int, default=d.kills)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--restart-all-steps", type=int, default=d.restart_all_steps)
    p.add_argument("--gap", type=float, default=d.gap_s, help="seconds from a join to a kill")
    p.add_argument("--spares", type=int, default=d.spares,
                   help="--ft-spares of the groups (0: torchrun restarts a killed worker)")
    p.add_argument("--ranks-per-group", type=int, default=d.ranks_per_group,
                   help="ranks of each replica group; a kill strikes a random one (%(default)s)")
    p.add_argument("--no-restart-all", action="store_true",
                   help="skip the restart-all run (no ratio)")
    p.add_argument("--out", default="bench-ft-out")
    args = p.parse_args(argv)
    s = FtBenchSettings(kills=args.kills, steps=args.steps,
                        restart_all_steps=args.restart_all_steps, gap_s=args.gap,
                        spares=args.spares, ranks_per_group=args.ranks_per_group,
                        restart_all=not args.no_restart_all)
    run_bench(s, Path(args.out))


def run_demo_ft(out_dir: str | Path = "demo-out", say=print) -> dict[str, Any]:
    """``moepec demo --ft``: one SIGKILL of a replica group's rank mid-run, beside the same
    fault under restart-all; the report goes to ``out_dir/ft/report.md``."""
    out = Path(out_dir) / "ft"
    s = FtBenchSettings(kills=1, steps=2500, restart_all_steps=300)
    result = run_bench(s, out, say)
    (out / "report.md").write_text(
        "# moepec demo --ft: a SIGKILL with replica groups and with restart-all\n\n"
        f"```\n{format_result(result)}\n```\n\nNumbers: `{out / 'bench_ft.json'}`.\n")
    return result
