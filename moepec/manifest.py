"""Manifests: what a committed checkpoint holds, its lineage, its view, and retention.

Pure functions over manifest dicts (JSON as stored); no I/O.

A manifest records, besides the keys the checkpoint itself wrote, the *view*:
for every key of the full training state, the name of the checkpoint that holds
its newest copy along this checkpoint's lineage (``parent`` links). Recovery
from a checkpoint therefore needs only its own manifest to know where every key
lives, and never trusts a directory listing of data files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from moepec.state import parse_key
from moepec.storage import parse_checkpoint_name

FORMAT = "moepec/2"
"""2: items may be raw tensor bytes (moepec.dcp_raw; the manifest's ``serialization``
says which) and checksums XXH3 (``xxh3:``). 1: torch.save-framed items, XXH64."""
KNOWN_FORMATS = ("moepec/1", "moepec/2")


def seq_of(name: str) -> int:
    parsed = parse_checkpoint_name(name)
    assert parsed is not None, name
    return parsed[0]


def updated_view(parent_view: Mapping[str, str] | None, name: str,
                 saved_keys: Iterable[str]) -> dict[str, str]:
    """The view after checkpoint ``name`` committed ``saved_keys`` on top of its parent."""
    view = dict(parent_view or {})
    for key in saved_keys:
        view[key] = name
    return view


MAX_ANCESTORS = 512


def lineage(manifests: Mapping[str, Mapping[str, Any]], head: str) -> list[str]:
    """``head`` and its committed ancestors that still exist, newest first."""
    if head not in manifests:
        return []
    names = [head] + list(reversed(manifests[head].get("ancestors", [])))
    return [n for n in names if n in manifests]


def newest(names: Iterable[str]) -> str | None:
    names = list(names)
    return max(names, key=seq_of) if names else None


def retained(manifests: Mapping[str, Mapping[str, Any]], keep_last: int) -> set[str]:
    """Checkpoints to keep: the newest ``keep_last`` of the newest lineage, plus every
    checkpoint their views need. Never drops the only copy of a key of a kept view."""
    head = newest(manifests)
    if head is None:
        return set()
    heads = lineage(manifests, head)[:keep_last]
    keep = set(heads)
    for h in heads:
        keep.update(v for v in manifests[h]["view"].values())
    return keep


def to_delete(manifests: Mapping[str, Mapping[str, Any]], uncommitted: Iterable[str],
              keep_last: int) -> list[str]:
    """Committed checkpoints no kept view needs, and uncommitted leftovers older than the
    newest commit (a save is persisted one at a time, so these can never commit)."""
    keep = retained(manifests, keep_last)
    head = newest(manifests)
    out = [n for n in manifests if n not in keep]
    if head is not None:
        out += [n for n in uncommitted if seq_of(n) < seq_of(head)]
    return sorted(out, key=seq_of)


def view_age(manifest: Mapping[str, Any]) -> list[list[int]]:
    """Per (layer, expert): steps between the checkpoint and the newest copy of its weights
    (0 = saved in this checkpoint), from the view alone."""
    step = manifest["step"]
    n = [e[2] for e in manifest["structure"]["experts"]]
    ages = [[-1] * k for k in n]
    for key, src in manifest["view"].items():
        info = parse_key(key)
        if info.is_expert and info.part == "model":
            parsed = parse_checkpoint_name(src)
            if parsed:
                ages[info.layer][info.expert] = step - parsed[1]
    if all(a < 0 for row in ages for a in row):  # pec_scope=optimizer: use optimizer keys
        for key, src in manifest["view"].items():
            info = parse_key(key)
            if info.is_expert:
                parsed = parse_checkpoint_name(src)
                if parsed:
                    ages[info.layer][info.expert] = step - parsed[1]
    return ages
