"""A stranger's checkpoint, at the storage layer: a small file (manifest, lease, record)
is read only as a regular file inside the root, never through a link, never from a FIFO
or a device, never beyond a small file's size; an item's bytes are read only where its
data file has them; a record that does not decode is a damaged item, not a crash."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.errors import CheckpointError, CorruptCheckpointError
from moepec.recovery.flat_view import verify_root
from moepec.recovery.offline import inspect_path, verify_path
from moepec.store import reader
from moepec.store.flat import (
    FlatManifest,
    commit,
    rank_dir,
    read_records,
    scan,
    write_rank,
)
from moepec.store.storage import Storage
from tests import manifest_docs
from tests.toy import Counter, full_state, make, run_loop

ROOT = Path(__file__).resolve().parent.parent


def _train(path: str, steps: int = 6, **kw) -> dict:
    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=path, interval=2, k_persist=1, keep_last=8, **kw)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    saved: dict = {}
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, steps,
             on_save=lambda s: saved.__setitem__(s, full_state(model, opt)))
    mgr.close()
    return saved


def _restore(path: str):
    model, opt, sched = make(5, "stacked", 4)
    cfg = CheckpointConfig(path=path, interval=2, k_persist=1)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": Counter()})
    try:
        return mgr.restore(), full_state(model, opt)
    finally:
        mgr.close()


@pytest.mark.parametrize("kind", ["link-out", "link-in", "fifo", "device", "folder",
                                  "oversized"])
def test_a_small_file_is_read_only_as_a_regular_file_of_bounded_size(tmp_path, monkeypatch,
                                                                      kind):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside.json").write_text('"secret"')
    (root / "inside.json").write_text('"fine"')
    target = root / "f.json"
    if kind == "link-out":
        target.symlink_to(tmp_path / "outside.json")
    elif kind == "link-in":
        target.symlink_to(root / "inside.json")
    elif kind == "fifo":
        os.mkfifo(target)  # an open for reading would block until a writer came
    elif kind == "device":
        target.symlink_to("/dev/zero")  # a read without end
    elif kind == "folder":
        target.mkdir()
    else:
        monkeypatch.setattr(reader, "SMALL_FILE_LIMIT", 64)
        target.write_bytes(b"0" * 65)
    st = Storage(str(root))
    assert st.get("inside.json") == b'"fine"'
    start = time.monotonic()
    with pytest.raises(CorruptCheckpointError):
        st.get("f.json")
    assert time.monotonic() - start < 5


def _newest_manifest(root: Path) -> Path:
    return root / Storage(str(root)).committed()[-1] / "moepec.json"


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_manifest_linked_to_a_fifo_or_device_is_a_damaged_checkpoint(tmp_path, kind):
    root = tmp_path / "c"
    saved = _train(str(root))
    newest = _newest_manifest(root)
    newest.unlink()
    if kind == "fifo":
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        newest.symlink_to(fifo)
    else:
        newest.symlink_to("/dev/zero")
    report, state = _restore(str(root))  # the older base, bit for bit
    assert report.checkpoint != newest.parent.name and report.step == sorted(saved)[-2]
    assert all(torch.equal(state[k], saved[report.step][k]) for k in state
               if ".experts." not in k)
    res = verify_path(str(root))
    assert len(res.damaged_manifests) == 1 and "link" in res.damaged_manifests[0]
    info = inspect_path(str(root))
    assert info is not None
    # The command too: it ends, exits 1 for the damaged checkpoint, no traceback.
    p = subprocess.run([sys.executable, "-m", "moepec", "verify", str(root)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]


def _tamper_torch_save_item(path: str, fs, change) -> str:
    man = sorted(p for p in fs.find(path) if p.endswith("moepec.json"))[-1]
    m, entries = manifest_docs.load(man, fs)
    key = next(k for k, v in sorted(entries.items())
               if k.startswith("model/") and v["encoding"] == "torch_save")
    change(entries[key], fs, man)
    manifest_docs.save(man, m, entries, fs)
    return key


def test_a_torch_save_item_longer_than_its_file_is_refused_before_it_is_allocated(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://trust-length-{os.getpid()}"
    _train(url, serialization="torch_save")
    fs = fsspec.filesystem("memory")
    key = _tamper_torch_save_item(url.removeprefix("memory:/"), fs,
                                  lambda item, *_: item.__setitem__("length", 1 << 40))
    try:
        res = verify_path(url)
        assert not res.ok and any(key in b for b in res.bad), res.bad
        # The read refuses it from the file's size, before allocating (a 1 TiB buffer
        # before this fix: a MemoryError here, a zero-filled GiB at smaller lengths).
        st = Storage(url)
        name = st.committed()[-1]
        item = st.read_manifest(name).keys[key]
        with pytest.raises(CheckpointError, match="ends at byte"):
            st.read(name, {key: torch.empty(item.shape, dtype=getattr(torch, item.dtype))},
                    {key: item})
    finally:
        fs.rm(url.removeprefix("memory:/"), recursive=True)




def _flat(root: Path, name: str = "iter_0000010") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    tensors = {"w#0,0+2,3": torch.arange(6.0).view(2, 3), "e#0+4": torch.ones(4)}
    write_rank(str(folder), tensors, 0)
    commit(str(root), FlatManifest(
        name=name, seq=0, step=10, parent=None, items=read_records(str(folder), 1),
        view={k: name for k in tensors}, experts={"e#0+4": ("l", 0)},
        experts_saved=[("l", 0)], k_persist=1, world_size=1, layers=["l"]))
    return folder / "moepec.json"


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("value", ["yesterday", [1], float("nan")])
def test_a_flat_manifest_with_a_bad_commit_time_is_damaged_not_a_crash(tmp_path, value):
    root = tmp_path / "flat"
    man = _flat(root)
    _flat(root, "iter_0000020")
    _edit(man, lambda d: d.__setitem__("committed_at", value))
    found = scan(str(root))  # a ValueError/TypeError escaped the scan before
    assert list(found.damaged) == ["iter_0000010"] and "committed_at" in found.damaged[
        "iter_0000010"]
    assert list(found.manifests) == ["iter_0000020"]


def test_a_flat_item_of_a_forged_shape_is_a_bad_item_not_a_crash(tmp_path):
    root = tmp_path / "flat"
    man = _flat(root)

    def forge(d):
        d["items"]["e#0+4"].update(shape=[1 << 42], dtype="uint8", nbytes=1 << 42,
                                   length=1 << 42)
    _edit(man, forge)
    res = verify_root(str(root))  # a RuntimeError (4 TiB allocation) escaped before
    assert res.bad == ["iter_0000010:e#0+4"], res


def test_a_flat_manifest_that_is_a_fifo_is_damaged_and_nothing_blocks(tmp_path):
    root = tmp_path / "flat"
    man = _flat(root)
    man.unlink()
    os.mkfifo(man)
    start = time.monotonic()
    found = scan(str(root))
    assert list(found.damaged) == ["iter_0000010"]
    assert time.monotonic() - start < 5
    shutil.rmtree(root)


def test_an_item_beyond_its_data_file_is_refused_before_reading(tmp_path):
    root = tmp_path / "flat"
    _flat(root)
    item = scan(str(root)).manifests["iter_0000010"].items["e#0+4"]
    far = dataclasses.replace(item, offset=1 << 30)
    with pytest.raises(CheckpointError, match="ends at byte"):
        reader.read_items(None, (str(root / "iter_0000010"), rank_dir(0)),
                          {"e#0+4": torch.empty(4)}, {"e#0+4": far}, local=True)


def test_a_record_that_does_not_decode_is_a_bad_item_and_verify_goes_on(tmp_path):
    root = tmp_path / "flat"
    man = _flat(root)
    _flat(root, "iter_0000020")
    # Raw bytes declared as a torch.save record: the decoder refuses them.
    _edit(man, lambda d: d["items"]["e#0+4"].__setitem__("encoding", "torch_save"))
    res = verify_root(str(root))  # an UnpicklingError ended the whole verify before
    assert res.bad == ["iter_0000010:e#0+4"] and res.checked == 4, res
