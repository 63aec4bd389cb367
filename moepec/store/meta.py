"""The manager's bookkeeping of one checkpoint (:class:`CheckpointMeta`): written into
its manifest and into a RAM slot's header, read back by :func:`meta_from_json`, the one
reader of both. Pure: JSON in, objects out.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from moepec.errors import ManifestError, MoepecError
from moepec.policy.plt import PLTLedger
from moepec.policy.selection import Selector
from moepec.store.items import DTYPE_SIZES, MAX_DIMS, is_count, need_field


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
    part: dict[str, Any] | None = None
    """For one part of a checkpoint striped over replica groups (:class:`Part`, as JSON):
    which part, of how many, of which groups and epoch. None: a whole checkpoint."""

    def runs_continued_by(self, run_id: str) -> list[str]:
        """The ``runs`` of a checkpoint taken by ``run_id`` after restoring this one: it
        continues this lineage (the newest 64 runs are kept)."""
        return [r for r in self.runs if r != run_id][-63:] + [run_id]

    @property
    def run_lineage(self) -> frozenset[str]:
        """The runs of this checkpoint's lineage, its own included (restore stitches, and a
        restarted worker reads RAM slots, only within one lineage)."""
        return frozenset(self.runs) | {self.run_id}


META_FIELDS = tuple(f.name for f in fields(CheckpointMeta))
_META_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "seq": int, "index": int, "time": (int, float), "structure": dict,
    "config": dict, "k_persist": int, "k_snapshot": int, "full": bool, "pec_scope": str,
    "selection": str, "experts_saved": list, "experts_snapshot": list, "counts": list,
    "ledger": dict, "plt": (int, float), "selectors": dict, "k_history": list,
    "world_size": int, "write_mode": str, "run_id": str, "runs": list,
}


@dataclass(frozen=True, slots=True)
class Part:
    """This root's share of a checkpoint striped over the replica groups of a quorum:
    the groups' roots together hold the checkpoint, each the items of its part."""

    index: int
    """This group's position among ``members``."""
    count: int
    """Parts of the checkpoint (the groups of the quorum)."""
    members: tuple[int, ...]
    """The replica groups writing it, in part order."""
    epoch: str
    """The run of the job since its last cold start: parts of two epochs never combine."""
    full: bool = False
    """Save every expert (the quorum changed since the last checkpoint)."""

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "count": self.count, "members": list(self.members),
                "epoch": self.epoch, "full": self.full}

    @classmethod
    def from_json(cls, data: Any, where: str) -> Part:
        """Raises ManifestError for a malformed part."""
        ok = isinstance(data, dict) and is_count(data.get("index")) \
            and is_count(data.get("count")) and isinstance(data.get("epoch"), str) \
            and isinstance(data.get("full"), bool) and isinstance(data.get("members"), list) \
            and all(is_count(m) for m in data["members"])
        if not ok or not data["index"] < data["count"] == len(set(data["members"])) \
                == len(data["members"]):
            raise ManifestError(f"{where}: manifest field 'part' is malformed")
        return cls(index=data["index"], count=data["count"], members=tuple(data["members"]),
                   epoch=data["epoch"], full=data["full"])


def meta_from_json(data: Any, where: str) -> CheckpointMeta:
    """A CheckpointMeta from its JSON fields (as a RAM slot header stores them), checked
    as a manifest's are. Raises ManifestError."""
    if not isinstance(data, dict):
        raise ManifestError(f"{where}: the checkpoint bookkeeping is not a JSON object")
    for name, kind in _META_TYPES.items():
        need_field(data, name, kind, where)
    meta = {n: data[n] for n in _META_TYPES}
    if data.get("part") is not None:
        meta["part"] = Part.from_json(data["part"], where).to_json()
    _check_structure(data["structure"], where)
    _check_bookkeeping(meta, where)
    return CheckpointMeta(**meta)


MAX_EXPERTS = 1 << 16
"""Experts per MoE layer a manifest may claim (more is taken as damage)."""


def _check_structure(structure: Mapping[str, Any], where: str) -> None:
    """The model structure: ``experts`` [prefix, layout, count] per MoE layer, ``params``
    [name, shape, dtype], a ``fingerprint`` string. Raises ManifestError."""
    # The manifests of one root repeat one structure: its canonical JSON is the cache key
    # of the check (a pure function's memo: nothing shared is mutated, any thread).
    try:
        text = json.dumps(structure, sort_keys=True)
    except (TypeError, ValueError):
        raise ManifestError(f"{where}: manifest field 'structure' is malformed") from None
    if not _structure_ok(text):
        raise ManifestError(f"{where}: manifest field 'structure' is malformed")


@functools.lru_cache(maxsize=16)
def _structure_ok(text: str) -> bool:
    structure = json.loads(text)
    experts, params = structure.get("experts"), structure.get("params")
    ok = isinstance(experts, list) and isinstance(params, list) and isinstance(
        structure.get("fingerprint"), str)
    ok = ok and all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                    and e[1] in ("stacked", "modules") and is_count(e[2])
                    and e[2] <= MAX_EXPERTS for e in experts)
    return ok and all(isinstance(p, list) and len(p) == 3 and isinstance(p[0], str)
                      and isinstance(p[1], list) and len(p[1]) <= MAX_DIMS
                      and all(is_count(n) for n in p[1]) and isinstance(p[2], str)
                      and p[2] in DTYPE_SIZES
                      for p in params)


def _counts(rows: Any) -> bool:
    """A list of lists of non-negative ints (not bools), checked at C speed."""
    if type(rows) is not list or not set(map(type, rows)) <= {list}:
        return False
    values = list(itertools.chain.from_iterable(rows))
    return set(map(type, values)) <= {int} and (not values or min(values) >= 0)


def _check_bookkeeping(meta: Mapping[str, Any], where: str) -> None:
    """Routing counts, experts saved, PLT ledger, selectors and K history fit the
    structure. Raises ManifestError."""
    n_experts = [e[2] for e in meta["structure"]["experts"]]
    if not all(_counts(meta[name]) for name in ("experts_saved", "experts_snapshot")):
        raise ManifestError(f"{where}: the manifest's bookkeeping (counts, PLT ledger, "
                            f"selectors, K) is malformed (experts saved)")
    check_schedule(meta, n_experts, where)


def check_schedule(fields: Mapping[str, Any], n_experts: list[int], where: str) -> None:
    """The PEC schedule's fields of a manifest (``ExpertSchedule.meta_fields``: routing
    counts per (layer, expert), PLT ledger, selectors, K history), checked against the
    experts per layer: loaded into fresh objects of their own classes, which check them
    (policy layer, pure). One check for both front ends' manifests. Raises ManifestError."""
    try:
        counts = fields["counts"]
        if not _counts(counts) or list(map(len, counts)) != n_experts:
            raise ValueError("counts do not match the experts per layer")
        if not all(isinstance(h, list) and len(h) == 2 and all(isinstance(x, int) for x in h)
                   for h in fields["k_history"]):
            raise ValueError("k_history")
        if n_experts and min(n_experts) > 0:
            PLTLedger.loaded(n_experts, fields["ledger"])
            for tier in ("persist", "ram"):
                Selector.loaded(n_experts, fields["selectors"][tier])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, MoepecError) as exc:
        raise ManifestError(f"{where}: the manifest's bookkeeping (counts, PLT ledger, "
                            f"selectors, K) is malformed ({type(exc).__name__})") from None
