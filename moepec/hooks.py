"""Fault-injection seams, for tests and fault injection: a :class:`FaultHooks` object
given to ``CheckpointManager(..., hooks=...)`` is called at fixed points of the persist
and the RAM snapshot, on the thread doing that work. Normal runs pass none.

A hook may block (to hold a persist or a copy at that point), raise (the persist or the
snapshot then fails as it would for a storage or memory error) or end the process (a
crash at that point). Nothing else in the library reads or patches module globals for
this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PERSIST_POINTS = ("write", "written", "before_commit", "after_commit", "retention")
"""Where ``on_persist`` is called: ``write`` (every rank, before its data is written),
``written`` (every rank, its data written), ``before_commit`` and ``after_commit`` (rank 0,
around the manifest write), ``retention`` (rank 0, before old checkpoints are deleted)."""
SNAPSHOT_POINTS = ("copy", "seal")
"""Where ``on_snapshot`` is called: ``copy`` (before a snapshot's copy starts) and ``seal``
(a shared-memory slot's data written, its header not yet)."""


@dataclass(slots=True, kw_only=True)
class FaultHooks:
    """Callables run at the persist's and the snapshot's fault points (for tests and fault
    injection). Either may be None; a field may be replaced while the manager runs (it is
    read at each point)."""

    on_persist: Callable[[str, str], None] | None = None
    """``on_persist(point, checkpoint_name)``, on the persist worker thread (or the
    training thread when persists are synchronous); points: :data:`PERSIST_POINTS`."""
    on_snapshot: Callable[[str, int], None] | None = None
    """``on_snapshot(point, step)``, on the copying thread; points: :data:`SNAPSHOT_POINTS`."""

    def persist_point(self, point: str, name: str) -> None:
        """Called by the persister at ``point`` of the persist of checkpoint ``name``."""
        if self.on_persist is not None:
            self.on_persist(point, name)

    def snapshot_point(self, point: str, step: int) -> None:
        """Called by the snapshotter at ``point`` of the snapshot of ``step``."""
        if self.on_snapshot is not None:
            self.on_snapshot(point, step)
