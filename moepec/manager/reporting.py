"""What the manager tells its owner: the records it owes the constructor's callbacks.

:class:`Reporter` keeps the checkpoint whose RAM copy is in flight (its
:class:`~moepec.events.SnapshotRecord` is due when the copy is finished), the seconds
the loop waited for it, and the loop's total blocked time. Training thread only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from moepec.events import CheckpointEvent, SnapshotRecord
from moepec.ram.snapshot import Snapshot

log = logging.getLogger(__name__)


def notify(callback: Callable[[Any], None] | None, record: Any) -> None:
    """Deliver ``record``; an observer's error is logged, never raised."""
    if callback is not None:
        try:
            callback(record)
        except Exception:  # noqa: BLE001 - an observer must not fail the checkpoint
            log.exception("checkpoint callback %r failed", callback)


class Reporter:
    """The records of one manager's checkpoints, delivered to its callbacks."""

    def __init__(self, on_checkpoint: Callable[[CheckpointEvent], None] | None,
                 on_snapshot: Callable[[SnapshotRecord], None] | None) -> None:
        self.on_checkpoint, self.on_snapshot = on_checkpoint, on_snapshot
        self.copying: CheckpointEvent | None = None
        """The checkpoint whose RAM snapshot is in flight (its SnapshotRecord is due)."""
        self.copy_wait = 0.0
        """Seconds the loop waited so far for that snapshot."""
        self.blocked = 0.0
        """Total seconds the loop was blocked in step() and wait_for_snapshot()."""

    def started(self, snap: Snapshot, sources: Mapping[str, torch.Tensor], *, full: bool,
                persist: bool, k: tuple[int, int]) -> CheckpointEvent:
        """The RAM copy of ``snap`` (from the live tensors ``sources``) started, with
        (K_persist, K_snapshot) ``k``: its event (``blocked_s`` not known yet; delivered
        by ``checkpoint``), and its SnapshotRecord is due when it is copied."""
        nbytes = sum(t.numel() * t.element_size() for t in sources.values())
        event = CheckpointEvent(
            step=snap.step, seq=snap.seq, full=full, persist=persist,
            experts_snapshot=tuple(snap.snapshot_experts),
            experts_persist=None if snap.persist_experts is None else tuple(snap.persist_experts),
            k_persist=k[0], k_snapshot=k[1], snapshot_bytes=nbytes, blocked_s=0.0)
        self.copying, self.copy_wait = event, 0.0
        return event

    def waited(self, seconds: float) -> None:
        """The loop waited ``seconds`` for the copy in flight."""
        self.blocked += seconds
        self.copy_wait += seconds

    def checkpoint(self, event: CheckpointEvent, blocked: float) -> None:
        """A checkpoint was started, the loop blocked ``blocked`` seconds for it."""
        self.blocked += blocked
        notify(self.on_checkpoint, dataclasses.replace(event, blocked_s=blocked))

    def snapshot(self, record: SnapshotRecord) -> None:
        """Deliver a SnapshotRecord returned earlier by ``copied(notify=False)``."""
        notify(self.on_snapshot, record)

    def copied(self, snap: Snapshot | None, notify: bool = True) -> SnapshotRecord | None:
        """The SnapshotRecord of a finished snapshot this manager started (delivered to
        ``on_snapshot`` when ``notify``, else returned); None for any other."""
        started = self.copying
        if snap is None or started is None or started.seq != snap.seq:
            return None
        self.copying = None
        record = SnapshotRecord(step=started.step, seq=started.seq,
                                snapshot_bytes=started.snapshot_bytes,
                                copy_s=snap.copy_seconds, wait_s=self.copy_wait)
        if not notify:
            return record
        self.snapshot(record)
        return None
