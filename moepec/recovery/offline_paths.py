"""What a path handed to the offline tools (``moepec inspect|verify|export``) holds.

Three kinds of folder hold moepec checkpoints: a ``CheckpointManager`` root (one
``ckpt-<seq>-step<step>-<run>`` folder per checkpoint), a flat save directory
(Megatron-Core's: one folder per iteration, :mod:`moepec.store.flat`), and the
``--ckpt-dir`` of a replica-group run (the folder holding the ``group-<I>`` roots, each a
manager root holding its part of every striped checkpoint). :func:`root_kind` tells them
apart; :func:`nothing_committed` is the one sentence every tool says when a folder holds
no committed checkpoint yet. Reads directory listings only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from enum import StrEnum

from moepec.errors import NoCheckpointError
from moepec.keys import parse_checkpoint_name
from moepec.store.flat import is_flat_root
from moepec.store.storage import Storage

log = logging.getLogger(__name__)


class RootKind(StrEnum):
    """What a checkpoint path holds."""

    MANAGER = "manager"
    """A ``CheckpointManager`` root (also an empty folder: nothing committed yet)."""
    FLAT = "flat"
    """A flat save directory: one folder per iteration (Megatron-Core's backend)."""
    GROUPS = "groups"
    """The folder of a replica-group run's ``group-<I>`` roots."""


def group_roots(st: Storage) -> list[str]:
    """The replica groups' roots directly under ``st`` (``group-<I>``), in group order.

    On a local disk a ``group-<I>`` that is a link is skipped (with a warning): the tools
    read nothing outside the folder they were given, and a link could lead anywhere."""
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in st.fs.ls(st.root, detail=False)]
    except (FileNotFoundError, OSError):
        return []
    found = []
    for n in names:
        if not re.fullmatch(r"group-\d{1,6}", n):
            continue
        if st.local and os.path.islink(os.path.join(st.root, n)):
            log.warning("skipping %s/%s: a link, not a replica group's root in the folder "
                        "given", st.url, n)
            continue
        found.append((int(n[6:]), n))
    return [n for _, n in sorted(found)]


def _local(path: str) -> str | None:
    """The local file-system path of ``path``, None for a remote URL."""
    if path.startswith("file://"):
        return path.removeprefix("file://")
    return None if "://" in path else path


def root_kind(path: str, storage_options: dict | None = None) -> RootKind:
    """The kind of folder ``path`` is. Raises NoCheckpointError, one line naming the path,
    when it does not exist. Any process; reads listings only."""
    local = _local(path)
    if local is not None and not os.path.exists(local):
        raise NoCheckpointError(f"{path} does not exist")
    if local is not None and is_flat_root(local):
        return RootKind.FLAT
    st = Storage(path, storage_options)
    if local is None and not st.fs.exists(st.root):
        raise NoCheckpointError(f"{path} does not exist")
    if not st.list_checkpoints() and group_roots(st):
        return RootKind.GROUPS
    return RootKind.MANAGER


def nothing_committed(path: str, uncommitted: Sequence[str] = ()) -> str:
    """The sentence for a folder with no committed checkpoint (``moepec`` exits 2)."""
    text = f"no committed checkpoint in {path} yet"
    local = _local(path)
    if local is not None and os.path.isdir(local):
        parent = os.path.dirname(os.path.abspath(local))
        if parse_checkpoint_name(os.path.basename(os.path.abspath(local))) is not None:
            return f"{path} is one checkpoint of the root {parent}; pass the root: {parent}"
        if os.path.isfile(os.path.join(local, ".metadata")):
            return (f"{path} is a plain DCP checkpoint, not a moepec checkpoint root; moepec "
                    f"reads roots it wrote (torch's dcp.load reads this one, if you trust it)")
    if uncommitted:
        text += (f" ({len(uncommitted)} uncommitted: {', '.join(list(uncommitted)[:3])}"
                 f"{', ...' if len(uncommitted) > 3 else ''}; a save still running or "
                 f"killed before its commit)")
    return text
