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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from moepec.errors import ManifestError, ManifestFormatError
from moepec.keys import parse_checkpoint_name, parse_key, seq_of

FORMAT = "moepec/2"
"""2: items may be raw tensor bytes (moepec.store.dcp_raw; the manifest's
``serialization`` says which) and checksums XXH3 (``xxh3:``). 1: torch.save-framed
items, XXH64."""
KNOWN_FORMATS = ("moepec/1", "moepec/2")
MAX_ANCESTORS = 512
"""Ancestors a manifest lists (its lineage); older ones are forgotten."""


class Serialization(StrEnum):
    """How DCP items are stored on disk (a manifest records which)."""

    RAW = "raw"
    """Raw tensor bytes (:mod:`moepec.store.dcp_raw`); read by moepec's DCP readers."""
    TORCH_SAVE = "torch_save"
    """Stock DCP (torch.save-framed items): any ``dcp.load`` reads it."""


@dataclass(frozen=True, slots=True)
class Item:
    """One stored tensor of a checkpoint (or of a RAM snapshot, without checksum and rank)."""

    shape: list[int]
    dtype: str
    """torch dtype name without the ``torch.`` prefix."""
    nbytes: int = 0
    checksum: str | None = None
    """``xxh3:<hex>`` (or ``xxh64:`` in format 1); None for RAM copies."""
    rank: int | None = None
    """The rank that wrote it."""

    def to_json(self) -> dict[str, Any]:
        return {"shape": self.shape, "dtype": self.dtype, "nbytes": self.nbytes,
                "checksum": self.checksum, "rank": self.rank}

    @classmethod
    def from_json(cls, d: Any, where: str) -> Item:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: an item entry is not an object")
        shape, dtype = d.get("shape"), d.get("dtype")
        if not (isinstance(shape, list) and all(isinstance(s, int) for s in shape)
                and isinstance(dtype, str)):
            raise ManifestError(f"{where}: an item has no valid shape/dtype")
        return cls(shape=shape, dtype=dtype, nbytes=d.get("nbytes", 0),
                   checksum=d.get("checksum"), rank=d.get("rank"))


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


_META_FIELDS = tuple(f.name for f in fields(CheckpointMeta))
_META_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "seq": int, "index": int, "time": (int, float), "structure": dict,
    "config": dict, "k_persist": int, "k_snapshot": int, "full": bool, "pec_scope": str,
    "selection": str, "experts_saved": list, "experts_snapshot": list, "counts": list,
    "ledger": dict, "plt": (int, float), "selectors": dict, "k_history": list,
    "world_size": int, "write_mode": str,
}


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
    keys: dict[str, Item]
    """Every item this checkpoint wrote (all ranks)."""
    view: dict[str, str]
    """Every key of the full state -> the checkpoint holding its newest copy."""
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

    def to_json(self) -> dict[str, Any]:
        """The flat JSON object stored as ``moepec.json``."""
        out = {name: getattr(self.meta, name) for name in _META_FIELDS}
        out.update(format=self.format, serialization=self.serialization, name=self.name,
                   parent=self.parent, ancestors=self.ancestors,
                   keys={k: v.to_json() for k, v in self.keys.items()}, view=self.view,
                   bytes_per_rank=self.bytes_per_rank, bytes=self.bytes,
                   committed_at=self.committed_at)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        """Parse a manifest; ``where`` names it in errors. Raises ManifestFormatError for a
        format this moepec cannot read, ManifestError for anything else wrong."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: the manifest is not a JSON object")
        fmt = data.get("format")
        if fmt not in KNOWN_FORMATS:
            raise ManifestFormatError(
                f"{where} has manifest format {fmt!r}, which this moepec cannot read (it "
                f"reads {', '.join(KNOWN_FORMATS)}); it was written by a newer moepec: "
                f"upgrade moepec")
        for name, kind in _META_TYPES.items():
            _need(data, name, kind, where)
        for name, kind in (("name", str), ("keys", dict),
                           ("view", dict), ("bytes_per_rank", list), ("bytes", int)):
            _need(data, name, kind, where)
        if not isinstance(data.get("ancestors", []), list):
            raise ManifestError(f"{where}: manifest field 'ancestors' is not a list")
        if parse_checkpoint_name(data["name"]) is None:
            raise ManifestError(f"{where}: 'name' {data['name']!r} is not a checkpoint name")
        return cls(meta=CheckpointMeta(**{n: data[n] for n in _META_FIELDS}),
                   name=data["name"], parent=data.get("parent"),
                   ancestors=data.get("ancestors", []),
                   keys={k: Item.from_json(v, where) for k, v in data["keys"].items()},
                   view=data["view"], bytes_per_rank=data["bytes_per_rank"],
                   bytes=data["bytes"], committed_at=data.get("committed_at", 0.0),
                   serialization=data.get("serialization", "torch_save"), format=fmt)


def _need(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> None:
    value = data.get(name)
    # bool is an int in Python; a count that reads `true` is still wrong
    if value is None or not isinstance(value, kind) or (
            isinstance(value, bool) and kind in (int, (int, float))):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ManifestError(f"{where}: manifest field {name!r} is {got}")


def updated_view(parent_view: Mapping[str, str] | None, name: str,
                 saved_keys: Iterable[str]) -> dict[str, str]:
    """The view after checkpoint ``name`` committed ``saved_keys`` on top of its parent."""
    view = dict(parent_view or {})
    for key in saved_keys:
        view[key] = name
    return view


def lineage(manifests: Mapping[str, Manifest], head: str) -> list[str]:
    """``head`` and its committed ancestors that still exist, newest first."""
    if head not in manifests:
        return []
    names = [head] + list(reversed(manifests[head].ancestors))
    return [n for n in names if n in manifests]


def newest(names: Iterable[str]) -> str | None:
    """The checkpoint name with the highest sequence number, or None."""
    names = list(names)
    return max(names, key=seq_of) if names else None


def retained(manifests: Mapping[str, Manifest], keep_last: int) -> set[str]:
    """Checkpoints to keep: the newest ``keep_last`` of the newest lineage, plus every
    checkpoint their views need. Never drops the only copy of a key of a kept view."""
    head = newest(manifests)
    if head is None:
        return set()
    heads = lineage(manifests, head)[:keep_last]
    keep = set(heads)
    for h in heads:
        keep.update(manifests[h].view.values())
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
    return sorted(out, key=seq_of)


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
