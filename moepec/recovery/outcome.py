"""What a restore reports and exchanges: the report a user gets, the context the
procedure reads, the outcome the manager applies (see :mod:`moepec.recovery.restore`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moepec.policy.plt import PLTLedger
from moepec.recovery.stitch import Source
from moepec.state.catalog import StateCatalog
from moepec.store.manifest import Manifest
from moepec.store.storage import Storage


@dataclass(slots=True)
class RestoreReport:
    """What ``CheckpointManager.restore()`` did."""

    step: int
    """The training step the restored state is from (resume at step + 1)."""
    checkpoint: str
    """Name of the base checkpoint (or ``ram:<seq>`` for a RAM snapshot)."""
    tier: str
    """Tier of the base: ``storage`` or ``ram``."""
    sources: dict[str, dict[str, Any]]
    """``"layer/expert"`` -> {"step", "tier", "checkpoint"} of the expert's weights."""
    lost: list[list[int]]
    """Token assignments lost by this recovery, per (layer, expert)."""
    plt: float
    """Cumulative proportion of lost tokens after this recovery (paper Eq. 7)."""
    warnings: list[str]
    seconds: float = 0.0
    units_from: dict[str, int] = field(default_factory=dict)
    """Expert units (one expert of one MoE layer: its weights and optimizer state)
    restored from each tier (``ram``, ``storage``)."""
    persisted_on_failure: str | None = None
    """The checkpoint this restore committed from a RAM snapshot a previous worker left
    (it was only in RAM when that worker died), or None."""

    @property
    def lost_total(self) -> int:
        return sum(map(sum, self.lost))


@dataclass(frozen=True, slots=True)
class RestoreContext:
    """What the restore procedure needs of the manager (read only)."""

    storage: Storage
    catalog: StateCatalog
    """Which experts this rank owns (the procedure never writes the live state)."""
    structure: dict[str, Any]
    n_experts: tuple[int, ...]
    rank: int
    world_size: int
    weights_in_view: bool
    """False with pec_scope "optimizer" (expert weights are saved as non-expert state)."""
    verify: bool
    read_in_place: bool = False
    """Read values straight into the live tensors that fit (CheckpointConfig.
    restore_in_place); False reads everything into new tensors first."""


@dataclass(frozen=True, slots=True)
class RestoreOutcome:
    """What a restore chose and read; the manager applies it."""

    values: dict[str, torch.Tensor]
    """This rank's restored keys -> values, to copy into the live state."""
    base: Source
    """The base: its ``meta`` is the bookkeeping to resume with (selectors, K, index)."""
    head: Manifest | None
    """The committed checkpoint the next persist continues (its lineage)."""
    ledger: PLTLedger
    """The PLT ledger after this recovery."""
    lost: list[list[int]]
    """Token assignments lost by this recovery."""
    sources: dict[str, dict[str, Any]]
    """``"layer/expert"`` -> where its weights came from (RestoreReport.sources)."""
    units_from: dict[str, int]
    """Expert units restored from each tier."""
    warnings: list[str]

    def report(self, *, plt: float, seconds: float,
               persisted_on_failure: str | None) -> RestoreReport:
        """The RestoreReport of this outcome, once the manager applied it."""
        base = self.base
        return RestoreReport(step=base.step, checkpoint=base.name, tier=str(base.tier),
                             sources=self.sources, lost=self.lost, plt=plt,
                             warnings=self.warnings, seconds=seconds, units_from=self.units_from,
                             persisted_on_failure=persisted_on_failure)
