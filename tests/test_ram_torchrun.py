"""The shared-memory RAM tier under torchrun --max-restarts: real SIGKILLs, real restarts.

One run of 2 ranks (gloo) with K_snapshot = N (every expert in RAM), so a restore from
RAM is the snapshot's state exactly: the steps trained again after a restart must give
the same losses, bit for bit, as the first time (a storage restore with K_persist=1
would bring back stale experts and different losses). Two faults, two restarts:

1. ``kill_commit@15:r0``: rank 0 is SIGKILLed after step 15's data is written, before
   its manifest: storage lacks step 15, both ranks' slots hold it. The restarted workers
   restore it from RAM and persist it before training on (persist on failure).
2. ``kill_copy@31:r1``: rank 1 is SIGKILLed while copying step 31 into its slot: that
   slot is torn (no header), so step 31 is incomplete in RAM; the older slots (step 23)
   serve both ranks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moepec.ram.jobs import DEFAULT_DIR, job_name
from moepec.recovery.offline import verify_path
from moepec.train import faults

REPO = Path(__file__).resolve().parents[1]


def run_torchrun(tmp_path: Path, faults: str, restarts: int, *extra: str):
    # torch issue 135712: restarted workers need a rendezvous store of their own.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "--max-restarts", str(restarts), "-m", "moepec", "train", "--config", "tiny",
           "--steps", "40", "--batch-size", "8", "--eval-batches", "1", "--eval-interval",
           "0", "--no-progress", "--threads", "1", "--ckpt-dir", str(tmp_path / "ckpt"),
           "--ckpt-interval", "8", "--k", "1", "--k-snapshot", "4", "--out-dir",
           str(tmp_path), "--faults", faults, "--dist-timeout", "30", "--log-interval", "1",
           *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_restarted_workers_restore_from_shared_memory(tmp_path):
    """No --ram-dir: the default (ram_dir="auto") keeps the slots in /dev/shm/moepec."""
    shm = Path(DEFAULT_DIR) / job_name(str(tmp_path / "ckpt"))
    proc = run_torchrun(tmp_path, "kill_commit@15:r0,kill_copy@31:r1", 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count(f"RAM tier: shared memory in {DEFAULT_DIR}") == 3  # per start
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_step"] == 39
    recs = records(tmp_path)
    recoveries = [r for r in recs if r.get("event") == "recovery"]
    assert [(r["step"], r["tier"]) for r in recoveries] == [(15, "ram"), (23, "ram")]
    # every expert came from RAM, nothing lost (PLT at K_snapshot = N is 0)
    assert all(r["units_from"] == {"ram": r["units_from"]["ram"]} for r in recoveries)
    assert [r["plt"] for r in recoveries] == [0.0, 0.0]
    # persist on failure: step 15 was only in RAM; the restarted workers committed it
    assert re.fullmatch(r"ckpt-000001-step00000015-[0-9a-f]{12}", recoveries[0]["persisted"])
    # ... once: not by the killed worker, but during the restore (its record just before)
    commits_15 = [i for i, r in enumerate(recs) if r.get("event") == "commit" and r["step"] == 15]
    assert commits_15 == [recs.index(recoveries[0]) - 1]
    assert verify_path(str(tmp_path / "ckpt")).ok
    # bit-exact restores: each step trained twice has the same loss both times
    losses: dict[int, set[float]] = {}
    for r in recs:
        if "loss" in r and "event" not in r:
            losses.setdefault(r["step"], set()).add(r["loss"])
    again = [s for s in losses if s > 15]
    assert len(losses) == 40 and all(len(v) == 1 for v in losses.values()), losses
    assert len(again) >= 20
    # a clean close removed the slots
    assert not shm.exists() or not any(p.is_file() for p in shm.rglob("*"))


@pytest.mark.parametrize("kind", ["kill_commit", "kill_persist"])
def test_a_persist_kill_strikes_its_checkpoint_not_an_older_one_in_flight(kind, monkeypatch):
    # The flake this fixes (issue 35.4): under load the persist of step 7 was still in
    # flight when kill_commit@15 was armed, and the kill struck it; recovery then restored
    # step 7 where 15 was expected (made certain by slowing rank 0's storage from step 5).
    kills = []
    monkeypatch.setattr(faults, "kill_self", lambda: kills.append(1))
    monkeypatch.setattr(faults.threading, "Timer", lambda delay, fn: type(
        "T", (), {"start": lambda self: fn()})())
    injector = faults.FaultInjector(faults.FaultPlan.parse(f"{kind}@15"), rank=0, ckpt_url=None)
    injector.before_step(15)  # armed
    where = "before_commit" if kind == "kill_commit" else "write"
    injector.hooks.on_persist(where, "ckpt-000000-step00000007-0123456789ab")
    assert kills == []  # the persist of step 7, still in flight: not its target
    injector.hooks.on_persist(where, "ckpt-000001-step00000015-0123456789ab")
    assert kills == [1]


def run_two_nodes(tmp_path: Path, faults: str) -> list[subprocess.CompletedProcess]:
    """Two "nodes" on this machine: one torchrun agent each (c10d rendezvous, so a
    restart on one node restarts both), each with its own MOEPEC_NODE_ID and ram_dir."""
    port = 29400 + os.getpid() % 500
    procs = []
    for node in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "MOEPEC_NODE_ID": f"n{node}"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", f"two-nodes-{port}", "--max-restarts", "2",
               "-m", "moepec", "train", "--config", "tiny", "--steps", "24", "--batch-size",
               "8", "--eval-batches", "1", "--eval-interval", "0", "--no-progress",
               "--threads", "1", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-interval", "4",
               "--k", "1", "--k-snapshot", "4", "--out-dir", str(tmp_path / "out"),
               "--faults", faults, "--dist-timeout", "30", "--log-interval", "1",
               "--ram-dir", str(tmp_path / f"shm-n{node}")]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "")
            for p, out in zip(procs, outs)]


@pytest.mark.slow
def test_a_lost_node_restores_from_its_replica_under_two_torchrun_agents(tmp_path):
    # ram_lost@10:r1 wipes node n1's ram_dir, then SIGKILLs rank 1: both agents restart
    # their workers; rank 1's shares of step 7 come from the replica rank 0 holds on n0.
    # Then both nodes lose their shared memory at step 18: storage serves, as without RAM.
    procs = run_two_nodes(tmp_path, "ram_lost@10:r1,ram_lost@18:r0,ram_lost@18:r1")
    for p in procs:
        assert p.returncode == 0, p.stdout[-4000:]
    out = tmp_path / "out"
    assert json.loads((out / "summary.json").read_text())["final_step"] == 23
    recs = records(out)
    recoveries = [r for r in recs if r.get("event") == "recovery"]
    # (c10d rendezvous may add a restart round after the second fault: its restore
    # comes after these two and is not checked)
    assert [(r["step"], r["tier"]) for r in recoveries[:2]] in (
        [(7, "ram"), (11, "storage")], [(7, "ram"), (15, "storage")]), recoveries
    assert set(recoveries[0]["units_from"]) == {"ram"} and recoveries[0]["plt"] == 0.0
    assert set(recoveries[1]["units_from"]) == {"storage"}
    # rank 0 alone served every key: its own shares and rank 1's replica
    assert "keys survive on 1 rank(s)" in "".join(p.stdout for p in procs)
    # bit-exact from RAM: the steps trained again after it repeat their losses exactly
    seen: dict[int, list[float]] = {}
    for r in recs:
        if "loss" in r and "event" not in r:
            seen.setdefault(r["step"], []).append(r["loss"])
    again = [s for s in range(8, 11) if len(seen[s]) > 1]
    assert again and all(len(set(seen[s])) == 1 for s in again), seen
    assert not any(p.is_file() for p in tmp_path.glob("shm-n*/**/*"))
