"""Trust rules of the shared-memory RAM tier: its folders are the user's own, and a slot
file is never opened through a symbolic link (written through, or read and restored).

``/dev/shm`` is shared by every user of a node and a job folder's name is predictable
from the checkpoint root, so another user may make the folders first, or plant links in
them. Every test here uses a ``ram_dir`` under ``tmp_path``, never ``/dev/shm/moepec``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager, ConfigError
from moepec.ram.jobs import job_name, list_jobs
from moepec.ram.shm import SlotHeader, SlotStore
from moepec.store.meta import CheckpointMeta
from tests.toy import Counter, make, run_loop

VICTIM_BYTES = b"precious user data\n"


def manager(tmp_path: Path, seed: int = 0) -> tuple[CheckpointManager, tuple]:
    """A manager of ``tmp_path/ckpt`` with its RAM tier in ``tmp_path/shm``."""
    model, opt, sched = make(seed, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(tmp_path / "ckpt"), ram_dir=str(tmp_path / "shm"),
                           interval=2, k_persist=1)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"data": counter, "sched": sched})
    return mgr, (model, opt, sched, counter)


def snapshot_once(mgr: CheckpointManager, parts: tuple) -> None:
    """Train two steps (one checkpoint: a snapshot into the slots) and close cleanly."""
    model, opt, sched, counter = parts
    try:
        run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 2)
        mgr.wait_for_snapshot()
    finally:
        mgr.close()


def job_dir(tmp_path: Path) -> Path:
    return tmp_path / "shm" / job_name(os.path.abspath(tmp_path / "ckpt"))


def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim_notes.txt"
    path.write_bytes(VICTIM_BYTES)
    return path


def folders(*paths: Path, mode: int = 0o700) -> None:
    """Make ``paths`` (in order) with exactly ``mode`` (mkdir's mode is masked by umask)."""
    for p in paths:
        p.mkdir()
        p.chmod(mode)


# -- writing: a planted link is never written through ------------------------------
def test_a_symlinked_slot_file_is_refused_and_its_target_left_unchanged(tmp_path):
    # The folders are the user's own (mode 0700), as a crashed worker of the same user
    # leaves them, but slot0.data is a link to another file: moepec refuses to set up
    # the tier instead of writing tensor bytes through the link.
    target = victim(tmp_path)
    job = job_dir(tmp_path)
    folders(tmp_path / "shm", job, job / "rank0")
    (job / "rank0" / "slot0.data").symlink_to(target)
    with pytest.raises(ConfigError, match=r"slot0\.data.*symbolic link.*remove it"):
        mgr, parts = manager(tmp_path)
        snapshot_once(mgr, parts)  # (before the fix: the snapshot wrote through the link)
    assert target.read_bytes() == VICTIM_BYTES


@pytest.mark.parametrize("name", ["slot0.json", "owner.lock"])
def test_other_symlinked_files_of_a_slot_folder_are_refused(tmp_path, name):
    target = victim(tmp_path)
    job = job_dir(tmp_path)
    folders(tmp_path / "shm", job, job / "rank0")
    (job / "rank0" / name).symlink_to(target)
    with pytest.raises(ConfigError, match=rf"{name}.*symbolic link"):
        mgr, parts = manager(tmp_path)
        snapshot_once(mgr, parts)
    assert target.read_bytes() == VICTIM_BYTES


def header(root: str, seq: int = 1) -> SlotHeader:
    meta = CheckpointMeta(step=seq, seq=seq, index=0, time=0.0, config={},
                          structure={"experts": [], "params": [], "fingerprint": ""},
                          k_persist=1, k_snapshot=1, full=True, pec_scope="all",
                          selection="sequential", experts_saved=[], experts_snapshot=[],
                          counts=[], ledger={}, plt=0.0, selectors={}, k_history=[],
                          world_size=1, write_mode="adaptive", run_id="r", runs=["r"])
    return SlotHeader(root=root, rank=0, world_size=1, meta=meta, entries={},
                      all_keys=["w"], persist_keys=[], snapshot_experts=[],
                      persist_experts=None)


LAYOUT = {"w": ((64,), torch.float32)}


def test_a_link_planted_after_the_tier_opened_is_not_written_through(tmp_path):
    # Opened, then the slot's file names are taken by links (data, and the header's
    # temporary name): the snapshot fails with a clear error, or writes its own file;
    # the targets stay as they were, byte for byte.
    target = victim(tmp_path)
    root = str(tmp_path / "ckpt")
    store = SlotStore(str(tmp_path / "shm"), root=root, rank=0, world_size=1)
    try:
        slot = store.reserve()
        slot.data_path.symlink_to(target)
        with pytest.raises(ConfigError, match=r"slot0\.data.*symbolic link.*remove it"):
            store.prepare(slot, LAYOUT)
        slot.data_path.unlink()
        tmp_header = slot.header_path.with_name(f".{slot.header_path.name}.{os.getpid()}.tmp")
        tmp_header.symlink_to(target)
        store.prepare(slot, LAYOUT)["w"].fill_(1.0)
        store.commit(slot, header(root))
        store.release(slot)
        assert json.loads(slot.header_path.read_text())["seq"] == 1
    finally:
        store.close(unlink=True)
    assert target.read_bytes() == VICTIM_BYTES


# -- reading: a linked slot is never restored ---------------------------------------
def committed_slot(tmp_path: Path) -> tuple[str, Path]:
    """One committed slot (seq 1) of rank 0 under ``tmp_path/shm``, left as a killed
    worker leaves it; returns (root, rank folder)."""
    root = str(tmp_path / "ckpt")
    store = SlotStore(str(tmp_path / "shm"), root=root, rank=0, world_size=1)
    slot = store.reserve()
    store.prepare(slot, LAYOUT)["w"].copy_(torch.arange(64.0))
    store.commit(slot, header(root))
    store.release(slot)
    store.close(unlink=False)
    return root, store.dir


@pytest.mark.parametrize("name", ["slot0.data", "slot0.json"])
def test_a_slot_file_swapped_for_a_link_is_not_restored(tmp_path, name):
    root, rank = committed_slot(tmp_path)
    store = SlotStore(str(tmp_path / "shm"), root=root, rank=0, world_size=1)
    try:
        assert [h.seq for _, h, _ in store.load()] == [1]  # intact: restored
        for slot in store.slots:
            store.release(slot)
        # The file is replaced by a link to an identical copy elsewhere (what a forged
        # slot looks like): its checksums match, but it is not the slot moepec wrote.
        copy = tmp_path / f"copy-{name}"
        copy.write_bytes((rank / name).read_bytes())
        (rank / name).unlink()
        (rank / name).symlink_to(copy)
        assert store.load() == []
    finally:
        store.close(unlink=True)


def test_a_slot_folder_holding_a_link_is_refused_when_reopened(tmp_path):
    root, rank = committed_slot(tmp_path)
    copy = tmp_path / "copy.data"
    copy.write_bytes((rank / "slot0.data").read_bytes())
    (rank / "slot0.data").unlink()
    (rank / "slot0.data").symlink_to(copy)
    with pytest.raises(ConfigError, match=r"slot0\.data.*symbolic link"):
        SlotStore(str(tmp_path / "shm"), root=root, rank=0, world_size=1)


def test_ram_ls_does_not_read_through_links(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"root": "SECRET", "step": 99, "pid": 1}))
    shm = tmp_path / "shm"
    folders(shm, shm / "job-a", shm / "job-a" / "rank0", shm / "elsewhere")
    (shm / "job-a" / "rank0" / "slot0.json").symlink_to(secret)
    (shm / "elsewhere" / "slot0.json").write_text(secret.read_text())
    (shm / "job-a" / "rank1").symlink_to(shm / "elsewhere", target_is_directory=True)
    rows = {r["job"]: r for r in list_jobs(str(shm))}
    assert rows["job-a"]["root"] is None and rows["job-a"]["newest_step"] is None


# -- folders: the user's own, not writable by others, not links ----------------------
@pytest.mark.parametrize("which", ["job", "rank"])
def test_a_slot_folder_others_can_write_is_refused(tmp_path, which):
    job = job_dir(tmp_path)
    folders(tmp_path / "shm", job, job / "rank0",
            mode=0o700)
    bad = job if which == "job" else job / "rank0"
    bad.chmod(0o777)
    target = victim(tmp_path)
    (job / "rank0" / "slot0.data").symlink_to(target)
    with pytest.raises(ConfigError) as err:
        mgr, parts = manager(tmp_path)
        snapshot_once(mgr, parts)
    msg = str(err.value)
    assert str(bad) in msg and "writable by other users" in msg and "ram_dir" in msg, msg
    assert target.read_bytes() == VICTIM_BYTES


def test_a_symlinked_job_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    folders(tmp_path / "shm", elsewhere)
    job_dir(tmp_path).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError) as err:
        mgr, parts = manager(tmp_path)
        snapshot_once(mgr, parts)
    msg = str(err.value)
    assert str(job_dir(tmp_path)) in msg and "symbolic link" in msg and "ram_dir" in msg
    assert list(elsewhere.iterdir()) == []


def test_a_symlinked_rank_folder_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    job = job_dir(tmp_path)
    folders(tmp_path / "shm", job, elsewhere)
    (job / "rank0").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        SlotStore(str(tmp_path / "shm"), root=str(tmp_path / "ckpt"), rank=0, world_size=1)
    assert list(elsewhere.iterdir()) == []


def test_the_base_folder_may_be_shared_only_with_the_sticky_bit(tmp_path):
    shm = tmp_path / "shm"
    folders(shm, mode=0o777)  # others could rename the job folder away and plant a link
    with pytest.raises(ConfigError, match=rf"{shm}.*writable by other users.*sticky"):
        SlotStore(str(shm), root=str(tmp_path / "ckpt"), rank=0, world_size=1)
    shm.chmod(0o1777)  # like /tmp: others may make their own folders, not touch ours
    store = SlotStore(str(shm), root=str(tmp_path / "ckpt"), rank=0, world_size=1)
    try:
        assert store.job_dir.stat().st_mode & 0o777 == 0o700
        assert store.dir.stat().st_mode & 0o777 == 0o700
    finally:
        store.close(unlink=True)


def test_a_base_folder_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    folders(elsewhere)
    (tmp_path / "shm").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        SlotStore(str(tmp_path / "shm"), root=str(tmp_path / "ckpt"), rank=0, world_size=1)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's folder needs root")
@pytest.mark.parametrize("which", ["base", "job"])
def test_a_folder_of_another_user_is_refused(tmp_path, which):
    nobody = 65534
    job = job_dir(tmp_path)
    folders(tmp_path / "shm", job)
    bad = tmp_path / "shm" if which == "base" else job
    if which == "base":
        bad.chmod(0o1777)  # sticky, but its owner may still rename our folders in it
    os.chown(bad, nobody, nobody)
    with pytest.raises(ConfigError, match=rf"{bad}.*belongs to user {nobody}.*ram_dir"):
        SlotStore(str(tmp_path / "shm"), root=str(tmp_path / "ckpt"), rank=0, world_size=1)


def test_ram_dir_auto_keeps_the_tier_in_the_process_when_the_folder_is_not_yours(
        tmp_path, monkeypatch, caplog):
    # On a shared node /dev/shm/moepec may be another user's, or writable by all: "auto"
    # then keeps the snapshots in the process, with the reason, rather than failing.
    import moepec.ram.placement as placement  # the one ram_dir resolution of both front ends

    base = tmp_path / "shm" / "moepec"
    folders(tmp_path / "shm", base, mode=0o777)
    monkeypatch.setattr(placement, "DEFAULT_DIR", str(base))
    model, opt, sched = make(0, "stacked", 4)
    with caplog.at_level("INFO", logger="moepec"):
        mgr = CheckpointManager(model, opt, CheckpointConfig(
            path=str(tmp_path / "ckpt"), ram_dir="auto", interval=2, k_persist=1),
            extra_state={"data": Counter(), "sched": sched})
        mgr.close()
    assert any("in-process buffers" in r.message and "writable by other users" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    assert list(base.iterdir()) == []


def _two_ranks_open(rank: int, world: int, tmp: str) -> None:
    """A rank of the test below: rank 1's ram_dir is a file, not a folder."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    model, opt, sched = make(0, "stacked", 4)
    ram = f"{tmp}/shm" if rank == 0 else f"{tmp}/a-file"
    start = time.monotonic()
    try:
        CheckpointManager(model, opt, CheckpointConfig(
            path=f"{tmp}/ckpt", ram_dir=ram, interval=2, k_persist=1),
            extra_state={"data": Counter(), "sched": sched}).close()
        out = {"ok": True}
    except ConfigError as exc:
        out = {"ok": False, "error": str(exc)}
    out["seconds"] = time.monotonic() - start
    Path(tmp, f"result-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_a_rank_that_cannot_open_its_slots_fails_every_rank_at_once(tmp_path):
    """Rank 1 alone cannot open its RAM slots: both ranks raise ConfigError naming it,
    at once, rather than rank 0 waiting in the next collective for the 120 s timeout."""
    from tests.spawning import start_processes

    (tmp_path / "a-file").write_text("not a folder")
    start_processes(_two_ranks_open, (2, str(tmp_path)), 2)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    assert not any(r["ok"] for r in results), results
    assert "a-file" in results[1]["error"], results
    assert results[0]["error"].startswith("rank 1 cannot open its RAM slots"), results
    assert all(r["seconds"] < 60 for r in results), results
