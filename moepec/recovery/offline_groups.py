"""Offline tools over the ``--ckpt-dir`` of a replica-group run: the folder holding the
``group-<I>`` roots, each a manager root with its part of every striped checkpoint
(:mod:`moepec.recovery.striped`). Inspect shows every root's table and the newest *whole*
striped checkpoint (every part committed: what a cold start restores and what
``moepec export`` writes); verify checks every root as ``moepec verify`` checks one, and
that a whole checkpoint exists and holds a copy of every expert. Reads only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moepec.errors import ManifestError
from moepec.recovery.offline import (
    VerifyResult,
    format_inspect,
    inspect_path,
    missing_experts,
    verify_path,
)
from moepec.recovery.offline_paths import group_roots
from moepec.recovery.striped import StripedViews
from moepec.recovery.views import usable_manifests
from moepec.store.committed import committed_manifests
from moepec.store.lineage import view_age
from moepec.store.storage import Storage


def _roots(path: str, storage_options: dict | None) -> list[tuple[str, Storage]]:
    st = Storage(path, storage_options)
    return [(g, Storage(f"{st.url}/{g}", storage_options)) for g in group_roots(st)]


@dataclass(frozen=True, slots=True)
class WholeCheckpoint:
    """The newest striped checkpoint all of whose parts are committed."""

    name: str
    """Its parts' names joined by ``+`` (as export and restore name it)."""
    step: int
    parts: list[str]
    """``group-<I>/<checkpoint>`` of each part, in part order."""
    bytes: int
    missing: str | None
    """The first expert no part's view holds a copy of (None: every expert has one)."""
    view_age: list[list[int]]
    """Per (layer, expert): steps since its newest copy in any part (-1: none)."""


def newest_whole(path: str, storage_options: dict | None = None) -> WholeCheckpoint | None:
    """The newest whole striped checkpoint over the group roots under ``path``, None when
    none is whole. Raises ManifestFormatError when a newer moepec wrote some part."""
    roots = _roots(path, storage_options)
    manifests = [usable_manifests(committed_manifests(st)) for _, st in roots]
    views = StripedViews([st for _, st in roots], manifests)
    if not views.bases:
        return None
    base = views.bases[0]
    whole = views.wholes[base.name]
    try:
        union = dataclasses.replace(whole.parts[0][1], view={
            k: src for _, m in whole.parts for k, src in m.view.items()})
        missing, ages = missing_experts(union), view_age(union)
    except ManifestError as exc:
        missing, ages = f"a readable view ({exc})", []
    return WholeCheckpoint(name=base.name, step=base.step,
                           parts=[f"{roots[r][0]}/{m.name}" for r, m in whole.parts],
                           bytes=sum(m.bytes for _, m in whole.parts), missing=missing,
                           view_age=ages)


def inspect_groups(path: str, storage_options: dict | None = None) -> dict[str, Any]:
    """What ``moepec inspect`` shows of the folder of group roots: each root's
    :func:`~moepec.recovery.offline.inspect_path`, and the newest whole checkpoint."""
    groups = {g: inspect_path(st.url, storage_options)
              for g, st in _roots(path, storage_options)}
    return {"path": path, "kind": "groups", "groups": groups,
            "whole": newest_whole(path, storage_options)}


def format_inspect_groups(info: dict[str, Any]) -> str:
    """The ``moepec inspect`` tables of the folder of group roots."""
    lines = [f"{info['path']}: {len(info['groups'])} replica group root(s) "
             f"({', '.join(info['groups'])})"]
    for g, sub in info["groups"].items():
        lines += ["", f"== {g}: one part of each striped checkpoint (age -1: that expert's "
                      f"copy is in another group's part) ==", format_inspect(sub)]
    whole: WholeCheckpoint | None = info["whole"]
    lines.append("")
    if whole is None:
        lines.append("no whole striped checkpoint (all parts committed) yet")
    else:
        lines.append(f"newest whole striped checkpoint: step {whole.step}, "
                     f"{whole.bytes / 1e6:.2f} MB in {len(whole.parts)} parts: "
                     + ", ".join(whole.parts))
        if whole.missing:
            lines.append(f"  it has no copy of {whole.missing}")
        lines.append("age of each expert's newest copy in any part, in steps (layer: e0 e1 ...):")
        lines += [f"  layer {i}: " + " ".join(map(str, row))
                  for i, row in enumerate(whole.view_age)]
    return "\n".join(lines)


def verify_groups(path: str, storage_options: dict | None = None,
                  progress: Callable[[int, int], None] | None = None) -> VerifyResult:
    """:func:`~moepec.recovery.offline.verify_path` of every group root (names prefixed
    ``group-<I>/``), plus one view: the newest whole striped checkpoint, which must exist
    (when any part is committed) and hold a copy of every expert."""
    res = VerifyResult()
    done = [0, 0]  # items checked and counted in the roots verified before
    for g, st in _roots(path, storage_options):
        def step(n: int, total: int) -> None:
            if progress:
                progress(done[0] + n, done[1] + total)

        sub = verify_path(st.url, storage_options, step)
        done[:] = [done[0] + sub.checked, done[1] + sub.checked]
        res.checked += sub.checked
        res.views += sub.views
        for name in ("bad", "uncommitted", "damaged_manifests", "broken_views"):
            getattr(res, name).extend(f"{g}/{x}" for x in getattr(sub, name))
    if res.views == 0:
        return res  # nothing committed (or only damaged manifests, listed)
    whole = newest_whole(path, storage_options)
    res.views += 1
    if whole is None:
        res.broken_views.append("no striped checkpoint has all its parts committed")
    elif whole.missing:
        res.broken_views.append(f"{whole.name} (the newest whole striped checkpoint): no "
                                f"copy of {whole.missing}")
    return res
