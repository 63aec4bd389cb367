"""A test leaves nothing in shared memory (issue 35.4): after each test that has a
``tmp_path``, the RAM tier's job folders of the checkpoint roots under it are removed from
``/dev/shm/moepec``. A job folder is named for its root's URL (:func:`job_name`, a hash of
the whole path), so only folders of roots inside this test's own ``tmp_path`` match:
never another test's, another process's or a user's. Managers that a test leaves open
(or kills) keep their slots there until this runs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from moepec.ram.jobs import DEFAULT_DIR, job_name


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


@pytest.fixture(autouse=True)
def _no_shared_memory_left(request: pytest.FixtureRequest) -> Iterator[None]:
    # Taken before the test (it asks for it anyway), so it is torn down after this.
    tmp_path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames \
        else None
    yield
    if tmp_path is not None:
        for folder in job_folders(tmp_path):
            shutil.rmtree(folder, ignore_errors=True)
