"""Recovery: stitch each key's newest good copy into one consistent training state.

Rules:
- The *base* is the newest usable checkpoint (the RAM snapshot if the process
  survived, else the newest committed manifest). All non-expert state comes from
  the base alone, so it is one consistent step; if any non-expert item of a base
  is missing or corrupt, the next older base is tried.
- Each expert *unit* (layer, expert, part: weights or optimizer state) is loaded
  whole from the newest copy in the base's lineage that holds it and verifies;
  a corrupt or missing copy falls back to the previous copy with a warning and
  the extra lost tokens counted; with no copy left, recovery fails.
- Lost token assignments of expert e in layer l = counts at the base minus counts
  at the restored copy of its weights (PLT, DESIGN.md).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from moepec.checksum import checksum_matches
from moepec.errors import CorruptCheckpointError, NoCheckpointError
from moepec.state import parse_key

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Source:
    """One place copies can come from: a committed checkpoint or a RAM snapshot."""

    name: str
    tier: str  # "storage" | "ram"
    step: int
    counts: list[list[int]]
    keys: Mapping[str, Mapping[str, Any]]
    """key -> {"shape", "dtype", "checksum" (storage only)}"""
    read: Callable[[dict[str, torch.Tensor]], None]
    meta: Mapping[str, Any] = field(default_factory=dict)
    """The manifest (storage) or snapshot metadata (ram)."""


@dataclass(slots=True)
class RestoreReport:
    """What ``CheckpointManager.restore()`` did."""

    step: int
    """The training step the restored state is from (resume at step + 1)."""
    checkpoint: str
    """Name of the base checkpoint (or ``ram:<seq>`` for a RAM snapshot)."""
    tier: str
    """Tier of the base: ``storage`` or ``ram``."""
    sources: dict[str, dict[str, Any]]
    """``"layer/expert"`` -> {"step", "tier", "checkpoint"} of the expert's weights."""
    lost: list[list[int]]
    """Token assignments lost by this recovery, per (layer, expert)."""
    plt: float
    """Cumulative proportion of lost tokens after this recovery (paper Eq. 7)."""
    warnings: list[str]
    seconds: float = 0.0
    keys_from: dict[str, int] = field(default_factory=dict)
    """Number of keys loaded from each tier."""

    @property
    def lost_total(self) -> int:
        return sum(map(sum, self.lost))


@dataclass(slots=True)
class Recovered:
    values: dict[str, torch.Tensor]
    base: Source
    unit_source: dict[tuple[int, int, str], Source]
    warnings: list[str]


def _alloc(info: Mapping[str, Any]) -> torch.Tensor:
    return torch.empty(info["shape"], dtype=getattr(torch, info["dtype"]))


def storage_source(storage, name: str, manifest: Mapping[str, Any]) -> Source:
    """A committed checkpoint as a Source (``storage`` is a moepec.storage.Storage)."""
    return Source(name=name, tier="storage", step=manifest["step"], counts=manifest["counts"],
                  keys=manifest["keys"],
                  read=lambda targets: storage.read(name, targets), meta=manifest)


def read_verified(src: Source, keys: Sequence[str], verify: bool = True
                  ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Read ``keys`` from ``src`` in one pass; return (good values, bad keys). A failed read
    is retried key by key to isolate the bad ones. Never raises for bad data."""
    targets = {k: _alloc(src.keys[k]) for k in keys}
    try:
        src.read(targets)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - isolate the bad key below
        if len(keys) == 1:
            log.debug("reading %s from %s failed: %s", keys[0], src.name, exc)
            return {}, list(keys)
        good: dict[str, torch.Tensor] = {}
        bad: list[str] = []
        for k in keys:
            g, b = read_verified(src, [k], verify)
            good.update(g)
            bad += b
        return good, bad
    bad = []
    if verify and src.tier == "storage":
        for k, t in targets.items():
            if not checksum_matches(t, src.keys[k].get("checksum")):
                bad.append(k)
    return {k: v for k, v in targets.items() if k not in bad}, bad


def recover(bases: Sequence[Source], lineage_of: Callable[[Source], list[Source]],
            required_of: Callable[[Source], set[str]], verify: bool = True) -> Recovered:
    """Choose a base and stitch every key. Raises NoCheckpointError when impossible.

    ``lineage_of(base)`` lists the sources that may supply copies, newest first;
    ``required_of(base)`` names every expert key the restored state must contain.
    """
    warnings: list[str] = []
    for base in bases:
        ne_keys = [k for k in base.keys if not parse_key(k).is_expert]
        values, bad = read_verified(base, ne_keys, verify)
        if bad:
            msg = (f"{base.name}: {len(bad)} non-expert item(s) corrupt or missing "
                   f"(e.g. {bad[0]}); trying an older checkpoint")
            log.warning(msg)
            warnings.append(msg)
            continue
        lineage = lineage_of(base)
        # Every expert unit of the base's view must be restored, from one copy.
        units: dict[tuple[int, int, str], set[str]] = defaultdict(set)
        for k in required_of(base):
            info = parse_key(k)
            if info.is_expert:
                units[(info.layer, info.expert, info.part)].add(k)
        unit_source: dict[tuple[int, int, str], Source] = {}
        pending: dict[tuple[int, int, str], list[Source]] = {
            u: [s for s in lineage if keys <= s.keys.keys()] for u, keys in units.items()}
        while pending:
            by_src: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
            for u, cands in pending.items():
                if not cands:
                    raise NoCheckpointError(
                        f"no intact copy left of expert {u[1]} of MoE layer {u[0]} ({u[2]}); "
                        f"the checkpoints under this path cannot restore it — restore an "
                        f"older path or start from scratch")
                by_src[id(cands[0])].append(u)
            for group in by_src.values():
                src = pending[group[0]][0]
                keys = [k for u in group for k in sorted(units[u])]
                good, bad = read_verified(src, keys, verify)
                bad_set = set(bad)
                for u in group:
                    if units[u] & bad_set:
                        for k in units[u]:
                            good.pop(k, None)
                        msg = (f"{src.name}: expert {u[1]} of layer {u[0]} ({u[2]}) is corrupt "
                               f"or missing; falling back to an older copy")
                        log.warning(msg)
                        warnings.append(msg)
                        pending[u] = pending[u][1:]
                    else:
                        unit_source[u] = src
                        del pending[u]
                values.update(good)
        return Recovered(values=values, base=base, unit_source=unit_source, warnings=warnings)
    raise CorruptCheckpointError(
        "every committed checkpoint has corrupt or missing non-expert state: "
        + "; ".join(warnings) + ". Run `moepec verify PATH` to see the damage")


def lost_tokens(rec: Recovered, n_experts: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(counts at the base, counts at each expert's restored weights copy)."""
    at_base = [list(row) for row in rec.base.counts]
    at_copy = [list(row) for row in at_base]
    for (layer, expert, part), src in rec.unit_source.items():
        # The weights decide what training progress an expert keeps; with
        # pec_scope="optimizer" weights are always fresh and only moments are stale.
        if part == "model":
            at_copy[layer][expert] = src.counts[layer][expert]
    return at_base, at_copy
