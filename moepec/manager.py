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

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moepec import manifest as mf
from moepec.config import CheckpointConfig
from moepec.errors import (
    CheckpointError,
    ConfigError,
    DistributedError,
    NoCheckpointError,
    StructureMismatchError,
)
from moepec.experts import ExpertSpec, discover, structure_mismatches, structure_of
from moepec.persist import Persister
from moepec.plan import Item, make_plan
from moepec.plt import PLTLedger
from moepec.recovery import RestoreReport, Source, lost_tokens, recover
from moepec.selection import Selector, select_two_tier
from moepec.snapshot import BufferPool, Snapshot, Snapshotter
from moepec.state import StateCatalog, parse_key
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
                 expert_spec: ExpertSpec | None = None) -> None:
        self.config = config
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.emap = discover(model, expert_spec)
        self.n_experts = self.emap.n_experts
        if not self.n_experts:
            log.warning("no experts found in the model: every checkpoint will be a full one")
        elif config.k_snapshot > min(self.n_experts):
            raise ConfigError(
                f"k_snapshot={config.k_snapshot} (and k_persist={config.k_persist}) must be "
                f"<= the experts per MoE layer ({min(self.n_experts)})")
        self.catalog = StateCatalog(model, optimizer, self.emap, extra_state)
        self.structure = structure_of(model, self.emap)
        self.storage = Storage(config.path, config.storage_options)
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
        self._need_full = True
        self._refs_lock = threading.Lock()
        self.pool = BufferPool()
        self.snapshotter = Snapshotter(self.pool, background=config.async_snapshot,
                                       timeout_s=config.timeout_s)
        self.persister = Persister(self.storage, self.pool, rank=self.rank,
                                   world_size=self.world_size, group=self._group,
                                   background=config.async_persist, timeout_s=config.timeout_s,
                                   keep_last=config.keep_last, release=self._release)
        self.ram: Snapshot | None = None
        self.seq = self._next_seq()
        self.events: list[dict[str, Any]] = []
        self.restores: list[RestoreReport] = []
        self._blocked = 0.0
        self._closed = False

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
        """Block until the RAM snapshot in progress is complete. Call before optimizer.step()."""
        self.persister_check()
        if self.snapshotter.busy or self.snapshotter._pending is not None:
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
        Raises PersistError for an earlier background failure.
        """
        self.persister_check()
        if (step + 1) % self.config.interval != 0:
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        """Start a checkpoint of the current state, labelled ``step``, now."""
        if self._closed:
            raise CheckpointError("CheckpointManager is closed")
        t0 = time.perf_counter()
        self.wait_for_snapshot()
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
        self.persister_check()
        full = self._need_full or (self.config.full_every > 0
                                   and self._index % self.config.full_every == 0)
        if full:
            snap_sel = [tuple(range(n)) for n in self.n_experts]
            persist_sel = snap_sel
        else:
            snap_sel, persist_sel = select_two_tier(self.persist_selector, self.ram_selector,
                                                    self.k_persist, self.k_snapshot)
        self.ram_selector.commit(snap_sel, self._index)
        if persist:
            self.persist_selector.commit(persist_sel, self._index)
            if full:
                self._need_full = False

        snap_keys = self._keys_for(snap_sel)
        persist_keys = self._keys_for(persist_sel) if persist else []
        mine = self._my_keys(snap_keys)
        objects = self.catalog.capture_objects()
        sources = {k: self.catalog.tensor(k) for k in mine if not k.startswith("objects/")}
        snap = Snapshot(seq=self.seq, step=step, tensors={},
                        snapshot_experts=[tuple(s) for s in snap_sel],
                        persist_experts=[tuple(p) for p in persist_sel] if persist else None,
                        persist_keys=frozenset(k for k in persist_keys if k in mine),
                        meta={}, refs=2 if persist else 1)
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
            self.wait_for_snapshot()
        if persist:
            self.persister.submit(snap, snap.meta)
        blocked = time.perf_counter() - t0
        event["blocked_step_s"] = blocked
        self._blocked += blocked

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

        Uses the RAM snapshot when this process holds one (the loop restarted in
        the same process), else storage. Returns None when there is nothing to
        restore. Raises StructureMismatchError (nothing changed, on disk or in
        memory) when the checkpoint is of a different model, NoCheckpointError /
        CorruptCheckpointError when no intact copy remains. On several ranks every
        rank calls it; all agree on the base.
        """
        t0 = time.perf_counter()
        try:
            self.snapshotter.wait()
        except CheckpointError as exc:
            log.warning("discarding the snapshot in progress: %s", exc)
        self.persister.wait_idle()
        try:
            self.persister.check()
        except CheckpointError as exc:
            log.warning("%s", exc)
        manifests = self._read_manifests()
        self.seq = max(self.seq, self._next_seq())
        ram = self.ram if (self.ram is not None and self.ram.done.is_set()
                           and self.ram.error is None) else None
        if self.distributed:
            ram = self._agree_on_ram(ram)
        if not manifests and ram is None:
            return None
        newest = mf.newest(manifests)
        if newest is not None:
            mismatches = structure_mismatches(manifests[newest]["structure"], self.structure)
            if mismatches:
                raise StructureMismatchError(
                    f"the checkpoint at {self.config.path} was saved from a different model: "
                    + "; ".join(mismatches)
                    + ". Restore into the same model configuration or use another path")
        sources = {n: self._storage_source(n, m) for n, m in manifests.items()}
        bases = sorted(sources.values(), key=lambda s: mf.seq_of(s.name), reverse=True)
        head_for_ram = self.persister.head if self.persister.head in manifests else newest
        if ram is not None:
            bases.insert(0, self._ram_source(ram))

        def lineage_of(base: Source) -> list[Source]:
            if base.tier == "ram":
                chain = mf.lineage(manifests, head_for_ram) if head_for_ram else []
                return [base] + [sources[n] for n in chain]
            return [sources[n] for n in mf.lineage(manifests, base.name)]

        def required_of(base: Source) -> set[str]:
            if base.tier == "ram":
                head_view = manifests[head_for_ram]["view"] if head_for_ram else {}
                return set(head_view) | set(base.keys)
            return set(base.meta["view"])

        for base in bases[:1]:
            if not self._covers_all_experts({k for k in required_of(base)
                                             if parse_key(k).is_expert}):
                raise NoCheckpointError(
                    f"{base.name} does not hold every expert of the model (was it saved "
                    f"with a different ExpertSpec?); restore with the spec it was saved with")
        rec = recover(bases, lineage_of, required_of, verify=self.config.verify)
        shapes = {}
        for key, value in rec.values.items():
            shapes[key] = (list(value.shape), str(value.dtype).removeprefix("torch."))
        self.catalog.ensure_optimizer_state(shapes)
        self.catalog.load(rec.values)

        meta = rec.base.meta
        self.ledger.load_state_dict(meta["ledger"])
        base_seq = meta["seq"]
        extra_lost = self._recoveries_since(base_seq)
        for layer, row in enumerate(extra_lost):
            for e, v in enumerate(row):
                self.ledger.lost[layer][e] += v
        at_base, at_copy = lost_tokens(rec, self.n_experts)
        lost = self.ledger.record_recovery(at_base, at_copy)
        self.persist_selector.load_state_dict(meta["selectors"]["persist"])
        self.ram_selector.load_state_dict(meta["selectors"]["ram"])
        self.k_persist, self.k_snapshot = meta["k_persist"], meta["k_snapshot"]
        self.k_history = [list(x) for x in meta["k_history"]]
        self._index = meta["index"] + 1
        self._adjust_k(meta["step"])
        if rec.base.tier == "storage":
            self.persister.head = rec.base.name
            self.ram = None
        else:
            self.persister.head = head_for_ram
        head_manifest = manifests.get(self.persister.head) if self.persister.head else None
        self.persister.head_view = dict(head_manifest["view"]) if head_manifest else {}
        self.persister.head_ancestors = (list(head_manifest.get("ancestors", []))
                                         if head_manifest else [])
        expert_keys = {k for k in self.persister.head_view if parse_key(k).is_expert}
        self._need_full = not self._covers_all_experts(expert_keys)
        self._pending_counts = [[0] * n for n in self.n_experts]
        sources_report = {}
        for (layer, expert, part), src in sorted(rec.unit_source.items()):
            if part == "model" or f"{layer}/{expert}" not in sources_report:
                sources_report[f"{layer}/{expert}"] = {"step": src.step, "tier": src.tier,
                                                       "checkpoint": src.name}
        keys_from: dict[str, int] = {}
        for src in rec.unit_source.values():
            keys_from[src.tier] = keys_from.get(src.tier, 0) + 1
        report = RestoreReport(step=meta["step"], checkpoint=rec.base.name, tier=rec.base.tier,
                               sources=sources_report, lost=lost, plt=self.ledger.plt(),
                               warnings=rec.warnings, seconds=time.perf_counter() - t0,
                               keys_from=keys_from)
        self._record_recovery(report, base_seq)
        self.restores.append(report)
        log.info("restored step %d from %s (%s); lost %d token assignments, PLT %.4f%%",
                 report.step, report.checkpoint, report.tier, report.lost_total,
                 100 * report.plt)
        return report

    # -- internals --------------------------------------------------------------
    def _keys_for(self, selected: Sequence[Sequence[int]]) -> list[str]:
        sel_parts, all_parts = _SCOPE_PARTS[self.config.pec_scope]
        keys = self.catalog.non_expert_tensor_keys() + self.catalog.object_keys()
        for layer, n in enumerate(self.n_experts):
            chosen = set(selected[layer])
            for e in range(n):
                parts = all_parts + (sel_parts if e in chosen else ())
                if parts:
                    keys += self.catalog.expert_keys(layer, e, parts)
        return keys

    def _my_keys(self, keys: list[str]) -> list[str]:
        """This rank's share of ``keys`` under the write plan (all of them on one rank)."""
        if self.world_size == 1:
            return keys
        items = []
        for k in keys:
            if k.startswith("objects/"):
                nbytes = 0
            else:
                t = self.catalog.tensor(k)
                nbytes = t.numel() * t.element_size()
            info = parse_key(k)
            group = info.layer if info.is_expert else _module_group(k)
            items.append(Item(key=k, nbytes=nbytes, holders=tuple(range(self.world_size)),
                              layer=group, expert=info.expert))
        # Objects (RNG, loader, scheduler) are replicated on data-parallel ranks: rank 0
        # writes them.
        plan = make_plan(items, self.world_size, self.config.write_mode)
        mine = set(plan.keys_for(self.rank))
        if self.rank == 0:
            mine.update(k for k in keys if k.startswith("objects/"))
        else:
            mine.difference_update(k for k in keys if k.startswith("objects/"))
        return [k for k in keys if k in mine]

    def _manifest_fields(self, snap: Snapshot, full: bool) -> dict[str, Any]:
        return {
            "step": snap.step, "seq": snap.seq, "index": self._index, "time": time.time(),
            "structure": self.structure, "config": self.config.to_dict(),
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

    def _read_manifests(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, committed in self.storage.list_checkpoints():
            if not committed:
                continue
            try:
                out[name] = self.storage.read_manifest(name)
            except CheckpointError as exc:
                log.warning("ignoring %s: %s", name, exc)
        return out

    def _storage_source(self, name: str, manifest: dict[str, Any]) -> Source:
        return Source(name=name, tier="storage", step=manifest["step"],
                      counts=manifest["counts"], keys=manifest["keys"],
                      read=lambda targets, n=name: self.storage.read(n, targets),
                      meta=manifest)

    def _ram_source(self, snap: Snapshot) -> Source:
        keys = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for k, t in snap.tensors.items()}

        def read(targets: dict[str, torch.Tensor]) -> None:
            for k, t in targets.items():
                t.copy_(snap.tensors[k])

        return Source(name=f"ram:{snap.seq}", tier="ram", step=snap.step,
                      counts=snap.meta["counts"], keys=keys, read=read, meta=snap.meta)

    def _agree_on_ram(self, ram: Snapshot | None) -> Snapshot | None:
        """Use RAM only if every rank holds the same snapshot (else all use storage)."""
        mine = torch.tensor([ram.seq if ram is not None else -1], dtype=torch.int64)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if low.item() != high.item() or low.item() < 0:
            return None
        if self.world_size > 1:
            # Each rank holds only its share of a snapshot: RAM recovery across ranks
            # would need a broadcast per key; storage is the common ground.
            return None
        return ram

    def _covers_all_experts(self, expert_keys: set[str]) -> bool:
        layers_seen: dict[int, set[int]] = {}
        for k in expert_keys:
            info = parse_key(k)
            if info.part == "model" or self.config.pec_scope == "optimizer":
                layers_seen.setdefault(info.layer, set()).add(info.expert)
        return all(len(layers_seen.get(i, ())) == n for i, n in enumerate(self.n_experts))

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

    def _recoveries_dir(self) -> str:
        return f"{self.storage.root}/recoveries"

    def _record_recovery(self, report: RestoreReport, base_seq: int) -> None:
        """Append a recovery record (rank 0): keeps PLT cumulative across restarts even if
        another fault strikes before the next checkpoint commits."""
        if self.rank != 0:
            return
        record = {"time": time.time(), "base_seq": base_seq, "next_seq": self.seq,
                  "step": report.step, "checkpoint": report.checkpoint, "tier": report.tier,
                  "lost": report.lost, "plt": report.plt, "seconds": report.seconds,
                  "k_persist": self.k_persist, "warnings": report.warnings}
        try:
            self.storage.fs.makedirs(self._recoveries_dir(), exist_ok=True)
            self.storage.fs.pipe_file(
                f"{self._recoveries_dir()}/rec-{self.seq:06d}-{time.time_ns()}.json",
                json.dumps(record).encode())
        except Exception as exc:  # noqa: BLE001 - the log is advisory; training goes on
            log.warning("could not write the recovery record: %s", exc)

    def _recoveries_since(self, base_seq: int) -> list[list[int]]:
        """Lost counts of recoveries that happened after checkpoint ``base_seq`` was made
        (so its ledger does not include them)."""
        total = [[0] * n for n in self.n_experts]
        try:
            paths = self.storage.fs.ls(self._recoveries_dir(), detail=False)
        except FileNotFoundError:
            return total
        for path in paths:
            try:
                rec = json.loads(self.storage.fs.cat_file(path))
            except Exception:  # noqa: BLE001
                continue
            if rec.get("next_seq", -1) > base_seq and rec.get("base_seq", -1) <= base_seq:
                for layer, row in enumerate(rec["lost"][:len(total)]):
                    for e, v in enumerate(row[:len(total[layer])]):
                        total[layer][e] += v
        if self.distributed:
            flat = torch.tensor([v for row in total for v in row] or [0], dtype=torch.int64)
            dist.broadcast(flat, src=0)
            values, i = flat.tolist(), 0
            for layer, n in enumerate(self.n_experts):
                total[layer] = values[i:i + n]
                i += n
        return total


def _module_group(key: str) -> int:
    """Group non-expert keys by transformer block (``blocks.<i>.``) for layer-wise sharding."""
    for part in key.split("/", 2)[-1].split(".")[:-1]:
        if part.isdigit():
            return int(part)
    return -1


def check_distributed_agreement(value: int, what: str) -> None:
    """Raise DistributedError on every rank if ranks disagree on ``value``."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0].item() != -t[1].item():
        raise DistributedError(f"ranks disagree on {what}; start every rank with the same "
                               f"settings")
