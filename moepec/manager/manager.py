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
applies its outcome (the methods of ``restore``). ``close`` waits for the persist in
flight. Its parts: the schedule of experts and K (``schedule``), the snapshot builder
(``snapshots``), the RAM tier's placement (``ram_setup``), the callbacks' records
(``reporting``), the replica groups' methods (``live``). Everything the manager holds
is private (a leading underscore); what its owner may read is a property.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn

from moepec.errors import CheckpointError, PersistError
from moepec.events import CheckpointEvent, CommitRecord, SnapshotRecord
from moepec.hooks import FaultHooks
from moepec.keys import next_seq
from moepec.manager.claim import RootClaim
from moepec.manager.config import CheckpointConfig
from moepec.manager.layout import Layout, destroy_groups, find_experts
from moepec.manager.live import LivePeers
from moepec.manager.persist_policy import may_persist
from moepec.manager.ram_setup import RamSetup
from moepec.manager.reporting import Reporter
from moepec.manager.restore import Restoring
from moepec.manager.routing import RoutingCounter
from moepec.manager.schedule import ExpertSchedule
from moepec.manager.snapshots import SnapshotBuilder
from moepec.manager.stop import StopSignals
from moepec.manager.stopping import Stopping
from moepec.policy.plt import PLTLedger
from moepec.ram.jobs import job_dir
from moepec.state.catalog import StateCatalog
from moepec.state.checkpoint_keys import CheckpointKeys
from moepec.state.experts import ExpertSpec, structure_of
from moepec.state.optimizers import Optimizers, joint
from moepec.store.meta import Part
from moepec.store.persist import Persister
from moepec.store.storage import Storage

log = logging.getLogger(__name__)


class CheckpointManager(Restoring, LivePeers, Stopping):
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
        self._config = config
        self._reporter = Reporter(on_checkpoint, on_snapshot)
        self._on_commit, self._hooks = on_commit, hooks
        self._init_state(model, optimizer, extra_state, expert_spec, expert_parallel)
        # Before the tiers: a schedule that cannot start (a selection policy no longer
        # registered) must not leave their threads and slots behind.
        self._schedule = ExpertSchedule(self._n_experts, config)
        self._init_tiers()
        self._builder = SnapshotBuilder(config, self._catalog, self._keys, self._schedule,
                                        self._structure, self._rank, self._world_size)
        self._routing = RoutingCounter(self._n_experts, self._distributed)
        self._seq = next_seq(n for n, _ in self._storage.list_checkpoints())
        self._last_step = -1
        self._last_stepped: int | None = None
        """The last step passed to step() since construction or the last restore."""
        self._complete_step: int | None = None
        """The step of the newest checkpoint that holds every expert and went to storage."""
        self._asked_stop = False
        self._stopped = None
        self._deferred_error: PersistError | None = None
        self._part: Part | None = None
        self._closed = False

    def _init_state(self, model: nn.Module, optimizer: Optimizers,
                    extra_state: Mapping[str, Any] | None, spec: ExpertSpec | None,
                    expert_parallel: tuple[int, int] | None) -> None:
        """Ranks and the expert-parallel layout; find the experts and catalogue the
        training state."""
        layout = Layout.current(expert_parallel)
        self._distributed, self._rank, self._world_size = (layout.distributed, layout.rank,
                                                           layout.world_size)
        ep_size = layout.ep_size
        self._emap, self._n_experts = find_experts(model, spec, self._config, ep_size)
        self._catalog = StateCatalog(model, joint(optimizer), self._emap, extra_state,
                                     ep_rank=layout.ep_rank, ep_size=ep_size)
        self._structure = structure_of(model, self._emap, ep_size)
        self._keys = CheckpointKeys(self._catalog, pec_scope=self._config.pec_scope,
                                    rank=self._rank, world_size=self._world_size,
                                    ep_size=ep_size, write_mode=self._config.write_mode)

    def _init_tiers(self) -> None:
        """Storage, the RAM snapshotter and the persist worker."""
        config = self._config
        self._storage = Storage(config.path, config.storage_options, config.serialization)
        self._peers = [Storage(p, config.storage_options, config.serialization)
                       for p in config.peer_paths]
        """The other replica groups' roots (striped checkpoints): read, never written."""
        self._init_run()
        # A dedicated group for the persist worker: its collectives never interleave
        # with the training thread's (STYLE.md: no collectives off the main thread
        # except on a dedicated group).
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=config.timeout_s))
                       if self._distributed else None)
        self._stop = StopSignals(config.stop_signals, distributed=self._distributed,
                                 timeout_s=config.timeout_s)
        ram = RamSetup(config, self._storage, self._catalog, self._rank, self._world_size,
                       self._distributed).build(self._hooks)
        self._ram_dir = ram.ram_dir
        """Where this manager's RAM snapshots live (None: in the process): ``ram_dir``
        resolved (``"auto"``: the default folder when the tier fits there)."""
        self._ram_tier, self._replicator = ram.tier, ram.replicator
        self._persister = Persister(self._storage, run_id=self._run_id, rank=self._rank,
                                    world_size=self._world_size, group=self._group,
                                    background=config.async_persist,
                                    timeout_s=config.timeout_s, keep_last=config.keep_last,
                                    release=self._ram_tier.release,
                                    guard=lambda: self._root_claim.check(),
                                    hooks=self._hooks, on_commit=self._on_commit,
                                    peers=self._peers)

    def _init_run(self) -> None:
        """This run's id and its claim on the root (the lease: taken at the first save or
        restore). Collective: rank 0 draws the id."""
        self._root_claim = RootClaim(self._storage, rank=self._rank,
                                     distributed=self._distributed,
                                     lease_timeout_s=self._config.lease_timeout_s,
                                     takeover=self._config.takeover)
        self._run_id = self._root_claim.run_id
        self._runs = [self._run_id]

    # -- the training-loop API --------------------------------------------------
    def observe_routing(self, counts: Sequence[Any]) -> None:
        """Add this rank's token assignments per (MoE layer, expert) of one step.

        ``counts[l]`` is a sequence or int tensor of length N_l. Cheap: no collective
        (counts are summed over ranks at the next checkpoint).
        """
        self._routing.add(counts)

    def wait_for_snapshot(self) -> None:
        """Block until the RAM snapshot in progress is complete. Call before optimizer.step().

        Raises PersistError (once) for a background persist that failed since the last
        call; the snapshot is complete all the same (it is finished first), so training
        may catch the error and go on to the optimizer step.
        """
        self._finish_snapshot()
        self._check_persist()

    def step(self, step: int) -> bool:
        """Checkpoint the state after optimizer step ``step`` if one is due.

        Returns at once when asynchronous (True if a checkpoint was started).
        Raises PersistError for an earlier background failure: after taking this
        checkpoint's RAM snapshot, so a failing storage never stops the RAM tier.
        """
        self._last_stepped = step
        if not self.due(step):
            self._check_persist()
            return False
        self.save(step)
        return True

    def due(self, step: int) -> bool:
        """Whether :meth:`step` checkpoints after optimizer step ``step`` (every
        ``config.interval`` steps). Any rank, any thread; no side effect."""
        return (step + 1) % self._config.interval == 0

    def save(self, step: int, *, final: bool = False) -> None:
        """Start a checkpoint of the current state, labelled ``step``, now.

        ``final=True``: a complete checkpoint (every expert) that goes to storage whatever
        ``busy_policy`` says (and even after an earlier persist failed), as
        :meth:`should_stop` and a clean :meth:`close` write; a door whose framework marks
        its last save calls it. ``close()`` (or :meth:`wait_for_persist`) waits for its
        commit. Training thread, every rank (the routing counts are summed over ranks here).
        """
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        t0 = time.perf_counter()
        if not self._root_claim.ready or self._root_claim.paused:
            self._root_claim.claim()
        self._finish_snapshot()
        counts = self._routing.take()
        self._schedule.observe(counts)
        persist, pending_error = may_persist(self._persister, self._root_claim,
                                             self._config.busy_policy, step, final=final)
        # The persister is idle here whenever this checkpoint is to be persisted, so the
        # committed view is current.
        part, self._part = self._part, None
        full = final or self._builder.is_full(persist, self._persister.head,
                                              self._persister.head_view, part)
        snap, sources = self._builder.take(step, self._seq, full, persist, run_id=self._run_id,
                                           runs=self._runs, part=part)
        self._ram_tier.start(snap, sources)
        started = self._reporter.started(snap, sources, full=full, persist=persist,
                                         k=(self.k_persist, self.k_snapshot))
        self._seq += 1
        self._schedule.index += 1
        self._last_step = step
        if full and persist:
            self._complete_step = step
        copied = None
        if not self._config.async_snapshot:
            copied = self._finish_snapshot(notify=False)
        try:
            if persist:
                self._persister.submit(snap)
        finally:
            self._reporter.checkpoint(started, time.perf_counter() - t0)
            if copied is not None:
                self._reporter.snapshot(copied)
        if pending_error is not None:
            raise pending_error

    def close(self) -> None:
        """Wait for the snapshot and persist in flight; re-raise any background error.
        Idempotent. A clean close (no exception being handled) first writes the complete
        checkpoint of the last step when ``config.final_checkpoint`` asks for it (every
        rank, collective). Stops what the manager started, in this order: the stop
        signals' handlers, the snapshot copy, the replica thread, the RAM tier (its slots
        go with a clean close), the persist thread, the lease's heartbeat thread, then the
        manager's own process groups (nothing is left for interpreter exit to tear down)."""
        if self._closed:
            return
        # Shared-memory slots go with a clean close; closed while an exception is being
        # handled (the run failed), they stay for the restarted worker.
        clean = sys.exc_info()[0] is None
        try:
            if clean:
                self._final_on_close()
        finally:
            self._closed = True
            self._close_all(clean)
        if self._deferred_error is not None:  # an earlier persist's, met by a final save
            error, self._deferred_error = self._deferred_error, None
            raise error

    def _close_all(self, clean: bool) -> None:
        """Stop what the manager started, in close()'s order."""
        try:
            self._stop.close()
            self._reporter.copied(self._ram_tier.finish())
        finally:
            try:
                if self._replicator is not None:
                    self._replicator.close()
                self._ram_tier.close(unlink=clean)
                self._persister.close()
            finally:
                self._root_claim.release()
                groups = [self._group, self._stop.group]  # (the replicator left its own)
                self._group = None
                destroy_groups(groups)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_persist(self, timeout_s: float | None = None) -> None:
        """Block until the persist in flight (if any) has finished, committed or not.

        Training thread. Its error, if it failed, stays pending: raised by the next
        ``step``, ``wait_for_snapshot`` or ``close``. Raises CheckpointError when it does not
        finish within ``timeout_s`` (default: ``config.timeout_s``).
        """
        self._persister.wait_idle(timeout_s)

    # -- read-only state ----------------------------------------------------------
    @property
    def config(self) -> CheckpointConfig:
        """The configuration this manager was built with (read it, do not change it)."""
        return self._config

    @property
    def n_experts(self) -> tuple[int, ...]:
        """The experts of each MoE layer (global counts, in the model's order); () for a
        model without experts (checkpointed in full)."""
        return self._n_experts

    @property
    def k_persist(self) -> int:
        """Experts per MoE layer written to storage at each checkpoint (now)."""
        return self._schedule.k_persist

    @property
    def k_snapshot(self) -> int:
        """Experts per MoE layer copied to RAM at each checkpoint (now)."""
        return self._schedule.k_snapshot

    @property
    def k_history(self) -> list[list[int]]:
        """[step, K_persist] at each change of K_persist (as the manifests record it)."""
        return self._schedule.k_history

    @property
    def ledger(self) -> PLTLedger:
        """The PLT ledger of this run's lineage (lost tokens so far)."""
        return self._schedule.ledger

    def set_k(self, k_persist: int, k_snapshot: int | None = None) -> None:
        """Save ``k_persist`` experts per layer to storage (``k_snapshot``, by default the
        larger of it and the current K_snapshot, to RAM) from the next checkpoint on, as
        dynamic K does after a recovery (recorded in the manifests' ``k_history``).

        Training thread, every rank with the same values. Raises ConfigError unless
        1 <= k_persist <= k_snapshot <= the experts per MoE layer.
        """
        self._schedule.set_k(k_persist, k_snapshot, self._last_step)

    @property
    def ram_folder(self) -> str | None:
        """The folder holding this run's RAM snapshot slots in shared memory on this node
        (under ``ram_dir`` as resolved: ``/dev/shm/moepec`` for ``"auto"`` when the tier
        fits there), or None where the snapshots live in the process. A restarted worker
        recovers from it; removing it loses the RAM tier of this node."""
        if self._ram_dir is None:
            return None
        return str(job_dir(self._ram_dir, self._storage.url, self._storage.local))

    @property
    def fenced(self) -> str | None:
        """Why this run no longer writes to its checkpoint root (another run took over its
        lease), or None. Training and RAM snapshots go on; nothing in the root is written,
        renamed or deleted by this run again."""
        return self._persister.fenced

    @property
    def last_persist_failed(self) -> bool:
        """Whether this run's newest persist did not commit (failed, or refused because
        the run was fenced). Any rank; final after ``close()``."""
        records = self._persister.records
        return bool(records) and not records[-1].committed

    @property
    def last_committed(self) -> str | None:
        """The newest committed checkpoint this run continues: its own last commit, or the
        one it restored from; None when there is none. Any rank, any time; final after
        ``close()`` (a persist that failed never changes it)."""
        return self._persister.head

    @property
    def blocked_seconds(self) -> float:
        """Total time the training loop spent blocked in step() and wait_for_snapshot()."""
        return self._reporter.blocked

    # -- internals --------------------------------------------------------------
    def _check_persist(self) -> None:
        """Re-raise (once) a background persist's error as PersistError."""
        self._persister.check()

    def _finish_snapshot(self, notify: bool = True) -> SnapshotRecord | None:
        """Wait for the snapshot in flight; its record is delivered (``notify``) or returned."""
        if self._ram_tier.snapshotter.pending is None:
            return None
        t0 = time.perf_counter()
        snap = self._ram_tier.finish()
        self._reporter.waited(time.perf_counter() - t0)
        return self._reporter.copied(snap, notify)
