"""The restore's two-thread work (issue 50): checksums checked and copies into the model
made on two threads give what one thread gives, byte for byte, and a bad item found by
the helper thread fails or falls back exactly as one found by the caller."""

from __future__ import annotations

import threading

import pytest
import torch

import moepec.state.bytecopy as bytecopy
from moepec.errors import CorruptCheckpointError
from moepec.state.bytecopy import _cut, copy_all, in_threads, split_by_bytes
from moepec.store.checksum import Verifier, stored_checksum, tensor_bytes
from tests.test_commit import _corrupt, _train, fresh


@pytest.fixture
def split_everything(monkeypatch):
    """Split any amount of work over two threads (the toy model is far under the
    threshold; torch may have been given one thread)."""
    monkeypatch.setattr(bytecopy, "PARALLEL_BYTES", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_cut_moves_cover_every_byte_once():
    moves = [(1000, 5000, 7), (2000, 6000, 1), (3000, 7000, 12)]
    for per in (1, 3, 7, 8, 20, 100):
        shares = _cut(moves, per)
        assert all(sum(n for _, _, n in s) <= per for s in shares)
        flat = [(to + i, frm + i) for s in shares for to, frm, n in s for i in range(n)]
        want = [(to + i, frm + i) for to, frm, n in moves for i in range(n)]
        assert flat == want


def test_split_by_bytes_keeps_order_and_balances(split_everything):
    jobs = list(range(1, 11))
    shares = split_by_bytes(jobs, lambda j: j, 2)
    assert [j for s in shares for j in s] == jobs and len(shares) == 2
    assert abs(sum(shares[0]) - sum(shares[1])) <= 10
    assert split_by_bytes([], len, 2) == []


def test_split_by_bytes_keeps_small_work_on_one_thread():
    assert split_by_bytes([b"x" * 10] * 3, len, 2) == [[b"x" * 10] * 3]


def test_in_threads_reraises_a_helpers_error_after_all_are_done():
    done = []

    def work(share):
        if share == ["bad"]:
            raise ValueError("boom")
        done.append(share)

    with pytest.raises(ValueError, match="boom"):
        in_threads(work, [["good"], ["bad"], ["also good"]])
    assert sorted(map(tuple, done)) == [("also good",), ("good",)]
    assert not [t for t in threading.enumerate() if t.name == "moepec-share"]


def test_copy_all_on_two_threads_is_exact(split_everything):
    srcs = [torch.randn(bytecopy.SERIAL_NUMEL + i) for i in range(5)]
    dsts = [torch.zeros_like(s) for s in srcs]
    copy_all(zip(dsts, srcs, strict=True), threads=2)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def test_verifier_names_a_bad_item_in_the_helpers_share(split_everything, monkeypatch):
    """The shares after the first go to helper threads: a mismatch there is reported too,
    in the order added."""
    import moepec.store.checksum as checksum

    shares_seen = []

    def spy(work, shares):
        shares_seen.append([[job[0] for job in share] for share in shares])
        in_threads(work, shares)

    monkeypatch.setattr(checksum, "in_threads", spy)
    tensors = [torch.randn(64) for _ in range(6)]
    verifier = Verifier()
    for i, t in enumerate(tensors):
        good = stored_checksum(tensor_bytes(t), t.dtype, tuple(t.shape))
        verifier.add(f"k{i}", tensor_bytes(t), t.dtype, tuple(t.shape),
                     "xxh3:0" if i in (0, 5) else good)
    assert verifier.finish() == ["k0", "k5"]
    [shares] = shares_seen
    assert len(shares) == 2 and "k0" in shares[0] and "k5" in shares[1]
    assert verifier.finish() == []  # checks are made once


def test_two_thread_restore_falls_back_from_a_corrupt_expert(tmp_path, split_everything):
    ckpt = tmp_path / "c"
    manager, states = _train(ckpt, keep_last=4)
    names = manager._storage.committed()
    layer0 = manager._storage.read_manifest(names[-1]).meta.experts_saved[0][0]
    _corrupt(ckpt / names[-1], f"experts/0/{layer0}/model/moe.0.experts.w1")
    m2, model, _ = fresh(ckpt, keep_last=4)
    report = m2.restore()
    src = report.sources[f"0/{layer0}"]
    assert report.step == 7 and src["checkpoint"] != names[-1]
    assert any("falling back" in w for w in report.warnings)
    assert torch.equal(model.moe[0].experts.w1[layer0],
                       states[src["step"]]["moe.0.experts.w1"][layer0])
    assert torch.equal(model.embed.weight, states[7]["embed.weight"])


def test_two_thread_restore_of_all_corrupt_fails_and_changes_nothing(tmp_path,
                                                                     split_everything):
    ckpt = tmp_path / "c"
    manager, _ = _train(ckpt, steps=4, keep_last=4)
    for name in manager._storage.committed():
        _corrupt(ckpt / name, "model/embed.weight")
    m2, model, _ = fresh(ckpt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match="moepec verify"):
        m2.restore()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_restore_threads_follow_torchs_setting():
    from moepec.state.bytecopy import MAX_RESTORE_THREADS, restore_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert restore_threads() == 1  # a user who asked torch for one thread gets one
        torch.set_num_threads(MAX_RESTORE_THREADS + 2)
        assert restore_threads() == MAX_RESTORE_THREADS
    finally:
        torch.set_num_threads(before)
