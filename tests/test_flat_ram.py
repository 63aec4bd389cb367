"""The flat front end's RAM tier (moepec.flat.ram) on real shared-memory slots: what a
restarted worker reads back (the newest snapshot of its lineage, bit for bit), and what
it never reads (a damaged slot, another lineage's, one older than storage, an abandoned
future). One rank (gloo); the two-rank agreement and real SIGKILLs are in
tests/test_deepspeed_ram.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moepec.flat.ram import FlatRam


@pytest.fixture
def ram(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    folder = tempfile.mkdtemp(prefix="moepec-test-", dir="/dev/shm")
    try:
        yield str(tmp_path / "ckpt"), folder
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)


def head(uid: str, step: int):
    """What FlatRam.newest reads of a storage head's manifest."""
    return types.SimpleNamespace(uid=uid, ancestors=[("older", "U0")], step=step)


def group(key: str) -> str:
    return key.split("/", 1)[0]


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"f/w": torch.randn(4, 8, generator=g), "f/b": torch.randn(8, generator=g)
            .to(torch.bfloat16), "f/n": torch.randint(0, 9, (3,), generator=g),
            "g/s": torch.tensor(seed)}


def test_a_restarted_worker_reads_its_newest_snapshot_bit_for_bit(ram):
    root, folder = ram
    first = FlatRam(root, ram_dir=folder)
    first.snapshot(6, state(6), "U1")
    first.snapshot(9, state(9), "U1")
    first.close()  # the worker dies: its slots stay
    again = FlatRam(root, ram_dir=folder)
    step, got = again.newest(head("U1", 4), group)
    assert step == 9 and got.keys() == state(9).keys()
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype
               for k, v in state(9).items())
    # a head whose lineage does not hold the save the snapshot continued: not read
    assert again.newest(head("U2", 4), group) is None
    again.close(unlink=True)


def test_a_snapshot_returns_once_copied_and_its_seal_follows_off_the_loop(ram):
    """The caller waits for the copy only: the seal (checksums, header last) runs on the
    copy thread, here held back by a hook; the live tensors may change at once, and a
    load in the same process waits for the seal, then reads the state as copied."""
    from moepec.hooks import FaultHooks

    root, folder = ram
    release = threading.Event()
    hooks = FaultHooks()
    hooks.on_snapshot = lambda point, step: release.wait(30) if point == "seal" else None
    ram_ = FlatRam(root, ram_dir=folder, hooks=hooks)
    live = state(6)
    snap = ram_.snapshot(6, live, "U1")
    assert snap.copied.is_set() and not snap.done.is_set()  # returned before its seal
    for t in live.values():
        t.zero_()  # training goes on: the copy is already taken
    release.set()
    step, got = ram_.newest(head("U1", 4), group)  # waits for the seal first
    assert snap.done.is_set() and snap.error is None
    assert step == 6 and all(torch.equal(got[k], v) for k, v in state(6).items())
    ram_.close(unlink=True)


def test_a_damaged_slot_is_never_read_the_previous_snapshot_is(ram):
    root, folder = ram
    first = FlatRam(root, ram_dir=folder)
    first.snapshot(6, state(6), "U1")
    newest = first.snapshot(9, state(9), "U1")
    first.close()
    with open(newest.slot.data_path, "r+b") as f:  # a write that never finished
        f.write(b"\xff" * 16)
    again = FlatRam(root, ram_dir=folder)
    step, got = again.newest(head("U1", 4), group)
    assert step == 6 and all(torch.equal(got[k], v) for k, v in state(6).items())
    again.close(unlink=True)


def test_a_load_reads_into_the_loaders_tensors_and_checks_what_it_read(ram):
    """With the loader's own tensors (``into``, as the Megatron door passes them), the
    slot's bytes are read into them and those are checked: a torn newest slot leaves
    them holding the previous snapshot, never the torn one's bytes."""
    root, folder = ram
    first = FlatRam(root, ram_dir=folder)
    first.snapshot(6, state(6), "U1")
    newest = first.snapshot(9, state(9), "U1")
    first.close()
    into = {k: torch.zeros_like(v) for k, v in state(0).items() if k != "f/n"}
    into["f/b"] = torch.zeros(8, dtype=torch.float32)  # another dtype: not read into
    again = FlatRam(root, ram_dir=folder)
    step, got = again.newest(head("U1", 4), group, into)
    assert step == 9 and all(torch.equal(got[k], v) and got[k].dtype == v.dtype
                             for k, v in state(9).items())
    assert got["f/w"] is into["f/w"] and got["g/s"] is into["g/s"]  # read in place
    assert got["f/b"] is not into["f/b"] and torch.equal(into["f/b"], torch.zeros(8))
    again.close()
    with open(newest.slot.data_path, "r+b") as f:  # a write that never finished
        f.write(b"\xff" * 16)
    last = FlatRam(root, ram_dir=folder)
    step, got = last.newest(head("U1", 4), group, into)
    assert step == 6 and all(torch.equal(got[k], v) for k, v in state(6).items())
    assert torch.equal(into["f/w"], state(6)["f/w"])
    last.close(unlink=True)


def test_a_load_checks_only_the_slot_it_takes_and_never_reads_a_torn_one(ram, monkeypatch):
    root, folder = ram
    first = FlatRam(root, ram_dir=folder)
    older = first.snapshot(6, state(6), "U1")
    newest = first.snapshot(9, state(9), "U1")
    first.close()
    with open(older.slot.data_path, "r+b") as f:
        f.write(b"\xff" * 16)
    import moepec.ram.readback as readback
    checked: list[torch.Tensor] = []
    real = readback.checksum_matches
    monkeypatch.setattr(readback, "checksum_matches",
                        lambda t, c: checked.append(t) or real(t, c))
    again = FlatRam(root, ram_dir=folder)
    step, got = again.newest(head("U1", 4), group)
    assert step == 9 and all(torch.equal(got[k], v) for k, v in state(9).items())
    assert len(checked) == len(state(9))  # the older slot's data was not hashed
    again.close()
    with open(newest.slot.data_path, "r+b") as f:
        f.write(b"\xff" * 16)
    last = FlatRam(root, ram_dir=folder)
    assert last.newest(head("U1", 4), group) is None  # both torn: storage serves
    last.close(unlink=True)


def test_ram_is_not_read_when_storage_is_as_new_or_of_another_lineage(ram):
    root, folder = ram
    first = FlatRam(root, ram_dir=folder)
    first.snapshot(6, state(6), "U1")
    first.close()
    again = FlatRam(root, ram_dir=folder)
    assert again.newest(head("U1", 6), group) is None  # storage holds step 6 already
    assert again.newest(None, group) is None  # no storage save names a lineage
    again.close()
    other = FlatRam(root, ram_dir=folder)
    assert other.newest(head("U9", 4), group) is None  # another run's save
    other.close(unlink=True)


def test_after_a_storage_load_every_snapshot_is_an_abandoned_future(ram):
    root, folder = ram
    first = FlatRam(root, ram_dir=folder)
    first.snapshot(6, state(6), "U1")
    first.settle(None)  # storage was loaded (a named tag): this process's snapshot too
    assert first.newest(head("U1", 4), group) is None
    first.close()
    again = FlatRam(root, ram_dir=folder)
    assert again.newest(head("U1", 4), group) is None
    again.close(unlink=True)


CHILD = """
import os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_flat_ram import state
from moepec.flat.ram import FlatRam
from moepec.hooks import FaultHooks
dist.init_process_group("gloo", init_method="file://" + {pg!r}, rank=0, world_size=1)
def stall(point, step):
    if (point, step) == ("seal", 9):  # copied, not committed: the parent kills us here
        open({flag!r}, "w").close()
        time.sleep(120)
ram = FlatRam({root!r}, ram_dir={folder!r}, hooks=FaultHooks(on_snapshot=stall))
ram.snapshot(6, state(6), "U1")
ram.snapshot(9, state(9), "U1")
"""


def test_a_worker_killed_during_a_snapshot_leaves_the_previous_one(ram, tmp_path):
    root, folder = ram
    flag = tmp_path / "sealing"
    code = CHILD.format(tests=str(Path(__file__).parent), pg=str(tmp_path / "pg2"),
                        flag=str(flag), root=root, folder=folder)
    child = subprocess.Popen([sys.executable, "-c", code], env={
        **os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    deadline = time.monotonic() + 60
    while not flag.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), "the child never reached the seal of step 9"
    os.kill(child.pid, signal.SIGKILL)  # its slot of step 9 is written, its header not
    child.wait(timeout=30)
    slots = Path(folder).glob("*/rank0/slot*")
    assert sorted(p.suffix for p in slots) == [".data", ".data", ".json"]  # one is torn
    again = FlatRam(root, ram_dir=folder)
    step, got = again.newest(head("U1", 4), group)
    assert step == 6 and all(torch.equal(got[k], v) for k, v in state(6).items())
    again.close(unlink=True)


def _lost_node_rank(rank: int, tmp: str, folder: str, mode: str) -> None:
    """Rank ``rank`` on node "ab"[rank] (its own ram_dir under ``folder``): snapshots of
    steps 6 and 9 replicated, then every worker restarts and node b's shared memory is
    gone (rank 1's slots and the replica of rank 0 it kept). ``mode``: ``torn``: the
    replica of rank 1's step 9 that node a keeps (the newest only) is damaged too;
    ``unsealed``: rank 0's seal of step 9 fails (nothing of it is sent) and step 12
    follows, whose exchange must still pair up."""
    from datetime import timedelta

    from moepec.hooks import FaultHooks

    node = "ab"[rank]
    os.environ["MOEPEC_NODE_ID"] = node
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    root, ram_dir = f"{tmp}/ckpt", f"{folder}/node-{node}"

    def mine(step: int) -> dict[str, torch.Tensor]:
        return {f"r{rank}/{k}": v for k, v in state(10 * step + rank).items()}

    copied = threading.Event()

    def fail(point: str, step: int) -> None:
        if (mode, rank, point, step) == ("unsealed", 0, "seal", 9):
            copied.wait(30)  # (a seal failing before the copy is waited for raises there)
            raise OSError("no space left (injected)")

    first = FlatRam(root, ram_dir=ram_dir, ram_replicas=None, timeout_s=30,
                    hooks=FaultHooks(on_snapshot=fail))
    for step in (6, 9, 12) if mode == "unsealed" else (6, 9):
        first.snapshot(step, mine(step), "U1")
        if step == 9:
            copied.set()
    first.wait_replicated()
    assert first.replicated
    first.close()  # every worker dies; their slots stay
    dist.barrier()
    if rank == 1:
        shutil.rmtree(ram_dir)  # node b replaced: its shared memory is gone
    if mode == "torn" and rank == 0:
        _damage(Path(ram_dir).glob("*/replica-of-rank1"), 9)
    dist.barrier()
    again = FlatRam(root, ram_dir=ram_dir, ram_replicas=1, timeout_s=60)
    found = again.newest(head("U1", 4), group)
    if mode == "torn":  # no intact copy of rank 1's slot is left
        assert found is None, (rank, found and found[0])
    else:
        want = 12 if mode == "unsealed" else 9
        step, got = found
        assert step == want and got.keys() == mine(want).keys(), (rank, step, sorted(got))
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype
                   for k, v in mine(want).items()), rank
    again.settle(None)  # storage was loaded: every slot and replica is abandoned
    assert again.newest(head("U1", 4), group) is None
    assert not list(Path(ram_dir).glob("*/*/slot*.json")), rank
    again.close(unlink=True)
    dist.destroy_process_group()


def _damage(folders, seq: int) -> None:
    """Flip bytes of the data of the slot of ``seq`` in ``folders`` (one must hold it)."""
    import json

    for header in [h for f in folders for h in f.glob("slot*.json")]:
        if json.loads(header.read_text())["seq"] == seq:
            with open(header.with_suffix(".data"), "r+b") as f:
                f.write(b"\xff" * 16)
            return
    raise AssertionError(f"no replica slot of seq {seq}")


@pytest.mark.parametrize("mode", ["replica", "torn", "unsealed"])
def test_a_rank_whose_node_was_lost_loads_its_slot_from_the_replica(tmp_path, mode):
    """ram_replicas: rank 1's node is lost; its newest slot comes back, bit for bit, from
    the replica node a keeps (rank 0 reads its own); with that replica torn no intact
    copy of rank 1's slot is left and both ranks get None (storage serves). A snapshot
    whose seal failed on one rank is not sent, and the exchanges after it still pair."""
    from tests.spawning import start_processes

    folder = tempfile.mkdtemp(prefix="moepec-test-", dir="/dev/shm")
    try:
        start_processes(_lost_node_rank, (str(tmp_path), folder, mode), 2)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_ram_replicas_is_checked_and_needs_several_nodes(ram):
    from moepec.errors import ConfigError
    from moepec.flat import RamLevel

    root, folder = ram
    for bad in (2, True, "1"):
        with pytest.raises(ConfigError, match="ram_replicas must be 0, 1 or None"):
            FlatRam(root, ram_dir=folder, ram_replicas=bad)
    with pytest.raises(ConfigError, match="set ram_dir"):
        FlatRam(root, ram_dir=None, ram_replicas=1)
    one_node = FlatRam(root, ram_dir=folder, ram_replicas=1)
    with pytest.raises(ConfigError, match="set ram_replicas=0 on one node"):
        one_node.snapshot(6, state(6), "U1")
    one_node.close()
    auto = FlatRam(root, ram_dir=folder)  # None: on when the ranks span nodes; here off
    auto.snapshot(6, state(6), "U1")
    assert not auto.replicated and auto.in_shared_memory
    auto.close(unlink=True)
    level = RamLevel(lambda: None)  # the doors' level hands the option to its tiers
    level.configure(True, folder, ram_replicas=0)
    assert level.ram(root).ram_replicas == 0
    with pytest.raises(ConfigError, match="ram_replicas must be"):
        level.configure(True, folder, ram_replicas=3)
    assert level.on and level.ram_replicas == 0  # a refusal changes nothing
    level.close()


def test_the_ranks_choose_the_newest_step_every_ranks_slot_is_held_for():
    from moepec.flat.ram import choose_copies

    own = [[(0, 9), (0, 6)], [(1, 9), (1, 6)]]
    assert choose_copies(own) == (9, {0: 0, 1: 1})
    lost = [[(0, 9), (0, 6), (1, 9), (1, 6)], [(0, 6)]]  # rank 1's node lost; 0 keeps its
    assert choose_copies(lost) == (9, {0: 0, 1: 0})
    swapped = [[(0, 9), (1, 6)], [(0, 6)]]  # each keeps the other's step 6 only
    assert choose_copies(swapped) == (6, {0: 1, 1: 0})
    assert choose_copies([[(0, 9)], [(1, 6)]]) is None
    assert choose_copies([[], []]) is None
