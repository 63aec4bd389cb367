"""Level one of two-level checkpointing: copy planned tensors into host RAM.

A :class:`Snapshot` is a complete, self-consistent copy of the planned keys of
one step. Buffers come from a :class:`BufferPool` and are reused: host memory is
bounded by the snapshots alive at once, at most three (the paper's triple
buffer): one being filled, one being persisted, and the newest complete one
kept for recovery from RAM.

On CUDA the buffers are pinned and the copies run non-blocking on a side
stream; on CPU they are plain reused tensors copied by one worker thread while
the training thread runs the next forward and backward (torch releases the GIL
inside ``copy_``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from moepec.errors import CheckpointError
from moepec.store.manifest import CheckpointMeta

log = logging.getLogger(__name__)

# Fault-injection seam (tests and moepec.train.faults set it; None in normal runs): called
# with ("copy", step) on the copying thread before a snapshot's copy starts.
fault_hook: Callable[[str, int], None] | None = None


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

    def give(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with self._lock:
            for t in tensors.values():
                self._free[(tuple(t.shape), t.dtype)].append(t)


@dataclass(slots=True)
class Snapshot:
    """A copy of one step's planned state in host RAM, plus what the manifest needs."""

    seq: int
    step: int
    tensors: dict[str, torch.Tensor]
    """key -> host buffer (tensor keys, filled by the copy) and object keys (filled at once)."""
    snapshot_experts: list[tuple[int, ...]]
    persist_experts: list[tuple[int, ...]] | None
    """Experts per layer to persist; None when this snapshot is not to be persisted."""
    persist_keys: frozenset[str]
    meta: CheckpointMeta | None
    """The manager's bookkeeping, captured on the training thread (counts, ledger,
    selectors, K...); set before the snapshot is started."""
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    copy_seconds: float = 0.0
    refs: int = 1
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    all_keys: list[str] = field(default_factory=list)
    """Every key of this snapshot over all ranks (each rank holds its share)."""


class Snapshotter:
    """Fills snapshots: inline, or on one background worker thread.

    ``start`` is called on the training thread; ``wait`` blocks (with a timeout)
    until the last started snapshot is complete and re-raises its error.
    """

    def __init__(self, pool: BufferPool, *, background: bool, timeout_s: float) -> None:
        self.pool = pool
        self.background = background
        self.timeout_s = timeout_s
        self._pending: Snapshot | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def start(self, snap: Snapshot, sources: Mapping[str, torch.Tensor]) -> None:
        """Begin copying ``sources`` (live tensors) into pooled buffers of ``snap``."""
        for key, src in sources.items():
            buf = self.pool.take(src)
            snap.pooled[key] = buf
            snap.tensors[key] = buf
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
        """Block until the pending snapshot is complete; returns it (or None)."""
        snap = self._pending
        if snap is None:
            return None
        if not snap.done.wait(self.timeout_s):
            raise CheckpointError(
                f"snapshot of step {snap.step} did not finish within {self.timeout_s}s; "
                f"raise CheckpointConfig.timeout_s or check host memory pressure")
        self._pending = None
        if snap.error is not None:
            raise CheckpointError(f"snapshot of step {snap.step} failed: {snap.error}") \
                from snap.error
        return snap

    @property
    def pending(self) -> Snapshot | None:
        """The last started snapshot, until ``wait`` has returned it."""
        return self._pending

    @property
    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done.is_set()

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
        t0 = time.perf_counter()
        try:
            if fault_hook is not None:
                fault_hook("copy", snap.step)
            if self._stream is not None:
                # Side stream: copies overlap compute on the default stream; the
                # caller waited for the optimizer step before starting us.
                self._stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self._stream):
                    for key, src in sources.items():
                        snap.tensors[key].copy_(src.detach(), non_blocking=True)
                self._stream.synchronize()
            else:
                with torch.no_grad():
                    for key, src in sources.items():
                        snap.tensors[key].copy_(src.detach())
        except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
            snap.error = exc
        snap.copy_seconds = time.perf_counter() - t0
        snap.done.set()


class RamTier:
    """Level one as a whole: pooled host buffers, the copying worker, and the newest
    complete snapshot kept for recovery from RAM (the triple buffer's third slot).

    A snapshot's buffers go back to the pool when its last holder releases it: the
    tier (when a newer snapshot replaces it) and the persist worker (when written).
    ``start``/``finish``/``drop`` are called on the training thread; ``release`` on
    either thread.
    """

    def __init__(self, *, background: bool, timeout_s: float) -> None:
        self.pool = BufferPool()
        self.snapshotter = Snapshotter(self.pool, background=background, timeout_s=timeout_s)
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
        return snap

    def usable(self) -> Snapshot | None:
        """The newest snapshot if it is complete and intact (what a restore may use)."""
        snap = self.newest
        return snap if snap is not None and snap.done.is_set() and snap.error is None else None

    def drop(self) -> None:
        """Forget the newest snapshot (its step was abandoned, or the RAM was lost)."""
        if self.newest is not None:
            self.release(self.newest)
            self.newest = None

    def release(self, snap: Snapshot) -> None:
        """One holder is done with ``snap``; the last one returns its buffers to the pool."""
        with self._refs_lock:
            snap.refs -= 1
            if snap.refs == 0:
                self.pool.give(snap.pooled)
                snap.pooled = {}

    def close(self) -> None:
        self.snapshotter.close()
