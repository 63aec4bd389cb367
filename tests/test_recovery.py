"""The fault-tolerant trainer end to end: faults injected, recovered automatically."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moepec import CheckpointConfig
from moepec.recovery.offline import verify_path
from moepec.store.storage import Storage
from moepec.train.faults import FaultyFileSystem
from moepec.train.trainer import TrainConfig, train

REPO = Path(__file__).resolve().parents[1]
BASE = dict(config="tiny", steps=40, batch_size=8, eval_batches=1, eval_interval=0,
            progress=False, threads=1)
CKPT = dict(interval=8, k_persist=1, k_snapshot=2)


def events(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "event" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    return train(TrainConfig(**BASE, out_dir=str(out)))


@pytest.mark.slow
def test_torchrun_sigkill_one_rank_recovers_to_the_same_end(tmp_path, uninterrupted):
    # torch issue 135712: restarted workers may read the previous round's addresses from
    # the rendezvous store torchrun shares with them; a store of their own avoids it.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "--max-restarts", "2", "-m", "moepec", "train", "--config", "tiny", "--steps",
           "40", "--batch-size", "8", "--eval-batches", "1", "--eval-interval", "0",
           "--no-progress", "--threads", "1", "--ckpt-dir", str(tmp_path / "ckpt"),
           "--ckpt-interval", "8", "--k", "1", "--k-snapshot", "2", "--out-dir",
           str(tmp_path), "--faults", "sigkill@35:r1", "--dist-timeout", "30"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_step"] == 39
    assert summary["data_state"] == uninterrupted.data_state
    # the default RAM tier (shared memory) outlived the killed worker: the restarted
    # workers resume from the newest snapshot, step 31, whatever storage had committed
    assert summary["resumed_from"] == 31
    ev = events(tmp_path)
    faults = [json.loads(x) for x in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(f["kind"], f["rank"], f["step"]) for f in faults] == [("sigkill", 1, 35)]
    recoveries = [e for e in ev if e["event"] == "recovery"]
    assert len(recoveries) == 1 and recoveries[0]["tier"] == "ram"
    assert recoveries[0]["plt"] > 0  # K_snapshot = 2 of 4 experts: the others are older
    assert verify_path(str(tmp_path / "ckpt")).ok


def test_in_process_restarts_recover_from_ram(tmp_path, uninterrupted):
    res = train(TrainConfig(**BASE, out_dir=str(tmp_path),
                            checkpoint=CheckpointConfig(path=str(tmp_path / "ckpt"), **CKPT),
                            faults="exception@12,exception@29", restarts=2))
    assert res.final_step == 39
    assert res.data_state == uninterrupted.data_state
    assert [r["tier"] for r in res.recoveries] == ["ram", "ram"]
    assert [r["step"] for r in res.recoveries] == [7, 23]
    # the first checkpoint of a run is full: nothing lost; the second loses stale experts
    assert res.recoveries[0]["plt"] == 0 < res.recoveries[1]["plt"]


def test_dynamic_k_keeps_plt_under_budget(tmp_path):
    faults = ",".join(f"exception@{s}" for s in range(12, 200, 16))
    common = dict(BASE, steps=200, restarts=20, faults=faults)
    ckpt = dict(CKPT, interval=4, k_snapshot=None, plt_budget=0.03)
    fixed = train(TrainConfig(**common, out_dir=str(tmp_path / "fixed"), checkpoint=(
        CheckpointConfig(path=str(tmp_path / "fixed" / "ckpt"), dynamic_k=False, **ckpt))))
    dyn = train(TrainConfig(**common, out_dir=str(tmp_path / "dyn"), checkpoint=(
        CheckpointConfig(path=str(tmp_path / "dyn" / "ckpt"), dynamic_k=True, **ckpt))))
    assert fixed.recoveries[-1]["plt"] > 0.03
    ks = [r["k_persist"] for r in dyn.recoveries]
    assert ks[-1] > ks[0] and ks == sorted(ks)  # K doubled while PLT was over budget
    assert dyn.recoveries[-1]["plt"] < 0.03
    # K history survives in the manifests (so it survives restarts)
    st = Storage(str(tmp_path / "dyn" / "ckpt"))
    manifest = st.read_manifest(st.committed()[-1])
    assert len(manifest.meta.k_history) > 1 and manifest.meta.k_persist == ks[-1]


def test_failing_storage_training_continues_error_visible(tmp_path, uninterrupted):
    try:
        res = train(TrainConfig(**BASE, out_dir=str(tmp_path), faults="storage_error@10",
                                checkpoint=CheckpointConfig(
                                    path=str(tmp_path / "ckpt"), **CKPT, keep_last=10,
                                    async_snapshot=False, async_persist=False)))
    finally:
        FaultyFileSystem.mode = None
    assert res.final_step == 39 and res.data_state == uninterrupted.data_state
    ev = events(tmp_path)
    errors = [e for e in ev if e["event"] == "persist_error"]
    assert errors and "Input/output error" in errors[0]["error"]
    st = Storage(str(tmp_path / "ckpt"))
    steps = [st.read_manifest(n).step for n in st.committed()]
    # the checkpoint before the failure is intact; those while storage failed never
    # committed; after healing, checkpoints commit again, and the run's end gets a
    # complete checkpoint of its last step after the periodic one
    assert steps == [7, 31, 39, 39]
    assert st.read_manifest(st.committed()[-1]).meta.full
    assert verify_path(str(tmp_path / "ckpt")).ok
