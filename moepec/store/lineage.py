"""Functions over committed manifests: the view after a commit, a checkpoint's lineage,
what retention keeps and deletes, how old each expert's newest copy is. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from moepec.errors import ManifestError
from moepec.keys import CHUNK_MARK, name_order, newest, parse_checkpoint_name, parse_key, seq_of
from moepec.store.manifest import Manifest


def updated_view(parent_view: Mapping[str, str] | None, name: str,
                 saved_keys: Iterable[str]) -> dict[str, str]:
    """The view after checkpoint ``name`` committed ``saved_keys`` on top of its parent.

    A tensor saved in chunks replaces every older copy of it, also one chunked in another
    layout (a run restored at another FSDP or EP degree): the view holds one layout of
    each tensor, whose chunks all come from one checkpoint."""
    view = dict(parent_view or {})
    saved = list(saved_keys)
    if any(CHUNK_MARK in k for k in saved) or any(CHUNK_MARK in k for k in view):
        bases = {k.partition(CHUNK_MARK)[0] for k in saved}
        view = {k: v for k, v in view.items() if k.partition(CHUNK_MARK)[0] not in bases}
    for key in saved:
        view[key] = name
    return view


def lineage(manifests: Mapping[str, Manifest], head: str) -> list[str]:
    """``head`` and its committed ancestors that still exist, newest first."""
    if head not in manifests:
        return []
    names = [head] + list(reversed(manifests[head].ancestors))
    return [n for n in names if n in manifests]


def retained(manifests: Mapping[str, Manifest], keep_last: int) -> set[str]:
    """Checkpoints to keep: the newest ``keep_last`` of the newest lineage, plus every
    checkpoint their views need. Never drops the only copy of a key of a kept view."""
    head = newest(manifests)
    if head is None:
        return set()
    heads = lineage(manifests, head)[:keep_last]
    keep = set(heads)
    for h in heads:
        try:
            keep.update(manifests[h].view.values())
        except ManifestError:  # which checkpoints it needs is unknown: delete nothing older
            return set(manifests)
    return keep


def to_delete(manifests: Mapping[str, Manifest], uncommitted: Iterable[str],
              keep_last: int, also: Iterable[str] = ()) -> list[str]:
    """Committed checkpoints no kept view needs (nor ``also`` names), and uncommitted
    leftovers older than the newest commit (a save is persisted one at a time, so these
    can never commit)."""
    keep = retained(manifests, keep_last) | set(also)
    head = newest(manifests)
    out = [n for n in manifests if n not in keep]
    if head is not None:
        out += [n for n in uncommitted if seq_of(n) < seq_of(head)]
    return sorted(out, key=name_order)


def view_age(manifest: Manifest) -> list[list[int]]:
    """Per (layer, expert): steps between the checkpoint and the newest copy of its weights
    (0 = saved in this checkpoint), from the view alone."""
    step = manifest.step
    ages = [[-1] * e[2] for e in manifest.meta.structure["experts"]]
    for weights_only in (True, False):  # pec_scope=optimizer: weights are not in the view
        for key, src in manifest.view.items():
            info = parse_key(key)
            parsed = parse_checkpoint_name(src)
            if info.is_expert and parsed and (info.part == "model" or not weights_only):
                ages[info.layer][info.expert] = step - parsed[1]
        if any(a >= 0 for row in ages for a in row):
            break
    return ages
