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
process survived, else storage). ``close`` waits for the persist in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moepec.config import CheckpointConfig
from moepec.errors import (
    CheckpointError,
    ConfigError,
)
from moepec.experts import ExpertSpec, discover, structure_of
from moepec.persist import Persister
from moepec.plt import PLTLedger
from moepec.rank_share import rank_share
from moepec.recovery import RestoreReport
from moepec.selection import Selector, select_two_tier
from moepec.snapshot import BufferPool, Snapshot, Snapshotter
from moepec.state import StateCatalog
from moepec.storage import Storage, parse_checkpoint_name

log = logging.getLogger(__name__)

_SCOPE_PARTS = {  # pec_scope -> (parts saved for selected experts, parts saved for all)
    "all": (("model", "optim"), ()),
    "optimizer": (("optim",), ("model",)),
    "weights": (("model",), ("optim",)),
}


class CheckpointManager:
    """Partial-experts, two-level, sharded checkpointing for one training job.

    Construct on every rank (after ``torch.distributed`` is initialised when
    running with several ranks) with the model and optimizer the loop uses.
    Raises ConfigError for invalid settings and ExpertDiscoveryError when the
    experts cannot be found unambiguously (pass ``expert_spec``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 config: CheckpointConfig, *, extra_state: Mapping[str, Any] | None = None,
                 expert_spec: ExpertSpec | None = None,
                 expert_parallel: tuple[int, int] | None = None) -> None:
        self.config = config
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
        self.emap = discover(model, expert_spec)
        # Global expert counts: a rank holds n_local of them per layer under EP.
        self.n_experts = tuple(n * self.ep_size for n in self.emap.n_experts)
        if not self.n_experts:
            log.warning("no experts found in the model: every checkpoint will be a full one")
        elif config.k_snapshot > min(self.n_experts):
            raise ConfigError(
                f"k_snapshot={config.k_snapshot} (and k_persist={config.k_persist}) must be "
                f"<= the experts per MoE layer ({min(self.n_experts)})")
        self.catalog = StateCatalog(model, optimizer, self.emap, extra_state,
                                    ep_rank=self.ep_rank, ep_size=self.ep_size)
        self.structure = structure_of(model, self.emap, self.ep_size)
        self._config_dict = config.to_dict()  # written into every manifest
        self.storage = Storage(config.path, config.storage_options, config.serialization)
        if self.rank == 0:
            self.storage.check_writable()
        # A dedicated group for the persist worker: its collectives never interleave
        # with the training thread's (STYLE.md: no collectives off the main thread
        # except on a dedicated group).
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=config.timeout_s))
                       if self.distributed else None)
        self.k_persist = config.k_persist
        self.k_snapshot = config.k_snapshot
        self.k_history: list[list[int]] = [[-1, self.k_persist]]
        self.persist_selector = Selector.create(self.n_experts, config.selection)
        self.ram_selector = Selector.create(self.n_experts, config.selection)
        self.ledger = PLTLedger.create(self.n_experts)
        self._pending_counts = [[0] * n for n in self.n_experts]
        self._index = 0
        self._covered: tuple[str | None, bool] = (None, False)
        self._refs_lock = threading.Lock()
        self.pool = BufferPool()
        self.snapshotter = Snapshotter(self.pool, background=config.async_snapshot,
                                       timeout_s=config.timeout_s)
        self.persister = Persister(self.storage, rank=self.rank,
                                   world_size=self.world_size, group=self._group,
                                   background=config.async_persist, timeout_s=config.timeout_s,
                                   keep_last=config.keep_last, release=self._release)
        self.ram: Snapshot | None = None
        self.seq = self._next_seq()
        self.events: list[dict[str, Any]] = []
        self.restores: list[RestoreReport] = []
        self._blocked = 0.0
        self._closed = False
        self._key_cache: dict[Any, Any] = {}

    # -- the training-loop API --------------------------------------------------
    def observe_routing(self, counts: Sequence[Any]) -> None:
        """Add this rank's token assignments per (MoE layer, expert) of one step.

        ``counts[l]`` is a sequence or int tensor of length N_l. Cheap: no collective
        (counts are summed over ranks at the next checkpoint).
        """
        if len(counts) != len(self.n_experts):
            raise ConfigError(f"observe_routing got counts for {len(counts)} MoE layers; the "
                              f"model has {len(self.n_experts)}")
        for layer, row in enumerate(counts):
            values = row.tolist() if torch.is_tensor(row) else list(row)
            if len(values) != self.n_experts[layer]:
                raise ConfigError(f"observe_routing: layer {layer} has {self.n_experts[layer]} "
                                  f"experts, got {len(values)} counts")
            pend = self._pending_counts[layer]
            for e, v in enumerate(values):
                pend[e] += int(v)

    def wait_for_snapshot(self) -> None:
        """Block until the RAM snapshot in progress is complete. Call before optimizer.step().

        Raises PersistError (once) for a background persist that failed since the last
        call; the snapshot is complete all the same (it is finished first), so training
        may catch the error and go on to the optimizer step.
        """
        self._finish_snapshot()
        self.persister_check()

    def _finish_snapshot(self) -> None:
        if self.snapshotter.pending is not None:
            t0 = time.perf_counter()
            snap = self.snapshotter.wait()
            waited = time.perf_counter() - t0
            self._blocked += waited
            if self.events:
                self.events[-1]["blocked_wait_s"] += waited
            if snap is not None:
                self._promote(snap)

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
        """Start a checkpoint of the current state, labelled ``step``, now."""
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        t0 = time.perf_counter()
        self._finish_snapshot()
        counts = self._reduce_counts()
        for tracker in (self.ledger, self.persist_selector, self.ram_selector):
            tracker.observe(counts)
        persist = True
        if self.persister.busy:
            if self.config.busy_policy == "wait":
                self.persister.wait_idle()
            else:
                persist = False
                log.info("step %d: previous persist still writing; keeping this checkpoint "
                         "in RAM only (busy_policy=skip)", step)
        pending_error = self.persister.take_error() if persist else None
        if pending_error is not None:
            # The previous persist failed: keep this checkpoint in RAM, report the error
            # once the snapshot is under way, and persist again at the next checkpoint.
            persist = False
        # The persister is idle here whenever this checkpoint is to be persisted, so the
        # committed view is current: while it lacks an expert (the first checkpoint of a
        # run, or every one after failed persists), the checkpoint is a full one.
        full = (persist and not self._storage_has_all_experts()) or (
            self.config.full_every > 0 and self._index % self.config.full_every == 0)
        if full:
            snap_sel = [tuple(range(n)) for n in self.n_experts]
            persist_sel = snap_sel
        else:
            snap_sel, persist_sel = select_two_tier(self.persist_selector, self.ram_selector,
                                                    self.k_persist, self.k_snapshot)
        self.ram_selector.commit(snap_sel, self._index)
        if persist:
            self.persist_selector.commit(persist_sel, self._index)

        snap_keys = self._keys_for(snap_sel)
        persist_keys = self._keys_for(persist_sel) if persist else []
        mine = self._my_keys(snap_keys)
        mine_set = set(mine)
        # Only the rank that writes the objects pays for serialising them.
        objects = (self.catalog.capture_objects()
                   if any(k.startswith("objects/") for k in mine) else {})
        sources = {k: self._live(k) for k in mine if not k.startswith("objects/")}
        snap = Snapshot(seq=self.seq, step=step, tensors={},
                        snapshot_experts=[tuple(s) for s in snap_sel],
                        persist_experts=[tuple(p) for p in persist_sel] if persist else None,
                        persist_keys=frozenset(k for k in persist_keys if k in mine_set),
                        meta={}, refs=2 if persist else 1, all_keys=snap_keys)
        # Objects (RNG, scheduler, loader, hyper-parameters) and buffers change during
        # the next forward; they are captured here, on the training thread.
        for k in mine:
            if k.startswith("objects/"):
                snap.tensors[k] = objects[k]
        for k in [k for k in sources if k.startswith("model/") and k[6:] in self.catalog.buffers]:
            snap.tensors[k] = sources.pop(k).clone()
        snap.meta = self._manifest_fields(snap, full)
        self.snapshotter.start(snap, sources)
        event = {"step": step, "seq": self.seq, "full": full, "persist": persist,
                 "snapshot_bytes": sum(t.numel() * t.element_size() for t in sources.values()),
                 "blocked_step_s": 0.0, "blocked_wait_s": 0.0}
        self.events.append(event)
        self.seq += 1
        self._index += 1
        if not self.config.async_snapshot:
            self._finish_snapshot()
        try:
            if persist:
                self.persister.submit(snap, snap.meta)
        finally:
            blocked = time.perf_counter() - t0
            event["blocked_step_s"] = blocked
            self._blocked += blocked
        if pending_error is not None:
            raise pending_error

    def close(self) -> None:
        """Wait for the snapshot and persist in flight; re-raise any background error.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            snap = self.snapshotter.wait()
            if snap is not None:
                self._promote(snap)
        finally:
            self.snapshotter.close()
            self.persister.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def persister_check(self) -> None:
        self.persister.check()

    @property
    def blocked_seconds(self) -> float:
        """Total time the training loop spent blocked in step() and wait_for_snapshot()."""
        return self._blocked

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
        from moepec.restoring import restore

        return restore(self)

    # -- internals --------------------------------------------------------------
    def _cache(self) -> dict[Any, Any]:
        """Key lists and live tensors, stable between checkpoints: rebuilt only when the
        optimizer grew state (its first step) or a restore replaced tensors."""
        opt = self.catalog.optimizer
        sig = len(opt.state) if opt is not None else 0
        if self._key_cache.get("sig") != sig:
            self._key_cache = {"sig": sig, "live": {},
                               "base": self.catalog.non_expert_tensor_keys()
                               + self.catalog.object_keys()}
        return self._key_cache

    def _live(self, key: str) -> torch.Tensor:
        live = self._cache()["live"]
        t = live.get(key)
        if t is None:
            t = live[key] = self.catalog.tensor(key)
        return t

    def _keys_for(self, selected: Sequence[Sequence[int]]) -> list[str]:
        cache = self._cache()
        sel_parts, all_parts = _SCOPE_PARTS[self.config.pec_scope]
        keys = list(cache["base"])
        for layer, n in enumerate(self.n_experts):
            chosen = set(selected[layer])
            for e in range(n):
                parts = all_parts + (sel_parts if e in chosen else ())
                if parts:
                    ck = (layer, e, parts)
                    if ck not in cache:
                        cache[ck] = self.catalog.expert_keys(layer, e, parts)
                    keys += cache[ck]
        return keys

    def _my_keys(self, keys: list[str]) -> list[str]:
        """This rank's share of ``keys`` under the write plan (all of them on one rank).

        Every rank computes the same plan: non-expert items are held by all ranks,
        an expert by the ranks of its expert-data-parallel group.
        """
        if self.world_size == 1:
            return keys
        cache = self._cache()
        plans = cache.setdefault("plans", {})
        key = tuple(keys)
        if key not in plans:
            if len(plans) >= 64:  # load_aware can pick many combinations: stay bounded
                plans.clear()
            plans[key] = rank_share(keys, self.catalog, rank=self.rank,
                                    world_size=self.world_size, ep_size=self.ep_size,
                                    mode=self.config.write_mode)
        return plans[key]

    def _manifest_fields(self, snap: Snapshot, full: bool) -> dict[str, Any]:
        return {
            "step": snap.step, "seq": snap.seq, "index": self._index, "time": time.time(),
            "structure": self.structure, "config": self._config_dict,
            "k_persist": self.k_persist, "k_snapshot": self.k_snapshot, "full": full,
            "pec_scope": self.config.pec_scope, "selection": self.config.selection,
            "experts_saved": [list(p) for p in (snap.persist_experts or [])],
            "experts_snapshot": [list(s) for s in snap.snapshot_experts],
            "counts": self.ledger.counts(), "ledger": self.ledger.state_dict(),
            "plt": self.ledger.plt(),
            "selectors": {"persist": self.persist_selector.state_dict(),
                          "ram": self.ram_selector.state_dict()},
            "k_history": [list(x) for x in self.k_history],
            "world_size": self.world_size, "write_mode": self.config.write_mode,
        }

    def _reduce_counts(self) -> list[list[int]]:
        counts = self._pending_counts
        self._pending_counts = [[0] * n for n in self.n_experts]
        if self.distributed and self.n_experts:
            flat = torch.tensor([v for row in counts for v in row], dtype=torch.int64)
            dist.all_reduce(flat)
            values = flat.tolist()
            out, i = [], 0
            for n in self.n_experts:
                out.append(values[i:i + n])
                i += n
            return out
        return counts

    def _storage_has_all_experts(self) -> bool:
        """Whether the committed view holds a copy of every expert this rank owns."""
        head = self.persister.head
        if self._covered[0] != head or head is None:
            from moepec.restoring import covers_owned_experts

            self._covered = (head, head is not None and covers_owned_experts(
                self, set(self.persister.head_view)))
        return self._covered[1]

    def _promote(self, snap: Snapshot) -> None:
        """A complete snapshot becomes the RAM recovery copy (the triple buffer's third)."""
        for event in reversed(self.events):
            if event["seq"] == snap.seq:
                event["snapshot_copy_s"] = snap.copy_seconds
                break
        if self.ram is not snap:
            old, self.ram = self.ram, snap
            if old is not None:
                self._release(old)

    def _release(self, snap: Snapshot) -> None:
        with self._refs_lock:
            snap.refs -= 1
            if snap.refs == 0:
                self.pool.give(snap.pooled)
                snap.pooled = {}

    def _next_seq(self) -> int:
        seqs = [parse_checkpoint_name(n)[0] for n, _ in self.storage.list_checkpoints()]
        return max(seqs, default=-1) + 1

    def _adjust_k(self, step: int) -> None:
        """Dynamic K (the paper's rule): double K_persist while PLT is over budget."""
        if not self.config.dynamic_k or not self.n_experts:
            return
        n = min(self.n_experts)
        plt = self.ledger.plt()
        new = self.k_persist
        if plt > self.config.plt_budget:
            new = min(2 * self.k_persist, n)
        elif self.config.dynamic_k_down and plt < self.config.plt_budget / 4:
            new = max(self.k_persist // 2, 1)
        if new != self.k_persist:
            log.info("dynamic K: PLT %.3f%% vs budget %.3f%%: K_persist %d -> %d", 100 * plt,
                     100 * self.config.plt_budget, self.k_persist, new)
            self.k_persist = new
            self.k_snapshot = max(self.k_snapshot, new)
            self.k_history.append([step, new])
