"""Replicas of RAM snapshot slots on another node: a lost node's shares survive.

Ranks are placed on a ring over node ids (``MOEPEC_NODE_ID``, default the hostname):
rank r sends each committed slot to the rank with its local index on the next node and
stores the slot its predecessor sends in ``<ram_dir>/<job>/replica-of-rank<p>/``. The
exchange runs on one worker thread over a dedicated gloo group, so it overlaps training
and never interleaves with the training thread's collectives. Every rank completes
every snapshot in the same order, so sends and receives pair up.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moepec.errors import ConfigError
from moepec.ram.shm import SlotStore
from moepec.ram.snapshot import RamTier, Snapshot

log = logging.getLogger(__name__)


def node_id() -> str:
    """This process's failure domain: ``MOEPEC_NODE_ID``, else the hostname."""
    return os.environ.get("MOEPEC_NODE_ID") or socket.gethostname()


def check_ram_replicas(ram_replicas: object, ram_dir: object) -> None:
    """Raise ConfigError, in one line, unless ``ram_replicas`` is 0, 1 or None and a
    replica has shared memory to live in (``ram_dir`` not None)."""
    if ram_replicas is not None and (ram_replicas not in (0, 1)
                                     or isinstance(ram_replicas, bool)):
        raise ConfigError(f"ram_replicas must be 0, 1 or None (1 when ranks span nodes); "
                          f"got {ram_replicas!r}")
    if ram_replicas and ram_dir is None:
        raise ConfigError("ram_replicas needs the shared-memory RAM tier: set ram_dir "
                          "(e.g. /dev/shm/moepec, or 'auto')")


def replica_peers(ram_replicas: int | None, *, rank: int, world_size: int,
                  distributed: bool) -> tuple[int, int] | None:
    """(successor, predecessor) on the ring over nodes when RAM slots are replicated
    (``ram_replicas``: 1, or None and the ranks span nodes), else None. Collective when
    distributed (the node ids are gathered). Raises ConfigError for ``ram_replicas=1``
    on one node or unevenly placed ranks (:func:`ring_peers`)."""
    if not distributed or ram_replicas == 0:
        if ram_replicas:
            raise ConfigError("ram_replicas=1 needs ranks on several nodes")
        return None
    nodes: list[Any] = [None] * world_size
    dist.all_gather_object(nodes, node_id())
    if len(set(nodes)) < 2 and ram_replicas is None:
        return None
    return ring_peers(nodes, rank)


def replicate(tier: RamTier, peers: tuple[int, int] | None, timeout_s: float
              ) -> Replicator | None:
    """Start exchanging ``tier``'s committed slots with ``peers`` (:func:`replica_peers`;
    ``tier`` opened with ``replicas``): each snapshot the tier completes is handed to the
    :class:`Replicator` (``tier.on_complete``), which releases it once sent. None without
    peers or shared-memory slots. Collective (a process group is made), training thread."""
    if not peers or tier.slots is None or tier.replicas is None:
        return None
    replicator = Replicator(tier.slots, tier.replicas, succ=peers[0], pred=peers[1],
                            timeout_s=timeout_s, release=tier.release)
    tier.on_complete = replicator.submit
    return replicator


def ring_peers(nodes: Sequence[str], rank: int) -> tuple[int, int]:
    """(successor, predecessor) of ``rank`` on the ring over nodes: the rank with the same
    local index on the next (previous) node. Raises ConfigError unless every node holds
    the same number of ranks and there are at least two nodes."""
    order = sorted(set(nodes))
    if len(order) < 2:
        raise ConfigError("ram_replicas needs ranks on at least two nodes (MOEPEC_NODE_ID "
                          "or the hostname); set ram_replicas=0 on one node")
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    if len({len(v) for v in members.values()}) != 1:
        raise ConfigError("ram_replicas needs the same number of ranks on every node; set "
                          "ram_replicas=0")
    i = order.index(nodes[rank])
    local = members[nodes[rank]].index(rank)
    succ = members[order[(i + 1) % len(order)]][local]
    pred = members[order[(i - 1) % len(order)]][local]
    return succ, pred


class Replicator:
    """Sends this rank's committed slots to ``succ`` and keeps ``pred``'s in ``held``.

    ``submit`` is called on the training thread when a snapshot completes (the caller
    took a reference on it; ``release`` gives it back once sent)."""

    def __init__(self, own: SlotStore, held: SlotStore, *, succ: int, pred: int,
                 timeout_s: float, release: Callable[[Snapshot], None]) -> None:
        self.own, self.held = own, held
        self.succ, self.pred = succ, pred
        self.timeout = timedelta(seconds=timeout_s)
        self.release = release
        self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.sent = 0
        self.errors: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="moepec-replica", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> None:
        self._queue.put(snap)

    def wait_idle(self) -> None:
        """Block until every submitted snapshot was exchanged (tests, benchmarks)."""
        self._queue.join()

    def close(self) -> None:
        """Stop the exchange thread (after the snapshots submitted; the timeout), then
        leave its process group. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(self.timeout.total_seconds())
        group, self.group = self.group, None
        if group is not None and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - exiting anyway; say what stays
                log.debug("could not destroy the replica process group: %s", exc)

    def _run(self) -> None:
        while True:
            snap = self._queue.get()
            try:
                if snap is None:
                    return
                self._exchange(snap)
                self.sent += 1
            except Exception as exc:  # noqa: BLE001 - a lost replica is not fatal
                log.warning("RAM replica of step %s not exchanged: %s", snap.step, exc)
                self.errors.append(str(exc))
            finally:
                if snap is not None:
                    self.release(snap)
                self._queue.task_done()

    def _exchange(self, snap: Snapshot) -> None:
        """Send ``snap``'s slot to the successor once sealed, receive the predecessor's.
        A slot that was not sealed (in time) is announced as empty and nothing of it is
        sent, so that every exchange still pairs with the peers' (then raises)."""
        assert snap.slot is not None
        problem = None
        if not snap.done.wait(self.timeout.total_seconds()):
            problem = TimeoutError(f"the slot of step {snap.step} was not sealed in time")
        elif snap.error is not None:
            problem = RuntimeError(f"the slot of step {snap.step} was not sealed: {snap.error}")
        header, data = (b"", None) if problem else self.own.raw(snap.slot)
        sizes = torch.tensor([len(header), 0 if data is None else data.numel()],
                             dtype=torch.int64)
        peer = torch.empty(2, dtype=torch.int64)
        self._wait([dist.isend(sizes, self.succ, group=self.group),
                    dist.irecv(peer, self.pred, group=self.group)])
        works = []
        if data is not None:
            out_header = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            works += [dist.isend(out_header, self.succ, group=self.group),
                      dist.isend(data.contiguous(), self.succ, group=self.group)]
        in_header = torch.empty(int(peer[0]), dtype=torch.uint8)
        in_data = torch.empty(int(peer[1]), dtype=torch.uint8)
        if in_header.numel():  # (empty: the predecessor's slot was not sealed)
            works += [dist.irecv(in_header, self.pred, group=self.group),
                      dist.irecv(in_data, self.pred, group=self.group)]
        self._wait(works)
        if in_header.numel():
            self.held.write_raw(in_header.numpy().tobytes(), in_data)
        if problem is not None:
            raise problem

    def _wait(self, works) -> None:
        for w in works:
            w.wait(self.timeout)
