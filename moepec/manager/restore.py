"""The manager's restore: finish what is in flight, read the committed checkpoints (and
the RAM tier), stitch the newest view with :func:`moepec.recovery.restore.restore_state`,
apply its outcome to the training state and the manager's bookkeeping, and record the
recovery. Methods of :class:`~moepec.manager.manager.CheckpointManager` (this class is
one of its bases); the manager's own sequence of a checkpoint stays in ``manager.py``.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace

from moepec.errors import CheckpointError, ConfigError
from moepec.keys import next_seq
from moepec.manager.config import PecScope
from moepec.ram.shm import admissible
from moepec.recovery.outcome import RestoreContext, RestoreOutcome, RestoreReport
from moepec.recovery.records import write_recovery
from moepec.recovery.restore import persist_on_failure, restore_state
from moepec.recovery.stitch import Tier
from moepec.recovery.striped import restore_striped
from moepec.store.committed import committed_manifests
from moepec.store.reader import release_later
from moepec.store.storage import no_gc

log = logging.getLogger(__name__)


class Restoring:
    """The restore methods of CheckpointManager (which sets the fields they use)."""

    def restore(self, step: int | None = None) -> RestoreReport | None:
        """Restore the newest view into the model, optimizer and extra state; with
        ``step``, the newest view at or before that training step (that step's when whole,
        else an older one; ConfigError with ``peer_paths``).

        Uses RAM snapshots where processes survived (the loop restarted in the same
        process), else storage. Returns None when there is nothing to restore. Raises
        StructureMismatchError (nothing changed, on disk or in memory) for a checkpoint
        of another model, NoCheckpointError / CorruptCheckpointError when no intact copy
        remains. With several ranks, every rank calls it and all restore the same step.
        """
        if step is not None and self._peers:
            raise ConfigError("restore(step=...) with peer_paths: restore the newest view")
        t0 = time.perf_counter()
        self._drain()
        with no_gc():  # many small objects, a large heap: see store.storage.no_gc
            return self._restore(t0, step)

    def _restore(self, t0: float, upto: int | None = None) -> RestoreReport | None:
        found = committed_manifests(self._storage)
        self._seq = max(self._seq, next_seq(n for n, _ in found.listing))
        limit = sys.maxsize if upto is None else upto  # restore(step): nothing newer
        usable = replace(found, manifests={n: m for n, m in found.manifests.items()
                                           if m.step <= limit})
        head = usable.manifests.get(usable.newest) if usable.manifests else None
        ram = self._ram_tier.recovered(lambda meta: meta.step <= limit and admissible(
            meta, head.meta if head is not None else None))
        if self._peers:  # striped over replica groups: whole over all roots (and RAM)
            outcome = restore_striped(self._restore_context(), found, self._peers,
                                      [committed_manifests(p) for p in self._peers], ram)
        else:
            outcome = restore_state(self._restore_context(), usable, ram)
        # The lease once the restore succeeded: a refused restore leaves the root as it was.
        self._root_claim.claim()
        if outcome is None:
            self._ram_tier.settle(-1, keep=False)
            return None
        self._apply(outcome)
        release_later(outcome.values)  # copied in: their mappings go on a helper thread
        self._persister.remember(found.manifests)
        base = outcome.base
        kept = self._ram_tier.settle(base.seq, keep=base.tier == Tier.RAM)
        persisted = persist_on_failure(kept, found, persister=self._persister,
                                       ram_tier=self._ram_tier, distributed=self._distributed,
                                       paused=bool(self._root_claim.paused))
        report = outcome.report(plt=self.ledger.plt(), seconds=time.perf_counter() - t0,
                                persisted_on_failure=persisted)
        if self._rank == 0 and self._root_claim.holds():
            write_recovery(self._storage, report, base_seq=base.seq, next_seq=self._seq,
                           k_persist=self.k_persist)
        log.info("restored step %d from %s (%s); lost %d token assignments, PLT %.4f%%",
                 report.step, report.checkpoint, report.tier, report.lost_total,
                 100 * report.plt)
        return report

    def _drain(self) -> None:
        """Finish the snapshot and persist in flight before restoring; their errors are
        logged (the restore is what matters now)."""
        try:
            self._reporter.copied(self._ram_tier.finish())
        except CheckpointError as exc:
            log.warning("discarding the snapshot in progress: %s", exc)
        self._persister.wait_idle()
        try:
            self._persister.check()
        except CheckpointError as exc:
            log.warning("%s", exc)

    def _restore_context(self) -> RestoreContext:
        return RestoreContext(storage=self._storage, catalog=self._catalog,
                              structure=self._structure, n_experts=self._n_experts,
                              rank=self._rank, world_size=self._world_size,
                              weights_in_view=self._config.pec_scope != PecScope.OPTIMIZER,
                              verify=self._config.verify,
                              read_in_place=self._config.restore_in_place)

    def _apply(self, outcome: RestoreOutcome) -> None:
        """Load the restored values and resume the bookkeeping of the base."""
        self._catalog.ensure_optimizer_state(outcome.values)
        self._catalog.load(outcome.values)
        self._keys.invalidate()  # restored optimizer state may be new tensors
        meta = outcome.base.meta
        self._schedule.resume(meta, outcome.ledger)
        # This run continues the base's lineage of runs (restore stitches only within it).
        self._runs = meta.runs_continued_by(self._run_id)
        # A restore that lost nothing (a complete checkpoint: a planned stop, a clean end)
        # is a resume, not a recovery: K is never raised by it (the run's PLT may be over
        # the budget from earlier faults, and this restore added nothing to it); with
        # dynamic_k_down, the headroom it shows may still lower K.
        self._schedule.adjust_k(meta.step, self._rank, lossless=not any(map(any, outcome.lost)))
        self._last_stepped = None
        newest = self._ram_tier.newest
        if outcome.base.tier == Tier.STORAGE and newest is not None and newest.seq > meta.seq:
            self._ram_tier.drop()  # a snapshot of the abandoned future
        self._persister.set_head(outcome.head)
        self._seq = max(self._seq, meta.seq + 1)  # a RAM base may be newer than any folder
        self._builder.forget_coverage()  # recomputed from the restored head at the next save
        self._routing.reset()
