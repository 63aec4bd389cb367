"""``moepec ram ls|clean`` touch only RAM-tier job folders, and stale RAM slots never
hold a run hostage.

Found by a review of the command line: ``moepec ram clean --ram-dir DIR`` removed every
folder under whatever DIR it was given (a checkpoint root, a home folder), ``ram ls``
walked foreign trees, and after the user deleted a checkpoint root the slots its crashed
run left either failed every later run with a misleading ExpertSpec error or brought the
deleted run back without a word. Every ``ram_dir`` here is under ``tmp_path``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from moepec import CheckpointConfig, ConfigError
from moepec.cli.main import main
from moepec.ram.jobs import job_name, list_jobs
from tests.test_trust_ram import manager
from tests.toy import run_loop


def tree(base: Path, files: dict[str, bytes]) -> dict[Path, bytes]:
    """Make ``files`` (relative path -> bytes) under ``base``; returns what to expect."""
    out = {}
    for rel, data in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        out[path] = data
    return out


def intact(expected: dict[Path, bytes]) -> bool:
    return all(p.is_file() and p.read_bytes() == data for p, data in expected.items())


def ram(capsys, *argv: str) -> tuple[int, str]:
    """The command's exit code and output (only its own: what the test printed or logged
    before is dropped)."""
    capsys.readouterr()
    code = main(["ram", *argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def crashed_run(tmp_path: Path, steps: int) -> Path:
    """Train ``steps`` steps (a checkpoint every two), then stop as a SIGKILL would:
    nothing cleaned up, the slots left in shared memory. Returns the job folder."""
    mgr, (model, opt, sched, counter) = manager(tmp_path)
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, steps)
    mgr.wait_for_snapshot()
    mgr._persister.wait_idle()
    mgr._ram_tier.snapshotter.close()
    mgr._persister.close()
    mgr._root_claim.release()
    slots = mgr._ram_tier.snapshotter.slots
    os.close(slots._owner)  # the kernel drops a dead process's lock on its slot folder
    slots._owner = None
    job = tmp_path / "shm" / job_name(os.path.abspath(tmp_path / "ckpt"))
    assert sorted(p.name for p in (job / "rank0").glob("slot*.json"))
    return job


# -- ram clean / ls: only job folders ------------------------------------------------
def test_clean_of_a_checkpoint_root_removes_nothing_and_fails(tmp_path, capsys):
    mgr, (model, opt, sched, counter) = manager(tmp_path)
    run_loop(mgr, model, opt, sched, counter, torch.Generator().manual_seed(1), 0, 4)
    mgr.close()
    root = tmp_path / "ckpt"
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert any(n.startswith("ckpt-") for n in os.listdir(root))
    code, out = ram(capsys, "clean", "--ram-dir", str(root))
    assert code != 0
    assert out.strip() == (f"{root} holds no RAM-tier job folders (it looks like a "
                           f"checkpoint root); nothing removed")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before


def test_clean_of_a_folder_of_ordinary_files_removes_nothing_and_fails(tmp_path, capsys):
    home = tmp_path / "home"
    files = tree(home, {"projects/src/a.py": b"print(1)\n", "photos/p.jpg": b"\xff\xd8",
                        "notes.txt": b"notes\n", "rank0/slot0.data": b"not ours"})
    (home / "empty").mkdir()
    for argv in (["clean"], ["clean", "--force"], ["clean", "--run", "photos"]):
        code, out = ram(capsys, *argv, "--ram-dir", str(home))
        assert code != 0 and "holds no RAM-tier job folders" in out, out
        assert "nothing removed" in out and len(out.strip().splitlines()) == 1
    assert intact(files) and (home / "empty").is_dir()


def test_clean_removes_a_real_job_folder_and_leaves_what_is_beside_it(tmp_path, capsys):
    job = crashed_run(tmp_path, 4)
    shm = tmp_path / "shm"
    files = tree(shm, {"mine/notes.txt": b"keep\n", "loose.bin": b"x"})
    # a folder laid out like a job folder but holding a foreign file, and a link to a
    # real job folder's copy: neither is a job folder
    files |= tree(shm, {"lookalike-0123456789ab/rank0/slot0.data": b"d",
                        "lookalike-0123456789ab/rank0/photo.jpg": b"p"})
    shutil.copytree(job, tmp_path / "copy")
    (shm / "linked-0123456789ab").symlink_to(tmp_path / "copy", target_is_directory=True)
    [row] = list_jobs(str(shm))
    assert row["job"] == job.name and row["newest_step"] == 3 and row["bytes"] > 0
    code, out = ram(capsys, "clean", "--force", "--ram-dir", str(shm))
    assert code == 0 and f"{job.name}" in out and "(removed)" in out, out
    assert "left alone: 4 other entries" in out, out
    assert not job.exists()
    assert intact(files) and (shm / "linked-0123456789ab").is_symlink()
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == ["rank0"]


def test_ls_never_descends_into_foreign_folders_nor_follows_links(tmp_path, capsys,
                                                                  monkeypatch):
    base = tmp_path / "base"
    tree(base, {"deep/a/b/c/d/e.txt": b"e", "deep/rank0/slot0.data": b"s", "f.txt": b"f"})
    job = base / "job-0123456789ab" / "rank0"  # a job folder whose rank folder is a link
    job.parent.mkdir()
    job.symlink_to(base / "deep", target_is_directory=True)
    seen: list[Path] = []
    real_scandir = os.scandir

    def spy(path=".", *a, **kw):
        seen.append(Path(path))
        return real_scandir(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", spy)
    monkeypatch.setattr(Path, "rglob", lambda *a, **kw: pytest.fail("rglob over a tree"))
    code, out = ram(capsys, "ls", "--ram-dir", str(base))
    assert code == 0
    [row] = list_jobs(str(base))
    assert row["job"] == "job-0123456789ab" and row["bytes"] == 0 and row["root"] is None
    # the base and its direct children only: never base/deep/<anything>, nor the link
    assert all(len(p.relative_to(base).parts) <= 1 for p in seen), seen
    code, out = ram(capsys, "ls", "--ram-dir", str(base / "deep"))
    assert code == 0 and "holds no RAM-tier job folders" in out


def test_a_ram_dir_that_is_or_holds_or_sits_in_the_checkpoint_root_is_refused(tmp_path):
    root = tmp_path / "run"
    for ram_dir, path in [(root, root), (root / "shm", root), (root, root / "ckpt"),
                          (Path(os.path.relpath(root)), f"file://{root}")]:
        with pytest.raises(ConfigError, match=r"ram_dir .* checkpoint root .*folder of its "
                                              r"own"):
            CheckpointConfig(path=str(path), ram_dir=str(ram_dir))
    CheckpointConfig(path=str(root / "ckpt"), ram_dir=str(root / "shm"))
    CheckpointConfig(path="memory://run", ram_dir="/dev/shm/moepec")


# -- stale slots after the user deleted the checkpoint root ---------------------------
def test_slots_that_cannot_be_restored_after_the_root_was_deleted_start_fresh(
        tmp_path, caplog):
    job = crashed_run(tmp_path, 4)  # slots of steps 1 (full) and 3 (K=1 of 4 experts)
    shutil.rmtree(tmp_path / "ckpt")
    # (before the fix: this and every later run failed with the ExpertSpec error)
    fresh, (model, opt, sched, counter) = manager(tmp_path, seed=5)
    with caplog.at_level(logging.WARNING, logger="moepec"):
        assert fresh.restore() is None
    run_loop(fresh, model, opt, sched, counter, torch.Generator().manual_seed(2), 0, 2)
    fresh.close()
    later, _ = manager(tmp_path, seed=6)  # the fresh run's own checkpoint, from storage
    with caplog.at_level(logging.WARNING, logger="moepec"):
        report = later.restore()
    assert (report.tier, report.step) == ("storage", 1)
    later.close()
    [warning] = [r.getMessage() for r in caplog.records if "RAM snapshot" in r.getMessage()]
    assert "ExpertSpec?" not in warning and "starting fresh" in warning
    assert f"moepec ram clean --ram-dir {job.parent} --run {job.name}" in warning


def test_a_restore_from_slots_while_storage_has_no_checkpoint_warns(tmp_path, caplog,
                                                                     capsys):
    job = crashed_run(tmp_path, 2)  # one checkpoint (step 1), all experts, in the slots
    shutil.rmtree(tmp_path / "ckpt")
    fresh, _ = manager(tmp_path, seed=5)
    with caplog.at_level(logging.WARNING, logger="moepec"):
        report = fresh.restore()
    assert (report.tier, report.step) == ("ram", 1)  # intended (a first checkpoint lost)
    fresh.close()
    [warning] = [r.getMessage() for r in caplog.records
                 if "holds no committed checkpoint" in r.getMessage()]
    command = f"moepec ram clean --ram-dir {job.parent} --run {job.name}"
    assert str(job) in warning and command in warning, warning
    # the command it names starts the next run fresh
    crashed_run(tmp_path / "again", 2)
    shutil.rmtree(tmp_path / "again" / "ckpt")
    again = tmp_path / "again" / "shm"
    [name] = [p.name for p in again.iterdir()]
    code, out = ram(capsys, "clean", "--force", "--ram-dir", str(again), "--run", name)
    assert code == 0 and not list(again.iterdir())
    fresh, _ = manager(tmp_path / "again", seed=5)
    assert fresh.restore() is None
    fresh.close()


def test_ls_does_not_call_a_crashed_run_finished(tmp_path, capsys):
    # a clean close removes its slots: a folder whose writer is gone was left by a crash
    job = crashed_run(tmp_path, 4)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process that ended: the crashed writer
    for header in job.glob("rank0/slot*.json"):
        data = json.loads(header.read_text())
        header.write_text(json.dumps({**data, "pid": gone.pid}))
    code, out = ram(capsys, "ls", "--ram-dir", str(tmp_path / "shm"))
    assert code == 0 and job.name in out, out
    assert "finished" not in out and "(no process: left by a run that crashed or was " \
        "killed)" in out, out
