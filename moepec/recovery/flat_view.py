"""Partial experts over flat checkpoints (``moepec.store.flat``): which experts a save
writes, the view it commits, what a stitched load lost, and verify of a save directory.

An *expert unit* is ``(layer, expert)``: ``layer`` a string naming one MoE layer (the
framework's key prefix and the layer's offsets), ``expert`` its global index. A save
writes every non-expert key and, for each layer, K of its N experts in staggered
round-robin order (``policy.selection.sequential_pick``: layer m (the m-th layer name
in natural order: numbers by value), checkpoint c starts at
expert (m + c*K) mod N, so every expert is saved at least every ceil(N/K) checkpoints);
a key the parent's view lacks is always written. Pure except :func:`verify_root`, which
reads the save directory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from moepec.policy.selection import sequential_pick
from moepec.store.flat import FlatManifest, empty_like_item, read_keys, scan

Unit = tuple[str, int]
"""(layer, expert)."""


def select_units(experts_per_layer: Mapping[str, int], index: int, k: int) -> set[Unit]:
    """The units checkpoint number ``index`` writes: ``k`` of each layer's experts
    (all of them when ``k`` >= N). ``experts_per_layer`` must be the same on every rank
    (the union over ranks), so all ranks pick alike."""
    out: set[Unit] = set()
    for m, layer in enumerate(sorted(experts_per_layer, key=_natural)):
        n = experts_per_layer[layer]
        taken, _ = sequential_pick((m + index * k) % n, n, k)
        out.update((layer, e) for e in taken)
    return out


def _natural(name: str) -> list[str | int]:
    """Sort key that orders numbers by value (``layers.2`` before ``layers.10``): layer m
    of the rotation is the m-th layer in this order."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def keys_to_write(units: Mapping[str, Unit | None], parent_view: Mapping[str, str] | None,
                  selected: set[Unit]) -> list[str]:
    """Of one rank's keys (key -> its unit, None for non-expert state): those to write.
    Every non-expert key, every key of a selected unit, every key the parent lacks."""
    return [key for key, unit in units.items()
            if unit is None or unit in selected or parent_view is None
            or key not in parent_view]


def next_view(parent_view: Mapping[str, str] | None, name: str, all_keys: Iterable[str],
              written: Iterable[str]) -> dict[str, str]:
    """The view of folder ``name``: every key of the state (all ranks') -> the folder of
    its newest copy. Keys no longer in the state are dropped. Raises ValueError for a
    key that neither this folder wrote nor the parent's view holds."""
    written = set(written)
    view: dict[str, str] = {}
    for key in all_keys:
        if key in written:
            view[key] = name
        elif parent_view is not None and key in parent_view:
            view[key] = parent_view[key]
        else:
            raise ValueError(f"{key!r:.120} is neither written nor in the parent's view")
    return view


@dataclass(frozen=True, slots=True)
class StitchReport:
    """What a stitched load of one folder restored."""

    folder: str
    step: int
    stale: dict[Unit, int] = field(default_factory=dict)
    """Units restored from an older folder -> the step of that copy."""
    lost_expert_steps: int = 0
    """Sum over units of the steps between the folder and the copy restored (the updates
    the load lost); 0 when every expert is as new as the folder."""

    def summary(self) -> str:
        if not self.stale:
            return f"{self.folder}: every expert as of step {self.step}"
        oldest = min(self.stale.values())
        return (f"{self.folder}: {len(self.stale)} expert(s) from older folders (oldest "
                f"from step {oldest}); lost expert-steps {self.lost_expert_steps}")


def stitch_report(manifest: FlatManifest, steps: Mapping[str, int],
                  keys: Iterable[str] | None = None) -> StitchReport:
    """The stale units of a load of ``manifest`` over ``keys`` (default: its whole
    view); ``steps`` maps folder names to their steps."""
    stale: dict[Unit, int] = {}
    for key in manifest.view if keys is None else keys:
        unit, src = manifest.experts.get(key), manifest.view[key]
        if unit is None or src == manifest.name:
            continue
        stale[unit] = min(stale.get(unit, steps[src]), steps[src])
    lost = sum(manifest.step - s for s in stale.values())
    return StitchReport(folder=manifest.name, step=manifest.step, stale=stale,
                        lost_expert_steps=lost)


@dataclass(slots=True)
class FlatVerify:
    """The result of :func:`verify_root`."""

    checked: int = 0
    bad: list[str] = field(default_factory=list)
    """``folder:key`` of every item missing or failing its checksum."""
    damaged: list[str] = field(default_factory=list)
    uncommitted: list[str] = field(default_factory=list)
    needs: dict[str, list[str]] = field(default_factory=dict)
    """Committed folder -> the other folders its view reads (keep them)."""
    broken: list[str] = field(default_factory=list)
    """Folders whose view cannot be loaded, with the reason."""

    @property
    def ok(self) -> bool:
        return not self.bad and not self.damaged and not self.broken and bool(self.needs)

    def lines(self) -> list[str]:
        """Human-readable report, one fact a line."""
        out = [f"{n} needs {', '.join(d)} (keep them)" if d else f"{n} is self-contained"
               for n, d in self.needs.items()]
        out += [f"uncommitted (never loaded; safe to delete): {n}" for n in self.uncommitted]
        out += [f"damaged: {d}" for d in self.damaged]
        out += [f"bad item: {b}" for b in self.bad]
        out += [f"cannot be loaded: {b}" for b in self.broken]
        return out


def verify_root(root: str) -> FlatVerify:
    """Read every item of every committed folder of ``root`` and compare checksums; for
    each folder, the folders its view needs and whether they are all intact."""
    found = scan(root)
    res = FlatVerify(damaged=[f"{n}: {e}" for n, e in found.damaged.items()],
                     uncommitted=list(found.uncommitted))
    for name, m in found.manifests.items():
        targets = {k: empty_like_item(v) for k, v in m.items.items()}
        res.bad += [f"{name}:{k}" for k in read_keys(root, found.manifests,
                                                     dict.fromkeys(targets, name), targets)]
        res.checked += len(targets)
    bad = set(res.bad)
    for name, m in found.manifests.items():
        res.needs[name] = sorted(m.needs(), key=lambda n: found.manifests[n].seq
                                 if n in found.manifests else -1)
        gone = [n for n in res.needs[name] if n not in found.manifests]
        broken = [k for k, src in m.view.items() if f"{src}:{k}" in bad]
        if gone:
            res.broken.append(f"{name}: needs {', '.join(gone)}, which is not committed")
        elif broken:
            res.broken.append(f"{name}: {len(broken)} key(s) of its view are damaged "
                              f"(e.g. {broken[0]})")
    return res
