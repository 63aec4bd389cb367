"""Level two of two-level checkpointing: write a RAM snapshot to storage and commit it.

One worker thread (or inline, for synchronous checkpointing) takes one snapshot at a
time: checksums of this rank's items, the DCP write, the meeting of all ranks, the
manifest written last by rank 0 (the commit), then retention. Errors are recorded
and re-raised on the training thread at its next call (``check``) and at ``close``.

Collectives here run only on a dedicated process group created by the manager, so
the training thread's collectives never interleave with ours.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from moepec import manifest as mf
from moepec.checksum import tensor_checksum
from moepec.errors import CheckpointError, PersistError
from moepec.snapshot import Snapshot
from moepec.storage import Storage, checkpoint_name

log = logging.getLogger(__name__)

# Fault-injection seam (moepec.faults sets it; None in normal runs). Called with a
# point name: "write", "written" (every rank, data written), "before_commit",
# "after_commit" (rank 0), "retention".
fault_hook: Callable[[str, str], None] | None = None


def _hook(point: str, name: str) -> None:
    if fault_hook is not None:
        fault_hook(point, name)


def _retention_fields(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What retention needs of a manifest: its lineage and the sources of its view."""
    return {"name": manifest["name"], "seq": manifest["seq"],
            "parent": manifest.get("parent"), "ancestors": manifest.get("ancestors", []),
            "view": {src: src for src in set(manifest["view"].values())}}


def _describe(tensors: Mapping[str, Any], rank: int) -> dict[str, dict[str, Any]]:
    """Manifest entries of this rank's items: shape, dtype, bytes, checksum, writer."""
    return {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                "nbytes": t.numel() * t.element_size(), "checksum": tensor_checksum(t),
                "rank": rank} for k, t in tensors.items()}


def root_cause(exc: BaseException) -> BaseException:
    """The underlying error of a DCP CheckpointException (one per failed rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, tuple) and first:  # DCP wraps (exception, traceback)
            first = first[0]
        if isinstance(first, BaseException):
            return root_cause(first)
    return exc


@dataclass(slots=True)
class PersistRecord:
    """What one persist did (kept by the manager for reports and benchmarks)."""

    name: str
    step: int
    bytes_written: int
    bytes_per_rank: list[int]
    seconds: float
    committed: bool


class Persister:
    """Writes snapshots to storage, one in flight at most."""

    def __init__(self, storage: Storage, *, rank: int, world_size: int,
                 group: dist.ProcessGroup | None, background: bool, timeout_s: float,
                 keep_last: int, release: Callable[[Snapshot], None]) -> None:
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.background = background
        self.timeout_s = timeout_s
        self.keep_last = keep_last
        self.release = release
        self.head: str | None = None
        self.head_view: dict[str, str] = {}
        self.head_ancestors: list[str] = []
        self.records: list[PersistRecord] = []
        self.on_commit: Callable[[PersistRecord, Mapping[str, Any]], None] | None = None
        """Called on the worker thread after each commit (record, manifest fields)."""
        self._error: BaseException | None = None
        self._manifest_cache: dict[str, Any] = {}
        self._idle = threading.Event()
        self._idle.set()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # -- training-thread API -------------------------------------------------
    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def submit(self, snap: Snapshot, fields: Mapping[str, Any]) -> None:
        """Persist ``snap`` (inline or in the background). Caller checked ``busy`` and
        took any earlier error. Inline, raises PersistError if this persist fails."""
        self._idle.clear()
        if not self.background:
            self._run_one(snap, fields)
            self.check()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="moepec-persist",
                                            daemon=True)
            self._thread.start()
        self._queue.put((snap, dict(fields)))

    def wait_idle(self, timeout: float | None = None) -> None:
        if not self._idle.wait(self.timeout_s if timeout is None else timeout):
            raise CheckpointError(
                f"persist did not finish within {self.timeout_s}s; storage may be stalled. "
                f"Raise CheckpointConfig.timeout_s or check the storage")

    def check(self) -> None:
        """Re-raise (once) an error of the worker on the calling thread."""
        err = self.take_error()
        if err is not None:
            raise err

    def take_error(self) -> PersistError | None:
        """The worker's error as a PersistError (once), or None."""
        if self._error is None:
            return None
        err, self._error = self._error, None
        cause = root_cause(err)
        wrapped = PersistError(f"checkpoint persist failed: {type(cause).__name__}: {cause}. "
                               f"The last committed checkpoint is intact.")
        wrapped.__cause__ = err
        return wrapped

    def close(self) -> None:
        """Wait for the persist in flight, stop the worker; idempotent."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.timeout_s)
            self._thread = None
        self.check()

    # -- worker --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run_one(*item)

    def _run_one(self, snap: Snapshot, fields: Mapping[str, Any]) -> None:
        try:
            self._persist(snap, fields)
        except BaseException as exc:  # noqa: BLE001 - surfaced by check()
            log.error("persist of step %s failed: %s", snap.step, root_cause(exc))
            self._error = exc
            self.records.append(PersistRecord(checkpoint_name(snap.seq, snap.step), snap.step,
                                              0, [], 0.0, False))
        finally:
            self.release(snap)
            self._idle.set()

    def _persist(self, snap: Snapshot, fields: Mapping[str, Any]) -> None:
        if not snap.done.wait(self.timeout_s):
            raise CheckpointError(f"snapshot of step {snap.step} never completed")
        if snap.error is not None:
            raise snap.error
        t0 = time.perf_counter()
        name = checkpoint_name(snap.seq, snap.step)
        keys = sorted(k for k in snap.persist_keys if k in snap.tensors)
        tensors = {k: snap.tensors[k] for k in keys}
        # Checksums before the write, on this thread: on 2 cores a checksum thread beside
        # the write slowed the write 2-3x (measured), more than the hashing costs.
        infos = _describe(tensors, self.rank)
        _hook("write", name)
        self.storage.write(name, tensors, self.group)
        _hook("written", name)
        all_infos = infos
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, infos, group=self.group)
            all_infos = {k: v for part in gathered for k, v in part.items()}
        bytes_per_rank = [0] * self.world_size
        for v in all_infos.values():
            bytes_per_rank[v["rank"]] += v["nbytes"]
        view = mf.updated_view(self.head_view, name, all_infos)
        ancestors = ((self.head_ancestors + [self.head])[-mf.MAX_ANCESTORS:]
                     if self.head else [])
        ok = [True]
        if self.rank == 0:
            manifest = dict(fields)
            manifest.update(format=mf.FORMAT, serialization=self.storage.serialization,
                            name=name, parent=self.head,
                            ancestors=ancestors, keys=all_infos,
                            view=view, bytes_per_rank=bytes_per_rank,
                            bytes=sum(bytes_per_rank), committed_at=time.time())
            _hook("before_commit", name)
            try:
                self.storage.write_manifest(name, manifest)
                self._manifest_cache[name] = _retention_fields(manifest)
            except Exception:
                ok = [False]
                if self.world_size == 1:
                    raise
                log.exception("commit of %s failed", name)
            _hook("after_commit", name)
        if self.world_size > 1:
            dist.broadcast_object_list(ok, src=0, group=self.group)
        if not ok[0]:
            raise CheckpointError(f"rank 0 could not commit {name}; it is not a checkpoint")
        self.head, self.head_view, self.head_ancestors = name, view, ancestors
        seconds = time.perf_counter() - t0
        record = PersistRecord(name, snap.step, sum(bytes_per_rank), bytes_per_rank, seconds,
                               True)
        self.records.append(record)
        if self.on_commit is not None:
            try:
                self.on_commit(record, fields)
            except Exception:  # noqa: BLE001 - an observer must not fail the checkpoint
                log.exception("on_commit callback failed")
        log.info("committed %s (%d bytes, %.2fs)", name, sum(bytes_per_rank), seconds)
        if self.rank == 0:
            self._retain()

    def _retain(self) -> None:
        _hook("retention", self.head or "")
        listing = self.storage.list_checkpoints()
        manifests: dict[str, Any] = {}
        for n, committed in listing:
            if committed:
                if n not in self._manifest_cache:  # committed manifests never change
                    try:
                        fields = _retention_fields(self.storage.read_manifest(n))
                        self._manifest_cache[n] = fields
                    except CheckpointError as exc:
                        log.warning("retention skips %s: %s", n, exc)
                        continue
                manifests[n] = self._manifest_cache[n]
        self._manifest_cache = {n: m for n, m in self._manifest_cache.items() if n in manifests}
        uncommitted = [n for n, c in listing if not c]
        for n in mf.to_delete(manifests, uncommitted, self.keep_last):
            log.info("retention deletes %s", n)
            self.storage.delete(n)
