"""One writer per checkpoint root: a lease file that names the run writing there.

``<root>/moepec.lease`` holds the holder's run id, host, pid and the time it was taken. It
is created exclusively (``Storage.create``: a hard link on a local disk, a conditional PUT
on object stores), so of two runs started on one root the second fails at once with a
one-line error naming the holder. Only a run acquiring the lease writes that file; the
holder's heartbeat goes to a file of its own, ``<root>/moepec.lease.<run id>``, so a run
that lost the lease and has not noticed yet can never overwrite (or, at exit, remove) the
new holder's lease: there is no read-then-write race to lose. A lease is free again when
its holder's heartbeat is older than the timeout, when its holder released it (a clean
close), when its holder was a process of this host that is no longer alive (a crashed or
restarted worker), or when the new run asks to take over.
Rank 0 holds it; a heartbeat thread refreshes it; ``check`` before every write, commit
and deletion makes sure a run that lost its lease never touches the root again. Losing
is final: a lease found held by another run, or gone, is never taken back by this run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

from moepec.errors import FencedError, LeaseError
from moepec.keys import RUN_ID_RE
from moepec.store.storage import Storage

log = logging.getLogger(__name__)

LEASE_NAME = "moepec.lease"

RELEASED = "its run released it"
"""Why a lease is free when its holder closed cleanly (a rerun takes it over quietly)."""

PID_LIMIT = 2**31
"""Process ids are below this (a C ``pid_t``; Linux's ``pid_max`` is at most 2**22)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lease."""

    run_id: str
    host: str
    pid: int
    heartbeat: float
    """time.time() when the holder took the lease (its later heartbeats are in its own
    file, ``moepec.lease.<run id>``)."""

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        """The holder recorded in a lease file, or None when it is unreadable (a damaged
        lease: not JSON, a field missing, a pid no process can have, a heartbeat that is
        no time)."""
        try:
            d = json.loads(raw)
            holder = cls(run_id=str(d["run_id"]), host=str(d["host"]), pid=int(d["pid"]),
                         heartbeat=float(d["heartbeat"]))
        except (ValueError, KeyError, TypeError, OverflowError):
            return None
        if not (0 < holder.pid < PID_LIMIT and math.isfinite(holder.heartbeat)):
            return None
        # The run id names the holder's heartbeat file: nothing but a plain id may.
        return holder if RUN_ID_RE.fullmatch(holder.run_id) else None


def pid_alive(pid: object) -> bool:
    """A process with this id runs on this host (an id that is not a positive int below
    :data:`PID_LIMIT`: no)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < PID_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """The lease of one checkpoint root for one run (rank 0 only)."""

    def __init__(self, storage: Storage, run_id: str, *, timeout_s: float, takeover: bool) -> None:
        self.storage = storage
        self.path = f"{storage.url}/{LEASE_NAME}"
        """Where the lease file is (for messages)."""
        self.me = Holder(run_id=run_id, host=socket.gethostname(), pid=os.getpid(),
                         heartbeat=time.time())
        self.timeout_s = timeout_s
        self.takeover = takeover
        self.held = False
        self.lost: str | None = None
        """Why this run no longer holds the lease (final), or None."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _beat_path(run_id: str) -> str:
        """The heartbeat file of run ``run_id``, under the root."""
        return f"{LEASE_NAME}.{run_id}"

    def acquire(self) -> Holder | None:
        """Take the lease; returns the holder it was taken from (None if it was free).
        Raises LeaseError naming the holder when another live run holds it."""
        if self.held:
            return None
        if self.lost is not None:
            raise FencedError(self.lost)
        self.storage.makedirs()
        # The heartbeat exists before the lease names us: a lease is never seen without it.
        self._beat()
        if self._create():
            return self._held(None)
        holder = self._read()
        if holder is not None and holder.run_id == self.me.run_id:
            return self._held(None)
        reason = self._free_because(holder)
        if reason is None:
            self._remove_quietly(self._beat_path(self.me.run_id))
            raise LeaseError(
                f"checkpoint root {self.storage.url} is in use by {self._describe(holder)}; "
                f"stop that run, or take over with --ckpt-takeover (CheckpointConfig("
                f"takeover=True)), or wait until its lease expires ({self.timeout_s:.0f}s "
                f"without a heartbeat)")
        # A lease its holder released is the normal resume of a stopped or finished run.
        (log.info if reason == RELEASED else log.warning)(
            "taking over the checkpoint root %s from %s (%s)", self.storage.url,
            self._describe(holder) if holder else "an unreadable lease", reason)
        self._write()
        if holder is not None:  # its heartbeat file means nothing now
            self._remove_quietly(self._beat_path(holder.run_id))
        return self._held(holder)

    def _free_because(self, holder: Holder | None) -> str | None:
        if holder is None:
            return "the lease file is unreadable"
        if self.takeover:
            return "takeover requested"
        beat = self._read_beat(holder)
        if beat == "released":
            return RELEASED
        if time.time() - max(holder.heartbeat, beat or 0.0) > self.timeout_s:
            return "its heartbeat expired"
        if holder.host == self.me.host and not pid_alive(holder.pid):
            return "its process is gone"
        if holder.host == self.me.host and holder.pid == self.me.pid:
            return "an earlier manager of this process"
        return None

    def _describe(self, holder: Holder) -> str:
        beat = self._read_beat(holder)
        last = max(holder.heartbeat, beat if isinstance(beat, float) else 0.0)
        return (f"run {holder.run_id} (host {holder.host}, pid {holder.pid}, heartbeat "
                f"{time.time() - last:.0f}s ago)")

    def _held(self, previous: Holder | None) -> Holder | None:
        self.held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat_loop, name="moepec-lease",
                                        daemon=True)
        self._thread.start()
        return previous

    def check(self) -> None:
        """Raise FencedError unless this run still holds the lease (rank 0, before each
        write, commit and deletion in the root; any thread). Reads the lease file."""
        if self.lost is None and self.held:
            holder = self._read()
            if holder is None or holder.run_id != self.me.run_id:
                self._lose(holder)
        if self.lost is not None:
            raise FencedError(self.lost)

    def _lose(self, holder: Holder | None) -> None:
        if self.lost is not None:
            return
        who = self._describe(holder) if holder is not None else \
            "another run (the lease file is gone or unreadable)"
        self.lost = (f"{who} took over the checkpoint root {self.storage.url}; this run no "
                     f"longer writes, renames or deletes anything there (training and RAM "
                     f"snapshots go on)")

    def release(self) -> None:
        """Stop the heartbeat and, if the lease is still ours, mark it released (in our
        own heartbeat file: the lease file is left to the next run to replace). A run
        that lost the lease touches nothing. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self.held:
            self.held = False
            if self.lost is not None:
                return
            try:
                self.storage.put(self._beat_path(self.me.run_id), b'"released"')
            except Exception as exc:  # noqa: BLE001 - a stale lease expires by itself
                log.warning("could not release the lease %s: %s", self.path, exc)

    # -- file I/O ---------------------------------------------------------------------
    def _data(self) -> bytes:
        me = Holder(run_id=self.me.run_id, host=self.me.host, pid=self.me.pid,
                    heartbeat=time.time())
        return json.dumps(asdict(me)).encode()

    def _create(self) -> bool:
        """Create the lease file exclusively; False when it exists."""
        try:
            self.storage.create(LEASE_NAME, self._data())
        except FileExistsError:
            return False
        return True

    def _write(self) -> None:
        """Replace the lease file whole (a takeover)."""
        self.storage.put(LEASE_NAME, self._data())

    def _remove_quietly(self, path: str) -> None:
        try:
            self.storage.remove(path)
        except Exception:  # noqa: BLE001 - a leftover heartbeat file is harmless
            pass

    def _read(self) -> Holder | None:
        try:
            return Holder.parse(self.storage.get(LEASE_NAME))
        except FileNotFoundError:
            return None

    def _read_beat(self, holder: Holder) -> float | str | None:
        """The holder's last heartbeat time, "released", or None (no heartbeat file)."""
        try:
            value = json.loads(self.storage.get(self._beat_path(holder.run_id)))
        except (FileNotFoundError, ValueError):
            return None
        if value == "released":
            return "released"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        try:  # a stranger's file: an int too large for a float, inf, nan are no time
            beat = float(value)
        except OverflowError:
            return None
        return beat if math.isfinite(beat) else None

    def _beat(self) -> None:
        """Refresh this run's own heartbeat file (never the lease file)."""
        self.storage.put(self._beat_path(self.me.run_id), json.dumps(time.time()).encode())

    def _beat_loop(self) -> None:
        interval = max(1.0, self.timeout_s / 4)
        warned = False
        while not self._stop.wait(interval):
            try:
                holder = self._read()
                if holder is None or holder.run_id != self.me.run_id:
                    self._lose(holder)
                    return  # taken over: check() stops every later write
                self._beat()
            except Exception as exc:  # noqa: BLE001 - storage trouble: persists report it
                if not warned:
                    log.warning("could not refresh the lease %s: %s", self.path, exc)
                    warned = True
