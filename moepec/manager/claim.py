"""This run's hold on its checkpoint root: its run id, the root's lease, and whether the
root can be written."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch.distributed as dist

from moepec.errors import CheckpointError, FencedError, LeaseError
from moepec.store.lease import Lease
from moepec.store.storage import Storage

log = logging.getLogger(__name__)


class RootClaim:
    """One per manager. The run id is drawn by rank 0 and agreed at construction
    (collective); rank 0 holds the lease (moepec.store.lease)."""

    def __init__(self, storage: Storage, *, rank: int, distributed: bool,
                 lease_timeout_s: float, takeover: bool) -> None:
        ids = [uuid.uuid4().hex[:12] if rank == 0 else None]
        if distributed:
            dist.broadcast_object_list(ids, src=0)
        self.run_id: str = ids[0]
        self.storage, self.rank, self.distributed = storage, rank, distributed
        self.lease = (Lease(storage, self.run_id, timeout_s=lease_timeout_s,
                            takeover=takeover) if rank == 0 else None)
        self.ready = False
        """The root was found writable and the lease is held."""
        self.paused: str | None = None
        """Why checkpoints go to RAM only (the root cannot be written), or None."""

    def claim(self) -> None:
        """Rank 0 probes that the root can be written and takes its lease; every rank
        learns the outcome (collective, training thread). Another live run's lease raises
        LeaseError on every rank; an unwritable root pauses checkpoints to storage (RAM
        snapshots and restores go on) until a later claim finds it writable."""
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                self.storage.check_writable()
                self.lease.acquire()
                outcome = [("ok", "")]
            except LeaseError as exc:
                outcome = [("held", str(exc))]
            except (CheckpointError, OSError) as exc:
                outcome = [("unwritable", str(exc))]
        if self.distributed:
            dist.broadcast_object_list(outcome, src=0)
        state, message = outcome[0]
        if state == "held":
            raise LeaseError(message)
        if state == "unwritable" and self.paused is None and self.rank == 0:
            log.warning("%s; checkpoints to storage are paused (RAM snapshots go on)", message)
        self.paused = message if state == "unwritable" else None
        self.ready = state == "ok"

    def check(self) -> None:
        """Rank 0, before each write, commit and deletion in the root: raises FencedError
        unless this run still holds the root's lease (any thread)."""
        if self.lease is not None:
            self.lease.check()

    def holds(self) -> bool:
        """Rank 0: whether this run still holds the root's lease (a fenced run writes
        nothing there, not even a recovery record)."""
        try:
            self.check()
        except FencedError:
            return False
        return True

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
