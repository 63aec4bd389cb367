"""A replica group cuts itself when one of its ranks freezes (``PeerWatch``).

Why: torchft's Lighthouse keeps a group in the quorum as long as its rank 0 heartbeats,
and forms no quorum of half or fewer of the heartbeating groups. A rank other than 0 that
hangs (SIGSTOP, a machine that stops scheduling it) leaves its rank 0 heartbeating while
the group trains nothing: with two groups, the survivor could get no quorum until the hung
group's own collectives time out (``--dist-timeout``), and past ``--ft-quorum-timeout`` it
restarted too. With the watch, every rank of a group beats in the group's store (a
counter, a few times a second, from a thread of its own, so a rank blocked in a collective
still beats); rank 0 watches every other rank, the others watch rank 0. A watched rank
whose counter did not move for ``limit_s`` (``--ft-timeout``) is frozen: the watcher calls
``on_frozen``, which ends its process, so the group leaves the quorum one Lighthouse
heartbeat timeout later and the other groups train on. The group then restarts (its warm
spares kill the frozen rank and fork a new generation; without spares, torchrun restarts
it) and heals from a live group.

A rank that ends its run marks itself done, so a peer that finishes later is not taken for
frozen. A hang that keeps the process's threads running (a deadlock in Python) is not a
freeze: the collectives' own timeouts (``--dist-timeout``) still bound it. A process whose
interpreter lock is held for ``limit_s`` without a break looks frozen too (it is, to
Python).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

__all__ = ["PeerWatch"]

log = logging.getLogger(__name__)


class PeerWatch:
    """This rank's beat and watch over its group (one thread; :meth:`close` stops it).

    ``store`` is a ``torch.distributed`` store all ranks of the group reach (a prefix of
    this generation's own); ``on_frozen(rank, silent_s)`` runs on the watch thread, at most
    once. Build on every rank of the group (:meth:`start`, or the constructor then
    :meth:`begin`); no collective.
    """

    def __init__(self, store, rank: int, world: int, limit_s: float,
                 on_frozen: Callable[[int, float], None], interval_s: float = 0.25) -> None:
        self.store, self.rank, self.limit_s, self.interval_s = store, rank, limit_s, interval_s
        self.on_frozen = on_frozen
        self.watched = list(range(1, world)) if rank == 0 else [0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moepec-peer-watch",
                                        daemon=True)

    @classmethod
    def start(cls, host: str, port: int, prefix: str, rank: int, world: int, limit_s: float,
              on_frozen: Callable[[int, float], None]) -> PeerWatch:
        """Connect a store client of its own to ``host:port`` under ``prefix`` and start."""
        import torch.distributed as dist

        raw = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=max(1.0, limit_s / 4)))
        watch = cls(dist.PrefixStore(prefix, raw), rank, world, limit_s, on_frozen)
        watch.begin()
        return watch

    def begin(self) -> None:
        """Start beating and watching (once)."""
        self._thread.start()

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {r: (-1, time.monotonic()) for r in self.watched}
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except Exception:  # the store's host is frozen or gone: no news from anyone
                pass
            now = time.monotonic()
            for r in self.watched:
                count = self._count(r)
                if count is not None and count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > self.limit_s and not self._done(r):
                    if not self._stop.is_set():
                        self.on_frozen(r, now - seen[r][1])
                    return

    def _count(self, rank: int) -> int | None:
        try:
            return int(self.store.add(f"beat/{rank}", 0))
        except Exception:
            return None

    def _done(self, rank: int) -> bool:
        try:
            return bool(self.store.check([f"done/{rank}"]))
        except Exception:
            return False

    def close(self) -> None:
        """Stop watching and mark this rank done (idempotent; at the end of the run)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.store.set(f"done/{self.rank}", b"1")
        except Exception:
            pass
        self._thread.join(timeout=5 * self.interval_s + 2)
