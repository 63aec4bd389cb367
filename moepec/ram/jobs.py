"""The shared-memory folder of the RAM tier: one job folder per checkpoint root.

``<ram_dir>/<job>/`` holds the slots of one root's ranks (:mod:`moepec.ram.shm`); the job
is named for the root (:func:`job_name`), so a restarted worker finds the folder of the
one it replaces. Also what the tier may take of shared memory (:func:`check_budget`) and
what ``moepec ram ls|clean`` show and delete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from moepec.errors import ConfigError
from moepec.store.lease import pid_alive

DEFAULT_DIR = "/dev/shm/moepec"
"""The RAM tier's folder for ``ram_dir="auto"`` (node-local shared memory)."""


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
    if job is not None and job.is_dir():
        free += sum(f.stat().st_size for f in job.rglob("*") if f.is_file())
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
        for h in job.glob("rank*/slot*.json"):
            try:
                data = json.loads(h.read_text())
                headers.append((data.get("root"), data.get("meta", {}).get("run_id"),
                                data.get("step"), data.get("pid")))
            except (OSError, ValueError, AttributeError):
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
