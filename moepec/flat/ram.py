"""The RAM tier behind the flat front end: a door's frequent level (a snapshot of this
rank's flat keys into node-local shared memory), on the manager's implementation of it
(:class:`~moepec.ram.snapshot.RamTier`'s slots and commit rule, ``ram_dir`` resolved by
:mod:`moepec.ram.placement`).

A door calls, on every rank:

1. :meth:`FlatRam.snapshot` (collective) after the optimizer step: every flat key this
   rank would save (all its experts: the RAM copy holds K_snapshot = N), copied into a
   slot committed header last; the slot names the storage save it continues (its uid);
2. :meth:`FlatRam.newest` (collective) before a load of the newest checkpoint: the step
   of the newest snapshot of which every rank's slot is held intact (by that rank, or
   with ``ram_replicas`` as a replica on the next node: a rank whose node was lost gets
   its tensors from there), when it continues the lineage of the storage head and is
   newer than it, with this rank's tensors; else None;
3. :meth:`FlatRam.settle` after the load: the slots (and replicas) newer than what was
   loaded are invalidated (an abandoned future).

A slot of another checkpoint root, rank or world size, a torn one, or one whose storage
save is not in the head's lineage is never read (:mod:`moepec.ram.shm`). A snapshot
taken before the first committed storage save is not read (storage serves, or the run
starts fresh).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from moepec.errors import ConfigError
from moepec.flat.lineage import manifest_or_none
from moepec.hooks import FaultHooks
from moepec.ram import placement
from moepec.ram.jobs import check_budget
from moepec.ram.replica import Replicator, check_ram_replicas, replica_peers, replicate
from moepec.ram.snapshot import RamTier, Snapshot
from moepec.recovery.outcome import RestoreReport
from moepec.store.flat import FlatManifest
from moepec.store.meta import CheckpointMeta

log = logging.getLogger(__name__)

_STRUCTURE = {"experts": [], "params": [], "fingerprint": "moepec-flat"}
"""A flat snapshot's meta: the keys are the door's; no model structure is recorded."""


def _meta(step: int, parent_uid: str, world_size: int) -> CheckpointMeta:
    return CheckpointMeta(
        step=step, seq=step, index=0, time=time.time(), structure=_STRUCTURE, config={},
        k_persist=0, k_snapshot=0, full=True, pec_scope="", selection="",
        experts_saved=[], experts_snapshot=[], counts=[], ledger={}, plt=0.0,
        selectors={}, k_history=[], world_size=world_size, write_mode="flat",
        run_id=parent_uid, runs=[])


def check_ram_dir(ram_dir: object) -> None:
    """Raise ConfigError, in one line, unless ``ram_dir`` is ``"auto"``, a folder or None."""
    if ram_dir is not None and (not isinstance(ram_dir, str) or not ram_dir):
        raise ConfigError(f"ram_dir must be 'auto', a folder path (e.g. /dev/shm/moepec) "
                          f"or None (null in JSON) for in-process snapshots (got {ram_dir!r})")


class FlatRam:
    """One door's RAM tier in this process, for one save directory (its slots are found
    again by a restarted worker of the same rank under the same directory)."""

    def __init__(self, root: str, *, ram_dir: str | None = placement.AUTO,
                 ram_replicas: int | None = None, budget_bytes: int | None = None,
                 timeout_s: float = 600.0, hooks: FaultHooks | None = None) -> None:
        """``root``: the save directory (absolute); ``ram_dir``: as
        ``CheckpointConfig.ram_dir`` (``"auto"``, a folder, or None: in the process);
        ``ram_replicas``: as ``CheckpointConfig.ram_replicas`` (0, 1, or None: 1 when the
        ranks span nodes): each committed slot is also kept by a rank of the next node,
        so a rank whose node was lost loads from RAM. ``hooks``: fault-injection seams
        of the snapshots (``moepec.hooks``, for tests). Opens nothing: the first
        collective call does. Raises ConfigError for a bad ``ram_dir`` or
        ``ram_replicas`` (``ram_replicas=1`` on one node: at the first call)."""
        check_ram_dir(ram_dir)
        check_ram_replicas(ram_replicas, ram_dir)
        self.root = os.path.abspath(root)
        self.ram_dir = ram_dir
        self.ram_replicas = ram_replicas
        self.budget_bytes = budget_bytes
        self.timeout_s = timeout_s
        self.hooks = hooks
        self._tier: RamTier | None = None
        self._replicator: Replicator | None = None

    def _open(self, share_bytes: int) -> RamTier:
        """All ranks, at the first call: resolve ``ram_dir``, open this rank's slots (and
        the replicas it keeps of its predecessor's on the ring over nodes, whose exchange
        starts here: :func:`moepec.ram.replica.replicate`)."""
        if self._tier is not None:
            return self._tier
        rank, world = dist.get_rank(), dist.get_world_size()
        peers = None if self.ram_dir is None else replica_peers(
            self.ram_replicas, rank=rank, world_size=world, distributed=True)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        need = 3 * share_bytes * local * (2 if peers else 1)  # replicas: twice the slots
        chosen = placement.choose_dir(self.ram_dir, need, self.budget_bytes, self.root,
                                      rank=rank, world_size=world, distributed=True)
        slots = held = None
        if chosen is not None:
            if self.ram_dir != placement.AUTO:
                check_budget(need, self.budget_bytes, chosen, self.root)
            slots, held = placement.open_slots(chosen, self.root, peers, rank=rank,
                                               world_size=world, distributed=True)
        self.ram_dir = chosen if slots is not None else None
        # The copy runs on the tier's thread while the caller waits; its seal (checksums,
        # header) follows there while training goes on, as in the manager. The replica
        # exchange waits for the seal on its own thread.
        self._tier = RamTier(background=True, timeout_s=self.timeout_s, slots=slots,
                             replicas=held, hooks=self.hooks)
        self._replicator = replicate(self._tier, peers, self.timeout_s)
        return self._tier

    @property
    def in_shared_memory(self) -> bool:
        """Whether the snapshots outlive this process (known after the first call)."""
        return self._tier is not None and self._tier.slots is not None

    def snapshot(self, step: int, tensors: Mapping[str, torch.Tensor],
                 parent_uid: str) -> Snapshot:
        """All ranks: copy ``tensors`` (this rank's flat keys, on the CPU or a device)
        into a slot; blocks until copied (the live tensors may change then) and returns
        the snapshot, whose seal (checksums, header last: the commit) follows on the
        copy thread (``snap.done``; :meth:`newest` and :meth:`close` wait for it).
        ``parent_uid``: the uid of the storage save this state continues. Raises
        CheckpointError when the copy failed; a failed seal is logged and its slot stays
        torn (never read)."""
        share = sum(t.numel() * t.element_size() for t in tensors.values())
        tier = self._open(share)
        snap = Snapshot(tensors={}, persist_keys=frozenset(),
                        meta=_meta(step, parent_uid, dist.get_world_size()), persist=False,
                        all_keys=sorted(tensors))
        tier.start(snap, dict(tensors))
        tier.finish()
        return snap

    @property
    def replicated(self) -> bool:
        """Whether this rank's slots are kept on another node too (after the first call)."""
        return self._replicator is not None

    def wait_replicated(self) -> None:
        """Block until every snapshot of this process was exchanged with the replica
        peers (each exchange bounded by the timeout; tests, benchmarks)."""
        if self._replicator is not None:
            self._replicator.wait_idle()

    def sealed(self) -> None:
        """Wait for the seal of this process's last snapshot (the snapshot timeout)."""
        if self._tier is not None and self._tier.newest is not None:
            self._tier.newest.done.wait(self.timeout_s)

    def head(self, name: str) -> FlatManifest | None:
        """Any rank: the manifest of folder ``name`` of the root, None when uncommitted."""
        return manifest_or_none(self.root, name)

    def newest(self, head: FlatManifest | None, group_of: Callable[[str], str],
               into: Mapping[str, Any] | None = None
               ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """All ranks, before a load of the newest checkpoint whose storage head is
        ``head`` (:meth:`head`; None: no storage save): (step, this rank's tensors:
        views of the slot, copy them) of the newest snapshot of which every rank's slot
        is held intact, by that rank or as a replica by another (``ram_replicas``; a
        rank whose own slot is gone receives its tensors from the replica's holder),
        continuing ``head``'s lineage and newer than it; else None on every rank. Only
        the copies chosen are checked against their checksums (a torn one is dropped and
        the ranks choose again). A rank's tensors are completed from the other
        ranks' snapshots: each key of a group (``group_of(key)``, e.g. a file) of which
        this rank holds a key (a framework that writes a shared file on one rank
        alone). ``into``: the loader's own tensors by key; a slot an earlier worker left
        is copied into those of the same shape and dtype and the copies checked
        (``moepec.ram.readback.read_checked``): they are its tensors then."""
        self.sealed()  # this process's own last snapshot: committed or torn, not in flight
        mine, me = self._candidates(head), dist.get_rank()
        while True:  # a torn copy a rank finds is dropped; the ranks choose again
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, sorted(mine))
            chosen = choose_copies(every)
            if chosen is None:
                return None
            step, source = chosen
            held = {owner: self._tensors(mine[(owner, step)][0],
                                         into if owner == me else None)
                    for owner, src in source.items() if src == me}
            intact = torch.tensor([int(all(t is not None for t in held.values()))])
            dist.all_reduce(intact, op=dist.ReduceOp.MIN)
            if intact.item():
                own = _from_holders(held, source, into)
                return step, own | _completed(own, group_of)
            for owner, tensors in held.items():  # that copy is gone; the next, if any
                if tensors is None:
                    mine[(owner, step)] = mine[(owner, step)][1:]
            mine = {key: snaps for key, snaps in mine.items() if snaps}

    def _candidates(self, head: FlatManifest | None
                    ) -> dict[tuple[int, int], list[Snapshot]]:
        """The snapshots this rank holds by (owner rank, step) (its own, and the replicas
        it keeps of its predecessor's: the slot header's rank), each newest first, that
        continue ``head``'s lineage and are newer than it, checksums not yet checked
        (:meth:`_tensors`: only those a load takes)."""
        mine: dict[tuple[int, int], list[Snapshot]] = {}
        if head is not None and self._tier is None:
            self._open(0)
        tier = self._tier
        if head is not None and tier is not None:
            lineage = {head.uid} | {uid for _, uid in head.ancestors}
            lineage.discard("")
            for snap in tier.recovered(lambda meta: meta.run_id in lineage, verify=False):
                if snap.step > head.step and snap.meta.run_id in lineage:
                    owner = tier.replicas.rank if snap.origin == "replica" and \
                        tier.replicas is not None else dist.get_rank()
                    mine.setdefault((owner, snap.step), []).append(snap)
        return mine

    def _tensors(self, snap: Snapshot, into: Mapping[str, Any] | None
                 ) -> dict[str, torch.Tensor] | None:
        """``snap``'s tensors (views), or None when its slot is torn: a slot an earlier
        worker left (this rank's or a replica) is mapped and checked against its
        checksums here, by the load that takes it (this process's own snapshot was
        sealed by it)."""
        tier = self._tier
        store = None if tier is None else \
            tier.replicas if snap.origin == "replica" else tier.slots
        if snap.verified or snap.slot is None or store is None:
            return dict(snap.tensors)
        return store.intact(snap.slot, into)

    def settle(self, step: int | None) -> None:
        """All ranks, after a load: keep the snapshot of ``step`` (the load's source;
        None: storage was loaded) and invalidate the slots of later steps (an abandoned
        future: after a storage load, every slot)."""
        self.sealed()  # a seal in flight would commit a slot invalidated here
        tier = self._tier if self._tier is not None else self._open(0)
        if step is None:
            tier.drop()  # this process's newest snapshot too
        tier.settle(-1 if step is None else step, keep=step is not None)

    def close(self, unlink: bool = False) -> None:
        """Drop the mappings (after the last snapshot's seal); with ``unlink`` (a clean
        end) remove this rank's slots (and the replicas it keeps). The replica exchange
        stops first (after the snapshots handed to it)."""
        if self._replicator is not None:
            self._replicator.close()
            self._replicator = None
        if self._tier is not None:
            self._tier.close(unlink)
            self._tier = None


def choose_copies(offers: Sequence[Sequence[tuple[int, int]]]
                  ) -> tuple[int, dict[int, int]] | None:
    """Pure: from the (owner rank, step) of the slots each rank holds (``offers[r]``:
    rank r's, its own and replicas), the newest step of which every rank's slot is held
    by some rank, and for each rank the one that serves its slot: itself when it holds
    it (read into its own tensors), else the lowest rank keeping a replica. None when no
    step is held whole."""
    holders: dict[tuple[int, int], list[int]] = {}
    for rank, keys in enumerate(offers):
        for owner, step in keys:
            holders.setdefault((owner, step), []).append(rank)
    for step in sorted({step for _, step in holders}, reverse=True):
        ranks = [holders.get((owner, step)) for owner in range(len(offers))]
        if all(ranks):
            return step, {owner: owner if owner in held else min(held)
                          for owner, held in enumerate(ranks)}
    return None


def _from_holders(held: Mapping[int, Mapping[str, torch.Tensor]], source: Mapping[int, int],
                  into: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """All ranks, once the copies ``source`` names are read (``held``: this rank's, by
    owner): this rank's tensors, its own slot's, or sent by the holder of its replica
    (each key's bytes, owners then keys in order; into ``into``'s tensor of the same
    shape and dtype where it is a contiguous CPU one)."""
    me = dist.get_rank()
    if all(src == owner for owner, src in source.items()):
        return dict(held[me])
    specs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(specs, {owner: {k: (list(t.shape), str(t.dtype))
                                           for k, t in tensors.items()}
                                   for owner, tensors in held.items() if owner != me})
    out = dict(held.get(me, {}))
    for owner, src in sorted(source.items()):
        if src == owner or me not in (owner, src):
            continue
        for key, (shape, dtype) in sorted(specs[src][owner].items()):
            if me == src:
                t = held[owner][key].contiguous()
            else:
                t = out[key] = _target((into or {}).get(key), shape,
                                       getattr(torch, dtype.removeprefix("torch.")))
            data = t.reshape(-1).view(torch.uint8)
            if data.numel():
                (dist.send if me == src else dist.recv)(data, owner if me == src else src)
    return out


def _target(mine: Any, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Where a key sent from a replica is received: the loader's own tensor when it fits
    (a contiguous CPU tensor of that shape and dtype), else a new one."""
    if isinstance(mine, torch.Tensor) and mine.device.type == "cpu" and mine.dtype == dtype \
            and list(mine.shape) == shape and mine.is_contiguous():
        return mine
    return torch.empty(shape, dtype=dtype)


def ram_report(head: RestoreReport, step: int) -> RestoreReport:
    """The report of a load from the RAM snapshot of ``step``, from ``head``'s (the load
    of its storage head, whose lineage the run takes over): every unit from RAM at that
    step, nothing lost by this load (the PLT of earlier recoveries stays)."""
    label = f"ram:{step}"
    return dataclasses.replace(
        head, step=step, checkpoint=label, tier="ram", units_from={"ram": len(head.sources)},
        lost=[[0] * len(r) for r in head.lost],
        sources={u: {**s, "step": step, "tier": "ram", "checkpoint": label}
                 for u, s in head.sources.items()})


def _completed(held: Mapping[str, torch.Tensor], group_of: Callable[[str], str]
               ) -> dict[str, torch.Tensor]:
    """All ranks: the keys this rank lacks of the groups it holds a key of, each sent by
    the lowest rank holding it (one broadcast of its bytes per key)."""
    world = dist.get_world_size()
    names: list[Any] = [None] * world
    mine = {k: (list(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in held.items()}
    dist.all_gather_object(names, mine)
    wanted = {r: {group_of(k) for k in names[r]} for r in range(world)}
    sends: dict[str, tuple[int, Any]] = {}
    for r in range(world):
        for k, spec in names[r].items():
            if k not in sends and any(group_of(k) in wanted[o] and k not in names[o]
                                      for o in range(world)):
                sends[k] = (r, spec)
    me, out = dist.get_rank(), {}
    for k in sorted(sends):
        src, (shape, dtype) = sends[k]
        t = held[k] if me == src else torch.empty(shape, dtype=getattr(torch, dtype))
        data = t.contiguous().reshape(-1).view(torch.uint8).clone() if me == src else \
            t.reshape(-1).view(torch.uint8)
        if data.numel():
            dist.broadcast(data, src=src)
        if me != src and k not in held and group_of(k) in wanted[me]:
            out[k] = t
    return out
