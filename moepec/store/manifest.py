"""Manifests: what a committed checkpoint holds and its view.

A :class:`Manifest` is the typed form of the ``moepec.json`` file that commits a
checkpoint (DESIGN.md, commit rule). It holds the manager's bookkeeping at the time of
the snapshot (:class:`CheckpointMeta`: step, counts, PLT ledger, selectors, K), every
item this checkpoint wrote (:class:`Item`: the expert items in the manifest, the
non-expert ones, which every checkpoint repeats, in a file of their own), and the *view*: for every key of the full
training state, the name of the checkpoint that holds its newest copy along this
checkpoint's lineage (``parent`` links). Recovery from a checkpoint therefore needs only
its own manifest to know where every key lives, and never trusts a directory listing.

Pure: JSON in, objects out; no I/O (reading and writing the file is
:mod:`moepec.store.storage`'s job). ``Manifest.from_json`` is the one place that checks
the format, so every reader gets the check. Its parts live beside it: the items in
:mod:`moepec.store.items`, the bookkeeping in :mod:`moepec.store.meta`, the functions
over manifests (lineage, retention) in :mod:`moepec.store.lineage`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from moepec.errors import ManifestError, ManifestFormatError, MoepecError
from moepec.keys import CHUNK_MARK, EXPERT_PREFIX, parse_checkpoint_name, split_chunk
from moepec.store.items import (
    Item,
    Items,
    check_keys,
    entries_total,
    need_field,
    parse_json,
    plain_file,
    split_items,
)
from moepec.store.meta import META_FIELDS, CheckpointMeta, meta_from_json

FORMAT = "moepec/6"
"""The manifest format written: item locations (file, offset, length, encoding), XXH3
checksums, objects as tagged JSON (no pickle), chunk keys of sharded tensors
(``<key>#<offsets>+<shape>:<global>``, moepec.keys), the view in a file of its own
(:class:`FileRef`, :class:`StoredView`), and the items split: the expert items in the
manifest, the non-expert items in a file of their own (``items_file``), each side file
read only when it is used (a restore reads the non-expert items of its base alone).
Formats other than :data:`READABLE` are refused in one line (:func:`check_format`): a
lower one was written by a pre-release moepec (damaged for restore, inspect and verify),
a higher one by a newer moepec (nothing acts as if it were absent)."""
READABLE = (FORMAT, "moepec/5")
"""The formats read: this one and moepec/5 (every item in the manifest), which a
moepec/6 reader takes as it is."""
KIND = "manager"
"""The ``kind`` of a CheckpointManager's manifest (absent in those written before flat
folders joined this format); a flat folder's is ``"flat"`` (``moepec.store.flat``)."""
_FORMAT_RE = re.compile(r"^moepec/(\d{1,6})$")
MAX_VIEW_BYTES = 1 << 30
"""A side file (a view, the non-expert items) may claim at most this many bytes (more is
taken as damage)."""
MAX_ANCESTORS = 512
"""Ancestors a manifest lists (its lineage); older ones are forgotten."""


def check_format(fmt: Any, where: str) -> None:
    """Raise unless ``fmt`` is one of :data:`READABLE`: ManifestError (damaged) for a pre-release
    format, ManifestFormatError for a newer one."""
    if fmt in READABLE:
        return
    m = _FORMAT_RE.match(fmt) if isinstance(fmt, str) else None
    if m is not None and int(m[1]) > int(FORMAT.split("/")[1]):
        raise ManifestFormatError(
            f"{where} has manifest format {fmt!r}, which this moepec cannot read (it reads "
            f"{FORMAT}); it was written by a newer moepec: upgrade moepec")
    raise ManifestError(f"{where}: written by a pre-release moepec (format {fmt!r:.40}); "
                        f"not readable by this version")


@dataclass(frozen=True, slots=True)
class Manifest:
    """A committed checkpoint (the typed ``moepec.json``)."""

    meta: CheckpointMeta
    name: str
    """The checkpoint's folder name, ``ckpt-<seq>-step<step>``."""
    parent: str | None
    """The checkpoint this one continues (the committed head when it was taken)."""
    ancestors: list[str]
    """Its lineage, oldest first, at most MAX_ANCESTORS (the parent last)."""
    keys: Mapping[str, Item]
    """Every item this checkpoint wrote (all ranks); :class:`Items` when parsed (its
    non-expert entries read from their file on first use: ManifestError when that file is
    missing or damaged)."""
    view: Mapping[str, str]
    """Every key of the full state -> the checkpoint holding its newest copy (a
    :class:`StoredView` when read: loaded on first use, ManifestError when its file is
    missing or damaged)."""
    bytes_per_rank: list[int]
    bytes: int
    committed_at: float
    serialization: str
    format: str = FORMAT
    """The format it was read in (written: always :data:`FORMAT`)."""
    items_ref: FileRef | None = None
    """The file of its non-expert items, as read (None: not written yet, or moepec/5)."""

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def seq(self) -> int:
        return self.meta.seq

    def to_json(self, view_ref: FileRef | None = None,
                items_ref: FileRef | None = None) -> dict[str, Any]:
        """The flat JSON object stored as ``moepec.json`` (format :data:`FORMAT`): the
        expert items inline, with the references to the view's file (``view_ref``, or the
        one it was read with) and to the non-expert items' file (``items_ref``: written
        first, :func:`encode_items`)."""
        out = {name: getattr(self.meta, name) for name in META_FIELDS}
        out.update(format=FORMAT, kind=KIND, serialization=self.serialization,
                   name=self.name,
                   parent=self.parent, ancestors=self.ancestors,
                   keys={k: v.to_json() for k, v in self.keys.items()
                         if k.startswith(EXPERT_PREFIX)},
                   bytes_per_rank=self.bytes_per_rank, bytes=self.bytes,
                   committed_at=self.committed_at)
        if view_ref is None and isinstance(self.view, StoredView):
            view_ref = self.view.ref
        items_ref = items_ref or self.items_ref
        if view_ref is None or items_ref is None:
            raise ValueError("a manifest is written with its side files (encode_view, "
                             "encode_items)")
        out["view_file"], out["items_file"] = view_ref.to_json(), items_ref.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any, where: str,
                  read_side: Callable[[FileRef], bytes] | None = None) -> Manifest:
        """Parse a manifest; ``where`` names it in errors. ``read_side`` reads the bytes of
        one of its side files (the view, the non-expert items: each checked when first
        used). Raises ManifestFormatError for a newer format, ManifestError for anything
        else wrong (a pre-release format included)."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: the manifest is not a JSON object")
        check_format(data.get("format"), where)
        if data.get("kind", KIND) != KIND:
            raise ManifestError(f"{where}: a flat folder's manifest (a framework door's "
                                f"save), not a CheckpointManager's: give moepec's tools the "
                                f"folder that holds it")
        meta = meta_from_json(data, where)
        for name, kind in (("name", str), ("keys", dict), ("view_file", dict),
                           ("bytes_per_rank", list), ("bytes", int)):
            need_field(data, name, kind, where)
        ancestors = data.get("ancestors", [])
        if read_side is None:
            raise ManifestError(f"{where}: its view is in a file of its own, and no reader "
                                f"was given for it")
        view = StoredView(FileRef.from_json(data["view_file"], where, "view_file"),
                          read_side, data["name"], where)
        _check_names(data["name"], ancestors, {}, data.get("parent"), where)
        keys, items_ref = _items(data, where, read_side)
        return cls(meta=meta, name=data["name"], parent=data.get("parent"),
                   ancestors=ancestors, keys=keys, view=view,
                   bytes_per_rank=data["bytes_per_rank"], bytes=data["bytes"],
                   committed_at=data.get("committed_at", 0.0),
                   serialization=data.get("serialization", "torch_save"),
                   format=data["format"], items_ref=items_ref)


def _items(data: dict[str, Any], where: str, read_side: Callable[[FileRef], bytes]
           ) -> tuple[Items, FileRef | None]:
    """A manifest's items: moepec/5 lists them all; moepec/6 lists the expert items and
    names the file of the others, read and checked (keys, entries, the byte total) on
    first use."""
    total = data["bytes"]
    if data["format"] != FORMAT:  # moepec/5: every item inline
        if entries_total(data["keys"], where) != total:
            raise ManifestError(f"{where}: the items' sizes do not add up to 'bytes'")
        _check_chunks(data["keys"], {}, where)
        experts, shared = split_items(data["keys"])
        return Items(experts, shared, where), None
    experts = data["keys"]
    expert_bytes = entries_total(experts, where)
    if not all(k.startswith(EXPERT_PREFIX) for k in experts) or expert_bytes > total:
        raise ManifestError(f"{where}: manifest field 'keys' holds a non-expert item, or "
                            f"more bytes than 'bytes'")
    _check_chunks(experts, {}, where)
    need_field(data, "items_file", dict, where)
    ref = FileRef.from_json(data["items_file"], where, "items_file")

    def shared() -> dict[str, Any]:
        at = f"{where} items {ref.file}"
        raw = read_side_file(read_side, ref, at)
        if entries_total(raw, at) != total - expert_bytes or any(
                k.startswith(EXPERT_PREFIX) for k in raw):
            raise ManifestError(f"{at}: holds an expert item, or the items' sizes do not "
                                f"add up to 'bytes'; the checkpoint is damaged")
        _check_chunks(raw, {}, at)
        return raw

    return Items(experts, shared, where), ref


@dataclass(frozen=True, slots=True)
class FileRef:
    """Where a side file of a manifest is stored (its view, its non-expert items): a file
    of the checkpoint folder, its length and XXH3 checksum (the manifest commits them: the
    file is written first)."""

    file: str
    length: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "length": self.length, "checksum": self.checksum}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str, field: str = "view_file") -> FileRef:
        file, length, checksum = d.get("file"), d.get("length"), d.get("checksum")
        if not (type(file) is str and plain_file(file) and type(length) is int
                and 0 <= length <= MAX_VIEW_BYTES and type(checksum) is str
                and checksum.startswith("xxh3:")):
            raise ManifestError(f"{where}: manifest field {field!r} is malformed")
        return cls(file=file, length=length, checksum=checksum)


ViewRef = FileRef
"""The view's file reference (the name it had before the items got a side file too)."""


def _encode(obj: Mapping[str, Any], prefix: str) -> tuple[bytes, FileRef]:
    """A side file's bytes (compact JSON) and its reference, whose file name holds the
    checksum: writing it again never changes a file another manifest names."""
    data = json.dumps(dict(obj), sort_keys=True, separators=(",", ":")).encode()
    digest = xxhash.xxh3_64_hexdigest(data)
    return data, FileRef(file=f"{prefix}-{digest}.json", length=len(data),
                         checksum=f"xxh3:{digest}")


def encode_view(view: Mapping[str, str]) -> tuple[bytes, FileRef]:
    """A view as stored in its file, and its reference."""
    return _encode(view, "view")


def encode_items(items: Mapping[str, Item]) -> tuple[bytes, FileRef]:
    """The non-expert items of a checkpoint as stored in their file, and its reference."""
    return _encode({k: v.to_json() for k, v in items.items()
                    if not k.startswith(EXPERT_PREFIX)}, "items")


def read_side_file(read: Callable[[FileRef], bytes], ref: FileRef, where: str
                   ) -> dict[str, Any]:
    """A side file's JSON object, read through ``read`` and checked against the length and
    checksum ``ref`` records. Raises ManifestError (missing, damaged, not an object)."""
    try:
        data = read(ref)
    except (OSError, MoepecError) as exc:
        raise ManifestError(f"{where} cannot be read ({type(exc).__name__}: {exc}); the "
                            f"checkpoint is damaged") from None
    if len(data) != ref.length or \
            f"xxh3:{xxhash.xxh3_64_hexdigest(data)}" != ref.checksum:
        raise ManifestError(f"{where} does not match the length and checksum the manifest "
                            f"records; the checkpoint is damaged")
    try:
        obj = parse_json(data)
    except ValueError:  # (UnicodeDecodeError too)
        raise ManifestError(f"{where} is not valid JSON") from None
    if type(obj) is not dict:
        raise ManifestError(f"{where} is not a JSON object")
    return obj


class StoredView(Mapping[str, str]):
    """A manifest's view: read, checked against its length and checksum, parsed
    and validated on first use (ManifestError when the file is missing or damaged; the
    error is kept, so every later use raises it too)."""

    __slots__ = ("ref", "_read", "_owner", "_where", "_view", "_error")

    def __init__(self, ref: FileRef, read: Callable[[FileRef], bytes], owner: str,
                 where: str) -> None:
        self.ref, self._read, self._owner, self._where = ref, read, owner, where
        self._view: dict[str, str] | None = None
        self._error: ManifestError | None = None

    def load(self) -> dict[str, str]:
        """The view (read once). Raises ManifestError."""
        if self._view is None:
            if self._error is None:
                try:
                    self._view = self._parse()
                except ManifestError as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error
        return self._view

    def _parse(self) -> dict[str, str]:
        where = f"{self._where} view {self.ref.file}"
        view = read_side_file(self._read, self.ref, where)
        _check_names(self._owner, [], view, None, where)
        _check_chunks({}, view, where)
        return view

    def __getitem__(self, key: str) -> str:
        return self.load()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.load()

    def __iter__(self) -> Iterator[str]:
        return iter(self.load())

    def __len__(self) -> int:
        return len(self.load())

    def keys(self):  # noqa: ANN201 - the dict's own views: set operations at C speed
        return self.load().keys()

    def items(self):  # noqa: ANN201
        return self.load().items()

    def values(self):  # noqa: ANN201
        return self.load().values()


def _check_chunks(raw: Mapping[str, Any], view: Mapping[str, str], where: str) -> None:
    """Chunk keys are well formed, and an item's shape is its chunk's (``raw``: entries)."""
    if CHUNK_MARK not in "".join(raw) and CHUNK_MARK not in "".join(view):
        return  # the common case, at C speed
    for key in [k for k in raw if CHUNK_MARK in k] + [k for k in view if CHUNK_MARK in k]:
        try:
            _, chunk = split_chunk(key)
        except ValueError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        item = Item.from_json(raw[key], f"{where} item {key}") if key in raw else None
        if item is not None and (chunk is None or list(chunk[1]) != item.shape):
            raise ManifestError(f"{where}: {key[:80]!r} is a chunk of shape "
                                f"{list(chunk[1]) if chunk else None}, its item {item.shape}")


def _check_names(name: Any, ancestors: Any, view: Mapping[str, Any], parent: Any,
                 where: str) -> None:
    """The checkpoint's own name, its parent, ancestors and view sources follow the
    checkpoint grammar, and none is newer than the checkpoint itself."""
    own = parse_checkpoint_name(name) if isinstance(name, str) else None
    if own is None:
        raise ManifestError(f"{where}: 'name' {name!r:.80} is not a checkpoint name")
    if not isinstance(ancestors, list):
        raise ManifestError(f"{where}: manifest field 'ancestors' is not a list")
    others = list(ancestors) + list(view.values()) + ([] if parent is None else [parent])
    if not set(map(type, others)) <= {str}:
        raise ManifestError(f"{where}: its lineage or view holds a name that is not a string")
    for other in set(others):  # a view names few distinct checkpoints: each checked once
        parsed = parse_checkpoint_name(other)
        if parsed is None or parsed[0] > own[0]:
            raise ManifestError(f"{where}: {other!r:.80} in its lineage or view is not an "
                                f"older checkpoint name")
    check_keys(view, where)
