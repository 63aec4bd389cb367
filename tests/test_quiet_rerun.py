"""Planned stops in one process, and a rerun that is quiet: a stop signal ends the loop
with a complete checkpoint that restores bit for bit with nothing lost; a restore that
lost nothing does not raise K; a released lease is taken over without a warning; and the
command line's small mistakes end in one line naming the flag."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager
from moepec.cli.main import main
from moepec.errors import FencedError
from moepec.store.committed import committed_manifests
from moepec.store.lease import Lease
from moepec.store.storage import Storage
from tests.toy import Counter, full_state, make, train_step


def loop(mgr, parts, gen, start: int, stop: int, signal_at: int | None = None) -> int:
    """The documented loop with ``should_stop``; returns the step it ended after."""
    model, opt, sched, counter = parts
    for step in range(start, stop):
        _, counts = train_step(model, opt, sched, gen)
        mgr.wait_for_snapshot()
        opt.step()
        sched.step()
        counter.position += 1
        mgr.observe_routing(counts)
        mgr.step(step)
        if step == signal_at:
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)  # a repeat at once: the same stop
        if mgr.should_stop(step):
            return step
    return stop - 1


def build(path: Path, seed: int = 0, **kw) -> tuple[CheckpointManager, tuple]:
    model, opt, sched = make(seed, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(path), interval=2, k_persist=1, ram_dir=None,
                           stop_signals=("SIGUSR1",), **kw)
    return (CheckpointManager(model, opt, cfg, extra_state={"data": counter, "sched": sched}),
            (model, opt, sched, counter))


def test_a_stop_signal_saves_every_expert_restored_bit_for_bit_with_nothing_lost(tmp_path):
    calls = []
    before = signal.signal(signal.SIGUSR1, lambda n, f: calls.append(n))
    try:
        mgr, parts = build(tmp_path)
        ended = loop(mgr, parts, torch.Generator().manual_seed(1), 0, 40, signal_at=4)
        saved = full_state(parts[0], parts[1])
        mgr.close()
        # stopped at the step the signal came in, its checkpoint complete and committed
        assert ended == 4 and mgr.stopped.step == 4 and mgr.stopped.signal == "SIGUSR1"
        assert mgr.stopped.committed and mgr.stopped.bytes > 0
        found = committed_manifests(Storage(str(tmp_path)))
        newest = found.manifests[found.newest]
        assert (newest.name, newest.meta.step, newest.meta.full) == \
            (mgr.stopped.checkpoint, 4, True)
        # the user's handler was chained (both signals), and is back after close()
        assert calls == [signal.SIGUSR1, signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is not mgr._stop._handle
        again, parts2 = build(tmp_path, seed=5)
        report = again.restore()
        assert (report.step, report.lost_total, report.plt) == (4, 0, 0.0)
        got = full_state(parts2[0], parts2[1])
        assert got.keys() == saved.keys()
        assert all(torch.equal(got[k], saved[k]) for k in saved)
        assert parts2[3].position == 5
        again.close()
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_complete_checkpoint_restores_without_raising_k(tmp_path):
    # 1) a run ends without a final checkpoint; 2) its restore loses tokens: dynamic K
    # doubles K (PLT over a tiny budget); that run asks should_stop, so its clean close
    # writes a complete checkpoint; 3) restoring that loses nothing and keeps K
    gen = torch.Generator().manual_seed(1)
    first, parts = build(tmp_path, plt_budget=1e-6, final_checkpoint=False)
    for step in range(6):  # no should_stop: the old loop
        _, counts = train_step(parts[0], parts[1], parts[2], gen)
        first.wait_for_snapshot()
        parts[1].step()
        first.observe_routing(counts)
        first.step(step)
    first.close()
    second, parts = build(tmp_path, plt_budget=1e-6)
    lossy = second.restore()
    assert lossy.lost_total > 0 and second.k_persist == 2
    loop(second, parts, gen, lossy.step + 1, lossy.step + 3)
    second.close()
    assert second.stopped.signal == "close" and second.stopped.committed
    third, _ = build(tmp_path, plt_budget=1e-6)
    resumed = third.restore()
    assert (resumed.step, resumed.lost_total) == (lossy.step + 2, 0)
    assert third.k_persist == 2 and 0 < resumed.plt < lossy.plt  # more tokens, no new loss
    third.close()


def test_a_released_lease_is_taken_over_quietly_a_dead_ones_with_a_warning(tmp_path,
                                                                           caplog):
    st = Storage(str(tmp_path))
    old = Lease(st, "0123456789ab", timeout_s=300, takeover=False)
    old.acquire()
    old.release()  # a clean close
    new = Lease(st, "abcdef012345", timeout_s=300, takeover=False)
    with caplog.at_level(logging.INFO, logger="moepec"):
        new.acquire()
    [record] = [r for r in caplog.records if "taking over" in r.getMessage()]
    assert record.levelno == logging.INFO and "released it" in record.getMessage()
    new.release()


def one_line(capsys, argv: list[str], rc: int, *words: str) -> None:
    capsys.readouterr()
    assert main(argv) == rc
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and all(w in err.splitlines()[-1] for w in words), err


def test_small_mistakes_end_in_one_line_naming_the_flag(tmp_path, capsys):
    one_line(capsys, ["--log-level", "bogus", "model-info"], 2, "--log-level", "invalid choice")
    one_line(capsys, ["simulate", "--config", "tiny", "--mfu", "2"], 2, "--mfu", "(0, 1]")
    one_line(capsys, ["simulate", "--config", "tiny", "--interval", "0"], 2, "--interval")
    for flags, words in ((["--k", "0"], ("--k must be >= 1",)),
                         (["--k", "2", "--k-snapshot", "1"], ("--k-snapshot (1)", "--k (2)")),
                         (["--ckpt-interval", "0"], ("--ckpt-interval must",))):
        one_line(capsys, ["train", "--config", "tiny", "--steps", "1", *flags], 2, *words)
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"x")
    one_line(capsys, ["train", "--config", "tiny", "--steps", "1", "--no-progress",
                      "--ckpt-dir", str(tmp_path / "dcp")], 2, "plain DCP checkpoint",
             "a folder of its own")
    assert os.listdir(tmp_path / "dcp") == [".metadata"]


def test_a_fenced_run_ends_in_error(tmp_path):
    from moepec.train.trainer import TrainConfig, train

    root = tmp_path / "ckpt"

    def take_over() -> None:  # another run takes the root once this one committed
        deadline = time.monotonic() + 300
        while not committed_manifests(Storage(str(root))).manifests:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        Lease(Storage(str(root)), "fedcba987654", timeout_s=300, takeover=True).acquire()

    thief = threading.Thread(target=take_over, daemon=True)
    thief.start()
    cfg = TrainConfig(config="tiny", steps=60, batch_size=4, eval_batches=0, progress=False,
                      threads=1, checkpoint=CheckpointConfig(path=str(root), interval=4,
                                                             ram_dir=None))
    with pytest.raises(FencedError, match="took over the checkpoint root.*ends in error"):
        train(cfg)
    thief.join(10)



def test_extending_a_finished_run_resumes_in_silence(tmp_path, caplog):
    from moepec.train.trainer import TrainConfig, train

    def run(steps: int):
        return train(TrainConfig(config="tiny", steps=steps, batch_size=4, eval_batches=0,
                                 progress=False, threads=1, checkpoint=CheckpointConfig(
                                     path=str(tmp_path / "ckpt"), interval=4)))

    run(6)  # ends with a complete checkpoint of step 5 (the periodic one is step 3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moepec"):
        longer = run(10)
    assert longer.resumed_from == 5 and longer.steps == 4
    assert [(r["lost"], r["plt"]) for r in longer.recoveries] == [(0, 0.0)]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
