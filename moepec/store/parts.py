"""The parts of checkpoints striped over replica groups, as the groups' roots hold them.

Each group's root holds its part of every striped checkpoint (``CheckpointMeta.part``).
A striped checkpoint is *whole* when every part of it is committed: the parts of one
epoch, step and quorum, every index present. Recovery restores only whole ones
(:mod:`moepec.recovery.striped`); retention keeps this root's part of the newest whole
one (:func:`protected`). Pure: manifests in, names out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moepec.errors import ManifestError
from moepec.store.manifest import Manifest


@dataclass(frozen=True, slots=True)
class Whole:
    """A checkpoint all of whose parts are committed: (root index, manifest) per part."""

    step: int
    parts: tuple[tuple[int, Manifest], ...]

    @property
    def name(self) -> str:
        return "+".join(m.name for _, m in self.parts)

    def part_in(self, root: int) -> Manifest | None:
        """The part root ``root`` holds, if any."""
        return next((m for r, m in self.parts if r == root), None)


def wholes(roots: Sequence[Mapping[str, Manifest]]) -> list[Whole]:
    """The whole checkpoints of ``roots`` (committed manifests per root), newest first: a
    manifest without a part is whole by itself; parts combine when epoch, step and
    quorum agree and every index is there. Ties of step: the later written first."""
    groups: dict[tuple, dict[int, tuple[int, Manifest]]] = defaultdict(dict)
    for r, manifests in enumerate(roots):
        for m in manifests.values():
            p = m.meta.part
            if p is None:
                groups[("whole", r, m.name)][0] = (r, m)
                continue
            key = (p["epoch"], m.step, p["count"], tuple(p["members"]))
            groups[key].setdefault(p["index"], (r, m))
    out = []
    for key, parts in groups.items():
        count = 1 if key[0] == "whole" else key[2]
        if len(parts) == count:
            ordered = tuple(parts[i] for i in range(count))
            out.append(Whole(step=ordered[0][1].step, parts=ordered))
    return sorted(out, key=lambda w: (w.step, sum(m.seq for _, m in w.parts)), reverse=True)


def protected(own: Mapping[str, Manifest], peers: Sequence[Mapping[str, Manifest]]) -> set[str]:
    """What retention keeps in root ``own`` for the newest whole checkpoint that has a part
    there: that part and every checkpoint of the root its view names."""
    for whole in wholes([own, *peers]):
        part = whole.part_in(0)
        if part is not None:
            try:
                return {part.name, *part.view.values()}
            except ManifestError:
                return set(own)
    return set()
