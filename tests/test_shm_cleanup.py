"""The suite's own shared-memory clean-up (tests/shm_cleanup.py) finds exactly the folders
of this process's RAM tiers of roots that are not local paths, and never another's."""

from __future__ import annotations

import json
import os

import torch

from moepec.ram.shm import SlotStore
from tests.shm_cleanup import flock_holders, own_new_folders


def test_an_unclosed_tier_of_a_remote_root_is_found_and_another_process_s_is_not(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "older").mkdir()  # there before the test: not its own
    store = SlotStore(str(shm), root="memory://moepec-test-x", rank=0, world_size=1)
    assert flock_holders()  # this host lists its locks (Linux /proc/locks)
    assert own_new_folders({"older"}, shm) == [store.job_dir]
    # the same folder seen from another process: held by this one, so not its own
    assert own_new_folders({"older"}, shm, pid=1) == []
    store.write_raw(json.dumps({"seq": 0, "pid": os.getpid()}).encode(),
                    torch.zeros(8, dtype=torch.uint8))
    store.close(unlink=False)  # an unclean close: the lock goes, the slot stays
    assert own_new_folders({"older"}, shm) == [store.job_dir]  # its header names this pid
