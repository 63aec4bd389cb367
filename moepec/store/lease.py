"""One writer per checkpoint root: a lease file that names the run writing there.

``<root>/moepec.lease`` holds the holder's run id, host, pid and a heartbeat time. It is
created exclusively (``O_EXCL`` on a local disk; a conditional create, S3's
``If-None-Match: *``, on object stores), so of two runs started on one root the second
fails at once with a one-line error naming the holder. A lease is free again when its
heartbeat is older than the timeout, when its holder was a process of this host that is
no longer alive (a crashed or restarted worker), or when the new run asks to take over.
Rank 0 holds it; a heartbeat thread refreshes it; ``check`` before every commit makes
sure a run that lost its lease never commits again.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

from moepec.errors import CheckpointError, LeaseError

log = logging.getLogger(__name__)

LEASE_NAME = "moepec.lease"


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lease."""

    run_id: str
    host: str
    pid: int
    heartbeat: float
    """time.time() of the holder's last refresh."""

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        """The holder recorded in a lease file, or None when it is unreadable."""
        try:
            d = json.loads(raw)
            return cls(run_id=str(d["run_id"]), host=str(d["host"]), pid=int(d["pid"]),
                       heartbeat=float(d["heartbeat"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        age = time.time() - self.heartbeat
        return f"run {self.run_id} (host {self.host}, pid {self.pid}, heartbeat {age:.0f}s ago)"


def pid_alive(pid: object) -> bool:
    """A process with this id runs on this host (an id that is not a positive int: no)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """The lease of one checkpoint root for one run (rank 0 only)."""

    def __init__(self, storage, run_id: str, *, timeout_s: float, takeover: bool) -> None:
        self.storage = storage
        self.path = f"{storage.root}/{LEASE_NAME}"
        self.me = Holder(run_id=run_id, host=socket.gethostname(), pid=os.getpid(),
                         heartbeat=time.time())
        self.timeout_s = timeout_s
        self.takeover = takeover
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> Holder | None:
        """Take the lease; returns the holder it was taken from (None if it was free).
        Raises CheckpointError naming the holder when another live run holds it."""
        if self.held:
            return None
        self.storage.fs.makedirs(self.storage.root, exist_ok=True)
        if self._create():
            return self._held(None)
        holder = self._read()
        if holder is not None and holder.run_id == self.me.run_id:
            return self._held(None)
        reason = self._free_because(holder)
        if reason is None:
            raise LeaseError(
                f"checkpoint root {self.storage.url} is in use by {holder.describe()}; stop "
                f"that run, or take over with --ckpt-takeover (CheckpointConfig(takeover="
                f"True)), or wait until its lease expires ({self.timeout_s:.0f}s without a "
                f"heartbeat)")
        log.warning("taking over the checkpoint root %s from %s (%s)", self.storage.url,
                    holder.describe() if holder else "an unreadable lease", reason)
        self._write()
        return self._held(holder)

    def _free_because(self, holder: Holder | None) -> str | None:
        if holder is None:
            return "the lease file is unreadable"
        if self.takeover:
            return "takeover requested"
        if time.time() - holder.heartbeat > self.timeout_s:
            return "its heartbeat expired"
        if holder.host == self.me.host and not pid_alive(holder.pid):
            return "its process is gone"
        if holder.host == self.me.host and holder.pid == self.me.pid:
            return "an earlier manager of this process"
        return None

    def _held(self, previous: Holder | None) -> Holder | None:
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="moepec-lease", daemon=True)
        self._thread.start()
        return previous

    def check(self) -> None:
        """Raise CheckpointError unless this run still holds the lease (rank 0, before a
        commit)."""
        holder = self._read()
        if holder is not None and holder.run_id != self.me.run_id:
            raise CheckpointError(
                f"{holder.describe()} took over the checkpoint root {self.storage.url}; this "
                f"run no longer commits checkpoints there")

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self.held:
            self.held = False
            try:
                holder = self._read()
                if holder is not None and holder.run_id == self.me.run_id:
                    self.storage.fs.rm(self.path)
            except Exception as exc:  # noqa: BLE001 - a stale lease expires by itself
                log.warning("could not remove the lease %s: %s", self.path, exc)

    # -- file I/O ---------------------------------------------------------------------
    def _data(self) -> bytes:
        me = Holder(run_id=self.me.run_id, host=self.me.host, pid=self.me.pid,
                    heartbeat=time.time())
        return json.dumps(asdict(me)).encode()

    def _create(self) -> bool:
        """Create the lease file exclusively; False when it exists."""
        try:
            if self.storage.local:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, self._data())
                    os.fsync(fd)
                finally:
                    os.close(fd)
            else:
                self.storage.fs.pipe_file(self.path, self._data(), mode="create")
        except FileExistsError:
            return False
        return True

    def _write(self) -> None:
        """Replace the lease file whole (a takeover or a heartbeat)."""
        if self.storage.local:
            tmp = f"{self.path}.{self.me.pid}.tmp"
            with open(tmp, "wb") as f:
                f.write(self._data())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        else:
            self.storage.fs.pipe_file(self.path, self._data())

    def _read(self) -> Holder | None:
        try:
            return Holder.parse(self.storage.fs.cat_file(self.path))
        except FileNotFoundError:
            return None

    def _beat(self) -> None:
        interval = max(1.0, self.timeout_s / 4)
        warned = False
        while not self._stop.wait(interval):
            try:
                holder = self._read()
                if holder is not None and holder.run_id != self.me.run_id:
                    return  # taken over: check() stops the next commit
                self._write()
            except Exception as exc:  # noqa: BLE001 - storage trouble: persists report it
                if not warned:
                    log.warning("could not refresh the lease %s: %s", self.path, exc)
                    warned = True
