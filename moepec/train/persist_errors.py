"""The trainer's policy for a failed background persist (``TrainConfig.on_persist_error``).

A persist that fails (storage full, unreachable, fenced) surfaces as a PersistError from the
manager's next ``wait_for_snapshot``, ``step`` or ``close``; so does a checkpoint kept in RAM
because its root is paused (the manager found it unwritable). With ``continue`` (the
default) it becomes a ``persist_error`` metrics record and one log line, and training goes
on (RAM snapshots continue; the next checkpoint to storage retries); with ``stop`` the run
fails. At the end of the run one warning says when its newest checkpoint never reached
storage, naming the newest committed one.
"""

from __future__ import annotations

import logging
import time

from moepec.errors import FencedError, PersistError
from moepec.keys import parse_checkpoint_name
from moepec.train.config import OnPersistError
from moepec.train.metrics import MetricsWriter

log = logging.getLogger(__name__)


class PersistGuard:
    """One per run (every rank builds its own): applies the policy to the manager's calls
    and remembers the last failure it saw, so that :meth:`close` can tell whether any
    checkpoint was committed after it. Training thread only."""

    def __init__(self, policy: OnPersistError, metrics: MetricsWriter) -> None:
        self.policy = policy
        self.metrics = metrics
        self.failed_at: int | None = None
        """The training step at which the newest failure surfaced, or None."""
        self.failure: str | None = None
        """Its message."""

    def call(self, step: int, call, *args) -> None:
        """Run a manager call at training step ``step``; a failed background persist is
        logged and training goes on (on_persist_error="continue": snapshots to RAM
        continue, the next checkpoint retries), or re-raised ("stop")."""
        try:
            call(*args)
        except PersistError as exc:
            self._failed(step, exc)
            log.error("step %d: %s; training continues", step, str(exc).rstrip("."))

    def close(self, manager, step: int) -> None:
        """Close the manager at the end of a run (waits for the last persist), with the same
        policy as :meth:`call`: with on_persist_error="stop" a failed last persist raises
        its PersistError (the run fails); with "continue" the run ends normally, with one
        warning naming the newest committed checkpoint (what a restart resumes from) when
        the run's last checkpoint did not reach storage: its persist failed, or no
        checkpoint was committed since the last failure (a paused root). A run fenced by
        another run's takeover raises FencedError whatever the policy (the root is no
        longer this run's: a success would hide it)."""
        error: PersistError | None = None
        try:
            manager.close()
        except PersistError as exc:
            self._failed(step, exc)
            error = exc
        name = manager.last_committed
        parsed = parse_checkpoint_name(name) if name else None
        if manager.fenced is not None:  # another run owns the root: not a passing failure
            raise FencedError(
                f"{manager.fenced.split(';')[0]}; this run's checkpoints since then went "
                f"to RAM only, and the run ends in error (its newest committed checkpoint "
                f"is {name or 'none'}); that other run now owns the checkpoint root")
        # A commit of a checkpoint taken at or after the step where the failure surfaced
        # came later than the failure: storage works again.
        stale = self.failed_at is not None and (
            name is None or (parsed is not None and parsed.step < self.failed_at))
        if error is None and not manager.last_persist_failed and not stale:
            return
        newest = (f"step {parsed.step} ({name})" if parsed is not None
                  else name or "none: no checkpoint of this run was committed")
        why = str(error if error is not None else self.failure or "its persist failed, "
                  "see above").rstrip(".")
        log.warning("the run ends, but its last checkpoint was not persisted (%s); the newest "
                    "committed checkpoint is %s (on_persist_error=continue; with stop this "
                    "run would fail)", why, newest)

    def _failed(self, step: int, exc: PersistError) -> None:
        """Record a failed persist; re-raise it when the policy is to stop."""
        self.failed_at, self.failure = step, str(exc)
        self.metrics.write({"event": "persist_error", "step": step, "time": time.time(),
                            "error": str(exc)})
        if self.policy == OnPersistError.STOP:
            raise exc
