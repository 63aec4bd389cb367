"""The Hugging Face Trainer integration: a run killed mid-way and started again with the
same command ends at the same step and data position as an uninterrupted run."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: "
                                           "pip install 'moepec[hf]'")

from moepec.store.committed import committed_manifests  # noqa: E402
from moepec.store.storage import Storage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
STEPS, INTERVAL = 12, 4


def _cmd(ckpt: Path, record: Path, sleep: float) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--ckpt", str(ckpt), "--steps", str(STEPS),
            "--interval", str(INTERVAL), "--sleep", str(sleep), "--record", str(record)]


def _committed_steps(ckpt: Path) -> list[int]:
    return sorted(int(re.search(r"step(\d+)", p).group(1))
                  for p in glob.glob(str(ckpt / "*" / "moepec.json")))


@pytest.mark.slow
@pytest.mark.timeout(900)  # three runs of up to 240 s each; 215 s of them beside busy loops
def test_trainer_killed_mid_run_resumes_at_the_same_step_and_data(tmp_path):
    env = dict(os.environ, PYTHONHASHSEED="0")
    full = subprocess.run(_cmd(tmp_path / "a", tmp_path / "a.json", 0.0), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert full.returncode == 0, full.stderr[-2000:]
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["global_step"] == STEPS and len(a["batches"]) == STEPS
    assert a["resumed_global_step"] is None
    # the Trainer's final step gets a complete checkpoint (every expert), committed
    found = committed_manifests(Storage(str(tmp_path / "a")))
    newest = found.manifests[found.newest].meta
    assert (newest.step, newest.full) == (STEPS - 1, True)

    # The same command, killed (SIGKILL) once a checkpoint at step 3 or later is committed.
    cmd = _cmd(tmp_path / "b", tmp_path / "b.json", 0.3)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not [s for s in _committed_steps(tmp_path / "b") if s >= 3]:
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint committed in time"
        time.sleep(0.05)
    assert proc.poll() is None  # still training: killed mid-run
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (tmp_path / "b.json").exists()
    last = max(_committed_steps(tmp_path / "b"))
    assert last < STEPS - 1

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["restored_step"] == last and b["resumed_global_step"] == last + 1
    assert b["global_step"] == a["global_step"] and b["epoch"] == a["epoch"]
    assert b["lr"] == a["lr"]  # the LR scheduler resumed, not restarted
    # the data position: the restarted process trained exactly the batches an
    # uninterrupted run trains after that step, in the same order
    assert b["batches"] == a["batches"][last + 1:]
    # routing counts were fed from the router logits and restored with the checkpoint
    assert b["routing_observed"] == a["routing_observed"] == STEPS * 4 * 8 * 2 * 2
