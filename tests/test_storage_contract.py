"""The storage contract (moepec.store.storage.Storage's docstring), run on every backend.

A new backend is one class and one entry in BACKENDS (and in ``storage`` below).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.errors import CheckpointError
from moepec.keys import MANIFEST_NAME
from moepec.store import atomic
from moepec.store.committed import committed_manifests
from moepec.store.storage import FsspecStorage, LocalStorage, Storage
from tests.toy import Counter, full_state, make, run_loop

BACKENDS = ["local", "memory", "s3"]
CKPT = "ckpt-000003-step00000030-abcdef"
"""A checkpoint folder name (moepec.keys grammar)."""
OUTSIDE = ["../x", "/abs", "a/../../x", "a//b", ".", "a/./b", "..\\x"]
"""Paths that are not plain names under the root."""


def _open(kind: str, request, tmp_path, name: str = "root") -> Storage:
    if kind == "local":
        return Storage(str(tmp_path / name))
    if kind == "memory":
        return Storage(f"memory://contract-{uuid.uuid4().hex}/{name}")
    return Storage(f"s3://moepec-test/contract-{uuid.uuid4().hex}/{name}",
                   request.getfixturevalue("s3_options"))


@pytest.fixture(params=BACKENDS)
def storage(request, tmp_path) -> Storage:
    """An empty root on each backend (its folder made)."""
    st = _open(request.param, request, tmp_path)
    st.makedirs()
    return st


def test_storage_opens_the_backend_that_serves_the_path(request, tmp_path):
    assert type(Storage(str(tmp_path))) is LocalStorage
    assert type(Storage(f"file://{tmp_path}")) is LocalStorage
    assert type(Storage("memory://x/y")) is FsspecStorage
    assert isinstance(Storage("memory://x/y"), Storage)
    with pytest.raises(CheckpointError, match="does not serve"):
        LocalStorage("memory://x/y")
    with pytest.raises(CheckpointError, match="does not serve"):
        FsspecStorage(str(tmp_path))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file"):
        Storage(str(tmp_path / "file"))


def test_put_get_replace_and_exists(storage):
    storage.makedirs("d")
    storage.put("d/a", b"one")
    assert storage.get("d/a") == b"one" and storage.exists("d/a")
    storage.put("d/a", b"twotwo")  # replaces whole
    assert storage.get("d/a") == b"twotwo"
    assert storage.get("d/a", limit=3) == b"two"
    assert storage.listdir("d") == ["a"]  # no temporary file left behind
    assert not storage.exists("d/b")
    with pytest.raises(FileNotFoundError):
        storage.get("d/b")


def test_put_is_atomic_to_a_concurrent_reader(storage):
    """A reader sees one whole version or the other, never a part or a mix."""
    versions = [bytes([i]) * (256 << 10) for i in (1, 2)]
    storage.put("f", versions[0])
    done = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(24):
                storage.put("f", versions[i % 2])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not done.is_set():
        data = storage.get("f")
        assert data in versions, f"a torn read of {len(data)} bytes"
    thread.join(60)
    assert not errors and storage.listdir() == ["f"]


def test_create_is_exclusive(storage):
    storage.create("c", b"first")
    with pytest.raises(FileExistsError):
        storage.create("c", b"second")
    assert storage.get("c") == b"first"
    storage.put("p", b"x")
    with pytest.raises(FileExistsError):
        storage.create("p", b"y")  # also over a file put there
    assert storage.get("p") == b"x"


def test_create_has_one_winner_when_several_race(storage):
    wins: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def contend(i: int) -> None:
        start.wait(30)
        try:
            storage.create("lease", str(i).encode())
        except FileExistsError:
            return
        with lock:
            wins.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(wins) == 1 and storage.get("lease") == str(wins[0]).encode()
    assert storage.listdir() == ["lease"]


@pytest.mark.parametrize("path", OUTSIDE)
def test_every_path_is_confined_to_the_root(storage, path):
    calls = [lambda: storage.put(path, b"x"), lambda: storage.create(path, b"x"),
             lambda: storage.get(path), lambda: storage.exists(path),
             lambda: storage.remove(path), lambda: storage.listdir(path),
             lambda: storage.makedirs(path), lambda: storage.file_sizes(path),
             lambda: storage.delete(path), lambda: storage.read_manifest(path),
             lambda: storage.data_bytes(path)]
    for call in calls:
        with pytest.raises(CheckpointError):
            call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_remove_and_delete_touch_nothing_outside_the_root(backend, request, tmp_path):
    root = _open(backend, request, tmp_path, "root")
    sibling = Storage(root.url.rsplit("/", 1)[0] + "/x", root.options)  # root/../x
    sibling.makedirs()
    sibling.put("keep", b"k")
    root.makedirs()
    for path in ("../x", "../x/keep", "/x", "x/../../x"):
        with pytest.raises(CheckpointError):
            root.remove(path)
        with pytest.raises(CheckpointError):
            root.delete(path)
    assert sibling.get("keep") == b"k"


def test_remove_files_and_folders(storage):
    storage.makedirs(CKPT)
    storage.put(f"{CKPT}/a", b"a")
    storage.put(f"{CKPT}/b", b"b")
    storage.put("top", b"t")
    storage.remove(f"{CKPT}/a")
    assert not storage.exists(f"{CKPT}/a") and storage.exists(f"{CKPT}/b")
    storage.remove(CKPT)
    assert not storage.exists(f"{CKPT}/b") and CKPT not in storage.listdir()
    storage.remove(CKPT)  # gone already: no error
    storage.remove("missing")
    assert storage.listdir() == ["top"]


def test_listing_sizes_and_data_bytes(storage):
    assert storage.listdir("nothing") == [] and storage.file_sizes("nothing") == {}
    storage.makedirs(CKPT)
    storage.put(f"{CKPT}/data.distcp", b"0123456789")
    storage.put(f"{CKPT}/{MANIFEST_NAME}", b"{}")
    assert storage.file_sizes(CKPT) == {"data.distcp": 10, MANIFEST_NAME: 2}
    assert storage.data_bytes(CKPT) == 10
    assert sorted(storage.listdir(CKPT)) == ["data.distcp", MANIFEST_NAME]
    storage.makedirs("ckpt-000004-step00000040-abcdef")
    storage.put("ckpt-000004-step00000040-abcdef/data.distcp", b"x")
    storage.put("not-a-checkpoint", b"x")
    assert storage.list_checkpoints() == [(CKPT, True),
                                          ("ckpt-000004-step00000040-abcdef", False)]
    assert storage.committed() == [CKPT] and storage.is_committed(CKPT)
    storage.delete(CKPT)
    assert storage.committed() == [] and not storage.exists(CKPT)


def test_check_writable_leaves_nothing(storage):
    storage.check_writable()
    assert storage.listdir() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_commit_once_and_read_back(backend, request, tmp_path):
    """A manager's checkpoints on the backend: committed, listed, read back bit for bit;
    a second commit of a committed name is refused and changes nothing."""
    st = _open(backend, request, tmp_path)
    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=st.url, interval=2, k_persist=1, ram_dir=None,
                           storage_options=st.options, async_persist=False)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter})
    saved = {}
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 4,
             on_save=lambda step: saved.__setitem__(step, full_state(model, opt)))
    mgr.close()
    found = committed_manifests(st, views=True)
    assert len(found.manifests) == 2 and not found.damaged and not found.uncommitted
    name = found.newest
    manifest = st.read_manifest(name)
    before = st.get(f"{name}/{MANIFEST_NAME}")
    for again in (manifest, dataclasses.replace(manifest, view=dict(manifest.view))):
        with pytest.raises(CheckpointError, match="never overwrites a manifest"):
            st.write_manifest(again)
    assert st.get(f"{name}/{MANIFEST_NAME}") == before
    key = "model/embed.weight"
    target = {key: torch.empty_like(saved[manifest.step][key])}
    st.read(name, target, manifest.keys)
    assert torch.equal(target[key], saved[manifest.step][key])
    assert st.data_bytes(name) > 0


def test_local_put_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    st = Storage(str(tmp_path / "root"))
    st.makedirs()
    st.put("f", b"old")

    def broken(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(atomic.os, "fsync", broken)
    for write in (st.put, st.create):
        with pytest.raises(OSError, match="disk gone"):
            write("f", b"new, never whole")
    monkeypatch.undo()
    assert st.get("f") == b"old" and os.listdir(st.root) == ["f"]


def test_local_links_are_removed_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    st = Storage(str(tmp_path / "root"))
    st.makedirs()
    os.symlink(outside, tmp_path / "root" / "link")
    with pytest.raises(CheckpointError, match="outside the checkpoint root"):
        st.remove("link/keep")
    assert st.file_sizes("link") == {}
    st.remove("link")
    assert (outside / "keep").read_bytes() == b"k" and st.listdir() == []


def test_the_link_check_refuses_and_accepts_exactly_what_full_resolution_does(tmp_path):
    """reader.confined and LocalStorage.confined resolve a path only when a component
    below the root is a link (links_below); for every layout they refuse and accept what
    resolving every path does: a link out of the root (folder or file, absolute or
    relative) is refused, a link inside it, a missing part, and a root that is itself a
    link are not."""
    import os

    from moepec.errors import CorruptCheckpointError
    from moepec.store.reader import confined
    from moepec.store.storage.local import LocalStorage

    real, outside = tmp_path / "real", tmp_path / "outside"
    (real / "ckpt-a").mkdir(parents=True)
    outside.mkdir()
    (real / "ckpt-a" / "data").write_bytes(b"d")
    (outside / "data").write_bytes(b"o")
    (real / "ckpt-in").symlink_to(real / "ckpt-a")  # inside the root
    (real / "ckpt-out").symlink_to(outside)  # out of it, absolute
    (real / "ckpt-rel").symlink_to("../outside")  # out of it, relative
    (real / "ckpt-a" / "leak").symlink_to(outside / "data")  # a file out of it
    (tmp_path / "root-link").symlink_to(real)  # the root itself a link
    cases = [("ckpt-a", "data"), ("ckpt-in", "data"), ("ckpt-out", "data"),
             ("ckpt-rel", "data"), ("ckpt-a", "leak"), ("ckpt-missing", "data"),
             ("ckpt-a", "missing")]
    for root in (str(real), str(tmp_path / "root-link")):
        real_root = os.path.realpath(root) + os.sep
        for parts in cases:
            inside = os.path.realpath("/".join((root,) + parts)).startswith(real_root)
            for check in (lambda r, p: confined(r, *p, local=True),
                          lambda r, p: LocalStorage(r).confined("/".join(p))):
                if inside:
                    assert check(root, parts) == "/".join((root,) + parts)
                else:
                    with pytest.raises(CorruptCheckpointError, match="outside"):
                        check(root, parts)
    assert {p for p in cases if not os.path.realpath(
        "/".join((str(real),) + p)).startswith(str(real) + os.sep)} == {
        ("ckpt-out", "data"), ("ckpt-rel", "data"), ("ckpt-a", "leak")}


def _mapped(folder) -> set[str]:
    """The files under ``folder`` this process maps now."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f
                if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith(
                    str(folder))}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux: /proc/self/maps")
def test_a_restore_unmaps_its_data_files_on_a_helper_thread(tmp_path, monkeypatch):
    """A local restore reads its data files over private mappings; once the values are in
    the model they are dropped on a helper thread (release_later): nothing of the root
    stays mapped, and the restored state is the saved one."""
    import moepec.manager.restore as manager_restore
    from moepec.store.reader import release_later

    threads: list[threading.Thread] = []
    monkeypatch.setattr(manager_restore, "release_later",
                        lambda values: threads.append(release_later(values)))
    model, opt, sched = make(seed=3, n_experts=4)
    cfg = CheckpointConfig(path=str(tmp_path / "c"), interval=1, k_persist=1,
                           async_persist=False, async_snapshot=False)
    with CheckpointManager(model, opt, cfg) as mgr:
        for step in range(5):
            mgr.save(step)
        saved = full_state(model, opt)
    model2, opt2, _ = make(seed=4, n_experts=4)
    seen: dict[str, set[str]] = {}
    real_apply = manager_restore.Restoring._apply

    def apply(self, outcome):
        real_apply(self, outcome)
        seen["during"] = _mapped(tmp_path / "c")

    monkeypatch.setattr(manager_restore.Restoring, "_apply", apply)
    with CheckpointManager(model2, opt2, CheckpointConfig(path=str(tmp_path / "c"))) as mgr:
        mgr.restore()
        assert len(threads) == 1
        threads[0].join(10)
        assert seen["during"] and not _mapped(tmp_path / "c")
    restored = full_state(model2, opt2)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="Linux: sysfs")
def test_a_folder_that_exists_but_takes_no_file_is_found_unwritable(tmp_path):
    """The write probe writes a file: a root whose folder exists (so makedirs succeeds)
    but in which no file can be created (sysfs refuses even root) is named unwritable,
    with the fix; a writable one is probed and left as it was."""
    from moepec.store.storage.local import LocalStorage

    with pytest.raises(CheckpointError, match="cannot write to checkpoint path.*choose a "
                                              "writable"):
        LocalStorage("/sys/kernel").check_writable()
    LocalStorage(str(tmp_path)).check_writable()
    assert list(tmp_path.iterdir()) == []
