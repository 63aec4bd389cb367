"""What `moepec train` and `moepec demo` refuse before they start, and how they end.

A checkpoint root that can never be written, a fault that can never fire and a bad demo
setting are refused in one line before anything runs; a root paused to the end of a run
gets the final warning; Ctrl-C ends a run in one line, exit 130.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moepec.cli import demo
from moepec.cli import main as cli
from moepec.cli.demo import DEFAULT_FAULTS, DemoSettings
from moepec.errors import ConfigError, PersistError
from moepec.train.config import OnPersistError
from moepec.train.faults import FaultPlan
from moepec.train.metrics import MetricsWriter
from moepec.train.persist_errors import PersistGuard

REPO = Path(__file__).resolve().parents[1]
TINY = ["train", "--config", "tiny", "--no-progress", "--threads", "1", "--batch-size", "4",
        "--eval-batches", "0", "--ram-dir", "none"]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], *match: str) -> str:
    """``moepec argv`` exits 2 with one error line holding ``match``, having trained nothing."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    errors = [line for line in err if line.startswith("moepec: error:")]
    assert len(errors) == 1 and all(m in errors[0] for m in match), err
    assert "Traceback" not in captured.err
    assert not any(" step 0: loss" in line for line in err), err  # nothing trained
    assert "first train loss" not in captured.out  # no summary
    return errors[0]


# -- A: a checkpoint root that cannot be written ---------------------------------------
def test_train_refuses_a_ckpt_dir_that_cannot_be_written(capsys, tmp_path):
    (tmp_path / "afile").write_text("a file, not a folder")
    root = tmp_path / "afile" / "sub"
    _refused(capsys, TINY + ["--steps", "4", "--ckpt-dir", str(root)],
             str(root), "choose a writable --ckpt-dir", "nothing was trained")


def test_a_root_paused_to_the_end_gets_the_final_warning(capsys, tmp_path, monkeypatch):
    """A restarted torchrun worker is mid-run: it trains on with the root paused, and the
    run's end says that no checkpoint reached storage."""
    (tmp_path / "afile").write_text("a file, not a folder")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    argv = TINY + ["--steps", "4", "--ckpt-dir", str(tmp_path / "afile" / "sub"),
                   "--ckpt-interval", "2"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    final = [line for line in err.splitlines() if "the run ends" in line]
    assert len(final) == 1 and "WARNING" in final[0], err
    assert "paused" in final[0]
    assert "the newest committed checkpoint is none" in final[0]


class _Manager:
    """What PersistGuard.close reads of a CheckpointManager."""

    def __init__(self, last_committed: str | None) -> None:
        self.last_committed = last_committed
        self.last_persist_failed = False
        self.fenced = None

    def close(self) -> None:
        pass


@pytest.mark.parametrize("committed, warns", [
    (None, True),  # paused from the start: nothing committed
    ("ckpt-000000-step00000003-aaaaaaaaaaaa", True),  # committed before the failure
    ("ckpt-000002-step00000009-aaaaaaaaaaaa", False),  # committed after it: storage is back
])
def test_the_final_warning_follows_commits_after_the_last_failure(caplog, committed, warns):
    guard = PersistGuard(OnPersistError.CONTINUE, MetricsWriter(None, enabled=False))

    def paused():
        raise PersistError("checkpoints are paused, the snapshot stays in RAM: cannot write")

    with caplog.at_level(logging.WARNING):
        guard.call(5, paused)
        caplog.clear()
        guard.close(_Manager(committed), 9)
    final = [r.getMessage() for r in caplog.records if "the run ends" in r.getMessage()]
    assert len(final) == (1 if warns else 0)
    if warns:
        assert "paused" in final[0]
        assert ("none: no checkpoint" in final[0]) == (committed is None)


# -- B: faults that can never fire -----------------------------------------------------
@pytest.mark.parametrize("steps, interval, faults, match", [
    (4, 2, "sigkill@-1", "steps and ranks count from 0"),
    (4, 2, "sigkill@2:r5", "the run has 1 rank(s)"),
    (4, 2, "sigkill@100", "past the run's last step 3"),
    (4, 2, "sigkill@4", "past the run's last step 3"),
    (6, 4, "kill_persist@5", "the last is after step 3"),
    (8, 4, "kill_copy@2", "step 2 takes none"),
])
def test_train_refuses_a_fault_that_can_never_fire(capsys, tmp_path, steps, interval, faults,
                                                   match):
    line = _refused(capsys, TINY + ["--steps", str(steps), "--ckpt-dir", str(tmp_path / "ck"),
                                    "--ckpt-interval", str(interval), "--faults", faults],
                    "can never fire", match)
    assert faults.split(":")[0] in line


def test_faults_that_can_fire_pass_the_check():
    FaultPlan.parse("sigkill@0,kill_persist@7,kill_copy@3:r1,exception@7:r1").check(
        8, interval=4, world_size=2)
    with pytest.raises(ConfigError, match="unknown fault kind 'bogus'"):
        FaultPlan.parse("bogus@3")


def test_demo_moves_its_default_faults_to_the_run_it_makes():
    assert DemoSettings().planned_faults() == (DEFAULT_FAULTS, None)
    faults, note = DemoSettings(steps=40).planned_faults()
    assert note and "placed for 300 steps" in note
    assert [f.step for f in FaultPlan.parse(faults).faults] == [10, 18, 24, 32]
    faults, note = DemoSettings(steps=8, ranks=1).planned_faults()
    plan = FaultPlan.parse(faults)
    assert plan.faults and all(f.step < 8 and f.rank == 0 for f in plan.faults)
    assert "kill_persist" not in faults and "kill_persist@3:r0 is left out" in note
    plan.check(8, interval=10, world_size=1)
    # faults a user gives are theirs: used as they are, refused when they cannot fire
    assert DemoSettings(steps=8, faults="sigkill@5:r1").planned_faults() == ("sigkill@5:r1",
                                                                             None)
    with pytest.raises(ConfigError, match="sigkill@50:r0 can never fire"):
        DemoSettings(steps=8, faults="sigkill@50")


# -- C: demo settings are checked before any run ---------------------------------------
class _Started(Exception):
    """A demo run was about to start."""


@pytest.fixture
def no_runs(monkeypatch):
    def train_run(settings, out, *, faulty, say):
        raise _Started

    monkeypatch.setattr(demo, "_train_run", train_run)


@pytest.mark.parametrize("argv, match", [
    (["--faults", "bogus"], "bad fault 'bogus'"),
    (["--ckpt-interval", "0"], "interval must be >= 1"),
    (["--ranks", "0"], "ranks must be >= 1"),
    (["--ranks", "-3"], "ranks must be >= 1"),
    (["--ranks", "1", "--faults", "sigkill@20:r1"], "the run has 1 rank(s)"),
    (["--ram-lost", "--ram-dir", "none"], "--ram-lost"),
])
def test_demo_checks_its_settings_before_any_run(capsys, tmp_path, no_runs, argv, match):
    assert cli.main(["demo", "--out-dir", str(tmp_path), *argv]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("moepec: error:")]
    assert len(errors) == 1 and match in errors[0], captured.err
    assert "[1/2]" not in captured.out and "Traceback" not in captured.err


def test_demo_warns_when_ranks_exceed_the_cores(tmp_path, no_runs, monkeypatch, caplog):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    lines: list[str] = []
    with caplog.at_level(logging.WARNING), pytest.raises(_Started):
        demo.run_demo(tmp_path, DemoSettings(ranks=64), say=lines.append)
    assert any("64 ranks on 2 CPU core(s)" in r.getMessage() for r in caplog.records)


# -- D: Ctrl-C --------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_ctrl_c_ends_train_in_one_line_with_exit_130(tmp_path):
    """Ctrl-C (pressed twice at once: the same stop) is a planned stop: a complete
    checkpoint of the step it stopped after, one line, status 130, no traceback."""
    from moepec.store.committed import committed_manifests
    from moepec.store.storage import Storage

    ckpt = tmp_path / "ck"
    cmd = [sys.executable, "-m", "moepec", *TINY, "--steps", "100000", "--ckpt-dir",
           str(ckpt), "--ckpt-interval", "2", "--log-interval", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # SIGINT as a terminal sends it: default disposition in the child even when this
    # process was started with SIGINT ignored (a background job of a shell).
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    before: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(before)  # the run ended before it was interrupted
            before.append(line)
            if "committed ckpt-" in "".join(before) and " step 5: loss" in line:
                break
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    said = [line for line in rest.splitlines() if "stopped after step" in line]
    assert len(said) == 1 and "on SIGINT" in said[0], rest
    found = committed_manifests(Storage(str(ckpt)))
    newest = found.manifests[found.newest]
    assert newest.meta.full and f"complete checkpoint {newest.name}" in said[0]
    assert said[0].endswith("rerunning the same command resumes with nothing lost")
    # after it, nothing but the run's summary
    tail = rest.splitlines()[rest.splitlines().index(said[0]) + 1:]
    assert tail and all(" WARNING " not in x and " ERROR " not in x for x in tail), rest
    assert "stopped" in tail[-1] and "SIGINT" in tail[-1], rest
