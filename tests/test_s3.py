"""s3:// checkpoints against a real S3-compatible server (moto's), over HTTP on loopback."""

from __future__ import annotations

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.recovery.offline import verify_path
from tests.toy import Counter, full_state, make, run_loop

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")  # the server: tests/conftest.py's s3_options


def test_s3_round_trip_and_verify(s3_options):
    url = "s3://moepec-test/run1"
    model, opt, sched = make(0, "modules", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=url, interval=2, k_persist=1, storage_options=s3_options)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    saved = {}
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 6,
             on_save=lambda step: saved.__setitem__(step, full_state(model, opt)))
    mgr.close()
    assert len(mgr._storage.committed()) == 3
    model2, opt2, sched2 = make(5, "modules", 4)
    c2 = Counter()
    mgr2 = CheckpointManager(model2, opt2, cfg, extra_state={"sched": sched2, "data": c2})
    report = mgr2.restore()
    assert report.step == 5 and c2.position == 6
    got = full_state(model2, opt2)
    assert torch.equal(got["model/embed.weight"], saved[5]["model/embed.weight"])
    # the expert saved at step 5 comes back exactly as it was then
    layer0 = mgr._storage.read_manifest(mgr._storage.committed()[-1]).meta.experts_saved[0][0]
    key = f"model/moe.0.experts.{layer0}.w1"
    assert torch.equal(got[key], saved[5][key])
    mgr2.close()  # a clean close removes its RAM tier's folder in /dev/shm/moepec
    res = verify_path(url, s3_options)
    assert res.ok and res.checked > 0
