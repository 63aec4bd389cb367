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
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch.distributed.checkpoint.api import CheckpointException

from moepec.errors import CorruptCheckpointError, ManifestError, NoCheckpointError
from moepec.keys import parse_key
from moepec.state.objects import decode_object
from moepec.store.checksum import Verifier, checksum_matches
from moepec.store.items import Item, Items
from moepec.store.manifest import Manifest
from moepec.store.meta import CheckpointMeta

log = logging.getLogger(__name__)


class Tier(StrEnum):
    """Where a copy lives."""

    RAM = "ram"
    STORAGE = "storage"


Unit = tuple[int, int, str]
"""An expert unit restored whole: (MoE layer, global expert, part "model" | "optim")."""


@dataclass(slots=True)
class Source:
    """One place copies can come from: a committed checkpoint or a RAM snapshot."""

    name: str
    """The checkpoint name, or ``ram:<seq>`` for a RAM snapshot."""
    tier: Tier
    meta: CheckpointMeta
    """The bookkeeping of the checkpoint (step, counts, ledger, selectors, K)."""
    keys: Mapping[str, Item]
    """The items this source can supply."""
    read: Callable[[dict[str, torch.Tensor]], None]
    """Fills preallocated tensors (key -> tensor) from this source; raises on failure."""
    manifest: Manifest | None = None
    """The manifest, for a committed checkpoint."""
    complete: bool = True
    """Holds every non-expert key (a RAM snapshot some of whose shares were lost is not)."""
    stored_bytes: Callable[[], int] | None = None
    """The bytes its data files hold (storage): no item may claim more, so a damaged
    manifest never makes a read allocate more than the checkpoint's own size."""
    map: Callable[[Sequence[str], bool], tuple[dict[str, torch.Tensor], list[str]]] | None \
        = None
    """``map(keys, verify)``: keys -> tensors over (copy-on-write) mappings of the data
    files instead of reads into new tensors (a local root), and with ``verify`` the keys
    that fail their checksums; raises on failure, as ``read``."""

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def seq(self) -> int:
        return self.meta.seq

    @property
    def counts(self) -> list[list[int]]:
        return self.meta.counts


@dataclass(slots=True)
class Recovered:
    """What :func:`recover` chose and read."""

    values: dict[str, torch.Tensor]
    base: Source
    unit_source: dict[Unit, Source]
    warnings: list[str]


Target = Callable[[str], torch.Tensor | None]
"""Where a key may be read to in place (the live tensor it restores), or None."""


def _alloc(key: str, item: Item, target: Target | None) -> torch.Tensor:
    """The tensor ``key`` is read into: its live tensor when that fits (no allocation and
    no second copy; a bad read is overwritten by the fallback copy), else a new one."""
    live = target(key) if target is not None else None
    if (live is not None and live.is_cpu and live.is_contiguous() and list(live.shape)
            == item.shape and str(live.dtype).removeprefix("torch.") == item.dtype):
        return live
    return torch.empty(item.shape, dtype=getattr(torch, item.dtype))


def storage_source(storage, manifest: Manifest) -> Source:
    """A committed checkpoint as a Source (``storage`` is a moepec.store.storage.Storage)."""
    name = manifest.name
    size: list[int] = []

    def stored_bytes() -> int:
        if not size:
            size.append(storage.data_bytes(name))
        return size[0]

    return Source(name=name, tier=Tier.STORAGE, meta=manifest.meta, keys=manifest.keys,
                  read=lambda targets: storage.read(name, targets, manifest.keys),
                  manifest=manifest, stored_bytes=stored_bytes,
                  map=((lambda keys, verify: storage.map(name, keys, manifest.keys, verify))
                       if storage.can_map else None))


def read_verified(src: Source, keys: Sequence[str], verify: bool = True,
                  target: Target | None = None, defer: Verifier | None = None
                  ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Read ``keys`` from ``src`` in one pass; return (good values, bad keys). A failed read
    is retried key by key to isolate the bad ones. Never raises for bad data. With
    ``defer``, the checksums of mapped items go to that Verifier instead of being checked
    here: the keys its ``finish`` names are bad too (:func:`read_all`)."""
    keys, unusable = _servable(src, keys)
    if unusable:  # a view that names a source without the key (or a bad entry): bad keys
        good, bad = read_verified(src, keys, verify, target, defer) if keys else ({}, [])
        return good, bad + unusable
    check = verify and src.tier == Tier.STORAGE
    try:
        targets, bad = _fetch(src, keys, target, defer if check and defer else check)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - isolate the bad key below
        if len(keys) == 1:
            log.debug("reading %s from %s failed: %s", keys[0], src.name, exc)
            return {}, list(keys)
        good: dict[str, torch.Tensor] = {}
        bad: list[str] = []
        for k in keys:
            g, b = read_verified(src, [k], verify, target, defer)
            good.update(g)
            bad += b
        return good, bad
    bad += [k for k, t in targets.items() if k not in bad and not _decodes(k, t)]
    return {k: v for k, v in targets.items() if k not in bad}, bad


def read_all(reads: Sequence[tuple[Source, Sequence[str]]], verify: bool = True,
             target: Target | None = None) -> list[tuple[dict[str, torch.Tensor], list[str]]]:
    """:func:`read_verified` of each (source, keys), a key read from one source only: the
    checksums of the mapped items are checked once all are mapped, on two threads
    (``Verifier``), as ``dcp.load`` uses two cores. Returns each read's (good values,
    bad keys), as read_verified would; never raises for bad data."""
    checks = Verifier()
    done = [read_verified(src, keys, verify, target, checks) for src, keys in reads]
    late = checks.finish()
    if not late:
        return done
    failed = set(late)
    return [({k: v for k, v in good.items() if k not in failed},
             bad + [k for k in good if k in failed]) for good, bad in done]


def _fetch(src: Source, keys: Sequence[str], target: Target | None, check: bool | Verifier
           ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``keys`` of ``src`` and (``check``) those failing their checksums: mapped where the
    source can map (no allocation, no read copy; as fast as reading in place and still
    all or nothing), else read into the live tensors that fit (``target``:
    restore_in_place) or into new ones. A Verifier ``check`` gets the mapped items'
    checks; items read are checked here."""
    if src.map is not None:
        return src.map(keys, check)
    targets = {k: _alloc(k, src.keys[k], target) for k in keys}
    src.read(targets)
    bad = [k for k, t in targets.items()
           if check and not checksum_matches(t, src.keys[k].checksum)]
    return targets, bad


def _servable(src: Source, keys: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the keys ``src`` can serve, the others, each in ``keys``' order): one it does not
    list, lists with a bad entry (a manifest's entries are checked on first use:
    store.items.Items), or whose entry claims more bytes than the checkpoint holds (never
    allocated). One lookup per key: a K=1 restore asks this of thousands."""
    entries = src.keys
    limit = None
    ok: list[str] = []
    bad: list[str] = []
    for key in keys:
        try:
            item = entries[key]
        except KeyError:
            bad.append(key)
            continue
        except ManifestError as exc:
            log.warning("%s", exc)
            bad.append(key)
            continue
        if src.stored_bytes is not None:
            if limit is None:
                limit = src.stored_bytes()
            if item.nbytes > limit:
                bad.append(key)
                continue
        ok.append(key)
    return ok, bad


def _decodes(key: str, value: torch.Tensor) -> bool:
    """An object item must decode (tagged JSON, never pickle): one that does not is a
    damaged item even when its checksum matches, since a checksum can be forged."""
    if not key.startswith("objects/"):
        return True
    try:
        decode_object(value, key)
    except CorruptCheckpointError as exc:
        log.warning("%s", exc)
        return False
    return True


def recover(bases: Sequence[Source], lineage_of: Callable[[Source], list[Source]],
            required_of: Callable[[Source], set[str]], verify: bool = True,
            target: Target | None = None,
            wanted: Callable[[str], bool] | None = None) -> Recovered:
    """Choose a base and stitch every key. Raises NoCheckpointError when impossible.

    ``bases`` are tried newest first; ``lineage_of(base)`` lists the sources that may
    supply copies, newest first; ``required_of(base)`` names every expert key the
    restored state must contain; ``wanted(key)`` filters the base's non-expert keys
    (a rank of a sharded layout reads only the chunks that overlap its own). Reads only;
    no collective.
    """
    warnings: list[str] = []
    for base in bases:
        try:
            units = _expert_units(required_of(base))
        except ManifestError as exc:  # its view (read on first use) is damaged
            msg = f"{base.name}: {exc}; trying an older checkpoint"
            log.warning(msg)
            warnings.append(msg)
            continue
        try:  # a stored base's non-expert items are read (from their file) here
            ne_keys = [k for k in base.keys if not parse_key(k).is_expert
                       and (wanted is None or wanted(k))]
        except ManifestError as exc:
            msg = f"{base.name}: {exc}; trying an older checkpoint"
            log.warning(msg)
            warnings.append(msg)
            continue
        [(values, bad)] = read_all([(base, ne_keys)], verify, target)
        if bad:
            msg = (f"{base.name}: {len(bad)} non-expert item(s) corrupt or missing "
                   f"(e.g. {bad[0]}); trying an older checkpoint")
            log.warning(msg)
            warnings.append(msg)
            continue
        unit_source = _stitch(units, lineage_of(base), values, warnings, verify, target)
        return Recovered(values=values, base=base, unit_source=unit_source, warnings=warnings)
    raise CorruptCheckpointError(
        "every committed checkpoint has corrupt or missing non-expert state: "
        + "; ".join(warnings) + ". Run `moepec verify PATH` to see the damage")


def _expert_units(required: set[str]) -> dict[Unit, set[str]]:
    """The expert keys of ``required`` grouped by unit."""
    units: dict[Unit, set[str]] = defaultdict(set)
    for k in required:
        info = parse_key(k)
        if info.is_expert:
            units[(info.layer, info.expert, info.part)].add(k)
    return units


def _stitch(units: Mapping[Unit, set[str]], lineage: Sequence[Source],
            values: dict[str, torch.Tensor], warnings: list[str], verify: bool,
            target: Target | None = None) -> dict[Unit, Source]:
    """Read every unit whole from its newest intact copy in ``lineage`` into ``values``;
    a bad copy falls back to the next older one. Returns each unit's source."""
    unit_source: dict[Unit, Source] = {}
    pending = _candidates(units, lineage)
    while pending:
        by_src: dict[int, list[Unit]] = defaultdict(list)
        for u, cands in pending.items():
            if not cands:
                raise NoCheckpointError(
                    f"no intact copy left of expert {u[1]} of MoE layer {u[0]} ({u[2]}); "
                    f"the checkpoints under this path cannot restore it — restore an "
                    f"older path or start from scratch")
            by_src[id(cands[0])].append(u)
        groups = list(by_src.values())  # one read per source: its units in one pass
        reads = read_all([(pending[g[0]][0], [k for u in g for k in sorted(units[u])])
                          for g in groups], verify, target)
        for group, (good, bad) in zip(groups, reads, strict=True):
            src = pending[group[0]][0]
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
    return unit_source


def held_experts(keys: Mapping[str, Item]):  # noqa: ANN201 - a set-like keys view
    """A source's keys for set operations with expert keys: a manifest's expert keys alone
    (its non-expert items are not read: store.items.Items), all keys of any other
    mapping."""
    return keys.expert_keys() if isinstance(keys, Items) else keys.keys()


def _candidates(units: Mapping[Unit, set[str]], lineage: Sequence[Source]
                ) -> dict[Unit, list[Source]]:
    """Per unit, the sources of ``lineage`` holding all its keys, newest first (set
    operations per source, not per unit and source: a K=1 view of E experts has E+1
    sources and E units per layer). A manifest's non-expert items are never read here."""
    required = set().union(*units.values())
    holders: dict[str, list[int]] = defaultdict(list)
    for i, src in enumerate(lineage):
        for key in required & held_experts(src.keys):
            holders[key].append(i)
    out: dict[Unit, list[Source]] = {}
    for u, keys in units.items():
        held = set.intersection(*(set(holders.get(k, ())) for k in keys)) if keys else set()
        out[u] = [lineage[i] for i in sorted(held)]
    return out


def lost_tokens(rec: Recovered) -> tuple[list[list[int]], list[list[int]]]:
    """(counts at the base, counts at each expert's restored weights copy)."""
    at_base = [list(row) for row in rec.base.counts]
    at_copy = [list(row) for row in at_base]
    for (layer, expert, part), src in rec.unit_source.items():
        # The weights decide what training progress an expert keeps; with
        # pec_scope="optimizer" weights are always fresh and only moments are stale.
        if part == "model":
            at_copy[layer][expert] = src.counts[layer][expert]
    return at_base, at_copy
