"""The committed record of one shared-memory slot (``slot<i>.json``, :mod:`moepec.ram.shm`):
the keys with their offsets, dtypes, shapes and checksums, and whose checkpoint it is."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from moepec.errors import ManifestError
from moepec.store.meta import CheckpointMeta, meta_from_json

HEADER_FORMAT = "moepec-ram-1"


@dataclass(slots=True)
class SlotHeader:
    """The committed record of one slot (``slot<i>.json``)."""

    root: str
    rank: int
    world_size: int
    meta: CheckpointMeta
    entries: dict[str, dict[str, Any]]
    """key -> {"offset", "shape", "dtype", "nbytes", "checksum"}."""
    all_keys: list[str]
    persist_keys: list[str]
    snapshot_experts: list[list[int]]
    persist_experts: list[list[int]] | None
    written_at: float = 0.0
    pid: int = 0

    @property
    def seq(self) -> int:
        return self.meta.seq

    @property
    def step(self) -> int:
        return self.meta.step

    def to_json(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in self.__slots__ if name != "meta"}
        # Shallow (the meta's fields are JSON values): asdict's deep copy took ~2 ms.
        meta = {f.name: getattr(self.meta, f.name) for f in fields(self.meta)}
        # seq and step also at the top, where `moepec ram ls` and a replica's receiver
        # read them without parsing the meta.
        return {"format": HEADER_FORMAT, **d, "seq": self.seq, "step": self.step,
                "meta": meta}

    @classmethod
    def from_json(cls, data: Any, where: str) -> SlotHeader:
        """Parse a header; raises ManifestError when anything is missing or mistyped."""
        if not isinstance(data, dict) or data.get("format") != HEADER_FORMAT:
            raise ManifestError(f"{where}: not a moepec RAM slot header")
        kinds = {"root": str, "rank": int, "world_size": int, "seq": int, "step": int,
                 "entries": dict, "all_keys": list, "persist_keys": list,
                 "snapshot_experts": list, "written_at": (int, float), "pid": int}
        for name, kind in kinds.items():
            if not isinstance(data.get(name), kind):
                raise ManifestError(f"{where}: header field {name!r} is missing or mistyped")
        if not (data.get("persist_experts") is None or isinstance(data["persist_experts"], list)):
            raise ManifestError(f"{where}: header field 'persist_experts' is mistyped")
        meta = meta_from_json(data.get("meta"), where)
        if (data["seq"], data["step"]) != (meta.seq, meta.step):
            raise ManifestError(f"{where}: header seq/step disagree with its checkpoint meta")
        fields_ = {n: data[n] for n in cls.__slots__ if n != "meta"}
        return cls(meta=meta, **fields_)

