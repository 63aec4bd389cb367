"""Warm spares for a replica group's workers (``moepec train --ft-spares N``).

torchrun restarts a dead worker as a new Python process, which imports torch, torchft and
moepec again before it can rejoin: seconds on a busy machine, most of a heal. With spares,
each worker torchrun started is a small supervisor: it imports all of that once, then forks
the process that trains. When that process dies (a signal, or an error after it joined its
replica group), the supervisor forks the next one at once, which builds the run and heals
from a live group like any restarted group. After ``spares`` such restarts, or when the
supervisor itself is killed, torchrun's own restart takes over as before.

A group of several ranks restarts as a whole, every rank from its own warm supervisor, in
*generations*: the supervisors meet in the group's store (torchrun's ``MASTER_ADDR:PORT``;
where torchrun does not host it, rank 0's supervisor starts a small process that does, so
the store outlives every training process). A supervisor whose child died marks the
generation down; every other supervisor then kills its own child, all of them wait until
every child of the generation is reaped, rank 0's supervisor removes torchft's keys of the
old generation (its Manager's address), and each forks the next generation's child. A child
joins its group's process group under the generation's own store prefix
(:func:`child_store_prefix`), so nothing of an older generation is read again.

Linux only (fork, and a child dies with its supervisor through ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

__all__ = ["child_store_prefix", "joined", "run_with_spares", "spares_apply"]

log = logging.getLogger(__name__)

_JOINED_FD_ENV = "MOEPEC_SPARE_JOINED_FD"
_PREFIX_ENV = "MOEPEC_SPARE_STORE_PREFIX"
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.02
"""How often a supervisor of a group of several ranks looks at its child and the store."""
_MEET_TIMEOUT_S = 120.0
"""Bound on the supervisors' meeting between two generations (then torchrun takes over)."""
_TORCHFT_KEYS = ("manager_addr", "replica_id")
"""What torchft's Manager writes, unprefixed, into the group's store (manager.py, 0.2.0)."""


def spares_apply(spares: int) -> bool:
    """Whether this process can keep warm spares: asked for, on Linux."""
    return spares > 0 and sys.platform.startswith("linux") and hasattr(os, "fork")


def child_store_prefix() -> str | None:
    """In a spare's child of a group of several ranks: the store prefix its process group
    joins under (:func:`moepec.train.dist.init_from_env`); None otherwise."""
    return os.environ.get(_PREFIX_ENV)


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
    copy-on-write). In a group of several ranks every rank's worker must call this.

    In the child, returns what ``fn`` returns (its exceptions propagate there, as without a
    spare); in the supervisor, the exit code to end with: the last child's, or 128 + the
    signal that killed it once the spares are spent."""
    if warm is not None:
        warm()
    # What the supervisor holds now is every child's too: frozen, a child's full collection
    # (the trainer runs one after its set-up) neither scans it nor copies its pages.
    gc.collect()
    gc.freeze()
    peers = _Peers.connect() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    sup = _Supervisor(peers)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, sup.forward)
    life = 0
    while True:
        outcome = sup.live(life)
        if outcome.in_child:
            return fn()
        code = outcome.code
        if not outcome.peer_down and (code == 0 or sup.stopping
                                      or not (code < 0 or outcome.joined)):
            return code if code >= 0 else 128 - code
        if life >= spares or sup.stopping:
            if not sup.stopping:
                log.error("the training process died (%s); no spares left: exiting for "
                          "torchrun to restart this worker", _what(code))
            return code if code >= 0 else 128 - code
        life += 1
        why = "a peer rank of its group failed" if outcome.peer_down else _what(code)
        log.warning("the training process (pid %d) ended after %.1fs (%s): starting warm "
                    "spare %d of %d", outcome.pid, outcome.seconds, why, life, spares)
        if peers is not None and not peers.next_generation(life - 1):
            return 1


def _what(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


@dataclass(frozen=True, slots=True)
class _Outcome:
    """How one child ended (or, in the child, that this is the child)."""

    in_child: bool
    pid: int = 0
    code: int = 0
    """Its exit code, or minus the signal that ended it."""
    joined: bool = False
    """It had joined its replica group (:func:`joined`)."""
    peer_down: bool = False
    """Its supervisor ended it: a peer rank's child of the same generation failed."""
    seconds: float = 0.0


class _Supervisor:
    """Forks one child per life and watches it (and, in a group of several ranks, the
    generation's down mark in the store)."""

    def __init__(self, peers: _Peers | None) -> None:
        self.peers, self.child, self.stopping = peers, 0, False

    def forward(self, signum, _frame) -> None:
        """SIGTERM/SIGINT (torchrun stopping this worker): passed on to the child."""
        self.stopping = True
        if not self.child:  # between two generations: nothing to pass it on to
            raise SystemExit(128 + signum)
        try:
            os.kill(self.child, signum)
        except ProcessLookupError:
            pass

    def live(self, life: int) -> _Outcome:
        """Fork the child of ``life`` and wait until it ends (in the child: return at once)."""
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        parent, stops = os.getpid(), {signal.SIGTERM, signal.SIGINT}
        # A stop signal between the fork and `self.child = child` would find no child to
        # pass on to: held until both sides are set up.
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        child = os.fork()
        if child == 0:
            os.close(read_fd)
            for sig in stops:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
            _die_with_parent(parent)
            os.environ[_JOINED_FD_ENV] = str(write_fd)
            os.environ["MOEPEC_SPARE_LIFE"] = str(life)
            if self.peers is not None:
                os.environ[_PREFIX_ENV] = self.peers.prefix(life, "pg")
            return _Outcome(in_child=True)
        os.close(write_fd)
        self.child, t0 = child, time.monotonic()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        status, peer_down = self._wait(child, life)
        self.child = 0
        return _Outcome(False, child, os.waitstatus_to_exitcode(status), _read_flag(read_fd),
                        peer_down, time.monotonic() - t0)

    def _wait(self, child: int, life: int) -> tuple[int, bool]:
        """(wait status, whether a peer's failure ended it). Marks the generation down
        when this child ended first (a fault; a clean end, or one torchrun asked for with
        SIGTERM, marks nothing)."""
        if self.peers is None:
            return os.waitpid(child, 0)[1], False  # retried after a forwarded signal
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                if os.waitstatus_to_exitcode(status) != 0 and not self.stopping:
                    self.peers.mark_down(life)
                return status, False
            if self.peers.is_down(life):
                try:
                    os.kill(child, signal.SIGKILL)  # also ends a stopped (SIGSTOP) child
                except ProcessLookupError:
                    pass
                return os.waitpid(child, 0)[1], True
            time.sleep(_POLL_S)


class _Peers:
    """The supervisors of one group's ranks, meeting in the group's store."""

    def __init__(self, store, raw, rank: int, world: int, keeper: int) -> None:
        self.store, self.raw, self.rank, self.world, self.keeper = store, raw, rank, world, keeper

    @classmethod
    def connect(cls) -> _Peers:
        """Join the group's store (rank 0 hosts it in a keeper process unless torchrun's
        agent does); blocks until it is reachable, at most ``_MEET_TIMEOUT_S``."""
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        keeper = 0
        if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            keeper = _start_keeper(host, port)
        raw = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=_MEET_TIMEOUT_S))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"moepec_spare/{attempt}/", raw)
        return cls(store, raw, rank, world, keeper)

    def prefix(self, life: int, what: str) -> str:
        """A store prefix of generation ``life`` (torchrun's attempt included)."""
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return f"moepec_spare/{attempt}/{life}/{what}/"

    def mark_down(self, life: int) -> None:
        try:
            self.store.set(f"{life}/down", b"1")
        except Exception:  # the store is gone: torchrun is stopping the worker
            pass

    def is_down(self, life: int) -> bool:
        try:
            return self.store.check([f"{life}/down"])
        except Exception:  # the store is gone: torchrun is stopping the worker
            return False

    def next_generation(self, life: int) -> bool:
        """After every child of generation ``life`` ended on this rank: wait for all the
        group's supervisors to get there, then (rank 0) drop torchft's keys of that
        generation. Returns False when the group did not meet within the bound."""
        try:
            self.store.add(f"{life}/reaped", 1)
            deadline = time.monotonic() + _MEET_TIMEOUT_S
            while self.store.add(f"{life}/reaped", 0) < self.world:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.world} supervisors did not meet")
                time.sleep(_POLL_S / 2)
            if self.rank == 0:
                for key in _TORCHFT_KEYS:
                    self.raw.delete_key(key)
                self.store.set(f"{life}/clean", b"1")
            else:
                self.store.wait([f"{life}/clean"], timedelta(seconds=_MEET_TIMEOUT_S))
        except Exception as exc:
            log.error("warm spares: the group's supervisors did not meet after generation "
                      "%d (%s): exiting for torchrun to restart this worker", life, exc)
            return False
        return True


def _start_keeper(host: str, port: int) -> int:
    """Fork a process that hosts the group's store at ``host:port`` for as long as this
    supervisor lives (torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 leaves it to rank
    0's worker, which a generation's end would take down)."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        _die_with_parent(parent)
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              multi_tenant=True)
        while store is not None:
            signal.pause()
    except BaseException:
        code = 1
    os._exit(code)


def _read_flag(fd: int) -> bool:
    try:
        return os.read(fd, 1) == b"j"
    except OSError:
        return False
    finally:
        os.close(fd)


def _die_with_parent(parent: int) -> None:
    """The child gets SIGKILL when the supervisor dies (torchrun's SIGKILL of its worker)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the supervisor died before prctl took effect (the
        os._exit(1)  # orphan's new parent is a subreaper, not always pid 1)
