"""The trainer's policy for a failed background persist (``TrainConfig.on_persist_error``).

A persist that fails (storage full, unreachable, fenced) surfaces as a PersistError from the
manager's next ``wait_for_snapshot``, ``step`` or ``close``. With ``continue`` (the default)
it becomes a ``persist_error`` metrics record and one log line, and training goes on (RAM
snapshots continue; the next checkpoint to storage retries); with ``stop`` the run fails.
"""

from __future__ import annotations

import logging
import time

from moepec.errors import PersistError
from moepec.keys import parse_checkpoint_name
from moepec.train.config import OnPersistError
from moepec.train.metrics import MetricsWriter

log = logging.getLogger(__name__)


def persist_guard(policy: OnPersistError, metrics: MetricsWriter, step: int, call,
                  *args) -> None:
    """Run a manager call; a failed background persist is logged and training goes on
    (on_persist_error="continue": snapshots to RAM continue, the next checkpoint retries)."""
    try:
        call(*args)
    except PersistError as exc:
        _persist_failed(policy, metrics, step, exc)
        log.error("step %d: %s; training continues", step, str(exc).rstrip("."))


def close_manager(policy: OnPersistError, metrics: MetricsWriter, manager, step: int) -> None:
    """Close the manager at the end of a run (waits for the last persist), with the same
    policy as :func:`persist_guard`: with on_persist_error="stop" a failed last persist
    raises its PersistError (the run fails); with "continue" the run ends normally, with
    one warning naming the newest committed checkpoint (what a restart resumes from)."""
    error: PersistError | None = None
    try:
        manager.close()
    except PersistError as exc:
        _persist_failed(policy, metrics, step, exc)
        error = exc
    if error is None and not manager.last_persist_failed:
        return
    name = manager.last_committed
    newest = (f"step {parse_checkpoint_name(name).step} ({name})" if name
              else "none: no checkpoint of this run was committed")
    why = str(error).rstrip(".") if error is not None else "its persist failed, see above"
    log.warning("the run ends, but its last checkpoint was not persisted (%s); the newest "
                "committed checkpoint is %s (on_persist_error=continue; with stop this "
                "run would fail)", why, newest)


def _persist_failed(policy: OnPersistError, metrics: MetricsWriter, step: int,
                    exc: PersistError) -> None:
    """Record a failed persist; re-raise it when the policy is to stop."""
    metrics.write({"event": "persist_error", "step": step, "time": time.time(),
                   "error": str(exc)})
    if policy == OnPersistError.STOP:
        raise exc
