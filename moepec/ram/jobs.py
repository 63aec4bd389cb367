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
    if job is not None and is_job_folder(job):
        free += sum(st.st_size for st in _job_files(job))
    budget = free // 2 if budget_bytes is None else budget_bytes
    if need_bytes > budget:
        raise ConfigError(
            f"the shared-memory RAM tier needs up to {need_bytes / 2**20:.1f} MiB on this node "
            f"(three snapshot slots per local rank) in {directory}, over its budget of {budget / 2**20:.1f} MiB"
            f"{' (half the free shared memory)' if budget_bytes is None else ''}; raise "
            f"CheckpointConfig.ram_budget_bytes, free /dev/shm (`moepec ram clean`), lower "
            f"k_snapshot, or use ram_dir=None (in-process snapshots)")


RANK_FOLDER = re.compile(r"(replica-of-)?rank\d+")
"""The folders of a job folder: one rank's slots, or the replicas of another's."""
SLOT_FILE = re.compile(r"slot\d+\.(data|json)|\.slot\d+\.json\.\d+\.tmp|owner\.lock")
"""The files of a rank folder (:mod:`moepec.ram.shm`): slots, headers being written, lock."""


def _entries(folder: Path) -> list[os.DirEntry] | None:
    """``folder``'s entries (one level, no link followed), or None when it cannot be read."""
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return None


def is_job_folder(path: Path) -> bool:
    """Whether ``path`` is a job folder of the RAM tier, judged by its contents alone: a
    real folder (not a link) holding at least one rank folder and nothing else, each rank
    folder (``rank<R>``, ``replica-of-rank<R>``) holding only slot files and its lock
    (a link in either place is never followed: an entry's name is all that is read).
    Anything else (a checkpoint root, a home folder, ``/proc``) is not one, and is told
    apart by the names of its entries alone: nothing below them is opened.

    Not by name: a checkpoint's folder (``ckpt-...-<12 hex>``) looks like
    :func:`job_name`'s, and folders the tier never made may still hold its layout."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
    except OSError:
        return False
    entries = _entries(path)
    if not entries:
        return False
    # Every name first: a foreign folder is told apart without opening any of its own.
    if not all(RANK_FOLDER.fullmatch(e.name) and (e.is_symlink() or e.is_dir(
            follow_symlinks=False)) for e in entries):
        return False
    for entry in entries:
        if entry.is_symlink():
            continue  # planted in a job folder: never followed, removed with it
        files = _entries(Path(entry.path))
        if files is None or any(not SLOT_FILE.fullmatch(f.name)
                                or f.is_dir(follow_symlinks=False) for f in files):
            return False
    return True


def scan(ram_dir: str) -> tuple[list[Path], list[str]]:
    """The job folders directly under ``ram_dir`` (:func:`is_job_folder`) and the names of
    the other entries there, which ``moepec ram`` neither lists nor removes. Nothing
    when ``ram_dir`` is missing or is itself a link (the tier never uses one)."""
    base = Path(ram_dir)
    try:
        if not stat.S_ISDIR(os.lstat(base).st_mode):
            return [], []
    except OSError:
        return [], []
    jobs, others = [], []
    for entry in sorted(_entries(base) or [], key=lambda e: e.name):
        path = Path(entry.path)
        (jobs.append(path) if is_job_folder(path) else others.append(entry.name))
    return jobs, others


def looks_like(names: list[str]) -> str:
    """What a folder whose entries are ``names`` (none of them job folders) seems to be,
    for the message of ``moepec ram clean``."""
    if "moepec.lease" in names or any(n.startswith("ckpt-") for n in names):
        return "it looks like a checkpoint root"
    return "it holds other files"


def _job_files(job: Path) -> list[os.stat_result]:
    """lstat of the regular files of a job folder (:func:`is_job_folder`), two levels."""
    out = []
    for rank in _entries(job) or []:
        if rank.is_dir(follow_symlinks=False):
            for f in _entries(Path(rank.path)) or []:
                st = f.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    out.append(st)
    return out


def list_jobs(ram_dir: str) -> list[dict[str, Any]]:
    """The job folders under ``ram_dir``, one row each (``moepec ram ls``); any other
    entry is left out (:func:`scan`). ``live``: a process that wrote one of its slots
    still runs on this host."""
    rows: list[dict[str, Any]] = []
    for job in scan(ram_dir)[0]:
        files = _job_files(job)
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
        mtime = max((f.st_mtime for f in files), default=job.lstat().st_mtime)
        rows.append({"job": job.name, "path": str(job),
                     "bytes": sum(f.st_size for f in files),
                     "root": next((h[0] for h in headers if h[0]), None),
                     "runs": sorted({h[1] for h in headers if isinstance(h[1], str)}),
                     "newest_step": max((h[2] for h in headers if isinstance(h[2], int)),
                                        default=None),
                     "live": any(pid_alive(h[3]) for h in headers),
                     "age_h": (time.time() - mtime) / 3600})
    return rows


def remove_job(ram_dir: str, job: str) -> None:
    """Delete one job folder, confined to ``ram_dir`` (a direct child, not a link) and
    only when it is one (:func:`is_job_folder`, checked again here). Raises ConfigError
    for anything else, removing nothing. Links inside are removed, never followed."""
    base = Path(ram_dir).resolve()
    target = base / job
    if (target.is_symlink() or target.resolve().parent != base or not target.is_dir()
            or not is_job_folder(target)):
        raise ConfigError(f"{job!r} is not a RAM-tier job folder of {ram_dir}; nothing "
                          f"removed")
    shutil.rmtree(target)
