"""The manager's face to live peers (replica groups on torchft,
:mod:`moepec.integrations.torchft`): the bookkeeping a live replica hands a restarted one,
and the part of a striped checkpoint a group writes next. Methods of
:class:`~moepec.manager.manager.CheckpointManager` (this class is one of its bases). When
a checkpoint is due is the manager's own (``CheckpointManager.due``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moepec.store.meta import Part


class LivePeers:
    """Replica-group methods of CheckpointManager (which sets the fields they use)."""

    def share(self, part: Part | None) -> None:
        """Make the next checkpoint this group's ``part`` of one striped over the replica
        groups of a quorum (each group's ranks write an even share of it into the group's
        root; :mod:`moepec.integrations.torchft` says which part). Every rank of every
        group, before the :meth:`step` or :meth:`save` it applies to, with the same
        part; None: a whole checkpoint. A restore with ``peer_paths`` restores the newest
        checkpoint whose parts are all committed."""
        self._part = part

    def live_state(self) -> dict[str, Any]:
        """The checkpoint bookkeeping a live replica hands a restarted one (torchft
        healing, :mod:`moepec.integrations.torchft`): PLT ledger, selectors, K and its
        history, the checkpoint index and this rank's routing counts since the last
        checkpoint. JSON-able, a copy. Training thread, any rank (each rank its own)."""
        return {**self._schedule.live_state(), "last_step": self._last_step,
                "routing": self._routing.pending()}

    def load_live_state(self, state: Mapping[str, Any]) -> None:
        """Adopt a peer's :meth:`live_state` after the model and optimizer were loaded
        from the same peer (no storage read). Training thread, every rank, between
        checkpoints. Raises StructureMismatchError for another MoE structure."""
        self._schedule.load_live_state(dict(state))
        self._last_step = int(state["last_step"])
        self._routing.reset()
        self._routing.add(state["routing"])
        self._keys.invalidate()  # the loaded optimizer state may be new tensors
