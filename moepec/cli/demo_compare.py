"""The demo's cost-per-fault comparison: after the restart-all run with its faults, the
same kill with replica groups on torchft, and a planned stop (SIGTERM to the launcher
mid-run) with the same command run again.

Each part returns one row of the comparison: lost seconds per fault (training time the
job lost: the downtime from the fault to training again, plus the steps redone at the
median step time), steps redone, and the PLT the fault added. The report puts the three
side by side (:func:`compare_table`, :func:`restart_all_row`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from moepec.errors import ConfigError, MoepecError
from moepec.train.metrics import read_jsonl

__all__ = ["compare_table", "planned_stop_row", "replica_group_row", "restart_all_row",
           "stop_settings"]

log = logging.getLogger(__name__)


def restart_all_row(faults: list[dict[str, Any]], iter_s: float) -> dict[str, Any] | None:
    """The restart-all run's first SIGKILL (the demo's report rows, :mod:`demo_report`):
    its downtime, the steps redone and the PLT its recovery added."""
    plt_before = 0.0
    for f in faults:
        if f["recovered_to"] is None:
            continue
        if f["kind"] == "sigkill":
            redone = f["steps_redone"]
            return {"what": f"sigkill@{f['step']}:r{f['rank']}", "downtime_s": f["downtime_s"],
                    "steps_redone": redone, "lost_s": f["downtime_s"] + redone * iter_s,
                    "plt": f["plt_after"] - plt_before}
        plt_before = f["plt_after"]
    return None


def replica_group_row(s, out: Path, say=print) -> dict[str, Any] | None:
    """Two replica groups of ``s.ranks // 2`` rank(s) (at least 1) on torchft, the same
    model, batch and checkpoints as the restart-all run, ``s.ft_steps`` steps; one rank of
    group 1 SIGKILLed a few seconds into training. None (said) when torchft is missing."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's import: it logs every quorum
    try:
        from moepec.bench.ft import FtBenchSettings, run_replica_groups
        from moepec.integrations import torchft  # noqa: F401 - raises without the extra
    except ConfigError as exc:
        say(f"  skipped: {exc}")
        return None
    fs = FtBenchSettings(kills=1, config=s.config, batch_size=s.batch_size, steps=s.ft_steps,
                         ckpt_interval=s.ckpt_interval, gap_s=1.0, seed=s.seed,
                         ranks_per_group=max(1, s.ranks // 2), restart_all=False)
    out.mkdir(parents=True, exist_ok=True)
    r = run_replica_groups(fs, out, say=lambda line: say(f" {line}"))
    if any(r["exit_codes"]):
        raise MoepecError(f"the replica-group run failed (exit codes {r['exit_codes']}); "
                          f"see {out}/group*.log")
    if not r["rows"]:  # said by run_replica_groups: the run ended before its kill
        return None
    row = r["rows"][0]
    return {"what": "sigkill, group 1", "downtime_s": row["survivor_lost_s"],
            "steps_redone": 0, "lost_s": row["survivor_lost_s"], "plt": r["plt"],
            "rejoin_s": row["trains_again_s"], "same_final_state": r["same_final_state"]}


def planned_stop_row(s, out: Path, cmd_of, env: dict[str, str], say=print) -> dict[str, Any]:
    """A run of ``s.stop_steps`` steps (the demo's model and checkpoints, no faults) gets
    SIGTERM at its launcher once half of it is trained, then the same command again.
    Lost seconds: from the signal to the launcher's exit, plus the rerun's start to its
    restore. ``cmd_of(settings, out)``: the command of the run."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    cmd = cmd_of(s, out)
    at = s.stop_steps // 2
    with open(out / "train.log", "ab") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 600
            while not any("loss" in r and r.get("step", -1) >= at for r in read_jsonl(metrics)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise MoepecError(f"the planned-stop run ended (exit {proc.returncode}) "
                                      f"or stalled before step {at}; see {out}/train.log")
                time.sleep(0.05)
            t_signal = time.time()
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                raise MoepecError(f"the planned-stop run did not exit within 300 s of its "
                                  f"SIGTERM; see {out}/train.log") from None
        finally:
            if proc.poll() is None:
                proc.kill()
        t_exit = time.time()
        stops = [r for r in read_jsonl(metrics) if r.get("event") == "stop"]
        # torchrun itself exits non-zero on SIGTERM (its workers exit 0, so its agent
        # restarts none): the stop record says whether the stop worked
        if not stops or not stops[-1]["committed"]:
            raise MoepecError(f"the planned stop left no complete checkpoint (exit {code}); "
                              f"see {out}/train.log")
        stop = stops[-1]
        say(f"  SIGTERM to the launcher after step {at}: stopped after step {stop['step']}, "
            f"complete checkpoint committed {stop['signal_to_commit_s']:.2f}s after the "
            f"signal, exit {t_exit - t_signal:.2f}s after it; the same command again ...")
        t_rerun = time.time()
        try:
            code = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                  timeout=600).returncode
        except subprocess.TimeoutExpired:
            raise MoepecError(f"the rerun after the planned stop ran past 600 s; see "
                              f"{out}/train.log") from None
    if code != 0:
        raise MoepecError(f"the rerun after the planned stop failed (exit {code}); see "
                          f"{out}/train.log")
    recs = [r for r in read_jsonl(metrics)
            if r.get("event") == "recovery" and r["time"] >= t_rerun]
    if not recs:
        raise MoepecError(f"the rerun after the planned stop did not resume; see {out}/train.log")
    rec = recs[0]
    downtime = (t_exit - t_signal) + (rec["time"] - t_rerun)
    return {"what": f"SIGTERM@{stop['step']}", "downtime_s": downtime,
            "steps_redone": stop["step"] - rec["step"], "lost_s": downtime,
            "plt": rec["plt"], "signal_to_commit_s": stop["signal_to_commit_s"],
            "signal_to_exit_s": t_exit - t_signal, "restore_s": rec["seconds"],
            "complete_bytes": stop["bytes"], "rerun_restore_s": rec["time"] - t_rerun}


def stop_settings(s):
    """The planned-stop run's settings: the demo's, ``s.stop_steps`` long, no faults, the
    RAM tier in the process (the rerun restores from storage, as after a preemption that
    moved the job to other nodes)."""
    return dataclasses.replace(s, steps=s.stop_steps, faults="", ram_dir=None, ram_lost=False)


def compare_table(rows: dict[str, dict[str, Any] | None]) -> list[str]:
    """The cost-per-fault table: one column per kind of fault handling."""
    names = [("restart_all", "restart-all"), ("replica_groups", "replica groups"),
             ("planned_stop", "planned stop")]
    cols = [(title, rows.get(key)) for key, title in names]

    def cell(row, fmt) -> str:
        return "-" if row is None else fmt(row)

    def line(label: str, fmt) -> str:
        return f"  {label:<26}" + "".join(f"{cell(r, fmt):>18}" for _, r in cols)

    return [
        "cost per fault: the same model, batch and checkpoints",
        f"  {'':<26}" + "".join(f"{title:>18}" for title, _ in cols),
        line("fault", lambda r: r["what"]),
        line("lost seconds", lambda r: f"{r['lost_s']:.2f}s"),
        line("  of which downtime", lambda r: f"{r['downtime_s']:.2f}s"),
        line("steps redone", lambda r: f"{r['steps_redone']}"),
        line("PLT added", lambda r: f"{100 * r['plt']:.3f}%"),
    ]
