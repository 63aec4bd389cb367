"""Fencing (issue 21.1): after a takeover, the old writer never writes, renames or deletes
anything in the root, and nothing it does can damage the new holder's checkpoints, even
before it notices (checkpoint names are unique per run). Two live writers, 30 s, on a
local root and on a real S3-compatible server (moto)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.recovery.offline import verify_path
from moepec.store.storage import Storage
from tests.toy import Counter, full_state, make

ROOT = Path(__file__).resolve().parent.parent
WRITER = str(ROOT / "tests" / "fence_writer.py")
SECONDS = 30.0


def _writer(path: str, seconds: float, takeover: bool, out: Path,
            options: dict | None) -> subprocess.Popen:
    args = [sys.executable, WRITER, path, str(seconds), "1" if takeover else "0", str(out)]
    if options:
        args.append(json.dumps(options))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _two_writers_after_a_takeover(path: str, tmp_path: Path, options: dict | None) -> None:
    old = _writer(path, SECONDS + 15, False, tmp_path / "a.pt", options)
    new = None
    try:
        assert old.stdout.readline().strip() == "ready", old.stderr.read()[-3000:]
        new = _writer(path, SECONDS, True, tmp_path / "d.pt", options)
        _, new_err = new.communicate(timeout=SECONDS + 120)
        assert new.returncode == 0, new_err[-3000:]
        _, old_err = old.communicate(timeout=SECONDS + 120)
        assert old.returncode == 0, old_err[-3000:]
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    a = json.loads((tmp_path / "a.pt.json").read_text())
    d = json.loads((tmp_path / "d.pt.json").read_text())
    # The old writer learnt it was fenced, said so once, and trained on without errors.
    assert a["fenced"] and "took over the checkpoint root" in a["fenced"]
    assert old_err.count("took over the checkpoint root") == 1, old_err[-3000:]
    # The new holder never failed a persist, and committed many checkpoints.
    assert d["errors"] == [] and d["fenced"] is None
    assert all(ok for _, ok in d["records"]) and len(d["records"]) > 5, d["records"][:5]
    # Every committed checkpoint reads back intact.
    res = verify_path(path, options)
    assert res.ok and not res.bad and not res.damaged_manifests, (res.bad, res.damaged_manifests)
    # The old run's folders stopped at its fencing: none of its checkpoints is newer than
    # the one it might have been writing when it noticed.
    st = Storage(path, options)
    names = [n for n, _ in st.list_checkpoints()]
    assert d["newest"] == max(names, key=lambda n: (int(n[5:11]), n)) or \
        d["newest"] in names
    late = [n for n in names if n.endswith(a["run_id"]) and int(n[5:11]) > int(d["newest"][5:11])]
    assert late == []
    # A restore gives the new holder's newest step, bit for bit.
    model, opt, sched = make(7, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=path, interval=3, k_persist=1, storage_options=options or {},
                           ram_dir=None)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    report = mgr.restore()
    assert report.checkpoint == d["newest"] and report.step == d["newest_step"]
    manifest = st.read_manifest(d["newest"])
    saved = torch.load(tmp_path / "d.pt", weights_only=True)
    got = full_state(model, opt)
    assert saved and set(got) == set(saved)
    for key, value in saved.items():
        if ".experts." not in key or value.dim() == 0:  # Adam's step counters are whole
            assert torch.equal(got[key], value), key
            continue
        layer = int(key.split("moe.")[1].split(".")[0])
        for e in manifest.meta.experts_saved[layer]:  # saved at this step: exact
            assert torch.equal(got[key][e], value[e]), (key, e)
    mgr.close()


@pytest.mark.slow
def test_two_live_writers_after_a_takeover_local(tmp_path):
    _two_writers_after_a_takeover(str(tmp_path / "root"), tmp_path, None)


@pytest.mark.slow
def test_two_live_writers_after_a_takeover_s3(tmp_path):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        port = server._server.server_port
        opts = {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
        import s3fs

        s3fs.S3FileSystem(**opts).mkdir("fence")
        _two_writers_after_a_takeover("s3://fence/run", tmp_path, opts)
    finally:
        server.stop()
