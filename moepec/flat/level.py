"""A door's RAM level in this process: the frequent level of the two-level checkpoint,
on the flat front end's RAM tier (:class:`~moepec.flat.ram.FlatRam`, one per save
directory). The one implementation both flat doors use; a door keeps only what is its
own: when it snapshots, how it names steps and folders, which storage folder a load of
"the newest" means, and how its state turns into flat keys.

A door calls, on every rank:

1. :meth:`RamLevel.snapshot` after the optimizer step: the door's flat keys into a slot
   that continues the lineage of the door's storage saves of that directory (none
   before its first save or load in this process: nothing would name the lineage);
2. :meth:`RamLevel.newest` before a load of the newest storage folder (its manifest,
   :meth:`RamLevel.head`): the newest snapshot every rank holds newer than it, or None;
3. when one was found, :meth:`RamLevel.take` (the load's report; the storage head's
   lineage taken over) and :meth:`RamLevel.copies` of the keys the load reads;
4. :meth:`RamLevel.settle` after the load: the slots newer than what was loaded are
   invalidated (an abandoned future).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from moepec.flat.front import FlatFrontEnd
from moepec.flat.lineage import Choice
from moepec.flat.ram import FlatRam, check_ram_dir, ram_report
from moepec.hooks import FaultHooks
from moepec.ram import placement
from moepec.ram.replica import check_ram_replicas
from moepec.recovery.outcome import RestoreReport
from moepec.store.flat import FlatManifest

log = logging.getLogger(__name__)


class RamFound(NamedTuple):
    """A RAM snapshot a load takes: the save directory, the folder of its storage head
    (whose lineage it continues), its step, and this rank's tensors (views of the slot:
    :meth:`RamLevel.copies` of them)."""

    root: str
    name: str
    step: int
    tensors: Mapping[str, torch.Tensor]


class RamLevel:
    """One door's RAM level in this process: off until :meth:`configure` turns it on."""

    def __init__(self, front: Callable[[], FlatFrontEnd]) -> None:
        """``front``: the door's current front end (the lineage a snapshot continues, the
        storage head a load from RAM takes over)."""
        self._front = front
        self.on = False
        self.ram_dir: str | None = placement.AUTO
        self.hooks: FaultHooks | None = None
        self.ram_replicas: int | None = None
        self._rams: dict[str, FlatRam] = {}
        self._told: set[str] = set()
        self.report: RestoreReport | None = None
        """The report of the last load if it was from RAM (:meth:`take`), else None."""

    def configure(self, on: bool, ram_dir: str | None = placement.AUTO,
                  hooks: FaultHooks | None = None, ram_replicas: int | None = None) -> None:
        """Any rank: turn the level on or off; ``ram_dir`` and ``ram_replicas`` as
        ``CheckpointConfig``'s (``"auto"``, a folder, or None: in the process; 0, 1, or
        None: slots kept on the next node too when the ranks span nodes); ``hooks``: the
        snapshots' fault-injection seams (for tests). Raises ConfigError for a bad
        ``ram_dir`` or ``ram_replicas`` (changing nothing); drops the mappings of an
        earlier configuration."""
        check_ram_dir(ram_dir)
        check_ram_replicas(ram_replicas, ram_dir)
        self.close(unlink=False)
        self.on, self.ram_dir, self.hooks, self.report = on, ram_dir, hooks, None
        self.ram_replicas = ram_replicas

    def ram(self, root: str) -> FlatRam:
        """The RAM tier of save directory ``root`` (opened at its first collective use)."""
        root = os.path.abspath(root)
        if root not in self._rams:
            self._rams[root] = FlatRam(root, ram_dir=self.ram_dir, hooks=self.hooks,
                                       ram_replicas=self.ram_replicas)
        return self._rams[root]

    def snapshot(self, root: str, step: int,
                 tensors: Callable[[], Mapping[str, torch.Tensor]]) -> bool:
        """All ranks: ``tensors()`` (this rank's flat keys, built only when a snapshot is
        taken) into a slot of save directory ``root``; blocks until copied (the commit,
        header last, follows on the copy thread: :meth:`FlatRam.snapshot`). Returns
        whether a snapshot was taken: none before the first save or load of ``root`` in
        this process. Raises CheckpointError when the copy failed."""
        root = os.path.abspath(root)
        parent = self._front().lineage_uid(root)
        if not parent:
            self.once(f"first:{root}", "moepec: RAM snapshots of %s start after its first "
                      "save or load", root)
            return False
        self.ram(root).snapshot(int(step), tensors(), parent)
        return True

    def head(self, root: str, name: str) -> FlatManifest | None:
        """Any rank: the manifest of folder ``name`` of ``root``; None when uncommitted."""
        return self.ram(root).head(name)

    def newest(self, root: str, name: str, head: FlatManifest | None,
               group_of: Callable[[str], str] = str,
               into: Mapping[str, Any] | None = None) -> RamFound | None:
        """All ranks, before a load of folder ``name`` of ``root``, the newest storage
        save, whose manifest is ``head`` (None: no moepec save; nothing is read): the
        newest snapshot every rank holds intact, newer than ``head`` and of its lineage,
        else None on every rank (:meth:`FlatRam.newest`; ``group_of``: the keys a rank
        completes from the other ranks' snapshots; ``into``: the tensors of
        :meth:`copies`, filled while the slot is checked)."""
        found = self.ram(root).newest(head, group_of, into)
        return None if found is None else RamFound(os.path.abspath(root), name, *found)

    def take(self, found: RamFound, known: Choice | None = None) -> RestoreReport:
        """All ranks, at the start of the load from ``found``: the load of its storage
        head (nothing read; the run takes over its lineage; ``known``: the head's
        :meth:`FlatFrontEnd.folder`, when read already) and the load's report (also kept
        in :attr:`report`)."""
        _, head = self._front().load(found.root, found.name, [], agree=True, known=known)
        self.report = ram_report(head, found.step)
        if dist.get_rank() == 0:
            log.info("moepec: loaded the RAM snapshot of step %d (newer than %s)",
                     found.step, found.name)
        return self.report

    @staticmethod
    def copies(found: RamFound, keys: Sequence[str],
               into: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Copies of ``keys`` of ``found`` (its slot is reused by later snapshots, and the
        framework keeps what it loads): a key's tensor of ``into`` of the same shape and
        dtype (the framework's own, which it would copy the value into) filled in place
        and returned, one copy instead of two; else a clone."""
        out: dict[str, torch.Tensor] = {}
        for k in keys:
            src, dst = found.tensors[k], (into or {}).get(k)
            if src is dst:  # filled while its slot was checked (newest(into=...))
                out[k] = dst
            elif isinstance(dst, torch.Tensor) and dst.shape == src.shape \
                    and dst.dtype == src.dtype:
                with torch.no_grad():
                    out[k] = dst.copy_(src)
            else:
                out[k] = src.clone()
        return out

    def settle(self, root: str, step: int | None) -> None:
        """All ranks, after a load of ``root`` (when the level is on): keep the snapshot
        of ``step`` (the load's source; None: storage was loaded) and invalidate the slots
        of later steps (after a storage load, every slot)."""
        if self.on:
            self.ram(root).settle(step)

    def once(self, what: str, message: str, *args: Any, level: int = logging.INFO) -> None:
        """Log ``message`` on rank 0, once per ``what`` in this process."""
        if what not in self._told and dist.get_rank() == 0:
            log.log(level, message, *args)
        self._told.add(what)

    def close(self, unlink: bool = True) -> None:
        """Drop the RAM tiers' mappings; with ``unlink`` (a clean end of the run) remove
        this rank's slots."""
        rams, self._rams = self._rams, {}
        for ram in rams.values():
            ram.close(unlink)
