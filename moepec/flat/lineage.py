"""What a flat lineage does when a folder it needs is gone (deleted by hand, or by a
framework's rotation such as the Hugging Face Trainer's ``save_total_limit``): a load
reads each expert that folder held from its newest older copy in the lineage, and the
next save writes those experts again from the live state. The lineage is the manifest's
``ancestors`` ((folder, uid) pairs): a folder written again under an old name is another
save, never taken for the ancestor. Rank 0 or any rank; reads small files only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

import torch.distributed as dist

from moepec.errors import CheckpointError, CorruptCheckpointError, MoepecError
from moepec.flat.plan import Parent, Unit
from moepec.keys import MANIFEST_NAME
from moepec.store.flat import FlatManifest, read_manifest
from moepec.store.items import Item

log = logging.getLogger(__name__)
T = TypeVar("T")


def manifest_or_none(root: str, name: str) -> FlatManifest | None:
    try:
        return read_manifest(root, name)
    except MoepecError:
        return None


GONE = "is gone"
REWRITTEN = "holds another save now (written again under its name)"
"""Why a folder a view needs is not the save its lineage names (saves and loads say the
same)."""


def committed(root: str, name: str) -> bool:
    """Whether folder ``name`` of ``root`` has its manifest (the commit rule)."""
    return os.path.exists(os.path.join(root, name, MANIFEST_NAME))


def folder_uid(root: str, name: str, cache: dict[str, tuple[tuple, str]]) -> str | None:
    """The ``uid`` of committed folder ``name`` of ``root``, None when it is not committed
    or its manifest cannot be read. A stat per call: the manifest is read again only
    when its file changed (``cache`` holds what was read)."""
    path = os.path.join(root, name, MANIFEST_NAME)
    try:
        st = os.stat(path)
    except OSError:
        return None
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    held = cache.get(path)
    if held is None or held[0] != stamp:
        m = manifest_or_none(root, name)
        if m is None:
            return None
        held = cache[path] = (stamp, m.uid)
    return held[1]


def without_gone(root: str, parent: Parent | str | None,
                 cache: dict[str, tuple[tuple, str]] | None = None,
                 rotating: set[str] | None = None) -> Parent | str | None:
    """``parent`` with the keys its view reads from folders that no longer hold the save
    its lineage names (deleted by hand or by a framework's rotation, such as the
    Trainer's ``save_total_limit``, or written again under the same name) dropped from
    its view, so that this save writes them again from the live state: the lineage
    heals instead of failing every later commit or leaning on another save's data.

    A framework that keeps only the newest folders deletes, right after each save, the
    older ones it reads other experts from, so that the newest would not load alone: once
    a folder is found deleted, the parent comes back marked ``full`` (the save writes
    every expert), said once, and ``root`` joins ``rotating`` (the caller's set of roots
    seen rotating): every later save into it is marked ``full`` too."""
    if not isinstance(parent, Parent):
        return parent
    cache = {} if cache is None else cache
    seen = rotating if rotating is not None else set()
    was_rotating = root in seen
    named = dict(parent.ancestors)
    gone = {}
    for f in set(parent.view.values()) - {parent.name}:
        uid = folder_uid(root, f, cache)
        if uid is None:
            gone[f] = GONE
        elif named.get(f) and uid != named[f]:
            gone[f] = REWRITTEN
    if not gone:
        return dataclasses.replace(parent, full=True) if was_rotating else parent
    view = {k: f for k, f in parent.view.items() if f not in gone}
    log.warning("moepec: %s: %s; this save writes again the %d key(s) whose newest copies "
                "were there", root, "; ".join(f"{f} {why}" for f, why in sorted(gone.items())),
                len(parent.view) - len(view))
    deleted = GONE in gone.values()
    if deleted and not was_rotating:
        log.warning("moepec: %s: checkpoint folders this lineage reads experts from are "
                    "being deleted (a rotation: Lightning's ModelCheckpoint save_top_k, the "
                    "Trainer's save_total_limit, Accelerate's total_limit), so every save "
                    "into it is written full from now on, each loadable alone; keep the "
                    "folders (save_top_k=-1, no limit) to save K experts per layer", root)
    if deleted:
        seen.add(root)
    return dataclasses.replace(parent, view=view, full=deleted or was_rotating)


def older_copies(root: str, head: FlatManifest, manifests: dict[str, FlatManifest],
                  gone: Mapping[str, str], warnings: list[str]) -> FlatManifest:
    """``head`` with a view that reads each expert held by a ``gone`` folder from its
    newest older copy: the newest folder of head's lineage that is still the one the
    lineage names (its own ancestors a prefix of head's) and holds every key of the
    expert. Adds those folders to ``manifests``. Raises CheckpointError naming the
    folder when a key is not an expert's or no older copy exists."""
    lost: dict[Unit, list[str]] = {}
    for key, src in head.view.items():
        if src in gone:
            unit = head.experts.get(key)
            if unit is None:
                raise CheckpointError(f"{root}/{head.name} reads {key!r:.80} from {src}, "
                                      f"which {gone[src]}; restore that folder or load "
                                      f"another checkpoint")
            lost.setdefault(unit, []).append(key)
    view = dict(head.view)
    for folder, uid in reversed(head.ancestors):  # newest first
        if not lost:
            break
        if folder in gone:
            continue
        m = manifests.get(folder) or manifest_or_none(root, folder)
        # the save the lineage names, not another written later under its name
        if m is None or m.seq >= head.seq or (uid and m.uid != uid):
            continue
        for unit, keys in list(lost.items()):
            if all(k in m.items for k in keys):
                manifests[folder] = m
                src = head.view[keys[0]]
                view.update(dict.fromkeys(keys, folder))
                warnings.append(f"expert {unit[0]}/{unit[1]}: its newest copy's folder "
                                f"{src} {gone[src]}; read from {folder} (step {m.step})")
                log.warning("moepec: %s: %s", head.name, warnings[-1])
                del lost[unit]
    if lost:
        unit, keys = next(iter(lost.items()))
        src = head.view[keys[0]]
        raise CheckpointError(f"{root}/{head.name} reads older expert copies from {src}, "
                              f"which {gone[src]}, and its lineage holds no older copy of "
                              f"expert {unit[0]}/{unit[1]}; restore that folder or load an "
                              f"older checkpoint")
    return dataclasses.replace(head, view=view)


class Choice(NamedTuple):
    """A load's choice of copies, from one read of the manifests."""

    head: FlatManifest
    """The folder's manifest, its view (the folder each key is read from) as loaded."""
    manifests: dict[str, FlatManifest]
    """The manifests read: the folder's and those of the folders its view reads."""
    warnings: tuple[str, ...] = ()
    """A line per expert read from an older copy than the one its view names."""


def choose_copies(root: str, name: str) -> Choice:
    """Folder ``name``'s manifest and those of the folders its view reads, each read once.
    When one of those is gone or unreadable, each expert whose newest copy it held is
    read from its newest older copy in the lineage (the manifest's ancestors): the head
    is returned with that view, and a line per expert goes to its ``warnings``. Any rank,
    no collective; raises as :func:`moepec.store.flat.read_manifest` for the head."""
    head = read_manifest(root, name)
    manifests = {name: head}
    gone: dict[str, str] = {}
    uids = dict(head.ancestors)
    for n in head.needs():
        if not os.path.isdir(os.path.join(root, n)):
            gone[n] = GONE
            continue
        try:
            m = read_manifest(root, n)
        except MoepecError as exc:
            gone[n] = f"cannot be read ({exc})"
            continue
        if uids.get(n) and m.uid != uids[n]:
            gone[n] = REWRITTEN
        else:
            manifests[n] = m
    warnings: list[str] = []
    if gone:
        head = older_copies(root, head, manifests, gone, warnings)
    return Choice(head, manifests, tuple(warnings))


def agreed(choose: Callable[[], Choice], where: str) -> Choice:
    """``choose()`` on every rank, checked to be the same choice on all (collective on
    the default group when it has several ranks). A folder deleted or written again
    while the ranks read their manifests can make them pick different older copies:
    then, and when any rank's choice failed, every rank raises (never a load that mixes
    copies, never a rank left waiting in the framework's next collective)."""
    def digest_of_choice() -> tuple[Choice, str]:
        choice = choose()
        head, manifests = choice.head, choice.manifests
        return choice, hashlib.sha256(json.dumps(
            [sorted(head.view.items()), sorted((n, m.uid) for n, m in manifests.items())]
        ).encode()).hexdigest()

    (choice, digest), every = _on_every_rank(digest_of_choice, where, own_error=True)
    if len({d for d in every if d is not None} | {digest}) > 1:
        raise CheckpointError(f"{where}: the ranks read different copies of its experts (a "
                              f"folder it needs was deleted or written while they read "
                              f"it); load again")
    return choice


def settled(read: Callable[[], T], where: str) -> T:
    """``read()`` on every rank, then one collective on the default group (when it has
    several ranks): when any rank's read failed (a file deleted after the ranks agreed on
    their copies, a damaged item), every rank raises the same CheckpointError naming the
    ranks and why, so no rank goes on alone into the framework's next collective."""
    (out, _), _ = _on_every_rank(lambda: (read(), None), where, own_error=False)
    return out


def _on_every_rank(work: Callable[[], tuple[T, str | None]], where: str, *, own_error: bool
                   ) -> tuple[tuple[T, str | None], list[str | None]]:
    """``work()`` (a result and a digest) on this rank, then every rank's outcome (one
    all_gather of the digests, where there are several ranks). An exception on any rank
    (a MoepecError, an OSError, or a bug: chained, not lost) makes every rank raise: the
    failed rank its own error where ``own_error``, every other rank (and, without
    ``own_error``, the failed one too) one CheckpointError naming the failed ranks."""
    error: BaseException | None = None
    done: tuple = (None, None)
    try:
        done = work()
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised
        error = exc
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return done, [done[1]]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (None if error is None else str(error), done[1]))
    if error is not None and own_error:
        raise error
    failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(every) if e is not None]
    if failed:
        raise CheckpointError(f"{where} not loaded; {'; '.join(failed)}") from error
    return done, [d for _, d in every]


def item_in(root: str, name: str, manifests: Mapping[str, FlatManifest], folder: str,
            key: str) -> Item:
    """The item of ``key`` in ``folder``, where folder ``name``'s view says it is.
    Raises CorruptCheckpointError when that folder does not hold it."""
    m = manifests.get(folder)
    if m is None or key not in m.items:
        raise CorruptCheckpointError(f"{root}/{name}: {key!r:.160} is not in {folder}, "
                                     f"where its view says it is; run `moepec verify "
                                     f"{root}`")
    return m.items[key]
