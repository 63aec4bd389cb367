"""Checkpoints from strangers and careless users: nothing on the load path runs code or
leaves the checkpoint root, one writer per root, and runs never mix."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.errors import LeaseError, MoepecError
from moepec.recovery.offline import export_view, inspect_path, verify_path
from moepec.store.checksum import tensor_checksum
from moepec.store.storage import Storage
from tests import manifest_docs
from tests.toy import Counter, full_state, make, run_loop

ROOT = Path(__file__).resolve().parent.parent


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _train(path: Path, steps: int = 8, **kw):
    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(path), interval=2, k_persist=1, keep_last=kw.pop("keep_last", 8),
                           **kw)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    saved = {}
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, steps,
             on_save=lambda s: saved.__setitem__(s, full_state(model, opt)))
    mgr.close()
    return mgr, saved


def _fresh(path: Path, **kw):
    model, opt, sched = make(5, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(path), interval=2, k_persist=1, **kw)
    return CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter}), \
        model, opt


def _all_tools(root: Path, out: Path) -> list[str]:
    """Run restore, verify, inspect and export; return what each did (never a traceback)."""
    results = []
    for name, call in [("restore", lambda: _fresh(root)[0].restore()),
                       ("verify", lambda: verify_path(str(root))),
                       ("inspect", lambda: inspect_path(str(root))),
                       ("export", lambda: export_view(str(root), str(out), "safetensors"))]:
        try:
            call()
            results.append(f"{name}: ok")
        except MoepecError as exc:
            results.append(f"{name}: {type(exc).__name__}")
    return results


def test_a_pickle_payload_in_dcp_metadata_runs_nothing(tmp_path):
    root = tmp_path / "c"
    _, saved = _train(root)
    marker = tmp_path / "pwned"
    for folder in root.glob("ckpt-*"):
        (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    results = _all_tools(root, tmp_path / "out.safetensors")
    assert not marker.exists()
    # moepec never reads .metadata: everything still works, bit-exact
    assert results == ["restore: ok", "verify: ok", "inspect: ok", "export: ok"]
    assert verify_path(str(root)).ok
    mgr, model, _ = _fresh(root)
    report = mgr.restore()
    assert torch.equal(model.embed.weight, saved[report.step]["model/embed.weight"])


def test_a_pickle_payload_in_every_object_item_runs_nothing(tmp_path):
    root = tmp_path / "c"
    _train(root)
    marker = tmp_path / "pwned"
    st = Storage(str(root))
    poisoned = 0
    for name in st.committed():
        path = root / name / "moepec.json"
        m, entries = manifest_docs.load(path)
        for key, item in entries.items():
            if not key.startswith("objects/"):
                continue
            payload = pickle.dumps(_Payload(marker))
            if len(payload) > item["length"]:
                continue  # too small to hold it (the rng and hyper-parameters do)
            poisoned += 1
            data = payload.ljust(item["length"], b"\0")  # same size: the manifest adds up
            blob = bytearray((root / name / item["file"]).read_bytes())
            blob[item["offset"]:item["offset"] + len(data)] = data
            (root / name / item["file"]).write_bytes(bytes(blob))
            # a careful attacker recomputes the checksum too
            item["checksum"] = tensor_checksum(torch.frombuffer(bytearray(data),
                                                                dtype=torch.uint8))
        manifest_docs.save(path, m, entries)
    assert poisoned >= 2 * len(st.committed())
    results = _all_tools(root, tmp_path / "out.safetensors")
    assert not marker.exists()
    assert results[0] == "restore: CorruptCheckpointError"  # every base's objects are bad
    assert not verify_path(str(root)).ok


def test_item_paths_never_leave_the_root(tmp_path):
    root = tmp_path / "c"
    _train(root)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x07" * 4096)
    st = Storage(str(root))
    newest = st.committed()[-1]
    path = root / newest / "moepec.json"
    m, entries = manifest_docs.load(path)
    key = next(k for k in entries if k.startswith("model/"))
    entries[key]["file"] = "../../secret.bin"
    manifest_docs.save(path, m, entries)
    assert newest in verify_path(str(root)).damaged_manifests[0]
    # a data file that is a symlink out of the root is not followed
    older = st.committed()[-2]
    data = next((root / older).glob("*.distcp"))
    data.unlink()
    data.symlink_to(secret)
    res = verify_path(str(root))
    assert res.bad and all(b.startswith(older) for b in res.bad) and not res.ok


def _falls_back(root, saved, newest: str, caplog, warning: str) -> None:
    """A restore skips the damaged newest checkpoint, says why, and restores the older
    base (step 5) bit-exact."""
    mgr, model, opt = _fresh(root)
    report = mgr.restore()
    mgr.close()
    assert report.step == 5 and report.checkpoint != newest
    assert any(warning in r.message for r in caplog.records)
    now = full_state(model, opt)
    assert all(torch.equal(now[k], saved[5][k]) for k in now if ".experts." not in k)


def test_a_bad_item_entry_is_never_used_and_restore_falls_back(tmp_path, caplog):
    # Restore checks a manifest's entries when it first uses them (store.items.Items):
    # a bad entry of the newest checkpoint's non-expert state must send the restore to the
    # older base, never into a read of what that entry claims.
    root = tmp_path / "c"
    _, saved = _train(root)
    newest = Storage(str(root)).committed()[-1]
    path = root / newest / "moepec.json"
    m, entries = manifest_docs.load(path)
    key = next(k for k in sorted(entries) if k.startswith("model/"))
    entries[key]["dtype"] = "object"
    manifest_docs.save(path, m, entries)
    _falls_back(root, saved, newest, caplog, "dtype 'object'")


def test_a_damaged_view_file_sends_restore_to_an_older_base_and_verify_says_so(tmp_path,
                                                                              caplog):
    # A manifest's view is a file of its own, read on first use (store.manifest.StoredView):
    # one that fails its checksum is never used, restore falls back, verify reports it.
    root = tmp_path / "c"
    _, saved = _train(root)
    newest = Storage(str(root)).committed()[-1]
    ref = json.loads((root / newest / "moepec.json").read_text())["view_file"]
    view_path = root / newest / ref["file"]
    view = json.loads(view_path.read_bytes())
    view[next(iter(view))] = newest  # plausible JSON, but not what the manifest commits
    view_path.write_text(json.dumps(view))
    _falls_back(root, saved, newest, caplog, "does not match the length and checksum")
    res = verify_path(str(root))
    assert not res.ok and any(newest in d and "view" in d for d in res.damaged_manifests)
    view_path.unlink()  # a missing view file: the same
    assert any(newest in d for d in verify_path(str(root)).damaged_manifests)


def test_retention_deletes_a_symlinked_checkpoint_link_not_its_target(tmp_path):
    outside = tmp_path / "outside"
    root = tmp_path / "c"
    _train(root, steps=4)
    st = Storage(str(root))
    first = st.committed()[0]
    (root / first).rename(outside)
    (root / first).symlink_to(outside, target_is_directory=True)
    _train(root, steps=12, keep_last=1)  # retention runs and drops the first checkpoint
    assert (outside / "moepec.json").exists()  # the target is untouched
    assert not (root / first).exists()


_HOLDER = """
import sys, time, torch
sys.path.insert(0, {root!r})
from moepec import CheckpointConfig, CheckpointManager
from tests.toy import Counter, make, run_loop
model, opt, sched = make(0, "stacked", 4)
counter = Counter()
cfg = CheckpointConfig(path={path!r}, interval=2, k_persist=1, keep_last=8,
                       async_persist=False, lease_timeout_s=600)
mgr = CheckpointManager(model, opt, cfg, extra_state={{"sched": sched, "data": counter}})
run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 4)
print("ready", flush=True)
sys.stdin.readline()
try:
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(2), 4, 2)
    print("fenced" if mgr.fenced else "committed", mgr._run_id, flush=True)
except Exception as exc:
    print("refused", type(exc).__name__, flush=True)
"""


def _holder(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER.format(root=str(ROOT), path=str(path))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_second_writer_is_refused_and_the_first_run_is_intact(tmp_path):
    root = tmp_path / "c"
    holder = _holder(root)
    try:
        before = sorted(p.name for p in root.glob("ckpt-*"))
        mgr, _, _ = _fresh(root)
        with pytest.raises(LeaseError, match="in use by run .*--ckpt-takeover") as err:
            mgr.restore()
        assert str(holder.pid) in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(LeaseError):
            mgr.save(0)
        mgr.close()
        assert sorted(p.name for p in root.glob("ckpt-*")) == before
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().split()[0] == "committed"  # the first run goes on
    finally:
        holder.kill()
        holder.wait()


def test_a_takeover_stops_the_old_writer_committing(tmp_path):
    root = tmp_path / "c"
    holder = _holder(root)
    try:
        mgr, _, _ = _fresh(root, takeover=True)
        report = mgr.restore()
        assert report is not None and report.step == 3
        mgr.save(10)
        mgr.close()  # releases the lease again
        mgr2, _, _ = _fresh(root, takeover=True)
        mgr2.restore()  # holds it now
        before = sorted(p.name for p in root.iterdir())
        holder.stdin.write("go\n")
        holder.stdin.flush()
        said, run_id = holder.stdout.readline().split()
        assert said == "fenced"  # it trained on, and never touched the root again
        assert sorted(p.name for p in root.iterdir()) == before
        assert not list(root.glob(f"ckpt-*-{run_id}"))[2:]  # its two checkpoints of steps 1, 3
        mgr2.close()
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holder_on_this_host_frees_the_lease(tmp_path):
    root = tmp_path / "c"
    holder = _holder(root)
    holder.kill()
    holder.wait()
    mgr, _, _ = _fresh(root)
    assert mgr.restore().step == 3  # the restarted worker's case: no takeover flag needed
    mgr.close()


def test_restore_never_stitches_another_runs_checkpoint(tmp_path, caplog):
    root = tmp_path / "c"
    _, saved = _train(root, steps=8)
    st = Storage(str(root))
    names = st.committed()
    foreign = names[-2]
    path = root / foreign / "moepec.json"
    m = json.loads(path.read_text())
    m["run_id"], m["runs"] = "stranger", ["stranger"]
    path.write_text(json.dumps(m))
    mgr, model, _ = _fresh(root)
    report = mgr.restore()
    assert report.checkpoint == names[-1]
    assert "not stitching " + foreign in caplog.text
    assert all(src["checkpoint"] != foreign for src in report.sources.values())
    mgr.close()


def test_a_lease_left_with_a_fresh_heartbeat_by_another_host_blocks(tmp_path):
    root = tmp_path / "c"
    _train(root, steps=4)
    (root / "moepec.lease").write_text(json.dumps(
        {"run_id": "abc", "host": "elsewhere", "pid": 1, "heartbeat": time.time()}))
    mgr, _, _ = _fresh(root)
    with pytest.raises(LeaseError, match="run abc .*host elsewhere"):
        mgr.restore()
    mgr.close()
    mgr, _, _ = _fresh(root, lease_timeout_s=0.01)  # expired: free
    time.sleep(0.05)
    assert mgr.restore().step == 3
    mgr.close()
