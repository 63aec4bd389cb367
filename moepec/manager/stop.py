"""Planned stops: preemption signals turned into one step that every rank stops at.

A scheduler's preemption (Slurm's SIGTERM or ``--signal=USR1@120``, Kubernetes' and spot
instances' SIGTERM), a launcher shutting its workers down (torchrun forwards SIGTERM,
SIGINT, SIGHUP and SIGQUIT, then SIGKILLs them after its ``--shutdown-timeout``, 30 s by
default) and Ctrl-C are planned stops: the run has a grace period to save what it has.

:class:`StopSignals` installs a handler for each configured signal that only records the
signal (and calls the handler that was there before it when that is a user's function):
nothing is saved from a signal handler. The training loop asks
:meth:`StopSignals.poll` once per step, on every rank; the ranks agree through one
asynchronous all-reduce (MAX of the signal number) of 8 bytes on a gloo group of its own,
started at one step's poll and read at the next step's, so it runs during the step and
the loop never waits for it. A signal that reached any rank (or only one) during step s
is seen by every rank at the poll of step s + 1 (at most two steps after it), the same
step on every rank.

A repeat of a stop signal more than :data:`REPEAT_S` seconds after the first means "stop
now": the handler that was there before (Ctrl-C's KeyboardInterrupt, SIGTERM's default
exit) takes it. A repeat within that time is the same stop (a terminal's Ctrl-C reaches
torchrun and its workers, and torchrun forwards it to them again).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moepec.errors import ConfigError

log = logging.getLogger(__name__)

REPEAT_S = 2.0
"""A stop signal repeated within this many seconds of the first is the same stop."""


def signal_number(name: str) -> int:
    """The number of a signal named like ``"SIGTERM"`` or ``"TERM"``; ConfigError naming
    the signals this platform has when it is not one of them."""
    full = name if name.upper().startswith("SIG") else f"SIG{name}"
    number = getattr(signal.Signals, full.upper(), None)
    if number is None or full.upper() in ("SIGKILL", "SIGSTOP"):
        known = ", ".join(s.name for s in signal.Signals if s.name not in ("SIGKILL", "SIGSTOP"))
        raise ConfigError(f"stop_signals: {name!r} is not a signal that can be caught; use "
                          f"names such as SIGTERM, SIGINT, SIGUSR1 (this platform: {known})")
    return int(number)


def _is_user_handler(handler: Any) -> bool:
    """A Python function of the user's (chained), not a default disposition or Python's
    own KeyboardInterrupt handler (which would end the graceful stop)."""
    return callable(handler) and handler is not signal.default_int_handler


class StopSignals:
    """The stop flag of one manager: its signal handlers and the ranks' agreement.

    Built on every rank by the manager's constructor (collective when ``distributed``:
    it creates the agreement's process group). Training thread only.
    """

    def __init__(self, names: Sequence[str], *, distributed: bool, timeout_s: float) -> None:
        self.numbers = tuple(signal_number(n) for n in names)
        self.timeout_s = timeout_s
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if distributed and self.numbers else None)
        self.received: int | None = None
        """The signal this process received first, or None."""
        self.received_at: float | None = None
        """``time.monotonic()`` when it arrived."""
        self.agreed: int | None = None
        """The signal the ranks agreed to stop on (the highest number any rank got)."""
        self._previous: dict[int, Any] = {}
        self._buf = torch.zeros(1, dtype=torch.int64)
        self._work: Any = None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        """Install the handlers (idempotent). Only the main thread may set handlers: from
        another thread this logs once and leaves the signals as they are."""
        if self._previous or not self.numbers:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("should_stop() called off the main thread: preemption signals are "
                        "not caught (Python sets signal handlers on the main thread only)")
            self.numbers = ()
            return
        for number in self.numbers:
            self._previous[number] = signal.signal(number, self._handle)

    def uninstall(self) -> None:
        """Put the handlers that were there before back (main thread; idempotent)."""
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, number: int, frame: Any) -> None:
        previous = self._previous.get(number, signal.SIG_DFL)
        now = time.monotonic()
        if self.received is None:
            self.received, self.received_at = number, now
        elif now - self.received_at > REPEAT_S:
            self._escalate(number, previous, frame)
            return
        if _is_user_handler(previous):
            previous(number, frame)

    def _escalate(self, number: int, previous: Callable | int | None, frame: Any) -> None:
        """A second stop signal: what the process did before the handlers were installed."""
        self.uninstall()
        if callable(previous):
            previous(number, frame)
        elif previous != signal.SIG_IGN:
            signal.raise_signal(number)  # the default disposition, now restored

    def poll(self) -> bool:
        """Whether the ranks agreed to stop now. Every rank, once per step, the same steps
        (collective when distributed; the all-reduce started by the previous poll is read
        here, so the loop waits for it only if it is still in flight)."""
        if self.agreed is not None:
            return True
        if self.group is None:
            self.agreed = self.received
            return self.agreed is not None
        if self._work is not None:
            self._work.wait()
            self._work = None
            if int(self._buf[0]) > 0:
                self.agreed = int(self._buf[0])
                return True
        self._buf[0] = self.received or 0
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group,
                                     async_op=True)
        return False

    def name(self) -> str:
        """The agreed signal's name (SIGTERM)."""
        return signal.Signals(self.agreed).name if self.agreed else ""

    def close(self) -> None:
        """Uninstall the handlers and finish the all-reduce in flight (every rank)."""
        self.uninstall()
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - a peer gone at close: nothing to agree
                log.debug("stop agreement left unfinished: %s", exc)
