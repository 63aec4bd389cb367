"""Fencing (issue 21.1): after a takeover, the old writer never writes, renames or deletes
anything in the root, and nothing it does can damage the new holder's checkpoints, even
before it notices (checkpoint names are unique per run). Two live writers, on a
local root and on a real S3-compatible server (moto)."""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.keys import parse_checkpoint_name
from moepec.recovery.offline import verify_path
from moepec.store.storage import Storage
from tests.fence_writer import COMMITS
from tests.toy import Counter, full_state, make

ROOT = Path(__file__).resolve().parent.parent
WRITER = str(ROOT / "tests" / "fence_writer.py")
WAIT_S = 900.0
"""How long the test waits for a writer's line or exit: the writers' own deadlines
(fence_writer.DEADLINE_S, 600 s) come first; this only bounds a writer that hangs."""


def _writer(path: str, stop: Path, takeover: bool, out: Path,
            options: dict | None) -> subprocess.Popen:
    args = [sys.executable, WRITER, path, str(stop), "1" if takeover else "0", str(out)]
    if options:
        args.append(json.dumps(options))
    # stderr to a file: a pipe nobody reads while the writer runs could fill and stall it
    with open(str(out) + ".err", "w") as err:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True)


def _wait_line(proc: subprocess.Popen, want: str, err: Path, timeout_s: float) -> None:
    """Wait for the line ``want`` on the writer's stdout, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if line.strip() == want:
                return
            assert line, f"writer exited before {want!r}: {err.read_text()[-3000:]}"
    raise AssertionError(f"no {want!r} from the writer in {timeout_s:.0f} s: "
                         f"{err.read_text()[-3000:]}")


class _TwoWriters:
    """Run A trains into a root; run D takes it over while A lives and trains until it
    committed its checkpoints; then A is told to stop, and stops once it learnt it was
    fenced and trained on for a few checkpoints (conditions, not times: fence_writer)."""

    def __init__(self, path: str, tmp_path: Path, options: dict | None) -> None:
        self.path, self.tmp_path, self.options = path, tmp_path, options
        self.stop = tmp_path / "stop-a"
        self.old = _writer(path, self.stop, False, tmp_path / "a.pt", options)
        self.new = None

    def take_over(self) -> None:
        _wait_line(self.old, "ready", self.tmp_path / "a.pt.err", WAIT_S)
        self.new = _writer(self.path, self.stop, True, self.tmp_path / "d.pt", self.options)

    def finish_new(self) -> None:
        """Wait for D to end (its condition met or its deadline), then tell A to stop."""
        self.new.wait(timeout=WAIT_S)
        assert self.new.returncode == 0, (self.tmp_path / "d.pt.err").read_text()[-3000:]
        self.stop.touch()

    def finish_old(self) -> str:
        """Wait for A (told to stop); returns its stderr."""
        self.old.wait(timeout=WAIT_S)
        old_err = (self.tmp_path / "a.pt.err").read_text()
        assert self.old.returncode == 0, old_err[-3000:]
        return old_err

    def kill(self) -> None:
        for proc in (self.old, self.new):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc is not None:
                proc.stdout.close()


def _check(path: str, tmp_path: Path, options: dict | None, old_err: str) -> None:
    a = json.loads((tmp_path / "a.pt.json").read_text())
    d = json.loads((tmp_path / "d.pt.json").read_text())
    # Both writers reached their conditions (not their deadlines).
    assert not d["timed_out"] and not a["timed_out"], (a, d)
    # The old writer learnt it was fenced, said so once, and trained on without errors.
    assert a["fenced"] and "took over the checkpoint root" in a["fenced"]
    assert old_err.count("took over the checkpoint root") == 1, old_err[-3000:]
    # The new holder never failed a persist, and committed many checkpoints.
    assert d["errors"] == [] and d["fenced"] is None
    assert all(ok for _, ok in d["records"]) and len(d["records"]) >= COMMITS, d["records"][:5]
    # Every committed checkpoint reads back intact.
    res = verify_path(path, options)
    assert res.ok and not res.bad and not res.damaged_manifests, (res.bad, res.damaged_manifests)
    # The old run stopped writing at its fencing: none of its folders is as new as the
    # new holder's newest checkpoint (it trained on for checkpoints after the new holder
    # stopped).
    st = Storage(path, options)
    names = [n for n, _ in st.list_checkpoints()]
    newest_seq = parse_checkpoint_name(d["newest"]).seq
    late = [n for n in names if parse_checkpoint_name(n).run == a["run_id"]
            and parse_checkpoint_name(n).seq >= newest_seq]
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
@pytest.mark.timeout(1800)  # ~1 min idle; the writers' deadlines are for a busy machine
def test_two_live_writers_after_a_takeover_local_and_s3(tmp_path):
    """Both roots at once (the writers sleep between steps; the new holder trains until it
    committed COMMITS checkpoints, the old one until it learnt it was fenced and AFTER
    more: fence_writer)."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    runs = []
    try:
        port = server._server.server_port
        opts = {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
        import s3fs

        s3fs.S3FileSystem(**opts).mkdir("fence")
        (tmp_path / "local").mkdir()
        (tmp_path / "s3").mkdir()
        cases = [(str(tmp_path / "local" / "root"), tmp_path / "local", None),
                 ("s3://fence/run", tmp_path / "s3", opts)]
        runs = [_TwoWriters(*case) for case in cases]
        for run in runs:
            run.take_over()
        for run in runs:  # every A is told as soon as its D is done, not after the other A
            run.finish_new()
        errs = [run.finish_old() for run in runs]
        for case, err in zip(cases, errs):
            _check(*case, err)
    finally:
        for run in runs:
            run.kill()
        server.stop()


def _toy(path: Path, **kw):
    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(path), interval=2, k_persist=1, async_persist=False,
                           ram_dir=None, **kw)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    return mgr, (model, opt, sched, counter)


def _listing(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_a_fenced_run_trains_saves_and_restores_without_touching_the_root(tmp_path, caplog):
    from tests.toy import run_loop

    root = tmp_path / "c"
    old, parts = _toy(root)
    run_loop(old, *parts, torch.Generator().manual_seed(1), 0, 4)
    new, _ = _toy(root, takeover=True)
    assert new.restore().step == 3
    new.save(10)
    before = _listing(root)
    run_loop(old, *parts, torch.Generator().manual_seed(2), 4, 6)  # three more checkpoints
    old.wait_for_snapshot()
    assert old.fenced and "took over the checkpoint root" in old.fenced
    assert caplog.text.count("this run no longer writes, renames or deletes") == 1
    newest = old._ram_tier.newest
    assert newest is not None and newest.step == 9  # RAM snapshots go on
    assert old.restore().tier == "ram"  # an in-process restart: no recovery record written
    old.close()
    assert _listing(root) == before  # not a file written, renamed or deleted
    new.close()
