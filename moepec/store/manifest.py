"""Manifests: what a committed checkpoint holds, its lineage, its view, and retention.

A :class:`Manifest` is the typed form of the ``moepec.json`` file that commits a
checkpoint (DESIGN.md, commit rule). It holds the manager's bookkeeping at the time of
the snapshot (:class:`CheckpointMeta`: step, counts, PLT ledger, selectors, K), every
item this checkpoint wrote (:class:`Item`), and the *view*: for every key of the full
training state, the name of the checkpoint that holds its newest copy along this
checkpoint's lineage (``parent`` links). Recovery from a checkpoint therefore needs only
its own manifest to know where every key lives, and never trusts a directory listing.

Pure: JSON in, objects out, and functions over them; no I/O (reading and writing the
file is :mod:`moepec.store.storage`'s job). ``Manifest.from_json`` is the one place
that checks the format, so every reader gets the check.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import xxhash

from moepec.errors import ManifestError, ManifestFormatError, MoepecError
from moepec.keys import (
    CHUNK_MARK,
    name_order,
    parse_checkpoint_name,
    parse_key,
    seq_of,
    split_chunk,
)
from moepec.policy.plt import PLTLedger
from moepec.policy.selection import Selector

FORMAT = "moepec/5"
"""The one manifest format: item locations (file, offset, length, encoding) in the
manifest, XXH3 checksums, objects as tagged JSON (no pickle), chunk keys of sharded tensors
(``<key>#<offsets>+<shape>:<global>``, moepec.keys), and the view in a file of its own
(:class:`ViewRef`, :class:`StoredView`), read only when it is used. Any other format is
refused in one line (:func:`check_format`): a lower one was written by a pre-release
moepec (damaged for restore, inspect and verify), a higher one by a newer moepec (nothing
acts as if it were absent)."""
_FORMAT_RE = re.compile(r"^moepec/(\d{1,6})$")
MAX_VIEW_BYTES = 1 << 30
"""A view file may claim at most this many bytes (more is taken as damage)."""
MAX_ANCESTORS = 512
"""Ancestors a manifest lists (its lineage); older ones are forgotten."""


class Serialization(StrEnum):
    """How DCP items are stored on disk (a manifest records which)."""

    RAW = "raw"
    """Raw tensor bytes (:mod:`moepec.store.dcp_raw`); read by moepec's DCP readers."""
    TORCH_SAVE = "torch_save"
    """Stock DCP (torch.save-framed items): any ``dcp.load`` reads it."""


DTYPE_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
    "uint32": 4, "uint64": 8, "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "complex64": 8, "complex128": 16, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
"""The dtypes a checkpoint may hold (the allow-list), and their item sizes in bytes."""
MAX_DIMS = 8
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
"""A data file is a plain name inside its checkpoint folder: no separator, no '..'."""


class Encoding(StrEnum):
    """How one item's bytes are framed in its data file."""

    RAW = "raw"
    """The tensor's contiguous bytes, native byte order."""
    TORCH_SAVE = "torch_save"
    """A torch.save record (read with ``torch.load(weights_only=True)``)."""


@dataclass(frozen=True, slots=True)
class Item:
    """One stored tensor of a checkpoint (or of a RAM snapshot: no checksum, rank or
    location)."""

    shape: list[int]
    dtype: str
    """torch dtype name without the ``torch.`` prefix (one of DTYPE_SIZES)."""
    nbytes: int = 0
    checksum: str | None = None
    """``xxh3:<hex>``; None for RAM copies."""
    rank: int | None = None
    """The rank that wrote it."""
    file: str | None = None
    """Data file inside the checkpoint folder; None for RAM copies."""
    offset: int = 0
    length: int = 0
    """Where the item's bytes are in ``file``."""
    encoding: str = Encoding.RAW

    def to_json(self) -> dict[str, Any]:
        out = {"shape": self.shape, "dtype": self.dtype, "nbytes": self.nbytes,
               "checksum": self.checksum, "rank": self.rank}
        if self.file is not None:
            out.update(file=self.file, offset=self.offset, length=self.length,
                       encoding=str(self.encoding))
        return out

    @classmethod
    def from_json(cls, d: Any, where: str) -> Item:
        """Parse and validate one entry (types, the dtype allow-list, sizes, location)."""
        # Runs for every item of every manifest a restore reads: plain type() checks (which
        # also keep bools out of the counts) rather than helpers.
        if type(d) is not dict:
            raise ManifestError(f"{where}: an item entry is not an object")
        shape, dtype, nbytes = d.get("shape"), d.get("dtype"), d.get("nbytes", 0)
        if type(shape) is not list or len(shape) > MAX_DIMS or not all(
                type(n) is int and n >= 0 for n in shape):
            raise ManifestError(f"{where}: an item has an invalid shape {shape!r:.80}")
        if type(dtype) is not str or dtype not in DTYPE_SIZES:
            raise ManifestError(f"{where}: an item has dtype {dtype!r:.40}, not one moepec "
                                f"stores")
        if type(nbytes) is not int or nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise ManifestError(f"{where}: an item's nbytes {nbytes!r:.40} does not match "
                                f"its shape and dtype")
        checksum, rank = d.get("checksum"), d.get("rank")
        if not (checksum is None or type(checksum) is str) or not (
                rank is None or (type(rank) is int and rank >= 0)):
            raise ManifestError(f"{where}: an item has an invalid checksum or rank")
        return cls(shape=shape, dtype=dtype, nbytes=nbytes, checksum=checksum, rank=rank,
                   **_location(d, nbytes, where))


_ENCODINGS = frozenset(e.value for e in Encoding)


class Items(Mapping[str, Item]):
    """A parsed manifest's items: key -> :class:`Item`, each entry checked by
    ``Item.from_json`` the first time it is looked up (ManifestError when it is bad).

    A restore of a K=1 view reads the non-expert items of one manifest and one expert of
    each of E others, yet every manifest lists all of its items: checking each entry on
    first use instead of all of them up front is what keeps that restore near the cost
    of one full load. Keys, entry types and the byte total are checked at parse time.
    """

    __slots__ = ("_raw", "_parsed", "_where")

    def __init__(self, raw: dict[str, Any], where: str) -> None:
        self._raw, self._where = raw, where
        self._parsed: dict[str, Item] = {}

    def __getitem__(self, key: str) -> Item:
        item = self._parsed.get(key)
        if item is None:
            item = self._parsed[key] = Item.from_json(self._raw[key], f"{self._where} "
                                                                      f"item {key}")
        return item

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def keys(self):  # noqa: ANN201 - dict_keys: set operations at C speed (stitching)
        return self._raw.keys()


def _raw_items(raw: dict[str, Any], where: str) -> tuple[Items, int]:
    """The items of a manifest with their keys and entry types checked, and their total
    bytes (each entry in full on first use: :class:`Items`)."""
    _check_keys(raw, where)
    entries = raw.values()
    sizes = ([e.get("nbytes", 0) for e in entries] if set(map(type, entries)) <= {dict}
             else [None])
    if not set(map(type, sizes)) <= {int} or (sizes and min(sizes) < 0):
        raise ManifestError(f"{where}: an item entry is not an object with a byte count")
    return Items(raw, where), sum(sizes)


@functools.lru_cache(maxsize=1024)
def _plain_file(file: str) -> bool:
    """A plain file name inside a checkpoint folder (few distinct names: cached)."""
    return bool(_FILE_RE.match(file)) and ".." not in file


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _location(d: Mapping[str, Any], nbytes: int, where: str) -> dict[str, Any]:
    """The validated location fields of an item entry ({} when it records none)."""
    file = d.get("file")
    if file is None:
        return {}
    offset, length, encoding = d.get("offset"), d.get("length"), d.get("encoding")
    if not (type(file) is str and _plain_file(file)):
        raise ManifestError(f"{where}: an item's data file {file!r:.80} is not a plain file "
                            f"name inside the checkpoint")
    if not (type(offset) is int and offset >= 0 and type(length) is int and length >= 0) \
            or type(encoding) is not str or encoding not in _ENCODINGS:
        raise ManifestError(f"{where}: an item has an invalid offset/length/encoding")
    if encoding == Encoding.RAW and length != nbytes:
        raise ManifestError(f"{where}: a raw item's length {length} is not its nbytes {nbytes}")
    return {"file": file, "offset": offset, "length": length, "encoding": encoding}


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    """The manager's bookkeeping of one checkpoint, captured on the training thread when
    its snapshot starts; carried by the RAM snapshot and written into the manifest."""

    step: int
    """Training step whose state this is (resume at step + 1)."""
    seq: int
    """Checkpoint sequence number (orders checkpoints, names the folder)."""
    index: int
    """Checkpoint index of the run (selectors' clock)."""
    time: float
    structure: dict[str, Any]
    """The model's structure and fingerprint (``state.experts.structure_of``)."""
    config: dict[str, Any]
    """CheckpointConfig.to_dict() of the saving run."""
    k_persist: int
    k_snapshot: int
    full: bool
    """All experts were saved (the first checkpoint, ``full_every``, a lacking view)."""
    pec_scope: str
    selection: str
    experts_saved: list[list[int]]
    """Experts per layer persisted (empty when this snapshot is RAM only)."""
    experts_snapshot: list[list[int]]
    """Experts per layer copied to RAM."""
    counts: list[list[int]]
    """Token assignments per (layer, expert) since the start of the run, at this step."""
    ledger: dict[str, Any]
    """PLTLedger.state_dict()."""
    plt: float
    selectors: dict[str, Any]
    """{"persist": Selector.state_dict(), "ram": ...}."""
    k_history: list[list[int]]
    """[step, K_persist] at each change of K."""
    world_size: int
    write_mode: str
    run_id: str = ""
    """The run (writer) that took this checkpoint (format 3 on)."""
    runs: list[str] = field(default_factory=list)
    """Every run of this checkpoint's lineage, oldest first: a run that restored another
    run's checkpoint continues its lineage (restore stitches only within it)."""


_META_FIELDS = tuple(f.name for f in fields(CheckpointMeta))
_META_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "seq": int, "index": int, "time": (int, float), "structure": dict,
    "config": dict, "k_persist": int, "k_snapshot": int, "full": bool, "pec_scope": str,
    "selection": str, "experts_saved": list, "experts_snapshot": list, "counts": list,
    "ledger": dict, "plt": (int, float), "selectors": dict, "k_history": list,
    "world_size": int, "write_mode": str, "run_id": str, "runs": list,
}


def check_format(fmt: Any, where: str) -> None:
    """Raise unless ``fmt`` is :data:`FORMAT`: ManifestError (damaged) for a pre-release
    format, ManifestFormatError for a newer one."""
    if fmt == FORMAT:
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
    """Every item this checkpoint wrote (all ranks); :class:`Items` when parsed."""
    view: Mapping[str, str]
    """Every key of the full state -> the checkpoint holding its newest copy (a
    :class:`StoredView` when read: loaded on first use, ManifestError when its file is
    missing or damaged)."""
    bytes_per_rank: list[int]
    bytes: int
    committed_at: float
    serialization: str
    format: str = FORMAT

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def seq(self) -> int:
        return self.meta.seq

    def to_json(self, view_ref: ViewRef | None = None) -> dict[str, Any]:
        """The flat JSON object stored as ``moepec.json``, with the reference to the view's
        file (``view_ref``, or the one it was read with)."""
        out = {name: getattr(self.meta, name) for name in _META_FIELDS}
        out.update(format=self.format, serialization=self.serialization, name=self.name,
                   parent=self.parent, ancestors=self.ancestors,
                   keys={k: v.to_json() for k, v in self.keys.items()},
                   bytes_per_rank=self.bytes_per_rank, bytes=self.bytes,
                   committed_at=self.committed_at)
        if view_ref is None and isinstance(self.view, StoredView):
            view_ref = self.view.ref
        if view_ref is None:
            raise ValueError("a manifest is written with its view's file (encode_view)")
        out["view_file"] = view_ref.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any, where: str,
                  read_view: Callable[[ViewRef], bytes] | None = None) -> Manifest:
        """Parse a manifest; ``where`` names it in errors. ``read_view`` reads the bytes of
        its view file (checked when the view is first used). Raises ManifestFormatError
        for a newer format, ManifestError for anything else wrong (a pre-release format
        included)."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: the manifest is not a JSON object")
        check_format(data.get("format"), where)
        meta = meta_from_json(data, where)
        for name, kind in (("name", str), ("keys", dict), ("view_file", dict),
                           ("bytes_per_rank", list), ("bytes", int)):
            _need(data, name, kind, where)
        ancestors = data.get("ancestors", [])
        if read_view is None:
            raise ManifestError(f"{where}: its view is in a file of its own, and no reader "
                                f"was given for it")
        view = StoredView(ViewRef.from_json(data["view_file"], where), read_view,
                          data["name"], where)
        _check_names(data["name"], ancestors, {}, data.get("parent"), where)
        keys, total = _raw_items(data["keys"], where)
        _check_chunks(keys, {}, where)
        if total != data["bytes"]:
            raise ManifestError(f"{where}: the items' sizes do not add up to 'bytes'")
        return cls(meta=meta, name=data["name"], parent=data.get("parent"),
                   ancestors=ancestors, keys=keys, view=view,
                   bytes_per_rank=data["bytes_per_rank"], bytes=data["bytes"],
                   committed_at=data.get("committed_at", 0.0),
                   serialization=data.get("serialization", "torch_save"))


@dataclass(frozen=True, slots=True)
class ViewRef:
    """Where a manifest's view is stored: a file of the checkpoint folder, its length and
    XXH3 checksum (the manifest commits them: the file is written first)."""

    file: str
    length: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "length": self.length, "checksum": self.checksum}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str) -> ViewRef:
        file, length, checksum = d.get("file"), d.get("length"), d.get("checksum")
        if not (type(file) is str and _plain_file(file) and type(length) is int
                and 0 <= length <= MAX_VIEW_BYTES and type(checksum) is str
                and checksum.startswith("xxh3:")):
            raise ManifestError(f"{where}: manifest field 'view_file' is malformed")
        return cls(file=file, length=length, checksum=checksum)


def encode_view(view: Mapping[str, str]) -> tuple[bytes, ViewRef]:
    """A view as stored in its file (compact JSON) and its reference, whose file name
    holds the checksum: writing it again never changes a file another manifest names."""
    data = json.dumps(dict(view), sort_keys=True, separators=(",", ":")).encode()
    digest = xxhash.xxh3_64_hexdigest(data)
    return data, ViewRef(file=f"view-{digest}.json", length=len(data), checksum=f"xxh3:{digest}")


class StoredView(Mapping[str, str]):
    """A manifest's view: read, checked against its length and checksum, parsed
    and validated on first use (ManifestError when the file is missing or damaged; the
    error is kept, so every later use raises it too)."""

    __slots__ = ("ref", "_read", "_owner", "_where", "_view", "_error")

    def __init__(self, ref: ViewRef, read: Callable[[ViewRef], bytes], owner: str,
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
        try:
            data = self._read(self.ref)
        except (OSError, MoepecError) as exc:
            raise ManifestError(f"{where} cannot be read ({type(exc).__name__}: {exc}); the "
                                f"checkpoint is damaged") from None
        if len(data) != self.ref.length or \
                f"xxh3:{xxhash.xxh3_64_hexdigest(data)}" != self.ref.checksum:
            raise ManifestError(f"{where} does not match the length and checksum the manifest "
                                f"records; the checkpoint is damaged")
        try:
            view = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ManifestError(f"{where} is not valid JSON") from None
        if type(view) is not dict:
            raise ManifestError(f"{where} is not a JSON object")
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


def meta_from_json(data: Any, where: str) -> CheckpointMeta:
    """A CheckpointMeta from its JSON fields (as a RAM slot header stores them), checked
    as a manifest's are. Raises ManifestError."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: the checkpoint bookkeeping is not a JSON object")
    for name, kind in _META_TYPES.items():
        _need(data, name, kind, where)
    meta = {n: data[n] for n in _META_TYPES}
    _check_structure(data["structure"], where)
    _check_bookkeeping(meta, where)
    return CheckpointMeta(**meta)


MAX_EXPERTS = 1 << 16
"""Experts per MoE layer a manifest may claim (more is taken as damage)."""


def _check_structure(structure: Mapping[str, Any], where: str) -> None:
    """The model structure: ``experts`` [prefix, layout, count] per MoE layer, ``params``
    [name, shape, dtype], a ``fingerprint`` string. The manifests of one root repeat one
    structure: one equal to the last that passed is not checked again."""
    if structure == _last_structure[0]:
        return
    experts, params = structure.get("experts"), structure.get("params")
    ok = isinstance(experts, list) and isinstance(params, list) and isinstance(
        structure.get("fingerprint"), str)
    ok = ok and all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                    and e[1] in ("stacked", "modules") and _is_count(e[2])
                    and e[2] <= MAX_EXPERTS for e in experts)
    ok = ok and all(isinstance(p, list) and len(p) == 3 and isinstance(p[0], str)
                    and isinstance(p[1], list) and len(p[1]) <= MAX_DIMS
                    and all(_is_count(n) for n in p[1]) and isinstance(p[2], str)
                    and p[2] in DTYPE_SIZES
                    for p in params)
    if not ok:
        raise ManifestError(f"{where}: manifest field 'structure' is malformed")
    _last_structure[0] = copy.deepcopy(structure)


_last_structure: list[Any] = [None]
"""The last structure that passed _check_structure (a private copy: callers may mutate
theirs)."""


def _counts(rows: Any) -> bool:
    """A list of lists of non-negative ints (not bools), checked at C speed."""
    if type(rows) is not list or not set(map(type, rows)) <= {list}:
        return False
    values = list(itertools.chain.from_iterable(rows))
    return set(map(type, values)) <= {int} and (not values or min(values) >= 0)


def _check_bookkeeping(meta: Mapping[str, Any], where: str) -> None:
    """Routing counts, PLT ledger, selectors and K history fit the structure: loaded into
    fresh objects of their own classes, which check them (policy layer, pure)."""
    n_experts = [e[2] for e in meta["structure"]["experts"]]
    try:
        counts = meta["counts"]
        if not _counts(counts) or list(map(len, counts)) != n_experts:
            raise ValueError("counts do not match the experts per layer")
        for name in ("experts_saved", "experts_snapshot"):
            if not _counts(meta[name]):
                raise ValueError(name)
        if not all(isinstance(h, list) and len(h) == 2 and all(isinstance(x, int) for x in h)
                   for h in meta["k_history"]):
            raise ValueError("k_history")
        if n_experts and min(n_experts) > 0:
            PLTLedger.create(n_experts).load_state_dict(meta["ledger"])
            for tier in ("persist", "ram"):
                Selector.create(n_experts).load_state_dict(meta["selectors"][tier])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, MoepecError) as exc:
        raise ManifestError(f"{where}: the manifest's bookkeeping (counts, PLT ledger, "
                            f"selectors, K) is malformed ({type(exc).__name__})") from None


_KEY_RE = re.compile(r"^(?:(?:model|optim|objects)/|experts/\d{1,6}/\d{1,6}/(?:model|optim)/)"
                     r"[^\x00]+$")
"""The state-key grammar of moepec.keys, as one expression (checked for every key)."""


def _check_keys(keys: Mapping[Any, Any], where: str) -> None:
    """Every key follows the state-key grammar (moepec.keys), or ManifestError."""
    if set(map(type, keys)) <= {str} and all(map(_known_key, keys)):
        return  # the common case, at C speed
    bad = next(k for k in keys if not (type(k) is str and _known_key(k)))
    raise ManifestError(f"{where}: {bad!r:.80} is not a moepec state key")


@functools.lru_cache(maxsize=1 << 16)
def _known_key(key: str) -> bool:
    """The grammar check of one key; the manifests of a root repeat the same keys."""
    return bool(_KEY_RE.match(key))


def _check_chunks(keys: Mapping[str, Item], view: Mapping[str, str], where: str) -> None:
    """Chunk keys are well formed, and an item's shape is its chunk's."""
    if CHUNK_MARK not in "".join(keys) and CHUNK_MARK not in "".join(view):
        return  # the common case, at C speed
    for key in [k for k in keys if CHUNK_MARK in k] + [k for k in view if CHUNK_MARK in k]:
        try:
            _, chunk = split_chunk(key)
        except ValueError as exc:
            raise ManifestError(f"{where}: {exc}") from None
        item = keys.get(key)
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
    _check_keys(view, where)


def _need(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> None:
    value = data.get(name)
    # bool is an int in Python; a count that reads `true` is still wrong
    if value is None or not isinstance(value, kind) or (
            isinstance(value, bool) and kind in (int, (int, float))):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ManifestError(f"{where}: manifest field {name!r} is {got}")


def updated_view(parent_view: Mapping[str, str] | None, name: str,
                 saved_keys: Iterable[str]) -> dict[str, str]:
    """The view after checkpoint ``name`` committed ``saved_keys`` on top of its parent.

    A tensor saved in chunks replaces every older copy of it, also one chunked in another
    layout (a run restored at another FSDP or EP degree): the view holds one layout of
    each tensor, whose chunks all come from one checkpoint."""
    view = dict(parent_view or {})
    saved = list(saved_keys)
    if any(CHUNK_MARK in k for k in saved) or any(CHUNK_MARK in k for k in view):
        bases = {k.partition(CHUNK_MARK)[0] for k in saved}
        view = {k: v for k, v in view.items() if k.partition(CHUNK_MARK)[0] not in bases}
    for key in saved:
        view[key] = name
    return view


def lineage(manifests: Mapping[str, Manifest], head: str) -> list[str]:
    """``head`` and its committed ancestors that still exist, newest first."""
    if head not in manifests:
        return []
    names = [head] + list(reversed(manifests[head].ancestors))
    return [n for n in names if n in manifests]


def newest(names: Iterable[str]) -> str | None:
    """The checkpoint name with the highest sequence number (ties: keys.name_order), or
    None."""
    names = list(names)
    return max(names, key=name_order) if names else None


def retained(manifests: Mapping[str, Manifest], keep_last: int) -> set[str]:
    """Checkpoints to keep: the newest ``keep_last`` of the newest lineage, plus every
    checkpoint their views need. Never drops the only copy of a key of a kept view."""
    head = newest(manifests)
    if head is None:
        return set()
    heads = lineage(manifests, head)[:keep_last]
    keep = set(heads)
    for h in heads:
        try:
            keep.update(manifests[h].view.values())
        except ManifestError:  # which checkpoints it needs is unknown: delete nothing older
            return set(manifests)
    return keep


def to_delete(manifests: Mapping[str, Manifest], uncommitted: Iterable[str],
              keep_last: int) -> list[str]:
    """Committed checkpoints no kept view needs, and uncommitted leftovers older than the
    newest commit (a save is persisted one at a time, so these can never commit)."""
    keep = retained(manifests, keep_last)
    head = newest(manifests)
    out = [n for n in manifests if n not in keep]
    if head is not None:
        out += [n for n in uncommitted if seq_of(n) < seq_of(head)]
    return sorted(out, key=name_order)


def view_age(manifest: Manifest) -> list[list[int]]:
    """Per (layer, expert): steps between the checkpoint and the newest copy of its weights
    (0 = saved in this checkpoint), from the view alone."""
    step = manifest.step
    ages = [[-1] * e[2] for e in manifest.meta.structure["experts"]]
    for weights_only in (True, False):  # pec_scope=optimizer: weights are not in the view
        for key, src in manifest.view.items():
            info = parse_key(key)
            parsed = parse_checkpoint_name(src)
            if info.is_expert and parsed and (info.part == "model" or not weights_only):
                ages[info.layer][info.expert] = step - parsed[1]
        if any(a >= 0 for row in ages for a in row):
            break
    return ages
