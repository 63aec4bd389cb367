"""Whether a checkpoint goes to storage now: the manager's decision at each save."""

from __future__ import annotations

import logging

from moepec.errors import CheckpointError, PersistError
from moepec.manager.claim import RootClaim
from moepec.manager.config import BusyPolicy
from moepec.store.persist import Persister

log = logging.getLogger(__name__)


def may_persist(persister: Persister, claim: RootClaim, busy_policy: BusyPolicy,
                step: int, *, final: bool = False) -> tuple[bool, CheckpointError | None]:
    """Whether checkpoint ``step`` goes to storage, and an earlier persist's error (which
    keeps it in RAM: it is raised once the snapshot is under way, and the next checkpoint
    persists again). Training thread, every rank; may wait for the persist in flight
    (``BusyPolicy.WAIT``, and always for a ``final`` checkpoint, which also goes to
    storage after an earlier error: it is the one a rerun resumes from)."""
    if persister.busy:
        if busy_policy == BusyPolicy.WAIT or final:
            persister.wait_idle()
        else:
            log.info("step %d: previous persist still writing; keeping this checkpoint "
                     "in RAM only (busy_policy=skip)", step)
            return False, None
    pending_error = persister.take_error()
    if persister.fenced is not None:
        return False, pending_error  # said once by the persister; RAM snapshots go on
    if claim.paused is not None:
        return False, pending_error or PersistError(
            f"checkpoints are paused, the snapshot stays in RAM: {claim.paused}")
    return pending_error is None or final, pending_error
