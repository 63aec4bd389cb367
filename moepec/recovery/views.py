"""The committed checkpoints of a root as recovery sources: usable manifests, the bases to
try, each base's lineage and the keys its view requires.

One definition for both readers of a view: the manager's restore (which adds the RAM
tier on top, ``moepec.recovery.restore``) and the offline export (``recovery.offline``),
so ``moepec export`` writes exactly the state ``CheckpointManager.restore()`` loads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from moepec.errors import NoCheckpointError
from moepec.keys import parse_key
from moepec.recovery.stitch import Recovered, Source, Tier, recover, storage_source
from moepec.store.committed import Committed
from moepec.store.lineage import lineage
from moepec.store.manifest import Manifest
from moepec.store.storage import Storage

log = logging.getLogger(__name__)


def usable_manifests(found: Committed) -> dict[str, Manifest]:
    """The committed manifests a recovery may use; the damaged ones are logged and skipped.

    Raises ManifestFormatError when a newer moepec wrote some checkpoint: skipping it
    would silently restore (or export) an older state than the run has. (A pre-release
    one is damaged: moepec.store.manifest.check_format.)"""
    newer = found.newer_format()
    if newer is not None:
        raise newer
    for name, exc in found.damaged.items():
        log.warning("ignoring %s: %s", name, exc)
    return found.manifests


def same_runs(base: Source, chain: list[Source]) -> list[Source]:
    """The copies of ``chain`` taken by runs of the base's lineage: a checkpoint another
    run wrote into the same root (a second writer, a copied folder) is never stitched in.
    A run continues a lineage by restoring from it (or taking over its lease)."""
    runs = base.meta.run_lineage
    kept = [s for s in chain if s.meta.run_id in runs]
    for s in chain:
        if s.meta.run_id not in runs:
            log.warning("not stitching %s: it was written by run %s, which is not in the "
                        "lineage of %s", s.name, s.meta.run_id or "?", base.name)
    return kept


class StoredViews:
    """The committed checkpoints of one root as recovery candidates (storage tier only).

    ``bases`` are newest first; :meth:`lineage_of` and :meth:`required_of` are the
    callables :func:`moepec.recovery.stitch.recover` takes. Reads nothing until used."""

    def __init__(self, storage: Storage, manifests: Mapping[str, Manifest]) -> None:
        self.manifests = manifests
        self.sources = {n: storage_source(storage, m) for n, m in manifests.items()}
        self.bases = sorted(self.sources.values(), key=lambda s: s.seq, reverse=True)

    def chain(self, head: str) -> list[Source]:
        """``head`` and its committed ancestors, newest first (every run's)."""
        return [self.sources[n] for n in lineage(self.manifests, head)]

    def lineage_of(self, base: Source) -> list[Source]:
        """The sources that may supply copies to ``base``, newest first."""
        return same_runs(base, self.chain(base.name))

    @staticmethod
    def required_of(base: Source) -> set[str]:
        """Every key of ``base``'s view (raises ManifestError when the view is damaged)."""
        assert base.manifest is not None, "a stored base has a manifest"
        return set(base.manifest.view)


@dataclass(frozen=True, slots=True)
class Fallback:
    """An expert unit a recovery took from an older copy than its base's view names."""

    layer: int
    expert: int
    part: str
    """``model`` (weights) or ``optim`` (optimizer state)."""
    source: Source
    """Where it came from."""
    newest: str
    """The checkpoint the base's view names for it (whose copy could not be used)."""

    def __str__(self) -> str:
        return (f"expert {self.expert} of MoE layer {self.layer} ({self.part}) from "
                f"{self.source.name} (step {self.source.step}): its copy in {self.newest} "
                f"is damaged or missing")


def fallbacks(rec: Recovered) -> list[Fallback]:
    """The expert units of a recovery from a storage base that did not come from where the
    base's view says their newest copy is, in (layer, expert, part) order."""
    if rec.base.tier != Tier.STORAGE or rec.base.manifest is None:
        return []
    named: dict[tuple[int, int, str], str] = {}
    for key, src in rec.base.manifest.view.items():
        info = parse_key(key)
        if info.is_expert:
            named.setdefault((info.layer, info.expert, info.part), src)
    return [Fallback(layer=u[0], expert=u[1], part=u[2], source=s, newest=named[u])
            for u, s in sorted(rec.unit_source.items())
            if u in named and s.name != named[u]]


def recover_stored(storage: Storage, found: Committed, verify: bool = True) -> Recovered:
    """Stitch the newest view of the committed checkpoints as a one-process restore would
    (no RAM tier, every key): the newest base whose non-expert state is intact, each
    expert unit from its newest intact copy. Reads only. Raises ManifestFormatError,
    NoCheckpointError (nothing committed, or no intact copy of some expert) and
    CorruptCheckpointError (no base with intact non-expert state)."""
    views = StoredViews(storage, usable_manifests(found))
    if not views.bases:
        raise NoCheckpointError(f"no committed checkpoint under {storage.url}")
    return recover(views.bases, views.lineage_of, views.required_of, verify=verify)

