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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moepec.errors import CheckpointError, FencedError, PersistError
from moepec.events import CommitRecord
from moepec.hooks import FaultHooks
from moepec.keys import checkpoint_name
from moepec.store import manifest as mf
from moepec.store.checksum import tensor_checksum
from moepec.store.committed import committed_manifests
from moepec.store.items import Item
from moepec.store.lineage import to_delete, updated_view
from moepec.store.manifest import Manifest
from moepec.store.meta import CheckpointMeta
from moepec.store.parts import protected
from moepec.store.storage import Storage

log = logging.getLogger(__name__)


class Snapshot(Protocol):
    """What the persist worker reads of a RAM snapshot (:class:`moepec.ram.snapshot.Snapshot`
    is one): the storage tier sits below the RAM tier and names only these fields."""

    tensors: dict[str, torch.Tensor]
    persist_keys: frozenset[str]
    meta: CheckpointMeta
    done: threading.Event
    error: BaseException | None
    checksums: dict[str, str]
    """key -> checksum of the snapshot's copy, where its seal computed one (read once
    ``done`` is set); a key without one is hashed by the persist."""

    @property
    def seq(self) -> int: ...

    @property
    def step(self) -> int: ...


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

    def __init__(self, storage: Storage, *, run_id: str, rank: int, world_size: int,
                 group: dist.ProcessGroup | None, background: bool, timeout_s: float,
                 keep_last: int, release: Callable[[Snapshot], None],
                 guard: Callable[[], None] | None = None, hooks: FaultHooks | None = None,
                 on_commit: Callable[[CommitRecord], None] | None = None,
                 peers: Sequence[Storage] = ()) -> None:
        self.storage = storage
        self.peers = list(peers)
        """The other replica groups' roots (striped checkpoints): retention keeps this
        root's part of the newest checkpoint whole over all of them. Read only."""
        self.run_id = run_id
        """This run's id: in every checkpoint name it writes (names unique per run)."""
        self.guard = guard
        """Called by rank 0 before each write, commit and deletion in the root; raises
        FencedError when this run lost the root's lease."""
        self.fenced: str | None = None
        """Why this run no longer touches the root (its lease was taken over), or None.
        Set on every rank by the same persist (the decision is broadcast); final."""
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.background = background
        self.timeout_s = timeout_s
        self.keep_last = keep_last
        self.release = release
        self._head: Manifest | None = None
        """The committed checkpoint the next persist continues (one reference: the training
        thread reads its name and view while the worker may replace it)."""
        self.records: list[PersistRecord] = []
        self.hooks = hooks or FaultHooks()
        """Fault-injection seams (moepec.hooks.PERSIST_POINTS)."""
        self.on_commit = on_commit
        """Called on the worker thread after each commit with its CommitRecord."""
        self._error: BaseException | None = None
        self._known: dict[str, Manifest] = {}
        self._peers_known: list[dict[str, Manifest]] = [{} for _ in self.peers]
        """Committed manifests read or written so far (retention reads only new ones)."""
        self._idle = threading.Event()
        self._idle.set()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    # -- training-thread API -------------------------------------------------
    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    @property
    def head(self) -> str | None:
        """The name of the committed checkpoint the next persist continues, or None."""
        head = self._head
        return head.name if head is not None else None

    @property
    def head_view(self) -> Mapping[str, str]:
        """That checkpoint's view ({} when there is none)."""
        head = self._head
        return head.view if head is not None else {}

    def set_head(self, manifest: Manifest | None) -> None:
        """The committed checkpoint the next persist continues (None: start a new lineage).
        Called by the worker after a commit and by the manager after a restore. Raises
        ManifestError when its view cannot be read (it is read now, not by a later
        persist)."""
        if manifest is not None:
            manifest.view.keys()
        self._head = manifest

    def remember(self, manifests: Mapping[str, Manifest]) -> None:
        """Committed manifests read by a restore: retention reads them no more (a
        committed manifest never changes). Training thread, while no persist runs."""
        self._known.update(manifests)

    def submit(self, snap: Snapshot) -> None:
        """Persist ``snap`` (inline or in the background). Caller checked ``busy`` and
        took any earlier error. Inline, raises PersistError if this persist fails."""
        self._idle.clear()
        if not self.background:
            self._run_one(snap)
            self.check()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="moepec-persist",
                                            daemon=True)
            self._thread.start()
        self._queue.put(snap)

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
            self._run_one(item)

    def name_of(self, snap: Snapshot) -> str:
        """The checkpoint name ``snap`` is persisted as (this run's own)."""
        return checkpoint_name(snap.seq, snap.step, self.run_id)

    def _run_one(self, snap: Snapshot) -> None:
        name = self.name_of(snap)
        try:
            self._persist(snap)
        except FencedError as exc:
            # Not an error of this run's storage: another run owns the root now. Nothing
            # is cleaned up (that would be a deletion in its root); said once.
            if self.fenced is None and self.rank == 0:
                log.warning("%s", exc)
            self.fenced = str(exc)
            self.records.append(PersistRecord(name, snap.step, 0, [], 0.0, False))
        except BaseException as exc:  # noqa: BLE001 - surfaced by check()
            log.error("persist of step %s failed: %s", snap.step, root_cause(exc))
            self._error = exc
            self.records.append(PersistRecord(name, snap.step, 0, [], 0.0, False))
            if self.rank == 0 and self.fenced is None:
                self._discard(name)
        finally:
            self.release(snap)
            self._idle.set()

    def _persist(self, snap: Snapshot) -> None:
        """Write, meet, commit, retain. Runs on every rank (worker thread or inline)."""
        if not snap.done.wait(self.timeout_s):
            raise CheckpointError(f"snapshot of step {snap.step} never completed")
        if snap.error is not None:
            raise snap.error
        t0 = time.perf_counter()
        name = self.name_of(snap)
        self._agree_on_lease()
        early: dict[str, Any] = {}
        items = self._write_share(snap, name, early)
        manifest = early.get("manifest") or self._manifest(snap.meta, name,
                                                           self._gather(items))
        self._commit(manifest, early.get("view"), early.get("items_file"))
        self.set_head(manifest)
        record = PersistRecord(name, snap.step, manifest.bytes, manifest.bytes_per_rank,
                               time.perf_counter() - t0, True)
        self.records.append(record)
        self._notify(record, snap.meta)
        log.info("committed %s (%d bytes, %.2fs)", name, record.bytes_written, record.seconds)
        if self.rank == 0:
            self._retain()

    def _write_share(self, snap: Snapshot, name: str, early: dict[str, Any]
                     ) -> dict[str, Item]:
        """Write this rank's items of ``snap`` (a DCP save: collective over the group);
        returns their manifest entries, once durable. All ranks. While the data file is
        synced, the entries are made, and with one rank (nothing to gather) the
        manifest (``early["manifest"]``) and its side files (``early["view"]``,
        ``early["items_file"]``): only the manifest's create, after the data is durable,
        commits."""
        keys = sorted(k for k in snap.persist_keys if k in snap.tensors)
        tensors = {k: snap.tensors[k] for k in keys}
        # The snapshot's seal hashed its copy already (off the loop's path; the same
        # bytes as written here). A key it did not hash is hashed before the write, on
        # this thread: on 2 cores a checksum thread beside the write slowed the write 2-3x.
        checksums = {k: snap.checksums.get(k) or tensor_checksum(t) for k, t in tensors.items()}

        def meanwhile(where: Mapping[str, Any]) -> None:
            early["items"] = {k: Item(
                shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                nbytes=t.numel() * t.element_size(), checksum=checksums[k], rank=self.rank,
                file=where[k].file, offset=where[k].offset, length=where[k].length,
                encoding=where[k].encoding) for k, t in tensors.items()}
            if self.world_size == 1:
                early["manifest"] = self._manifest(snap.meta, name, early["items"])
                # Both encoded before either is written: the first fsync waits for the data
                # file's (ext4's ordered journal), and the encoding then runs beside it.
                view, items = (mf.encode_view(early["manifest"].view),
                               mf.encode_items(early["items"]))
                early["view"] = self.storage.write_side(name, view)
                early["items_file"] = self.storage.write_side(name, items)

        self.hooks.persist_point("write", name)
        self.storage.write(name, tensors, self.group, meanwhile=meanwhile)
        self.hooks.persist_point("written", name)
        return early["items"]

    def _agree_on_lease(self) -> None:
        """Rank 0 checks the lease before anything is written; every rank learns the
        answer (the persist group). Raises FencedError on every rank when it is lost."""
        lost = [self.fenced]
        if self.rank == 0 and lost[0] is None and self.guard is not None:
            try:
                self.guard()
            except FencedError as exc:
                lost = [str(exc)]
        if self.world_size > 1:
            dist.broadcast_object_list(lost, src=0, group=self.group)
        if lost[0] is not None:
            raise FencedError(lost[0])

    def _gather(self, items: dict[str, Item]) -> dict[str, Item]:
        """Every rank's items (all ranks meet here: the data is written everywhere)."""
        if self.world_size == 1:
            return items
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, items, group=self.group)
        return {k: v for part in gathered for k, v in part.items()}

    def _manifest(self, meta: CheckpointMeta, name: str, items: dict[str, Item]) -> Manifest:
        """The manifest of ``name`` on top of the current head (the same on every rank)."""
        bytes_per_rank = [0] * self.world_size
        for item in items.values():
            bytes_per_rank[item.rank] += item.nbytes
        head = self._head
        ancestors = ((list(head.ancestors) + [head.name])[-mf.MAX_ANCESTORS:]
                     if head is not None else [])
        parent = head.name if head is not None else None
        view = updated_view(head.view if head is not None else None, name, items)
        return Manifest(meta=meta, name=name, parent=parent, ancestors=ancestors,
                        keys=items, view=view,
                        bytes_per_rank=bytes_per_rank, bytes=sum(bytes_per_rank),
                        committed_at=time.time(), serialization=self.storage.serialization)

    def _discard(self, name: str) -> None:
        """Delete what a failed persist left (unless it committed): a full disk stays full
        otherwise. Best effort: what remains is an uncommitted folder, never read."""
        try:
            if self.guard is not None:
                self.guard()  # a run that lost the root deletes nothing there
            if not self.storage.is_committed(name):
                self.storage.delete(name)
        except FencedError:
            pass  # the new holder's retention removes it
        except Exception as exc:  # noqa: BLE001 - retention removes it later
            log.warning("could not remove the partial checkpoint %s: %s", name, exc)

    def _commit(self, manifest: Manifest, view: mf.FileRef | None = None,
                items: mf.FileRef | None = None) -> None:
        """Rank 0 writes the manifest (the commit; ``view``, ``items``: its side files,
        written already); every rank learns whether it did."""
        outcome: list[Any] = [("ok", "")]
        if self.rank == 0:
            self.hooks.persist_point("before_commit", manifest.name)
            try:
                if self.guard is not None:
                    self.guard()
                self.storage.write_manifest(manifest, view, items)
                self._known[manifest.name] = manifest
            except FencedError as exc:
                outcome = [("fenced", str(exc))]
            except Exception:
                outcome = [("failed", "")]
                if self.world_size == 1:
                    raise
                log.exception("commit of %s failed", manifest.name)
            self.hooks.persist_point("after_commit", manifest.name)
        if self.world_size > 1:
            dist.broadcast_object_list(outcome, src=0, group=self.group)
        state, message = outcome[0]
        if state == "fenced":
            raise FencedError(message)
        if state != "ok":
            raise CheckpointError(f"rank 0 could not commit {manifest.name}; it is not a "
                                  f"checkpoint")

    def _notify(self, record: PersistRecord, meta: CheckpointMeta) -> None:
        if self.on_commit is not None:
            try:
                self.on_commit(CommitRecord(
                    name=record.name, step=record.step, bytes=record.bytes_written,
                    bytes_per_rank=tuple(record.bytes_per_rank), seconds=record.seconds,
                    k_persist=meta.k_persist, full=meta.full))
            except Exception:  # noqa: BLE001 - an observer must not fail the checkpoint
                log.exception("on_commit callback failed")

    def _peer_manifests(self) -> list[dict[str, Manifest]]:
        """The committed manifests of the other groups' roots (only new ones are read)."""
        for i, peer in enumerate(self.peers):
            self._peers_known[i] = dict(committed_manifests(peer, self._peers_known[i]).manifests)
        return self._peers_known

    def _retain(self) -> None:
        """Delete what no retained view needs (rank 0, after a commit; only while this run
        holds the root's lease)."""
        self.hooks.persist_point("retention", self.head or "")
        if self.guard is not None:
            try:
                self.guard()
            except FencedError:
                return  # the next persist finds it too, and tells every rank (and the user)
        found = committed_manifests(self.storage, self._known)
        for name, exc in found.damaged.items():
            log.warning("retention skips %s: %s", name, exc)
        if found.newer_format() is not None:
            log.warning("retention deletes nothing: a newer moepec wrote checkpoints here")
            return
        self._known = found.manifests  # committed manifests never change
        keep = protected(found.manifests, self._peer_manifests()) if self.peers else set()
        for name in to_delete(found.manifests, found.uncommitted, self.keep_last, keep):
            log.info("retention deletes %s", name)
            self.storage.delete(name)
