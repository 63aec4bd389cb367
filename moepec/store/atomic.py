"""The one atomic small-file write on a local file system.

A manifest, a lease, a heartbeat, a recovery record: small files that a reader must see
whole or not at all, and that must survive a crash once written. On a local disk that
takes four steps, each for a reason: the bytes go to a temporary name in the same folder
(a reader never sees a part), are fsync'd (the data is on disk before its name is), the
temporary file becomes the final name (``os.replace``; for an exclusive create a hard
link, which unlike a rename fails when the name exists), and the folder is fsync'd (the
new name survives a crash). Object stores need none of this: one PUT appears whole
(:class:`moepec.store.storage.FsspecStorage`).
"""

from __future__ import annotations

import contextlib
import os
import secrets


def write_atomic(path: str | os.PathLike[str], data: bytes, *,
                 exclusive: bool = False) -> None:
    """Write the small file ``path`` whole and durably: a reader sees the old file (or
    none) or the new one, never a part, and after a crash the new one is either there
    whole or absent. With ``exclusive`` an existing ``path`` is never replaced:
    FileExistsError, and nothing changed (a commit never overwrites a manifest).

    The temporary file (``.<name>.<pid>-<random>.tmp`` beside ``path``) never outlives
    the call, unless the process dies inside it. Any thread, any process; blocks for two
    fsyncs. Raises OSError as the file system does (a missing folder included)."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)  # fails when path exists, as a rename would not
        else:
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(folder or ".")


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make the names in ``folder`` durable (a created, renamed or removed entry)."""
    fsync_file(folder)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Make the file (or folder) at ``path`` durable, written already by anyone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
