"""Views over flat checkpoints (``moepec.store.flat``): which keys a save writes, the
view it commits, and verify of a save directory. Which experts a save selects is the
engine's schedule (``moepec.flat.plan``). Pure except :func:`verify_root`, which reads
the save directory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from moepec.errors import CorruptCheckpointError
from moepec.store.flat import empty_like_item, read_keys, scan

Unit = tuple[str, int]
"""(layer, expert)."""


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
        targets = {}
        for key, item in m.items.items():
            try:
                targets[key] = empty_like_item(item)
            except CorruptCheckpointError:  # a forged shape: a bad item, nothing read
                res.bad.append(f"{name}:{key}")
        res.bad += [f"{name}:{k}" for k in read_keys(root, found.manifests,
                                                     dict.fromkeys(targets, name), targets)]
        res.checked += len(m.items)
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
