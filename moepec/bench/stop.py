"""A planned stop and its resume, measured: SIGTERM to ``torchrun`` mid-run, as a
scheduler's preemption sends it, then the same command again.

For each model, one ``torchrun --nproc_per_node RANKS -m moepec train`` (K=1, a checkpoint
every ``--interval`` steps) gets SIGTERM once step ``--after`` is trained. Measured:

- from the signal to the committed complete checkpoint (the ``stop`` record of rank 0:
  ``signal_to_commit_s``, measured in the worker from the signal's arrival), and its
  bytes, against the last periodic PEC checkpoint's (the baseline: what a stop without a
  complete checkpoint leaves, K of N experts);
- from the signal to the exit of ``torchrun`` (measured here);
- the same command again: the restore's seconds and lost tokens (0: nothing lost), the
  first step it trains (the stop's + 1: nothing redone).

Run: moepec bench stop [--configs small gpt-125m-8e/4] [--ranks 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moepec.bench.size import scaled
from moepec.models.configs import get_config


def _overrides(name: str) -> list[str]:
    """The ``--config`` and ``-O`` flags of ``name`` (``base/S``: scaled down S times)."""
    base, _, scale = name.partition("/")
    if not scale:
        return ["--config", base]
    cfg, full = scaled(base, int(scale)), get_config(base)
    flags = ["--config", base]
    for field in ("d_model", "d_ff", "vocab_size", "seq_len"):
        if getattr(cfg, field) != getattr(full, field):
            flags += ["-O", f"{field}={getattr(cfg, field)}"]
    return flags


def _records(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _command(name: str, out: Path, ranks: int, interval: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(ranks), "-m", "moepec", "train", *_overrides(name), "--steps", "100000",
            "--batch-size", str(4 * ranks), "--eval-batches", "0", "--no-progress",
            "--threads", "1", "--ckpt-dir", str(out / "ckpt"), "--ckpt-interval",
            str(interval), "--k", "1", "--out-dir", str(out), "--log-interval", "1",
            "--dist-timeout", "120"]


def measure(name: str, ranks: int, interval: int, after: int) -> dict[str, Any]:
    """Stop one run of ``name`` with SIGTERM after step ``after``, resume it once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with tempfile.TemporaryDirectory(prefix="moepec-bench-stop-") as tmp:
        out = Path(tmp)
        cmd = _command(name, out, ranks, interval)
        log = (out / "stderr.txt").open("w+")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 900
        while not any(r.get("step", -1) >= after and "loss" in r for r in _records(out)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the run ended or stalled before step {after}")
            time.sleep(0.01)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        exit_s = time.monotonic() - t0
        first = _records(out)
        (out / "metrics.jsonl").rename(out / "first.jsonl")
        stops = [r for r in first if r.get("event") == "stop"]
        if len(stops) != 1:
            log.seek(0)
            raise RuntimeError(f"{name}: no stop record after the signal (torchrun's exit "
                               f"{proc.returncode}): {log.read()[-3000:]}")
        stop = stops[0]
        commits = [r for r in first if r.get("event") == "commit"]
        periodic = [c["bytes"] for c in commits if not c["full"]]
        resume = subprocess.run(cmd[:cmd.index("--steps") + 1] + [str(stop["step"] + 2)]
                                + cmd[cmd.index("--steps") + 2:], env=env,
                                capture_output=True, text=True, timeout=900)
        if resume.returncode != 0:
            raise RuntimeError(f"{name}: the resume failed: {resume.stderr[-2000:]}")
        second = _records(out)
        [recovery] = [r for r in second if r.get("event") == "recovery"]
        trained = [r["step"] for r in second if "loss" in r and "event" not in r]
    return {"config": name, "ranks": ranks, "stop_step": stop["step"],
            "signal_to_commit_s": stop["signal_to_commit_s"],
            "save_s": stop["save_seconds"], "signal_to_exit_s": exit_s,
            "complete_bytes": stop["bytes"],
            "periodic_pec_bytes": periodic[-1] if periodic else None,
            "restore_s": recovery["seconds"], "lost": recovery["lost"],
            "plt": recovery["plt"], "first_step_after": min(trained)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="moepec bench stop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["small", "gpt-125m-8e/4"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--interval", type=int, default=4, help="steps between checkpoints")
    p.add_argument("--after", type=int, default=9,
                   help="SIGTERM once this step is trained (after a periodic checkpoint)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [measure(c, args.ranks, args.interval, args.after) for c in args.configs]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'config':<16}{'ranks':>6}{'stop at':>8}{'to commit':>11}{'to exit':>9}"
          f"{'complete MB':>13}{'PEC K=1 MB':>12}{'restore':>9}{'lost':>6}{'next':>6}")
    for r in rows:
        pec = r["periodic_pec_bytes"]
        print(f"{r['config']:<16}{r['ranks']:>6}{r['stop_step']:>8}"
              f"{r['signal_to_commit_s']:>10.2f}s{r['signal_to_exit_s']:>8.2f}s"
              f"{r['complete_bytes'] / 1e6:>13.2f}{(pec or 0) / 1e6:>12.2f}"
              f"{r['restore_s']:>8.2f}s{r['lost']:>6}{r['first_step_after']:>6}")
