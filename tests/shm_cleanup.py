"""A test leaves nothing in shared memory (issue 35.4): after each test, the RAM tier's job
folders in ``/dev/shm/moepec`` that are this test's own are removed. Two kinds:

- the job folders of checkpoint roots at or under the test's ``tmp_path`` (a job folder
  is named for its root's URL, :func:`job_name`, a hash of the whole path): never another
  test's, another process's or a user's. Managers that a test leaves open (or kills, in a
  child process) keep their slots there until this runs.
- roots that are not local paths (``memory://``, ``s3://``): their names say nothing of
  the test, so a folder goes when it appeared during the test and a slot folder in it is
  this process's: its owner lock (``owner.lock``, held for as long as the manager lives,
  :mod:`moepec.ram.shm`) is held by this process, or a slot header names its pid. A
  manager a test did not close holds its lock to the end of the session, and leaves its
  folder behind. A folder any other process holds is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from moepec.ram.jobs import DEFAULT_DIR, job_name
from moepec.ram.shm import OWNER_NAME


def job_folders(tmp_path: Path, shm: Path = Path(DEFAULT_DIR)) -> list[Path]:
    """The job folders in ``shm`` of checkpoint roots at or under ``tmp_path`` (a local
    path, or that path behind the fault-injecting ``faulty://`` filesystem)."""
    if not shm.is_dir() or not tmp_path.is_dir():
        return []
    present = set(os.listdir(shm))
    if not present:
        return []
    found = []
    for folder, _, _ in os.walk(tmp_path):
        for url in (folder, "faulty://" + folder):
            name = job_name(url)
            if name in present:
                found.append(shm / name)
    return found


def flock_holders(locks: str = "/proc/locks") -> dict[tuple[int, int, int], int]:
    """(device major, minor, inode) -> pid of each flock held on this host (Linux's
    ``/proc/locks``; empty where there is none)."""
    try:
        lines = Path(locks).read_text().splitlines()
    except OSError:
        return {}
    held = {}
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":  # "->" marks a waiter, not a holder
            continue
        try:
            major, minor, inode = parts[5].split(":")
            held[int(major, 16), int(minor, 16), int(inode)] = int(parts[4])
        except ValueError:
            continue
    return held


def _holder(owner: Path, holders: dict[tuple[int, int, int], int]) -> int | None:
    try:
        st = owner.stat()
    except OSError:
        return None
    return holders.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))


def _header_pids(slots: Path) -> set[int]:
    pids = set()
    for header in slots.glob("slot*.json"):
        try:
            pids.add(json.loads(header.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return pids


def own_new_folders(before: set[str], shm: Path = Path(DEFAULT_DIR),
                    pid: int | None = None) -> list[Path]:
    """The job folders in ``shm`` that are not in ``before`` and belong to process ``pid``
    (default: this one): one of its slot folders has its owner lock held by ``pid``, or a
    slot header written by ``pid``, and none is held by another process."""
    pid = os.getpid() if pid is None else pid
    try:
        new = set(os.listdir(shm)) - before
    except OSError:
        return []
    holders = flock_holders() if new else {}
    found = []
    for name in sorted(new):
        slots = [p for p in (shm / name).glob("*") if p.is_dir() and not p.is_symlink()]
        owners = {_holder(p / OWNER_NAME, holders) for p in slots} - {None}
        if owners - {pid}:
            continue  # another live process uses it
        if pid in owners or any(pid in _header_pids(p) for p in slots):
            found.append(shm / name)
    return found


def _listing(shm: Path = Path(DEFAULT_DIR)) -> set[str]:
    try:
        return set(os.listdir(shm))
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def _no_shared_memory_left(request: pytest.FixtureRequest) -> Iterator[None]:
    # Taken before the test (it asks for it anyway), so it is torn down after this.
    tmp_path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames \
        else None
    before = _listing()
    yield
    left = own_new_folders(before)
    if tmp_path is not None:
        left += job_folders(tmp_path)
    for folder in left:
        shutil.rmtree(folder, ignore_errors=True)
