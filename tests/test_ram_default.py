"""The RAM tier's default (issue 21.4): ram_dir="auto" keeps snapshots in shared memory
when it exists and fits, else in the process, saying which once, never failing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, CheckpointManager, ConfigError
from moepec.ram.jobs import DEFAULT_DIR, job_name
from tests.toy import Counter, full_state, make, run_loop


def _manager(path: Path, **kw):
    model, opt, sched = make(0, "stacked", 4)
    counter = Counter()
    cfg = CheckpointConfig(path=str(path), interval=2, k_persist=4, **kw)
    return CheckpointManager(model, opt, cfg, extra_state={"sched": sched, "data": counter}), \
        (model, opt, sched, counter)


def test_auto_is_the_default_and_uses_shared_memory(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="moepec")
    assert CheckpointConfig(path="x").ram_dir == "auto"
    mgr, (model, opt, sched, counter) = _manager(tmp_path / "c")
    assert mgr._ram_dir == DEFAULT_DIR
    assert caplog.text.count(f"RAM tier: shared memory in {DEFAULT_DIR}") == 1
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 4)
    mgr.wait_for_snapshot()
    job = Path(DEFAULT_DIR) / job_name(str(tmp_path / "c"))
    assert any(job.rglob("slot*.data"))  # the slots are in shared memory
    saved = full_state(model, opt)
    mgr.close()
    assert not any(p.is_file() for p in job.rglob("*"))  # a clean close leaves nothing
    mgr2, (model2, opt2, _, _) = _manager(tmp_path / "c")
    assert mgr2.restore().step == 3
    assert all(torch.equal(v, saved[k]) for k, v in full_state(model2, opt2).items())
    mgr2.close()


def test_too_small_shared_memory_falls_back_to_the_process(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="moepec")
    mgr, (model, opt, sched, counter) = _manager(tmp_path / "c", ram_budget_bytes=1)
    assert mgr._ram_dir is None
    assert caplog.text.count("RAM tier: in-process buffers (shared memory is too small") == 1
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 4)
    mgr.wait_for_snapshot()
    newest = mgr._ram_tier.newest
    assert newest is not None and newest.step == 3  # the RAM tier works, in the process
    mgr.close()
    assert not (Path(DEFAULT_DIR) / job_name(str(tmp_path / "c"))).exists()


def test_an_explicit_folder_that_does_not_fit_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="ram_budget_bytes"):
        _manager(tmp_path / "c", ram_dir=str(tmp_path / "shm"), ram_budget_bytes=1)


def test_none_keeps_snapshots_in_the_process(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="moepec")
    mgr, _ = _manager(tmp_path / "c", ram_dir=None)
    assert mgr._ram_dir is None and "RAM tier" not in caplog.text
    mgr.close()


def test_two_live_managers_of_one_root_never_share_slots(tmp_path, caplog):
    """A second live writer into the same root on this host (a takeover while the old run
    lives) keeps its snapshots in the process: slots have one owner."""
    first, (model, opt, sched, counter) = _manager(tmp_path / "c")
    assert first._ram_dir == DEFAULT_DIR
    second, _ = _manager(tmp_path / "c", takeover=True)
    assert second._ram_dir is None
    assert "RAM tier: in-process buffers (another live process on this host uses the RAM " \
           "slots" in caplog.text
    run_loop(first, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 2)
    first.close()
    second.close()
    third, _ = _manager(tmp_path / "c")  # the owner is gone: the slots are free again
    assert third._ram_dir == DEFAULT_DIR
    third.close()
