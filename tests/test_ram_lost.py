"""The ``ram_lost`` fault removes the folder the RAM tier really uses (issue 35.3): under
the default ``ram_dir="auto"`` that is this run's job folder in /dev/shm/moepec, never a
folder named ``auto`` in the working directory; without a shared-memory tier the fault is
refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moepec import ConfigError
from moepec.ram.jobs import DEFAULT_DIR, job_name
from moepec.train.faults import FaultInjector, FaultPlan

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def job(tmp_path: Path):
    """The shared-memory job folder of the root ``tmp_path/ckpt`` (this test's own: named
    for that root), removed afterwards if the test left it."""
    if not os.access(os.path.dirname(DEFAULT_DIR), os.W_OK):
        pytest.skip(f"no writable shared memory at {os.path.dirname(DEFAULT_DIR)}")
    folder = Path(DEFAULT_DIR) / job_name(str(tmp_path / "ckpt"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_ram_lost_under_the_default_removes_this_runs_shared_memory(tmp_path, job):
    mine = tmp_path / "auto"  # a user's folder that happens to be named like the setting
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # No --ram-dir: the default, "auto". Checkpoints at steps 1 and 3: slots exist at 4.
    proc = subprocess.run(
        [sys.executable, "-m", "moepec", "train", "--config", "tiny", "--steps", "8",
         "--batch-size", "4", "--eval-interval", "0", "--eval-batches", "1", "--no-progress",
         "--threads", "1", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-interval", "2",
         "--out-dir", str(tmp_path / "out"), "--faults", "ram_lost@4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    assert f"RAM tier: shared memory in {DEFAULT_DIR}" in proc.stderr
    faults = (tmp_path / "out" / "faults.jsonl").read_text().splitlines()
    (event,) = [json.loads(x) for x in faults]
    assert (event["kind"], event["step"], event["ram_dir"]) == ("ram_lost", 4, str(job))
    assert not job.exists()  # this run's slots are gone: the killed worker left them there
    assert (mine / "keep.txt").read_text() == "mine"  # the cwd's ./auto is untouched
    assert Path(DEFAULT_DIR).is_dir()  # other runs' folders are not this fault's


def test_ram_lost_is_refused_without_a_shared_memory_tier():
    injector = FaultInjector(FaultPlan.parse("sigkill@3,ram_lost@5"), rank=0, ckpt_url=None)
    with pytest.raises(ConfigError, match="ram_lost fault needs a shared-memory RAM tier"):
        injector.use_ram(None)
    plain = FaultInjector(FaultPlan.parse("sigkill@3"), rank=0, ckpt_url=None)
    plain.use_ram(None)  # nothing to refuse
    assert plain.ram_folder is None
