"""CheckpointManager: the one object a training loop talks to.

Per checkpoint (``step`` when due), on the training thread:
  1. sum the routing counts observed since the last checkpoint over ranks;
  2. choose the experts (K_snapshot to RAM, K_persist of them to storage);
  3. decide this rank's share of the items (the write plan);
  4. start the RAM snapshot (returns at once when asynchronous) and hand it to the
     persist worker.
``wait_for_snapshot`` must be called before ``optimizer.step()``: it blocks only
if the copy of the previous checkpoint has not finished, so weights are never
mutated under a copy. ``restore`` stitches the newest view (RAM where the
process survived, else storage) with :func:`moepec.recovery.restore.restore_state` and
applies its outcome. ``close`` waits for the persist in flight. Its parts: the
schedule of experts and K (``schedule``), the snapshot builder (``snapshots``), the
RAM tier's placement (``ram_setup``), the callbacks' records (``reporting``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from moepec.errors import CheckpointError, ConfigError
from moepec.events import CheckpointEvent, CommitRecord, SnapshotRecord
from moepec.hooks import FaultHooks
from moepec.keys import next_seq
from moepec.manager.claim import RootClaim
from moepec.manager.config import CheckpointConfig, PecScope
from moepec.manager.layout import Layout, destroy_groups, find_experts
from moepec.manager.live import LivePeers
from moepec.manager.persist_policy import may_persist
from moepec.manager.ram_setup import RamSetup
from moepec.manager.reporting import Reporter
from moepec.manager.routing import RoutingCounter
from moepec.manager.schedule import ExpertSchedule
from moepec.manager.snapshots import SnapshotBuilder
from moepec.policy.plt import PLTLedger
from moepec.ram.shm import admissible
from moepec.ram.snapshot import BufferPool, Snapshot, Snapshotter
from moepec.recovery.outcome import RestoreContext, RestoreOutcome, RestoreReport
from moepec.recovery.records import write_recovery
from moepec.recovery.restore import persist_on_failure, restore_state
from moepec.recovery.stitch import Tier
from moepec.recovery.striped import restore_striped
from moepec.state.catalog import StateCatalog
from moepec.state.checkpoint_keys import CheckpointKeys
from moepec.state.experts import ExpertSpec, structure_of
from moepec.state.optimizers import Optimizers, joint
from moepec.store.committed import committed_manifests
from moepec.store.meta import Part
from moepec.store.persist import Persister
from moepec.store.storage import Storage, no_gc

log = logging.getLogger(__name__)


class CheckpointManager(LivePeers):
    """Partial-experts, two-level, sharded checkpointing for one training job.

    Construct on every rank (after ``torch.distributed`` is initialised when
    running with several ranks) with the model and optimizer the loop uses: one torch
    optimizer, several over disjoint parameters (a list: each one's per-expert state goes
    with its expert), or None.
    Raises ConfigError for invalid settings and ExpertDiscoveryError when the
    experts cannot be found unambiguously (pass ``expert_spec``), or none are found and
    ``config.require_experts`` (by default) asks for them.

    What the manager does is told through callbacks (see :mod:`moepec.events`; each
    runs on the thread its record names, and an exception it raises is logged, never
    raised): ``on_checkpoint(CheckpointEvent)`` when a checkpoint starts,
    ``on_snapshot(SnapshotRecord)`` when its RAM copy is complete,
    ``on_commit(CommitRecord)`` when it is committed to storage. ``hooks``
    (:class:`moepec.FaultHooks`) are fault-injection seams, for tests.
    """

    def __init__(self, model: nn.Module, optimizer: Optimizers,
                 config: CheckpointConfig, *, extra_state: Mapping[str, Any] | None = None,
                 expert_spec: ExpertSpec | None = None,
                 expert_parallel: tuple[int, int] | None = None,
                 on_checkpoint: Callable[[CheckpointEvent], None] | None = None,
                 on_snapshot: Callable[[SnapshotRecord], None] | None = None,
                 on_commit: Callable[[CommitRecord], None] | None = None,
                 hooks: FaultHooks | None = None) -> None:
        self.config = config
        self._reporter = Reporter(on_checkpoint, on_snapshot)
        self._on_commit, self._hooks = on_commit, hooks
        self._init_state(model, optimizer, extra_state, expert_spec, expert_parallel)
        self._init_tiers()
        self.schedule = ExpertSchedule(self.n_experts, config)
        self._builder = SnapshotBuilder(config, self.catalog, self.keys, self.schedule,
                                        self.structure, self.rank, self.world_size)
        self.routing = RoutingCounter(self.n_experts, self.distributed)
        self.seq = next_seq(n for n, _ in self.storage.list_checkpoints())
        self._last_step = -1
        self._part: Part | None = None
        self.restores: list[RestoreReport] = []
        self._closed = False

    def _init_state(self, model: nn.Module, optimizer: Optimizers,
                    extra_state: Mapping[str, Any] | None, spec: ExpertSpec | None,
                    expert_parallel: tuple[int, int] | None) -> None:
        """Ranks and the expert-parallel layout; find the experts and catalogue the
        training state."""
        layout = Layout.current(expert_parallel)
        self.distributed, self.rank, self.world_size = (layout.distributed, layout.rank,
                                                        layout.world_size)
        self.ep_rank, self.ep_size = layout.ep_rank, layout.ep_size
        self.emap, self.n_experts = find_experts(model, spec, self.config, self.ep_size)
        self.catalog = StateCatalog(model, joint(optimizer), self.emap, extra_state,
                                    ep_rank=self.ep_rank, ep_size=self.ep_size)
        self.structure = structure_of(model, self.emap, self.ep_size)
        self.keys = CheckpointKeys(self.catalog, pec_scope=self.config.pec_scope,
                                   rank=self.rank, world_size=self.world_size,
                                   ep_size=self.ep_size, write_mode=self.config.write_mode)

    def _init_tiers(self) -> None:
        """Storage, the RAM snapshotter and the persist worker."""
        config = self.config
        self.storage = Storage(config.path, config.storage_options, config.serialization)
        self.peers = [Storage(p, config.storage_options, config.serialization)
                      for p in config.peer_paths]
        """The other replica groups' roots (striped checkpoints): read, never written."""
        self._init_run()
        # A dedicated group for the persist worker: its collectives never interleave
        # with the training thread's (STYLE.md: no collectives off the main thread
        # except on a dedicated group).
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=config.timeout_s))
                       if self.distributed else None)
        ram = RamSetup(config, self.storage, self.catalog, self.rank, self.world_size,
                       self.distributed).build(self._hooks)
        self.ram_dir = ram.ram_dir
        """Where this manager's RAM snapshots live (None: in the process)."""
        self.ram_tier, self.replicator = ram.tier, ram.replicator
        self.persister = Persister(self.storage, run_id=self.run_id, rank=self.rank,
                                   world_size=self.world_size, group=self._group,
                                   background=config.async_persist, timeout_s=config.timeout_s,
                                   keep_last=config.keep_last, release=self.ram_tier.release,
                                   guard=lambda: self.root_claim.check(),
                                   hooks=self._hooks, on_commit=self._on_commit,
                                   peers=self.peers)

    def _init_run(self) -> None:
        """This run's id and its claim on the root (the lease: taken at the first save or
        restore). Collective: rank 0 draws the id."""
        self.root_claim = RootClaim(self.storage, rank=self.rank, distributed=self.distributed,
                                    lease_timeout_s=self.config.lease_timeout_s,
                                    takeover=self.config.takeover)
        self.run_id = self.root_claim.run_id
        self.runs = [self.run_id]

    # -- the training-loop API --------------------------------------------------
    def observe_routing(self, counts: Sequence[Any]) -> None:
        """Add this rank's token assignments per (MoE layer, expert) of one step.

        ``counts[l]`` is a sequence or int tensor of length N_l. Cheap: no collective
        (counts are summed over ranks at the next checkpoint).
        """
        self.routing.add(counts)

    def wait_for_snapshot(self) -> None:
        """Block until the RAM snapshot in progress is complete. Call before optimizer.step().

        Raises PersistError (once) for a background persist that failed since the last
        call; the snapshot is complete all the same (it is finished first), so training
        may catch the error and go on to the optimizer step.
        """
        self._finish_snapshot()
        self.persister_check()

    def step(self, step: int) -> bool:
        """Checkpoint the state after optimizer step ``step`` if one is due.

        Returns at once when asynchronous (True if a checkpoint was started).
        Raises PersistError for an earlier background failure: after taking this
        checkpoint's RAM snapshot, so a failing storage never stops the RAM tier.
        """
        if not self.due(step):
            self.persister_check()
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        """Start a checkpoint of the current state, labelled ``step``, now.

        Training thread, every rank (the routing counts are summed over ranks here).
        """
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        t0 = time.perf_counter()
        if not self.root_claim.ready or self.root_claim.paused:
            self.root_claim.claim()
        self._finish_snapshot()
        counts = self.routing.take()
        self.schedule.observe(counts)
        persist, pending_error = may_persist(self.persister, self.root_claim,
                                             self.config.busy_policy, step)
        # The persister is idle here whenever this checkpoint is to be persisted, so the
        # committed view is current.
        part, self._part = self._part, None
        full = self._builder.is_full(persist, self.persister.head, self.persister.head_view,
                                     part)
        snap, sources = self._builder.take(step, self.seq, full, persist, run_id=self.run_id,
                                           runs=self.runs, part=part)
        self.ram_tier.start(snap, sources)
        started = self._reporter.started(snap, sources, full=full, persist=persist,
                                         k=(self.k_persist, self.k_snapshot))
        self.seq += 1
        self.schedule.index += 1
        self._last_step = step
        copied = None
        if not self.config.async_snapshot:
            copied = self._finish_snapshot(notify=False)
        try:
            if persist:
                self.persister.submit(snap)
        finally:
            self._reporter.checkpoint(started, time.perf_counter() - t0)
            if copied is not None:
                self._reporter.snapshot(copied)
        if pending_error is not None:
            raise pending_error

    def close(self) -> None:
        """Wait for the snapshot and persist in flight; re-raise any background error.
        Idempotent. Stops what the manager started, in this order: the snapshot copy,
        the replica thread, the RAM tier (its slots go with a clean close), the persist
        thread, the lease's heartbeat thread, then the manager's own process groups
        (nothing is left for interpreter exit to tear down)."""
        if self._closed:
            return
        self._closed = True
        # Shared-memory slots go with a clean close; closed while an exception is being
        # handled (the run failed), they stay for the restarted worker.
        clean = sys.exc_info()[0] is None
        try:
            self._reporter.copied(self.ram_tier.finish())
        finally:
            try:
                if self.replicator is not None:
                    self.replicator.close()
                self.ram_tier.close(unlink=clean)
                self.persister.close()
            finally:
                self.root_claim.release()
                groups = [self._group] + ([self.replicator.group] if self.replicator else [])
                self._group = None
                destroy_groups(groups)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def persister_check(self) -> None:
        """Re-raise (once) a background persist's error as PersistError."""
        self.persister.check()

    def wait_for_persist(self, timeout_s: float | None = None) -> None:
        """Block until the persist in flight (if any) has finished, committed or not.

        Training thread. Its error, if it failed, stays pending: raised by the next
        ``step``, ``wait_for_snapshot`` or ``close``. Raises CheckpointError when it does not
        finish within ``timeout_s`` (default: ``config.timeout_s``).
        """
        self.persister.wait_idle(timeout_s)

    @property
    def k_persist(self) -> int:
        """Experts per MoE layer written to storage at each checkpoint (now)."""
        return self.schedule.k_persist

    @property
    def k_snapshot(self) -> int:
        """Experts per MoE layer copied to RAM at each checkpoint (now)."""
        return self.schedule.k_snapshot

    @property
    def k_history(self) -> list[list[int]]:
        """[step, K_persist] at each change of K_persist (as the manifests record it)."""
        return self.schedule.k_history

    @property
    def ledger(self) -> PLTLedger:
        """The PLT ledger of this run's lineage (lost tokens so far)."""
        return self.schedule.ledger

    def set_k(self, k_persist: int, k_snapshot: int | None = None) -> None:
        """Save ``k_persist`` experts per layer to storage (``k_snapshot``, by default the
        larger of it and the current K_snapshot, to RAM) from the next checkpoint on, as
        dynamic K does after a recovery (recorded in the manifests' ``k_history``).

        Training thread, every rank with the same values. Raises ConfigError unless
        1 <= k_persist <= k_snapshot <= the experts per MoE layer.
        """
        self.schedule.set_k(k_persist, k_snapshot, self._last_step)

    @property
    def ram(self) -> Snapshot | None:
        """The newest complete RAM snapshot (what a restore in this process may use)."""
        return self.ram_tier.newest

    @property
    def snapshotter(self) -> Snapshotter:
        return self.ram_tier.snapshotter

    @property
    def pool(self) -> BufferPool:
        return self.ram_tier.pool

    @property
    def fenced(self) -> str | None:
        """Why this run no longer writes to its checkpoint root (another run took over its
        lease), or None. Training and RAM snapshots go on; nothing in the root is written,
        renamed or deleted by this run again."""
        return self.persister.fenced

    @property
    def last_persist_failed(self) -> bool:
        """Whether this run's newest persist did not commit (failed, or refused because
        the run was fenced). Any rank; final after ``close()``."""
        records = self.persister.records
        return bool(records) and not records[-1].committed

    @property
    def last_committed(self) -> str | None:
        """The newest committed checkpoint this run continues: its own last commit, or the
        one it restored from; None when there is none. Any rank, any time; final after
        ``close()`` (a persist that failed never changes it)."""
        return self.persister.head

    @property
    def blocked_seconds(self) -> float:
        """Total time the training loop spent blocked in step() and wait_for_snapshot()."""
        return self._reporter.blocked

    # -- restore ----------------------------------------------------------------
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
        if step is not None and self.peers:
            raise ConfigError("restore(step=...) with peer_paths: restore the newest view")
        t0 = time.perf_counter()
        self._drain()
        with no_gc():  # many small objects, a large heap: see store.storage.no_gc
            return self._restore(t0, step)

    def _restore(self, t0: float, upto: int | None = None) -> RestoreReport | None:
        found = committed_manifests(self.storage)
        self.seq = max(self.seq, next_seq(n for n, _ in found.listing))
        limit = sys.maxsize if upto is None else upto  # restore(step): nothing newer
        usable = replace(found, manifests={n: m for n, m in found.manifests.items()
                                           if m.step <= limit})
        head = usable.manifests.get(usable.newest) if usable.manifests else None
        ram = self.ram_tier.recovered(lambda meta: meta.step <= limit and admissible(
            meta, head.meta if head is not None else None))
        if self.peers:  # striped over replica groups: whole over all roots (and RAM)
            outcome = restore_striped(self._restore_context(), found, self.peers,
                                      [committed_manifests(p) for p in self.peers], ram)
        else:
            outcome = restore_state(self._restore_context(), usable, ram)
        # The lease once the restore succeeded: a refused restore leaves the root as it was.
        self.root_claim.claim()
        if outcome is None:
            self.ram_tier.settle(-1, keep=False)
            return None
        self._apply(outcome)
        base = outcome.base
        kept = self.ram_tier.settle(base.seq, keep=base.tier == Tier.RAM)
        persisted = persist_on_failure(kept, found, persister=self.persister,
                                       ram_tier=self.ram_tier, distributed=self.distributed,
                                       paused=bool(self.root_claim.paused))
        report = outcome.report(plt=self.ledger.plt(), seconds=time.perf_counter() - t0,
                                persisted_on_failure=persisted)
        if self.rank == 0 and self.root_claim.holds():
            write_recovery(self.storage, report, base_seq=base.seq, next_seq=self.seq,
                           k_persist=self.k_persist)
        self.restores.append(report)
        log.info("restored step %d from %s (%s); lost %d token assignments, PLT %.4f%%",
                 report.step, report.checkpoint, report.tier, report.lost_total,
                 100 * report.plt)
        return report

    def _drain(self) -> None:
        """Finish the snapshot and persist in flight before restoring; their errors are
        logged (the restore is what matters now)."""
        try:
            self._reporter.copied(self.ram_tier.finish())
        except CheckpointError as exc:
            log.warning("discarding the snapshot in progress: %s", exc)
        self.persister.wait_idle()
        try:
            self.persister.check()
        except CheckpointError as exc:
            log.warning("%s", exc)

    def _restore_context(self) -> RestoreContext:
        return RestoreContext(storage=self.storage, catalog=self.catalog,
                              structure=self.structure, n_experts=self.n_experts,
                              rank=self.rank, world_size=self.world_size,
                              weights_in_view=self.config.pec_scope != PecScope.OPTIMIZER,
                              verify=self.config.verify,
                              read_in_place=self.config.restore_in_place)

    def _apply(self, outcome: RestoreOutcome) -> None:
        """Load the restored values and resume the bookkeeping of the base."""
        shapes = {k: (list(v.shape), str(v.dtype).removeprefix("torch."))
                  for k, v in outcome.values.items()}
        self.catalog.ensure_optimizer_state(shapes)
        self.catalog.load(outcome.values)
        self.keys.invalidate()  # restored optimizer state may be new tensors
        meta = outcome.base.meta
        self.schedule.resume(meta, outcome.ledger)
        # This run continues the base's lineage of runs (restore stitches only within it).
        self.runs = meta.runs_continued_by(self.run_id)
        self.schedule.adjust_k(meta.step, self.rank)
        if outcome.base.tier == Tier.STORAGE and self.ram is not None \
                and self.ram.seq > meta.seq:
            self.ram_tier.drop()  # a snapshot of the abandoned future
        self.persister.set_head(outcome.head)
        self.seq = max(self.seq, meta.seq + 1)  # a RAM base may be newer than any folder
        self._builder.forget_coverage()  # recomputed from the restored head at the next save
        self.routing.reset()

    # -- internals --------------------------------------------------------------
    def _finish_snapshot(self, notify: bool = True) -> SnapshotRecord | None:
        """Wait for the snapshot in flight; its record is delivered (``notify``) or returned."""
        if self.snapshotter.pending is None:
            return None
        t0 = time.perf_counter()
        snap = self.ram_tier.finish()
        self._reporter.waited(time.perf_counter() - t0)
        return self._reporter.copied(snap, notify)
