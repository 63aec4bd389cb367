"""Building one checkpoint's RAM snapshot from the live state (training thread).

:class:`SnapshotBuilder` chooses the experts (through the manager's
:class:`~moepec.manager.schedule.ExpertSchedule`), works out this rank's share of the
keys under the write plan, captures the small objects and buffers now, and returns the
:class:`~moepec.ram.snapshot.Snapshot` with the live tensors its copy reads.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moepec.manager.config import CheckpointConfig, PecScope
from moepec.manager.schedule import ExpertSchedule
from moepec.ram.snapshot import Snapshot
from moepec.state.catalog import StateCatalog
from moepec.state.checkpoint_keys import CheckpointKeys
from moepec.store.meta import CheckpointMeta, Part


@dataclass(slots=True)
class SnapshotBuilder:
    """What a snapshot is built from: the manager's state, keys and schedule."""

    config: CheckpointConfig
    catalog: StateCatalog
    keys: CheckpointKeys
    schedule: ExpertSchedule
    structure: dict[str, Any]
    rank: int
    world_size: int
    config_dict: dict[str, Any] = field(init=False)
    """The config as written into every manifest."""
    _covered: tuple[str | None, bool] = field(init=False, default=(None, False))
    """(committed head, whether its view holds every expert this rank owns)."""

    def __post_init__(self) -> None:
        self.config_dict = self.config.to_dict()

    def is_full(self, persist: bool, head: str | None, view: Mapping[str, str],
                part: Part | None = None) -> bool:
        """Whether the next checkpoint saves every expert: when it is persisted while the
        committed view (of ``head``) lacks one of this rank's experts (the first checkpoint
        of a run, or every one after failed persists), every ``full_every``-th, and every
        one of a model without experts (it holds the whole state). A part of a striped
        checkpoint: when the part says so (every group decides alike; one root's view
        never holds every expert)."""
        if part is not None:
            return part.full or self.schedule.is_full_by_period()
        return (not self.catalog.n_global or (persist and not self._covers(head, view))
                or self.schedule.is_full_by_period())

    def _covers(self, head: str | None, view: Mapping[str, str]) -> bool:
        """Whether the committed view holds a copy of every expert this rank owns."""
        if self._covered[0] != head or head is None:
            self._covered = (head, head is not None and self.catalog.covers_owned_experts(
                view, self.config.pec_scope != PecScope.OPTIMIZER))
        return self._covered[1]

    def forget_coverage(self) -> None:
        """After a restore: the coverage is recomputed from the restored head."""
        self._covered = (None, False)

    def take(self, step: int, seq: int, full: bool, persist: bool, *, run_id: str,
             runs: Sequence[str], part: Part | None = None
             ) -> tuple[Snapshot, dict[str, torch.Tensor]]:
        """Choose the experts and build checkpoint ``seq``'s snapshot: objects and buffers
        captured now, the live tensors to copy returned beside it. With ``part``, this
        rank's share of the checkpoint striped over the groups of ``part``."""
        # Objects (RNG, scheduler, loader, hyper-parameters) change during the next
        # forward: captured now, on the training thread, and first, so that a state that
        # cannot be stored (ConfigError) leaves the selectors as they were. Rank 0 writes
        # them (the write plan), so only it pays for serialising them.
        objects = self.catalog.capture_objects() if self.rank == 0 else {}
        snap_sel, persist_sel = self.schedule.choose(full, persist)
        snap_keys = self.keys.keys_for(snap_sel)
        mine = self.keys.mine(snap_keys)
        persist_keys = self.keys.keys_for(persist_sel) if persist else []
        if part is not None:  # RAM: the group's share (complete within it); storage: the part
            striped = set(self.keys.mine(snap_keys, (part.index, part.count)))
            persist_keys = [k for k in persist_keys if k in striped]
            held = striped | set(mine)
            mine = [k for k in snap_keys if k in held]
        mine_set = set(mine)
        persist_experts = [tuple(p) for p in persist_sel] if persist else None
        meta = self._meta(step, seq, full, snap_sel, persist_experts, run_id, runs)
        if part is not None:
            meta = dataclasses.replace(meta, part=part.to_json())
        snap = Snapshot(tensors={},
                        persist_keys=frozenset(k for k in persist_keys if k in mine_set),
                        meta=meta, persist=persist, refs=2 if persist else 1,
                        all_keys=snap_keys)
        # Buffers change during the next forward too: cloned now.
        snap.tensors.update({k: v for k, v in objects.items() if k in mine_set})
        sources = {k: self.keys.live(k) for k in mine if not k.startswith("objects/")}
        for k in [k for k in sources if k.startswith("model/") and k[6:] in self.catalog.buffers]:
            snap.tensors[k] = sources.pop(k).clone()
        return snap, sources

    def _meta(self, step: int, seq: int, full: bool, snap_sel: Sequence[Sequence[int]],
              persist_experts: Sequence[Sequence[int]] | None, run_id: str,
              runs: Sequence[str]) -> CheckpointMeta:
        return CheckpointMeta(
            step=step, seq=seq, time=time.time(),
            structure=self.structure, config=self.config_dict, full=full,
            pec_scope=str(self.config.pec_scope), selection=str(self.config.selection),
            experts_saved=[list(p) for p in (persist_experts or [])],
            experts_snapshot=[list(s) for s in snap_sel],
            world_size=self.world_size, write_mode=str(self.config.write_mode),
            run_id=run_id, runs=list(runs), **self.schedule.meta_fields())
