"""A warm spare for a replica group's worker (``moepec train --ft-spares N``).

torchrun restarts a dead worker as a new Python process, which imports torch, torchft and
moepec again before it can rejoin: seconds on a busy machine, most of a heal. With a spare,
the worker torchrun started is a small supervisor: it imports all of that once, then forks
the process that trains. When that process dies (a signal, or an error after it joined its
replica group), the supervisor forks the next one at once, which builds the run and heals
from a live group like any restarted group. After ``spares`` such restarts, or when the
supervisor itself is killed, torchrun's own restart takes over as before.

Only for a group of one rank: the ranks of a larger group share torchrun's rendezvous
store, which a re-forked rank cannot rejoin without the others (they restart through
torchrun). Linux only (fork, and the child dies with its supervisor through
``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

__all__ = ["joined", "run_with_spares", "spares_apply"]

log = logging.getLogger(__name__)

_JOINED_FD_ENV = "MOEPEC_SPARE_JOINED_FD"
_PR_SET_PDEATHSIG = 1


def spares_apply(spares: int) -> bool:
    """Whether this process can keep warm spares: asked for, one rank per group, Linux."""
    return (spares > 0 and int(os.environ.get("WORLD_SIZE", "1")) == 1
            and sys.platform.startswith("linux") and hasattr(os, "fork"))


def joined() -> None:
    """Called by the trainer once it has joined its replica group: from now on, its death is
    a fault the supervisor restarts (before, an error is the user's, and ends the run)."""
    fd = os.environ.pop(_JOINED_FD_ENV, None)
    if fd is not None:
        try:
            os.write(int(fd), b"j")
            os.close(int(fd))
        except OSError:
            pass


def run_with_spares(fn: Callable[[], int], spares: int,
                    warm: Callable[[], object] | None = None) -> int:
    """Run ``fn`` in a forked child, again after each fault, ``spares`` times at most;
    ``warm`` imports and loads, before the first fork, what every child would spend its
    first seconds on (it must start no threads; what it loads is shared with the children,
    copy-on-write).

    In the child, returns what ``fn`` returns (its exceptions propagate there, as without a
    spare); in the supervisor, the exit code to end with: the last child's, or 128 + the
    signal that killed it once the spares are spent."""
    if warm is not None:
        warm()
    child = 0
    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        if child:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    life = 0
    while True:
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            os.close(read_fd)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            _die_with_parent()
            os.environ[_JOINED_FD_ENV] = str(write_fd)
            os.environ["MOEPEC_SPARE_LIFE"] = str(life)
            return fn()
        os.close(write_fd)
        t0 = time.monotonic()
        status = os.waitpid(child, 0)[1]  # retried after a forwarded signal (PEP 475)
        was_joined = _read_flag(read_fd)
        code = os.waitstatus_to_exitcode(status)
        if code == 0 or stopping or not (code < 0 or was_joined) or life >= spares:
            if code < 0 and not stopping:
                log.error("the training process died (signal %d); no spares left: exiting "
                          "for torchrun to restart this worker", -code)
            return code if code >= 0 else 128 - code
        life += 1
        what = f"signal {-code}" if code < 0 else f"exit code {code}"
        log.warning("the training process (pid %d) ended after %.1fs with %s: starting warm "
                    "spare %d of %d", child, time.monotonic() - t0, what, life, spares)


def _read_flag(fd: int) -> bool:
    try:
        return os.read(fd, 1) == b"j"
    except OSError:
        return False
    finally:
        os.close(fd)


def _die_with_parent() -> None:
    """The child gets SIGKILL when the supervisor dies (torchrun's SIGKILL of its worker)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the supervisor died before prctl took effect
        os._exit(1)
