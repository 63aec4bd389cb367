"""Where a manager's RAM tier lives: node-local shared memory or the process.

:class:`RamSetup` makes the choices the manager's constructor needs (the folder for
``ram_dir="auto"``, the replica ring, the shared-memory budget, the slot stores) and
returns them as a :class:`RamChoice`; the manager keeps it. Every method that gathers
over ranks is collective when distributed (all ranks, training thread, in the same
order), so all ranks pick one tier: the restore protocol meets over it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from moepec.hooks import FaultHooks
from moepec.manager.config import AUTO, CheckpointConfig
from moepec.ram import placement
from moepec.ram.jobs import check_budget, root_identity
from moepec.ram.replica import Replicator, replica_peers, replicate
from moepec.ram.shm import SlotStore
from moepec.ram.snapshot import RamTier
from moepec.state.catalog import StateCatalog
from moepec.store.storage import Storage

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RamChoice:
    """The RAM tier a manager runs with."""

    ram_dir: str | None
    """Where the RAM snapshots live (None: in the process)."""
    tier: RamTier
    replicator: Replicator | None
    """Copies slots to the next node (``ram_replicas``), else None."""


@dataclass(slots=True)
class RamSetup:
    """The inputs of the choice: the manager's config, root, state and ranks."""

    config: CheckpointConfig
    storage: Storage
    catalog: StateCatalog
    rank: int
    world_size: int
    distributed: bool

    def build(self, hooks: FaultHooks | None) -> RamChoice:
        """Choose the folder, open the slots (and replicas) and build the RamTier.
        Collective when distributed. Raises ConfigError for a tier that does not fit
        its budget or a folder that cannot hold it."""
        config = self.config
        slots = held = peers = None
        ram_dir = self.choose_dir()
        if ram_dir is not None:
            peers = self.replica_peers()
            root = root_identity(self.storage.url, self.storage.local)
            if config.ram_dir != AUTO:  # checked by choose_dir when chosen automatically
                check_budget(self.need_bytes(peers), config.ram_budget_bytes, ram_dir, root)
            slots, held = self.open_slots(ram_dir, root, peers)
            if slots is None:
                ram_dir = peers = None
        tier = RamTier(background=config.async_snapshot, timeout_s=config.timeout_s,
                       slots=slots, replicas=held, hooks=hooks)
        replicator = replicate(tier, peers, config.timeout_s)
        return RamChoice(ram_dir=ram_dir, tier=tier, replicator=replicator)

    def open_slots(self, ram_dir: str, root: str, peers: tuple[int, int] | None
                   ) -> tuple[SlotStore | None, SlotStore | None]:
        """This rank's slot store and replicas (:func:`moepec.ram.placement.open_slots`).
        Collective when distributed."""
        return placement.open_slots(ram_dir, root, peers, rank=self.rank,
                                    world_size=self.world_size, distributed=self.distributed)

    def choose_dir(self) -> str | None:
        """The folder of the shared-memory RAM tier, or None for in-process buffers
        (:func:`moepec.ram.placement.choose_dir`). Collective when distributed."""
        chosen = self.config.ram_dir
        if chosen != AUTO:
            return chosen
        return placement.choose_dir(chosen, self.need_bytes(None),
                                    self.config.ram_budget_bytes,
                                    root_identity(self.storage.url, self.storage.local),
                                    rank=self.rank, world_size=self.world_size,
                                    distributed=self.distributed)

    def replica_peers(self) -> tuple[int, int] | None:
        """(successor, predecessor) on the ring over nodes when RAM slots are replicated,
        else None (:func:`moepec.ram.replica.replica_peers`). Collective when
        distributed."""
        return replica_peers(self.config.ram_replicas, rank=self.rank,
                             world_size=self.world_size, distributed=self.distributed)

    def need_bytes(self, peers: tuple[int, int] | None) -> int:
        """Shared memory the tier may take on this node: three slots per local rank (twice
        that with replicas), a full snapshot's share being about 1/world of the model with
        Adam's two moments (optimizer state may not exist yet), whole for one rank."""
        model = sum(t.numel() * t.element_size()
                    for t in self.catalog.model.state_dict().values())
        per_copy = model * (3 if self.catalog.optimizer is not None else 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return 3 * -(-per_copy // self.world_size) * (2 if peers else 1) * local

