"""The manager's planned stops: :meth:`should_stop` and the complete checkpoint at a stop
or a clean end. Methods of :class:`~moepec.manager.manager.CheckpointManager` (this class
is one of its bases); the signals and the ranks' agreement are
:class:`moepec.manager.stop.StopSignals`.

A stop checkpoint is taken at a step boundary from the live state (never from a signal
handler or an exception path), holds every expert, goes to storage whatever
``busy_policy`` says, and is committed before ``should_stop`` returns True, so the next
``restore()`` loses nothing (PLT unchanged) and redoes no step.
"""

from __future__ import annotations

import logging
import time

from moepec.errors import CheckpointError, PersistError
from moepec.events import StopRecord

log = logging.getLogger(__name__)


class Stopping:
    """The planned-stop methods of CheckpointManager (which sets the fields they use)."""

    def should_stop(self, step: int) -> bool:
        """Whether the loop should stop after step ``step`` because of a planned stop.

        Call it on every rank after ``manager.step(step)``, every step (the ranks agree
        through one 8-byte all-reduce that overlaps the next step, see
        :mod:`moepec.manager.stop`). The first call installs the handlers of
        ``config.stop_signals``. When it returns True the manager has written a complete
        checkpoint at ``step`` (every expert; committed unless it took longer than
        ``config.stop_grace_s`` from the signal, or storage is fenced or paused: logged)
        and the loop should break and call ``close()``. Training thread.
        """
        stop = self._stop
        if not stop.numbers:
            return False
        self._asked_stop = True
        stop.install()
        if not stop.poll():
            return False
        if self._stopped is None:
            self._save_complete(step, stop.name(), stop.received_at)
        return True

    @property
    def stopped(self) -> StopRecord | None:
        """The planned stop's record (a signal, or the final checkpoint of a clean
        ``close()``), or None."""
        return self._stopped

    def _save_complete(self, step: int, why: str, since: float | None) -> None:
        """Write a complete checkpoint at ``step`` and wait (within the grace period when
        a signal started it) for its commit; log and record (``stopped``) what it cost.
        An earlier persist's error met here is logged and raised by ``close()``."""
        t0 = time.perf_counter()
        try:
            self.save(step, final=True)
        except PersistError as exc:
            log.error("%s", str(exc).rstrip("."))
            self._deferred_error = exc
        deadline = self._config.stop_grace_s - (0.0 if since is None
                                                else time.monotonic() - since)
        try:
            self.wait_for_persist(max(deadline, 0.001) if since is not None else None)
        except CheckpointError as exc:
            log.error("step %d: the complete checkpoint is not committed yet (%s); "
                      "close() waits for it", step, exc)
        record = self._persister.records[-1] if self._persister.records else None
        ok = record is not None and record.step == step and record.committed
        done = time.perf_counter() - t0
        stop = StopRecord(step=step, signal=why, checkpoint=record.name if ok else None,
                          committed=ok, bytes=record.bytes_written if ok else 0,
                          save_seconds=done,
                          signal_to_commit_s=(time.monotonic() - since
                                              if since is not None and ok else None))
        if self._rank == 0:
            self._log_stop(stop)
        self._stopped = stop

    def _log_stop(self, stop: StopRecord) -> None:
        what = (f"stopped after step {stop.step} on {stop.signal}"
                if stop.signal != "close" else f"run ends at step {stop.step}")
        if stop.committed:
            since = (f", {stop.signal_to_commit_s:.2f}s after the signal"
                     if stop.signal_to_commit_s is not None else "")
            log.info("%s: complete checkpoint %s (every expert, %.1f MB) committed in "
                     "%.2fs%s; rerunning the same command resumes with nothing lost", what,
                     stop.checkpoint, stop.bytes / 1e6, stop.save_seconds, since)
        else:
            log.warning("%s: the complete checkpoint was not committed (storage fenced, "
                        "paused or failing: see above); the newest committed checkpoint "
                        "is %s", what, self.last_committed or "none")

    def _final_on_close(self) -> None:
        """At a clean ``close()``: the complete checkpoint of the last step trained, when
        ``config.final_checkpoint`` asks for it and the newest checkpoint is not one."""
        final = self._config.final_checkpoint
        wanted = self._asked_stop if final is None else final
        step = self._last_stepped
        if not wanted or step is None or self._stopped is not None or self._peers \
                or step == self._complete_step or self.fenced is not None:
            return
        self._save_complete(step, "close", None)
