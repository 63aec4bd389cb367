"""Two-level asynchronous checkpointing: RAM tier, background persist, failures."""

from __future__ import annotations

import pytest
import torch

from moepec import CheckpointConfig, CheckpointEvent, CheckpointManager, FaultHooks, PersistError
from moepec.train.faults import FaultyFileSystem
from tests.toy import Counter, full_state, make, run_loop, train_step


@pytest.fixture(autouse=True)
def healthy_storage():
    FaultyFileSystem.mode = None
    yield
    FaultyFileSystem.mode = None


def setup(path, hooks=None, on_checkpoint=None, **kw):
    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    kw.setdefault("interval", 2)
    cfg = CheckpointConfig(path=str(path), **kw)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter},
                            hooks=hooks, on_checkpoint=on_checkpoint)
    return mgr, model, opt, sched, counter


def loop(mgr, model, opt, sched, counter, steps, start=0, gen=None, on_save=None):
    gen = gen or torch.Generator().manual_seed(1)
    run_loop(mgr, model, opt, sched, counter, gen, start, steps, on_save)
    return gen


def test_ram_recovery_is_fresher_than_storage(tmp_path):
    mgr, model, opt, sched, counter = setup(tmp_path / "c", k_persist=1, k_snapshot=3,
                                            keep_last=3)
    saved = {}
    loop(mgr, model, opt, sched, counter, 9,
         on_save=lambda s: saved.__setitem__(s, full_state(model, opt)))
    mgr.wait_for_snapshot()
    # a fault inside the step: the process survived, its RAM tier is intact
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    report = mgr.restore()
    assert report.tier == "ram" and report.step == 7
    assert report.units_from.get("ram", 0) > 0
    # non-expert state is exactly step 7's
    now = full_state(model, opt)
    assert torch.equal(now["model/embed.weight"], saved[7]["model/embed.weight"])
    assert counter.position == 8
    snap_experts = mgr._ram_tier.newest.snapshot_experts[0]
    # restoring the same run from storage alone (a new process) loses more tokens
    mgr.close()
    fresh, *_ = setup(tmp_path / "c", k_persist=1, k_snapshot=3, keep_last=3)
    storage_report = fresh.restore()
    assert storage_report.tier == "storage" and storage_report.step == 7
    assert report.lost_total < storage_report.lost_total
    # RAM experts are those snapshotted at step 7, restored bit-exact
    for e in snap_experts:
        assert torch.equal(model.moe[0].experts.w1[e], saved[7]["model/moe.0.experts.w1"][e])


def test_failed_persist_surfaces_keeps_last_commit_and_snapshots_go_on(tmp_path):
    url = f"faulty://{tmp_path}/c"
    mgr, model, opt, sched, counter = setup(url, k_persist=1, k_snapshot=2)
    gen = loop(mgr, model, opt, sched, counter, 4)  # commits at steps 1 and 3
    mgr.wait_for_persist()
    committed = mgr._storage.committed()
    FaultyFileSystem.mode = "enospc"
    with pytest.raises(PersistError, match="No space left") as err:
        loop(mgr, model, opt, sched, counter, 6, start=4, gen=gen)
    assert "last committed checkpoint is intact" in str(err.value)
    assert mgr._storage.committed() == committed
    # training goes on: the loop keeps snapshotting to RAM
    FaultyFileSystem.mode = "enospc"
    ram_steps = []
    for step in range(6, 12):
        # The previous persist has failed before this step starts, so its error surfaces
        # at this step's first check whatever the threads' timing.
        mgr.wait_for_persist()
        try:
            loop(mgr, model, opt, sched, counter, 1, start=step, gen=gen)
            mgr.wait_for_snapshot()
        except PersistError:
            # raised after the snapshot in flight was finished: the optimizer may step
            assert mgr._ram_tier.snapshotter.pending is None
        ram_steps.append(mgr._ram_tier.newest.step)
    assert max(ram_steps) == 11
    mgr.wait_for_persist()
    try:  # the last failure may or may not have been reported inside the loop
        mgr.wait_for_snapshot()
    except PersistError:
        pass
    assert mgr._storage.committed() == committed
    # storage heals: the next checkpoint commits
    FaultyFileSystem.mode = None
    loop(mgr, model, opt, sched, counter, 2, start=12, gen=gen)
    mgr.close()
    assert len(mgr._storage.committed()) > len(committed)


def test_persist_error_is_raised_only_after_the_snapshot_is_complete(tmp_path):
    """A loop that catches PersistError at wait_for_snapshot() and goes on to
    optimizer.step() must not tear the snapshot still being copied. With busy_policy
    "skip" a persist can fail while the next snapshot (kept in RAM only) is copying."""
    import threading

    url = f"faulty://{tmp_path}/c"
    hooks = FaultHooks()
    mgr, model, opt, sched, counter = setup(url, hooks, k_persist=4, busy_policy="skip")
    persist_gate, copy_gate, timed_out = threading.Event(), threading.Event(), []
    # Generous gates that the test opens itself: a wait that times out fails the test.
    hooks.on_persist = lambda point, name: (_held(persist_gate, timed_out)
                                            if point == "write" else None)
    FaultyFileSystem.mode = "enospc"
    try:
        loop(mgr, model, opt, sched, counter, 2)  # step 1's persist waits at the gate
        # Only step 3's copy: step 1's may still be sealing its slot on a slow machine,
        # and holding it would hold save(3) too (it waits for the copy before it)
        hooks.on_snapshot = lambda point, step: (_held(copy_gate, timed_out)
                                                 if step == 3 else None)
        mgr.save(3)  # the persister is busy: RAM only; the copy waits at its gate
        persist_gate.set()
        mgr.wait_for_persist()  # step 1's persist failed: its error is pending
        threading.Timer(0.3, copy_gate.set).start()
        with pytest.raises(PersistError):
            mgr.wait_for_snapshot()
        assert copy_gate.is_set() and mgr._ram_tier.snapshotter.pending is None
        assert mgr._ram_tier.newest.step == 3 and not timed_out
    finally:
        hooks.on_persist = hooks.on_snapshot = None
        persist_gate.set()
        copy_gate.set()
    FaultyFileSystem.mode = None
    mgr.close()


def _held(gate, timed_out, timeout=120.0):
    """Block a hook until the test opens ``gate``; a wait that times out is recorded in
    ``timed_out`` (the test asserts it stays empty)."""
    if not gate.wait(timeout):
        timed_out.append(gate)


def test_close_surfaces_background_error(tmp_path):
    url = f"faulty://{tmp_path}/c"
    mgr, model, opt, sched, counter = setup(url, interval=2)
    loop(mgr, model, opt, sched, counter, 1)
    FaultyFileSystem.mode = "error"
    loop(mgr, model, opt, sched, counter, 1, start=1)
    with pytest.raises(PersistError):
        mgr.close()
    mgr.close()  # idempotent


def test_skip_policy_keeps_busy_checkpoints_in_ram(tmp_path):
    import threading

    # The first persist is held at its write until the loop is done (an event, not slow
    # storage: a step on a loaded machine may outlast any fixed write delay), so every
    # later checkpoint finds the persister busy. In-process buffers: the shared-memory
    # tier's three slots would hold the loop back to the persist's pace (a slot is reused
    # once written), so nothing would be skipped.
    gate = threading.Event()
    hooks = FaultHooks(on_persist=lambda point, name: gate.wait(120) if point == "write"
                       else None)
    events: list[CheckpointEvent] = []
    mgr, model, opt, sched, counter = setup(tmp_path / "c", hooks, interval=1,
                                            busy_policy="skip", ram_dir=None,
                                            on_checkpoint=events.append)
    try:
        loop(mgr, model, opt, sched, counter, 6)
        mgr.wait_for_snapshot()
        assert mgr._ram_tier.newest.step == 5
    finally:
        gate.set()
    mgr.close()
    assert [e.persist for e in events] == [True] + [False] * 5


def test_buffers_are_reused_and_memory_bounded(tmp_path):
    events: list[CheckpointEvent] = []
    mgr, model, opt, sched, counter = setup(tmp_path / "c", interval=1, k_persist=1,
                                            k_snapshot=2, on_checkpoint=events.append)
    loop(mgr, model, opt, sched, counter, 12)
    mgr.close()
    largest = max(e.snapshot_bytes for e in events)
    # triple buffer: at most three snapshots alive (the first, full one, is the largest)
    assert mgr._ram_tier.pool.allocated_bytes <= 3 * largest


def test_torn_state_slow_snapshot_overlaps_training(tmp_path):
    """The copy of step t runs while step t+1's forward/backward run; the optimizer waits
    for it, so restore gives exactly step t's state, never a mix with t+1."""
    import threading

    overlapped = []
    trained = threading.Event()
    """Set once the forward/backward after a save ran: the copy may finish from then on."""

    def slow(where, step):
        # The copy is held until training ran a step beside it (a condition, not a time:
        # on a loaded machine a step may take longer than any fixed sleep).
        assert trained.wait(120), "the training thread never ran a step beside the copy"

    mgr, model, opt, sched, counter = setup(tmp_path / "c", FaultHooks(on_snapshot=slow),
                                            interval=3, k_persist=4)
    saved = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(9):
        _, counts = train_step(model, opt, sched, gen)  # runs during the copy
        overlapped.append(mgr._ram_tier.snapshotter.busy)
        trained.set()
        mgr.wait_for_snapshot()
        opt.step()
        sched.step()
        counter.position += 1
        mgr.observe_routing(counts)
        trained.clear()
        if mgr.step(step):
            saved[step] = full_state(model, opt)
    trained.set()  # the last copy has no step after it
    mgr.close()
    assert overlapped == [s % 3 == 0 and s > 0 for s in range(9)]  # the copy of s - 1 ran
    fresh, model2, opt2, _, c2 = setup(tmp_path / "c", interval=3, k_persist=4)
    report = fresh.restore()
    assert report.step == 8 and c2.position == 9
    got = full_state(model2, opt2)
    assert all(torch.equal(got[k], saved[8][k]) for k in saved[8])


def test_first_persist_failing_makes_the_next_commit_full(tmp_path):
    url = f"faulty://{tmp_path}/c"
    FaultyFileSystem.mode = "error"
    mgr, model, opt, sched, counter = setup(url, interval=2, k_persist=1, keep_last=10)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):  # checkpoints at 1, 3, 5 all fail
        try:
            loop(mgr, model, opt, sched, counter, 1, start=step, gen=gen)
        except PersistError:
            pass
        mgr.wait_for_persist()
    FaultyFileSystem.mode = None
    for step in range(6, 10):
        try:
            loop(mgr, model, opt, sched, counter, 1, start=step, gen=gen)
        except PersistError:
            pass
    mgr.close()
    manifests = [mgr._storage.read_manifest(n) for n in mgr._storage.committed()]
    assert manifests and manifests[0].meta.full  # storage had no copy of any expert yet
    fresh, *_ = setup(url, interval=2, k_persist=1, keep_last=10)
    assert fresh.restore().step == 9


def test_dynamic_k_down_halves_k_when_plt_has_headroom(tmp_path):
    mgr, model, opt, sched, counter = setup(tmp_path / "c", interval=2, k_persist=4,
                                            dynamic_k=True, dynamic_k_down=True)
    gen = torch.Generator().manual_seed(1)
    ks = []
    for start in (0, 4, 8):
        loop(mgr, model, opt, sched, counter, 4, start=start, gen=gen)
        report = mgr.restore()  # a fault: K=N checkpoints lose nothing, PLT stays 0
        assert report.plt == 0.0
        ks.append(mgr.k_persist)
    mgr.close()
    assert ks == [2, 1, 1]
    assert mgr.k_history[-2:] == [[3, 2], [7, 1]]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_callbacks_deliver_typed_records_in_order(tmp_path, asynchronous):
    """Every checkpoint gives one CheckpointEvent, then one SnapshotRecord of the same seq;
    each commit one CommitRecord; a failing observer never fails the checkpoint."""
    from moepec import CommitRecord, SnapshotRecord

    seen: list = []

    def broken(record):
        raise RuntimeError("an observer's bug")

    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(tmp_path / "c"), interval=2, k_persist=1, k_snapshot=2,
                           async_snapshot=asynchronous, async_persist=asynchronous)
    mgr = CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter},
                            on_checkpoint=seen.append, on_snapshot=seen.append,
                            on_commit=lambda r: (seen.append(r), broken(r)))
    loop(mgr, model, opt, sched, counter, 6)
    mgr.close()
    events = [r for r in seen if isinstance(r, CheckpointEvent)]
    snaps = [r for r in seen if isinstance(r, SnapshotRecord)]
    commits = [r for r in seen if isinstance(r, CommitRecord)]
    assert [e.step for e in events] == [s.step for s in snaps] == [1, 3, 5]
    order = [r.seq for r in seen if not isinstance(r, CommitRecord)]
    assert order == [s for e in events for s in (e.seq, e.seq)]
    assert events[0].full and not events[1].full and all(e.persist for e in events)
    assert all(len(layer) == 2 for layer in events[1].experts_snapshot)
    assert all(len(layer) == 1 for layer in events[1].experts_persist)
    assert [c.name for c in commits] == mgr._storage.committed()[-len(commits):]
    assert all(c.bytes == sum(c.bytes_per_rank) > 0 for c in commits)


def test_set_k_changes_k_from_the_next_checkpoint(tmp_path):
    from moepec import ConfigError

    mgr, model, opt, sched, counter = setup(tmp_path / "c", k_persist=1, async_persist=False)
    loop(mgr, model, opt, sched, counter, 2)
    mgr.set_k(2)
    assert (mgr.k_persist, mgr.k_snapshot) == (2, 2)
    with pytest.raises(ConfigError, match="set_k"):
        mgr.set_k(3, 2)
    with pytest.raises(AttributeError):
        mgr.k_persist = 1
    loop(mgr, model, opt, sched, counter, 4, start=2)
    mgr.close()
    meta = mgr._storage.read_manifest(mgr._storage.committed()[-1]).meta
    assert meta.k_persist == 2 and meta.k_history[-1] == [1, 2]
