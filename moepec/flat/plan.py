"""One flat save planned on the engine's schedule: which MoE layers and experts the state
has, which of them this save writes (the manager's :class:`ExpertSchedule`: selection
policy, K, ``full_every``, dynamic K, the PLT ledger), the view it commits, and the PLT
of a stitched load.

Pure logic over plain inputs (keys, units, manifests): no I/O, no collectives. The
collective and file steps are :mod:`moepec.flat.front`'s.

An *expert unit* is ``(layer, expert)``: ``layer`` a string naming one MoE layer (the
framework's key prefix and the layer's offsets), ``expert`` its global index. MoE layer L
of the schedule and of ``RestoreReport.sources["L/E"]`` is the L-th layer name in natural
order (numbers by value: ``layers.2`` before ``layers.10``), the model's MoE layers in
depth order for the key grammars the doors produce.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moepec.errors import ConfigError
from moepec.manager.config import CheckpointConfig
from moepec.manager.schedule import ExpertSchedule
from moepec.policy.plt import PLTLedger
from moepec.recovery.flat_view import Unit, keys_to_write, next_view
from moepec.store.flat import FlatManifest
from moepec.store.manifest import MAX_ANCESTORS

FLAT_FIELDS = ("k_persist", "selection", "full_every", "plt_budget", "dynamic_k",
               "dynamic_k_down")
"""The :class:`CheckpointConfig` fields that apply to a framework's own checkpointing
(the rest -- path, interval, RAM tier, write mode -- are the framework's business)."""


def flat_config(**fields: Any) -> CheckpointConfig:
    """A CheckpointConfig from a door's fields (the same names and validation as the
    manager's). Raises ConfigError naming a field that does not apply to a door."""
    unknown = sorted(set(fields) - set(FLAT_FIELDS))
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not a setting of a framework's own "
                          f"checkpointing; the ones that apply: {', '.join(FLAT_FIELDS)}")
    return CheckpointConfig(path="<framework>", **fields)


def natural(name: str) -> list[str | int]:
    """Sort key that orders numbers by value (``layers.2`` before ``layers.10``)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def layer_sizes(every: Iterable[Mapping[str, Unit | None]]) -> dict[str, int]:
    """MoE layer -> its experts (one more than the highest global index any rank holds),
    layers in natural order. ``every``: each rank's key -> unit."""
    sizes: dict[str, int] = {}
    for units in every:
        for unit in units.values():
            if unit is not None:
                sizes[unit[0]] = max(sizes.get(unit[0], 0), unit[1] + 1)
    return {name: sizes[name] for name in sorted(sizes, key=natural)}


@dataclass(frozen=True, slots=True)
class Parent:
    """The committed (or pending) folder a save continues."""

    name: str
    seq: int
    view: Mapping[str, str]
    layers: Sequence[str]
    schedule: Mapping[str, Any] | None
    """Its schedule's ``meta_fields`` (None: a folder without experts)."""
    ledger: Mapping[str, Any] | None = None
    """The PLT ledger to continue with, when it differs from ``schedule["ledger"]``
    (after a stitched load: the recovery's loss recorded)."""
    uid: str = ""
    ancestors: Sequence[tuple[str, str]] = ()
    """Its lineage, oldest first (the manifest's ``ancestors``: (folder, uid))."""
    pending: bool = False
    """Not committed when this save was planned (a save of this process in flight)."""
    full: bool = False
    """The save must write every expert (the folders it would read from get deleted)."""


@dataclass(frozen=True, slots=True)
class FlatPlan:
    """One save as planned on every rank (identical on all)."""

    root: str
    name: str
    seq: int
    step: int
    parent: str | None
    view: dict[str, str]
    experts: dict[str, Unit]
    saved: list[Unit]
    written: frozenset[str]
    world_size: int
    layers: list[str]
    schedule: dict[str, Any] | None
    uid: str = ""
    ancestors: list[tuple[str, str]] = field(default_factory=list)
    parent_pending: bool = False
    """The parent was in flight when this save was planned: if it never commits, nor
    may this save (every other folder its view reads was committed then)."""

    @property
    def k_persist(self) -> int:
        return self.schedule["k_persist"] if self.schedule else 0

    def manifest(self, items: Mapping[str, Any]) -> FlatManifest:
        """The manifest committing this plan, over the ranks' written ``items``."""
        return FlatManifest(
            name=self.name, seq=self.seq, step=self.step, parent=self.parent, items=items,
            view=self.view, experts={k: u for k, u in self.experts.items() if k in self.view},
            experts_saved=self.saved, k_persist=self.k_persist, world_size=self.world_size,
            layers=self.layers, schedule=self.schedule, uid=self.uid,
            ancestors=self.ancestors)


def schedule_for(sizes: Mapping[str, int], config: CheckpointConfig, parent: Parent | None,
                 rank: int, step: int) -> ExpertSchedule | None:
    """The schedule of the next save: the parent's continued when it covers the same
    layers (dynamic K applied after a recovery), else a fresh one. None without experts."""
    if not sizes:
        return None
    schedule = ExpertSchedule(tuple(sizes.values()), config)
    if parent is not None and parent.schedule is not None \
            and list(parent.layers) == list(sizes):
        ledger = PLTLedger.create(schedule.n_experts)
        ledger.load_state_dict(dict(parent.ledger or parent.schedule["ledger"]))
        schedule.resume_from(parent.schedule, ledger)
        if parent.ledger is not None:
            schedule.adjust_k(step, rank)
    return schedule


def plan_save(root: str, name: str, step: int, every: Sequence[Mapping[str, Unit | None]],
              parent: Parent | None, schedule: ExpertSchedule | None,
              counts: Sequence[Sequence[int]] | None, uid: str = "", full: bool = False
              ) -> FlatPlan:
    """Plan one save: ``every`` is each rank's key -> unit (all ranks gathered),
    ``counts`` the routing counts per (layer, expert) since the parent (summed over ranks),
    ``uid`` the save's identity (the same on every rank), ``full``: a complete save (a
    final one, :mod:`moepec.flat.final`).
    The first save of a lineage, one ``full_every`` or a ``full`` parent asks for, one over
    a changed set of layers and a ``full`` one write every expert; a key the parent's view
    lacks is always written."""
    sizes = layer_sizes(every)
    selected: set[Unit] = set()
    fields = None
    if schedule is not None:
        if counts is not None:
            schedule.observe(counts)
        resumed = parent is not None and parent.schedule is not None \
            and list(parent.layers) == list(sizes)
        full = full or not resumed or parent.full or schedule.is_full_by_period()
        _, persist_sel = schedule.choose(full, persist=True)
        selected = {(layer, e) for layer, sel in zip(sizes, persist_sel) for e in sel}
        fields = schedule.meta_fields()
    view = parent.view if parent is not None else None
    written = frozenset(k for units in every for k in keys_to_write(units, view, selected))
    experts = {k: u for units in every for k, u in units.items() if u is not None}
    return FlatPlan(root=root, name=name, seq=parent.seq + 1 if parent else 0, step=step,
                    parent=parent.name if parent else None,
                    view=next_view(view, name, [k for units in every for k in units], written),
                    experts=experts, saved=sorted({experts[k] for k in written if k in experts}),
                    written=written, world_size=len(every), layers=list(sizes),
                    schedule=fields, uid=uid, parent_pending=bool(parent and parent.pending),
                    ancestors=[] if parent is None else
                    [*parent.ancestors, (parent.name, parent.uid)][-MAX_ANCESTORS:])


def stale_copies(head: FlatManifest, manifests: Mapping[str, FlatManifest],
                 keys: Iterable[str]) -> dict[Unit, str]:
    """Each expert unit among ``keys`` -> the folder of its oldest copy the load reads
    (the unit's state is as old as its oldest key)."""
    out: dict[Unit, str] = {}
    for key in keys:
        unit = head.experts.get(key)
        if unit is None:
            continue
        src = head.view[key]
        if unit not in out or manifests[src].seq < manifests[out[unit]].seq:
            out[unit] = src
    return out


def account_load(head: FlatManifest, manifests: Mapping[str, FlatManifest],
                 keys: Iterable[str]) -> tuple[dict[str, dict[str, Any]], list[list[int]],
                                               PLTLedger | None]:
    """What a stitched load of ``head`` over ``keys`` restored and lost: ``sources``
    (``"L/E"`` -> step, tier, checkpoint of the copy), the lost assignments per (layer,
    expert) and the ledger with this recovery recorded (paper Eq. 7), None without a
    schedule. Every folder read must be in ``manifests``."""
    copies = stale_copies(head, manifests, keys)
    index = {layer: i for i, layer in enumerate(head.layers)}
    sources = {f"{index[u[0]]}/{u[1]}": {"step": manifests[f].step, "tier": "storage",
                                         "checkpoint": f}
               for u, f in sorted(copies.items(), key=lambda kv: (index[kv[0][0]], kv[0][1]))
               if u[0] in index}
    if head.schedule is None:
        return sources, [], None
    ledger = PLTLedger.create([len(r) for r in head.schedule["counts"]])
    ledger.load_state_dict(head.schedule["ledger"])
    at = head.schedule["counts"]
    copy = [list(row) for row in at]
    for (layer, e), folder in copies.items():
        src = manifests[folder].schedule
        if layer in index and src is not None and layer in manifests[folder].layers:
            l_src = list(manifests[folder].layers).index(layer)
            copy[index[layer]][e] = src["counts"][l_src][e]
    lost = ledger.record_recovery(at, copy)
    return sources, lost, ledger
