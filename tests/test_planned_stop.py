"""Planned stops under torchrun (2 ranks): a SIGTERM to the launcher, or to one rank only,
leaves a complete checkpoint at the step every rank stopped at; the same command again
restores it with nothing lost, redoes no step and ends on the uninterrupted run's losses
and state, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moepec.recovery.offline import consolidate, read_view
from moepec.store.committed import committed_manifests
from moepec.store.storage import Storage

REPO = Path(__file__).resolve().parents[1]
STEPS = 40
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def command(out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "--max-restarts", "1", "-m", "moepec", "train", "--config", "tiny", "--steps",
            str(STEPS), "--batch-size", "8", "--eval-batches", "1", "--eval-interval", "0",
            "--no-progress", "--threads", "1", "--ckpt-dir", str(out / "ckpt"),
            "--ckpt-interval", "8", "--k", "1", "--out-dir", str(out), "--log-interval", "1",
            "--dist-timeout", "60"]


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def losses(recs: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "event" not in r}


def final_state(out: Path) -> tuple[int, dict[str, torch.Tensor]]:
    view = read_view(str(out / "ckpt"))
    return view.manifest.step, consolidate(view.manifest, view.values)


def run_to_end(out: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(out), cwd=out, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def worker_of_rank(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker of ``rank`` (its child with RANK=rank)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} under torchrun {launcher}")


def stop_midway(out: Path, target, after: int) -> tuple[subprocess.CompletedProcess, str]:
    """Start the run, SIGTERM ``target(launcher pid)`` once step ``after`` is trained, wait
    for the end; returns the process and its stderr."""
    log = (out / "stderr.txt").open("w+")
    proc = subprocess.Popen(command(out), cwd=out, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=log, text=True)
    deadline = time.monotonic() + 300
    while not any(s >= after for s in losses(records(out))):
        assert proc.poll() is None, f"the run ended before step {after}: {proc.returncode}"
        assert time.monotonic() < deadline, f"step {after} not trained within 300 s"
        time.sleep(0.02)
    os.kill(target(proc.pid), signal.SIGTERM)
    proc.wait(timeout=300)
    log.seek(0)
    return proc, log.read()


def check_stop(out: Path, life: list[dict], stderr: str, after: int) -> int:
    """The life ended on one planned stop with a complete checkpoint at the step both
    ranks stopped at; returns that step."""
    stops = [r for r in life if r.get("event") == "stop"]
    assert len(stops) == 1, stderr[-3000:]
    stop = stops[0]
    step = stop["step"]
    assert after <= step < STEPS - 1 and stop["signal"] == "SIGTERM" and stop["committed"]
    assert stop["signal_to_commit_s"] is None or stop["signal_to_commit_s"] < 20  # the grace
    # the newest committed checkpoint holds every expert at the step both ranks stopped
    # at (its commit needs both ranks' writes), and no rank trained past it
    found = committed_manifests(Storage(str(out / "ckpt")))
    newest = found.manifests[found.newest]
    assert (newest.meta.step, newest.meta.full, newest.name) == (step, True, stop["checkpoint"])
    assert max(losses(life)) == step
    return step


def resumed_at(life: list[dict], step: int) -> None:
    """The life restored ``step`` losing nothing, K as it was, and redid no step."""
    recovery = [r for r in life if r.get("event") == "recovery"]
    assert [(r["step"], r["lost"], r["plt"], r["k_persist"]) for r in recovery] == \
        [(step, 0, 0.0, 1)]
    assert min(losses(life)) == step + 1


def next_life(out: Path, n: int) -> list[dict]:
    life = records(out)
    (out / "metrics.jsonl").rename(out / f"life{n}.jsonl")
    return life


@pytest.mark.slow
def test_sigterm_to_torchrun_then_to_one_rank_loses_nothing(tmp_path_factory):
    """One uninterrupted run; then the same command three times: SIGTERM to torchrun
    (stop 1), again with SIGTERM to rank 1 only (stop 2), again to the end."""
    ref_out = tmp_path_factory.mktemp("uninterrupted")
    run_to_end(ref_out)
    ref_losses = losses(records(ref_out))
    ref_summary = json.loads((ref_out / "summary.json").read_text())
    ref_step, ref_state = final_state(ref_out)
    out = tmp_path_factory.mktemp("stopped")
    # 1: torchrun gets SIGTERM, forwards it, and exits non-zero as a signalled launcher does
    proc, stderr = stop_midway(out, lambda launcher: launcher, after=8)
    assert proc.returncode != 0
    first = next_life(out, 1)
    stop1 = check_stop(out, first, stderr, 8)
    # 2: the same command resumes; only rank 1 gets SIGTERM: both ranks stop at one step
    # and exit 0, so torchrun (--max-restarts 1) ends the job instead of restarting it
    proc, stderr = stop_midway(out, lambda launcher: worker_of_rank(launcher, 1),
                               after=stop1 + 8)
    assert proc.returncode == 0 and "Restarting" not in stderr, stderr[-3000:]
    second = next_life(out, 2)
    resumed_at(second, stop1)
    stop2 = check_stop(out, second, stderr, stop1 + 8)
    assert " WARNING " not in stderr, stderr[-3000:]  # a rerun after a planned stop is quiet
    # 3: the same command again, to the end: the uninterrupted run's losses, data
    # position, validation loss and final state (weights, Adam moments, RNG), bit for bit
    again = run_to_end(out)
    third = records(out)
    resumed_at(third, stop2)
    assert " WARNING " not in again.stderr, again.stderr[-3000:]
    assert {**losses(first), **losses(second), **losses(third)} == ref_losses
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_state"] == ref_summary["data_state"]
    assert summary["val_loss"] == ref_summary["val_loss"]
    end_step, state = final_state(out)
    assert end_step == ref_step == STEPS - 1 and state.keys() == ref_state.keys()
    assert [k for k in state if not torch.equal(state[k], ref_state[k])] == []
