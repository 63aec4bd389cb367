"""What a CheckpointManager tells its owner: typed records delivered to the callbacks given
to its constructor (``on_checkpoint``, ``on_snapshot``, ``on_commit``).

Each callback runs on the thread named in its record's docstring; an exception it raises
is logged and ignored (an observer never fails a checkpoint). A callback that runs on the
persist worker thread must be thread-safe with the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointEvent:
    """A checkpoint was started: its RAM snapshot taken (objects captured, the copy of the
    tensors under way). Delivered to ``on_checkpoint`` on the training thread, every rank,
    when ``step()``/``save()`` returns (also when it raises an earlier persist's error)."""

    step: int
    """The training step the checkpoint holds (the one passed to ``step()``)."""
    seq: int
    """The checkpoint's sequence number (in its name; grows by one per checkpoint)."""
    full: bool
    """Every expert is saved (the first checkpoint of a run, ``full_every``)."""
    persist: bool
    """It goes to storage; False: it stays in RAM (busy persister, paused or fenced root,
    or an earlier persist failed)."""
    experts_snapshot: tuple[tuple[int, ...], ...]
    """The experts copied to RAM, per MoE layer."""
    experts_persist: tuple[tuple[int, ...], ...] | None
    """The experts written to storage, per MoE layer; None when not persisted."""
    k_persist: int
    k_snapshot: int
    snapshot_bytes: int
    """Bytes of live tensors this rank copies into the snapshot."""
    blocked_s: float
    """Seconds ``step()``/``save()`` blocked the training loop to start it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRecord:
    """A checkpoint's RAM snapshot is complete (its copy finished). Delivered to
    ``on_snapshot`` on the training thread, every rank: from the call that waited for it
    (``wait_for_snapshot``, the next ``step``/``save``, ``restore`` or ``close``), right
    after the checkpoint's :class:`CheckpointEvent` when snapshots are synchronous."""

    step: int
    seq: int
    snapshot_bytes: int
    """Bytes of live tensors this rank copied."""
    copy_s: float
    """Seconds the copy took (on the copying thread)."""
    wait_s: float
    """Seconds the training loop blocked waiting for the copy to finish."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitRecord:
    """A checkpoint was committed to storage (its manifest written). Delivered to
    ``on_commit`` on the persist worker thread (the training thread when persists are
    synchronous), every rank, after the commit."""

    name: str
    """The checkpoint's name (its folder in the root)."""
    step: int
    bytes: int
    """Bytes of tensor data the checkpoint holds, all ranks."""
    bytes_per_rank: tuple[int, ...]
    seconds: float
    """Seconds from the start of the persist to the commit."""
    k_persist: int
    full: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRecord:
    """What a planned stop did: the complete checkpoint written by
    ``CheckpointManager.should_stop`` or a clean ``close()`` (``CheckpointManager.stopped``;
    the same on every rank except the seconds)."""

    step: int
    """The step every rank stopped after (the complete checkpoint's step)."""
    signal: str
    """The signal the ranks agreed on (SIGTERM), or ``"close"`` for a clean end."""
    checkpoint: str | None
    """The complete checkpoint's name, or None when it was not committed (see above)."""
    committed: bool
    bytes: int
    """Bytes of tensor data of the complete checkpoint, all ranks (0 if not committed)."""
    save_seconds: float
    """From the start of the complete checkpoint to its commit (or the end of the wait)."""
    signal_to_commit_s: float | None
    """From the signal's arrival on this rank to the commit; None for a clean end or a
    rank that learnt of the stop from another rank."""
