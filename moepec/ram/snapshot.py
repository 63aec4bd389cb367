"""Level one of two-level checkpointing: copy planned tensors into host RAM.

A :class:`Snapshot` is a complete, self-consistent copy of the planned keys of
one step. Buffers come from a :class:`BufferPool` and are reused: host memory is
bounded by the snapshots alive at once, at most three (the paper's triple
buffer): one being filled, one being persisted, and the newest complete one
kept for recovery from RAM.

With ``CheckpointConfig(ram_dir=...)`` the buffers are slots in node-local shared
memory (:mod:`moepec.ram.shm`) that outlive the process: a snapshot's slot is
committed (header written last) once its copy is complete, and a restarted worker
loads the committed slots of its rank (``RamTier.recovered``).

On CUDA the buffers are pinned and the copies run non-blocking on a side stream; on
CPU they are plain reused tensors copied by one worker thread while the training thread
runs the next forward and backward (torch releases the GIL inside ``copy_``).

A snapshot is *copied* once the live tensors are in RAM: the training loop waits for
that and nothing more (before ``optimizer.step()`` mutates the weights). Its *seal*
follows on the copy thread, off the loop's path: the checksums of its copy (every key
of a shared-memory slot, the keys to persist otherwise), hashed once and used by both
the slot's header and the persist, then the slot's header, written last. The snapshot
is *done* once sealed; the persist, the replica exchange and a restore from RAM read
only done snapshots.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

import torch

from moepec.errors import CheckpointError
from moepec.hooks import FaultHooks
from moepec.ram.shm import Slot, SlotHeader, SlotStore
from moepec.state.bytecopy import copy_all, copy_laid_out
from moepec.store.checksum import tensor_checksum
from moepec.store.meta import CheckpointMeta

log = logging.getLogger(__name__)
_SHAPE = attrgetter("shape", "dtype")  # a tensor's, read in C (the slot's layout)


class BufferPool:
    """Free lists of host tensors by (shape, dtype). Thread-safe."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.pin = torch.cuda.is_available()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        spec = (tuple(like.shape), like.dtype)
        with self._lock:
            if self._free[spec]:
                return self._free[spec].pop()
            self.allocated_bytes += like.numel() * like.element_size()
        return torch.empty(spec[0], dtype=spec[1], device="cpu", pin_memory=self.pin)

    def take_all(self, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A buffer for each tensor of ``like``, by key: :meth:`take` under one lock (the
        training thread calls it for every key of a snapshot, ~600 at K=1)."""
        out, new = {}, []
        with self._lock:
            for key, t in like.items():
                free = self._free.get((t.shape, t.dtype))  # torch.Size hashes as a tuple
                if free:
                    out[key] = free.pop()
                else:
                    new.append(key)
        for key in new:
            out[key] = self.take(like[key])
        return out

    def give(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            for t in tensors.values():
                self._free[(tuple(t.shape), t.dtype)].append(t)


@dataclass(slots=True)
class Snapshot:
    """A copy of one step's planned state in host RAM, plus what the manifest needs."""

    tensors: dict[str, torch.Tensor]
    """key -> host buffer (tensor keys, filled by the copy) and object keys (filled at once).
    With a shared-memory slot the copy thread replaces it by views of the slot (objects
    and buffers copied in); read it only once ``copied`` is set."""
    persist_keys: frozenset[str]
    meta: CheckpointMeta
    """The manager's bookkeeping, captured on the training thread (step, seq, experts,
    counts, ledger, selectors, K...) when the snapshot is taken."""
    persist: bool
    """Whether this snapshot is to be persisted (else it stays in RAM only)."""
    copied: threading.Event = field(default_factory=threading.Event)
    """Set once the live tensors are copied (or the copy failed): the loop may go on."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set once the snapshot is sealed (checksums, a slot's header) or has failed."""
    error: BaseException | None = None
    """Why it is not usable: its copy or (after ``copied``: only logged) its seal failed."""
    copy_error: BaseException | None = None
    """Why its copy failed (set before ``copied``): what ``Snapshotter.wait`` raises."""
    copy_seconds: float = 0.0
    """Seconds of the copy the loop waits for (the seal after it not included)."""
    seal_seconds: float = 0.0
    """Seconds of the seal (checksums and a slot's header), off the loop's path."""
    checksums: dict[str, str] = field(default_factory=dict)
    """key -> checksum of its copy (``moepec.store.checksum``), set by the seal: every key
    of a slot, the keys to persist otherwise. Read it only once ``done`` is set."""
    refs: int = 1
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    all_keys: list[str] = field(default_factory=list)
    """Every key of this snapshot over all ranks (each rank holds its share)."""
    slot: Slot | None = None
    """The shared-memory slot holding ``tensors`` (ram_dir set), else None."""
    origin: str = "process"
    """``process`` (taken by this process) or ``shm`` (loaded from a slot a previous
    worker committed)."""
    verified: bool = True
    """False for a slot recovered unchecked (``recovered(verify=False)``): no tensors
    yet; ``SlotStore.intact`` maps and checks them."""

    @property
    def seq(self) -> int:
        return self.meta.seq

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def snapshot_experts(self) -> list[tuple[int, ...]]:
        """Experts per layer copied to RAM."""
        return [tuple(e) for e in self.meta.experts_snapshot]

    @property
    def persist_experts(self) -> list[tuple[int, ...]] | None:
        """Experts per layer to persist; None when this snapshot is not to be persisted."""
        return [tuple(e) for e in self.meta.experts_saved] if self.persist else None


def slot_jobs(snaps: Iterable[Snapshot]) -> list[Path]:
    """The job folders of the shared-memory slots ``snaps`` were loaded from, sorted."""
    return sorted({s.slot.header_path.parent.parent for s in snaps
                   if s.slot is not None and s.origin != "process"})


def clean_command(jobs: Iterable[Path]) -> str:
    """The ``moepec ram clean`` that removes ``jobs`` (:func:`slot_jobs`)."""
    return "; ".join(f"moepec ram clean --ram-dir {j.parent} --run {j.name}"
                     for j in jobs) or "moepec ram clean --ram-dir <ram_dir>"


class Snapshotter:
    """Fills snapshots: inline, or on one background worker thread.

    ``start`` is called on the training thread; ``wait`` blocks (with a timeout)
    until the last started snapshot is complete and re-raises its error.
    """

    def __init__(self, pool: BufferPool, *, background: bool, timeout_s: float,
                 slots: SlotStore | None = None, hooks: FaultHooks | None = None) -> None:
        self.pool = pool
        self.hooks = hooks or FaultHooks()
        """Fault-injection seams (moepec.hooks.SNAPSHOT_POINTS), on the copying thread."""
        self.slots = slots
        self.background = background
        self.timeout_s = timeout_s
        self._pending: Snapshot | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def start(self, snap: Snapshot, sources: Mapping[str, torch.Tensor]) -> None:
        """Begin copying ``sources`` (live tensors) into pooled buffers of ``snap``."""
        if self.slots is not None:
            # Only the slot is chosen here: the copy thread removes its header, maps it
            # (creating its file and faulting its pages in) and fills it, so the training
            # thread does no file I/O and takes no page faults (see _into_slot).
            snap.slot = self.slots.reserve()
        else:
            snap.pooled = self.pool.take_all(sources)
            snap.tensors.update(snap.pooled)
        self._pending = snap
        if not self.background:
            self._copy(snap, sources)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moepec-snapshot",
                                            daemon=True)
            self._thread.start()
        self._queue.put((snap, dict(sources)))

    def wait(self) -> Snapshot | None:
        """Block until the pending snapshot is copied (its seal may still run); returns it
        (or None). Raises CheckpointError when its copy failed or timed out."""
        snap = self._pending
        if snap is None:
            return None
        if not snap.copied.wait(self.timeout_s):
            raise CheckpointError(
                f"snapshot of step {snap.step} did not finish within {self.timeout_s}s; "
                f"raise CheckpointConfig.timeout_s or check host memory pressure")
        self._pending = None
        if snap.copy_error is not None:
            raise CheckpointError(f"snapshot of step {snap.step} failed: {snap.copy_error}") \
                from snap.copy_error
        return snap

    @property
    def pending(self) -> Snapshot | None:
        """The last started snapshot, until ``wait`` has returned it."""
        return self._pending

    @property
    def busy(self) -> bool:
        """Whether the pending snapshot's copy is still running."""
        return self._pending is not None and not self._pending.copied.is_set()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.timeout_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._copy(*item)

    def _copy(self, snap: Snapshot, sources: Mapping[str, torch.Tensor]) -> None:
        """Copy ``sources`` into ``snap`` (``copied``), then seal it (``done``)."""
        t0 = time.perf_counter()
        try:
            self.hooks.snapshot_point("copy", snap.step)
            if snap.slot is not None:
                self._into_slot(snap, sources)  # (on CPU, the copy too)
            if self._stream is not None:
                # Side stream: copies overlap compute on the default stream; the
                # caller waited for the optimizer step before starting us.
                self._stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._stream):
                    for key, src in sources.items():
                        snap.tensors[key].copy_(src.detach(), non_blocking=True)
                self._stream.synchronize()
            elif snap.slot is None:
                # On this thread, never in torch's pool (which the training thread keeps
                # busy), and at little cost per tensor (moepec.state.bytecopy.copy_all).
                tensors = snap.tensors
                copy_all((tensors[key], src) for key, src in sources.items())
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
            snap.error = snap.copy_error = exc
        t1 = time.perf_counter()
        snap.copy_seconds = t1 - t0
        snap.copied.set()
        if snap.error is None:
            try:
                self._seal(snap)
            except BaseException as exc:  # noqa: BLE001 - surfaced by the persist
                log.warning("snapshot of step %d could not be sealed (not usable): %s",
                            snap.step, exc)
                snap.error = exc
        snap.seal_seconds = time.perf_counter() - t1
        snap.done.set()

    def _into_slot(self, snap: Snapshot, sources: Mapping[str, torch.Tensor]) -> None:
        """Lay ``snap``'s slot out for the sources and the objects and buffers captured
        already, copy them in (on CUDA not the device's: the side stream copies those) and
        point ``snap.tensors`` at it; sources' metadata read once. Copy thread."""
        slot, both = snap.slot, {**sources, **snap.tensors}
        tensors = list(both.values())
        snap.tensors = self.slots.prepare(slot, list(both), tuple(map(_SHAPE, tensors)))
        skip = len(sources) if self._stream is not None else 0
        copy_laid_out(slot.base.data_ptr(), slot.plan[1][skip:], tensors[skip:],
                      slot.views[2][skip:])

    def _seal(self, snap: Snapshot) -> None:
        """Checksum ``snap``'s copy and commit its slot (header last). Copy thread, after
        ``copied``: off the loop's path."""
        slots = self.slots
        if snap.slot is None or slots is None:
            if snap.persist:
                snap.checksums = {k: tensor_checksum(snap.tensors[k])
                                  for k in snap.persist_keys if k in snap.tensors}
            return
        self.hooks.snapshot_point("seal", snap.step)
        snap.checksums = slots.commit(snap.slot, SlotHeader(
            root=slots.root, rank=slots.rank, world_size=slots.world_size,
            meta=snap.meta, entries={}, all_keys=list(snap.all_keys),
            persist_keys=sorted(snap.persist_keys),
            snapshot_experts=[list(e) for e in snap.snapshot_experts],
            persist_experts=(None if snap.persist_experts is None
                             else [list(e) for e in snap.persist_experts]),
            written_at=time.time(), pid=os.getpid()))


class RamTier:
    """Level one as a whole: pooled host buffers, the copying worker, and the newest
    complete snapshot kept for recovery from RAM (the triple buffer's third slot).

    A snapshot's buffers go back to the pool when its last holder releases it: the
    tier (when a newer snapshot replaces it) and the persist worker (when written).
    ``start``/``finish``/``drop`` are called on the training thread; ``release`` on
    either thread.
    """

    def __init__(self, *, background: bool, timeout_s: float,
                 slots: SlotStore | None = None, replicas: SlotStore | None = None,
                 hooks: FaultHooks | None = None) -> None:
        self.pool = BufferPool()
        self.slots = slots
        self.replicas = replicas
        """Slots of another node's rank this rank keeps (ram_replicas), or None."""
        self.on_complete: Callable[[Snapshot], None] | None = None
        """Called (training thread) with each completed shared-memory snapshot, on which
        it holds a reference it must ``release`` (the replicator)."""
        """Shared-memory slots (ram_dir set), or None for in-process buffers."""
        self.snapshotter = Snapshotter(self.pool, background=background, timeout_s=timeout_s,
                                       slots=slots, hooks=hooks)
        self._loaded: list[Snapshot] = []
        self.newest: Snapshot | None = None
        """The newest complete snapshot (the RAM recovery copy), or None."""
        self._refs_lock = threading.Lock()

    def start(self, snap: Snapshot, sources: Mapping[str, torch.Tensor]) -> None:
        """Begin copying ``sources`` into ``snap`` (returns at once when in the background)."""
        self.snapshotter.start(snap, sources)

    def finish(self) -> Snapshot | None:
        """Wait for the snapshot in flight and make it the newest; returns it (None when
        none was in flight). Raises CheckpointError if its copy failed or timed out."""
        snap = self.snapshotter.wait()
        if snap is not None and snap is not self.newest:
            old, self.newest = self.newest, snap
            if old is not None:
                self.release(old)
            if self.on_complete is not None and snap.slot is not None:
                self.hold(snap)
                self.on_complete(snap)
        return snap

    def usable(self) -> Snapshot | None:
        """The newest snapshot once sealed, if intact (what a restore may use); waits for a
        seal in flight (the snapshot timeout)."""
        snap = self.newest
        if snap is None or not snap.done.wait(self.snapshotter.timeout_s):
            return None
        return snap if snap.error is None else None

    def drop(self) -> None:
        """Forget the newest snapshot (its step was abandoned, or the RAM was lost)."""
        if self.newest is not None:
            self.release(self.newest)
            self.newest = None

    def hold(self, snap: Snapshot) -> None:
        """One more holder of ``snap`` (it calls ``release`` when done)."""
        with self._refs_lock:
            snap.refs += 1

    def release(self, snap: Snapshot) -> None:
        """One holder is done with ``snap``; the last one returns its buffers to the pool."""
        with self._refs_lock:
            snap.refs -= 1
            if snap.refs == 0:
                if snap.slot is not None and self.slots is not None:
                    self.slots.release(snap.slot)
                else:
                    self.pool.give(snap.pooled)
                snap.pooled = {}

    # -- snapshots a previous worker left in shared memory -------------------------
    def recovered(self, accept: Callable[[CheckpointMeta], bool] | None = None,
                  verify: bool = True) -> list[Snapshot]:
        """The snapshots a restore may use, newest first: this process's newest when it
        has one; otherwise, with shared-memory slots, every intact committed slot of this
        rank that ``accept`` admits (held until ``settle``); without ``verify``, their
        headers alone (``verified`` False: ``SlotStore.intact`` gives the tensors).
        Training thread."""
        usable = self.usable()
        if usable is not None or self.slots is None:
            return [usable] if usable is not None else []
        if not self._loaded:
            found = [(slot, header, tensors, "shm") for slot, header, tensors
                     in self.slots.load(verify)]
            if self.replicas is not None:
                found += [(slot, header, tensors, "replica") for slot, header, tensors
                          in self.replicas.load(verify)]
            for slot, header, tensors, origin in found:
                if accept is not None and not accept(header.meta):
                    log.warning("not reading RAM slot seq %d: written by run %s, which is "
                                "not in the lineage of this checkpoint root", header.seq,
                                header.meta.run_id or "?")
                    continue
                (self.slots if origin == "shm" else self.replicas).hold(slot)
                snap = Snapshot(tensors=tensors, persist_keys=frozenset(header.persist_keys),
                                meta=header.meta, persist=header.persist_experts is not None,
                                all_keys=list(header.all_keys), slot=slot, origin=origin,
                                checksums={k: e["checksum"] for k, e in header.entries.items()},
                                verified=verify)
                snap.copied.set()
                snap.done.set()
                self._loaded.append(snap)
        return list(self._loaded)

    def settle(self, base_seq: int, keep: bool) -> Snapshot | None:
        """After a restore from base ``base_seq``: keep the loaded snapshot of that seq as
        the newest (``keep``: the base was in RAM), release the other loaded ones, and
        invalidate slots newer than the base (an abandoned future). Returns the kept one."""
        kept = None
        for snap in self._loaded:
            if keep and snap.seq == base_seq and kept is None and snap.origin == "shm":
                kept = snap
            else:
                self.release(snap)
        self._loaded = []
        if kept is not None:
            self.newest = kept
        for store in (self.slots, self.replicas):
            if store is not None:
                store.invalidate(lambda seq: seq > base_seq)
        return kept

    @property
    def allocated_bytes(self) -> int:
        return self.slots.allocated_bytes if self.slots is not None else \
            self.pool.allocated_bytes

    def close(self, unlink: bool = False) -> None:
        """Stop the copy worker; with shared-memory slots drop the mappings, and with
        ``unlink`` (a clean close) remove this rank's slot files."""
        self.snapshotter.close()
        if self.slots is not None:
            self.newest = None
            self._loaded = []
            self.slots.close(unlink)
        if self.replicas is not None:
            self.replicas.close(unlink)
