"""The shared-memory RAM tier: slots that outlive the process, committed header last.

A "restarted worker" here is a second CheckpointManager built over fresh model and
optimizer objects in the same process after the first was abandoned without ``close``
(what a SIGKILL leaves: committed slots and no clean-up). The torchrun tests with real
SIGKILLs are in tests/test_ram_torchrun.py.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import stat
import threading

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager, ConfigError, FaultHooks, PersistError
from moepec.cli.main import main
from moepec.ram import pinning, shm
from moepec.ram.jobs import job_name
from moepec.ram.shm import admissible
from moepec.store import persist
from moepec.store.meta import CheckpointMeta
from moepec.store.storage import Storage
from tests.toy import Counter, full_state, make, run_loop, train_step


def manager(tmp_path, seed=0, hooks=None, **kw):
    model, opt, sched = make(seed, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(tmp_path / "ckpt"), ram_dir=str(tmp_path / "shm"),
                           interval=2, k_persist=1, k_snapshot=3, keep_last=3, **kw)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"data": counter, "sched": sched},
                            hooks=hooks)
    return mgr, (model, opt, sched, counter)


def train(mgr, parts, steps, saved):
    model, opt, sched, counter = parts
    gen = torch.Generator().manual_seed(1)
    run_loop(mgr, model, opt, sched, counter, gen, 0, steps,
             lambda s: saved.__setitem__(s, full_state(model, opt)))
    mgr.wait_for_snapshot()
    mgr._persister.wait_idle()


def crash(mgr):
    """What a SIGKILL leaves: nothing cleaned up (threads stop, files stay)."""
    mgr._ram_tier.snapshotter.close()
    mgr._persister.close() if mgr._persister._error is None else None
    mgr._root_claim.release()
    slots = mgr._ram_tier.snapshotter.slots
    os.close(slots._owner)  # the kernel drops a dead process's lock on its slot folder
    slots._owner = None


def rank_dir(tmp_path):
    return tmp_path / "shm" / job_name(os.path.abspath(tmp_path / "ckpt")) / "rank0"


def slot_headers(tmp_path):
    return sorted(rank_dir(tmp_path).glob("slot*.json"),
                  key=lambda p: json.loads(p.read_text())["seq"])


def expert_keys(state, layer, expert):
    return {k: v[expert] for k, v in state.items()
            if f"moe.{layer}.experts." in k and v.dim() > 0}


def assert_state(model, opt, want, experts):
    """Non-expert state and the given (layer, expert)s equal ``want`` bit-exact."""
    now = full_state(model, opt)
    for k, v in now.items():
        if ".experts." not in k:
            assert torch.equal(v, want[k]), k
    for layer, e in experts:
        for k, v in expert_keys(now, layer, e).items():
            assert torch.equal(v, expert_keys(want, layer, e)[k]), (k, layer, e)


def ram_cli(capsys, tmp_path, *argv):
    assert main(["ram", *argv, "--ram-dir", str(tmp_path / "shm"), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_restarted_worker_restores_from_shared_memory_and_persists_what_was_only_in_ram(
        tmp_path, capsys):
    # The last checkpoint (step 7) is due for storage, but its commit fails (as if the
    # worker died before committing): it exists only in RAM.
    die = FaultHooks(on_persist=lambda where, name: (_ for _ in ()).throw(OSError("died"))
                     if where == "before_commit" and "-step00000007-" in name else None)
    mgr, parts = manager(tmp_path, hooks=die)
    saved = {}
    model, opt, sched, counter = parts
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 8,
             lambda s: saved.__setitem__(s, full_state(model, opt)))
    # the failed persist surfaces once, on whichever call comes after it ends
    with pytest.raises(PersistError, match="last committed checkpoint is intact"):
        mgr.wait_for_snapshot()
        mgr._persister.wait_idle()
        mgr._persister.check()
    mgr._persister.wait_idle()
    storage = Storage(str(tmp_path / "ckpt"))
    assert [storage.read_manifest(n).step for n in storage.committed()] == [1, 3, 5]
    snap_experts = [list(e) for e in mgr._ram_tier.newest.snapshot_experts]
    in_process_plt = mgr._ram_tier.newest.meta.plt
    crash(mgr)
    assert 2 <= len(slot_headers(tmp_path)) <= len(list(rank_dir(tmp_path).glob(
        "slot*.data"))) <= 3  # at most three slots, reused over four checkpoints
    for p in rank_dir(tmp_path).iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE(rank_dir(tmp_path).stat().st_mode) == 0o700
    # moepec ram ls / clean: the writer (this process) still runs, so clean keeps it
    [row] = ram_cli(capsys, tmp_path, "ls")
    assert row["root"] == os.path.abspath(tmp_path / "ckpt") and row["runs"] == [mgr._run_id]
    assert row["live"] and row["newest_step"] == 7 and row["bytes"] > 0
    assert ram_cli(capsys, tmp_path, "clean", "--older-than", "1") == []
    assert ram_cli(capsys, tmp_path, "clean", "--run", "nope") == []
    assert [r["removed"] for r in ram_cli(capsys, tmp_path, "clean")] == [False]

    fresh, (model, opt, _, counter) = manager(tmp_path, seed=5)
    report = fresh.restore()
    assert report.tier == "ram" and report.step == 7 and counter.position == 8
    # K_snapshot experts per layer come from RAM bit-exact, the rest from storage
    assert_state(model, opt, saved[7], [(layer, e) for layer, es in enumerate(snap_experts)
                                        for e in es])
    ram_units = {k for k, v in report.sources.items() if v["tier"] == "ram"}
    assert ram_units == {f"{layer}/{e}" for layer, es in enumerate(snap_experts) for e in es}
    assert report.plt >= in_process_plt
    # persist on failure: storage now holds the step-7 checkpoint, committed
    assert report.persisted_on_failure is not None
    assert storage.read_manifest(storage.committed()[-1]).step == 7
    fresh.close()
    assert not rank_dir(tmp_path).exists()  # a clean close unlinks the slots
    assert ram_cli(capsys, tmp_path, "ls") == []


def test_torn_slots_are_never_used(tmp_path):
    mgr, parts = manager(tmp_path)
    saved = {}
    train(mgr, parts, 8, saved)
    crash(mgr)
    storage = Storage(str(tmp_path / "ckpt"))
    for name in storage.committed()[2:]:
        storage.delete(name)  # storage stops at step 3: steps 5 and 7 are in RAM only
    older, newest = slot_headers(tmp_path)
    assert [json.loads(p.read_text())["step"] for p in (older, newest)] == [5, 7]
    # a byte of the newest slot's data flipped: its checksum no longer matches
    header = json.loads(newest.read_text())
    entry = next(e for e in header["entries"].values() if e["nbytes"] > 8)
    with open(newest.with_suffix(".data"), "r+b") as f:
        f.seek(entry["offset"] + 4)
        b = f.read(1)
        f.seek(entry["offset"] + 4)
        f.write(bytes([b[0] ^ 0xFF]))
    fresh, (model, opt, _, counter) = manager(tmp_path, seed=5)
    report = fresh.restore()
    assert report.tier == "ram" and report.step == 5 and counter.position == 6
    assert_state(model, opt, saved[5], [])
    assert not newest.exists()  # a torn slot's header is removed: never read again
    assert report.persisted_on_failure  # storage lacked step 5: committed now
    fresh.close()
    # the slots are gone (a clean close; as after a wiped node): storage serves step 5
    again, (model, opt, *_) = manager(tmp_path, seed=6)
    report = again.restore()
    assert (report.tier, report.step) == ("storage", 5)
    assert_state(model, opt, saved[5], [])
    again.close()


META = dict(step=1, seq=1, index=0, time=0.0, structure={}, config={}, k_persist=1,
            k_snapshot=1, full=True, pec_scope="all", selection="sequential",
            experts_saved=[], experts_snapshot=[], counts=[], ledger={}, plt=0.0,
            selectors={}, k_history=[], world_size=1, write_mode="adaptive")


def test_slot_of_another_root_or_an_unrelated_run_is_never_read(tmp_path, capsys):
    meta = META
    head = CheckpointMeta(**meta, run_id="b", runs=["a", "b"])
    assert admissible(CheckpointMeta(**meta, run_id="c", runs=["a", "b", "c"]), head)
    assert admissible(CheckpointMeta(**meta, run_id="a", runs=["a"]), head)
    assert not admissible(CheckpointMeta(**meta, run_id="x", runs=["x"]), head)
    assert admissible(CheckpointMeta(**meta, run_id="x", runs=["x"]), None)
    # a slot folder copied under another root's job is ignored (the header names its root)
    mgr, parts = manager(tmp_path)
    train(mgr, parts, 4, {})
    crash(mgr)
    other = tmp_path / "other"
    dest = tmp_path / "shm" / job_name(os.path.abspath(other / "ckpt")) / "rank0"
    dest.parent.mkdir(parents=True)
    rank_dir(tmp_path).rename(dest)
    model, opt, sched = make(5, "stacked", 4)
    cfg = CheckpointConfig(path=str(other / "ckpt"), ram_dir=str(tmp_path / "shm"),
                           interval=2)
    fresh = CheckpointManager(model, opt, cfg, extra_state={"sched": sched})
    assert fresh.restore() is None
    fresh.close()
    # a crashed run's folder, its writer gone: clean removes it, confined to ram_dir
    dead = tmp_path / "shm" / "old-run" / "rank0"
    dead.mkdir(parents=True)
    (dead / "slot0.data").write_bytes(b"x" * 100)
    (dead / "slot0.json").write_text(json.dumps({"pid": 2**22 + 7, "step": 3}))
    rows = ram_cli(capsys, tmp_path, "clean", "--run", "old-run")
    assert [(r["job"], r["removed"], r["bytes"]) for r in rows] == [("old-run", True, 100 + len(
        json.dumps({"pid": 2**22 + 7, "step": 3})))]
    assert not dead.parent.exists()


def test_config_and_budget(tmp_path):
    with pytest.raises(ConfigError, match="ram_dir"):
        CheckpointConfig(path="x", ram_dir="")
    with pytest.raises(ConfigError, match="ram_budget_bytes"):
        CheckpointConfig(path="x", ram_budget_bytes=0)
    with pytest.raises(ConfigError, match="over its budget"):
        manager(tmp_path, ram_budget_bytes=1000)
    with pytest.raises(ConfigError, match="ram_replicas must be"):
        CheckpointConfig(path="x", ram_dir="/dev/shm/x", ram_replicas=2)
    with pytest.raises(ConfigError, match="needs the shared-memory RAM tier"):
        CheckpointConfig(path="x", ram_dir=None, ram_replicas=1)
    (tmp_path / "afile").write_text("")
    model, opt, _ = make(0, "stacked", 4)
    with pytest.raises(ConfigError, match="cannot keep RAM snapshots"):
        CheckpointManager(model, opt, CheckpointConfig(
            path=str(tmp_path / "c2"), ram_dir=str(tmp_path / "afile" / "shm")))


def test_slot_files_are_touched_only_off_the_training_thread_and_slots_are_reused(
        tmp_path, monkeypatch):
    """The training thread only picks a slot: its header is removed, its file created,
    grown and mapped (tmpfs pages allocated) on the copy thread, and a slot once mapped
    is reused by later checkpoints, not mapped again (issue 21: file work and page faults
    on the training thread blocked it 3-8x longer than in-process buffers)."""
    shm_dir = str(tmp_path / "shm")
    calls: list[tuple[str, int, bool]] = []  # (op, checkpoint, on the training thread)
    mgr, parts = manager(tmp_path)
    main_thread = threading.main_thread()

    def spy(op, fn, ours=lambda *a: True):
        def wrapped(*a, **kw):
            if ours(*a):
                calls.append((op, mgr._seq, threading.current_thread() is main_thread))
            return fn(*a, **kw)
        return wrapped

    under_shm = lambda p, *a: str(p).startswith(shm_dir)  # noqa: E731
    monkeypatch.setattr(os, "open", spy("open", os.open, under_shm))
    monkeypatch.setattr(os, "posix_fallocate", spy("fallocate", os.posix_fallocate))
    monkeypatch.setattr(mmap, "mmap", spy("mmap", mmap.mmap))
    monkeypatch.setattr(pathlib.Path, "unlink", spy("unlink", pathlib.Path.unlink, under_shm))
    monkeypatch.setattr(os, "replace", spy("replace", os.replace, under_shm))
    saved = {}
    train(mgr, parts, 20, saved)  # ten checkpoints
    assert not [c for c in calls if c[2]], "slot file work on the training thread"
    # pages allocated by fallocate (it releases the GIL; MAP_POPULATE in mmap does not)
    assert {op for op, _, _ in calls} == {"open", "fallocate", "mmap", "unlink", "replace"}
    n_slots = len(list(rank_dir(tmp_path).glob("slot*.data")))
    assert n_slots <= 3
    maps = [n for op, n, _ in calls if op == "mmap"]
    assert len(maps) <= n_slots + 1 and max(maps) <= 4, maps  # mapped once, then reused
    assert sorted(json.loads(p.read_text())["step"] for p in slot_headers(tmp_path))[-1] == 19
    mgr.close()


def test_the_loop_waits_for_the_copy_only_and_the_seal_hashes_once(tmp_path, monkeypatch):
    """Issue 50: a slot's checksums and header (its seal) follow the copy, off the loop's
    path: wait_for_snapshot() returns while a seal is held. The persist writes the seal's
    checksums (it hashes nothing again), and a restarted worker's restore from the slot
    verifies them and equals the saved state bit for bit."""
    went_on, late, hashed = threading.Event(), [], []

    def hold_seal(point, step):
        if point == "seal" and not went_on.wait(10):  # old code: the loop waited for it
            late.append(step)

    real = persist.tensor_checksum
    monkeypatch.setattr(persist, "tensor_checksum", lambda t: hashed.append(t) or real(t))
    mgr, (model, opt, sched, counter) = manager(tmp_path, hooks=FaultHooks(
        on_snapshot=hold_seal))
    saved, gen = {}, torch.Generator().manual_seed(1)
    for step in range(4):  # checkpoints at steps 1 and 3
        _, counts = train_step(model, opt, sched, gen)
        mgr.wait_for_snapshot()
        went_on.set()  # the loop goes on: the seal held until now may finish
        opt.step()
        sched.step()
        counter.position += 1
        mgr.observe_routing(counts)
        if mgr.step(step):
            saved[step] = full_state(model, opt)
            went_on.clear()
    mgr.wait_for_snapshot()
    went_on.set()
    mgr.wait_for_persist()
    assert late == [] and hashed == []
    storage = Storage(str(tmp_path / "ckpt"))
    items = storage.read_manifest(storage.committed()[-1]).keys
    entries = json.loads(slot_headers(tmp_path)[-1].read_text())["entries"]
    assert items and {k: i.checksum for k, i in items.items()} == {
        k: entries[k]["checksum"] for k in items}
    crash(mgr)
    fresh, (model, opt, _, _) = manager(tmp_path, seed=5)
    report = fresh.restore()
    assert report.tier == "ram" and report.step == 3
    assert_state(model, opt, saved[3], [(layer, e) for layer, es in enumerate(
        fresh._ram_tier.newest.snapshot_experts) for e in es])
    fresh.close()


def test_slots_are_registered_with_cuda_while_mapped(tmp_path, monkeypatch):
    """Issue 50, item 4: with ``pin`` (default: CUDA available) every mapping of a slot is
    page-locked for CUDA while it is the slot's, unregistered when a grown slot is mapped
    anew and at close. CUDA is absent here: the registration is stubbed out."""
    calls = []
    monkeypatch.setattr(pinning, "register", lambda a, n: calls.append(("reg", a, n)))
    monkeypatch.setattr(pinning, "unregister", lambda a: calls.append(("unreg", a)))
    assert not shm.SlotStore(str(tmp_path / "off"), root="r", rank=0, world_size=1).pin
    store = shm.SlotStore(str(tmp_path / "shm"), root="r", rank=0, world_size=1, pin=True)
    slot = store.reserve()
    store.prepare(slot, {"a": ((1000,), torch.float32)})["a"].fill_(1.5)
    first = (slot.base.data_ptr(), slot.size)
    assert calls == [("reg", *first)] and first[1] >= 4000
    store.release(slot)
    assert store.reserve() is slot  # the only slot, reused
    views = store.prepare(slot, {"a": ((1000,), torch.float32), "b": ((5000,), torch.int64)})
    assert calls == [("reg", *first), ("unreg", first[0]), ("reg", slot.base.data_ptr(),
                                                             slot.size)]
    views["b"].copy_(torch.arange(5000))
    store.commit(slot, shm.SlotHeader(root="r", rank=0, world_size=1, meta=CheckpointMeta(
        **{**META, "structure": {"experts": [], "params": [], "fingerprint": ""}},
        run_id="a", runs=["a"]), entries={}, all_keys=["a", "b"], persist_keys=[],
        snapshot_experts=[], persist_experts=None))
    store.release(slot)
    [(_, _, loaded)] = store.load()  # read back and verified against its checksums
    assert torch.equal(loaded["b"], torch.arange(5000))
    pinned = slot.pinned
    store.close(unlink=True)
    assert pinned == calls[-1][1] and calls[-1] == ("unreg", pinned) and len(calls) == 4
    # CUDA refusing (a memlock limit): the slots stay unpinned, the snapshot goes on
    monkeypatch.setattr(pinning, "register", lambda a, n: (_ for _ in ()).throw(
        RuntimeError("cudaErrorMemoryAllocation")))
    store = shm.SlotStore(str(tmp_path / "shm"), root="r", rank=0, world_size=1, pin=True)
    slot = store.reserve()
    store.prepare(slot, {"a": ((10,), torch.float32)})["a"].fill_(2.0)
    assert not store.pin and slot.pinned is None
    store.close(unlink=True)


def test_in_process_snapshots_are_hashed_once_by_their_seal(tmp_path, monkeypatch):
    """Issue 50: in-process buffers too: the seal (copy thread, after the copy) hashes the
    keys to persist; the persist writes those checksums without hashing again, and the
    restore verifies them against what was written."""
    hashed = []
    real = persist.tensor_checksum
    monkeypatch.setattr(persist, "tensor_checksum", lambda t: hashed.append(t) or real(t))
    model, opt, sched = make(0, "stacked", 4)
    mgr = CheckpointManager(model, opt, CheckpointConfig(
        path=str(tmp_path / "ckpt"), ram_dir=None, interval=2, k_persist=1))
    saved = {}
    run_loop(mgr, model, opt, sched, Counter(), torch.Generator().manual_seed(1), 0, 4,
             lambda s: saved.__setitem__(s, full_state(model, opt)))
    mgr.close()
    assert hashed == [] and sorted(saved) == [1, 3]
    model, opt, _ = make(5, "stacked", 4)
    fresh = CheckpointManager(model, opt, CheckpointConfig(path=str(tmp_path / "ckpt"),
                                                           ram_dir=None, k_persist=1))
    assert fresh.restore().step == 3  # every item verified against its checksum
    assert_state(model, opt, saved[3], [])
    fresh.close()


def test_buffer_pool_take_all_reuses_given_buffers_and_allocates_the_rest():
    """take_all: a buffer per key of the right shape and dtype; the ones given back are
    reused (same memory), the missing ones allocated and counted."""
    from moepec.ram.snapshot import BufferPool

    pool = BufferPool()
    like = {"a": torch.zeros(3, 4), "b": torch.zeros(3, 4), "c": torch.zeros(5, dtype=torch.int64)}
    first = pool.take_all(like)
    assert {k: (tuple(t.shape), t.dtype) for k, t in first.items()} == \
        {k: (tuple(t.shape), t.dtype) for k, t in like.items()}
    assert pool.allocated_bytes == 2 * 48 + 40
    pool.give({"a": first["a"]})
    second = pool.take_all(like)
    assert second["a"].data_ptr() == first["a"].data_ptr()
    assert second["b"].data_ptr() not in (first["a"].data_ptr(), first["b"].data_ptr())
    assert pool.allocated_bytes == 2 * (2 * 48 + 40) - 48


def test_a_failed_seal_is_logged_and_never_raised_by_the_wait_for_the_copy(tmp_path, caplog):
    """The seal (checksums, header) runs after the loop went on: when it fails, the slot
    stays torn and the failure is logged; the wait for the copy, however late it comes
    after the seal, returns the snapshot (it used to raise when the seal had failed
    first: both failures shared one field)."""
    from moepec.ram.shm import SlotStore
    from moepec.ram.snapshot import RamTier, Snapshot

    def fail_seal(point, step):
        if point == "seal":
            raise OSError("no space left for the header")

    slots = SlotStore(str(tmp_path / "shm"), root=str(tmp_path / "root"), rank=0,
                      world_size=1)
    tier = RamTier(background=True, timeout_s=30, slots=slots,
                   hooks=FaultHooks(on_snapshot=fail_seal))
    meta = CheckpointMeta(step=3, seq=3, index=0, time=0.0, structure={}, config={},
                          k_persist=0, k_snapshot=0, full=True, pec_scope="", selection="",
                          experts_saved=[], experts_snapshot=[], counts=[], ledger={},
                          plt=0.0, selectors={}, k_history=[], world_size=1,
                          write_mode="flat", run_id="r", runs=[])
    snap = Snapshot(tensors={}, persist_keys=frozenset(), meta=meta, persist=False,
                    all_keys=["w"])
    tier.start(snap, {"w": torch.arange(6.0)})
    assert snap.done.wait(30)  # the seal failed before the loop asks for the copy
    assert isinstance(snap.error, OSError) and snap.copy_error is None
    assert tier.finish() is snap  # the copy itself succeeded
    assert "could not be sealed" in caplog.text
    assert tier.recovered(lambda meta: True, verify=True) == []  # torn: never read
    tier.close(unlink=True)
