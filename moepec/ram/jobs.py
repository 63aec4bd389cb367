"""The shared-memory folder of the RAM tier: one job folder per checkpoint root.

``<ram_dir>/<job>/`` holds the slots of one root's ranks (:mod:`moepec.ram.shm`); the job
is named for the root (:func:`job_name`), so a restarted worker finds the folder of the
one it replaces. Also what the tier may take of shared memory (:func:`check_budget`) and
what ``moepec ram ls|clean`` show and delete.

Shared memory is shared by every user of the node and a job folder's name is predictable,
so another user may make a folder first or plant links in one. Every folder the tier
creates or reuses is checked by :func:`own_folder`: the job and rank folders must be
this user's own and writable by nobody else; the base folder (``ram_dir``) may instead be
shared like ``/tmp`` (owned by root, sticky: no one can rename or delete another's
folders in it). Nothing is read or written through a link.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from moepec.errors import ConfigError, CorruptCheckpointError
from moepec.store.lease import pid_alive
from moepec.store.reader import read_small

DEFAULT_DIR = "/dev/shm/moepec"
"""The RAM tier's folder for ``ram_dir="auto"`` (node-local shared memory)."""
MAX_HEADER_BYTES = 64 << 20
"""The most bytes a slot header may hold."""


def job_name(root_url: str) -> str:
    """The folder of one checkpoint root's slots: readable tail + a hash of the URL."""
    tail = re.sub(r"[^A-Za-z0-9_.-]", "_", root_url.rstrip("/").rsplit("/", 1)[-1])[:40]
    return f"{tail or 'root'}-{hashlib.sha256(root_url.encode()).hexdigest()[:12]}"


def root_identity(url: str, local: bool) -> str:
    """The checkpoint root as recorded in slot headers (absolute for a local path)."""
    return os.path.abspath(url) if local and "://" not in url else url


def job_dir(ram_dir: str, url: str, local: bool) -> Path:
    """The folder of one checkpoint root's slots under ``ram_dir`` (all its ranks' slots
    and the replicas this node holds): what the RAM tier opens for the root at ``url``
    (``local``: a local path). Pure: creates nothing."""
    return Path(ram_dir) / job_name(root_identity(url, local))


def _user(uid: int) -> str:
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def folder_problem(st: os.stat_result, *, shared: bool) -> str | None:
    """What makes a folder with ``os.lstat`` result ``st`` unfit to hold this user's RAM
    slots, or None. Private (job and rank folders): a real folder, owned by this user
    (effective uid), writable by no one else. ``shared`` (the base folder): the same, or
    sticky and owned by root (like /tmp: others may add folders, but only root may
    rename or delete ours). A sticky folder of another user is refused: its owner could
    rename our job folder away and plant a link in its place."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    mode = stat.S_IMODE(st.st_mode)
    root_sticky = shared and st.st_uid == 0 and bool(mode & stat.S_ISVTX)
    if st.st_uid != os.geteuid() and not root_sticky:
        return f"belongs to user {_user(st.st_uid)}, not to you (uid {os.geteuid()})"
    if mode & 0o022 and not (shared and mode & stat.S_ISVTX):
        return ("is writable by other users" + (" without the sticky bit" if shared else "")
                + f" (mode {mode:o})")
    return None


def own_folder(path: Path, *, shared: bool = False) -> None:
    """Make the RAM tier folder ``path`` (mode 0700), or check the one there: its parent
    must exist (``shared``: the base folder, whose parents are made too). Raises
    ConfigError naming the folder, what is wrong and the fix, when :func:`folder_problem`
    finds one (checked also after a fresh mkdir: the same lstat either way)."""
    if shared:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    problem = folder_problem(os.lstat(path), shared=shared)
    if problem is None:
        return
    if shared:
        fix = ("use a folder of your own (mode 0700), or one shared like /tmp (owned by "
               "root, mode 1777): remove it or fix it, or set ram_dir to a folder of your "
               "own")
    else:
        fix = ("moepec keeps RAM snapshots only in folders of your own, writable by you "
               "alone: remove it, or set ram_dir to a folder of your own")
    raise ConfigError(f"the RAM tier's folder {path} {problem}; {fix}")


def read_header(path: Path) -> bytes:
    """The bytes of a slot header, never through a link (nor from a FIFO or device);
    raises OSError, or CorruptCheckpointError for a link, not a regular file, or a
    header over MAX_HEADER_BYTES."""
    data = read_small(str(path), MAX_HEADER_BYTES + 1)
    if len(data) > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"{path}: header over {MAX_HEADER_BYTES} bytes")
    return data


def free_shm_bytes(directory: str) -> int:
    """Free bytes of the filesystem holding ``directory`` (or its nearest parent)."""
    p = Path(directory)
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def check_budget(need_bytes: int, budget_bytes: int | None, directory: str,
                 root: str | None = None) -> None:
    """Refuse a RAM tier of ``need_bytes`` (three slots) that does not fit: the budget,
    by default half the free space of the shared-memory filesystem, counting as free the
    slots this checkpoint root's job already holds (a restarted worker reuses them).
    Raises ConfigError."""
    free = free_shm_bytes(directory)
    job = Path(directory) / job_name(root) if root is not None else None
    if job is not None and job.is_dir() and not job.is_symlink():
        free += sum(f.lstat().st_size for f in job.rglob("*")
                    if f.is_file() and not f.is_symlink())
    budget = free // 2 if budget_bytes is None else budget_bytes
    if need_bytes > budget:
        raise ConfigError(
            f"the shared-memory RAM tier needs up to {need_bytes / 2**20:.1f} MiB on this node "
            f"(three snapshot slots per local rank) in {directory}, over its budget of {budget / 2**20:.1f} MiB"
            f"{' (half the free shared memory)' if budget_bytes is None else ''}; raise "
            f"CheckpointConfig.ram_budget_bytes, free /dev/shm (`moepec ram clean`), lower "
            f"k_snapshot, or use ram_dir=None (in-process snapshots)")


def list_jobs(ram_dir: str) -> list[dict[str, Any]]:
    """What is under ``ram_dir``: one row per job folder (``moepec ram ls``). ``live``:
    a process that wrote one of its slots still runs on this host."""
    rows: list[dict[str, Any]] = []
    base = Path(ram_dir)
    if not base.is_dir():
        return rows
    for job in sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink()):
        files = [f for f in job.rglob("*") if f.is_file() and not f.is_symlink()]
        headers = []
        # Not glob("rank*/slot*.json"): it would follow a rank folder that is a link.
        ranks = [r for r in job.glob("rank*") if r.is_dir() and not r.is_symlink()]
        for h in (h for r in ranks for h in r.glob("slot*.json")):
            try:
                data = json.loads(read_header(h))
                headers.append((data.get("root"), data.get("meta", {}).get("run_id"),
                                data.get("step"), data.get("pid")))
            except (OSError, ValueError, AttributeError, CorruptCheckpointError):
                continue
        mtime = max((f.stat().st_mtime for f in files), default=job.stat().st_mtime)
        rows.append({"job": job.name, "path": str(job),
                     "bytes": sum(f.stat().st_size for f in files),
                     "root": next((h[0] for h in headers if h[0]), None),
                     "runs": sorted({h[1] for h in headers if isinstance(h[1], str)}),
                     "newest_step": max((h[2] for h in headers if isinstance(h[2], int)),
                                        default=None),
                     "live": any(pid_alive(h[3]) for h in headers),
                     "age_h": (time.time() - mtime) / 3600})
    return rows


def remove_job(ram_dir: str, job: str) -> None:
    """Delete one job folder, confined to ``ram_dir`` (a direct child, not a link)."""
    base = Path(ram_dir).resolve()
    target = base / job
    if target.is_symlink() or target.resolve().parent != base or not target.is_dir():
        raise ConfigError(f"{job!r} is not a job folder of {ram_dir}; nothing removed")
    shutil.rmtree(target)
