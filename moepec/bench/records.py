"""What a benchmark keeps of a CheckpointManager's run: its typed records, collected by the
callbacks given to the manager's constructor (``CheckpointManager(..., **r.callbacks())``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moepec import CheckpointEvent, CommitRecord, SnapshotRecord


@dataclass(slots=True)
class Records:
    """Every checkpoint started, snapshot completed and checkpoint committed, in order."""

    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    snapshots: dict[int, SnapshotRecord] = field(default_factory=dict)
    """By the checkpoint's seq."""
    commits: list[CommitRecord] = field(default_factory=list)

    def callbacks(self) -> dict[str, Any]:
        """The manager's ``on_checkpoint``, ``on_snapshot`` and ``on_commit`` arguments."""
        return {"on_checkpoint": self.checkpoints.append,
                "on_snapshot": lambda r: self.snapshots.__setitem__(r.seq, r),
                "on_commit": self.commits.append}

    def blocked(self) -> list[float]:
        """Seconds each checkpoint blocked the loop: starting it, and waiting for its copy."""
        return [e.blocked_s + (self.snapshots[e.seq].wait_s if e.seq in self.snapshots else 0.0)
                for e in self.checkpoints]

    def copies(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each completed snapshot copy that took measurable time."""
        return [(s.snapshot_bytes, s.copy_s) for e in self.checkpoints
                if (s := self.snapshots.get(e.seq)) is not None and s.copy_s]
