"""Checkpoints striped over replica groups: each group's root holds its part of every
checkpoint, and the parts of one checkpoint together hold all of it.

Each group writes its part into its own root under the usual commit rule (its manifest
last), so a root never holds a half-committed part. A striped checkpoint is *whole*
when every part of it is committed (:func:`wholes`: the parts of one epoch, step and
quorum); only whole ones are restored. Its lineage is the union of its parts' lineages
(each a chain of parents in its own root), so an expert unit comes from its newest copy
in any root. The manager's restore (:func:`restore_striped`) and the persister's
retention (:func:`moepec.store.parts.protected`, which keeps this root's part of the newest whole one) read
the other groups' roots and never write there.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch

from moepec.errors import ManifestError, NoCheckpointError
from moepec.keys import parse_key
from moepec.ram.snapshot import Snapshot
from moepec.recovery import restore as single
from moepec.recovery.outcome import RestoreContext, RestoreOutcome
from moepec.recovery.stitch import Recovered, Source, Tier, held_experts, storage_source
from moepec.recovery.views import same_runs, usable_manifests
from moepec.store.committed import Committed
from moepec.store.lineage import lineage
from moepec.store.manifest import Manifest
from moepec.store.parts import Whole, wholes
from moepec.store.storage import Storage

log = logging.getLogger(__name__)


def _composite(whole: Whole, sources: Sequence[Source], own: int) -> Source:
    """One source over the parts of ``whole``: each key read from the part that holds it.
    Its bookkeeping is this root's part's (its seq orders this root), else the first's."""
    where: dict[str, int] = {}
    keys = {}
    for i, src in enumerate(sources):
        for k, item in src.keys.items():
            if k not in where:
                where[k], keys[k] = i, item

    def split(names) -> dict[int, list[str]]:
        by: dict[int, list[str]] = defaultdict(list)
        for k in names:
            by[where[k]].append(k)
        return by

    def read(targets: dict[str, torch.Tensor]) -> None:
        for i, names in split(targets).items():
            sources[i].read({k: targets[k] for k in names})

    def map_(names, verify):
        values: dict[str, torch.Tensor] = {}
        bad: list[str] = []
        for i, part in split(names).items():
            v, b = sources[i].map(part, verify)  # type: ignore[misc]
            values.update(v)
            bad += b
        return values, bad

    mine = next((i for i, (r, _) in enumerate(whole.parts) if r == own), 0)
    total = [0]

    def stored_bytes() -> int:
        if not total[0]:
            total[0] = sum(s.stored_bytes() for s in sources if s.stored_bytes is not None)
        return total[0]

    return Source(name=whole.name, tier=Tier.STORAGE, meta=sources[mine].meta, keys=keys,
                  read=read, stored_bytes=stored_bytes,
                  map=map_ if all(s.map is not None for s in sources) else None)


class StripedViews:
    """The whole checkpoints over all groups' roots as recovery candidates (and a RAM
    snapshot): ``bases`` newest first, with ``lineage_of`` and ``required_of`` for
    ``recover``; ``wants``: the keys this rank restores (all, offline)."""

    def __init__(self, storages: Sequence[Storage], manifests: Sequence[Mapping[str, Manifest]],
                 ram: Source | None = None, wants: Callable[[str], bool] = lambda k: True
                 ) -> None:
        self.storages, self.manifests, self.wants = storages, manifests, wants
        self._sources: dict[tuple[int, str], Source] = {}
        self.wholes: dict[str, Whole] = {}
        self.bases: list[Source] = []
        for whole in wholes(manifests):
            parts = [self._source(r, m.name) for r, m in whole.parts]
            try:  # reads every part's non-expert items (from their files)
                base = _composite(whole, parts, own=0)
            except ManifestError as exc:
                log.warning("not restoring %s: %s", whole.name, exc)
                continue
            if self._covered(base, whole):
                self.wholes[base.name] = whole
                self.bases.append(base)
        self._add_ram(ram)
        self.order = {b.name: len(self.bases) - i for i, b in enumerate(self.bases)}

    def _add_ram(self, ram: Source | None) -> None:
        """This group's RAM snapshot as a base, newest first (before a whole checkpoint of
        the same step: it holds K_snapshot experts), its older experts from the newest
        whole checkpoint of its epoch not after it (the anchor). Not without an anchor:
        which older copies are of its history is unknown then."""
        if ram is None or not ram.complete or ram.meta.part is None:
            return
        epoch = ram.meta.part["epoch"]
        anchor = next((b for b in self.bases if b.step <= ram.step
                       and (self.wholes[b.name].parts[0][1].meta.part or {}).get("epoch")
                       == epoch), None)
        if anchor is None:
            log.info("not restoring the RAM snapshot of step %d: no whole checkpoint of its "
                     "epoch on storage to take its other experts from", ram.step)
            return
        self.wholes[ram.name] = self.wholes[anchor.name]
        at = next(i for i, b in enumerate(self.bases) if b.step <= ram.step)
        self.bases.insert(at, ram)

    def _source(self, root: int, name: str) -> Source:
        key = (root, name)
        if key not in self._sources:
            self._sources[key] = storage_source(self.storages[root], self.manifests[root][name])
        return self._sources[key]

    def _covered(self, base: Source, whole: Whole) -> bool:
        """Whether every expert unit of the view has a copy in the lineage (a quorum change
        after which the full checkpoint never became whole leaves units without one)."""
        try:
            required = self.required_of(base, whole)
        except ManifestError:
            return True  # recover() reports and skips a damaged view
        held = set(base.keys).union(*(held_experts(s.keys)  # no part's non-expert items
                                      for s in self.lineage_of(base, whole)))
        missing = required - held
        if missing:
            log.warning("not restoring %s: no copy of %s in the groups' roots (the full "
                        "checkpoint after a quorum change is incomplete)", base.name,
                        sorted(missing)[0])
        return not missing

    def lineage_of(self, base: Source, whole: Whole | None = None) -> list[Source]:
        """Every part's chain of parents in its root (one run lineage each), newest step
        first; a RAM base first, before its anchor's."""
        whole = whole or self.wholes[base.name]
        out: list[Source] = [base] if base.tier == Tier.RAM else []
        for r, m in whole.parts:
            chain = [self._source(r, n) for n in lineage(self.manifests[r], m.name)]
            out += same_runs(chain[0], chain)
        return sorted(out, key=lambda s: (s.step, s.tier == Tier.RAM), reverse=True)

    def required_of(self, base: Source, whole: Whole | None = None) -> set[str]:
        """Every key of the parts' views this rank restores (raises ManifestError)."""
        whole = whole or self.wholes[base.name]
        keys = set().union(*(set(m.view) for _, m in whole.parts))
        if base.tier == Tier.RAM:
            keys |= set(base.keys)
        return {k for k in keys if self.wants(k)}

    def head_for(self, base: Source) -> Manifest | None:
        """This root's part of ``base``: the parent of this root's next checkpoint."""
        return self.wholes[base.name].part_in(0)

    def seq_of(self, base: Source) -> int:
        """This root's checkpoint sequence at ``base`` (recovery records since then count):
        its part's, else its newest checkpoint not after the base's step."""
        head = self.head_for(base)
        if base.tier == Tier.RAM:
            return base.seq  # this root's numbering: the manager's own snapshot
        if head is not None:
            return head.seq
        older = [m.seq for m in self.manifests[0].values() if m.step <= base.step]
        return max(older, default=-1)


def open_roots(ctx: RestoreContext, found: Committed, peers: Sequence[Storage],
               peer_found: Sequence[Committed], ram: Source | None = None
               ) -> StripedViews | None:
    """The views over this root (``ctx.storage``, ``found``) and the peers' roots (and this
    group's RAM snapshot); None when no root holds a whole checkpoint."""
    manifests = [usable_manifests(found), *(usable_manifests(f) for f in peer_found)]
    views = StripedViews([ctx.storage, *peers], manifests, ram, ctx.catalog.wants)
    if not views.bases:
        if any(manifests):
            raise NoCheckpointError(
                f"the replica groups' roots ({ctx.storage.url} and {len(peers)} more) hold "
                f"parts of checkpoints but no whole one (every part committed)")
        return None
    return views


def restore_striped(ctx: RestoreContext, found: Committed, peers: Sequence[Storage],
                    peer_found: Sequence[Committed],
                    ram: Snapshot | Sequence[Snapshot] | None = None) -> RestoreOutcome | None:
    """Restore the newest whole striped checkpoint over all groups' roots, or this group's
    newer RAM snapshot (its shares complete over the group's ranks; older experts from the
    roots). Collective over this group's ranks."""
    views = open_roots(ctx, found, peers, peer_found, single.gather_ram(ctx, ram))
    if views is None:
        return None
    single.check_structure(ctx, views.bases[0].meta)
    rec = single.agreed_recover(ctx, views, order=lambda b: views.order[b.name])
    ledger, lost = single.account(ctx, rec, since_seq=views.seq_of(rec.base))
    sources, units_from = single.where_from(rec)
    return RestoreOutcome(values=rec.values, base=rec.base, head=views.head_for(rec.base),
                          ledger=ledger, lost=lost, sources=sources, units_from=units_from,
                          warnings=rec.warnings)


def stitched_manifest(views: StripedViews, rec: Recovered) -> Manifest:
    """A manifest standing for the whole checkpoint ``rec`` restored (offline export): its
    first part's bookkeeping, the whole's name, a view naming where each key came from."""
    first = views.wholes[rec.base.name].parts[0][1]
    where = {}
    for k in rec.values:
        info = parse_key(k)
        src = rec.unit_source.get((info.layer, info.expert, info.part)) if info.is_expert \
            else None
        where[k] = src.name if src is not None else rec.base.name
    return dataclasses.replace(first, name=rec.base.name, view=where)
