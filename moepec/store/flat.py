"""Flat checkpoints: a flat dict of tensors per rank, no nn.Module, one folder each.

The entry point for frameworks that hand moepec a flat sharded state dict of their own
(Megatron-Core's ``dist_checkpointing``: ``moepec.integrations.megatron``) rather than a
model and an optimizer. Layout under a save directory ``ROOT`` (the framework's: one
folder per iteration)::

    ROOT/iter_0000010/moepec-r<rank>/      rank <rank>'s items: one DCP checkpoint of raw
                                           tensor bytes (moepec.store.dcp_raw)
    ROOT/iter_0000010/moepec-r<rank>.json  the items' locations and checksums (written by
                                           the rank's writer, read by the committer)
    ROOT/iter_0000010/moepec.json          the manifest (:class:`FlatManifest`): written
                                           last, atomically; its presence is the commit

The manifest's *view* maps every key of the state to the sibling folder that holds its
newest copy (the folder itself, or an older one for experts it did not save), so a
folder alone says which siblings it still needs. Trust rules as everywhere in moepec: the
manifest is JSON validated before use, item locations come from it, every path read is
confined to ``ROOT`` (``store.reader.confined``), nothing is unpickled.

Which code runs where: :func:`write_rank` on any process (a forked async writer
included), no collective; everything else reads or writes small files, no collective.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from moepec.errors import CheckpointError, CorruptCheckpointError, ManifestError
from moepec.keys import MANIFEST_NAME
from moepec.store.atomic import write_atomic
from moepec.store.checksum import checksum_matches, tensor_checksum
from moepec.store.dcp_planner import StartedIndex
from moepec.store.dcp_raw import RawFileSystemWriter
from moepec.store.items import Encoding, Item, parse_json
from moepec.store.manifest import FORMAT, MAX_ANCESTORS, check_format
from moepec.store.meta import check_schedule
from moepec.store.reader import confined, read_items, read_small

log = logging.getLogger(__name__)

KIND = "flat"
"""A flat folder's manifest is of the one manifest format (``moepec.store.manifest.FORMAT``,
versioned once for both front ends) with ``"kind": "flat"``: its own fields (a view per
key, the experts by (layer, expert)) where the manager's manifest has its meta."""
LEGACY_FORMAT = "moepec-flat/2"
"""What flat folders were committed with before the two manifest formats became one:
still read (the fields are the same), never written."""
FOLDER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,127}\Z")
"""A checkpoint folder is a plain name inside the save directory (``=`` for Lightning's
``epoch=0-step=2.ckpt``)."""
MAX_KEY = 1024
_UID = re.compile(r"[0-9a-f]{0,32}")


def rank_dir(rank: int) -> str:
    """The subfolder holding rank ``rank``'s items."""
    return f"moepec-r{rank}"


def record_name(rank: int) -> str:
    return f"moepec-r{rank}.json"


@dataclass(frozen=True, slots=True)
class FlatManifest:
    """A committed flat checkpoint (the typed ``moepec.json`` of one folder)."""

    name: str
    """Its folder name inside the save directory."""
    seq: int
    """Orders the folders of one save directory (parent's + 1)."""
    step: int
    """The training iteration it holds (from the folder name where it has one)."""
    parent: str | None
    """The folder whose view this one continued."""
    items: Mapping[str, Item]
    """What this folder wrote (all ranks; ``Item.rank`` names the rank subfolder)."""
    view: Mapping[str, str]
    """Every key of the state -> the folder holding its newest copy."""
    experts: Mapping[str, tuple[str, int]]
    """Expert keys of the view -> (layer, expert)."""
    experts_saved: list[tuple[str, int]]
    """The (layer, expert) units whose keys this folder wrote."""
    k_persist: int
    world_size: int
    layers: Sequence[str] = ()
    """The MoE layers in schedule order (layer L of ``"L/E"`` and of ``schedule``)."""
    schedule: Mapping[str, Any] | None = None
    """The PEC schedule after this save (``ExpertSchedule.meta_fields``: selectors, K,
    index, routing counts, the PLT ledger); None when the state has no experts."""
    uid: str = ""
    """This save's identity (random, one per save): a folder written again under the
    same name is another save. Empty in folders committed before it was recorded."""
    ancestors: Sequence[tuple[str, str]] = ()
    """Its lineage, oldest first, at most MAX_ANCESTORS (the parent last), as (folder,
    uid): which saves its view reads, and where a load looks for an older copy of an
    expert whose newest copy's folder is gone."""
    committed_at: float = field(default_factory=time.time)
    format: str = FORMAT
    kind: str = KIND

    def needs(self) -> list[str]:
        """The other folders this one's view reads from, sorted by name (their sequence
        numbers are in their own manifests)."""
        return sorted(set(self.view.values()) - {self.name})

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "kind": self.kind, "name": self.name, "seq": self.seq,
                "step": self.step, "parent": self.parent,
                "items": {k: v.to_json() for k, v in self.items.items()},
                "view": dict(self.view),
                "experts": {k: [lay, e] for k, (lay, e) in self.experts.items()},
                "experts_saved": [[lay, e] for lay, e in self.experts_saved],
                "k_persist": self.k_persist, "world_size": self.world_size,
                "layers": list(self.layers), "schedule": self.schedule,
                "uid": self.uid, "ancestors": [list(a) for a in self.ancestors],
                "committed_at": self.committed_at}

    @classmethod
    def from_json(cls, data: Any, where: str) -> FlatManifest:
        """Parse and validate; raises ManifestError naming ``where`` for anything off."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: the manifest is not a JSON object")
        if data.get("format") != LEGACY_FORMAT:
            check_format(data.get("format"), where)
            if data.get("kind") != KIND:
                raise ManifestError(f"{where}: a CheckpointManager's manifest, not a flat "
                                    f"folder's (kind {data.get('kind')!r:.20})")
        for name, kind in (("name", str), ("seq", int), ("step", int), ("items", dict),
                           ("view", dict), ("experts", dict), ("experts_saved", list),
                           ("k_persist", int), ("world_size", int)):
            if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool):
                raise ManifestError(f"{where}: manifest field {name!r} is missing or not "
                                    f"a {kind.__name__}")
        name, parent = data["name"], data.get("parent")
        ancestors, uid = data.get("ancestors", []), data.get("uid", "")
        if not isinstance(ancestors, list) or len(ancestors) > MAX_ANCESTORS or not all(
                isinstance(a, list) and len(a) == 2 and isinstance(a[1], str)
                and _UID.fullmatch(a[1]) for a in ancestors) \
                or not isinstance(uid, str) or not _UID.fullmatch(uid):
            raise ManifestError(f"{where}: manifest field 'uid' or 'ancestors' (at most "
                                f"{MAX_ANCESTORS} [folder, uid] pairs) is malformed")
        for folder in [name, *([parent] if parent is not None else []),
                       *(a[0] for a in ancestors), *data["view"].values()]:
            if not isinstance(folder, str) or not FOLDER_RE.fullmatch(folder):
                raise ManifestError(f"{where}: {folder!r:.80} is not a plain folder name")
        items = {_key(k, where): Item.from_json(v, where) for k, v in data["items"].items()}
        if any(v.rank is None or v.file is None for v in items.values()):
            raise ManifestError(f"{where}: an item has no rank or file")
        view = {_key(k, where): v for k, v in data["view"].items()}
        if any(view.get(k) != name for k in items):
            raise ManifestError(f"{where}: an item of this folder is not in its view")
        return cls(name=name, seq=data["seq"], step=data["step"], parent=parent,
                   items=items, view=view,
                   experts={_key(k, where): _unit(v, where)
                            for k, v in data["experts"].items()},
                   experts_saved=[_unit(v, where) for v in data["experts_saved"]],
                   k_persist=data["k_persist"], world_size=data["world_size"],
                   layers=_layers(data.get("layers"), where),
                   schedule=_schedule(data.get("schedule"), data.get("layers"), where),
                   uid=uid, ancestors=[(a[0], a[1]) for a in ancestors],
                   committed_at=_committed_at(data.get("committed_at", 0.0), where))


def _committed_at(value: Any, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ManifestError(f"{where}: manifest field 'committed_at' is not a time "
                            f"({value!r:.40})")
    return float(value)


def _key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
        raise ManifestError(f"{where}: a key is not a string of 1..{MAX_KEY} characters")
    return key


def _layers(v: Any, where: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and 0 < len(x) <= MAX_KEY
                                          for x in v) or len(set(v)) != len(v):
        raise ManifestError(f"{where}: manifest field 'layers' is not a list of distinct "
                            f"layer names")
    return v


def _schedule(v: Any, layers: list[str], where: str) -> dict[str, Any] | None:
    """The schedule's fields (``ExpertSchedule.meta_fields``), checked by the one check
    of both front ends' manifests (``moepec.store.meta.check_schedule``) against the
    experts per layer its counts give."""
    if v is None:
        return None
    ok = isinstance(v, dict) and all(isinstance(v.get(k), kind) for k, kind in (
        ("index", int), ("k_persist", int), ("k_snapshot", int), ("counts", list),
        ("ledger", dict), ("selectors", dict), ("k_history", list)))
    counts = v.get("counts") if ok else None
    if not ok or len(counts) != len(layers) or not all(
            isinstance(row, list) and row for row in counts):
        raise ManifestError(f"{where}: manifest field 'schedule' is malformed")
    check_schedule(v, [len(row) for row in counts], where)
    return v


def _unit(v: Any, where: str) -> tuple[str, int]:
    if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
            and isinstance(v[1], int) and not isinstance(v[1], bool) and v[1] >= 0):
        raise ManifestError(f"{where}: an expert entry is not [layer, expert]")
    return v[0], v[1]


def split_folder(checkpoint_dir: str | os.PathLike) -> tuple[str, str]:
    """(save directory, folder name) of a checkpoint folder path; CheckpointError when the
    name is not a plain folder name."""
    path = os.path.abspath(os.fspath(checkpoint_dir)).rstrip(os.sep)
    root, name = os.path.split(path)
    if not FOLDER_RE.match(name):
        raise CheckpointError(f"{checkpoint_dir}: the checkpoint folder name must be a plain "
                              f"name (letters, digits, '_', '.', '-', '=')")
    return root, name


# -- writing ---------------------------------------------------------------------------
def write_rank(folder: str, tensors: Mapping[str, torch.Tensor], rank: int) -> None:
    """Write rank ``rank``'s tensors (flat key -> CPU tensor) into checkpoint folder
    ``folder`` and then their record (locations, checksums) beside them. Any process, no
    collective (a one-process DCP checkpoint in the rank's own subfolder); the record is
    written last and atomically, so a killed writer leaves no record. Raises what the
    disk raised."""
    sub = os.path.join(folder, rank_dir(rank))
    os.makedirs(sub, exist_ok=True)
    writer = RawFileSystemWriter(sub, sync_files=True, overwrite=True)
    try:  # the data file written at once, DCP's .metadata from its items (no plans)
        (entries,) = StartedIndex(chunks=False).save(writer, tensors, None, False)
    except BaseException:
        writer.wait_synced(raise_error=False)  # nothing reads ``tensors`` after
        raise
    writer.wait_synced()
    items = {}
    for key, shape, dtype, offset, length in entries:
        items[key] = Item(
            shape=list(shape), dtype=str(dtype).removeprefix("torch."), nbytes=length,
            checksum=tensor_checksum(tensors[key]), rank=rank, file=f"__0_0{DEFAULT_SUFFIX}",
            offset=offset, length=length, encoding=Encoding.RAW)
    data = json.dumps({k: v.to_json() for k, v in items.items()}).encode()
    atomic_write(os.path.join(folder, record_name(rank)), data, overwrite=True)


def read_records(folder: str, world_size: int) -> dict[str, Item]:
    """Every rank's items of checkpoint ``folder``, from the records :func:`write_rank`
    left. Raises CheckpointError naming the ranks whose writer did not finish."""
    missing = [r for r in range(world_size)
               if not os.path.exists(os.path.join(folder, record_name(r)))]
    if missing:
        raise CheckpointError(f"{folder}: rank(s) {missing} did not finish writing; the "
                              f"checkpoint is not committed")
    out: dict[str, Item] = {}
    for r in range(world_size):
        where = os.path.join(folder, record_name(r))
        try:
            with open(where, "rb") as f:
                raw = json.load(f)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where} cannot be read ({exc})") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where} is not a JSON object")
        for k, v in raw.items():
            item = Item.from_json(v, where)
            if item.rank != r or k in out:
                raise CheckpointError(f"{where}: item {k!r:.80} is not rank {r}'s alone")
            out[_key(k, where)] = item
    return out


def atomic_write(path: str, data: bytes, overwrite: bool = False) -> None:
    """Write a small file whole (``moepec.store.atomic.write_atomic``). Without
    ``overwrite`` an existing file is never replaced (CheckpointError)."""
    try:
        write_atomic(path, data, exclusive=not overwrite)
    except FileExistsError:
        raise CheckpointError(f"{path} exists already; a commit never overwrites a "
                              f"manifest") from None


def commit(root: str, manifest: FlatManifest) -> None:
    """Commit folder ``manifest.name`` of ``root`` by writing its manifest atomically
    (never over an existing one). One process (the coordinator) calls it, after every
    rank's record exists."""
    data = json.dumps(manifest.to_json(), sort_keys=True, separators=(",", ":")).encode()
    atomic_write(os.path.join(root, manifest.name, MANIFEST_NAME), data)


# -- reading ---------------------------------------------------------------------------
@dataclass(slots=True)
class FlatRoot:
    """What a save directory holds, as read by :func:`scan`."""

    manifests: dict[str, FlatManifest]
    """Committed folders whose manifest validates, oldest sequence first."""
    damaged: dict[str, str]
    """Folders whose manifest cannot be used, with the reason."""
    uncommitted: list[str]
    """Folders moepec wrote into without committing (a killed or failed save)."""

    @property
    def head(self) -> FlatManifest | None:
        """The committed folder with the highest sequence number."""
        return max(self.manifests.values(), key=lambda m: m.seq, default=None)


def read_manifest(root: str, name: str) -> FlatManifest:
    """The manifest of folder ``name`` of ``root``. Raises CheckpointError when it has
    none (not committed), ManifestError when it cannot be used."""
    path = confined(root, name, MANIFEST_NAME, local=True)
    try:
        data = parse_json(read_small(path))
    except FileNotFoundError:
        raise CheckpointError(f"{root}/{name} has no moepec manifest (not committed)") from None
    except (OSError, ValueError, CorruptCheckpointError) as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc}): the folder is damaged; run "
                            f"`moepec verify {root}`") from exc
    manifest = FlatManifest.from_json(data, f"{root}/{name}")
    if manifest.name != name:
        raise ManifestError(f"{root}/{name}: the manifest names folder {manifest.name!r} "
                            f"(a copied or renamed folder)")
    return manifest


def is_flat_root(root: str) -> bool:
    """Whether ``root`` holds at least one folder written by :func:`write_rank`."""
    return bool(_moepec_folders(root))


def _moepec_folders(root: str) -> list[str]:
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    # Rank 0's subfolder (made first) or record marks a flat folder; a moepec.json alone
    # does not (every moepec checkpoint folder has one).
    return [e.name for e in entries if e.is_dir(follow_symlinks=False)
            and FOLDER_RE.match(e.name)
            and (os.path.isdir(os.path.join(e.path, rank_dir(0)))
                 or os.path.exists(os.path.join(e.path, record_name(0))))]


def scan(root: str, read: Mapping[str, FlatManifest] | None = None) -> FlatRoot:
    """Read and validate every flat manifest under ``root``; never raises for a damaged
    one (listed in ``damaged``). Folders moepec did not write are ignored. ``read``:
    manifests of ``root`` this caller read a moment ago (a load's), not read again."""
    out = FlatRoot(manifests={}, damaged={}, uncommitted=[])
    for name in _moepec_folders(root):
        try:
            out.manifests[name] = (read or {}).get(name) or read_manifest(root, name)
        except ManifestError as exc:
            out.damaged[name] = str(exc)
        except CheckpointError:
            out.uncommitted.append(name)
    out.manifests = dict(sorted(out.manifests.items(), key=lambda kv: kv[1].seq))
    return out


def read_keys(root: str, manifests: Mapping[str, FlatManifest],
              sources: Mapping[str, str], targets: Mapping[str, torch.Tensor]
              ) -> list[str]:
    """Fill ``targets`` (key -> preallocated CPU tensor) from the folder ``sources`` names
    for each key, at the locations its manifest records; returns the keys whose bytes
    are missing or fail their checksum (their targets hold garbage). Reads only."""
    bad: list[str] = []
    by_place: dict[tuple[str, int], list[str]] = {}
    for key in targets:
        item = manifests[sources[key]].items.get(key)
        if item is None:
            bad.append(key)
            continue
        by_place.setdefault((sources[key], item.rank), []).append(key)
    for (name, rank), keys in by_place.items():
        items = manifests[name].items
        folder = confined(root, name, local=True)
        try:  # one open per data file; a failure is then isolated key by key
            read_items(None, (folder, rank_dir(rank)), {k: targets[k] for k in keys},
                       items, local=True)
            unread = []
        except (OSError, CheckpointError):
            unread = keys
        for key in unread:
            try:
                read_items(None, (folder, rank_dir(rank)), {key: targets[key]}, items,
                           local=True)
            except (OSError, CheckpointError) as exc:
                log.warning("%s/%s: %s cannot be read (%s)", root, name, key, exc)
                bad.append(key)
        bad += [k for k in keys if k not in bad
                and not checksum_matches(targets[k], items[k].checksum)]
    return bad


def empty_like_item(item: Item) -> torch.Tensor:
    """A CPU tensor of ``item``'s shape and dtype to read it into."""
    dtype = getattr(torch, item.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"dtype {item.dtype!r} is not a torch dtype")
    try:  # pages are touched only as bytes are read, and the read is bounded by the file
        return torch.empty(item.shape, dtype=dtype)
    except RuntimeError as exc:  # more than this host can address: a forged shape
        raise CorruptCheckpointError(f"an item of shape {item.shape} ({item.nbytes} bytes) "
                                     f"cannot be allocated; the manifest is damaged") from exc


def folders_needed(manifests: Mapping[str, FlatManifest],
                   heads: Iterable[str]) -> dict[str, list[str]]:
    """For each head folder, the other folders its view reads from."""
    return {h: manifests[h].needs() for h in heads if h in manifests}
