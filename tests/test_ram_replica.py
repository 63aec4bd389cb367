"""RAM slot replicas across "nodes": two spawned ranks (gloo, file rendezvous), each its
own node (MOEPEC_NODE_ID) with its own ram_dir. Node n1's shared memory is wiped between
the training processes and the restarted ones: rank 1's shares come from the replica
rank 0 keeps, so the restore is from RAM, bit-exact (K_snapshot = N)."""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.spawning import start_processes
from tests.toy import Counter, full_state, make, run_loop


def _worker(rank: int, world: int, tmp: str, phase: str) -> None:
    tmp_path = Path(tmp)
    os.environ["MOEPEC_NODE_ID"] = f"n{rank}"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv-{phase}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=30))
    from moepec import CheckpointConfig, CheckpointManager

    model, opt, sched = make(0 if phase == "train" else 7, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(tmp_path / "ckpt"), ram_dir=str(tmp_path / f"shm-n{rank}"),
                           interval=2, k_persist=1, k_snapshot=4, timeout_s=30)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"data": counter, "sched": sched})
    out: dict = {"replicated": mgr._replicator is not None}
    if phase == "train":
        gen = torch.Generator().manual_seed(1)
        run_loop(mgr, model, opt, sched, counter, gen, 0, 8, None)
        mgr.wait_for_snapshot()
        torch.save(full_state(model, opt), tmp_path / f"saved-{rank}.pt")
        mgr._replicator.wait_idle()
        mgr._persister.wait_idle()
        out["sent"] = mgr._replicator.sent
        dist.barrier()
        (tmp_path / f"out-{phase}-{rank}.json").write_text(json.dumps(out))
        os._exit(0)  # a crash: nothing cleaned up
    report = mgr.restore()
    saved = torch.load(tmp_path / f"saved-{rank}.pt", weights_only=True)
    now = full_state(model, opt)
    out.update(tier=report.tier, step=report.step, units_from=report.units_from,
               equal=now.keys() == saved.keys() and all(torch.equal(now[k], saved[k])
                                                        for k in now),
               position=counter.position)
    mgr.close()
    dist.destroy_process_group()
    (tmp_path / f"out-{phase}-{rank}.json").write_text(json.dumps(out))


def _spawn(tmp_path: Path, phase: str) -> list[dict]:
    start_processes(_worker, (2, str(tmp_path), phase), 2)
    return [json.loads((tmp_path / f"out-{phase}-{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_lost_node_restores_its_shares_from_the_replica_on_another_node(tmp_path):
    trained = _spawn(tmp_path, "train")
    assert [t["replicated"] for t in trained] == [True, True]
    assert all(t["sent"] == 4 for t in trained)  # every checkpoint's slot went across
    held = list((tmp_path / "shm-n0").glob("*/replica-of-rank1/slot*.json"))
    assert held and (tmp_path / "shm-n1").exists()
    shutil.rmtree(tmp_path / "shm-n1")  # node n1 replaced: its shared memory is gone
    restored = _spawn(tmp_path, "restore")
    for r in restored:
        assert (r["tier"], r["step"], r["position"]) == ("ram", 7, 8), r
        assert set(r["units_from"]) == {"ram"} and r["equal"], r
    # a clean close removed every slot and replica
    assert not any(p.is_file() for p in tmp_path.glob("shm-n*/**/*"))
