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
process survived, else storage) with :func:`moepec.manager.restore.restore_state` and
applies its outcome. ``close`` waits for the persist in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moepec.errors import (
    CheckpointError,
    ConfigError,
    ExpertDiscoveryError,
    FencedError,
    PersistError,
)
from moepec.events import CheckpointEvent, CommitRecord, SnapshotRecord
from moepec.hooks import FaultHooks
from moepec.keys import parse_checkpoint_name
from moepec.manager.claim import RootClaim
from moepec.manager.config import AUTO, BusyPolicy, CheckpointConfig, PecScope
from moepec.manager.restore import RestoreContext, RestoreOutcome, RestoreReport, restore_state
from moepec.manager.routing import RoutingCounter
from moepec.policy.plt import PLTLedger, dynamic_k
from moepec.policy.selection import Selector, select_two_tier
from moepec.recovery.records import write_recovery
from moepec.recovery.stitch import Tier
from moepec.state.catalog import StateCatalog
from moepec.state.experts import ExpertSpec, describe, discover, structure_of
from moepec.state.shares import CheckpointKeys
from moepec.store.manifest import CheckpointMeta
from moepec.store.persist import Persister
from moepec.store.replica import Replicator, node_id, ring_peers
from moepec.store.shm import (
    DEFAULT_DIR,
    SlotsInUse,
    SlotStore,
    admissible,
    check_budget,
    root_identity,
)
from moepec.store.snapshot import BufferPool, RamTier, Snapshot, Snapshotter
from moepec.store.storage import Storage, committed_manifests, no_gc

log = logging.getLogger(__name__)


class CheckpointManager:
    """Partial-experts, two-level, sharded checkpointing for one training job.

    Construct on every rank (after ``torch.distributed`` is initialised when
    running with several ranks) with the model and optimizer the loop uses.
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

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 config: CheckpointConfig, *, extra_state: Mapping[str, Any] | None = None,
                 expert_spec: ExpertSpec | None = None,
                 expert_parallel: tuple[int, int] | None = None,
                 on_checkpoint: Callable[[CheckpointEvent], None] | None = None,
                 on_snapshot: Callable[[SnapshotRecord], None] | None = None,
                 on_commit: Callable[[CommitRecord], None] | None = None,
                 hooks: FaultHooks | None = None) -> None:
        self.config = config
        self._on_checkpoint, self._on_snapshot = on_checkpoint, on_snapshot
        self._on_commit, self._hooks = on_commit, hooks
        self._init_layout(expert_parallel)
        self._init_state(model, optimizer, extra_state, expert_spec)
        self._init_tiers()
        self._k_persist = config.k_persist
        self._k_snapshot = config.k_snapshot
        self.k_history: list[list[int]] = [[-1, self.k_persist]]
        self.persist_selector = Selector.create(self.n_experts, config.selection)
        self.ram_selector = Selector.create(self.n_experts, config.selection)
        self.ledger = PLTLedger.create(self.n_experts)
        self.routing = RoutingCounter(self.n_experts, self.distributed)
        self._index = 0
        self._covered: tuple[str | None, bool] = (None, False)
        self.seq = _next_seq(self.storage.list_checkpoints())
        self._copying: CheckpointEvent | None = None
        """The checkpoint whose RAM snapshot is in flight (its SnapshotRecord is due)."""
        self._copy_wait = 0.0
        """Seconds the loop waited so far for that snapshot."""
        self._last_step = -1
        self.restores: list[RestoreReport] = []
        self._blocked = 0.0
        self._closed = False

    def _init_layout(self, expert_parallel: tuple[int, int] | None) -> None:
        """Ranks and the expert-parallel layout (checked against the process group)."""
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.ep_rank, self.ep_size = expert_parallel or (0, 1)
        if self.ep_size > 1 and (self.world_size % self.ep_size
                                 or self.ep_rank != self.rank % self.ep_size):
            raise ConfigError(
                f"expert_parallel={expert_parallel} on rank {self.rank} of {self.world_size}: "
                f"ep_size must divide the world size and ep_rank must be rank % ep_size "
                f"(EP groups are contiguous ranks)")

    def _init_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    extra_state: Mapping[str, Any] | None, spec: ExpertSpec | None) -> None:
        """Find the experts and catalogue the training state."""
        config = self.config
        self.emap = discover(model, spec)
        # Global expert counts: a rank holds n_local of them per layer under EP.
        self.n_experts = tuple(n * self.ep_size for n in self.emap.n_experts)
        if not self.n_experts:
            found = describe(self.emap)
            if config.experts_required:
                raise ExpertDiscoveryError(
                    f"{found}\nto checkpoint this model in full on purpose, pass "
                    f"CheckpointConfig(require_experts=False)")
            log.warning("%s\nrequire_experts=False: every checkpoint will be a full one", found)
        elif self.emap.ragged and self.ep_size > 1:
            raise ConfigError("ExpertSpec(ragged=True) does not work with expert parallelism; "
                              "run without expert_parallel")
        elif config.k_snapshot > min(self.n_experts):
            raise ConfigError(
                f"k_snapshot={config.k_snapshot} (and k_persist={config.k_persist}) must be "
                f"<= the experts per MoE layer ({min(self.n_experts)})")
        self.catalog = StateCatalog(model, optimizer, self.emap, extra_state,
                                    ep_rank=self.ep_rank, ep_size=self.ep_size)
        self.structure = structure_of(model, self.emap, self.ep_size)
        self.keys = CheckpointKeys(self.catalog, pec_scope=config.pec_scope, rank=self.rank,
                                   world_size=self.world_size, ep_size=self.ep_size,
                                   write_mode=config.write_mode)

    def _init_tiers(self) -> None:
        """Storage, the RAM snapshotter and the persist worker."""
        config = self.config
        self._config_dict = config.to_dict()  # written into every manifest
        self.storage = Storage(config.path, config.storage_options, config.serialization)
        self._init_run()
        # A dedicated group for the persist worker: its collectives never interleave
        # with the training thread's (STYLE.md: no collectives off the main thread
        # except on a dedicated group).
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=config.timeout_s))
                       if self.distributed else None)
        slots = held = peers = None
        ram_dir = self._ram_dir()
        if ram_dir is not None:
            peers = self._replica_peers()
            root = root_identity(self.storage.url, self.storage.local)
            if config.ram_dir != AUTO:  # checked by _ram_dir when chosen automatically
                check_budget(self._ram_need_bytes(peers), config.ram_budget_bytes, ram_dir,
                             root)
            slots, held = self._open_slots(ram_dir, root, peers)
            if slots is None:
                ram_dir = peers = None
        self.ram_dir = ram_dir
        """Where this manager's RAM snapshots live (None: in the process)."""
        self.ram_tier = RamTier(background=config.async_snapshot, timeout_s=config.timeout_s,
                                slots=slots, replicas=held, hooks=self._hooks)
        self.replicator = None
        if peers:
            self.replicator = Replicator(slots, held, succ=peers[0], pred=peers[1],
                                         timeout_s=config.timeout_s,
                                         release=self.ram_tier.release)
            self.ram_tier.on_complete = self.replicator.submit
        self.persister = Persister(self.storage, run_id=self.run_id, rank=self.rank,
                                   world_size=self.world_size, group=self._group,
                                   background=config.async_persist, timeout_s=config.timeout_s,
                                   keep_last=config.keep_last, release=self.ram_tier.release,
                                   guard=lambda: self.root_claim.check(),
                                   hooks=self._hooks, on_commit=self._on_commit)

    def _open_slots(self, ram_dir: str, root: str, peers: tuple[int, int] | None
                    ) -> tuple[SlotStore | None, SlotStore | None]:
        """This rank's slot store (and its predecessor's replicas), or (None, None) on
        every rank when another live process of this host holds some rank's slots (a
        second run into the same root, as in a takeover while the old run lives): the
        tier is then in the process, with one warning. Collective when distributed."""
        slots = held = None
        busy = None
        try:
            slots = SlotStore(ram_dir, root=root, rank=self.rank, world_size=self.world_size)
            if peers:
                held = SlotStore(ram_dir, root=root, rank=peers[1],
                                 world_size=self.world_size, replica=True)
        except SlotsInUse as exc:
            busy = str(exc)
        except OSError as exc:
            raise ConfigError(f"cannot keep RAM snapshots in ram_dir={ram_dir!r} ({exc}); use "
                              f"a writable folder on a shared-memory filesystem such as "
                              f"/dev/shm/moepec, or ram_dir=None") from exc
        if self.distributed:
            reasons: list[Any] = [None] * self.world_size
            dist.all_gather_object(reasons, busy)
            busy = next((f"rank {r}: {b}" for r, b in enumerate(reasons) if b), None)
        if busy is None:
            return slots, held
        for store in (slots, held):
            if store is not None:
                store.close(unlink=False)
        if self.rank == 0:
            log.warning("RAM tier: in-process buffers (%s)", busy)
        return None, None

    def _ram_dir(self) -> str | None:
        """The folder of the shared-memory RAM tier, or None for in-process buffers.
        ``ram_dir="auto"``: DEFAULT_DIR when shared memory exists and the tier fits its
        budget, else None; one info line (local rank 0) says which and why."""
        chosen = self.config.ram_dir
        if chosen != AUTO:
            return chosen
        shm = os.path.dirname(DEFAULT_DIR)
        why = None
        if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
            why = f"no writable shared memory at {shm}; a restarted worker recovers from storage"
        else:
            try:
                check_budget(self._ram_need_bytes(None), self.config.ram_budget_bytes, shm,
                             root_identity(self.storage.url, self.storage.local))
            except ConfigError as exc:
                why = f"shared memory is too small: {str(exc).split(';')[0]}"
        if self.distributed:  # one tier for all ranks: the restore protocol meets over it
            whys: list[Any] = [None] * self.world_size
            dist.all_gather_object(whys, why)
            why = next((f"rank {r}: {w}" for r, w in enumerate(whys) if w), None)
        if self.rank == 0:
            if why is None:
                log.info("RAM tier: shared memory in %s (survives worker restarts; "
                         "ram_dir=None keeps it in the process)", DEFAULT_DIR)
            else:
                log.info("RAM tier: in-process buffers (%s)", why)
        return DEFAULT_DIR if why is None else None

    def _replica_peers(self) -> tuple[int, int] | None:
        """(successor, predecessor) on the ring over nodes when RAM slots are replicated,
        else None. Collective when distributed (the node ids are gathered)."""
        if not self.distributed or self.config.ram_replicas == 0:
            if self.config.ram_replicas:
                raise ConfigError("ram_replicas=1 needs ranks on several nodes")
            return None
        nodes: list[Any] = [None] * self.world_size
        dist.all_gather_object(nodes, node_id())
        if len(set(nodes)) < 2 and self.config.ram_replicas is None:
            return None
        return ring_peers(nodes, self.rank)

    def _ram_need_bytes(self, peers: tuple[int, int] | None) -> int:
        """Shared memory the tier may take on this node: three slots per local rank (twice
        that with replicas), a full snapshot's share being about 1/world of the model with
        Adam's two moments (optimizer state may not exist yet), whole for one rank."""
        model = sum(t.numel() * t.element_size()
                    for t in self.catalog.model.state_dict().values())
        per_copy = model * (3 if self.catalog.optimizer is not None else 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return 3 * -(-per_copy // self.world_size) * (2 if peers else 1) * local

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
        if (step + 1) % self.config.interval != 0:
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
        for tracker in (self.ledger, self.persist_selector, self.ram_selector):
            tracker.observe(counts)
        persist, pending_error = self._may_persist(step)
        # The persister is idle here whenever this checkpoint is to be persisted, so the
        # committed view is current: while it lacks an expert (the first checkpoint of a
        # run, or every one after failed persists), the checkpoint is a full one.
        full = (persist and not self._storage_has_all_experts()) or (
            self.config.full_every > 0 and self._index % self.config.full_every == 0)
        snap, sources = self._take(step, full, persist)
        self.ram_tier.start(snap, sources)
        nbytes = sum(t.numel() * t.element_size() for t in sources.values())
        self._copying, self._copy_wait = CheckpointEvent(
            step=step, seq=self.seq, full=full, persist=persist,
            experts_snapshot=tuple(snap.snapshot_experts),
            experts_persist=None if snap.persist_experts is None else tuple(snap.persist_experts),
            k_persist=self.k_persist, k_snapshot=self.k_snapshot, snapshot_bytes=nbytes,
            blocked_s=0.0), 0.0
        started = self._copying
        self.seq += 1
        self._index += 1
        self._last_step = step
        copied = None
        if not self.config.async_snapshot:
            copied = self._finish_snapshot(notify=False)
        try:
            if persist:
                self.persister.submit(snap)
        finally:
            blocked = time.perf_counter() - t0
            self._blocked += blocked
            self._notify(self._on_checkpoint, dataclasses.replace(started, blocked_s=blocked))
            if copied is not None:
                self._notify(self._on_snapshot, copied)
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
            self._record_copy(self.ram_tier.finish())
        finally:
            try:
                if self.replicator is not None:
                    self.replicator.close()
                self.ram_tier.close(unlink=clean)
                self.persister.close()
            finally:
                self.root_claim.release()
                self._destroy_groups()

    def _destroy_groups(self) -> None:
        """Leave the process groups this manager created (after their threads stopped)."""
        groups = [self._group] + ([self.replicator.group] if self.replicator else [])
        self._group = None
        if not (dist.is_available() and dist.is_initialized()):
            return  # the default group went first: it took every subgroup with it
        for group in groups:
            if group is not None:
                try:
                    dist.destroy_process_group(group)
                except Exception as exc:  # noqa: BLE001 - exiting anyway; say what stays
                    log.debug("could not destroy a checkpoint process group: %s", exc)

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
        return self._k_persist

    @property
    def k_snapshot(self) -> int:
        """Experts per MoE layer copied to RAM at each checkpoint (now)."""
        return self._k_snapshot

    def set_k(self, k_persist: int, k_snapshot: int | None = None) -> None:
        """Save ``k_persist`` experts per layer to storage (``k_snapshot``, by default the
        larger of it and the current K_snapshot, to RAM) from the next checkpoint on, as
        dynamic K does after a recovery (recorded in the manifests' ``k_history``).

        Training thread, every rank with the same values. Raises ConfigError unless
        1 <= k_persist <= k_snapshot <= the experts per MoE layer.
        """
        k_snapshot = max(self._k_snapshot, k_persist) if k_snapshot is None else k_snapshot
        top = min(self.n_experts, default=0)
        if not 1 <= k_persist <= k_snapshot <= top:
            raise ConfigError(f"set_k({k_persist}, {k_snapshot}): need 1 <= k_persist <= "
                              f"k_snapshot <= {top} (the experts per MoE layer)")
        if k_persist != self._k_persist:
            self.k_history.append([self._last_step, k_persist])
        self._k_persist, self._k_snapshot = k_persist, k_snapshot

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
        return self._blocked

    # -- live peers (replica groups) ---------------------------------------------
    def live_state(self) -> dict[str, Any]:
        """The checkpoint bookkeeping a live replica hands a restarted one (torchft
        healing, :mod:`moepec.integrations.torchft`): PLT ledger, selectors, K and its
        history, the checkpoint index and this rank's routing counts since the last
        checkpoint. JSON-able, a copy. Training thread, any rank (each rank its own)."""
        return {"ledger": self.ledger.state_dict(),
                "selectors": {"persist": self.persist_selector.state_dict(),
                              "ram": self.ram_selector.state_dict()},
                "k": [self._k_persist, self._k_snapshot],
                "k_history": [list(x) for x in self.k_history],
                "index": self._index, "last_step": self._last_step,
                "routing": self.routing.pending()}

    def load_live_state(self, state: Mapping[str, Any]) -> None:
        """Adopt a peer's :meth:`live_state` after the model and optimizer were loaded
        from the same peer (no storage read). Training thread, every rank, between
        checkpoints. Raises StructureMismatchError for another MoE structure."""
        self.ledger.load_state_dict(state["ledger"])
        self.persist_selector.load_state_dict(state["selectors"]["persist"])
        self.ram_selector.load_state_dict(state["selectors"]["ram"])
        self._k_persist, self._k_snapshot = (int(k) for k in state["k"])
        self.k_history = [list(x) for x in state["k_history"]]
        self._index, self._last_step = int(state["index"]), int(state["last_step"])
        self.routing.reset()
        self.routing.add(state["routing"])
        self.keys.invalidate()  # the loaded optimizer state may be new tensors

    # -- restore ----------------------------------------------------------------
    def restore(self) -> RestoreReport | None:
        """Restore the newest view into the model, optimizer and extra state.

        Uses RAM snapshots where processes survived (the loop restarted in the same
        process), else storage. Returns None when there is nothing to restore.
        Raises StructureMismatchError (nothing changed, on disk or in memory) when
        the checkpoint is of a different model, NoCheckpointError /
        CorruptCheckpointError when no intact copy remains. With several ranks,
        every rank calls it and all restore the same step.
        """
        t0 = time.perf_counter()
        self._drain()
        with no_gc():  # many small objects, a large heap: see store.storage.no_gc
            return self._restore(t0)

    def _restore(self, t0: float) -> RestoreReport | None:
        found = committed_manifests(self.storage)
        self.seq = max(self.seq, _next_seq(found.listing))
        head = found.manifests.get(found.newest) if found.manifests else None
        ram = self.ram_tier.recovered(
            lambda meta: admissible(meta, head.meta if head is not None else None))
        outcome = restore_state(self._restore_context(), found, ram)
        # The lease once the restore succeeded: a refused restore leaves the root as it was.
        self.root_claim.claim()
        if outcome is None:
            self.ram_tier.settle(-1, keep=False)
            return None
        self._apply(outcome)
        base = outcome.base
        kept = self.ram_tier.settle(base.seq, keep=base.tier == Tier.RAM)
        persisted = self._persist_on_failure(kept, found)
        report = RestoreReport(step=base.step, checkpoint=base.name, tier=str(base.tier),
                               sources=outcome.sources, lost=outcome.lost,
                               plt=self.ledger.plt(), warnings=outcome.warnings,
                               seconds=time.perf_counter() - t0, keys_from=outcome.keys_from)
        if self.rank == 0 and self._holds_root():
            write_recovery(self.storage, report, base_seq=base.seq, next_seq=self.seq,
                           k_persist=self.k_persist)
        report.persisted_on_failure = persisted
        self.restores.append(report)
        log.info("restored step %d from %s (%s); lost %d token assignments, PLT %.4f%%",
                 report.step, report.checkpoint, report.tier, report.lost_total,
                 100 * report.plt)
        return report

    def _holds_root(self) -> bool:
        """Rank 0: whether this run still holds the root's lease (a fenced run writes
        nothing there, not even a recovery record)."""
        try:
            self.root_claim.check()
        except FencedError:
            return False
        return True

    def _drain(self) -> None:
        """Finish the snapshot and persist in flight before restoring; their errors are
        logged (the restore is what matters now)."""
        try:
            self._record_copy(self.ram_tier.finish())
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
        self.ledger = outcome.ledger
        self.persist_selector.load_state_dict(meta.selectors["persist"])
        self.ram_selector.load_state_dict(meta.selectors["ram"])
        self._k_persist, self._k_snapshot = meta.k_persist, meta.k_snapshot
        self.k_history = [list(x) for x in meta.k_history]
        # This run continues the base's lineage of runs (restore stitches only within it).
        self.runs = [r for r in meta.runs if r != self.run_id][-63:] + [self.run_id]
        self._index = meta.index + 1
        self._adjust_k(meta.step)
        if outcome.base.tier == Tier.STORAGE and self.ram is not None \
                and self.ram.seq > meta.seq:
            self.ram_tier.drop()  # a snapshot of the abandoned future
        self.persister.set_head(outcome.head)
        self.seq = max(self.seq, meta.seq + 1)  # a RAM base may be newer than any folder
        self._covered = (None, False)  # recomputed from the restored head at the next save
        self.routing.reset()

    def _persist_on_failure(self, snap: Snapshot | None, found: Any) -> str | None:
        """Persist the RAM base a previous worker left in shared memory if storage lacks
        it (it was due for storage and its worker died first), before training resumes,
        so a second fault cannot lose it. All ranks (they agree on doing it); returns the
        checkpoint name committed, or None."""
        due = (snap is not None and snap.origin == "shm" and snap.persist_experts is not None
               and not any(mf_seq >= snap.seq for mf_seq in
                           (m.seq for m in found.manifests.values())))
        if self.distributed:
            flag = torch.tensor([1 if due else 0], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            due = bool(flag.item())
        if not due or self.root_claim.paused:
            return None
        assert snap is not None
        # Written under this run's name: the dead worker's unfinished folder of the same
        # snapshot (another run's name) is left to retention, never written into.
        name = self.persister.name_of(snap)
        self.ram_tier.hold(snap)  # the persist worker's reference, released when written
        t0 = time.perf_counter()
        self.persister.submit(snap)
        self.persister.wait_idle()
        try:
            self.persister.check()
        except CheckpointError as exc:
            log.warning("could not persist the RAM snapshot of step %d: %s", snap.step, exc)
            return None
        log.info("persisted RAM snapshot of step %d (only in RAM when its worker died) as %s "
                 "in %.2fs", snap.step, name, time.perf_counter() - t0)
        return name

    # -- internals --------------------------------------------------------------
    def _finish_snapshot(self, notify: bool = True) -> SnapshotRecord | None:
        """Wait for the snapshot in flight; its record is delivered (``notify``) or returned."""
        if self.snapshotter.pending is None:
            return None
        t0 = time.perf_counter()
        snap = self.ram_tier.finish()
        waited = time.perf_counter() - t0
        self._blocked += waited
        self._copy_wait += waited
        return self._record_copy(snap, notify)

    def _may_persist(self, step: int) -> tuple[bool, CheckpointError | None]:
        """Whether this checkpoint goes to storage, and an earlier persist's error (which
        keeps it in RAM: it is raised once the snapshot is under way, and the next
        checkpoint persists again)."""
        if self.persister.busy:
            if self.config.busy_policy == BusyPolicy.WAIT:
                self.persister.wait_idle()
            else:
                log.info("step %d: previous persist still writing; keeping this checkpoint "
                         "in RAM only (busy_policy=skip)", step)
                return False, None
        pending_error = self.persister.take_error()
        if self.persister.fenced is not None:
            return False, pending_error  # said once by the persister; RAM snapshots go on
        if self.root_claim.paused is not None:
            return False, pending_error or PersistError(
                f"checkpoints are paused, the snapshot stays in RAM: {self.root_claim.paused}")
        return pending_error is None, pending_error

    def _take(self, step: int, full: bool, persist: bool
              ) -> tuple[Snapshot, dict[str, torch.Tensor]]:
        """Choose the experts and build this checkpoint's snapshot: objects and buffers
        captured now, the live tensors to copy returned beside it."""
        # Objects (RNG, scheduler, loader, hyper-parameters) change during the next
        # forward: captured now, on the training thread, and first, so that a state that
        # cannot be stored (ConfigError) leaves the selectors as they were. Rank 0 writes
        # them (the write plan), so only it pays for serialising them.
        objects = self.catalog.capture_objects() if self.rank == 0 else {}
        if full:
            snap_sel = [tuple(range(n)) for n in self.n_experts]
            persist_sel = snap_sel
        else:
            snap_sel, persist_sel = select_two_tier(self.persist_selector, self.ram_selector,
                                                    self.k_persist, self.k_snapshot)
        self.ram_selector.commit(snap_sel, self._index)
        if persist:
            self.persist_selector.commit(persist_sel, self._index)
        snap_keys = self.keys.keys_for(snap_sel)
        mine = self.keys.mine(snap_keys)
        mine_set = set(mine)
        persist_keys = self.keys.keys_for(persist_sel) if persist else []
        persist_experts = [tuple(p) for p in persist_sel] if persist else None
        snap = Snapshot(seq=self.seq, step=step, tensors={},
                        snapshot_experts=[tuple(s) for s in snap_sel],
                        persist_experts=persist_experts,
                        persist_keys=frozenset(k for k in persist_keys if k in mine_set),
                        meta=self._meta(step, full, snap_sel, persist_experts),
                        refs=2 if persist else 1, all_keys=snap_keys)
        # Buffers change during the next forward too: cloned now.
        snap.tensors.update({k: v for k, v in objects.items() if k in mine_set})
        sources = {k: self.keys.live(k) for k in mine if not k.startswith("objects/")}
        for k in [k for k in sources if k.startswith("model/") and k[6:] in self.catalog.buffers]:
            snap.tensors[k] = sources.pop(k).clone()
        return snap, sources

    def _meta(self, step: int, full: bool, snap_sel: Sequence[Sequence[int]],
              persist_experts: Sequence[Sequence[int]] | None) -> CheckpointMeta:
        return CheckpointMeta(
            step=step, seq=self.seq, index=self._index, time=time.time(),
            structure=self.structure, config=self._config_dict,
            k_persist=self.k_persist, k_snapshot=self.k_snapshot, full=full,
            pec_scope=str(self.config.pec_scope), selection=str(self.config.selection),
            experts_saved=[list(p) for p in (persist_experts or [])],
            experts_snapshot=[list(s) for s in snap_sel],
            counts=self.ledger.counts(), ledger=self.ledger.state_dict(),
            plt=self.ledger.plt(),
            selectors={"persist": self.persist_selector.state_dict(),
                       "ram": self.ram_selector.state_dict()},
            k_history=[list(x) for x in self.k_history],
            world_size=self.world_size, write_mode=str(self.config.write_mode),
            run_id=self.run_id, runs=list(self.runs))

    def _storage_has_all_experts(self) -> bool:
        """Whether the committed view holds a copy of every expert this rank owns."""
        head = self.persister.head
        if self._covered[0] != head or head is None:
            self._covered = (head, head is not None and self.catalog.covers_owned_experts(
                self.persister.head_view, self.config.pec_scope != PecScope.OPTIMIZER))
        return self._covered[1]

    def _record_copy(self, snap: Snapshot | None, notify: bool = True) -> SnapshotRecord | None:
        """The SnapshotRecord of a finished snapshot this manager started (delivered to
        ``on_snapshot`` when ``notify``, else returned); None for any other."""
        started = self._copying
        if snap is None or started is None or started.seq != snap.seq:
            return None
        self._copying = None
        record = SnapshotRecord(step=started.step, seq=started.seq,
                                snapshot_bytes=started.snapshot_bytes,
                                copy_s=snap.copy_seconds, wait_s=self._copy_wait)
        if not notify:
            return record
        self._notify(self._on_snapshot, record)
        return None

    @staticmethod
    def _notify(callback: Callable[[Any], None] | None, record: Any) -> None:
        """Deliver ``record``; an observer's error is logged, never raised."""
        if callback is not None:
            try:
                callback(record)
            except Exception:  # noqa: BLE001 - an observer must not fail the checkpoint
                log.exception("checkpoint callback %r failed", callback)

    def _adjust_k(self, step: int) -> None:
        """Dynamic K after a recovery (policy.plt.dynamic_k), when configured; without it,
        a warning when the recovery left PLT over the budget."""
        if not self.n_experts:
            return
        if not self.config.dynamic_k:
            if self.ledger.plt() > self.config.plt_budget and self.rank == 0:
                log.warning("PLT is %.2f%% after this recovery, over the budget %.2f%%, and "
                            "dynamic K is off: set CheckpointConfig(dynamic_k=True) "
                            "(moepec train --dynamic-k), or save more experts per checkpoint "
                            "(k_persist) or checkpoint more often (interval)",
                            100 * self.ledger.plt(), 100 * self.config.plt_budget)
            return
        plt = self.ledger.plt()
        new = dynamic_k(self.k_persist, plt, self.config.plt_budget, min(self.n_experts),
                        self.config.dynamic_k_down)
        if new != self.k_persist:
            log.info("dynamic K: PLT %.3f%% vs budget %.3f%%: K_persist %d -> %d", 100 * plt,
                     100 * self.config.plt_budget, self.k_persist, new)
            self._k_persist = new
            self._k_snapshot = max(self._k_snapshot, new)
            self.k_history.append([step, new])


def _next_seq(listing: Sequence[tuple[str, bool]]) -> int:
    """The sequence number after every checkpoint folder's, committed or not."""
    seqs = [parse_checkpoint_name(n)[0] for n, _ in listing]
    return max(seqs, default=-1) + 1
